//! Launchers for the fully connected kernels: `fc_forward`, `fc_backward_data`,
//! `fc_backward_filter` (64- or 128-row × 64 output tiles of 256 threads;
//! grid x over the GEMM's N and y over its M; see
//! `gpu-kernels/src/gemm.rs`), the first two split over K into grid z when
//! their M = batch leaves the GPU short of blocks (partials summed by
//! `splitk_reduce`, in a fixed order), and `fc_backward_bias` (one thread
//! per output). In TF32/bf16, products whose inputs and outputs are
//! multiples of 4 run on the vector engine (`*_vec` kernels: blocks of 128
//! threads, 16-byte copies, `ldmatrix` where k is contiguous; its tile
//! shapes are [`VecTile`]). In bf16, where they are multiples of 8, the
//! operands are first rounded to bf16 copies in scratch (`convert_bf16`)
//! and the `*_vec_h16` kernels read those: half the bytes, no conversion in
//! the inner loop. In TF32 the `*_vec_tf32r` kernels read TF32-rounded
//! copies (`convert_tf32`) the same way. Either way w's copy is kept by the
//! layer and rewritten by the SGD update, so a training step rounds only
//! the activations and gradients.

use super::layout::{as_bf16, as_tf32, convert_bf16, convert_tf32};
use super::{CudaBackend, Scratch, check_len, gemm_names, grid_1d, launch};
use crate::backend::FcGeom;
use anyhow::Result;
use cudarc::driver::{CudaSlice, LaunchConfig};

/// Tile grid of the GEMM engine for an `m × n` result, `z` problems, and
/// whether it uses the 128-row (`_wide`) kernels.
pub(super) fn tiles(be: &CudaBackend, m: usize, n: usize, z: usize) -> (LaunchConfig, bool) {
    let wide = be.wide_tiles(m, Some(n.div_ceil(64) * z));
    (grid(m, n, z, wide), wide)
}

/// Tile grid for an `m × n` result, `z` problems, at the given tile height.
pub(super) fn grid(m: usize, n: usize, z: usize, wide: bool) -> LaunchConfig {
    let rows = if wide { 128 } else { 64 };
    LaunchConfig {
        grid_dim: (n.div_ceil(64) as u32, m.div_ceil(rows) as u32, z as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: gemm_shared_bytes(wide),
    }
}

/// Must equal `gpu_kernels::gemm::shared_bytes(wide)`: 4 stages of
/// 16·(64+4)·2 floats, or 3 stages of 16·(128+4 + 64+4) floats.
fn gemm_shared_bytes(wide: bool) -> u32 {
    if wide {
        3 * 16 * (128 + 4 + 64 + 4) * 4
    } else {
        4 * 16 * (64 + 4) * 2 * 4
    }
}

/// Tile shape of a vector-engine kernel (`gemm::VNARROW`, `VWIDE`, `VBIG`):
/// 64×64, 128×64 or 128×128 (rows × columns of the product).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VecTile {
    Narrow,
    Wide,
    Big,
    /// 64×128 (`gemm::VLONG`).
    Long,
    /// 128×48 (`gemm::VSLIM`: the transposed data gradient of 48-channel
    /// groups).
    Slim,
}

impl VecTile {
    /// The 64-row or 128×64 shape, as the scalar engine's `wide` choice.
    pub(super) fn of(wide: bool) -> Self {
        if wide { VecTile::Wide } else { VecTile::Narrow }
    }
    /// The shape of vector kernel `name`, from its suffix.
    pub(super) fn of_name(name: &str) -> Self {
        if name.ends_with("_slim") {
            VecTile::Slim
        } else if name.ends_with("_big") {
            VecTile::Big
        } else if name.ends_with("_long") {
            VecTile::Long
        } else if name.ends_with("_wide") {
            VecTile::Wide
        } else {
            VecTile::Narrow
        }
    }
    /// The kernel-name suffix of the shape.
    pub(super) fn suffix(self) -> &'static str {
        match self {
            VecTile::Narrow => "",
            VecTile::Wide => "_wide",
            VecTile::Big => "_big",
            VecTile::Long => "_long",
            VecTile::Slim => "_slim",
        }
    }
}

/// `cfg` (a grid of 64-column tiles of 64 or 128 rows; for `_slim`
/// kernels, already their own grid) for vector-engine kernel `name`, its
/// tile shape from the name's suffix: 128-column tiles halve grid x; blocks
/// of `gemm::VTHREADS` (128) threads with
/// `gemm::vshared_bytes` of shared memory (4 stages of 64 + 64 rows, or 3
/// of 128 + 64, 64 + 128 or 128 + 128, × 80 bytes), or for the warpgroup
/// engine (`_wg` kernels) `gemm::wshared_bytes` (4 stages of the rows × 64
/// bytes; `_wg_big`: [`WG_BIG_SHARED`], [`WG_BIG_THREADS`] threads).
pub(super) fn vec_cfg(cfg: LaunchConfig, name: &str) -> LaunchConfig {
    let (gx, gy, gz) = cfg.grid_dim;
    let tile = VecTile::of_name(name);
    let (stages, rows, gx) = match tile {
        VecTile::Narrow => (4, 128, gx),
        VecTile::Wide => (3, 192, gx),
        VecTile::Big => (3, 256, gx.div_ceil(2)),
        VecTile::Long => (3, 192, gx.div_ceil(2)),
        VecTile::Slim => (3, 192, gx),
    };
    let (threads, shared_mem_bytes) = match (is_wg_kernel(name), tile) {
        (true, _) if name.contains("_tma") => (WG_TMA_THREADS, tma_shared(TMA_STAGES)),
        (true, VecTile::Big) => (WG_BIG_THREADS, WG_BIG_SHARED),
        (true, _) => (128, 4 * rows * 64),
        (false, _) => (128, stages * rows * 80),
    };
    LaunchConfig {
        grid_dim: (gx, gy, gz),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    }
}

/// Whether `name` runs on the warpgroup engine (`gemm_tile_wg`, Hopper's
/// `wgmma`; only in the `sm_90a` module).
pub(super) fn is_wg_kernel(name: &str) -> bool {
    name.contains("_wg")
}

/// The vector engines' largest dynamic shared memory (4 stages of 256 rows
/// of 64 bytes for the warpgroup engine's 128×128 tiles), over the 48 KiB a
/// kernel gets without opting in.
pub(super) const VEC_SHARED_MAX: i32 = 4 * 256 * 64;
/// Dynamic shared memory of the 128×128 warpgroup kernels fed by `cp.async`
/// (`_wg_big`): `gemm::wshared_bytes_sw`, 4 stages of 256 rows × 128 bytes
/// of k and 1 KiB to align them to the swizzle's 1024-byte atoms.
pub(super) const WG_BIG_SHARED: u32 = 4 * 256 * 128 + 1024;
/// Threads of a 128×128 warpgroup kernel's block (`gemm::WS_THREADS`): two
/// warpgroups, one per 64 rows.
pub(super) const WG_BIG_THREADS: u32 = 256;
/// Threads of a TMA-fed kernel's block (`_wg_tma_big`, `gemm::TMA_THREADS`):
/// the two warpgroups and a producer warp.
pub(super) const WG_TMA_THREADS: u32 = WG_BIG_THREADS + 32;
/// The TMA-fed kernels' stages unless `ALEXNET_TMA_STAGES` says otherwise
/// (5: conv3–5's forwards and data gradients 2–6% faster than with 4 on
/// the H100, 7 no better), and the most they take (`gemm::TMA_STAGES_MAX`).
pub(super) const TMA_STAGES: u32 = 5;
pub(super) const TMA_STAGES_MAX: u32 = 7;
/// The bit of a TMA kernel's `ring` argument that keeps its stores straight
/// from the accumulators (`gemm::TMA_DIRECT_STORE`).
pub(super) const TMA_DIRECT_STORE: u32 = 1 << 8;
/// Dynamic shared memory of a TMA-fed kernel with `stages` stages
/// (`gemm::tma_shared_bytes`): 32 KiB each, 1 KiB of alignment, a "full"
/// and an "empty" barrier per stage.
pub(super) const fn tma_shared(stages: u32) -> u32 {
    stages * 256 * 128 + 1024 + 16 * stages
}

/// Whether kernel `name` runs on the vector or warpgroup engines (and so
/// needs more than 48 KiB of dynamic shared memory allowed: [`VEC_SHARED_MAX`],
/// or [`tma_shared`] of [`TMA_STAGES_MAX`] for the TMA-fed kernels).
pub(super) fn is_vec_kernel(name: &str) -> bool {
    name.contains("_nhwc")
        || name.contains("_vec_")
        || name.contains("_rows")
        || name.contains("_tma")
}

/// The operand copies an fc product reads: none (fp32 operands, converted
/// as fragments are read where the precision needs it), bf16 copies (the
/// `*_vec_h16` kernels) or TF32-rounded ones (`*_vec_tf32r`, which feed
/// them to the tensor cores as loaded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copies {
    None,
    Bf16,
    Tf32,
}

impl Copies {
    /// Floats of the copy of `len` values.
    fn floats(self, len: usize) -> usize {
        match self {
            Copies::None => 0,
            Copies::Bf16 => len.div_ceil(2),
            Copies::Tf32 => len,
        }
    }

    /// Writes the copy of `src` into `dst`.
    fn convert(
        self,
        be: &CudaBackend,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match self {
            Copies::None => Ok(()),
            Copies::Bf16 => convert_bf16(be, src, dst),
            Copies::Tf32 => convert_tf32(be, src, dst),
        }
    }

    /// Runs `f` on the copy of `src` in scratch `slot` (on `src` itself
    /// for `None`).
    fn with<R>(
        self,
        be: &CudaBackend,
        slot: Scratch,
        src: &CudaSlice<f32>,
        f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        match self {
            Copies::None => f(src),
            Copies::Bf16 => as_bf16(be, slot, src, f),
            Copies::Tf32 => as_tf32(be, slot, src, f),
        }
    }
}

/// The fc products' vector tile: `ALEXNET_FC_TILE=narrow|wide|big` forces
/// one (measurements), otherwise the GEMM engine's height choice `wide`.
fn fc_tile(wide: bool) -> VecTile {
    static FORCED: std::sync::OnceLock<Option<VecTile>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("ALEXNET_FC_TILE").as_deref() {
        Ok("narrow") => Some(VecTile::Narrow),
        Ok("wide") => Some(VecTile::Wide),
        Ok("big") => Some(VecTile::Big),
        _ => None,
    });
    forced.unwrap_or(VecTile::of(wide))
}

/// Blocks per SM that the fc products' split over K aims at
/// (`ALEXNET_FC_SPLIT_BLOCKS`, default 2; measurements).
fn fc_split_blocks() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("ALEXNET_FC_SPLIT_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(2)
    })
}

/// An fc product's kernel: the vector engine's `{base}_vec_h16` (bf16
/// copies; `fits[1]`), `{base}_vec_tf32r` (TF32 copies) or `{base}_vec`
/// (`fits[0]`) at `tile`, else the GEMM engine's at the tile's height; and
/// the copies it reads.
fn pick(
    be: &CudaBackend,
    names: [&'static str; 6],
    fits: [bool; 2],
    tile: VecTile,
) -> (&'static str, Copies) {
    let base = names[0];
    if let Some(name) = be.vec_kernel(
        &format!("{base}_vec_h16"),
        fits[1] && be.operand_copies,
        tile,
    ) {
        return (name, Copies::Bf16);
    }
    if fits[0] && be.tf32_copies && be.precision == crate::config::Precision::Tf32 && be.vec_engine
    {
        let rounded = format!("{base}_vec_tf32r{}", tile.suffix());
        if let Some((name, _)) = be.funcs.get_key_value(rounded.as_str()) {
            return (name, Copies::Tf32);
        }
    }
    match be.vec_kernel(&format!("{base}_vec"), fits[0], tile) {
        Some(name) => (name, Copies::None),
        None => (be.gemm_kernel(names, tile != VecTile::Narrow), Copies::None),
    }
}

/// Launch grid of fc kernel `name` for an `m × n` result in `z` K slices.
fn fc_cfg(name: &str, m: usize, n: usize, z: usize, tile: VecTile) -> LaunchConfig {
    let cfg = grid(m, n, z, tile != VecTile::Narrow);
    if is_vec_kernel(name) {
        vec_cfg(cfg, name)
    } else {
        cfg
    }
}

fn dims(g: &FcGeom) -> (u32, u32, u32) {
    (g.n as u32, g.inputs as u32, g.outputs as u32)
}

/// An fc product's launch: kernel, grid, the operand copies it reads, and
/// its K slices.
struct FcPlan {
    name: &'static str,
    cfg: LaunchConfig,
    copies: Copies,
    splits: u32,
}

/// The plan of a product with an `m × n` result and depth `k`, split over
/// K where `split` allows (`fc_splits`).
fn plan(
    be: &CudaBackend,
    names: [&'static str; 6],
    fits: [bool; 2],
    (m, n, k): (usize, usize, usize),
    split: bool,
) -> FcPlan {
    // A split over K fills the GPU, so the height no longer has to leave
    // enough blocks: 128 rows wherever they add no padding (fc6+fc7 forward
    // and data gradient, H200 kernel timings at batch 128: TF32 0.435 →
    // 0.387 ms, bf16 0.271 → 0.253; benches/NOTES.md).
    let wide = be.wide_tiles(m, (!split).then_some(n.div_ceil(64)));
    let tile = fc_tile(wide);
    let (name, copies) = pick(be, names, fits, tile);
    let splits = if split {
        fc_splits(be, &fc_cfg(name, m, n, 1, tile), k)
    } else {
        1
    };
    FcPlan {
        name,
        cfg: fc_cfg(name, m, n, splits as usize, tile),
        copies,
        splits,
    }
}

fn forward_plan(be: &CudaBackend, g: &FcGeom) -> FcPlan {
    let fits = [g.inputs.is_multiple_of(4), g.inputs.is_multiple_of(8)];
    plan(
        be,
        gemm_names!("fc_forward"),
        fits,
        (g.n, g.outputs, g.inputs),
        true,
    )
}

fn data_plan(be: &CudaBackend, g: &FcGeom) -> FcPlan {
    let fits = |v: usize| g.inputs.is_multiple_of(v) && g.outputs.is_multiple_of(v);
    plan(
        be,
        gemm_names!("fc_backward_data"),
        [fits(4), fits(8)],
        (g.n, g.inputs, g.outputs),
        true,
    )
}

fn filter_plan(be: &CudaBackend, g: &FcGeom) -> FcPlan {
    let fits = |v: usize| g.inputs.is_multiple_of(v) && g.outputs.is_multiple_of(v);
    plan(
        be,
        gemm_names!("fc_backward_filter"),
        [fits(4), fits(8) && be.fc_filter_copies],
        (g.outputs, g.inputs, g.n),
        false,
    )
}

/// Floats of the copy of w (bf16 or TF32-rounded) that the forward can
/// keep for the data gradient (`fc_forward_keep`) and the SGD update
/// refreshes, where both products read the same kind: 0 where they read
/// none. Without it fc6's 38M weights are rounded twice a step (~0.06 ms
/// each in bf16 at batch 128).
pub(super) fn kept_len(be: &CudaBackend, g: &FcGeom) -> usize {
    let (f, d) = (forward_plan(be, g).copies, data_plan(be, g).copies);
    if f == d {
        f.floats(g.outputs * g.inputs)
    } else {
        0
    }
}

/// `y = x·wᵀ + b`; with `kept` (`kept_len` floats or more, where that is
/// not 0) the copy of w is made there and left for `fc_backward_data`,
/// or, where `kept` says it is fresh (the SGD update wrote it from this
/// w), read as it is. A shorter buffer, or one under settings that keep
/// none, is passed over.
pub(super) fn fc_forward(
    be: &CudaBackend,
    g: &FcGeom,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    kept: Option<(&mut CudaSlice<f32>, bool)>,
) -> Result<()> {
    check_len("fc_forward x", x, g.n * g.inputs)?;
    check_len("fc_forward w", w, g.outputs * g.inputs)?;
    check_len("fc_forward bias", b, g.outputs)?;
    check_len("fc_forward y", y, g.n * g.outputs)?;
    let (n, i, o) = dims(g);
    let FcPlan {
        name,
        cfg,
        copies,
        splits,
    } = forward_plan(be, g);
    let what = || format!("{g:?} splits={splits}");
    let run = |x: &CudaSlice<f32>, w: &CudaSlice<f32>| {
        if splits == 1 {
            return launch!(be, name, cfg, what; x, w, b, y, &n, &i, &o, &splits);
        }
        let len = g.n * g.outputs;
        be.with_workspace(len * splits as usize, |ws| {
            launch!(be, name, cfg, what; x, w, b, &mut *ws, &n, &i, &o, &splits)?;
            launch!(be, "splitk_reduce", grid_1d(be, len), what; &*ws, &mut *y, &len, &splits, b, &o)
        })
    };
    match kept {
        Some((wt, fresh)) if holds_kept(be, g, wt) => {
            if !fresh {
                copies.convert(be, w, wt)?;
            }
            let wt = &*wt;
            copies.with(be, Scratch::X, x, |x| run(x, wt))
        }
        _ => copies.with(be, Scratch::X, x, |x| {
            copies.with(be, Scratch::W, w, |w| run(x, w))
        }),
    }
}

/// Whether `buf` can hold (or holds) the copy of w that `kept_len` names
/// under the current settings.
fn holds_kept(be: &CudaBackend, g: &FcGeom, buf: &CudaSlice<f32>) -> bool {
    let len = kept_len(be, g);
    len > 0 && buf.len() >= len
}

/// How many K slices an fc product with launch `cfg` (one slice) and depth
/// `k` uses: enough blocks for `fc_split_blocks` (2) per SM, each slice at
/// least 256 deep. M = batch leaves the forward and data-gradient products
/// with few blocks (AlexNet's fc8 forward: 32 at batch 128).
fn fc_splits(be: &CudaBackend, cfg: &LaunchConfig, k: usize) -> u32 {
    let blocks = (cfg.grid_dim.0 * cfg.grid_dim.1 * cfg.grid_dim.2) as usize;
    let want = (fc_split_blocks() * be.sm_count() as usize).div_ceil(blocks);
    want.min(k / 256).clamp(1, 16) as u32
}

/// `dx = dy·w`; with `kept` (what `fc_forward` kept from this same w) the
/// copy of w is read from there instead of made again.
pub(super) fn fc_backward_data(
    be: &CudaBackend,
    g: &FcGeom,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    kept: Option<&CudaSlice<f32>>,
    dx: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("fc_backward_data dy", dy, g.n * g.outputs)?;
    check_len("fc_backward_data w", w, g.outputs * g.inputs)?;
    check_len("fc_backward_data dx", dx, g.n * g.inputs)?;
    let (n, i, o) = dims(g);
    let FcPlan {
        name,
        cfg,
        copies,
        splits,
    } = data_plan(be, g);
    let what = || format!("{g:?} splits={splits}");
    let run = |dy: &CudaSlice<f32>, w: &CudaSlice<f32>| {
        if splits == 1 {
            return launch!(be, name, cfg, what; dy, w, dx, &n, &i, &o, &splits);
        }
        let len = g.n * g.inputs;
        be.with_workspace(len * splits as usize, |ws| {
            launch!(be, name, cfg, what; dy, w, &mut *ws, &n, &i, &o, &splits)?;
            launch!(be, "splitk_reduce", grid_1d(be, len), what; &*ws, &mut *dx, &len, &splits, &0u64, &1u32)
        })
    };
    match kept {
        Some(wt) if holds_kept(be, g, wt) => copies.with(be, Scratch::Dy, dy, |dy| run(dy, wt)),
        _ => copies.with(be, Scratch::Dy, dy, |dy| {
            copies.with(be, Scratch::W, w, |w| run(dy, w))
        }),
    }
}

pub(super) fn fc_backward_filter(
    be: &CudaBackend,
    g: &FcGeom,
    x: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("fc_backward_filter x", x, g.n * g.inputs)?;
    check_len("fc_backward_filter dy", dy, g.n * g.outputs)?;
    check_len("fc_backward_filter dw", dw, g.outputs * g.inputs)?;
    let (n, i, o) = dims(g);
    let FcPlan {
        name, cfg, copies, ..
    } = filter_plan(be, g);
    copies.with(be, Scratch::X, x, |x| {
        copies.with(
            be,
            Scratch::Dy,
            dy,
            |dy| launch!(be, name, cfg, || format!("{g:?}"); x, dy, dw, &n, &i, &o),
        )
    })
}

pub(super) fn fc_backward_bias(
    be: &CudaBackend,
    g: &FcGeom,
    dy: &CudaSlice<f32>,
    db: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("fc_backward_bias dy", dy, g.n * g.outputs)?;
    check_len("fc_backward_bias db", db, g.outputs)?;
    let (n, _, o) = dims(g);
    let cfg = LaunchConfig {
        grid_dim: (g.outputs.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(be, "fc_backward_bias", cfg, || format!("{g:?}"); dy, db, &n, &o)
}

#[cfg(test)]
mod tests {
    use super::{
        TMA_STAGES_MAX, VEC_SHARED_MAX, WG_BIG_SHARED, WG_BIG_THREADS, WG_TMA_THREADS, tma_shared,
        vec_cfg,
    };
    use cudarc::driver::LaunchConfig;

    /// Launch shapes from kernel names: 128-column tiles halve grid x, and
    /// shared memory matches `gpu_kernels::gemm::vshared_bytes` (80-byte
    /// rows) or, for `_wg` kernels, `wshared_bytes` (4 stages of 64-byte
    /// rows; `_wg_big`: `wshared_bytes_sw`, 128-byte rows, 1 KiB for
    /// alignment), never above what the backend allows the kernels.
    #[test]
    fn vec_cfg_sizes_each_engine() {
        let grid = LaunchConfig {
            grid_dim: (9, 2, 3),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for (name, gx, bytes) in [
            ("conv_forward_nhwc_tf32", 9, 4 * 128 * 80),
            ("conv_forward_nhwc_tf32_wide", 9, 3 * 192 * 80),
            ("conv_forward_nhwc_tf32_big", 5, 3 * 256 * 80),
            ("conv_forward_nhwc16_bf16_long", 5, 3 * 192 * 80),
            ("conv_backward_data_nhwc_t_tf32_slim", 9, 3 * 192 * 80),
            ("conv_forward_nhwc_tf32_wg", 9, 4 * 128 * 64),
            ("conv_forward_nhwc_tf32_wg_wide", 9, 4 * 192 * 64),
            ("conv_forward_nhwc_tf32_wg_big", 5, 4 * 256 * 128 + 1024),
            (
                "conv_forward_nhwc16_bf16_wg_tma_big",
                5,
                5 * 256 * 128 + 1024 + 80,
            ),
            ("conv_forward_nhwc16_bf16_wg_long", 5, 4 * 192 * 64),
        ] {
            let cfg = vec_cfg(grid, name);
            assert_eq!(cfg.grid_dim, (gx, 2, 3), "{name}");
            let threads = match (
                name.ends_with("_big") && name.contains("_wg"),
                name.contains("_tma"),
            ) {
                (true, true) => WG_TMA_THREADS,
                (true, false) => WG_BIG_THREADS,
                _ => 128,
            };
            assert_eq!(cfg.block_dim, (threads, 1, 1), "{name}");
            assert_eq!(cfg.shared_mem_bytes, bytes, "{name}");
            let allowed = match (
                name.ends_with("_big") && name.contains("_wg"),
                name.contains("_tma"),
            ) {
                (true, true) => tma_shared(TMA_STAGES_MAX),
                (true, false) => WG_BIG_SHARED,
                _ => VEC_SHARED_MAX as u32,
            };
            assert!(cfg.shared_mem_bytes <= allowed, "{name}");
        }
    }
}
