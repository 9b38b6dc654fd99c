//! Launchers for `maxpool_forward` (one thread per output; also saves each
//! window's argmax offset) and `maxpool_backward` (one thread per input,
//! routing by the saved offsets), 1-D grid-stride.

use super::{CudaBackend, check_len, grid_1d, launch};
use crate::backend::PoolGeom;
use anyhow::Result;
use cudarc::driver::CudaSlice;

fn dims(g: &PoolGeom) -> [u32; 7] {
    [
        (g.n * g.c) as u32,
        g.h as u32,
        g.w as u32,
        g.size as u32,
        g.stride as u32,
        g.out_h() as u32,
        g.out_w() as u32,
    ]
}

pub(super) fn maxpool_forward(
    be: &CudaBackend,
    g: &PoolGeom,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    arg: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("maxpool_forward x", x, g.x_len())?;
    check_len("maxpool_forward y", y, g.y_len())?;
    check_len("maxpool_forward arg", arg, g.y_len())?;
    let [planes, h, w, size, stride, oh, ow] = dims(g);
    launch!(be, "maxpool_forward", grid_1d(be, g.y_len()), || format!("{g:?}");
        x, y, arg, &planes, &h, &w, &size, &stride, &oh, &ow)
}

pub(super) fn maxpool_backward(
    be: &CudaBackend,
    g: &PoolGeom,
    arg: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("maxpool_backward arg", arg, g.y_len())?;
    check_len("maxpool_backward dy", dy, g.y_len())?;
    check_len("maxpool_backward dx", dx, g.x_len())?;
    let [planes, h, w, size, stride, oh, ow] = dims(g);
    launch!(be, "maxpool_backward", grid_1d(be, g.x_len()), || format!("{g:?}");
        arg, dy, dx, &planes, &h, &w, &size, &stride, &oh, &ow)
}
