//! Launchers for `lrn_forward` / `lrn_backward`: one thread per (n, h, w)
//! pixel and run of `CHUNK` channels, 256-thread blocks, 1-D grid-stride.

use super::{CudaBackend, check_len, grid_1d, launch};
use crate::backend::LrnParams;
use anyhow::Result;
use cudarc::driver::CudaSlice;

/// Channels per thread: AlexNet's 27×27 planes at batch 128 give only 93k
/// pixels, too few threads to keep the memory system busy if each walked
/// all 256 channels; runs of 32 cost 4 extra window reads per 32.
const CHUNK: u32 = 32;

/// (n, c, hw, work items) of the launch.
fn dims(p: &LrnParams) -> (u32, u32, u32, usize) {
    let hw = p.h * p.w;
    let runs = p.c.div_ceil(CHUNK as usize);
    (p.n as u32, p.c as u32, hw as u32, p.n * hw * runs)
}

pub(super) fn lrn_forward(
    be: &CudaBackend,
    p: &LrnParams,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    scale: &mut CudaSlice<f32>,
) -> Result<()> {
    let len = p.len();
    check_len("lrn_forward x", x, len)?;
    check_len("lrn_forward y", y, len)?;
    check_len("lrn_forward scale", scale, len)?;
    let (n, c, hw, pixels) = dims(p);
    let size = p.size as u32;
    launch!(be, "lrn_forward", grid_1d(be, pixels), || format!("{p:?}");
        x, y, scale, &n, &c, &hw, &size, &p.alpha, &p.beta, &p.k, &CHUNK)
}

#[allow(clippy::too_many_arguments)] // the kernel's tensors, plus the ReLU flag
pub(super) fn lrn_backward(
    be: &CudaBackend,
    p: &LrnParams,
    x: &CudaSlice<f32>,
    y: &CudaSlice<f32>,
    scale: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    relu: bool,
) -> Result<()> {
    let len = p.len();
    for (name, b) in [("x", x), ("y", y), ("scale", scale), ("dy", dy)] {
        check_len(&format!("lrn_backward {name}"), b, len)?;
    }
    check_len("lrn_backward dx", dx, len)?;
    let (n, c, hw, pixels) = dims(p);
    let (size, relu) = (p.size as u32, relu as u32);
    launch!(be, "lrn_backward", grid_1d(be, pixels), || format!("{p:?}");
        x, y, scale, dy, dx, &n, &c, &hw, &size, &p.alpha, &p.beta, &relu, &CHUNK)
}
