//! Launchers for the implicit-GEMM convolution kernels (`conv_forward`,
//! `conv_backward_data`, `conv_backward_filter` + `splitk_reduce`) and
//! `conv_backward_bias` (blocks per channel and slice of the images,
//! partials summed by `splitk_reduce`; in the whole backward it sums the
//! per-channel partial sums that dy's relayout wrote instead of dy).
//!
//! In TF32 and bf16, a product whose channel counts allow it (C_in/G for the
//! forward and weight gradient, C_out/G for the data gradient and weight
//! gradient, multiples of 4) takes the channels-last path: x and dy are
//! transposed to NHWC and the filter bank to the product's k order in
//! scratch buffers (`transpose_tf32` in TF32, which rounds the copies to
//! TF32 once so that the kernels convert nothing), and the `*_nhwc` kernels
//! copy 16-byte vectors of channels. Results come out in the usual
//! layouts. A forward given a buffer for it (`conv_forward_keep`) keeps its
//! copy of x there for the weight gradient (`kept_copy`). In bf16, where
//! the channel counts are multiples of 8, the copies are bf16
//! (`transpose_bf16`; `*_nhwc16_bf16` kernels), halving the bytes and
//! skipping the conversion in the inner loop.
//!
//! One-group layers whose channels rule that out (conv1's 3) take the
//! row-patch path in TF32 and bf16 instead: x and the filter bank are cut
//! into the rows of their windows (`row_patches`, rows padded to whole
//! vectors) and the `*_rows` kernels read those rows as vectors (forward
//! and weight gradient; conv1 has no data gradient). Padding conv1 to 4
//! channels on the channels-last path had measured 1.5–1.8× slower.
//!
//! The weight gradient's GEMM has a small result (C_out/G × C_in/G·KH·KW) and a
//! huge reduction (N·OH·OW), so it is split over K until the grid fills one
//! wave of the kernel (its occupancy from the driver); the slices' partials
//! land in a workspace and `splitk_reduce` adds them in a fixed order,
//! keeping results deterministic.

use super::gemm::{VecTile, grid, tiles, vec_cfg};
use super::layout::{Elem, TRANSPOSE_COLS, row_patches, transpose};
use super::tma::{TmaProduct, grid_box};
use super::{
    CudaBackend, DevBuf, FastDiv, Scratch, StridedData, check_len, gemm_names, grid_1d, launch,
};
use crate::backend::{ConvGeom, GridGeom, RowGeom, TunedKernel};
use anyhow::Result;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// Mirror of `gpu_kernels::conv::ConvShape` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvShape {
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad: u32,
    groups: u32,
    oh: u32,
    ow: u32,
    relu: u32,
}

unsafe impl DeviceRepr for ConvShape {}

fn shape(g: &ConvGeom) -> Result<ConvShape> {
    g.check()?;
    Ok(ConvShape {
        n: g.n as u32,
        c_in: g.c_in as u32,
        h: g.h as u32,
        w: g.w as u32,
        c_out: g.c_out as u32,
        kh: g.k_h as u32,
        kw: g.k_w as u32,
        stride: g.stride as u32,
        pad: g.pad as u32,
        groups: g.groups as u32,
        oh: g.out_h() as u32,
        ow: g.out_w() as u32,
        relu: 0,
    })
}

#[allow(clippy::too_many_arguments)] // the layer's tensors and the copy
pub(super) fn conv_forward(
    be: &CudaBackend,
    g: &ConvGeom,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    relu: bool,
    keep: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let s = ConvShape {
        relu: relu as u32,
        ..shape(g)?
    };
    check_len("conv_forward x", x, g.x_len())?;
    check_len("conv_forward w", w, g.w_len())?;
    check_len("conv_forward bias", bias, g.c_out)?;
    check_len("conv_forward y", y, g.y_len())?;
    let what = || format!("{g:?}");
    let (cg, kk) = (g.c_in / g.groups, g.k_h * g.k_w);
    let plan = forward_plan(be, g);
    let keep = keep.filter(|k| plan.x_copy().is_some_and(|c| holds_kept(be, g, c, k)));
    match plan {
        ForwardPlan::Gemm { name, cfg } => launch!(be, name, cfg, what; &s, x, w, bias, y),
        ForwardPlan::Rows { plan: p, rw } => {
            XCopy::Rows { half: p.half, rw }.with(be, g, x, keep, |xc| {
                let wg = RowGeom::filters(g, rw);
                cut_rows(
                    be,
                    Scratch::W,
                    w,
                    &wg,
                    p.half,
                    |wr| launch!(be, p.name, p.cfg, what; &s, xc, wr, bias, y),
                )
            })
        }
        ForwardPlan::Vec(p) => XCopy::Nhwc { half: p.half }.with(be, g, x, keep, |xc| {
            relayout(be, Scratch::W, w, [g.c_out, cg, kk], cg, p.half, |wt| {
                if p.name.contains("_tma") {
                    let maps = be.conv_tma_maps(g, TmaProduct::Forward, xc, wt, p.half)?;
                    let (cfg, ring) = be.tma_cfg(p.name, p.cfg)?;
                    launch!(be, p.name, cfg, what; &s, &maps, &ring, bias, y)
                } else {
                    launch!(be, p.name, p.cfg, what; &s, xc, wt, bias, y)
                }
            })
        }),
    }
}

/// The forward's kernel for a shape: on the vector engine from window rows
/// `rw` long (conv1) or from x in NHWC, or on the NCHW GEMM engine.
enum ForwardPlan {
    Rows {
        plan: VecPlan,
        rw: usize,
    },
    Vec(VecPlan),
    Gemm {
        name: &'static str,
        cfg: LaunchConfig,
    },
}

impl ForwardPlan {
    /// The operand copy of x the forward reads, if any.
    fn x_copy(&self) -> Option<XCopy> {
        match self {
            ForwardPlan::Rows { plan, rw } => Some(XCopy::Rows {
                half: plan.half,
                rw: *rw,
            }),
            ForwardPlan::Vec(plan) => Some(XCopy::Nhwc { half: plan.half }),
            ForwardPlan::Gemm { .. } => None,
        }
    }
}

fn forward_plan(be: &CudaBackend, g: &ConvGeom) -> ForwardPlan {
    let k = be.knobs(Product::Forward, g);
    let (fg, pixels) = (g.c_out / g.groups, g.n * g.out_h() * g.out_w());
    // The TMA kernels' 128×128 tiles, where they fit, beat the others even
    // where they pad the filters (conv4's 192 a group: 0.36 → 0.18 ms in
    // TF32 on the H200, benches/NOTES.md), so they skip the tile heuristics.
    let tma = be.tma_forward_fits(g) && k.big != Some(false) && k.transposed != Transposed::All;
    let (cfg, wide) = if tma {
        (grid(fg, pixels, g.groups, true), true)
    } else {
        tiles(be, fg, pixels, g.groups)
    };
    if let Some((name, half, rw)) = row_path(be, k, g, "conv_forward", wide, Some(cfg.grid_dim)) {
        let cfg = vec_cfg(cfg, name);
        let plan = VecPlan { name, half, cfg };
        return ForwardPlan::Rows { plan, rw };
    }
    let cg = g.c_in / g.groups;
    let fits = [cg.is_multiple_of(4), cg.is_multiple_of(8)];
    if !tma && let Some(plan) = transposed(be, k, "conv_forward_nhwc", fg, pixels, g.groups, fits) {
        return ForwardPlan::Vec(plan);
    }
    let grid = (!tma).then_some(cfg.grid_dim);
    if let Some((name, half)) = channels_last(be, k, "conv_forward", fits, wide, grid) {
        let name = be.tma_twin(name, g, half);
        let cfg = vec_cfg(cfg, name);
        return ForwardPlan::Vec(VecPlan { name, half, cfg });
    }
    let name = be.gemm_kernel(gemm_names!("conv_forward"), wide);
    ForwardPlan::Gemm { name, cfg }
}

/// Which product of a convolution a kernel choice is for. (The weight
/// gradient is not tuned: its split over K follows the tile, so another
/// tile would sum in another order, and its tiles measured within 1%.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Product {
    Forward,
    Data,
}

/// Where the transposed (pixels × channels) channels-last products run: not
/// at all, where the usual tiles would pad the channels (the default), or
/// also on any multiple of 64 channels (an autotune candidate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Transposed {
    Off,
    Padded,
    All,
}

/// The choices a product's plan makes beyond its shape: the backend's
/// settings (`ALEXNET_TRANSPOSED`, `ALEXNET_BIG_TILES`) unless the autotune
/// picked others for that shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Knobs {
    pub(super) transposed: Transposed,
    /// As `CudaBackend::big_tiles`.
    pub(super) big: Option<bool>,
}

/// Every setting the autotune tries (the plans many of them give coincide).
const TUNE_KNOBS: [Knobs; 9] = {
    let (t, b) = (
        [Transposed::Padded, Transposed::Off, Transposed::All],
        [None, Some(true), Some(false)],
    );
    let mut out = [Knobs {
        transposed: Transposed::Padded,
        big: None,
    }; 9];
    let mut i = 0;
    while i < 9 {
        out[i] = Knobs {
            transposed: t[i / 3],
            big: b[i % 3],
        };
        i += 1;
    }
    out
};

/// Timed runs per autotune candidate (after one warm-up run).
const TUNE_REPS: usize = 5;

/// The kernel and grid `product` of `g` runs under the current knobs
/// (`"gemm"`: the NCHW engine's data gradient).
fn chosen(be: &CudaBackend, product: Product, g: &ConvGeom) -> (&'static str, (u32, u32, u32)) {
    match product {
        Product::Forward => match forward_plan(be, g) {
            ForwardPlan::Rows { plan, .. } | ForwardPlan::Vec(plan) => {
                (plan.name, plan.cfg.grid_dim)
            }
            ForwardPlan::Gemm { name, cfg } => (name, cfg.grid_dim),
        },
        Product::Data if by_columns(be, g) => {
            let (name, cfg) = cols_plan(be, g, g.n);
            (name, cfg.grid_dim)
        }
        Product::Data if by_phases(be, g) => chosen(be, product, &g.phases()),
        Product::Data => {
            data_channels_last(be, g).map_or(("gemm", (0, 0, 0)), |p| (p.name, p.cfg.grid_dim))
        }
    }
}

/// A plan (kernel, grid) and the knobs that give it (`None`: the
/// backend's own settings).
type Candidate = ((&'static str, (u32, u32, u32)), Option<Knobs>);

/// The distinct plans `product` of `g` can run under the knobs the autotune
/// tries, the heuristic's first (leaves no choice set for it).
fn candidates(be: &CudaBackend, product: Product, g: &ConvGeom) -> Vec<Candidate> {
    let (product, g) = tuned_as(be, product, g);
    let g = &g;
    be.set_knobs(product, g, None);
    let mut cands = vec![(chosen(be, product, g), None)];
    for k in TUNE_KNOBS {
        if !allowed(k, be.transposed, be.big_tiles) {
            continue;
        }
        be.set_knobs(product, g, Some(k));
        let plan = chosen(be, product, g);
        if !cands.iter().any(|(p, _)| *p == plan) {
            cands.push((plan, Some(k)));
        }
    }
    be.set_knobs(product, g, None);
    cands
}

/// The product and shape whose knobs choose `product` of `g`'s kernel: a
/// strided data gradient by phases runs a stride-1 one's.
fn tuned_as(be: &CudaBackend, product: Product, g: &ConvGeom) -> (Product, ConvGeom) {
    match product {
        Product::Data if by_phases(be, g) => (product, g.phases()),
        _ => (product, *g),
    }
}

/// Whether the autotune may try `k` under the backend's settings: a
/// setting forced from outside (`ALEXNET_TRANSPOSED=0`, `ALEXNET_BIG_TILES`)
/// holds; only what is left to the heuristic is tuned.
fn allowed(k: Knobs, transposed: bool, big: Option<bool>) -> bool {
    (transposed || k.transposed == Transposed::Off) && (big.is_none() || k.big == big)
}

/// Runs `f` once under each of `product`'s candidate plans for `g` (that
/// plan set meanwhile), with the plan's kernel name; the heuristic's plan
/// is set again after. For tests: each candidate must be right.
pub(super) fn for_each_candidate(
    be: &CudaBackend,
    product: Product,
    g: &ConvGeom,
    mut f: impl FnMut(&str) -> Result<()>,
) -> Result<usize> {
    let cands = candidates(be, product, g);
    let (tp, tg) = tuned_as(be, product, g);
    let result = cands.iter().try_for_each(|&((name, _), k)| {
        be.set_knobs(tp, &tg, k);
        f(name)
    });
    be.set_knobs(tp, &tg, None);
    result.map(|()| cands.len())
}

/// Random operands of one convolution shape for the autotune's timings.
struct TuneBufs {
    x: DevBuf,
    w: DevBuf,
    bias: DevBuf,
    y: DevBuf,
    dx: DevBuf,
}

impl TuneBufs {
    fn new(be: &CudaBackend, g: &ConvGeom) -> Result<Self> {
        Ok(Self {
            x: be.random(g.x_len(), 1)?,
            w: be.random(g.w_len(), 2)?,
            bias: be.random(g.c_out, 3)?,
            y: be.random(g.y_len(), 4)?,
            dx: be.random(g.x_len(), 5)?,
        })
    }

    /// One run of `product` as the model runs it (forward with its ReLU,
    /// data gradient through the ReLU before it); `y` stands in for dy.
    fn run(&mut self, be: &CudaBackend, g: &ConvGeom, product: Product) -> Result<()> {
        match product {
            Product::Forward => {
                conv_forward(be, g, &self.x, &self.w, &self.bias, &mut self.y, true, None)
            }
            Product::Data => {
                conv_backward_data(be, g, &self.y, &self.w, &mut self.dx, Some(&self.x))
            }
        }
    }
}

/// Times every distinct kernel choice of `g`'s forward and data gradient
/// (with `data`) and keeps the fastest for that shape: what cuDNN's
/// benchmark mode does. The heuristic plan is the first candidate and
/// stays unless another is faster. A product's candidates differ in tile
/// shape and operand roles, not in any output's order of summation, so
/// the choice does not change results (`gpu_ops conv_autotune` checks them
/// bit for bit). Returns the products that had a choice.
pub(super) fn autotune(be: &CudaBackend, g: &ConvGeom, data: bool) -> Result<Vec<TunedKernel>> {
    shape(g)?;
    let mut bufs: Option<TuneBufs> = None;
    let mut out = Vec::new();
    for (product, label) in [
        (Product::Forward, "forward"),
        (Product::Data, "data gradient"),
    ] {
        if product == Product::Data && !data {
            continue;
        }
        let logged = be.tune_log.lock().unwrap().get(&(product, *g)).cloned();
        if let Some(t) = logged {
            out.push(t);
            continue;
        }
        let cands = candidates(be, product, g);
        if cands.len() < 2 {
            continue;
        }
        let (tp, tg) = tuned_as(be, product, g);
        let b = match &mut bufs {
            Some(b) => b,
            None => bufs.insert(TuneBufs::new(be, g)?),
        };
        let mut times = Vec::with_capacity(cands.len());
        for &(_, k) in &cands {
            be.set_knobs(tp, &tg, k);
            let mut t = be.time_events(1, TUNE_REPS, || b.run(be, g, product))?;
            t.sort_by(f32::total_cmp);
            times.push(t[t.len() / 2]);
        }
        let best = (0..cands.len())
            .min_by(|&i, &j| times[i].total_cmp(&times[j]))
            .unwrap_or(0);
        be.set_knobs(tp, &tg, cands[best].1);
        let t = TunedKernel {
            product: label.to_string(),
            kernel: cands[best].0.0.to_string(),
            ms: times[best],
            heuristic_kernel: cands[0].0.0.to_string(),
            heuristic_ms: times[0],
            candidates: cands.len(),
        };
        be.tune_log.lock().unwrap().insert((product, *g), t.clone());
        out.push(t);
    }
    if bufs.is_some() {
        // The losing candidates' workspaces go; the model's first step
        // grows what its own kernels need.
        drop(bufs);
        be.release_workspaces()?;
    }
    Ok(out)
}

/// An operand copy of a convolution's x: in NHWC (`transpose`) or cut into
/// window rows `rw` long (`row_patches`), stored as `operand_elem` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum XCopy {
    Nhwc { half: bool },
    Rows { half: bool, rw: usize },
}

impl XCopy {
    fn floats(self, be: &CudaBackend, g: &ConvGeom) -> usize {
        match self {
            XCopy::Nhwc { half } => operand_elem(be, half).floats(g.x_len()),
            XCopy::Rows { half, rw } => {
                operand_elem(be, half).floats(RowGeom::patches(g, rw).len())
            }
        }
    }

    /// Runs `f` with this copy of `g`'s x, made in `keep` where given (a
    /// forward keeping it for the weight gradient), else in scratch `X`.
    fn with<R>(
        self,
        be: &CudaBackend,
        g: &ConvGeom,
        x: &CudaSlice<f32>,
        keep: Option<&mut CudaSlice<f32>>,
        f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        let floats = self.floats(be, g);
        let write = |dst: &mut CudaSlice<f32>| match self {
            XCopy::Nhwc { half } => {
                let dims = [g.n, g.c_in, g.h * g.w];
                transpose(be, x, dst, dims, g.c_in, operand_elem(be, half), None)
            }
            XCopy::Rows { half, rw } => {
                row_patches(be, x, dst, &RowGeom::patches(g, rw), operand_elem(be, half))
            }
        };
        match keep {
            Some(k) => {
                write(k)?;
                f(k)
            }
            None => be.with_scratch(Scratch::X, floats, |t| {
                write(t)?;
                f(t)
            }),
        }
    }
}

/// The copy of x that `g`'s forward makes and its weight gradient reads
/// again, where both read the same one: what the forward can keep
/// (`conv_forward_keep`) to spare the backward a relayout of x. At batch
/// 256 in TF32 those relayouts were 0.43 ms of a 14.1 ms step (conv1's
/// window rows 0.19, conv2–5's NHWC transposes about 0.23; `…-v18/final/`).
fn kept_copy(be: &CudaBackend, g: &ConvGeom) -> Option<XCopy> {
    let forward = forward_plan(be, g).x_copy()?;
    match filter_plan(be, g) {
        FilterPlan::Vec(f) if f.x_copy() == forward => Some(forward),
        _ => None,
    }
}

/// Whether `buf` is where `g`'s forward keeps `copy` under the current
/// settings: `copy` is what `kept_copy` names, and `buf` holds it. A buffer
/// sized under other settings (a precision changed after the model was
/// built) is passed over, and the copy made in scratch as without one.
fn holds_kept(be: &CudaBackend, g: &ConvGeom, copy: XCopy, buf: &CudaSlice<f32>) -> bool {
    kept_copy(be, g) == Some(copy) && buf.len() >= copy.floats(be, g)
}

/// Floats of the copy `kept_copy` names (0 where there is none).
pub(super) fn kept_len(be: &CudaBackend, g: &ConvGeom) -> usize {
    kept_copy(be, g).map_or(0, |c| c.floats(be, g))
}

/// `dx` from `dy`; with `relu_of` = x (the output of the ReLU before the
/// convolution), also that ReLU's backward (`dx = 0` where x ≤ 0), in the
/// same epilogue.
pub(super) fn conv_backward_data(
    be: &CudaBackend,
    g: &ConvGeom,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    relu_of: Option<&CudaSlice<f32>>,
) -> Result<()> {
    let s = data_shape(g, relu_of)?;
    check_len("conv_backward_data dy", dy, g.y_len())?;
    check_len("conv_backward_data w", w, g.w_len())?;
    check_len("conv_backward_data dx", dx, g.x_len())?;
    let mask = relu_of.unwrap_or(dy);
    data_product(be, g, &s, dy, w, dx, mask)
}

/// `conv_backward_data` past its checks of the buffers' lengths (which
/// may be longer than `g` needs: scratch).
fn data_product(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    mask: &CudaSlice<f32>,
) -> Result<()> {
    if by_phases(be, g) {
        return data_by_phases(be, g, s, dy, w, dx, mask);
    }
    if by_columns(be, g) {
        return data_by_columns(be, g, s, dy, w, dx, mask);
    }
    if let Some(plan) = data_channels_last(be, g) {
        return dy_nhwc(be, g, dy, plan.half, None, |dyt| {
            data_from_nhwc(be, g, s, &plan, dyt, w, dx, mask)
        });
    }
    let (cg, pixels) = (g.c_in / g.groups, g.n * g.h * g.w);
    let wide = be.wide_tiles_data_grad();
    let cfg = grid(cg, pixels, g.groups, wide);
    let what = || format!("{g:?}");
    launch!(be, be.gemm_kernel(gemm_names!("conv_backward_data"), wide), cfg, what; s, dy, w, dx, mask)
}

/// The data gradient's shape: `relu` set when it also does the ReLU's
/// backward (its mask x checked to be x-sized).
fn data_shape(g: &ConvGeom, relu_of: Option<&CudaSlice<f32>>) -> Result<ConvShape> {
    if let Some(x) = relu_of {
        check_len("conv_backward_data relu mask", x, g.x_len())?;
    }
    Ok(ConvShape {
        relu: relu_of.is_some() as u32,
        ..shape(g)?
    })
}

/// Whether `g`'s data gradient goes by columns (`data_by_columns`): at
/// stride s > 1 the gathered products multiply s² − 1 of every s² taps by
/// zero, and a layer with few channels per group (conv1: 3) pads them to
/// whole tiles as well; conv1's data gradient took 112 ms (TF32) and 56 ms
/// (bf16) that way at batch 128 on an H100, against cuDNN's 0.80 and 2.07.
pub(super) fn by_columns(be: &CudaBackend, g: &ConvGeom) -> bool {
    be.strided_data == StridedData::Columns && g.stride > 1
}

/// Whether `g`'s data gradient goes by phases (`data_by_phases`, the
/// default for strides above 1).
pub(super) fn by_phases(be: &CudaBackend, g: &ConvGeom) -> bool {
    be.strided_data == StridedData::Phases && g.stride > 1
}

/// The data gradient by phases ([`ConvGeom::phases`]): `conv_phase_filters`
/// into scratch `Phases`, the stride-1 data gradient of `g.phases()` over
/// dy as the autotune chose it for that shape into scratch `Cols`, then
/// `conv_phase_scatter` into dx (with the ReLU mask where `s.relu`).
fn data_by_phases(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    mask: &CudaSlice<f32>,
) -> Result<()> {
    let p = g.phases();
    let ps = shape(&p)?;
    phases_fit(g)?;
    be.with_scratch(Scratch::Phases, p.w_len(), |wp| {
        phase_filters(be, g, s, w, wp)?;
        be.with_scratch(Scratch::Cols, p.x_len(), |yp| {
            data_product(be, &p, &ps, dy, wp, yp, dy)?;
            phase_scatter(be, g, s, yp, dx, mask)
        })
    })
}

/// An error unless dx and the phase planes of `g` have fewer than 2^31
/// elements (`conv_phase_scatter` indexes both in 32 bits).
fn phases_fit(g: &ConvGeom) -> Result<()> {
    anyhow::ensure!(
        g.x_len().max(g.phases().x_len()) < i32::MAX as usize,
        "conv_backward_data {g:?}: more than 2^31 elements of dx or of its phases"
    );
    Ok(())
}

/// `conv_phase_filters`: `g.phases()`'s filter bank from `w` into `wp`.
fn phase_filters(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    w: &CudaSlice<f32>,
    wp: &mut CudaSlice<f32>,
) -> Result<()> {
    let len = g.phases().w_len();
    let what = || format!("{g:?} phase filters");
    launch!(be, "conv_phase_filters", grid_1d(be, len), what; s, w, wp)
}

/// `conv_phase_scatter`: dx from the data gradient of `g.phases()` in
/// `yp` (with the ReLU mask where `s.relu`).
fn phase_scatter(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    yp: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    mask: &CudaSlice<f32>,
) -> Result<()> {
    let div = |d: usize| FastDiv::new(d as u32);
    let (fw, fh, fs) = (div(g.w), div(g.h), div(g.stride));
    let what = || format!("{g:?} phase scatter");
    let cfg = grid_1d(be, g.x_len());
    launch!(be, "conv_phase_scatter", cfg, what; s, yp, dx, mask, &fw, &fh, &fs)
}

/// [`phase_filters`] with its buffers checked.
pub(super) fn conv_phase_filters(
    be: &CudaBackend,
    g: &ConvGeom,
    w: &CudaSlice<f32>,
    wp: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("conv_phase_filters w", w, g.w_len())?;
    check_len("conv_phase_filters wp", wp, g.phases().w_len())?;
    phase_filters(be, g, &shape(g)?, w, wp)
}

/// [`phase_scatter`] with its buffers checked (`relu_of`: the mask).
pub(super) fn conv_phase_scatter(
    be: &CudaBackend,
    g: &ConvGeom,
    yp: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    relu_of: Option<&CudaSlice<f32>>,
) -> Result<()> {
    let s = data_shape(g, relu_of)?;
    check_len("conv_phase_scatter yp", yp, g.phases().x_len())?;
    check_len("conv_phase_scatter dx", dx, g.x_len())?;
    phases_fit(g)?;
    phase_scatter(be, g, &s, yp, dx, relu_of.unwrap_or(yp))
}

/// The first kernel of `g`'s data gradient under the current settings.
pub(super) fn data_kernel(be: &CudaBackend, g: &ConvGeom) -> &'static str {
    chosen(be, Product::Data, g).0
}

/// The column product's kernel and launch grid for `imgs` images of `g`.
fn cols_plan(be: &CudaBackend, g: &ConvGeom, imgs: usize) -> (&'static str, LaunchConfig) {
    let rows = g.c_in / g.groups * g.k_h * g.k_w;
    let (cfg, wide) = tiles(be, rows, imgs * g.out_h() * g.out_w(), g.groups);
    (
        be.gemm_kernel(gemm_names!("conv_backward_data_cols"), wide),
        cfg,
    )
}

/// The data gradient by columns, in chunks of images whose columns fit
/// `CudaBackend::cols_budget` (at least one image): the dense product
/// `conv_backward_data_cols` (K = the group's filters, no zero taps, rows =
/// Cg·KH·KW) into scratch `Cols`, then `conv_cols_sum` adds each input
/// pixel's ⌈KH/s⌉·⌈KW/s⌉ entries into dx (with the ReLU mask where `s.relu`).
fn data_by_columns(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    mask: &CudaSlice<f32>,
) -> Result<()> {
    let per_image = g.c_in * g.k_h * g.k_w * g.out_h() * g.out_w();
    let chunk = (be.cols_budget / per_image.max(1)).clamp(1, g.n.max(1));
    be.with_scratch(Scratch::Cols, chunk * per_image, |cols| {
        for img0 in (0..g.n).step_by(chunk) {
            let imgs = chunk.min(g.n - img0);
            let (name, cfg) = cols_plan(be, g, imgs);
            let (i0, n) = (img0 as u32, imgs as u32);
            let what = || format!("{g:?} images {img0}..{}", img0 + imgs);
            launch!(be, name, cfg, what; s, dy, w, &mut *cols, &i0, &n)?;
            let sum = grid_1d(be, imgs * g.c_in * g.h * g.w);
            launch!(be, "conv_cols_sum", sum, what; s, &*cols, &mut *dx, mask, &i0, &n)?;
        }
        Ok(())
    })
}

/// A vector-engine kernel chosen for a product: its name, whether it reads
/// bf16 operand copies, and its launch shape.
struct VecPlan {
    name: &'static str,
    half: bool,
    cfg: LaunchConfig,
}

/// The channels-last data-gradient kernel for `g`, if the shape takes it.
fn data_channels_last(be: &CudaBackend, g: &ConvGeom) -> Option<VecPlan> {
    if by_columns(be, g) || by_phases(be, g) {
        return None;
    }
    let k = be.knobs(Product::Data, g);
    let (cg, fg) = (g.c_in / g.groups, g.c_out / g.groups);
    let fits = [fg.is_multiple_of(4), fg.is_multiple_of(8)];
    let pixels = g.n * g.h * g.w;
    // Groups of at most 64 channels, where 128×128 tiles would pad more
    // than half of each tile (conv2's 48, conv1's phases' 48), take the
    // TMA kernel with the roles swapped (128 pixels × 64 channels a tile,
    // 64-row weight boxes): conv2 at batch 128 on an H100, autotune off,
    // TF32 0.533 ms against `_t_slim`'s 0.686 and the 128×128 kernel's
    // 0.821; bf16 0.303 against 0.384 and 0.436.
    let swapped = cg <= 64 && k.transposed == Transposed::Padded;
    if k.big != Some(false)
        && k.transposed != Transposed::All
        && let Some((name, half)) = be.tma_data_kernel(g, swapped)
    {
        let mut cfg = grid(cg, pixels, g.groups, true);
        if swapped {
            cfg.grid_dim = (
                pixels.div_ceil(128) as u32,
                cg.div_ceil(64) as u32,
                g.groups as u32,
            );
        }
        let cfg = vec_cfg(cfg, name);
        return Some(VecPlan { name, half, cfg });
    }
    if let Some(plan) = transposed(be, k, "conv_backward_data_nhwc", cg, pixels, g.groups, fits) {
        return Some(plan);
    }
    let (cfg, wide) = tiles(be, cg, g.n * g.h * g.w, g.groups);
    let (name, half) = channels_last(be, k, "conv_backward_data", fits, wide, Some(cfg.grid_dim))?;
    Some(VecPlan {
        name,
        half,
        cfg: vec_cfg(cfg, name),
    })
}

/// The transposed channels-last product `{base}_t` (pixels × channels,
/// 128-pixel tiles; launch plan) for a group of `channels` output channels
/// (filters of the forward, input channels of the data gradient) over
/// `pixels`, where the usual tiles pad the channels and this does not, or
/// less: 48-channel tiles (`_slim`, data gradient only) where they pad less
/// than 64-row ones (conv2's groups of 48: a quarter of each 64-row
/// tile's `mma`s wasted), 64-channel ones (`_wide`) where
/// 128-row tiles would pad and 64-row ones are chosen (conv4's 192
/// filters, conv4–5's 192 channels). Measured at batch 128 (`…-v17/
/// transposed/`): conv2's data gradient TF32 0.988 → 0.929 ms, bf16 0.476
/// → 0.434; bf16 conv4 forward 0.216 → 0.200, conv4–5 data gradients
/// 0.234 → 0.212 and 0.176 → 0.157. The TF32 `_wide` twins measured
/// slower then (conv4's data gradient 0.422 → 0.495) and faster once
/// their A fragments came from one `ldmatrix` (`…-v18/final/`, off → on:
/// conv4 forward 0.373 → 0.297, data gradients conv4 0.414 → 0.352, conv5
/// 0.302 → 0.253). `None` where it is off, the kernel does not exist, or
/// the pixel tiles overflow grid y. With `k.transposed` at `All` (an
/// autotune candidate), also where `channels` is a multiple of 64 that the
/// usual tiles do not pad (128×64 tiles).
fn transposed(
    be: &CudaBackend,
    k: Knobs,
    base: &str,
    channels: usize,
    pixels: usize,
    groups: usize,
    fits: [bool; 2],
) -> Option<VecPlan> {
    let pixel_tiles = pixels.div_ceil(128);
    let slim = channels.div_ceil(48) * 48 < channels.div_ceil(64) * 64;
    let wide = channels % 128 == 64 && channels > 64;
    let any64 = k.transposed == Transposed::All && channels.is_multiple_of(64);
    if k.transposed == Transposed::Off || pixel_tiles > 65535 || !(slim || wide || any64) {
        return None;
    }
    let (tile, cols) = if slim {
        (VecTile::Slim, 48)
    } else {
        (VecTile::Wide, 64)
    };
    let half16 = (fits[1] && be.operand_copies)
        .then(|| be.vec_kernel(&format!("{base}16_t"), true, tile))
        .flatten();
    let (name, half) = match half16 {
        Some(k) => (k, true),
        None => (be.vec_kernel(&format!("{base}_t"), fits[0], tile)?, false),
    };
    let grid = LaunchConfig {
        grid_dim: (
            channels.div_ceil(cols) as u32,
            pixel_tiles as u32,
            groups as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    Some(VecPlan {
        name,
        half,
        cfg: vec_cfg(grid, name),
    })
}

/// The channels-last data gradient from dy already in NHWC (`dyt`, as
/// `plan.half` says): relays the filter bank out and launches (`mask` is
/// read only where `s.relu` says).
#[allow(clippy::too_many_arguments)] // the product's operands and plan
fn data_from_nhwc(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    plan: &VecPlan,
    dyt: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dx: &mut CudaSlice<f32>,
    mask: &CudaSlice<f32>,
) -> Result<()> {
    let (cg, fg, kk) = (g.c_in / g.groups, g.c_out / g.groups, g.k_h * g.k_w);
    let what = || format!("{g:?}");
    let dims = [g.groups, fg, cg * kk];
    relayout(be, Scratch::W, w, dims, fg, plan.half, |wt| {
        if plan.name.contains("_tma") {
            let product = if plan.name.ends_with("_tma_t") {
                TmaProduct::DataSwapped
            } else {
                TmaProduct::Data
            };
            let maps = be.conv_tma_maps(g, product, dyt, wt, plan.half)?;
            let (cfg, ring) = be.tma_cfg(plan.name, plan.cfg)?;
            launch!(be, plan.name, cfg, what; s, &maps, &ring, dx, mask)
        } else {
            launch!(be, plan.name, plan.cfg, what; s, dyt, wt, dx, mask)
        }
    })
}

/// The channels-last kernel for product `base` and whether it reads bf16
/// operands: `{base}_nhwc16_bf16` in bf16 where
/// `fits[1]` (and bf16 operands are on), else `{base}_nhwc_{tf32|bf16}`
/// where `fits[0]`; `grid` as `vec_tiled` takes it.
fn channels_last(
    be: &CudaBackend,
    k: Knobs,
    base: &str,
    fits: [bool; 2],
    wide: bool,
    grid: Option<(u32, u32, u32)>,
) -> Option<(&'static str, bool)> {
    if fits[1]
        && be.operand_copies
        && let Some(name) = vec_tiled(be, k, &format!("{base}_nhwc16"), wide, grid)
    {
        return Some((name, true));
    }
    if !fits[0] {
        return None;
    }
    vec_tiled(be, k, &format!("{base}_nhwc"), wide, grid).map(|name| (name, false))
}

/// Vector kernel `base` (see `vec_kernel`; its name gives its tile shape):
/// 64 or 128 rows as `wide` says, then the 128-column variant if `base` has
/// one and big tiles are not off:
/// - 64×128 (`_long`: the bf16 forward and data gradients) wherever it
///   exists: faster than 64×64 on every AlexNet layer (conv2's data
///   gradient 0.54 → 0.48 ms at batch 128). TF32 has none: at 174–180
///   registers two blocks fit on an SM, and it measured slower.
/// - 128×128 (`_big`) unless `base` also has 128×64 and that fills the
///   GPU's waves better for `grid` (the launch grid in 64-column tiles;
///   `None` for split-K products, whose slices fill the waves): e.g.
///   conv5's forward makes 338 blocks of 128×128 at two per SM, 1.3 waves,
///   against 676 of 128×64 at three per SM, 1.7. Of the weight gradients
///   only conv1's bf16 one has it: the others measured slower.
fn vec_tiled(
    be: &CudaBackend,
    k: Knobs,
    base: &str,
    wide: bool,
    grid: Option<(u32, u32, u32)>,
) -> Option<&'static str> {
    let tile = VecTile::of(wide);
    let broad_tile = if wide { VecTile::Big } else { VecTile::Long };
    let plain = be.vec_kernel(base, true, tile);
    let broad = (k.big != Some(false))
        .then(|| be.vec_kernel(base, true, broad_tile))
        .flatten();
    match (broad, plain, grid) {
        (Some(b), Some(p), Some((gx, gy, gz))) if wide && k.big.is_none() => {
            let blocks = gy as usize * gz as usize;
            let (n_plain, n_broad) = (gx as usize * blocks, gx.div_ceil(2) as usize * blocks);
            if broad_fills_as_well(n_broad, be.wave(b), n_plain, be.wave(p)) {
                Some(b)
            } else {
                Some(p)
            }
        }
        (Some(b), _, _) => Some(b),
        (None, p, _) => p,
    }
}

/// Whether `broad` blocks of a 128-column kernel, `broad_wave` of them
/// resident at once, keep the GPU's block slots about as busy over their
/// waves as `narrow` blocks of its 64-column twin (within 2%).
fn broad_fills_as_well(broad: usize, broad_wave: usize, narrow: usize, narrow_wave: usize) -> bool {
    let fill = |blocks: usize, wave: usize| blocks as f64 / (blocks.div_ceil(wave) * wave) as f64;
    fill(broad, broad_wave) + 0.02 >= fill(narrow, narrow_wave)
}

/// The row-patch kernel for product `base` (`{base}_rows_tf32` in TF32,
/// `{base}_rows16_bf16` in bf16 with bf16 operands), whether it reads bf16,
/// and its row length (`KW·C` rounded up to whole 16-byte vectors): for
/// one-group layers whose channel count rules out the channels-last path
/// (conv1). `None` otherwise.
fn row_path(
    be: &CudaBackend,
    k: Knobs,
    g: &ConvGeom,
    base: &str,
    wide: bool,
    grid: Option<(u32, u32, u32)>,
) -> Option<(&'static str, bool, usize)> {
    if g.groups != 1 || g.c_in.is_multiple_of(4) {
        return None;
    }
    let half = be.precision == crate::config::Precision::Bf16 && be.operand_copies;
    let name = vec_tiled(
        be,
        k,
        &format!("{base}_rows{}", if half { "16" } else { "" }),
        wide,
        grid,
    )?;
    let rw = (g.k_w * g.c_in).next_multiple_of(if half { 8 } else { 4 });
    Some((name, half, rw))
}

/// How the vector kernels' operand copies are stored: bf16 when `half`;
/// else, in TF32, fp32 rounded to TF32 (the `_tf32` vector kernels are built
/// to feed their fragments to the tensor cores unconverted); else fp32.
fn operand_elem(be: &CudaBackend, half: bool) -> Elem {
    if half {
        Elem::Bf16
    } else if be.precision == crate::config::Precision::Tf32 {
        Elem::Tf32
    } else {
        Elem::F32
    }
}

/// Runs `f` with `src` cut into window rows (`row_patches`, see
/// [`RowGeom`]) in scratch `slot`, stored as `operand_elem` says.
fn cut_rows<R>(
    be: &CudaBackend,
    slot: Scratch,
    src: &CudaSlice<f32>,
    g: &RowGeom,
    half: bool,
    f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    let elem = operand_elem(be, half);
    be.with_scratch(slot, elem.floats(g.len()), |t| {
        row_patches(be, src, t, g, elem)?;
        f(t)
    })
}

/// Runs `f` with dy of convolution `g` in NHWC (scratch `Dy`), as fp32 or
/// (`half`) bf16. With `db`, then also `db` from the per-channel partial
/// sums that the relayout wrote on its way through dy (`conv_backward_bias`
/// over them instead of over dy: at batch 256 in TF32 its passes over dy
/// were 0.23 ms of a 13.2 ms step, `…-v19/`).
fn dy_nhwc<R>(
    be: &CudaBackend,
    g: &ConvGeom,
    dy: &CudaSlice<f32>,
    half: bool,
    db: Option<&mut CudaSlice<f32>>,
    f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    let hw = g.out_h() * g.out_w();
    let Some(db) = db else {
        return relayout(be, Scratch::Dy, dy, [g.n, g.c_out, hw], g.c_out, half, f);
    };
    check_len("conv_backward db", db, g.c_out)?;
    let tiles = hw.div_ceil(TRANSPOSE_COLS);
    let elem = operand_elem(be, half);
    be.with_scratch(Scratch::Sums, g.n * g.c_out * tiles, |sums| {
        let r = be.with_scratch(Scratch::Dy, elem.floats(g.n * g.c_out * hw), |t| {
            transpose(
                be,
                dy,
                t,
                [g.n, g.c_out, hw],
                g.c_out,
                elem,
                Some(&mut *sums),
            )?;
            f(t)
        })?;
        let what = || format!("{g:?} bias from {tiles} partial sums per image");
        channel_sums(be, sums, db, [g.n, g.c_out, tiles], &what)?;
        Ok(r)
    })
}

/// Runs `f` with `src` transposed per matrix (`[batches, rows, cols]` →
/// `[batches, cols, rows_out]`, zero-padded rows) into scratch `slot`,
/// stored as `operand_elem` says.
fn relayout<R>(
    be: &CudaBackend,
    slot: Scratch,
    src: &CudaSlice<f32>,
    dims: [usize; 3],
    rows_out: usize,
    half: bool,
    f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    let elem = operand_elem(be, half);
    be.with_scratch(slot, elem.floats(dims[0] * rows_out * dims[2]), |t| {
        transpose(be, src, t, dims, rows_out, elem, None)?;
        f(t)
    })
}

/// How many K slices the weight gradient uses, given `blocks` per slice,
/// a reduction `k` deep and `wave` blocks running at once: as many as one
/// wave holds (each slice still at least 1024 deep, at most 64). conv2 at
/// batch 128 in TF32 (38 blocks of 128×64, three per SM): 10 slices, 380
/// of 396 slots busy. Two waves' worth (conv3: 7 slices instead of 3)
/// measured slower: every slice adds a partial to write and sum.
fn filter_splits(blocks: usize, k: usize, wave: usize) -> u32 {
    (wave / blocks).clamp(1, (k / 1024).clamp(1, 64)) as u32
}

/// K slices of the TMA weight gradients, given `tiles` per slice, a
/// reduction `k` deep and `wave` blocks at once (one per SM: their stages
/// take most of its shared memory). Blocks run in whole waves, so the time
/// goes as ⌈tiles·s/wave⌉/s; of the slice counts up to 16 (each at least
/// 1024 deep) within 3% of the best, the fewest, since each slice adds a
/// partial of dw to write and sum. conv3 at batch 128 (54 tiles on 132
/// SMs): 7 slices, 378 blocks in 3 waves (95% busy), where "about two
/// waves" gave 5 and 270 blocks in 3 waves (68%).
fn tma_filter_splits(tiles: usize, k: usize, wave: usize) -> u32 {
    let most = (k / 1024).clamp(1, 16);
    let cost = |s: usize| (tiles * s).div_ceil(wave.max(1)) as f64 / s as f64;
    let best = (1..=most).map(cost).fold(f64::INFINITY, f64::min);
    (1..=most).find(|&s| cost(s) <= best * 1.03).unwrap_or(1) as u32
}

/// Blocks of a launch.
fn blocks(cfg: &LaunchConfig) -> usize {
    let (x, y, z) = cfg.grid_dim;
    x as usize * y as usize * z as usize
}

/// `dw`, and with `db` the bias gradient too (from dy's relayout where
/// the weight gradient reads dy in NHWC); with `kept`, x's operand copy
/// from the forward (`kept_copy`).
pub(super) fn conv_backward_filter(
    be: &CudaBackend,
    g: &ConvGeom,
    x: &CudaSlice<f32>,
    kept: Option<&CudaSlice<f32>>,
    dy: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
    db: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let s = shape(g)?;
    check_len("conv_backward_filter x", x, g.x_len())?;
    check_len("conv_backward_filter dy", dy, g.y_len())?;
    check_len("conv_backward_filter dw", dw, g.w_len())?;
    match filter_plan(be, g) {
        FilterPlan::Gemm { name, cfg, splits } => {
            let what = || format!("{g:?} splits={splits}");
            filter_launch(be, name, cfg, &s, x, dy, dw, splits, &what)?;
            db.map_or(Ok(()), |db| conv_backward_bias(be, g, dy, db))
        }
        FilterPlan::Vec(f) => dy_nhwc(be, g, dy, f.plan.half, db, |dyt| {
            filter_from_nhwc(be, g, &s, &f, x, kept, dyt, dw)
        }),
        FilterPlan::Grid(f) => {
            filter_grid(be, g, &s, &f, x, dy, dw)?;
            db.map_or(Ok(()), |db| conv_backward_bias(be, g, dy, db))
        }
    }
}

/// The weight gradient's kernel for a shape: on the vector engine (dy in
/// NHWC), the TF32 TMA kernel over the padded pixel grid, or the NCHW GEMM
/// engine; `splits` K slices.
enum FilterPlan {
    Vec(VecFilter),
    Grid(VecFilter),
    Gemm {
        name: &'static str,
        cfg: LaunchConfig,
        splits: u32,
    },
}

/// A vector-engine weight gradient: x as row patches `rw` long (`rows =
/// Some(rw)`, conv1) or in NHWC; `splits` K slices.
struct VecFilter {
    plan: VecPlan,
    rows: Option<usize>,
    splits: u32,
}

impl VecFilter {
    /// The operand copy of x it reads.
    fn x_copy(&self) -> XCopy {
        let half = self.plan.half;
        match self.rows {
            Some(rw) => XCopy::Rows { half, rw },
            None => XCopy::Nhwc { half },
        }
    }
}

fn filter_plan(be: &CudaBackend, g: &ConvGeom) -> FilterPlan {
    let kn = be.default_knobs();
    let m = g.c_out / g.groups;
    let wide = be.wide_tiles(m, None);
    let n_len = (g.c_in / g.groups) * g.k_h * g.k_w;
    let k = g.n * g.out_h() * g.out_w();
    let cg = g.c_in / g.groups;
    let base = grid(m, n_len, g.groups, wide);
    let rows = row_path(be, kn, g, "conv_backward_filter", wide, None)
        .filter(|&(_, half, _)| m.is_multiple_of(if half { 8 } else { 4 }));
    if let Some((name, half, rw)) = rows {
        let one = vec_cfg(grid(m, g.k_h * rw, 1, wide), name);
        let splits = filter_splits(blocks(&one), k, be.wave(name));
        let cfg = vec_cfg(grid(m, g.k_h * rw, splits as usize, wide), name);
        let plan = VecPlan { name, half, cfg };
        return FilterPlan::Vec(VecFilter {
            plan,
            rows: Some(rw),
            splits,
        });
    }
    if let Some((name, half)) = be.tma_filter_kernel(g) {
        // 128×128 tiles per group, split over K; the TF32 kernel sums
        // over the whole grid.
        let k = match GridGeom::conv(g) {
            Some((_, _, len)) if !half => len,
            _ => k,
        };
        let n_len = g.k_h * g.k_w * tma_filter_cgp(g, half);
        let tiles = n_len.div_ceil(128) * m.div_ceil(128) * g.groups;
        let splits = tma_filter_splits(tiles, k, be.sm_count() as usize);
        let cfg = LaunchConfig {
            grid_dim: (
                n_len.div_ceil(128) as u32,
                m.div_ceil(128) as u32,
                (g.groups * splits as usize) as u32,
            ),
            block_dim: (super::gemm::WG_TMA_THREADS, 1, 1),
            shared_mem_bytes: super::gemm::tma_shared(super::gemm::TMA_STAGES),
        };
        let plan = VecPlan { name, half, cfg };
        let f = VecFilter {
            plan,
            rows: None,
            splits,
        };
        return if half {
            FilterPlan::Vec(f)
        } else {
            FilterPlan::Grid(f)
        };
    }
    let fits = [
        cg.is_multiple_of(4) && m.is_multiple_of(4),
        cg.is_multiple_of(8) && m.is_multiple_of(8),
    ];
    if let Some((name, half)) = channels_last(be, kn, "conv_backward_filter", fits, wide, None) {
        let splits = filter_splits(blocks(&vec_cfg(base, name)), k, be.wave(name));
        let cfg = grid(m, n_len, g.groups * splits as usize, wide);
        let plan = VecPlan {
            name,
            half,
            cfg: vec_cfg(cfg, name),
        };
        return FilterPlan::Vec(VecFilter {
            plan,
            rows: None,
            splits,
        });
    }
    let name = be.gemm_kernel(gemm_names!("conv_backward_filter"), wide);
    // The NCHW engine (fp32, and shapes the vector engine does not take)
    // keeps its measured rule: enough slices for about two blocks per SM.
    let want = (2 * be.sm_count() as usize).div_ceil(blocks(&base));
    let splits = want.min(k / 1024).clamp(1, 64) as u32;
    let cfg = grid(m, n_len, g.groups * splits as usize, wide);
    FilterPlan::Gemm { name, cfg, splits }
}

/// A vector-engine weight gradient from dy already in NHWC (`dyt`): reads
/// x's operand copy from `kept` where the forward kept it, else makes it,
/// and launches.
#[allow(clippy::too_many_arguments)] // the product's operands and plan
fn filter_from_nhwc(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    f: &VecFilter,
    x: &CudaSlice<f32>,
    kept: Option<&CudaSlice<f32>>,
    dyt: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
) -> Result<()> {
    let (plan, splits) = (&f.plan, f.splits);
    let what = || format!("{g:?} splits={splits}");
    let mut run = |xc: &CudaSlice<f32>| {
        if plan.name.contains("_tma") {
            filter_launch_tma(be, g, plan, s, xc, dyt, dw, splits, &what)
        } else {
            filter_launch(be, plan.name, plan.cfg, s, xc, dyt, dw, splits, &what)
        }
    };
    let copy = f.x_copy();
    match kept.filter(|k| holds_kept(be, g, copy, k)) {
        Some(k) => run(k),
        None => copy.with(be, g, x, None, run),
    }
}

/// The TF32 weight gradient over the padded pixel grid: dy copied onto it
/// and x in KW shifted copies (`pixel_grid_tf32`, scratch `GridDy` and
/// `GridX`), their maps, then the kernel and the split-K reduction.
fn filter_grid(
    be: &CudaBackend,
    g: &ConvGeom,
    s: &ConvShape,
    f: &VecFilter,
    x: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
) -> Result<()> {
    let no_grid = || anyhow::anyhow!("{g:?} has no pixel grid for its TF32 weight gradient");
    let gx = GridGeom::x(g).ok_or_else(no_grid)?;
    let gdy = GridGeom::dy(g).ok_or_else(no_grid)?;
    let bx = grid_box(g).ok_or_else(no_grid)? as u32;
    let (name, splits) = (f.plan.name, f.splits);
    let what = || format!("{g:?} splits={splits} on a {}×{} grid", gx.hp, gx.wp);
    be.with_scratch(Scratch::GridX, gx.grid_len(), |xg| {
        be.pixel_grid_tf32(x, xg, &gx)?;
        be.with_scratch(Scratch::GridDy, gdy.grid_len(), |dg| {
            be.pixel_grid_tf32(dy, dg, &gdy)?;
            let maps = be.conv_tma_maps(g, TmaProduct::Grid, xg, dg, false)?;
            let (cfg, ring) = be.tma_cfg(name, f.plan.cfg)?;
            let (wp, len) = (gx.wp as u32, gx.len as u32);
            split_gemm_order(
                be,
                g,
                tma_filter_cgp(g, false),
                dw,
                splits,
                &what,
                |out| launch!(be, name, cfg, what; s, &maps, &ring, out, &splits, &wp, &len, &bx),
            )
        })
    })
}

/// The whole backward of a convolution: `dw`, `db` and, when given, `dx`
/// (with `relu`, through the backward of the ReLU whose output x is);
/// `kept` as `conv_backward_filter` takes it.
/// Where the data and weight gradients both read dy in NHWC of the same
/// type, it is relaid out once for both (else as the separate launchers).
#[allow(clippy::too_many_arguments)] // the layer's tensors and gradients
pub(super) fn conv_backward(
    be: &CudaBackend,
    g: &ConvGeom,
    x: &CudaSlice<f32>,
    kept: Option<&CudaSlice<f32>>,
    dy: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
    db: &mut CudaSlice<f32>,
    dx: Option<&mut CudaSlice<f32>>,
    relu: bool,
) -> Result<()> {
    let relu_of = relu.then_some(x);
    let fplan = match filter_plan(be, g) {
        FilterPlan::Vec(f) => Some((f, false)),
        FilterPlan::Grid(f) => Some((f, true)),
        FilterPlan::Gemm { .. } => None,
    };
    let dplan = match (&dx, &fplan) {
        (Some(_), Some((f, _))) => data_channels_last(be, g).filter(|d| d.half == f.plan.half),
        _ => None,
    };
    match (dx, dplan, fplan) {
        (Some(dx), Some(dplan), Some(fplan)) => {
            let s = data_shape(g, relu_of)?;
            check_len("conv_backward x", x, g.x_len())?;
            check_len("conv_backward dy", dy, g.y_len())?;
            check_len("conv_backward w", w, g.w_len())?;
            check_len("conv_backward dw", dw, g.w_len())?;
            check_len("conv_backward dx", dx, g.x_len())?;
            dy_nhwc(be, g, dy, dplan.half, Some(db), |dyt| {
                data_from_nhwc(be, g, &s, &dplan, dyt, w, dx, x)?;
                match fplan {
                    (f, false) => filter_from_nhwc(be, g, &shape(g)?, &f, x, kept, dyt, dw),
                    (f, true) => filter_grid(be, g, &shape(g)?, &f, x, dy, dw),
                }
            })
        }
        (dx, _, _) => {
            conv_backward_filter(be, g, x, kept, dy, dw, Some(db))?;
            match dx {
                Some(dx) => conv_backward_data(be, g, dy, w, dx, relu_of),
                None => Ok(()),
            }
        }
    }
}

/// Launches weight-gradient kernel `name` (either engine: same parameters)
/// straight into `dw`, or with `splits` > 1 into the split-K workspace
/// followed by `splitk_reduce`.
#[allow(clippy::too_many_arguments)]
fn filter_launch(
    be: &CudaBackend,
    name: &'static str,
    cfg: LaunchConfig,
    s: &ConvShape,
    x: &CudaSlice<f32>,
    dy: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
    splits: u32,
    what: &dyn Fn() -> String,
) -> Result<()> {
    split_into(
        be,
        dw,
        splits,
        what,
        |out| launch!(be, name, cfg, what; s, x, dy, out, &splits),
    )
}

/// Runs `product` (a weight-gradient launch writing `splits` K slices'
/// partials of dw, one after another) into `dw` itself when `splits` is 1,
/// else into the split-K workspace, then sums the slices into `dw` with
/// `splitk_reduce`.
fn split_into(
    be: &CudaBackend,
    dw: &mut CudaSlice<f32>,
    splits: u32,
    what: &dyn Fn() -> String,
    mut product: impl FnMut(&mut CudaSlice<f32>) -> Result<()>,
) -> Result<()> {
    if splits == 1 {
        return product(dw);
    }
    let len = dw.len();
    be.with_workspace(len * splits as usize, |ws| {
        product(&mut *ws)?;
        launch!(be, "splitk_reduce", grid_1d(be, len), what; &*ws, &mut *dw, &len, &splits, &0u64, &1u32)
    })
}

/// Columns a tap of the TMA weight gradients' GEMM has: a group's
/// channels, rounded up to the bf16 kernel's 64-channel boxes.
fn tma_filter_cgp(g: &ConvGeom, half: bool) -> usize {
    let cg = g.c_in / g.groups;
    if half { cg.next_multiple_of(64) } else { cg }
}

/// Runs `product` (a TMA weight-gradient launch writing `splits` K
/// slices' partials of dw in GEMM order, `[slice][f][(kh·KW + kw)·cgp +
/// c]`) into the split-K workspace, one slice too, then sums and permutes
/// them into dw with `conv_backward_filter_sum`.
#[allow(clippy::too_many_arguments)] // the product's shape and output
fn split_gemm_order(
    be: &CudaBackend,
    g: &ConvGeom,
    cgp: usize,
    dw: &mut CudaSlice<f32>,
    splits: u32,
    what: &dyn Fn() -> String,
    product: impl FnOnce(&mut CudaSlice<f32>) -> Result<()>,
) -> Result<()> {
    let len = g.c_out * g.k_h * g.k_w * cgp;
    be.with_workspace(len * splits as usize, |ws| {
        product(&mut *ws)?;
        filter_sum(be, g, cgp, ws, dw, splits, what)
    })
}

/// Channels of a filter row per block of `conv_backward_filter_sum` for
/// `kk` taps and `cg` channels a group: its shared `[kk][chunk + 1]` sums
/// within 32 KiB, in whole warps where that allows.
fn filter_sum_chunk(kk: usize, cg: usize) -> usize {
    let fit = (8192 / kk).max(1);
    let chunk = if fit >= 32 { fit / 32 * 32 } else { fit };
    chunk.min(cg)
}

/// `conv_backward_filter_sum`: dw (`[F][Cg][KH][KW]`) as the sum of the
/// `splits` GEMM-ordered partials at the start of `ws` (which may be
/// longer), `cgp` ≥ Cg columns a tap.
pub(super) fn filter_sum(
    be: &CudaBackend,
    g: &ConvGeom,
    cgp: usize,
    ws: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
    splits: u32,
    what: &dyn Fn() -> String,
) -> Result<()> {
    check_len("conv_backward_filter_sum dw", dw, g.w_len())?;
    if cgp < g.c_in / g.groups {
        anyhow::bail!(
            "conv_backward_filter_sum: {cgp} columns a tap, fewer than a group's channels ({g:?})"
        );
    }
    let need = g.c_out * g.k_h * g.k_w * cgp * splits as usize;
    if ws.len() < need {
        anyhow::bail!(
            "conv_backward_filter_sum ws: buffer holds {} floats, {splits} slices of the shape need {need}",
            ws.len()
        );
    }
    let (kk, cg) = (g.k_h * g.k_w, g.c_in / g.groups);
    let chunk = filter_sum_chunk(kk, cg);
    if 4 * kk * (chunk + 1) > 48 << 10 {
        anyhow::bail!(
            "conv_backward_filter_sum: {kk} taps a filter need more than 48 KiB of shared memory ({g:?})"
        );
    }
    let cfg = LaunchConfig {
        grid_dim: (cg.div_ceil(chunk) as u32, g.c_out as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (4 * kk * (chunk + 1)) as u32,
    };
    let (f, cg32, cgp32, chunk32) = (g.c_out as u32, cg as u32, cgp as u32, chunk as u32);
    let kk32 = super::FastDiv::new(kk as u32);
    launch!(be, "conv_backward_filter_sum", cfg, what; ws, dw, &f, &cg32, &cgp32, &kk32, &chunk32, &splits)
}

/// [`filter_launch`] for the TMA weight gradient: its tensor maps (x's
/// NHWC bf16 copy `xc`, dy's `dyt`) and its ring, then the split-K sum in
/// GEMM order ([`split_gemm_order`]).
#[allow(clippy::too_many_arguments)] // the product's operands and plan
fn filter_launch_tma(
    be: &CudaBackend,
    g: &ConvGeom,
    plan: &VecPlan,
    s: &ConvShape,
    xc: &CudaSlice<f32>,
    dyt: &CudaSlice<f32>,
    dw: &mut CudaSlice<f32>,
    splits: u32,
    what: &dyn Fn() -> String,
) -> Result<()> {
    let maps = be.conv_tma_maps(g, TmaProduct::Filter, xc, dyt, true)?;
    let (cfg, ring) = be.tma_cfg(plan.name, plan.cfg)?;
    split_gemm_order(
        be,
        g,
        tma_filter_cgp(g, true),
        dw,
        splits,
        what,
        |out| launch!(be, plan.name, cfg, what; s, &maps, &ring, out, &splits),
    )
}

pub(super) fn conv_backward_bias(
    be: &CudaBackend,
    g: &ConvGeom,
    dy: &CudaSlice<f32>,
    db: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("conv_backward_bias dy", dy, g.y_len())?;
    check_len("conv_backward_bias db", db, g.c_out)?;
    let what = || format!("{g:?}");
    channel_sums(be, dy, db, [g.n, g.c_out, g.out_h() * g.out_w()], &what)
}

/// `db[c] = Σ_{i,p} t[i][c][p]` over an `[n, c, hw]` tensor at the start of
/// `t`: dy itself, or its partial sums from the relayout (`hw` = tiles).
fn channel_sums(
    be: &CudaBackend,
    t: &CudaSlice<f32>,
    db: &mut CudaSlice<f32>,
    [n, c, hw]: [usize; 3],
    what: &dyn Fn() -> String,
) -> Result<()> {
    // Enough (channel, image-slice) blocks for ~8 per SM, each slice still
    // at least 4096 elements.
    let want = (8 * be.sm_count() as usize).div_ceil(c);
    let splits = want.min(n * hw / 4096).clamp(1, n);
    let per = n.div_ceil(splits);
    let splits = n.div_ceil(per);
    let (n32, c32, per32) = (n as u32, c as u32, per as u32);
    let hw32 = super::FastDiv::new(hw as u32);
    let cfg = LaunchConfig {
        grid_dim: (c32, splits as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 32 * 4,
    };
    let what = || format!("{} splits={splits}", what());
    if splits == 1 {
        return launch!(be, "conv_backward_bias", cfg, what; t, db, &n32, &c32, &hw32, &per32);
    }
    let parts = splits as u32;
    be.with_workspace(c * splits, |ws| {
        launch!(be, "conv_backward_bias", cfg, what; t, &mut *ws, &n32, &c32, &hw32, &per32)?;
        launch!(be, "splitk_reduce", grid_1d(be, c), what; &*ws, &mut *db, &c, &parts, &0u64, &1u32)
    })
}

#[cfg(test)]
mod tests {
    use super::{Knobs, TUNE_KNOBS, Transposed, allowed, broad_fills_as_well, filter_splits};

    /// The autotune tries all nine settings by default, and only those
    /// that keep a setting forced from outside.
    #[test]
    fn autotune_keeps_forced_settings() {
        let count = |t, b| TUNE_KNOBS.iter().filter(|&&k| allowed(k, t, b)).count();
        assert_eq!(count(true, None), 9);
        assert_eq!(count(false, None), 3);
        assert_eq!(count(true, Some(false)), 3);
        assert_eq!(count(false, Some(true)), 1);
        let off = Knobs {
            transposed: Transposed::Off,
            big: Some(true),
        };
        assert!(allowed(off, false, Some(true)));
        let all = Knobs {
            transposed: Transposed::All,
            ..off
        };
        assert!(!allowed(all, false, None));
        // The nine are distinct.
        for (i, a) in TUNE_KNOBS.iter().enumerate() {
            assert!(TUNE_KNOBS[i + 1..].iter().all(|b| b != a));
        }
    }

    /// The AlexNet launches behind the measured choices (batch 128, 132
    /// SMs; 128×128 at two blocks per SM, 128×64 at three).
    #[test]
    fn wave_fill_picks_the_measured_tile() {
        let (big, wide) = (2 * 132, 3 * 132);
        // conv5's forward: 338 vs 676 blocks, 1.3 vs 1.7 waves → 128×64.
        assert!(!broad_fills_as_well(338, big, 676, wide));
        // conv3's forward: 507 vs 1014 (0.96 vs 0.85 busy) → 128×128.
        assert!(broad_fills_as_well(507, big, 1014, wide));
        // conv2's forward: 1458 vs 2916 (both 0.92) → 128×128.
        assert!(broad_fills_as_well(1458, big, 2916, wide));
    }

    #[test]
    fn tma_filter_splits_avoid_a_wave_tail() {
        // conv3 at batch 128 (54 tiles, 784 K tiles of 32 on 132 SMs).
        assert_eq!(super::tma_filter_splits(54, 25088, 132), 7);
        // One tile per SM already: no split.
        assert_eq!(super::tma_filter_splits(132, 1 << 20, 132), 1);
        // A short reduction caps the slices.
        assert_eq!(super::tma_filter_splits(10, 2048, 132), 2);
        assert_eq!(super::tma_filter_splits(10, 100, 132), 1);
    }

    #[test]
    fn filter_splits_fill_one_wave_within_limits() {
        // conv2, TF32, batch 128: 38 blocks a slice, 396 slots → 10 slices.
        assert_eq!(filter_splits(38, 128 * 27 * 27, 396), 10);
        // conv3: 108 blocks a slice → 3 (not the 7 of two waves).
        assert_eq!(filter_splits(108, 128 * 13 * 13, 396), 3);
        // More blocks than a wave: one slice.
        assert_eq!(filter_splits(500, 1 << 20, 396), 1);
        // Slices stay at least 1024 deep and at most 64.
        assert_eq!(filter_splits(1, 4096, 396), 4);
        assert_eq!(filter_splits(1, 1 << 30, 396), 64);
        assert_eq!(filter_splits(1, 100, 396), 1);
    }
}
