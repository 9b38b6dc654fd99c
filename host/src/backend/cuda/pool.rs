//! Launchers for `maxpool_forward` (one thread per output; also saves each
//! window's argmax offset) and `maxpool_backward` (routing `dy` by the saved
//! offsets, optionally through the backward of a ReLU before the pool;
//! one thread per `stride × stride` block of inputs when
//! size ≤ 2·stride, else one per input): 256-thread blocks over the work
//! items of all planes, flattened (the kernel splits an item's index into
//! plane, row and column with the [`FastDiv`]s given here).

use super::{CudaBackend, FastDiv, check_len, launch};
use crate::backend::PoolGeom;
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// Mirror of `gpu_kernels::pool::PoolGeom` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PoolShape {
    h: u32,
    w: u32,
    size: u32,
    stride: u32,
    oh: u32,
    ow: u32,
    items: u32,
    plane: FastDiv,
    row: FastDiv,
}

unsafe impl DeviceRepr for PoolShape {}

/// The launch shape for `rows × cols` work items per plane. The kernels
/// index in 32 bits: every tensor and the item count stay below 2^31.
fn shape(g: &PoolGeom, rows: usize, cols: usize) -> Result<PoolShape> {
    let items = g.n * g.c * rows * cols;
    let limit = i32::MAX as usize;
    ensure!(
        g.x_len() <= limit && items <= limit,
        "maxpool: {g:?} is too large for 32-bit indexing (2^31 elements)"
    );
    Ok(PoolShape {
        h: g.h as u32,
        w: g.w as u32,
        size: g.size as u32,
        stride: g.stride as u32,
        oh: g.out_h() as u32,
        ow: g.out_w() as u32,
        items: items as u32,
        plane: FastDiv::new((rows * cols) as u32),
        row: FastDiv::new(cols as u32),
    })
}

/// One thread per item, 256 a block (the kernels also stride, so any grid
/// works).
fn items_grid(s: &PoolShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((s.items as usize).div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
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
    let s = shape(g, g.out_h(), g.out_w())?;
    launch!(be, "maxpool_forward", items_grid(&s), || format!("{g:?}");
        x, y, arg, &s)
}

/// `dx` from `dy`; with `relu_z` = the pool's output y (of a ReLU's output
/// x), also that ReLU's backward (`dx = 0` where x ≤ 0) in the same pass.
pub(super) fn maxpool_backward(
    be: &CudaBackend,
    g: &PoolGeom,
    arg: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    relu_z: Option<&CudaSlice<f32>>,
    dx: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("maxpool_backward arg", arg, g.y_len())?;
    check_len("maxpool_backward dy", dy, g.y_len())?;
    check_len("maxpool_backward dx", dx, g.x_len())?;
    if let Some(z) = relu_z {
        check_len("maxpool_backward y", z, g.y_len())?;
    }
    // Items per plane: the kernel picks its mapping by the same test.
    let s = if g.size <= 2 * g.stride {
        shape(g, g.h.div_ceil(g.stride), g.w.div_ceil(g.stride))?
    } else {
        shape(g, g.h, g.w)?
    };
    let (cfg, what) = (items_grid(&s), || format!("{g:?}"));
    match relu_z {
        Some(z) => launch!(be, "maxpool_backward", cfg, what; arg, dy, z, dx, &s),
        None => launch!(be, "maxpool_backward", cfg, what; arg, dy, &0u64, dx, &s),
    }
}
