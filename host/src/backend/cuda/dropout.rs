//! Launchers for `dropout_forward` / `dropout_backward` (in place; one thread
//! per 4 elements, 1-D grid-stride).

use super::{CudaBackend, grid_1d, inplace_ptr, launch};
use crate::backend::DropoutParams;
use anyhow::Result;
use cudarc::driver::CudaSlice;

pub(super) fn dropout_forward(
    be: &CudaBackend,
    p: &DropoutParams,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = y.len();
    let ptr = inplace_ptr(be, y);
    launch!(be, "dropout_forward", grid_1d(be, n.div_ceil(4)), || format!("n={n} p={}", p.p);
        &ptr, &n, &p.p, &p.seed, &p.step)
}

pub(super) fn dropout_backward(
    be: &CudaBackend,
    p: &DropoutParams,
    d: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = d.len();
    let ptr = inplace_ptr(be, d);
    launch!(be, "dropout_backward", grid_1d(be, n.div_ceil(4)), || format!("n={n} p={}", p.p);
        &ptr, &n, &p.p, &p.seed, &p.step)
}
