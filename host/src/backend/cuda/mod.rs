//! The CUDA backend: one context and one stream per GPU, the PTX module built
//! from `gpu-kernels` loaded once, typed device buffers (`CudaSlice`), and a
//! launcher per kernel in the file named after its family (`lrn.rs` launches
//! `lrn_forward`/`lrn_backward`). Everything is queued on the backend's stream;
//! nothing waits for the GPU except `download` and `synchronize`.
//!
//! Runs on `cudarc` (driver API, libcuda loaded at run time), so building needs
//! no CUDA installation and a machine without a GPU gets a clear error.
//! Set `ALEXNET_SYNC_LAUNCHES=1` to synchronise after every launch, so an
//! asynchronous fault is reported against the kernel (and shapes) that caused it
//! (this also turns CUDA graphs off).
//!
//! A training step can be captured as a CUDA graph and replayed (`graph.rs`):
//! the values that change per step reach the dropout and SGD kernels through
//! a small device buffer rather than as kernel arguments, and the split-K
//! workspace and channels-last scratch never grow during a capture.

mod activation;
mod buf;
pub use buf::DevBuf;
mod conv;
mod copy;
mod dropout;
mod gemm;
mod graph;
pub use graph::StepGraph;
mod layout;
pub use layout::Elem;
mod loss;
mod lrn;
mod optimizer;
pub use optimizer::SgdTable;
mod pool;
mod profile;
mod tma;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, sys,
};

use super::*;

/// Kernels the PTX module must provide (checked at load time).
const KERNELS: &[&str] = &[
    "conv_forward",
    "conv_backward_data",
    "conv_backward_filter",
    "conv_forward_tf32",
    "conv_forward_bf16",
    "conv_forward_wide",
    "conv_forward_tf32_wide",
    "conv_forward_bf16_wide",
    "conv_backward_data_tf32",
    "conv_backward_data_bf16",
    "conv_backward_data_wide",
    "conv_backward_data_tf32_wide",
    "conv_backward_data_bf16_wide",
    "conv_backward_filter_tf32",
    "conv_backward_filter_bf16",
    "conv_backward_filter_wide",
    "conv_backward_filter_tf32_wide",
    "conv_backward_filter_bf16_wide",
    "conv_backward_bias",
    "conv_backward_data_cols",
    "conv_backward_data_cols_tf32",
    "conv_backward_data_cols_bf16",
    "conv_backward_data_cols_wide",
    "conv_backward_data_cols_tf32_wide",
    "conv_backward_data_cols_bf16_wide",
    "conv_cols_sum",
    "conv_phase_filters",
    "conv_phase_scatter",
    "conv_backward_filter_sum",
    "conv_forward_nhwc_tf32",
    "conv_forward_nhwc_bf16",
    "conv_forward_nhwc_tf32_wide",
    "conv_forward_nhwc_bf16_wide",
    "conv_backward_data_nhwc_tf32",
    "conv_backward_data_nhwc_bf16",
    "conv_backward_data_nhwc_tf32_wide",
    "conv_backward_data_nhwc_bf16_wide",
    "conv_backward_filter_nhwc_tf32",
    "conv_backward_filter_nhwc_bf16",
    "conv_backward_filter_nhwc_tf32_wide",
    "conv_backward_filter_nhwc_bf16_wide",
    "transpose",
    "transpose_tf32",
    "transpose_bf16",
    "row_patches",
    "row_patches_tf32",
    "row_patches_bf16",
    "pixel_grid_tf32",
    "convert_bf16",
    "convert_tf32",
    "conv_forward_rows_tf32",
    "conv_forward_rows_tf32_wide",
    "conv_forward_rows16_bf16",
    "conv_forward_rows16_bf16_big",
    "conv_forward_nhwc16_bf16_big",
    "conv_backward_data_nhwc16_bf16_big",
    "conv_forward_nhwc_tf32_big",
    "conv_backward_data_nhwc_tf32_big",
    "conv_forward_rows_tf32_big",
    "conv_forward_nhwc16_bf16_long",
    "conv_backward_data_nhwc16_bf16_long",
    "conv_backward_data_nhwc_t_tf32_slim",
    "conv_backward_data_nhwc16_t_bf16_slim",
    "conv_backward_data_nhwc16_t_bf16_wide",
    "conv_forward_nhwc16_t_bf16_wide",
    "conv_backward_data_nhwc_t_tf32_wide",
    "conv_forward_nhwc_t_tf32_wide",
    "conv_backward_filter_rows16_bf16_big",
    "conv_backward_filter_rows_tf32",
    "conv_backward_filter_rows_tf32_wide",
    "conv_backward_filter_rows16_bf16",
    "conv_backward_filter_rows16_bf16_wide",
    "conv_forward_nhwc16_bf16",
    "conv_backward_data_nhwc16_bf16",
    "conv_backward_filter_nhwc16_bf16",
    "conv_backward_filter_nhwc16_bf16_wide",
    "splitk_reduce",
    "fc_forward",
    "fc_backward_data",
    "fc_backward_filter",
    "fc_forward_tf32",
    "fc_forward_bf16",
    "fc_forward_wide",
    "fc_forward_tf32_wide",
    "fc_forward_bf16_wide",
    "fc_backward_data_tf32",
    "fc_backward_data_bf16",
    "fc_backward_data_wide",
    "fc_backward_data_tf32_wide",
    "fc_backward_data_bf16_wide",
    "fc_backward_filter_tf32",
    "fc_backward_filter_bf16",
    "fc_backward_filter_wide",
    "fc_backward_filter_tf32_wide",
    "fc_backward_filter_bf16_wide",
    "fc_backward_bias",
    "fc_forward_vec_tf32",
    "fc_forward_vec_bf16",
    "fc_forward_vec_tf32_wide",
    "fc_forward_vec_bf16_wide",
    "fc_backward_data_vec_tf32",
    "fc_backward_data_vec_bf16",
    "fc_backward_data_vec_tf32_wide",
    "fc_backward_data_vec_bf16_wide",
    "fc_backward_filter_vec_tf32",
    "fc_backward_filter_vec_bf16",
    "fc_backward_filter_vec_tf32_wide",
    "fc_backward_filter_vec_bf16_wide",
    "fc_forward_vec_h16_bf16",
    "fc_forward_vec_h16_bf16_wide",
    "fc_backward_data_vec_h16_bf16",
    "fc_backward_data_vec_h16_bf16_wide",
    "fc_backward_filter_vec_h16_bf16",
    "fc_backward_filter_vec_h16_bf16_wide",
    "fc_forward_vec_tf32_big",
    "fc_forward_vec_tf32r",
    "fc_forward_vec_tf32r_wide",
    "fc_forward_vec_tf32r_big",
    "fc_forward_vec_h16_bf16_big",
    "fc_backward_data_vec_tf32_big",
    "fc_backward_data_vec_tf32r",
    "fc_backward_data_vec_tf32r_wide",
    "fc_backward_data_vec_tf32r_big",
    "fc_backward_data_vec_h16_bf16_big",
    "fc_backward_filter_vec_tf32_big",
    "fc_backward_filter_vec_tf32r",
    "fc_backward_filter_vec_tf32r_wide",
    "fc_backward_filter_vec_tf32r_big",
    "fc_backward_filter_vec_h16_bf16_big",
    "relu_forward",
    "relu_backward",
    "lrn_forward",
    "lrn_backward",
    "lrn_pool_forward",
    "lrn_pool_backward",
    "maxpool_forward",
    "maxpool_backward",
    "dropout_forward",
    "dropout_backward",
    "softmax_xent_forward",
    "softmax_xent_backward",
    "label_rank",
    "sgd_update_all",
];

/// Kernels only the Hopper module provides (the warpgroup engine's
/// products, `gemm_tile_wg`).
const WG_KERNELS: &[&str] = &[
    "conv_forward_nhwc_tf32_wg",
    "conv_forward_nhwc_tf32_wg_wide",
    "conv_forward_nhwc_tf32_wg_big",
    "conv_forward_nhwc_tf32_wg_long",
    "conv_forward_nhwc16_bf16_wg",
    "conv_forward_nhwc16_bf16_wg_wide",
    "conv_forward_nhwc16_bf16_wg_big",
    "conv_forward_nhwc16_bf16_wg_long",
    "conv_backward_data_nhwc_tf32_wg",
    "conv_backward_data_nhwc_tf32_wg_wide",
    "conv_backward_data_nhwc_tf32_wg_big",
    "conv_backward_data_nhwc_tf32_wg_long",
    "conv_backward_data_nhwc16_bf16_wg",
    "conv_backward_data_nhwc16_bf16_wg_wide",
    "conv_backward_data_nhwc16_bf16_wg_big",
    "conv_backward_data_nhwc16_bf16_wg_long",
    "conv_forward_rows_tf32_wg",
    "conv_forward_rows_tf32_wg_wide",
    "conv_forward_rows_tf32_wg_big",
    "conv_forward_rows_tf32_wg_long",
    "conv_forward_rows16_bf16_wg",
    "conv_forward_rows16_bf16_wg_wide",
    "conv_forward_rows16_bf16_wg_big",
    "conv_forward_rows16_bf16_wg_long",
    "fc_forward_vec_h16_bf16_wg",
    "fc_forward_vec_h16_bf16_wg_wide",
    "conv_forward_nhwc_tf32_wg_tma_big",
    "conv_forward_nhwc16_bf16_wg_tma_big",
    "conv_backward_data_nhwc_tf32_wg_tma_big",
    "conv_backward_data_nhwc16_bf16_wg_tma_big",
    "conv_backward_data_nhwc_tf32_wg_tma_t",
    "conv_backward_data_nhwc16_bf16_wg_tma_t",
    "conv_backward_filter_nhwc16_bf16_wg_tma_big",
    "conv_backward_filter_grid_tf32_wg_tma_big",
];

/// What `host devices` prints for one GPU.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    pub sm_count: i32,
    pub clock_mhz: i32,
    pub l2_bytes: i32,
    pub max_shared_per_block: i32,
}

/// Why no GPU can be used, as one line; `None` when the driver loads and at
/// least one device exists.
pub fn unavailable_reason() -> Option<String> {
    if !unsafe { sys::is_culib_present() } {
        return Some("no NVIDIA driver found (libcuda.so could not be loaded)".into());
    }
    match CudaContext::device_count() {
        Ok(0) => Some("the NVIDIA driver reports no CUDA devices".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the NVIDIA driver could not be initialised: {e}")),
    }
}

/// The driver's CUDA version, e.g. (13, 0).
pub fn driver_version() -> Result<(i32, i32)> {
    let mut v = 0;
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(gpu_err)?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// Lists every visible GPU.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    if let Some(why) = unavailable_reason() {
        bail!("{why}");
    }
    let count = CudaContext::device_count().map_err(gpu_err)? as usize;
    (0..count)
        .map(|i| {
            let ctx = CudaContext::new(i).map_err(gpu_err)?;
            let attr = |a| ctx.attribute(a).map_err(gpu_err);
            use sys::CUdevice_attribute as A;
            Ok(DeviceInfo {
                ordinal: i,
                name: ctx.name().map_err(gpu_err)?,
                compute_capability: ctx.compute_capability().map_err(gpu_err)?,
                total_mem: ctx.total_mem().map_err(gpu_err)?,
                sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                clock_mhz: attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? / 1000,
                l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
                max_shared_per_block: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )?,
            })
        })
        .collect()
}

fn gpu_err(e: DriverError) -> anyhow::Error {
    anyhow!("CUDA error: {e}")
}

/// Which weight gradients run on the TMA-fed `wgmma` kernel
/// (`ALEXNET_TMA_FILTER`: `0`, `bf16`, `wide` (the default) or `1`/`all`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmaFilter {
    /// None: the `mma.sync` kernels.
    Off,
    /// The bf16 ones (MN-major tiles of dy and x's windows): conv3–5
    /// 11–26% faster per layer, the bf16 step 3–5% (H100, benches/NOTES.md).
    Bf16,
    /// The bf16 ones, and the TF32 ones over the padded pixel grid where a
    /// group has more than 128 filters (conv3–4), whose copies of x are
    /// then shared by more than one 128-row tile of filters: conv3's TF32
    /// weight gradient 0.41 → 0.29 ms and the TF32 step 2% faster (H200,
    /// benches/NOTES.md).
    Wide,
    /// The TF32 ones too, over the padded pixel grid: correct, but conv2's
    /// and conv5's are slower and so is the step (H100), so opt-in.
    All,
}

impl TmaFilter {
    /// The setting `ALEXNET_TMA_FILTER` (`None`: unset) names.
    pub fn parse(v: Option<String>) -> Result<Self> {
        Ok(match v.as_deref() {
            Some("0") => Self::Off,
            Some("bf16") => Self::Bf16,
            None | Some("wide") => Self::Wide,
            Some("1" | "all") => Self::All,
            Some(v) => bail!("ALEXNET_TMA_FILTER must be 0, bf16, wide, 1 or all, got {v:?}"),
        })
    }
}

/// How strided convolutions take their data gradient
/// (`ALEXNET_STRIDED_DATA`: `phases` (the default), `columns` or `gather`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StridedData {
    /// Split by phase into a stride-1 data gradient over dy
    /// ([`ConvGeom::phases`]) and `conv_phase_scatter`: no zero taps past
    /// the window's edges, and the stride-1 kernels' tiles (conv1 0.64 ms
    /// in TF32 at batch 128 on an H100, benches/NOTES.md).
    Phases,
    /// A dense product into columns (`conv_backward_data_cols`), summed per
    /// input pixel (`conv_cols_sum`): conv1 1.45 ms there.
    Columns,
    /// The gathered products, which multiply s² − 1 of every s² taps by
    /// zero: conv1 112 ms (tests and benchmarks only).
    Gather,
}

impl StridedData {
    /// The setting `ALEXNET_STRIDED_DATA` (`None`: unset) names.
    pub fn parse(v: Option<String>) -> Result<Self> {
        Ok(match v.as_deref() {
            None | Some("phases") => Self::Phases,
            Some("columns") => Self::Columns,
            Some("gather") => Self::Gather,
            Some(v) => bail!("ALEXNET_STRIDED_DATA must be phases, columns or gather, got {v:?}"),
        })
    }
}

/// How a TMA kernel's 1-D grid covers its 128×128 tiles (each block takes
/// tiles b, b + grid, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmaGrid {
    /// One block per tile.
    PerTile,
    /// As many blocks as stay resident on the GPU at once, each looping
    /// over tiles, so that a tile's stores overlap the next one's copies.
    Resident,
    /// At most this many blocks (tests: tiles per block beyond what the
    /// shape gives).
    Blocks(u32),
}

/// The CUDA backend for one GPU.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    /// Blocks of each vector-engine kernel that fit on one SM at once (the
    /// driver's occupancy for its launch shape).
    resident: HashMap<&'static str, u32>,
    sm_count: u32,
    sync_each_launch: bool,
    /// Scratch for split-K partial sums, grown on demand (stream-ordered reuse).
    workspace: Mutex<Option<CudaSlice<f32>>>,
    label: String,
    /// Arithmetic of the conv and fc products.
    precision: crate::config::Precision,
    /// Pinned staging buffers for large uploads (see [`CudaBackend::write`]);
    /// used only when `pinned_uploads` is on (the default).
    staging: Mutex<Staging>,
    /// The stream of the staged host-to-device copies (see [`Staging`]).
    upload_stream: Arc<CudaStream>,
    /// Whether staged copies run on `upload_stream` (else on the compute
    /// stream, straight into their destination: `ALEXNET_UPLOAD_STREAM=0`,
    /// for comparison).
    upload_overlap: bool,
    pinned_uploads: bool,
    /// Whether a model's buffers are ranges of one arena (else each is an
    /// allocation of its own, which gradients then do not share:
    /// `ALEXNET_ARENA=0`, so that compute-sanitizer sees every buffer's
    /// bounds).
    arena: bool,
    gemm_tiles: GemmTiles,
    /// Whether TF32/bf16 products whose shapes allow it run on the vector
    /// engine (16-byte copies; channels-last convolutions, see `conv.rs`);
    /// `ALEXNET_VEC_ENGINE=0` turns it off (benchmarks).
    vec_engine: bool,
    /// Whether bf16 products read bf16 copies of their operands
    /// (`ALEXNET_OPERAND_COPIES=0` keeps them fp32, converted as fragments
    /// are read; benchmarks and tests).
    operand_copies: bool,
    /// Whether TF32 fc products read TF32-rounded copies of their operands,
    /// the SGD update writing the weights' (`ALEXNET_TF32_COPIES=1`). Off by
    /// default: no faster on the H200 (the in-loop conversion was not what
    /// held the fc products back; `benches/NOTES.md`), and 234 MB more.
    tf32_copies: bool,
    /// Whether the bf16 fc weight gradient reads bf16 copies of x and dy
    /// too (`ALEXNET_FC_FILTER_COPIES=1`). Off by default: its fp32
    /// operands converted in the loop measured faster (K is the batch, so
    /// a block has few k steps to spread the copies' cost over), and two
    /// `convert_bf16` launches per fc layer go.
    fc_filter_copies: bool,
    /// Whether LRN followed by max pooling runs as one fused pass each way
    /// where the kernels take the shapes (`ALEXNET_FUSE_LRN_POOL=0` runs
    /// them separately; benchmarks).
    fuse_lrn_pool: bool,
    /// Whether vector-engine products that have a 128×128 (64×128) variant
    /// use it where 128-row (64-row) tiles are chosen: `None` where it
    /// fills the GPU's waves about as well (see `conv.rs`), `Some(on)`
    /// always or never (`ALEXNET_BIG_TILES=1|0`; benchmarks and tests).
    big_tiles: Option<bool>,
    /// Whether channels-last products whose channel count the 64- or
    /// 128-row tiles pad take the transposed kernels (`_t_`: pixels ×
    /// channels, 128×48 or 128×64 tiles) instead (`ALEXNET_TRANSPOSED=0`
    /// turns them off; benchmarks and tests).
    transposed: bool,
    /// How strided convolutions take their data gradient ([`StridedData`];
    /// `ALEXNET_STRIDED_DATA`).
    strided_data: StridedData,
    /// Floats of the data gradient's column buffer (`Scratch::Cols`) at
    /// most; the images go through it in chunks that fit (at least one).
    cols_budget: usize,
    /// Whether `autotune_conv` times the candidate kernels of each shape
    /// (off by default; `host train` and `host bench` turn it on as the
    /// config's `train.autotune` says).
    autotune: bool,
    /// The autotune's choices, per product and shape (cleared when a
    /// setting changes).
    tuned: Mutex<HashMap<(conv::Product, ConvGeom), conv::Knobs>>,
    /// What the autotune measured, per product and shape (a second model of
    /// the same shapes reuses it).
    tune_log: Mutex<HashMap<(conv::Product, ConvGeom), TunedKernel>>,
    /// Whether the loaded module is the Hopper one, with the warpgroup
    /// engine's kernels (see `crate::PTX_SM90A`).
    has_wgmma: bool,
    /// Whether vector-engine products that have a warpgroup-engine twin
    /// (`_wg`) use it (`ALEXNET_WGMMA=1`; tests turn it on and off).
    wgmma: bool,
    /// Whether the channels-last conv forwards in 128×128 tiles take their
    /// warpgroup twin (`_wg_big`, the swizzled 128-byte-row pipeline) even
    /// with `wgmma` off: on by default on Hopper (`ALEXNET_WG_BIG=0` turns
    /// it off). Its products are bit-identical to `mma.sync`'s (`gpu_ops
    /// conv_wg_big`); the step is 2–3% faster with it (benches/NOTES.md).
    /// conv1's row-patch forward and the data gradients at batch 256 were
    /// slower with it, so they keep `mma.sync`.
    wg_big: bool,
    /// Whether the channels-last conv forwards whose shape allows it run
    /// on the 128×128 warpgroup kernels fed by the tensor memory
    /// accelerator (`_wg_tma_big`; `tma.rs`): on by default on Hopper
    /// (`ALEXNET_TMA=0` turns it off). Bit-identical to the `_wg_big`
    /// kernels (`gpu_ops conv_tma`); conv3–5 forwards 14–20% faster than
    /// theirs on the H200, and conv4's about twice as fast as before,
    /// when it padded no filters with 64-row tiles (benches/NOTES.md).
    tma: bool,
    /// Whether the channels-last stride-1 data gradients whose shape allows
    /// it may run on the TMA kernels too (the autotune still compares):
    /// on by default on Hopper (`ALEXNET_TMA_DATA=0` turns it off); conv3's
    /// TF32 data gradient 0.38 → 0.21 ms on the H100 (benches/NOTES.md).
    tma_data: bool,
    /// Which weight gradients whose shape allows it run on the TMA
    /// kernels ([`TmaFilter`]; `Wide` by default on Hopper).
    tma_filter: TmaFilter,
    /// The TMA kernels' tensor maps (`tma.rs`).
    tma_maps: Mutex<tma::TmaMaps>,
    /// The TMA kernels' stages of 32 KiB (`ALEXNET_TMA_STAGES`, 2 to 7;
    /// the producer warp runs up to one fewer K tiles ahead).
    tma_stages: u32,
    /// How the TMA kernels' grid covers their tiles (`ALEXNET_TMA_PERSISTENT=1`:
    /// resident blocks that loop over tiles).
    tma_grid: TmaGrid,
    /// Whether the TMA kernels store their tiles straight from the
    /// accumulators (`ALEXNET_TMA_EPILOGUE=direct`) instead of staging them
    /// in shared memory first where they can (`gemm::gemm_tile_tma`).
    tma_direct_store: bool,
    /// Scratch for the channels-last path, by [`Scratch`] slot, grown on
    /// demand like `workspace`.
    scratch: [Mutex<Option<CudaSlice<f32>>>; 8],
    /// The per-step values that dropout and SGD kernels read (`graph.rs`).
    step_values: Mutex<graph::StepValues>,
    /// Set while a step graph is captured: writing the per-step values and
    /// growing buffers are then errors.
    capturing: AtomicBool,
    /// Bumped whenever something a captured graph depends on is replaced
    /// or a setting changes (`graph.rs`).
    generation: AtomicU64,
    /// Per-launch timing for `host bench --profile` (off unless started).
    recorder: profile::Recorder,
}

/// Slots of [`CudaBackend`]'s scratch buffers.
#[derive(Clone, Copy)]
enum Scratch {
    /// x in NHWC.
    X = 0,
    /// dy in NHWC.
    Dy = 1,
    /// The filter bank in a product's k order.
    W = 2,
    /// dy's per-channel partial sums from its relayout (the bias gradient).
    Sums = 3,
    /// The data gradient's columns (`conv::by_columns`).
    Cols = 4,
    /// x on the TF32 weight gradient's pixel grid.
    GridX = 5,
    /// dy on that grid.
    GridDy = 6,
    /// The filter bank of the data gradient by phases (`conv::by_phases`).
    Phases = 7,
}

/// Tile height of the GEMM engine's products (conv and fc): 64 or 128 rows
/// of the result per block. `Auto` chooses per product (see `wide_tiles`);
/// the environment variable `ALEXNET_GEMM_TILES=64|128` forces one
/// (benchmarks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmTiles {
    Auto,
    Narrow,
    Wide,
}

/// Two slots used in turn, each a page-locked host buffer and a device
/// buffer of the same size: a large `write` copies the caller's data into
/// the host buffer (CPU threads), and the upload stream copies it to the
/// device buffer while the compute stream may still be running the step
/// before; the compute stream then waits for that copy and moves the data
/// to its destination with a device-to-device copy (~0.05 ms for a batch
/// of 128 AlexNet crops, where the host copy takes milliseconds and used
/// to sit between two steps). Reusing a slot waits on the host for its
/// previous copy (`copied`; the pinned buffer's own event is recorded only
/// while cudarc tracks events, which this backend turns off) and, on the
/// upload stream, for the compute stream's read of its device buffer
/// (`used`).
#[derive(Default)]
struct Staging {
    slots: [Option<StagingSlot>; 2],
    next: usize,
}

struct StagingSlot {
    host: cudarc::driver::PinnedHostSlice<f32>,
    device: CudaSlice<f32>,
    /// Recorded on the upload stream after the host-to-device copy.
    copied: cudarc::driver::CudaEvent,
    /// Recorded on the compute stream after the device-to-device copy.
    used: cudarc::driver::CudaEvent,
}

/// Writes of at least this many floats go through [`Staging`].
const STAGED_WRITE_MIN: usize = 1 << 18;

impl CudaBackend {
    /// Opens GPU `ordinal`, loads the embedded PTX and resolves every kernel.
    pub fn new(ordinal: usize) -> Result<Self> {
        if let Some(why) = unavailable_reason() {
            bail!("{why}");
        }
        let count = CudaContext::device_count().map_err(gpu_err)? as usize;
        if ordinal >= count {
            bail!("GPU {ordinal} requested but only {count} CUDA device(s) are visible");
        }
        let ctx = CudaContext::new(ordinal).map_err(gpu_err)?;
        // Kernels run on one stream, whose order is theirs, so cudarc's
        // per-buffer event tracking would only add overhead; the upload
        // stream is ordered against it by `Staging`'s own events.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(gpu_err)?;
        let upload_stream = ctx.new_stream().map_err(gpu_err)?;
        // Hopper (9.0) gets the sm_90a module and its `wgmma` and TMA
        // kernels (PTX ISA 8.3: a CUDA 12.3+ driver); where its driver
        // cannot JIT that, the portable module (PTX ISA 8.0) serves instead.
        let mut hopper = ctx.compute_capability().map_err(gpu_err)? == (9, 0);
        let portable = || {
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(crate::PTX)).map_err(|e| {
                anyhow!(
                    "loading the PTX module (built for {}) failed: {e}; the driver must JIT PTX ISA 8.0 (CUDA 12.0+ driver) for an sm_70+ GPU",
                    env!("ALEXNET_CUDA_ARCH")
                )
            })
        };
        let module = if hopper {
            match ctx.load_module(cudarc::nvrtc::Ptx::from_src(crate::PTX_SM90A)) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!(
                        "warning: the Hopper (sm_90a, PTX ISA 8.3) module did not load ({e}); running the portable kernels, without wgmma and TMA (a CUDA 12.3+ driver has them)"
                    );
                    hopper = false;
                    portable()?
                }
            }
        } else {
            portable()?
        };
        let mut funcs = HashMap::new();
        let mut resident = HashMap::new();
        let wg_kernels = if hopper { WG_KERNELS } else { &[] };
        for &name in KERNELS.iter().chain(wg_kernels) {
            let f = module
                .load_function(name)
                .with_context(|| format!("kernel {name} is missing from the PTX module"))?;
            if gemm::is_vec_kernel(name) {
                let cfg = gemm::vec_cfg(LaunchConfig::for_num_elems(1), name);
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    if name.contains("_tma") {
                        gemm::tma_shared(gemm::TMA_STAGES_MAX) as i32
                    } else {
                        gemm::VEC_SHARED_MAX.max(cfg.shared_mem_bytes as i32)
                    },
                )
                .map_err(|e| anyhow!("allowing {name} its shared memory failed: {e}"))?;
                let blocks = f
                    .occupancy_max_active_blocks_per_multiprocessor(
                        cfg.block_dim.0,
                        cfg.shared_mem_bytes as usize,
                        None,
                    )
                    .map_err(|e| anyhow!("occupancy of {name}: {e}"))?;
                resident.insert(name, blocks.max(1));
            }
            funcs.insert(name, f);
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(gpu_err)? as u32;
        let label = format!("cuda:{ordinal} {}", ctx.name().map_err(gpu_err)?);
        let step_values = Mutex::new(graph::StepValues::new(&stream)?);
        Ok(Self {
            ctx,
            stream,
            _module: module,
            funcs,
            resident,
            sm_count,
            sync_each_launch: std::env::var("ALEXNET_SYNC_LAUNCHES").is_ok_and(|v| v == "1"),
            workspace: Mutex::new(None),
            label,
            precision: crate::config::Precision::Fp32,
            staging: Mutex::new(Staging::default()),
            upload_stream,
            upload_overlap: std::env::var("ALEXNET_UPLOAD_STREAM").map_or(true, |v| v != "0"),
            pinned_uploads: std::env::var("ALEXNET_PINNED_UPLOADS").map_or(true, |v| v != "0"),
            arena: std::env::var("ALEXNET_ARENA").map_or(true, |v| v != "0"),
            gemm_tiles: match std::env::var("ALEXNET_GEMM_TILES").as_deref() {
                Ok("64") => GemmTiles::Narrow,
                Ok("128") => GemmTiles::Wide,
                _ => GemmTiles::Auto,
            },
            vec_engine: std::env::var("ALEXNET_VEC_ENGINE").map_or(true, |v| v != "0"),
            operand_copies: std::env::var("ALEXNET_OPERAND_COPIES").map_or(true, |v| v != "0"),
            tf32_copies: std::env::var("ALEXNET_TF32_COPIES").is_ok_and(|v| v == "1"),
            fc_filter_copies: std::env::var("ALEXNET_FC_FILTER_COPIES").is_ok_and(|v| v == "1"),
            fuse_lrn_pool: std::env::var("ALEXNET_FUSE_LRN_POOL").map_or(true, |v| v != "0"),
            big_tiles: match std::env::var("ALEXNET_BIG_TILES").as_deref() {
                Ok("0") => Some(false),
                Ok("1") => Some(true),
                _ => None,
            },
            transposed: std::env::var("ALEXNET_TRANSPOSED").map_or(true, |v| v != "0"),
            strided_data: StridedData::parse(std::env::var("ALEXNET_STRIDED_DATA").ok())?,
            cols_budget: 1 << 26,
            autotune: false,
            tuned: Default::default(),
            tune_log: Default::default(),
            has_wgmma: hopper,
            wgmma: hopper && std::env::var("ALEXNET_WGMMA").is_ok_and(|v| v == "1"),
            wg_big: hopper && !std::env::var("ALEXNET_WG_BIG").is_ok_and(|v| v == "0"),
            tma: hopper && !std::env::var("ALEXNET_TMA").is_ok_and(|v| v == "0"),
            tma_data: hopper && !std::env::var("ALEXNET_TMA_DATA").is_ok_and(|v| v == "0"),
            tma_filter: match TmaFilter::parse(std::env::var("ALEXNET_TMA_FILTER").ok())? {
                _ if !hopper => TmaFilter::Off,
                which => which,
            },
            tma_maps: Mutex::new(tma::TmaMaps::new()),
            tma_grid: if std::env::var("ALEXNET_TMA_PERSISTENT").is_ok_and(|v| v == "1") {
                TmaGrid::Resident
            } else {
                TmaGrid::PerTile
            },
            tma_direct_store: match std::env::var("ALEXNET_TMA_EPILOGUE").as_deref() {
                Err(_) | Ok("staged") => false,
                Ok("direct") => true,
                Ok(v) => bail!("ALEXNET_TMA_EPILOGUE must be staged or direct, got {v:?}"),
            },
            tma_stages: match std::env::var("ALEXNET_TMA_STAGES") {
                Err(_) => gemm::TMA_STAGES,
                Ok(v) => v
                    .parse()
                    .ok()
                    .filter(|n| (2..=gemm::TMA_STAGES_MAX).contains(n))
                    .ok_or_else(|| {
                        anyhow!(
                            "ALEXNET_TMA_STAGES must be a whole number from 2 to {}, got {v:?}",
                            gemm::TMA_STAGES_MAX
                        )
                    })?,
            },
            scratch: Default::default(),
            step_values,
            capturing: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            recorder: Default::default(),
        })
    }

    /// Makes every graph captured so far stale (a setting changed).
    fn settings_changed(&mut self) {
        *self.generation.get_mut() += 1;
        self.tuned
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.tune_log
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// How strided convolutions take their data gradient ([`StridedData`]);
    /// and the most floats the columns path's buffer may take (default
    /// 2^26, 256 MiB; at least one image's columns are always made). For
    /// tests and benchmarks.
    pub fn set_strided_data(&mut self, how: StridedData, budget: Option<usize>) {
        self.strided_data = how;
        if let Some(b) = budget {
            self.cols_budget = b;
        }
        self.settings_changed();
    }

    /// The kernel that `g`'s data gradient runs under the current settings
    /// (the first of two for the columns path, the stride-1 product for the
    /// phases path; `"gemm"` for the NCHW engine's). For tests: which path a
    /// shape takes.
    pub fn conv_data_kernel(&self, g: &ConvGeom) -> &'static str {
        conv::data_kernel(self, g)
    }

    /// Turns the autotune of convolution kernels on or off (see
    /// [`Backend::autotune_conv`]).
    /// `ALEXNET_AUTOTUNE=0` keeps it off.
    pub fn set_autotune(&mut self, on: bool) {
        self.autotune = on && std::env::var("ALEXNET_AUTOTUNE").map_or(true, |v| v != "0");
    }

    /// Runs `f` once under each kernel choice the autotune would time for
    /// `product` (`"forward"` or `"data"`) of `g`, with that
    /// choice set and its kernel's name; returns how many there were. The
    /// built-in choice is set again after. For tests: every candidate must
    /// agree with the reference.
    pub fn for_each_conv_candidate(
        &self,
        g: &ConvGeom,
        product: &str,
        f: impl FnMut(&str) -> Result<()>,
    ) -> Result<usize> {
        let product = match product {
            "forward" => conv::Product::Forward,
            "data" => conv::Product::Data,
            _ => bail!("the autotune has no convolution product {product:?} (forward, data)"),
        };
        conv::for_each_candidate(self, product, g, f)
    }

    /// The settings `product`'s plan for `g` reads: the autotune's choice,
    /// else the backend's.
    fn knobs(&self, product: conv::Product, g: &ConvGeom) -> conv::Knobs {
        let tuned = self.tuned.lock().unwrap_or_else(|e| e.into_inner());
        tuned
            .get(&(product, *g))
            .copied()
            .unwrap_or_else(|| self.default_knobs())
    }

    /// The backend's own settings as knobs.
    fn default_knobs(&self) -> conv::Knobs {
        conv::Knobs {
            transposed: if self.transposed {
                conv::Transposed::Padded
            } else {
                conv::Transposed::Off
            },
            big: self.big_tiles,
        }
    }

    /// Sets (or with `None` clears) the choice for `product` of `g`; graphs
    /// captured before are stale.
    fn set_knobs(&self, product: conv::Product, g: &ConvGeom, k: Option<conv::Knobs>) {
        let mut tuned = self.tuned.lock().unwrap_or_else(|e| e.into_inner());
        match k {
            Some(k) => tuned.insert((product, *g), k),
            None => tuned.remove(&(product, *g)),
        };
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Chooses the arithmetic of the conv and fc products: fp32 on the CUDA
    /// cores (default), TF32 or bf16 on the tensor cores (fp32 storage and
    /// accumulation in every mode).
    pub fn set_precision(&mut self, p: crate::config::Precision) -> Result<()> {
        self.precision = p;
        self.settings_changed();
        Ok(())
    }

    /// Whether [`Backend::arena`] makes one allocation (default) or one per
    /// buffer (`ALEXNET_ARENA=0`).
    pub fn set_arena(&mut self, on: bool) {
        self.arena = on;
    }

    pub fn arena_enabled(&self) -> bool {
        self.arena
    }

    /// Stages large writes through pinned host memory with asynchronous
    /// copies (see [`Staging`]). On by default (on the H200, `host train`
    /// on synthetic AlexNet data, bf16: 4,273 → 5,614 images/s);
    /// `ALEXNET_PINNED_UPLOADS=0` turns it off.
    pub fn set_pinned_uploads(&mut self, on: bool) {
        self.pinned_uploads = on;
    }

    /// Turns the vector engine (channels-last convolutions, vectorized fc
    /// products) on or off.
    pub fn set_vec_engine(&mut self, on: bool) {
        self.vec_engine = on;
        self.settings_changed();
    }

    /// Whether vector-engine products use their 128-column variants where
    /// they have one: `None` by how they fill the GPU (default), else
    /// always or never.
    pub fn big_tiles(&self) -> Option<bool> {
        self.big_tiles
    }

    /// Sets [`CudaBackend::big_tiles`].
    pub fn set_big_tiles(&mut self, on: Option<bool>) {
        self.big_tiles = on;
        self.settings_changed();
    }

    /// Turns the transposed channels-last products on or off (see the
    /// field).
    pub fn set_transposed(&mut self, on: bool) {
        self.transposed = on;
        self.settings_changed();
    }

    /// The vector-engine kernel `{base}_{tf32|bf16}{tile suffix}` when the
    /// precision and the shape (`fits`) allow it, the engine is on and that
    /// tile shape exists for it; its warpgroup-engine twin
    /// `{base}_{tf32|bf16}_wg{tile suffix}` instead where the Hopper module
    /// has one and the engine is on (or, with `wg_big`, for the
    /// channels-last forwards' 128×128 tiles).
    fn vec_kernel(&self, base: &str, fits: bool, tile: gemm::VecTile) -> Option<&'static str> {
        use crate::config::Precision;
        if !self.vec_engine || !fits {
            return None;
        }
        let p = match self.precision {
            Precision::Fp32 => return None,
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        };
        let name = format!("{base}_{p}{}", tile.suffix());
        let big_forward = tile == gemm::VecTile::Big && base.starts_with("conv_forward_nhwc");
        let wg = (self.wgmma || (self.wg_big && big_forward))
            .then(|| format!("{base}_{p}_wg{}", tile.suffix()));
        wg.iter()
            .chain([&name])
            .find_map(|n| self.funcs.get_key_value(n.as_str()).map(|(k, _)| *k))
    }

    /// Whether this GPU runs the warpgroup engine's `wgmma` kernels (Hopper,
    /// with the `sm_90a` module loaded).
    pub fn has_wgmma(&self) -> bool {
        self.has_wgmma
    }

    /// Whether the products use the warpgroup engine now.
    pub fn wgmma_enabled(&self) -> bool {
        self.wgmma
    }

    /// Turns the warpgroup engine on or off (where the GPU has it;
    /// `ALEXNET_WGMMA=1` turns it on at start), its 128×128 kernels
    /// included.
    pub fn set_wgmma(&mut self, on: bool) {
        self.wgmma = on && self.has_wgmma;
        self.wg_big = self.wgmma;
        self.settings_changed();
    }

    /// Whether the channels-last conv forwards' 128×128 tiles take the
    /// warpgroup engine with `wgmma` off.
    pub fn wg_big_enabled(&self) -> bool {
        self.wg_big
    }

    /// Turns the warpgroup engine on or off for the channels-last conv
    /// forwards' 128×128 tiles alone.
    pub fn set_wg_big(&mut self, on: bool) {
        self.wg_big = on && self.has_wgmma;
        self.settings_changed();
    }

    /// Whether the conv forwards' 128×128 warpgroup kernels take their TMA
    /// twins where the shape allows.
    pub fn tma_enabled(&self) -> bool {
        self.tma
    }

    /// Turns the TMA conv forwards on or off (where the GPU has them).
    pub fn set_tma(&mut self, on: bool) {
        self.tma = on && self.has_wgmma;
        self.settings_changed();
    }

    /// Turns the TMA data gradients on or off (where the GPU has them).
    pub fn set_tma_data(&mut self, on: bool) {
        self.tma_data = on && self.has_wgmma;
        self.settings_changed();
    }

    /// The TMA kernels' stages.
    pub fn tma_stages(&self) -> u32 {
        self.tma_stages
    }

    /// Sets the TMA kernels' stages (2 to 7).
    pub fn set_tma_stages(&mut self, stages: u32) -> Result<()> {
        if !(2..=gemm::TMA_STAGES_MAX).contains(&stages) {
            bail!(
                "TMA stages must be from 2 to {}, got {stages}",
                gemm::TMA_STAGES_MAX
            );
        }
        self.tma_stages = stages;
        self.settings_changed();
        Ok(())
    }

    /// How the TMA kernels' grid covers their tiles.
    pub fn tma_grid(&self) -> TmaGrid {
        self.tma_grid
    }

    /// Sets how the TMA kernels' grid covers their tiles.
    pub fn set_tma_grid(&mut self, grid: TmaGrid) {
        self.tma_grid = grid;
        self.settings_changed();
    }

    /// Whether the TMA kernels store straight from the accumulators.
    pub fn tma_direct_store(&self) -> bool {
        self.tma_direct_store
    }

    /// Sets whether the TMA kernels store straight from the accumulators
    /// (true) or stage their tiles in shared memory where they can.
    pub fn set_tma_direct_store(&mut self, on: bool) {
        self.tma_direct_store = on;
        self.settings_changed();
    }

    /// The launch of TMA kernel `name` for `cfg`'s grid of 128×128 tiles
    /// (the kernel takes them in a 1-D grid: one block per tile, or as many
    /// as stay resident), with this backend's stages, and the kernel's
    /// `ring` argument (the stages, and `gemm::TMA_DIRECT_STORE`).
    fn tma_cfg(&self, name: &str, cfg: LaunchConfig) -> Result<(LaunchConfig, u32)> {
        let shared_mem_bytes = gemm::tma_shared(self.tma_stages);
        let (gx, gy, gz) = cfg.grid_dim;
        let tiles = gx * gy * gz;
        let blocks = if let TmaGrid::Blocks(n) = self.tma_grid {
            tiles.min(n.max(1))
        } else if self.tma_grid == TmaGrid::Resident {
            let per_sm = self.funcs[name]
                .occupancy_max_active_blocks_per_multiprocessor(
                    cfg.block_dim.0,
                    shared_mem_bytes as usize,
                    None,
                )
                .map_err(|e| anyhow!("occupancy of {name}: {e}"))?;
            tiles.min(per_sm.max(1) * self.sm_count)
        } else {
            tiles
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            shared_mem_bytes,
            ..cfg
        };
        let direct = if self.tma_direct_store {
            gemm::TMA_DIRECT_STORE
        } else {
            0
        };
        Ok((cfg, self.tma_stages | direct))
    }

    /// Whether the TMA data gradients are on.
    pub fn tma_data_enabled(&self) -> bool {
        self.tma_data
    }

    /// Whether the forward of `g` would run on a TMA kernel given 128×128
    /// tiles: TMA on, the channels-last TF32 or bf16-copy products (the
    /// 128×128 `_wg_big` kernels' precisions), 128-row tiles not ruled out,
    /// and a shape the kernel takes.
    fn tma_forward_fits(&self, g: &ConvGeom) -> bool {
        self.tma_half().is_some_and(|half| {
            self.tma && (self.wg_big || self.wgmma) && tma::conv_forward_unfit(g, half).is_none()
        })
    }

    /// The TMA data-gradient kernel for `g` and whether it reads bf16, if
    /// it is on and the shape fits: with `swapped`, the one with 128 pixels
    /// × 64 channels a tile (`_tma_t`), else 128×128.
    fn tma_data_kernel(&self, g: &ConvGeom, swapped: bool) -> Option<(&'static str, bool)> {
        let half = self.tma_half()?;
        if !self.tma_data || tma::conv_data_unfit(g, half).is_some() {
            return None;
        }
        let name = match (half, swapped) {
            (true, false) => "conv_backward_data_nhwc16_bf16_wg_tma_big",
            (false, false) => "conv_backward_data_nhwc_tf32_wg_tma_big",
            (true, true) => "conv_backward_data_nhwc16_bf16_wg_tma_t",
            (false, true) => "conv_backward_data_nhwc_tf32_wg_tma_t",
        };
        self.funcs.get_key_value(name).map(|(k, _)| (*k, half))
    }

    /// The TMA weight gradient for `g`, where it is on and fits, and
    /// whether its operands are bf16 (else TF32, over the pixel grid).
    fn tma_filter_kernel(&self, g: &ConvGeom) -> Option<(&'static str, bool)> {
        let half = self.tma_half()?;
        let on = match self.tma_filter {
            TmaFilter::Off => false,
            TmaFilter::Bf16 => half,
            TmaFilter::Wide => half || g.c_out / g.groups > 128,
            TmaFilter::All => true,
        };
        if !on || tma::conv_filter_unfit(g, half).is_some() {
            return None;
        }
        let name = if half {
            "conv_backward_filter_nhwc16_bf16_wg_tma_big"
        } else {
            "conv_backward_filter_grid_tf32_wg_tma_big"
        };
        self.funcs.get_key_value(name).map(|(k, _)| (*k, half))
    }

    /// Sets which weight gradients run on the TMA kernels (none where the
    /// GPU has no `wgmma`).
    pub fn set_tma_filter(&mut self, which: TmaFilter) {
        self.tma_filter = if self.has_wgmma {
            which
        } else {
            TmaFilter::Off
        };
        self.settings_changed();
    }

    /// Which weight gradients run on the TMA kernels.
    pub fn tma_filter(&self) -> TmaFilter {
        self.tma_filter
    }

    /// Whether the TMA kernels' operands are bf16 (`Some(true)`) or TF32
    /// (`Some(false)`) in this precision, `None` where they have none (fp32,
    /// bf16 on fp32 operands) or the vector engine or 128-row tiles are off.
    fn tma_half(&self) -> Option<bool> {
        use crate::config::Precision;
        if !self.vec_engine || self.gemm_tiles == GemmTiles::Narrow {
            return None;
        }
        match self.precision {
            Precision::Tf32 => Some(false),
            Precision::Bf16 if self.operand_copies => Some(true),
            _ => None,
        }
    }

    /// The TMA twin of the 128×128 warpgroup conv forward `name` when it is
    /// on and `g` fits it (`half`: bf16 operands), else `name`.
    fn tma_twin(&self, name: &'static str, g: &ConvGeom, half: bool) -> &'static str {
        let Some(base) = name.strip_suffix("_wg_big") else {
            return name;
        };
        if !self.tma
            || !base.starts_with("conv_forward_nhwc")
            || tma::conv_forward_unfit(g, half).is_some()
        {
            return name;
        }
        let twin = format!("{base}_wg_tma_big");
        self.funcs
            .get_key_value(twin.as_str())
            .map_or(name, |(k, _)| *k)
    }

    /// Chooses the GEMM engine's tile height (see [`GemmTiles`]).
    pub fn set_gemm_tiles(&mut self, t: GemmTiles) {
        self.gemm_tiles = t;
        self.settings_changed();
    }

    /// Whether a product with `m` rows uses the 128-row tiles. `Auto` takes
    /// them where they pad no more rows than 64-row tiles do and, when
    /// `col_blocks` (64-column tiles × independent problems) is given, still
    /// make at least two blocks per SM; `None` means split-K will supply the
    /// blocks.
    fn wide_tiles(&self, m: usize, col_blocks: Option<usize>) -> bool {
        match self.gemm_tiles {
            GemmTiles::Auto => {
                let no_extra_rows = 2 * m.div_ceil(128) == m.div_ceil(64);
                let enough =
                    col_blocks.is_none_or(|c| m.div_ceil(128) * c >= 2 * self.sm_count() as usize);
                no_extra_rows && enough
            }
            GemmTiles::Narrow => false,
            GemmTiles::Wide => true,
        }
    }

    /// Whether a convolution data gradient uses the 128-row tiles: only when
    /// forced. 64 rows measured faster on every AlexNet layer (its gathered
    /// B operand gains less from the taller tile than it loses to the
    /// shallower pipeline).
    fn wide_tiles_data_grad(&self) -> bool {
        self.gemm_tiles == GemmTiles::Wide
    }

    /// The variant of a GEMM-engine kernel for the current precision and
    /// tile height, from the names [`gemm_names`] gives.
    fn gemm_kernel(&self, names: [&'static str; 6], wide: bool) -> &'static str {
        use crate::config::Precision;
        let i = match self.precision {
            Precision::Fp32 => 0,
            Precision::Tf32 => 1,
            Precision::Bf16 => 2,
        };
        names[i + if wide { 3 } else { 0 }]
    }

    /// Blocks of vector kernel `name` the whole GPU runs at once.
    fn wave(&self, name: &str) -> usize {
        self.resident.get(name).copied().unwrap_or(1) as usize * self.sm_count() as usize
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// Turns a launch or post-launch failure into an error naming the kernel
    /// and its shapes.
    fn kernel_error(&self, name: &str, what: &str, e: DriverError) -> anyhow::Error {
        anyhow!("kernel {name} ({what}) failed: {e}")
    }

    fn after_launch(&self, name: &'static str, what: &dyn Fn() -> String) -> Result<()> {
        if self.sync_each_launch {
            self.stream
                .synchronize()
                .map_err(|e| self.kernel_error(name, &what(), e))?;
        }
        if self.recorder.is_on() {
            self.recorder.launched(&self.ctx, &self.stream, name)?;
        }
        Ok(())
    }

    fn alloc_error(&self, what: &str, bytes: usize, e: DriverError) -> anyhow::Error {
        let oom = e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY;
        if oom {
            let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
            anyhow!(
                "out of GPU memory allocating {what} ({:.1} MiB; {:.1} of {:.1} GiB free on {}): try a smaller batch size",
                bytes as f64 / (1 << 20) as f64,
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                self.label
            )
        } else {
            anyhow!("allocating {what} ({bytes} bytes) failed: {e}")
        }
    }

    /// Runs `f` with a workspace of at least `len` floats.
    fn with_workspace<R>(
        &self,
        len: usize,
        f: impl FnOnce(&mut CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        let mut ws = self.workspace.lock().unwrap();
        if ws.as_ref().is_none_or(|w| w.len() < len) {
            self.before_replacing("split-K workspace", len * 4)?;
            *ws = None;
            let buf = unsafe { self.stream.alloc::<f32>(len) }
                .map_err(|e| self.alloc_error("split-K workspace", len * 4, e))?;
            *ws = Some(buf);
        }
        f(ws.as_mut().unwrap())
    }

    /// Frees the split-K workspace and the scratch buffers (launches that
    /// need them allocate them again); graphs captured before are stale.
    fn release_workspaces(&self) -> Result<()> {
        self.before_replacing("workspaces", 0)?;
        *self.workspace.lock().unwrap() = None;
        for s in &self.scratch {
            *s.lock().unwrap() = None;
        }
        self.synchronize()
    }

    /// Runs `f` with scratch buffer `slot` of at least `len` floats.
    fn with_scratch<R>(
        &self,
        slot: Scratch,
        len: usize,
        f: impl FnOnce(&mut CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        let mut buf = self.scratch[slot as usize].lock().unwrap();
        if buf.as_ref().is_none_or(|b| b.len() < len) {
            self.before_replacing("channels-last scratch", len * 4)?;
            *buf = None;
            let b = unsafe { self.stream.alloc::<f32>(len) }
                .map_err(|e| self.alloc_error("channels-last scratch", len * 4, e))?;
            *buf = Some(b);
        }
        f(buf.as_mut().unwrap())
    }

    /// Whether bf16 products read bf16 copies of their operands (default),
    /// or fp32 ones.
    pub fn set_operand_copies(&mut self, on: bool) {
        self.operand_copies = on;
        self.settings_changed();
    }

    /// Whether TF32 fc products read TF32-rounded operand copies (default
    /// off), or fp32 ones converted as fragments are read.
    pub fn set_tf32_copies(&mut self, on: bool) {
        self.tf32_copies = on;
        self.settings_changed();
    }

    /// Whether TF32 fc products read TF32-rounded operand copies.
    pub fn tf32_copies(&self) -> bool {
        self.tf32_copies
    }

    /// Whether the bf16 fc weight gradient reads bf16 copies of its
    /// operands (default off), or fp32 ones converted as fragments are read.
    pub fn set_fc_filter_copies(&mut self, on: bool) {
        self.fc_filter_copies = on;
        self.settings_changed();
    }

    /// Whether the bf16 fc weight gradient reads bf16 operand copies.
    pub fn fc_filter_copies(&self) -> bool {
        self.fc_filter_copies
    }

    /// `row_patches`, `row_patches_tf32` or `row_patches_bf16` (as `elem`
    /// says) of `src` into `dst` (see [`RowGeom`]).
    pub fn row_patches(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        g: &crate::backend::RowGeom,
        elem: Elem,
    ) -> Result<()> {
        layout::row_patches(self, src, dst, g, elem)
    }

    /// `pixel_grid_tf32` of `src` into `dst` (see [`GridGeom`]).
    pub fn pixel_grid_tf32(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        g: &crate::backend::GridGeom,
    ) -> Result<()> {
        layout::pixel_grid_tf32(self, src, dst, g)
    }

    /// `conv_phase_filters`: the filter bank of `g.phases()` (the data
    /// gradient by phases, [`ConvGeom::phases`]) from `g`'s `w` into `wp`.
    pub fn conv_phase_filters(
        &self,
        g: &ConvGeom,
        w: &CudaSlice<f32>,
        wp: &mut CudaSlice<f32>,
    ) -> Result<()> {
        conv::conv_phase_filters(self, g, w, wp)
    }

    /// `conv_phase_scatter`: `g`'s dx from the data gradient of
    /// `g.phases()` in `yp`; with `relu_of` = x, 0 where x ≤ 0.
    pub fn conv_phase_scatter(
        &self,
        g: &ConvGeom,
        yp: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
        relu_of: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        conv::conv_phase_scatter(self, g, yp, dx, relu_of)
    }

    /// `conv_backward_filter_sum`: dw of `g` (`[F][Cg][KH][KW]`) as the sum
    /// of `splits` partials in GEMM order at the start of `ws`
    /// (`[slice][f][(kh·KW + kw)·cgp + c]`, `cgp` ≥ Cg columns a tap, as
    /// the TMA weight gradients write them).
    pub fn conv_backward_filter_sum(
        &self,
        g: &ConvGeom,
        cgp: usize,
        ws: &CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        splits: u32,
    ) -> Result<()> {
        conv::filter_sum(self, g, cgp, ws, dw, splits, &|| {
            format!("{g:?} splits={splits}")
        })
    }

    /// `src` rounded to bf16 into `dst` (raw storage, two values per float).
    pub fn convert_bf16(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>) -> Result<()> {
        layout::convert_bf16(self, src, dst)
    }

    /// `src` rounded to TF32 into `dst` (fp32 storage, the low 13 bits
    /// zero).
    pub fn convert_tf32(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>) -> Result<()> {
        layout::convert_tf32(self, src, dst)
    }

    /// `dst[b][j][i] = src[b][i][j]` for `batches` row-major `rows × cols`
    /// matrices, stored as `elem` (the `transpose`, `transpose_tf32` and
    /// `transpose_bf16` kernels; `dst` may be longer than needed).
    pub fn transpose(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        [batches, rows, cols]: [usize; 3],
        elem: Elem,
    ) -> Result<()> {
        layout::transpose(self, src, dst, [batches, rows, cols], rows, elem, None)
    }

    /// `transpose` that also writes each source row's partial sums over
    /// tiles of 64 columns, `sums[b][i][tile]` (what the bias gradient adds
    /// up from dy's relayout).
    pub fn transpose_sums(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        [batches, rows, cols]: [usize; 3],
        elem: Elem,
        sums: &mut CudaSlice<f32>,
    ) -> Result<()> {
        layout::transpose(
            self,
            src,
            dst,
            [batches, rows, cols],
            rows,
            elem,
            Some(sums),
        )
    }
}

/// Launches `$name` on the backend's stream with the given arguments; `$what`
/// (a closure giving the shapes as text) goes into any error message.
/// The variants of a GEMM-engine kernel: fp32, tf32, bf16 with 64-row tiles,
/// then the same with 128-row tiles (`_wide`).
macro_rules! gemm_names {
    ($base:literal) => {
        [
            $base,
            concat!($base, "_tf32"),
            concat!($base, "_bf16"),
            concat!($base, "_wide"),
            concat!($base, "_tf32_wide"),
            concat!($base, "_bf16_wide"),
        ]
    };
}
pub(crate) use gemm_names;

macro_rules! launch {
    ($be:expr, $name:expr, $cfg:expr, $what:expr; $($arg:expr),* $(,)?) => {{
        let be: &$crate::backend::cuda::CudaBackend = $be;
        let what = $what;
        use cudarc::driver::PushKernelArg;
        let mut b = be.stream.launch_builder(be.func($name));
        $( b.arg($arg); )*
        unsafe { b.launch($cfg) }.map_err(|e| be.kernel_error($name, &what(), e))?;
        be.after_launch($name, &what)
    }};
}
pub(crate) use launch;

/// A 1-D grid-stride launch over `n` items: 256 threads a block, enough blocks
/// for every SM to hold several, never more than the items need.
fn grid_1d(be: &CudaBackend, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, be.sm_count as usize * 16);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Division by a divisor fixed at launch, as the kernels do it
/// (`gpu_kernels::device::FastDiv`, same layout): for `n < 2^31`,
/// `n / d = (mulhi(n, mul) + n) >> shr` with `shr = ⌈log2 d⌉` and
/// `mul = ⌊2^32·(2^shr − d)/d⌋ + 1` (CUTLASS's `FastDivmod`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FastDiv {
    d: u32,
    mul: u32,
    shr: u32,
}

// SAFETY: plain `repr(C)` words, passed by value to kernels.
unsafe impl cudarc::driver::DeviceRepr for FastDiv {}

impl FastDiv {
    /// `d` in `1..=2^31`.
    pub(crate) fn new(d: u32) -> Self {
        assert!(
            (1..=1 << 31).contains(&d),
            "FastDiv: divisor {d} out of range"
        );
        let shr = 32 - (d - 1).leading_zeros();
        let mul = (((1u64 << 32) * ((1u64 << shr) - d as u64)) / d as u64 + 1) as u32;
        FastDiv { d, mul, shr }
    }

    /// What the kernels compute (for the tests).
    #[cfg(test)]
    fn div(&self, n: u32) -> u32 {
        let hi = ((n as u64 * self.mul as u64) >> 32) as u32;
        (hi + n) >> self.shr
    }
}

fn check_len(what: &str, buf: &CudaSlice<f32>, want: usize) -> Result<()> {
    if buf.len() != want {
        bail!(
            "{what}: buffer holds {} floats, the shape needs {want}",
            buf.len()
        );
    }
    Ok(())
}

impl CudaBackend {
    /// A [`Staging`] slot of `len` floats. Its device buffer is allocated
    /// on the compute stream and waited for, so the upload stream may
    /// write it; both events start out recorded (nothing to wait for).
    fn staging_slot(&self, len: usize) -> Result<StagingSlot> {
        // Safety: the buffer is filled before any copy reads it.
        let host = unsafe { self.ctx.alloc_pinned::<f32>(len) }.map_err(|e| {
            anyhow!(
                "allocating {} MB of pinned host memory failed: {e}",
                (len * 4) >> 20
            )
        })?;
        // Safety: written by the upload before the compute stream reads it.
        let device = unsafe { self.stream.alloc::<f32>(len) }
            .map_err(|e| self.alloc_error("an upload buffer", len * 4, e))?;
        let used = self.stream.record_event(None).map_err(gpu_err)?;
        self.stream.synchronize().map_err(gpu_err)?;
        let copied = self.upload_stream.record_event(None).map_err(gpu_err)?;
        Ok(StagingSlot {
            host,
            device,
            copied,
            used,
        })
    }
}

impl Backend for CudaBackend {
    type Buf = DevBuf;
    type Labels = CudaSlice<i32>;
    type SgdTable = SgdTable;
    type Graph = StepGraph;

    fn name(&self) -> String {
        format!("{} ({})", self.label, self.precision)
    }
    fn zeros(&self, len: usize) -> Result<DevBuf> {
        self.stream
            .alloc_zeros::<f32>(len)
            .map(DevBuf::from)
            .map_err(|e| self.alloc_error("a buffer", len * 4, e))
    }
    fn arena(&self, plan: &crate::arena::ArenaPlan) -> Result<Vec<DevBuf>> {
        if !self.arena {
            return plan.lens.iter().map(|&len| self.zeros(len)).collect();
        }
        let whole = self
            .stream
            .alloc_zeros::<f32>(plan.total.max(1))
            .map_err(|e| self.alloc_error("the model's arena", plan.total * 4, e))?;
        let whole = std::sync::Arc::new(whole);
        Ok((0..plan.lens.len())
            .map(|i| DevBuf::part(&whole, &self.stream, plan.range(i)))
            .collect())
    }
    fn upload(&self, host: &[f32]) -> Result<DevBuf> {
        self.stream
            .clone_htod(host)
            .map(DevBuf::from)
            .map_err(|e| self.alloc_error("an upload", host.len() * 4, e))
    }
    fn write(&self, dst: &mut DevBuf, host: &[f32]) -> Result<()> {
        check_len("write", dst, host.len())?;
        // A second stream cannot join a graph being captured: writes then
        // stay on the compute stream.
        if !self.pinned_uploads
            || host.len() < STAGED_WRITE_MIN
            || self.capturing.load(std::sync::atomic::Ordering::SeqCst)
        {
            return self.stream.memcpy_htod(host, dst).map_err(gpu_err);
        }
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let index = staging.next;
        staging.next ^= 1;
        let slot = &mut staging.slots[index];
        if slot.as_ref().is_none_or(|s| s.host.len() != host.len()) {
            if let Some(old) = slot.take() {
                old.copied.synchronize().map_err(gpu_err)?;
            }
            *slot = Some(self.staging_slot(host.len())?);
        }
        let slot = slot.as_mut().expect("staging slot made above");
        // Waits until the previous copy out of the host buffer is done (its
        // own event is not recorded with event tracking off).
        slot.copied.synchronize().map_err(gpu_err)?;
        {
            use rayon::prelude::*;
            let pinned = slot.host.as_mut_slice().map_err(gpu_err)?;
            pinned
                .par_chunks_mut(1 << 16)
                .zip(host.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }
        if !self.upload_overlap {
            self.stream.memcpy_htod(&slot.host, dst).map_err(gpu_err)?;
            return slot.copied.record(&self.stream).map_err(gpu_err);
        }
        let up = &self.upload_stream;
        up.wait(&slot.used).map_err(gpu_err)?;
        up.memcpy_htod(&slot.host, &mut slot.device)
            .map_err(gpu_err)?;
        slot.copied.record(up).map_err(gpu_err)?;
        self.stream.wait(&slot.copied).map_err(gpu_err)?;
        self.stream
            .memcpy_dtod(&slot.device, dst)
            .map_err(gpu_err)?;
        slot.used.record(&self.stream).map_err(gpu_err)
    }
    fn download(&self, buf: &DevBuf) -> Result<Vec<f32>> {
        let v = self.stream.clone_dtoh(buf).map_err(gpu_err)?;
        self.stream.synchronize().map_err(gpu_err)?;
        Ok(v)
    }
    fn upload_labels(&self, host: &[i32]) -> Result<CudaSlice<i32>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.alloc_error("labels", host.len() * 4, e))
    }
    fn write_labels(&self, dst: &mut CudaSlice<i32>, host: &[i32]) -> Result<()> {
        if dst.len() != host.len() {
            bail!(
                "write_labels: buffer holds {} labels, got {}",
                dst.len(),
                host.len()
            );
        }
        self.stream.memcpy_htod(host, dst).map_err(gpu_err)
    }
    fn len(&self, buf: &DevBuf) -> usize {
        buf.len()
    }
    fn copy_block(&self, b: &BlockCopy, src: &DevBuf, dst: &mut DevBuf) -> Result<()> {
        copy::copy_block(self, b, src, dst)
    }
    fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        self.time_events(warmup, reps, f)
    }
    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }
    fn start_launch_profile(&self) -> Result<bool> {
        self.recorder.start(&self.ctx, &self.stream)?;
        Ok(true)
    }
    fn set_profile_label(&self, label: &str) {
        self.recorder.set_label(label);
    }
    fn finish_launch_profile(&self) -> Result<Vec<LaunchTime>> {
        self.recorder.finish(&self.stream)
    }
    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| {
            anyhow!("GPU work failed: {e} (set ALEXNET_SYNC_LAUNCHES=1 to find the kernel)")
        })
    }

    fn conv_forward(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        conv::conv_forward(self, g, x, w, bias, y, false, None)
    }
    fn conv_forward_relu(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        conv::conv_forward(self, g, x, w, bias, y, true, None)
    }
    fn conv_kept_len(&self, g: &ConvGeom) -> usize {
        conv::kept_len(self, g)
    }
    fn autotune_conv(&self, g: &ConvGeom, data: bool) -> Result<Vec<TunedKernel>> {
        if !self.autotune {
            return Ok(Vec::new());
        }
        conv::autotune(self, g, data)
    }
    fn conv_forward_keep(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: &Self::Buf,
        y: &mut Self::Buf,
        relu: bool,
        kept: &mut Self::Buf,
    ) -> Result<()> {
        conv::conv_forward(self, g, x, w, bias, y, relu, Some(kept))
    }
    fn conv_backward_data(
        &self,
        g: &ConvGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        conv::conv_backward_data(self, g, dy, w, dx, None)
    }
    fn conv_backward_filter(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        dy: &Self::Buf,
        dw: &mut Self::Buf,
    ) -> Result<()> {
        conv::conv_backward_filter(self, g, x, None, dy, dw, None)
    }
    fn conv_backward_bias(&self, g: &ConvGeom, dy: &Self::Buf, db: &mut Self::Buf) -> Result<()> {
        conv::conv_backward_bias(self, g, dy, db)
    }
    fn conv_backward(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        dy: &Self::Buf,
        w: &Self::Buf,
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        dx: Option<&mut Self::Buf>,
        relu: bool,
    ) -> Result<()> {
        conv::conv_backward(self, g, x, None, dy, w, dw, db, dx.map(|d| &mut **d), relu)
    }
    fn conv_backward_kept(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        kept: &Self::Buf,
        dy: &Self::Buf,
        w: &Self::Buf,
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        dx: Option<&mut Self::Buf>,
        relu: bool,
    ) -> Result<()> {
        conv::conv_backward(
            self,
            g,
            x,
            Some(kept),
            dy,
            w,
            dw,
            db,
            dx.map(|d| &mut **d),
            relu,
        )
    }
    fn fc_forward(
        &self,
        g: &FcGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        gemm::fc_forward(self, g, x, w, b, y, None)
    }
    fn fc_kept_len(&self, g: &FcGeom) -> usize {
        gemm::kept_len(self, g)
    }
    #[allow(clippy::too_many_arguments)] // the layer's tensors and the copy
    fn fc_forward_keep(
        &self,
        g: &FcGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        y: &mut Self::Buf,
        kept: &mut Self::Buf,
        fresh: bool,
    ) -> Result<()> {
        gemm::fc_forward(self, g, x, w, b, y, Some((kept, fresh)))
    }
    fn fc_backward_data_kept(
        &self,
        g: &FcGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        kept: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        gemm::fc_backward_data(self, g, dy, w, Some(kept), dx)
    }
    fn fc_backward_data(
        &self,
        g: &FcGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        gemm::fc_backward_data(self, g, dy, w, None, dx)
    }
    fn fc_backward_filter(
        &self,
        g: &FcGeom,
        x: &Self::Buf,
        dy: &Self::Buf,
        dw: &mut Self::Buf,
    ) -> Result<()> {
        gemm::fc_backward_filter(self, g, x, dy, dw)
    }
    fn fc_backward_bias(&self, g: &FcGeom, dy: &Self::Buf, db: &mut Self::Buf) -> Result<()> {
        gemm::fc_backward_bias(self, g, dy, db)
    }
    fn relu_forward(&self, y: &mut Self::Buf) -> Result<()> {
        activation::relu_forward(self, y)
    }
    fn relu_backward(&self, y: &Self::Buf, d: &mut Self::Buf) -> Result<()> {
        activation::relu_backward(self, y, d)
    }
    fn lrn_forward(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &mut Self::Buf,
        scale: &mut Self::Buf,
    ) -> Result<()> {
        lrn::lrn_forward(self, p, x, y, scale)
    }
    fn lrn_backward(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &Self::Buf,
        scale: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        lrn::lrn_backward(self, p, x, y, scale, dy, dx, false)
    }
    fn lrn_backward_relu(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &Self::Buf,
        scale: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        lrn::lrn_backward(self, p, x, y, scale, dy, dx, true)
    }
    fn lrn_pool_fusable(&self, p: &LrnParams, g: &PoolGeom) -> bool {
        self.fuse_lrn_pool && lrn::fusable(p, g)
    }
    fn lrn_pool_forward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Self::Buf,
        z: &mut Self::Buf,
        arg: &mut Self::Buf,
    ) -> Result<()> {
        lrn::lrn_pool_forward(self, p, g, x, z, arg)
    }
    fn lrn_pool_backward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Self::Buf,
        arg: &Self::Buf,
        dz: &Self::Buf,
        dx: &mut Self::Buf,
        relu: bool,
    ) -> Result<()> {
        lrn::lrn_pool_backward(self, p, g, x, arg, dz, dx, relu)
    }
    fn maxpool_forward(
        &self,
        g: &PoolGeom,
        x: &Self::Buf,
        y: &mut Self::Buf,
        arg: &mut Self::Buf,
    ) -> Result<()> {
        pool::maxpool_forward(self, g, x, y, arg)
    }
    fn maxpool_backward(
        &self,
        g: &PoolGeom,
        arg: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        pool::maxpool_backward(self, g, arg, dy, None, dx)
    }
    fn maxpool_backward_relu(
        &self,
        g: &PoolGeom,
        arg: &Self::Buf,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        check_len("maxpool_backward x", x, g.x_len())?;
        pool::maxpool_backward(self, g, arg, dy, Some(y), dx)
    }
    fn dropout_forward(&self, p: &DropoutParams, y: &mut Self::Buf) -> Result<()> {
        dropout::dropout_forward(self, p, y)
    }
    fn dropout_backward(&self, p: &DropoutParams, d: &mut Self::Buf) -> Result<()> {
        dropout::dropout_backward(self, p, d)
    }
    fn softmax_xent_forward(
        &self,
        n: usize,
        classes: usize,
        logits: &Self::Buf,
        labels: &Self::Labels,
        probs: &mut Self::Buf,
        loss: &mut Self::Buf,
    ) -> Result<()> {
        loss::softmax_xent_forward(self, n, classes, logits, labels, probs, loss)
    }
    fn softmax_xent_backward(
        &self,
        n: usize,
        classes: usize,
        probs: &Self::Buf,
        labels: &Self::Labels,
        dlogits: &mut Self::Buf,
    ) -> Result<()> {
        loss::softmax_xent_backward(self, n, classes, probs, labels, dlogits)
    }
    fn label_rank(
        &self,
        n: usize,
        classes: usize,
        scores: &Self::Buf,
        labels: &Self::Labels,
        rank: &mut Self::Buf,
    ) -> Result<()> {
        loss::label_rank(self, n, classes, scores, labels, rank)
    }
    fn sgd_update_all(
        &self,
        p: &SgdParams,
        tensors: &mut [SgdTensor<'_, Self::Buf>],
        table: &mut SgdTable,
    ) -> Result<()> {
        optimizer::sgd_update_all(self, p, tensors, table)
    }
    fn no_graphs_reason(&self) -> Option<String> {
        self.sync_each_launch
            .then(|| "ALEXNET_SYNC_LAUNCHES=1 synchronises every launch".to_string())
    }
    fn capture(&self, args: &StepArgs, f: &mut dyn FnMut() -> Result<()>) -> Result<StepGraph> {
        graph::capture(self, args, f)
    }
    fn graph_current(&self, g: &StepGraph) -> bool {
        graph::graph_current(self, g)
    }
    fn buffers_generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }
    unsafe fn replay(&self, g: &StepGraph, args: &StepArgs) -> Result<()> {
        graph::replay(self, g, args)
    }
}

/// The device address of a buffer that a kernel both reads and writes (an
/// in-place op passes it twice). Valid while `buf` lives; the backend's single
/// stream orders every use.
fn inplace_ptr(be: &CudaBackend, buf: &mut CudaSlice<f32>) -> u64 {
    use cudarc::driver::DevicePtrMut;
    buf.device_ptr_mut(&be.stream).0
}

impl CudaBackend {
    /// Times `f` with CUDA events on the backend's stream: `warmup` untimed
    /// calls, then `reps` calls each between two events. Returns the
    /// milliseconds of each timed call.
    pub fn time_events(
        &self,
        warmup: usize,
        reps: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        for _ in 0..warmup {
            f()?;
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let events = (0..=reps)
            .map(|_| self.ctx.new_event(flags).map_err(gpu_err))
            .collect::<Result<Vec<_>>>()?;
        events[0].record(&self.stream).map_err(gpu_err)?;
        for e in &events[1..] {
            f()?;
            e.record(&self.stream).map_err(gpu_err)?;
        }
        self.synchronize()?;
        events
            .windows(2)
            .map(|w| w[0].elapsed_ms(&w[1]).map_err(gpu_err))
            .collect()
    }

    /// `len` floats uniform in [−1, 1) from a xorshift stream keyed by
    /// `seed` (operands for benchmarks and the autotune's timings).
    pub fn random(&self, len: usize, seed: u64) -> Result<DevBuf> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        self.upload(&v)
    }

    /// A buffer filled with NaN, for tests that check every output is written.
    pub fn poisoned(&self, len: usize) -> Result<DevBuf> {
        self.upload(&vec![f32::NAN; len])
    }
}

#[cfg(test)]
mod tests {
    use super::{FastDiv, KERNELS, StridedData, TmaFilter, WG_KERNELS};

    /// `ALEXNET_STRIDED_DATA`: phases unless set; a value it does not know
    /// is an error that names it.
    #[test]
    fn strided_data_setting() {
        let parse = |v: Option<&str>| StridedData::parse(v.map(String::from));
        assert_eq!(parse(None).unwrap(), StridedData::Phases);
        assert_eq!(parse(Some("phases")).unwrap(), StridedData::Phases);
        assert_eq!(parse(Some("columns")).unwrap(), StridedData::Columns);
        assert_eq!(parse(Some("gather")).unwrap(), StridedData::Gather);
        let e = parse(Some("cols")).unwrap_err().to_string();
        assert!(
            e.contains("ALEXNET_STRIDED_DATA") && e.contains("cols"),
            "{e}"
        );
    }

    /// `ALEXNET_TMA_FILTER`: wide unless set; a value it does not know is
    /// an error that names it.
    #[test]
    fn tma_filter_setting() {
        let parse = |v: Option<&str>| TmaFilter::parse(v.map(String::from));
        assert_eq!(parse(None).unwrap(), TmaFilter::Wide);
        assert_eq!(parse(Some("bf16")).unwrap(), TmaFilter::Bf16);
        assert_eq!(parse(Some("0")).unwrap(), TmaFilter::Off);
        assert_eq!(parse(Some("wide")).unwrap(), TmaFilter::Wide);
        assert_eq!(parse(Some("1")).unwrap(), TmaFilter::All);
        assert_eq!(parse(Some("all")).unwrap(), TmaFilter::All);
        let e = parse(Some("tf32")).unwrap_err().to_string();
        assert!(
            e.contains("ALEXNET_TMA_FILTER") && e.contains("tf32"),
            "{e}"
        );
    }

    /// The kernel a PTX line opens, if it is a `.visible .entry` line.
    fn entry_name(line: &str) -> Option<&str> {
        let rest = line.strip_prefix(".visible .entry ")?;
        Some(rest.split('(').next().unwrap_or(rest).trim())
    }

    fn entries(ptx: &str) -> Vec<&str> {
        ptx.lines().filter_map(entry_name).collect()
    }

    /// Both embedded modules hold every kernel the backend loads; the
    /// warpgroup kernels are in the Hopper module only (the portable one
    /// must load on any sm_70+ GPU), and only that module targets sm_90a.
    #[test]
    fn embedded_modules_hold_the_expected_kernels() {
        let (base, hopper) = (entries(crate::PTX), entries(crate::PTX_SM90A));
        for k in KERNELS {
            assert!(base.contains(k), "{k} missing from the portable module");
            assert!(hopper.contains(k), "{k} missing from the sm_90a module");
        }
        for k in WG_KERNELS {
            assert!(hopper.contains(k), "{k} missing from the sm_90a module");
            assert!(!base.contains(k), "{k} is in the portable module");
        }
        assert!(crate::PTX_SM90A.contains(".target sm_90a"));
        assert!(!crate::PTX.contains("wgmma"));
    }

    /// Every TMA-fed kernel tells ptxas its block size (`.maxntid`, added by
    /// `build.rs`), the one the launchers use, so that it never takes more
    /// registers than a block of that size can have.
    #[test]
    fn tma_kernels_declare_their_block_size() {
        let want = format!(")\n.maxntid {}, 1, 1\n{{", super::gemm::WG_TMA_THREADS);
        let ptx = crate::PTX_SM90A;
        let tma: Vec<_> = entries(ptx)
            .into_iter()
            .filter(|k| k.ends_with("_wg_tma_big"))
            .collect();
        assert!(tma.len() >= 6, "{tma:?}");
        for k in tma {
            let at = ptx.find(&format!(".entry {k}(")).unwrap();
            let body = at + ptx[at..].find('{').unwrap();
            assert!(
                ptx[..body + 1].ends_with(&want),
                "{k} has no .maxntid of its block"
            );
        }
    }

    /// Every TMA-fed kernel is allowed its shared memory at load time (the
    /// TF32 grid weight gradient, whose name has no `_nhwc`, once was not:
    /// its launch failed with an invalid argument).
    #[test]
    fn tma_kernels_get_their_shared_memory() {
        for k in WG_KERNELS.iter().filter(|k| k.contains("_tma")) {
            assert!(super::gemm::is_vec_kernel(k), "{k}");
        }
    }

    /// The backend loads every kernel the modules hold: a kernel left out
    /// of the lists is never resolved, and the launchers that look it up
    /// quietly take another path (the TMA weight gradients did, once).
    #[test]
    fn every_kernel_in_the_modules_is_loaded() {
        for (module, ptx) in [("portable", crate::PTX), ("sm_90a", crate::PTX_SM90A)] {
            for k in entries(ptx) {
                assert!(
                    KERNELS.contains(&k) || WG_KERNELS.contains(&k),
                    "{k} of the {module} module is in neither KERNELS nor WG_KERNELS"
                );
            }
        }
    }

    /// Kernels of `ptx` whose bodies mention the `.local` state space.
    fn local_memory_kernels(ptx: &str) -> Vec<&str> {
        let mut kernel = "";
        let mut found = Vec::new();
        for line in ptx.lines() {
            if let Some(name) = entry_name(line) {
                kernel = name;
            } else if line.contains(".local") && found.last() != Some(&kernel) {
                found.push(kernel);
            }
        }
        found
    }

    /// No kernel of either module uses local memory: in these kernels it
    /// only ever meant register arrays indexed by a loop LLVM did not
    /// unroll (operand cursors, accumulators), which made the transposed
    /// conv products 2× slower once (`benches/NOTES.md`, `…-v18/`).
    #[test]
    fn no_kernel_spills_to_local_memory() {
        let sample = ".visible .entry ok(\n)\n{\n\tret;\n}\n\
                      .visible .entry bad(\n)\n{\n\t.local .align 4 .b8 __local_depot0[64];\n\tret;\n}\n";
        assert_eq!(local_memory_kernels(sample), ["bad"]);
        for (module, ptx) in [("portable", crate::PTX), ("sm_90a", crate::PTX_SM90A)] {
            let found = local_memory_kernels(ptx);
            assert!(
                found.is_empty(),
                "local memory in the {module} module: {found:?}"
            );
        }
    }

    /// `build.rs` caps `lrn_pool_forward` at 64 registers (4 blocks of 256
    /// threads per SM instead of 3; `…-v20/`), in both modules, and the
    /// directive sits between the parameter list and the body, where PTX
    /// takes it.
    #[test]
    fn lrn_pool_forward_is_capped_at_64_registers() {
        for (module, ptx) in [("portable", crate::PTX), ("sm_90a", crate::PTX_SM90A)] {
            let at = ptx
                .find(".entry lrn_pool_forward(")
                .unwrap_or_else(|| panic!("no lrn_pool_forward in the {module} module"));
            let head = &ptx[at..at + ptx[at..].find('{').unwrap()];
            assert!(
                head.trim_end().ends_with(")\n.maxnreg 64"),
                "{module} module: lrn_pool_forward's header is {head:?}"
            );
        }
    }

    /// The kernels' division agrees with `/` for numerators below 2^31:
    /// every small divisor, powers of two and their neighbours, and the
    /// divisors the pooling kernels use, each over edge and sampled
    /// numerators.
    #[test]
    fn fast_div_matches_division() {
        let mut divisors: Vec<u32> = (1..=300).collect();
        for k in 1..=31 {
            let p = 1u32 << k;
            divisors.extend([p - 1, p, p.saturating_add(1)]);
        }
        divisors.extend([
            729,
            3025,
            169,
            49,
            36,
            784,
            196,
            65_535,
            1_000_003,
            i32::MAX as u32,
        ]);
        let max = i32::MAX as u32;
        for &d in divisors.iter().filter(|&&d| (1..=1 << 31).contains(&d)) {
            let f = FastDiv::new(d);
            let mut ns: Vec<u32> = vec![0, 1, d - 1, d, d.saturating_add(1), max - 1, max];
            ns.extend((1..64u32).map(|k| d.saturating_mul(k).min(max)));
            ns.extend((1..64u32).map(|k| d.saturating_mul(k).min(max).saturating_sub(1)));
            let mut s = 0x9E37_79B9u32 ^ d;
            for _ in 0..2000 {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                ns.push(s & max);
            }
            for n in ns.into_iter().filter(|&n| n <= max) {
                assert_eq!(f.div(n), n / d, "{n} / {d} ({f:?})");
            }
        }
    }
}
