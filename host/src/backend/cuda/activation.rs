//! Launchers for `relu_forward` / `relu_backward` (in place, 1-D grid-stride).

use super::{CudaBackend, check_len, grid_1d, inplace_ptr, launch};
use anyhow::Result;
use cudarc::driver::CudaSlice;

pub(super) fn relu_forward(be: &CudaBackend, y: &mut CudaSlice<f32>) -> Result<()> {
    let n = y.len();
    let p = inplace_ptr(be, y);
    launch!(be, "relu_forward", grid_1d(be, n), || format!("n={n}"); &p, &p, &n)
}

pub(super) fn relu_backward(
    be: &CudaBackend,
    y: &CudaSlice<f32>,
    d: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = d.len();
    check_len("relu_backward y", y, n)?;
    let p = inplace_ptr(be, d);
    launch!(be, "relu_backward", grid_1d(be, n), || format!("n={n}"); y, &p, &p, &n)
}
