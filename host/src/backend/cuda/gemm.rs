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
//! the inner loop.

use super::layout::{as_bf16, convert_bf16};
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
/// bytes).
pub(super) fn vec_cfg(cfg: LaunchConfig, name: &str) -> LaunchConfig {
    let (gx, gy, gz) = cfg.grid_dim;
    let (stages, rows, gx) = match VecTile::of_name(name) {
        VecTile::Narrow => (4, 128, gx),
        VecTile::Wide => (3, 192, gx),
        VecTile::Big => (3, 256, gx.div_ceil(2)),
        VecTile::Long => (3, 192, gx.div_ceil(2)),
        VecTile::Slim => (3, 192, gx),
    };
    let shared_mem_bytes = if is_wg_kernel(name) {
        4 * rows * 64
    } else {
        stages * rows * 80
    };
    LaunchConfig {
        grid_dim: (gx, gy, gz),
        block_dim: (128, 1, 1),
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

/// Whether kernel `name` runs on the vector engine (and so needs
/// [`VEC_SHARED_MAX`] bytes of dynamic shared memory allowed).
pub(super) fn is_vec_kernel(name: &str) -> bool {
    name.contains("_nhwc") || name.contains("_vec_") || name.contains("_rows")
}

/// The fc kernel `base` for the current precision and tile height, or a
/// vector-engine twin where the shape allows: `{base}_vec_h16` (bf16
/// operand copies; `fits[1]`, bf16 with bf16 operands on) or `{base}_vec`
/// (`fits[0]`). Its launch configuration from `cfg`, and whether it reads
/// bf16 copies.
fn pick(
    be: &CudaBackend,
    names: [&'static str; 6],
    fits: [bool; 2],
    wide: bool,
    cfg: LaunchConfig,
) -> (&'static str, LaunchConfig, bool) {
    let tile = VecTile::of(wide);
    let half = fits[1] && be.bf16_operands;
    if let Some(name) = be.vec_kernel(&format!("{}_vec_h16", names[0]), half, tile) {
        return (name, vec_cfg(cfg, name), true);
    }
    match be.vec_kernel(&format!("{}_vec", names[0]), fits[0], tile) {
        Some(name) => (name, vec_cfg(cfg, name), false),
        None => (be.gemm_kernel(names, wide), cfg, false),
    }
}

/// Runs `f` on operands `a` and `b`, or (`half`) on bf16 copies of them in
/// the given scratch slots.
fn operands<R>(
    be: &CudaBackend,
    half: bool,
    (sa, a): (Scratch, &CudaSlice<f32>),
    (sb, b): (Scratch, &CudaSlice<f32>),
    f: impl FnOnce(&CudaSlice<f32>, &CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    if !half {
        return f(a, b);
    }
    as_bf16(be, sa, a, |a| as_bf16(be, sb, b, |b| f(a, b)))
}

fn dims(g: &FcGeom) -> (u32, u32, u32) {
    (g.n as u32, g.inputs as u32, g.outputs as u32)
}

/// An fc product's launch: kernel, grid, whether it reads bf16 operand
/// copies, and its K slices.
struct FcPlan {
    name: &'static str,
    cfg: LaunchConfig,
    half: bool,
    splits: u32,
}

fn forward_plan(be: &CudaBackend, g: &FcGeom) -> FcPlan {
    let (cfg, wide) = tiles(be, g.n, g.outputs, 1);
    let splits = fc_splits(be, &cfg, g.inputs);
    let fits = [g.inputs.is_multiple_of(4), g.inputs.is_multiple_of(8)];
    let cfg = grid(g.n, g.outputs, splits as usize, wide);
    let (name, cfg, half) = pick(be, gemm_names!("fc_forward"), fits, wide, cfg);
    FcPlan {
        name,
        cfg,
        half,
        splits,
    }
}

fn data_plan(be: &CudaBackend, g: &FcGeom) -> FcPlan {
    let (cfg, wide) = tiles(be, g.n, g.inputs, 1);
    let splits = fc_splits(be, &cfg, g.outputs);
    let fits = |v: usize| g.inputs.is_multiple_of(v) && g.outputs.is_multiple_of(v);
    let cfg = grid(g.n, g.inputs, splits as usize, wide);
    let (name, cfg, half) = pick(
        be,
        gemm_names!("fc_backward_data"),
        [fits(4), fits(8)],
        wide,
        cfg,
    );
    FcPlan {
        name,
        cfg,
        half,
        splits,
    }
}

/// Floats of the bf16 copy of w that the forward can keep for the data
/// gradient (`fc_forward_keep`), where both read one: 0 unless both run on
/// bf16 operand copies. Without it fc6's 38M weights are rounded twice a
/// step (~0.06 ms each at batch 128).
pub(super) fn kept_len(be: &CudaBackend, g: &FcGeom) -> usize {
    if forward_plan(be, g).half && data_plan(be, g).half {
        (g.outputs * g.inputs).div_ceil(2)
    } else {
        0
    }
}

/// `y = x·wᵀ + b`; with `kept` (`kept_len` floats or more, where that is
/// not 0) the bf16 copy of w is made there and left for
/// `fc_backward_data`, or, where `kept` says it is fresh (the SGD update
/// wrote it from this w), read as it is. A shorter buffer, or one under
/// settings that keep none, is passed over.
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
        half,
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
                convert_bf16(be, w, wt)?;
            }
            let wt = &*wt;
            as_bf16(be, Scratch::X, x, |x| run(x, wt))
        }
        _ => operands(be, half, (Scratch::X, x), (Scratch::W, w), run),
    }
}

/// Whether `buf` can hold (or holds) the bf16 copy of w that `kept_len`
/// names under the current settings.
fn holds_kept(be: &CudaBackend, g: &FcGeom, buf: &CudaSlice<f32>) -> bool {
    let len = kept_len(be, g);
    len > 0 && buf.len() >= len
}

/// How many K slices an fc product with launch `cfg` (one slice) and depth
/// `k` uses: enough blocks for ~2 per SM, each slice at least 256 deep.
/// M = batch leaves the forward and data-gradient products with few blocks
/// (AlexNet's fc8 forward: 32 at batch 128).
fn fc_splits(be: &CudaBackend, cfg: &LaunchConfig, k: usize) -> u32 {
    let blocks = (cfg.grid_dim.0 * cfg.grid_dim.1 * cfg.grid_dim.2) as usize;
    let want = (2 * be.sm_count() as usize).div_ceil(blocks);
    want.min(k / 256).clamp(1, 16) as u32
}

/// `dx = dy·w`; with `kept` (what `fc_forward` kept from this same w) the
/// bf16 copy of w is read from there instead of made again.
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
        half,
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
        Some(wt) if holds_kept(be, g, wt) => as_bf16(be, Scratch::Dy, dy, |dy| run(dy, wt)),
        _ => operands(be, half, (Scratch::Dy, dy), (Scratch::W, w), run),
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
    let (cfg, wide) = tiles(be, g.outputs, g.inputs, 1);
    let fits = |v: usize| g.inputs.is_multiple_of(v) && g.outputs.is_multiple_of(v);
    let (name, cfg, half) = pick(
        be,
        gemm_names!("fc_backward_filter"),
        [fits(4), fits(8)],
        wide,
        cfg,
    );
    operands(
        be,
        half,
        (Scratch::X, x),
        (Scratch::Dy, dy),
        |x, dy| launch!(be, name, cfg, || format!("{g:?}"); x, dy, dw, &n, &i, &o),
    )
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
    use super::{VEC_SHARED_MAX, vec_cfg};
    use cudarc::driver::LaunchConfig;

    /// Launch shapes from kernel names: 128-column tiles halve grid x, and
    /// shared memory matches `gpu_kernels::gemm::vshared_bytes` (80-byte
    /// rows) or, for `_wg` kernels, `wshared_bytes` (4 stages of 64-byte
    /// rows), never above what the backend allows the kernels.
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
            ("conv_forward_nhwc_tf32_wg_big", 5, 4 * 256 * 64),
            ("conv_forward_nhwc16_bf16_wg_long", 5, 4 * 192 * 64),
        ] {
            let cfg = vec_cfg(grid, name);
            assert_eq!(cfg.grid_dim, (gx, 2, 3), "{name}");
            assert_eq!(cfg.block_dim, (128, 1, 1), "{name}");
            assert_eq!(cfg.shared_mem_bytes, bytes, "{name}");
            assert!(cfg.shared_mem_bytes as i32 <= VEC_SHARED_MAX, "{name}");
        }
    }
}
