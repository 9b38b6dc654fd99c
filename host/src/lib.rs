//! AlexNet training in pure Rust on NVIDIA GPUs.
//!
//! `arena` plans a model's device memory, `backend` holds the ops (CPU
//! reference and CUDA), `config` the validated JSON configs, `data` the
//! datasets and loaders, `checkpoint` safetensors I/O, `report` metrics and
//! plots, `multi_gpu` data-parallel training, `step_graph` the single-GPU
//! training step replayed as a CUDA graph.

pub mod arena;
pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod model;
pub mod multi_gpu;
pub mod report;
pub mod step_graph;
pub mod train;

/// The PTX module built from `gpu-kernels` by `build.rs`.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
/// The Hopper module (`sm_90a`): every kernel of [`PTX`] plus the `wgmma`
/// products, loaded on GPUs of compute capability 9.0.
pub const PTX_SM90A: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_sm90a.ptx"));
