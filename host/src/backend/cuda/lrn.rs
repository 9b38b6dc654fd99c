//! Launchers for `lrn_forward` / `lrn_backward` (one thread per (n, h, w)
//! pixel and run of `CHUNK` channels) and the fused `lrn_pool_forward`
//! (per pooled pixel and run) / `lrn_pool_backward` (per input pixel and
//! run): 256-thread blocks, 1-D grid-stride.

use super::{CudaBackend, check_len, grid_1d, launch};
use crate::backend::{LrnParams, PoolGeom};
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, DeviceRepr};

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

/// Mirror of `gpu_kernels::lrn::LrnPoolGeom` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct LrnPoolShape {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    oh: u32,
    ow: u32,
    size: u32,
    pool: u32,
    stride: u32,
    chunk: u32,
    alpha: f32,
    beta: f32,
    k: f32,
}

unsafe impl DeviceRepr for LrnPoolShape {}

/// Whether the fused kernels take LRN `p` then pool `g`: LRN windows 3 and
/// 5, pool windows 2 and 3 at stride 2 (the kernels' register layouts are
/// built for those), one shape, and element counts within 32 bits.
pub(super) fn fusable(p: &LrnParams, g: &PoolGeom) -> bool {
    (p.n, p.c, p.h, p.w) == (g.n, g.c, g.h, g.w)
        && matches!(p.size, 3 | 5)
        && matches!(g.size, 2 | 3)
        && g.stride == 2
        && g.h >= g.size
        && g.w >= g.size
        && p.len() < u32::MAX as usize
}

fn shape(p: &LrnParams, g: &PoolGeom) -> Result<LrnPoolShape> {
    ensure!(
        fusable(p, g),
        "lrn_pool: no fused kernel for {p:?} then {g:?}"
    );
    Ok(LrnPoolShape {
        n: p.n as u32,
        c: p.c as u32,
        h: p.h as u32,
        w: p.w as u32,
        oh: g.out_h() as u32,
        ow: g.out_w() as u32,
        size: p.size as u32,
        pool: g.size as u32,
        stride: g.stride as u32,
        chunk: CHUNK,
        alpha: p.alpha,
        beta: p.beta,
        k: p.k,
    })
}

pub(super) fn lrn_pool_forward(
    be: &CudaBackend,
    p: &LrnParams,
    g: &PoolGeom,
    x: &CudaSlice<f32>,
    z: &mut CudaSlice<f32>,
    arg: &mut CudaSlice<f32>,
) -> Result<()> {
    let s = shape(p, g)?;
    check_len("lrn_pool_forward x", x, p.len())?;
    check_len("lrn_pool_forward z", z, g.y_len())?;
    check_len("lrn_pool_forward arg", arg, g.y_len())?;
    let items = g.y_len() / g.c.max(1) * p.c.div_ceil(CHUNK as usize);
    launch!(be, "lrn_pool_forward", grid_1d(be, items), || format!("{s:?}");
        x, z, arg, &s)
}

#[allow(clippy::too_many_arguments)] // the kernel's tensors, plus the ReLU flag
pub(super) fn lrn_pool_backward(
    be: &CudaBackend,
    p: &LrnParams,
    g: &PoolGeom,
    x: &CudaSlice<f32>,
    arg: &CudaSlice<f32>,
    dz: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    relu: bool,
) -> Result<()> {
    let s = shape(p, g)?;
    check_len("lrn_pool_backward x", x, p.len())?;
    check_len("lrn_pool_backward arg", arg, g.y_len())?;
    check_len("lrn_pool_backward dz", dz, g.y_len())?;
    check_len("lrn_pool_backward dx", dx, p.len())?;
    let items = p.n * p.h * p.w * p.c.div_ceil(CHUNK as usize);
    let relu = relu as u32;
    launch!(be, "lrn_pool_backward", grid_1d(be, items), || format!("{s:?}");
        x, arg, dz, dx, &s, &relu)
}
