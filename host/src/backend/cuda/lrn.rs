//! Launchers for `lrn_forward` / `lrn_backward` (one thread per (n, h, w)
//! pixel and run of `CHUNK` channels; 256-thread blocks, 1-D grid-stride)
//! and the fused `lrn_pool_forward` / `lrn_pool_backward` (a block per tile
//! of pooled rows, run of channels and image; the tile sizes are chosen
//! here, see [`Tiles`]).

use super::{CudaBackend, check_len, grid_1d, launch};
use crate::backend::{LrnParams, PoolGeom};
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

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
    run: u32,
    tile: u32,
    alpha: f32,
    beta: f32,
    k: f32,
}

unsafe impl DeviceRepr for LrnPoolShape {}

/// The fused kernels' block and work split (`gpu_kernels::lrn`'s
/// `FUSED_THREADS`, `FUSED_STEP`, `FWD_PIX`, `FWD_ITEMS`): at most 256
/// threads (a block gets the fewest warps its tile needs, see
/// [`fwd_threads`] and [`bwd_threads`]); channels in steps of 4; the
/// forward's tile rows hold at most 2 pixels and its steps at most 2
/// pooled outputs per thread, the backward's at most one pixel and one
/// 2×2 gather block per thread.
const THREADS: usize = 256;
const STEP: usize = 4;
const FWD_PIX: usize = 2;
const FWD_ITEMS: usize = 2;

/// Channels per block: runs of about 32 in the forward (each run re-reads
/// the LRN window's `size − 1` edge channels) and 64 in the backward (each
/// run recomputes 2·⌊size/2⌋ of them, +12% at 32), split evenly.
const RUN_FWD: usize = 32;
const RUN_BWD: usize = 64;

/// Pooled rows per block of the two fused kernels (the last block of a
/// plane may have fewer), balanced over the blocks of a plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiles {
    forward: usize,
    backward: usize,
}

/// `t` pooled rows per tile, evened out: the same number of tiles with as
/// equal a share each as possible.
fn balanced(oh: usize, t: usize) -> usize {
    oh.div_ceil(oh.div_ceil(t))
}

/// Input rows the backward block of the last tile owns (down to the
/// bottom row), with tiles of `t` pooled rows.
fn last_rows(g: &PoolGeom, t: usize) -> usize {
    g.h - 2 * t * (g.out_h().div_ceil(t) - 1)
}

/// The largest tiles that fit the kernels' per-thread limits, or `None`
/// (the planes are too wide: over about 64 columns).
fn tiles(g: &PoolGeom) -> Option<Tiles> {
    let (oh, ow, w) = (g.out_h(), g.out_w(), g.w);
    // Forward: tile rows 2t + pool − 2 of w pixels; STEP·t·ow outputs.
    let fwd_fits = |t: usize| {
        (2 * t + g.size - 2) * w <= FWD_PIX * THREADS && STEP * t * ow <= FWD_ITEMS * THREADS
    };
    // Backward: 2t rows (the last tile to the bottom) of w pixels, in
    // 2×2 blocks, STEP channels of them.
    let bwd_fits = |t: usize| {
        let rows = (2 * t).max(last_rows(g, t));
        rows * w <= THREADS && STEP * rows.div_ceil(2) * w.div_ceil(2) <= THREADS
    };
    let pick =
        |fits: &dyn Fn(usize) -> bool| (1..=oh).rev().map(|t| balanced(oh, t)).find(|&t| fits(t));
    Some(Tiles {
        forward: pick(&fwd_fits)?,
        backward: pick(&bwd_fits)?,
    })
}

/// Threads of a forward block with tiles of `t` pooled rows: enough for
/// its input rows at `FWD_PIX` pixels and its step's outputs at
/// `FWD_ITEMS` per thread, in whole warps.
fn fwd_threads(g: &PoolGeom, t: usize) -> usize {
    let pix = (2 * t + g.size - 2) * g.w;
    let outs = STEP * t * g.out_w();
    pix.div_ceil(FWD_PIX)
        .max(outs.div_ceil(FWD_ITEMS))
        .next_multiple_of(32)
}

/// Threads of a backward block with tiles of `t` pooled rows: one per
/// pixel of the largest tile and per 2×2 gather block of a step, in whole
/// warps (norm1's 4 rows of 55: 224, where 256 left 14% idle).
fn bwd_threads(g: &PoolGeom, t: usize) -> usize {
    let rows = (2 * t).max(last_rows(g, t));
    (rows * g.w)
        .max(STEP * rows.div_ceil(2) * g.w.div_ceil(2))
        .next_multiple_of(32)
}

/// Whether the fused kernels take LRN `p` then pool `g`: LRN windows 3 and
/// 5, pool windows 2 and 3 at stride 2 (the kernels' register layouts are
/// built for those), one shape, planes narrow enough for their tiles, at
/// most 65,535 images (the grid's z) and element counts within 32 bits.
pub(super) fn fusable(p: &LrnParams, g: &PoolGeom) -> bool {
    (p.n, p.c, p.h, p.w) == (g.n, g.c, g.h, g.w)
        && matches!(p.size, 3 | 5)
        && matches!(g.size, 2 | 3)
        && g.stride == 2
        && g.h >= g.size
        && g.w >= g.size
        && (1..=65_535).contains(&p.n)
        && p.c > 0
        && p.len() < u32::MAX as usize
        && tiles(g).is_some()
}

fn shape(p: &LrnParams, g: &PoolGeom, tile: usize, run: usize) -> LrnPoolShape {
    let runs = p.c.div_ceil(run);
    LrnPoolShape {
        n: p.n as u32,
        c: p.c as u32,
        h: p.h as u32,
        w: p.w as u32,
        oh: g.out_h() as u32,
        ow: g.out_w() as u32,
        size: p.size as u32,
        pool: g.size as u32,
        stride: g.stride as u32,
        run: p.c.div_ceil(runs) as u32,
        tile: tile as u32,
        alpha: p.alpha,
        beta: p.beta,
        k: p.k,
    }
}

/// Blocks (tile, run, image) of `threads`; `floats` of shared memory.
fn fused_cfg(s: &LrnPoolShape, threads: usize, floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.oh.div_ceil(s.tile), s.c.div_ceil(s.run), s.n),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: (floats * 4) as u32,
    }
}

pub(super) fn lrn_pool_forward(
    be: &CudaBackend,
    p: &LrnParams,
    g: &PoolGeom,
    x: &CudaSlice<f32>,
    z: &mut CudaSlice<f32>,
    arg: &mut CudaSlice<f32>,
) -> Result<()> {
    ensure!(
        fusable(p, g),
        "lrn_pool: no fused kernel for {p:?} then {g:?}"
    );
    check_len("lrn_pool_forward x", x, p.len())?;
    check_len("lrn_pool_forward z", z, g.y_len())?;
    check_len("lrn_pool_forward arg", arg, g.y_len())?;
    let t = tiles(g).expect("fusable").forward;
    let s = shape(p, g, t, RUN_FWD);
    // Two buffers of STEP channel slots: the tile's input rows, each as
    // its even columns then its odd ones.
    let floats = 2 * STEP * (2 * t + g.size - 2) * 2 * g.w.div_ceil(2);
    launch!(be, "lrn_pool_forward", fused_cfg(&s, fwd_threads(g, t), floats), || format!("{s:?}");
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
    ensure!(
        fusable(p, g),
        "lrn_pool: no fused kernel for {p:?} then {g:?}"
    );
    check_len("lrn_pool_backward x", x, p.len())?;
    check_len("lrn_pool_backward arg", arg, g.y_len())?;
    check_len("lrn_pool_backward dz", dz, g.y_len())?;
    check_len("lrn_pool_backward dx", dx, p.len())?;
    let t = tiles(g).expect("fusable").backward;
    let s = shape(p, g, t, RUN_BWD);
    // Two buffers of STEP channel slots of the largest tile's pixels.
    let floats = 2 * STEP * (2 * t).max(last_rows(g, t)) * g.w;
    let relu = relu as u32;
    launch!(be, "lrn_pool_backward", fused_cfg(&s, bwd_threads(g, t), floats), || format!("{s:?}");
        x, arg, dz, dx, &s, &relu)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(h: usize, w: usize, size: usize) -> PoolGeom {
        PoolGeom {
            n: 1,
            c: 1,
            h,
            w,
            size,
            stride: 2,
        }
    }

    /// AlexNet's tiles, and the kernels' limits on every shape up to 70
    /// columns: the forward's tile rows and outputs, the backward's pixels
    /// and gather blocks (the last tile included) fit the block, and the
    /// tiles cover the pooled rows.
    #[test]
    fn tiles_fit_the_kernels() {
        assert_eq!(
            tiles(&pool(55, 55, 3)),
            Some(Tiles {
                forward: 4,
                backward: 2
            })
        );
        assert_eq!(
            (
                fwd_threads(&pool(55, 55, 3), 4),
                bwd_threads(&pool(55, 55, 3), 2)
            ),
            (256, 224)
        );
        assert_eq!(
            (
                fwd_threads(&pool(27, 27, 3), 7),
                bwd_threads(&pool(27, 27, 3), 4)
            ),
            (224, 224)
        );
        assert_eq!(
            tiles(&pool(27, 27, 3)),
            Some(Tiles {
                forward: 7,
                backward: 4
            })
        );
        for size in [2, 3] {
            for h in size..70 {
                for w in size..70 {
                    let g = pool(h, w, size);
                    let Some(t) = tiles(&g) else {
                        assert!(w > 64, "{g:?} not fused");
                        continue;
                    };
                    let oh = g.out_h();
                    let (f, b) = (t.forward, t.backward);
                    assert!(f >= 1 && b >= 1 && f <= oh && b <= oh);
                    assert!((2 * f + size - 2) * w <= FWD_PIX * THREADS);
                    assert!(STEP * f * g.out_w() <= FWD_ITEMS * THREADS);
                    let rows = (2 * b).max(last_rows(&g, b));
                    assert!(rows * w <= THREADS);
                    assert!(STEP * rows.div_ceil(2) * w.div_ceil(2) <= THREADS);
                    // The blocks: whole warps, within the limit, enough
                    // for every pixel, output and gather block.
                    let (tf, tb) = (fwd_threads(&g, f), bwd_threads(&g, b));
                    assert!(tf % 32 == 0 && tf <= THREADS && tb % 32 == 0 && tb <= THREADS);
                    assert!((2 * f + size - 2) * w <= FWD_PIX * tf);
                    assert!(STEP * f * g.out_w() <= FWD_ITEMS * tf);
                    assert!(rows * w <= tb && STEP * rows.div_ceil(2) * w.div_ceil(2) <= tb);
                    // The last tile starts inside the pooled plane and owns
                    // the rows below it.
                    for t in [f, b] {
                        let last = (oh.div_ceil(t) - 1) * t;
                        assert!(last < oh);
                        assert!(last_rows(&g, t) >= 1);
                    }
                }
            }
        }
    }
}
