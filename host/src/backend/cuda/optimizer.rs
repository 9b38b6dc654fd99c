//! Launcher for `sgd_update` (in place over one tensor, 1-D grid-stride).

use super::{CudaBackend, check_len, grid_1d, launch};
use crate::backend::{SgdParams, SgdRule};
use anyhow::Result;
use cudarc::driver::CudaSlice;

pub(super) fn sgd_update(
    be: &CudaBackend,
    p: &SgdParams,
    w: &mut CudaSlice<f32>,
    g: &CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = w.len();
    check_len("sgd_update grad", g, n)?;
    check_len("sgd_update momentum", v, n)?;
    let rule: u32 = match p.rule {
        SgdRule::Pytorch => 0,
        SgdRule::Paper => 1,
    };
    launch!(be, "sgd_update", grid_1d(be, n), || format!("n={n}");
        w, g, v, &n, &p.lr, &p.momentum, &p.weight_decay, &rule)
}
