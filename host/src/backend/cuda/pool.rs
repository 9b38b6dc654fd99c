//! Launchers for `maxpool_forward` (one thread per output; also saves each
//! window's argmax offset) and `maxpool_backward` (routing `dy` by the saved
//! offsets; one thread per `stride × stride` block of inputs when
//! size ≤ 2·stride, else one per input): 256-thread blocks over a plane,
//! planes along grid y.

use super::{CudaBackend, check_len, launch};
use crate::backend::PoolGeom;
use anyhow::Result;
use cudarc::driver::{CudaSlice, LaunchConfig};

/// 256-thread blocks over a plane of `len` elements, grid y over the planes
/// (the kernels stride over any beyond the grid's limit of 65,535).
fn plane_grid(len: usize, planes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (len.div_ceil(256) as u32, planes.clamp(1, 65_535) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

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
    launch!(be, "maxpool_forward", plane_grid(g.out_w() * g.out_h(), g.n * g.c), || format!("{g:?}");
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
    // Threads per plane: the kernel picks its mapping by the same test.
    let per_plane = if g.size <= 2 * g.stride {
        g.h.div_ceil(g.stride) * g.w.div_ceil(g.stride)
    } else {
        g.h * g.w
    };
    launch!(be, "maxpool_backward", plane_grid(per_plane, g.n * g.c), || format!("{g:?}");
        arg, dy, dx, &planes, &h, &w, &size, &stride, &oh, &ow)
}
