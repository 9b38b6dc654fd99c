//! AlexNet's GPU kernels, written in Rust and compiled to one PTX module by the
//! top-level `build.rs` (rustc's NVPTX backend; no nvcc, no NVRTC).
//!
//! One file per kernel family; every `extern "ptx-kernel"` function is named
//! `<op>_<direction>` and documents what it computes, its data layout and its
//! grid/block mapping. The host launcher, CPU reference, test and benchmark use
//! the same name. Tensors are fp32, NCHW, contiguous, except the NHWC (fp32 or
//! bf16) copies the channels-last convolutions make (`layout.rs`, `conv.rs`).
#![no_std]
#![feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics)]
#![feature(
    gpu_launch_sized_workgroup_mem,
    gpu_intrinsics,
    core_intrinsics,
    core_float_math
)]
#![allow(
    internal_features,
    clippy::missing_safety_doc,
    clippy::too_many_arguments
)]

pub mod device;

pub mod activation;
pub mod conv;
pub mod dropout;
pub mod gemm;
pub mod layout;
pub mod loss;
pub mod lrn;
pub mod optimizer;
pub mod pool;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    unsafe { core::arch::nvptx::trap() }
}
