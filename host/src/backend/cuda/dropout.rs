//! Launchers for `dropout_forward` / `dropout_backward` (in place; one thread
//! per 4 elements, 1-D grid-stride). The step reaches the kernel through the
//! backend's per-step values (`graph.rs`), so a captured graph draws new
//! masks each step.

use super::graph::STEP_OFFSET;
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
    let step = be.step_values("the dropout step", |a| a.dropout_step = p.step)? + STEP_OFFSET;
    launch!(be, "dropout_forward", grid_1d(be, n.div_ceil(4)), || format!("n={n} p={}", p.p);
        &ptr, &n, &p.p, &p.seed, &step)
}

pub(super) fn dropout_backward(
    be: &CudaBackend,
    p: &DropoutParams,
    d: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = d.len();
    let ptr = inplace_ptr(be, d);
    let step = be.step_values("the dropout step", |a| a.dropout_step = p.step)? + STEP_OFFSET;
    launch!(be, "dropout_backward", grid_1d(be, n.div_ceil(4)), || format!("n={n} p={}", p.p);
        &ptr, &n, &p.p, &p.seed, &step)
}
