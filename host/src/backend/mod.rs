//! The `Backend` trait: one method per op, with a CPU reference
//! implementation (`cpu`) and a CUDA implementation (`cuda`).
//!
//! Model, trainer and tests are written once against this trait. Tensors are
//! fp32, NCHW, contiguous; a backend's buffers are flat. Ops that overwrite an
//! output never read it first (tests poison outputs with NaN to check this),
//! except where a method says it works in place.

pub mod cpu;
pub mod cuda;

use anyhow::Result;

/// Geometry of a 2-D convolution with zero padding, stride and groups.
/// A kernel the autotune chose for one product of a convolution, with the
/// heuristic's choice for comparison (times: median of a few runs, ms).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TunedKernel {
    pub product: String,
    pub kernel: String,
    pub ms: f32,
    pub heuristic_kernel: String,
    pub heuristic_ms: f32,
    /// Distinct kernel choices timed.
    pub candidates: usize,
}

/// Input `[n, c_in, h, w]`, weight `[c_out, c_in/groups, k_h, k_w]` (PyTorch's
/// layout), bias `[c_out]`, output `[n, c_out, out_h, out_w]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub k_h: usize,
    pub k_w: usize,
    pub stride: usize,
    pub pad: usize,
    pub groups: usize,
}

#[cfg(test)]
impl ConvGeom {
    /// `[n, c_in, h, w, c_out, k_h, k_w, stride, pad, groups]` as a
    /// geometry (tests).
    pub(crate) fn of([n, c_in, h, w, c_out, k_h, k_w, stride, pad, groups]: [usize; 10]) -> Self {
        ConvGeom {
            n,
            c_in,
            h,
            w,
            c_out,
            k_h,
            k_w,
            stride,
            pad,
            groups,
        }
    }
}

impl ConvGeom {
    /// Output height (PyTorch's floor rule).
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.pad - self.k_h) / self.stride + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.pad - self.k_w) / self.stride + 1
    }
    pub fn x_len(&self) -> usize {
        self.n * self.c_in * self.h * self.w
    }
    pub fn y_len(&self) -> usize {
        self.n * self.c_out * self.out_h() * self.out_w()
    }
    pub fn w_len(&self) -> usize {
        self.c_out * (self.c_in / self.groups) * self.k_h * self.k_w
    }
    /// An error unless groups divide both channel counts, stride ≥ 1 and the
    /// kernel fits the padded input.
    pub fn check(&self) -> Result<()> {
        let g = self;
        if g.groups == 0
            || !g.c_in.is_multiple_of(g.groups)
            || !g.c_out.is_multiple_of(g.groups)
            || g.stride == 0
        {
            anyhow::bail!("invalid convolution {g:?}: channels must divide by groups, stride ≥ 1");
        }
        if g.h + 2 * g.pad < g.k_h || g.w + 2 * g.pad < g.k_w {
            anyhow::bail!("invalid convolution {g:?}: the kernel is larger than the padded input");
        }
        Ok(())
    }

    /// Multiply-adds of the forward pass (each backward pass does as many).
    pub fn macs(&self) -> usize {
        self.y_len() * (self.c_in / self.groups) * self.k_h * self.k_w
    }

    /// The stride-1 convolution whose data gradient holds this one's split
    /// by phase: at stride s, input row `s·a + r − pad` takes only the taps
    /// `kh = r + s·j`, from output rows `a − j`, so phase (r, r') of
    /// channel c is a stride-1 data gradient over dy with ⌈KH/s⌉×⌈KW/s⌉
    /// taps. Its channels are (c, r, r') (`C_in·s²`), its filters this
    /// one's, its input `(OH + Jh − 1) × (OW + Jw − 1)` unpadded, its
    /// output this one's dy. `conv_phase_filters` makes its filter bank,
    /// `conv_phase_scatter` puts its data gradient in place as dx.
    pub fn phases(&self) -> ConvGeom {
        let s = self.stride;
        let (jh, jw) = (self.k_h.div_ceil(s), self.k_w.div_ceil(s));
        ConvGeom {
            n: self.n,
            c_in: self.c_in * s * s,
            h: self.out_h() + jh - 1,
            w: self.out_w() + jw - 1,
            c_out: self.c_out,
            k_h: jh,
            k_w: jw,
            stride: 1,
            pad: 0,
            groups: self.groups,
        }
    }
}

/// Shape of a `pixel_grid_tf32` layout change: `batches` NCHW images of
/// `c × h × w` copied channel-major onto a grid of `hp × wp` pixels per
/// image, where image b's pixel (y, x) is grid pixel `(b·hp + y)·wp + x`
/// and every other grid pixel is zero. `copies` copies, each `c` rows of
/// `len` elements: `dst[k][ch][q]` = grid pixel `q + shift + k` of
/// channel ch (zero outside the grid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridGeom {
    pub batches: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub hp: usize,
    pub wp: usize,
    pub len: usize,
    pub copies: usize,
    pub shift: isize,
}

impl GridGeom {
    /// The grid `(hp, wp, len)` of a stride-1 convolution's TF32 weight
    /// gradient, the same for x and dy: every tap's input pixel of output
    /// pixel p is `p + kh·wp + kw − (pad·wp + pad)` on x's grid, or a zero
    /// there (the padding after a row or image is the next one's before
    /// it), and dy fits. `wp` is a multiple of 4 and `len` of 32, so that
    /// the kernel's copy-engine boxes start on 16-byte boundaries, which
    /// the copy engine requires of a box's first element along a row (an
    /// H100 run with unaligned starts hung). `None` for a stride above 1.
    pub fn conv(g: &ConvGeom) -> Option<(usize, usize, usize)> {
        if g.stride != 1 {
            return None;
        }
        // Input rows −pad..H + pad − 1 are read: the pad rows after an
        // image are the next one's before it.
        let hp = (g.h + g.pad).max(g.out_h());
        let wp = (g.w + g.pad).max(g.out_w()).next_multiple_of(4);
        Some((hp, wp, (g.n * hp * wp).next_multiple_of(32)))
    }

    /// dy of `g` on its grid ([`GridGeom::conv`]), one copy.
    pub fn dy(g: &ConvGeom) -> Option<Self> {
        let (hp, wp, len) = Self::conv(g)?;
        Some(GridGeom {
            batches: g.n,
            c: g.c_out,
            h: g.out_h(),
            w: g.out_w(),
            hp,
            wp,
            len,
            copies: 1,
            shift: 0,
        })
    }

    /// x of `g` on its grid, a copy per filter column kw shifted by
    /// `kw − (pad·wp + pad)`: tap (kh, kw) of output pixel p is then pixel
    /// `p + kh·wp` of copy kw, a whole number of 16-byte vectors on.
    pub fn x(g: &ConvGeom) -> Option<Self> {
        let (hp, wp, len) = Self::conv(g)?;
        Some(GridGeom {
            batches: g.n,
            c: g.c_in,
            h: g.h,
            w: g.w,
            hp,
            wp,
            len,
            copies: g.k_w,
            shift: -((g.pad * wp + g.pad) as isize),
        })
    }

    /// Floats of the source.
    pub fn src_len(&self) -> usize {
        self.batches * self.c * self.h * self.w
    }

    /// Floats of the grid (all copies).
    pub fn grid_len(&self) -> usize {
        self.copies * self.c * self.len
    }
}

/// Shape of a `row_patches` layout change: `batches` NCHW images of
/// `c × h × w` cut into `rows` rows of `ow` windows of `kw` taps (stride
/// `stride`, padding `pad`), each window row stored as `rw ≥ kw·c` elements:
/// `dst[b][r][o][kw·c + ch] = src[b][ch][r − pad][stride·o − pad + kw]`,
/// zero outside the image and past `kw·c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowGeom {
    pub batches: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub rows: usize,
    pub ow: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
    pub rw: usize,
}

impl RowGeom {
    /// The window rows of convolution `g`'s input x (one group), `rw`
    /// elements each: `rows = stride·(OH−1) + KH` per image, so window
    /// (oh, ow)'s row kh is row `stride·oh + kh`, entry `ow`.
    pub fn patches(g: &ConvGeom, rw: usize) -> Self {
        RowGeom {
            batches: g.n,
            c: g.c_in,
            h: g.h,
            w: g.w,
            rows: g.stride * (g.out_h() - 1) + g.k_h,
            ow: g.out_w(),
            kw: g.k_w,
            stride: g.stride,
            pad: g.pad,
            rw,
        }
    }

    /// The same cut of `g`'s filter bank: `[F][KH][rw]`.
    pub fn filters(g: &ConvGeom, rw: usize) -> Self {
        RowGeom {
            batches: g.c_out,
            c: g.c_in,
            h: g.k_h,
            w: g.k_w,
            rows: g.k_h,
            ow: 1,
            kw: g.k_w,
            stride: 1,
            pad: 0,
            rw,
        }
    }

    pub fn src_len(&self) -> usize {
        self.batches * self.c * self.h * self.w
    }
    pub fn len(&self) -> usize {
        self.batches * self.rows * self.ow * self.rw
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A fully connected layer: `y[n, out] = x[n, in] · w[out, in]ᵀ + b[out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FcGeom {
    pub n: usize,
    pub inputs: usize,
    pub outputs: usize,
}

/// Max pooling over `size × size` windows at `stride` (windows may overlap),
/// no padding, PyTorch's floor rule for the output size. `[n, c, h, w]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub size: usize,
    pub stride: usize,
}

impl PoolGeom {
    pub fn out_h(&self) -> usize {
        (self.h - self.size) / self.stride + 1
    }
    pub fn out_w(&self) -> usize {
        (self.w - self.size) / self.stride + 1
    }
    pub fn x_len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    pub fn y_len(&self) -> usize {
        self.n * self.c * self.out_h() * self.out_w()
    }
}

/// Cross-map local response normalisation as in the paper:
/// `y = x / (k + α·Σ_{j∈window(c)} x_j²)^β`, window = the `size` maps centred
/// on `c` (clipped at the edges). `alpha` multiplies the plain sum (the
/// paper's α; PyTorch's `alpha` is `size` times this).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrnParams {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub size: usize,
    pub alpha: f32,
    pub beta: f32,
    pub k: f32,
}

impl LrnParams {
    pub fn len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Inverted dropout: an element is kept with probability `1 - p` and scaled by
/// `1 / (1 - p)`, so evaluation needs no rescaling. The keep decision for
/// element `i` is a pure function of `(seed, step, i)` (Philox-4x32-10), so
/// backward regenerates the mask instead of storing it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutParams {
    pub p: f32,
    pub seed: u64,
    pub step: u64,
}

/// Which momentum-SGD rule `sgd_update_all` applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SgdRule {
    /// PyTorch's: `v ← μ·v + (g + λ·w)`, `w ← w − lr·v`.
    #[default]
    Pytorch,
    /// The paper's (Krizhevsky et al. 2012, §5):
    /// `v ← μ·v − λ·lr·w − lr·g`, `w ← w + v`.
    Paper,
}

/// A `rows × cols` block copied between row-major views of two buffers:
/// `dst[dst_offset + i·dst_stride + j] = src[src_offset + i·src_stride + j]`
/// for `i < rows`, `j < cols`. The multi-GPU hybrid mode uses it to place a
/// rank's columns of an fc activation into the full one and back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub rows: usize,
    pub cols: usize,
    pub src_offset: usize,
    pub src_stride: usize,
    pub dst_offset: usize,
    pub dst_stride: usize,
}

impl BlockCopy {
    /// A contiguous run of `len` values.
    pub fn run(src_offset: usize, dst_offset: usize, len: usize) -> Self {
        BlockCopy {
            rows: 1,
            cols: len,
            src_offset,
            src_stride: len,
            dst_offset,
            dst_stride: len,
        }
    }

    /// An error unless every row fits both buffers and rows do not overlap
    /// (stride ≥ cols where there is more than one row).
    pub fn check(&self, src_len: usize, dst_len: usize) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let end = |offset: usize, stride: usize| {
            (self.rows - 1)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(offset))
                .and_then(|s| s.checked_add(self.cols))
        };
        let strides_ok =
            self.rows == 1 || (self.src_stride >= self.cols && self.dst_stride >= self.cols);
        let fits = end(self.src_offset, self.src_stride).is_some_and(|e| e <= src_len)
            && end(self.dst_offset, self.dst_stride).is_some_and(|e| e <= dst_len);
        if !strides_ok || !fits {
            anyhow::bail!(
                "invalid block copy {self:?} from a buffer of {src_len} floats into one of {dst_len}"
            );
        }
        Ok(())
    }
}

/// One launch of a recorded stretch of device work (`host bench
/// --profile`): the kernel (or `copy_block`), the label that was current
/// when it was queued ([`Backend::set_profile_label`]) and its time, from
/// the end of the previous launch to its own end (so a gap in which the
/// device waited for the host counts towards the launch after it).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchTime {
    pub kernel: &'static str,
    pub label: String,
    pub ms: f32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub rule: SgdRule,
}

/// One parameter tensor of [`Backend::sgd_update_all`]: weights, their
/// gradient and momentum, of equal lengths, and optionally the bf16 or
/// TF32 copy of the weights that an fc layer keeps
/// ([`Backend::fc_kept_len`]), which the update refreshes from the new
/// weights (backends that keep no such copies refuse one).
pub struct SgdTensor<'a, Buf> {
    pub w: &'a mut Buf,
    pub g: &'a Buf,
    pub v: &'a mut Buf,
    pub copy: Option<&'a mut Buf>,
}

/// The values of a training step that change from step to step: dropout's
/// step (its masks' counter) and the SGD hyper-parameters (the learning rate
/// follows a schedule). The CUDA backend keeps them in a small device buffer
/// that its dropout and SGD kernels read, so a captured step graph replays
/// with new values ([`Backend::replay`]); everything else a graph holds is
/// fixed when it is captured.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct StepArgs {
    pub dropout_step: u64,
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

impl StepArgs {
    /// The values of a step with dropout step `dropout_step` and update `sgd`.
    pub fn new(dropout_step: u64, sgd: &SgdParams) -> Self {
        StepArgs {
            dropout_step,
            lr: sgd.lr,
            momentum: sgd.momentum,
            weight_decay: sgd.weight_decay,
        }
    }
}

/// A compute backend. `Buf` holds f32 values, `Labels` holds class indices.
pub trait Backend {
    type Buf;
    type Labels;
    /// See [`Backend::sgd_update_all`].
    type SgdTable: Default;
    /// A captured sequence of launches ([`Backend::capture`]); a CUDA graph,
    /// `Infallible` where the backend has none.
    type Graph;

    /// A short human-readable name ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    /// A buffer of `len` zeros.
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// The buffers of `plan`, zeroed: one allocation of `plan.total` floats
    /// where buffers whose ranges overlap share bytes (the caller keeps them
    /// from holding values at the same time). The default allocates each
    /// buffer apart (the CPU reference has no device memory to save).
    fn arena(&self, plan: &crate::arena::ArenaPlan) -> Result<Vec<Self::Buf>> {
        plan.lens.iter().map(|&len| self.zeros(len)).collect()
    }
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    fn write(&self, dst: &mut Self::Buf, host: &[f32]) -> Result<()>;
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    fn upload_labels(&self, host: &[i32]) -> Result<Self::Labels>;
    fn write_labels(&self, dst: &mut Self::Labels, host: &[i32]) -> Result<()>;
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Copies a block between two buffers on the device ([`BlockCopy`]);
    /// nothing else in `dst` changes.
    fn copy_block(&self, b: &BlockCopy, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;
    /// Wait for all queued work; reports any asynchronous failure.
    fn synchronize(&self) -> Result<()>;

    /// Milliseconds of each of `reps` calls of `f` after `warmup` untimed
    /// ones. The default uses the host clock around a synchronised call; the
    /// CUDA backend times with events on its stream.
    fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        for _ in 0..warmup {
            f()?;
        }
        self.synchronize()?;
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                f()?;
                self.synchronize()?;
                Ok(t.elapsed().as_secs_f32() * 1e3)
            })
            .collect()
    }

    /// `(free, total)` device memory in bytes, where the backend has any.
    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    /// Starts recording the time of every launch from here on (the CUDA
    /// backend records an event after each); `false`, and nothing
    /// recorded, where the backend keeps no such record (the CPU's).
    fn start_launch_profile(&self) -> Result<bool> {
        Ok(false)
    }
    /// Labels the launches queued from now on ("conv2 fwd"); does nothing
    /// unless a recording is on.
    fn set_profile_label(&self, _label: &str) {}
    /// Ends the recording: every launch since the start, in order, with its
    /// time (waits for the device). Empty where nothing was recorded.
    fn finish_launch_profile(&self) -> Result<Vec<LaunchTime>> {
        Ok(Vec::new())
    }

    /// `y = conv(x, w) + bias`.
    fn conv_forward(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// `conv_forward` followed by `relu_forward` on `y` (one pass on the GPU).
    fn conv_forward_relu(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        bias: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()> {
        self.conv_forward(g, x, w, bias, y)?;
        self.relu_forward(y)
    }
    /// Floats of the operand copy of x that a convolution's forward can keep
    /// for its weight gradient (`conv_forward_keep`), where both read x in
    /// the same layout; 0 where there is none (the CPU reads x as it is).
    /// Times the kernels that could run `g`'s products (the data gradient
    /// only where `data`) and keeps the fastest for that shape, as cuDNN's
    /// benchmark mode does; returns the products that had a choice. A
    /// no-op where there is nothing to choose or autotuning is off (CUDA:
    /// `CudaBackend::set_autotune`).
    fn autotune_conv(&self, _g: &ConvGeom, _data: bool) -> Result<Vec<TunedKernel>> {
        Ok(Vec::new())
    }

    fn conv_kept_len(&self, _g: &ConvGeom) -> usize {
        0
    }
    /// `conv_forward` (`conv_forward_relu` with `relu`) that also leaves in
    /// `kept` (`conv_kept_len` floats) its operand copy of x, for
    /// `conv_backward_kept` to read instead of making it again.
    #[allow(clippy::too_many_arguments)] // the layer's tensors and the copy
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
        let _ = kept;
        if relu {
            self.conv_forward_relu(g, x, w, bias, y)
        } else {
            self.conv_forward(g, x, w, bias, y)
        }
    }
    /// `dx = ∂L/∂x` from `dy` (overwrites `dx`).
    fn conv_backward_data(
        &self,
        g: &ConvGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()>;
    /// `dw = ∂L/∂w` (overwrites `dw`).
    fn conv_backward_filter(
        &self,
        g: &ConvGeom,
        x: &Self::Buf,
        dy: &Self::Buf,
        dw: &mut Self::Buf,
    ) -> Result<()>;
    /// `db[c] = Σ_{n,h,w} dy[n,c,h,w]` (overwrites `db`).
    fn conv_backward_bias(&self, g: &ConvGeom, dy: &Self::Buf, db: &mut Self::Buf) -> Result<()>;
    /// A convolution's whole backward: `conv_backward_filter`,
    /// `conv_backward_bias` and, when `dx` is given, `conv_backward_data`,
    /// with `relu` followed by the backward of the ReLU whose output `x` is
    /// (`dx = 0` where `x ≤ 0`). The GPU relays dy out once for the data
    /// and weight gradients and masks dx in the data gradient's epilogue.
    #[allow(clippy::too_many_arguments)] // the layer's tensors and gradients
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
        self.conv_backward_filter(g, x, dy, dw)?;
        self.conv_backward_bias(g, dy, db)?;
        let Some(dx) = dx else { return Ok(()) };
        self.conv_backward_data(g, dy, w, dx)?;
        if relu {
            self.relu_backward(x, dx)?;
        }
        Ok(())
    }
    /// `conv_backward` whose weight gradient reads x's operand copy from
    /// `kept`, which `conv_forward_keep` wrote from this same x (x itself is
    /// still read for the ReLU's mask).
    #[allow(clippy::too_many_arguments)] // the layer's tensors and gradients
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
        let _ = kept;
        self.conv_backward(g, x, dy, w, dw, db, dx, relu)
    }

    /// `y = x·wᵀ + b`.
    fn fc_forward(
        &self,
        g: &FcGeom,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// `dx = dy·w`.
    fn fc_backward_data(
        &self,
        g: &FcGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()>;
    /// Floats of the operand copy of w that an fc forward can keep for its
    /// data gradient (`fc_forward_keep`), where both read w in the same
    /// form (the GPU's bf16 products); 0 where there is none.
    fn fc_kept_len(&self, _g: &FcGeom) -> usize {
        0
    }
    /// `fc_forward` that also leaves in `kept` (`fc_kept_len` floats) its
    /// operand copy of w, for `fc_backward_data_kept` to read instead of
    /// making it again; with `fresh`, `kept` already holds the copy of this
    /// w (`sgd_update_all` refreshed it), and the forward only reads it.
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
        let _ = (kept, fresh);
        self.fc_forward(g, x, w, b, y)
    }
    /// `fc_backward_data` reading w's operand copy from `kept`, which
    /// `fc_forward_keep` wrote from this same w.
    fn fc_backward_data_kept(
        &self,
        g: &FcGeom,
        dy: &Self::Buf,
        w: &Self::Buf,
        kept: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        let _ = kept;
        self.fc_backward_data(g, dy, w, dx)
    }
    /// `dw = dyᵀ·x`.
    fn fc_backward_filter(
        &self,
        g: &FcGeom,
        x: &Self::Buf,
        dy: &Self::Buf,
        dw: &mut Self::Buf,
    ) -> Result<()>;
    /// `db[j] = Σ_n dy[n, j]`.
    fn fc_backward_bias(&self, g: &FcGeom, dy: &Self::Buf, db: &mut Self::Buf) -> Result<()>;

    /// `y ← max(y, 0)` in place.
    fn relu_forward(&self, y: &mut Self::Buf) -> Result<()>;
    /// `d ← d · [y > 0]` in place (`y` is the ReLU's output).
    fn relu_backward(&self, y: &Self::Buf, d: &mut Self::Buf) -> Result<()>;

    /// `y = lrn(x)`; also writes `scale = k + α·Σx²` for the backward pass.
    fn lrn_forward(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &mut Self::Buf,
        scale: &mut Self::Buf,
    ) -> Result<()>;
    /// `dx` from `dy`, given the forward's `x`, `y` and `scale`.
    fn lrn_backward(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &Self::Buf,
        scale: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()>;
    /// `lrn_backward` followed by the backward pass of the ReLU whose output
    /// `x` is (`dx = 0` where `x ≤ 0`; one pass on the GPU).
    fn lrn_backward_relu(
        &self,
        p: &LrnParams,
        x: &Self::Buf,
        y: &Self::Buf,
        scale: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        self.lrn_backward(p, x, y, scale, dy, dx)?;
        self.relu_backward(x, dx)
    }

    /// Whether [`Backend::lrn_pool_forward`] / [`Backend::lrn_pool_backward`]
    /// take LRN `p` followed by max pool `g` in one pass each (the model
    /// fuses the pair when they do, else runs them one by one).
    fn lrn_pool_fusable(&self, p: &LrnParams, g: &PoolGeom) -> bool;
    /// `lrn_forward` then `maxpool_forward` on its output, writing only the
    /// pool's `z` and `arg` (`x` is `p`'s input, `z` and `arg` `g`'s output).
    fn lrn_pool_forward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Self::Buf,
        z: &mut Self::Buf,
        arg: &mut Self::Buf,
    ) -> Result<()>;
    /// The backward of [`Backend::lrn_pool_forward`]: `dx` from `x`, `arg`
    /// and `dz`, as `maxpool_backward` then `lrn_backward` (then, with
    /// `relu`, the backward of the ReLU whose output `x` is) would give.
    #[allow(clippy::too_many_arguments)] // the tensors, plus the ReLU flag
    fn lrn_pool_backward(
        &self,
        p: &LrnParams,
        g: &PoolGeom,
        x: &Self::Buf,
        arg: &Self::Buf,
        dz: &Self::Buf,
        dx: &mut Self::Buf,
        relu: bool,
    ) -> Result<()>;

    /// `y` = each window's maximum; `arg` (same length) = where its first
    /// maximum lies (row-major scan; ties go to the lowest row, then
    /// column), as the offset `a·size + b` in the window, stored as f32.
    fn maxpool_forward(
        &self,
        g: &PoolGeom,
        x: &Self::Buf,
        y: &mut Self::Buf,
        arg: &mut Self::Buf,
    ) -> Result<()>;
    /// Routes each `dy` to the element its window's `arg` names; overlapping
    /// windows add up.
    fn maxpool_backward(
        &self,
        g: &PoolGeom,
        arg: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()>;
    /// `maxpool_backward` followed by the backward of the ReLU whose output
    /// the pool's input `x` is (`dx = 0` where x ≤ 0); `y` is the pool's
    /// output. The GPU does both in one pass (masking by `y`: a window's
    /// gradient goes to its maximum, whose x is the window's y).
    #[allow(clippy::too_many_arguments)] // the pool's tensors and gradients
    fn maxpool_backward_relu(
        &self,
        g: &PoolGeom,
        arg: &Self::Buf,
        x: &Self::Buf,
        y: &Self::Buf,
        dy: &Self::Buf,
        dx: &mut Self::Buf,
    ) -> Result<()> {
        let _ = y;
        self.maxpool_backward(g, arg, dy, dx)?;
        self.relu_backward(x, dx)
    }

    /// Inverted dropout in place.
    fn dropout_forward(&self, p: &DropoutParams, y: &mut Self::Buf) -> Result<()>;
    /// Applies the same mask and scale to the gradient in place.
    fn dropout_backward(&self, p: &DropoutParams, d: &mut Self::Buf) -> Result<()>;

    /// Row-wise softmax of `logits [n, classes]` into `probs`, and the
    /// per-sample cross-entropy `loss[i] = −ln probs[i, labels[i]]`.
    fn softmax_xent_forward(
        &self,
        n: usize,
        classes: usize,
        logits: &Self::Buf,
        labels: &Self::Labels,
        probs: &mut Self::Buf,
        loss: &mut Self::Buf,
    ) -> Result<()>;
    /// Gradient of the mean loss: `dlogits = (probs − onehot(labels)) / n`.
    fn softmax_xent_backward(
        &self,
        n: usize,
        classes: usize,
        probs: &Self::Buf,
        labels: &Self::Labels,
        dlogits: &mut Self::Buf,
    ) -> Result<()>;
    /// `rank[i]` = how many classes score strictly higher than the true one
    /// (top-k correct ⇔ rank < k). Written as f32.
    fn label_rank(
        &self,
        n: usize,
        classes: usize,
        scores: &Self::Buf,
        labels: &Self::Labels,
        rank: &mut Self::Buf,
    ) -> Result<()>;

    /// One momentum-SGD step over every tensor of `tensors`, in place, in
    /// one pass (one launch on the GPU). `table` is what the backend keeps
    /// for this list of tensors (the CUDA backend: their addresses and
    /// lengths on the device); start from `Default` and pass the same one
    /// with the same tensors each step: it is built on the first call, and
    /// rebuilt if the tensors differ.
    fn sgd_update_all(
        &self,
        p: &SgdParams,
        tensors: &mut [SgdTensor<'_, Self::Buf>],
        table: &mut Self::SgdTable,
    ) -> Result<()>;

    /// Why [`Backend::capture`] does not work here; `None` where it does
    /// (CUDA, unless every launch is synchronised for debugging).
    fn no_graphs_reason(&self) -> Option<String> {
        Some(format!("the {} backend has no graphs", self.name()))
    }
    /// Records the work `f` queues into a graph, running none of it, after
    /// writing `args` where the dropout and SGD kernels read them (see
    /// [`StepArgs`]); `f`'s dropout and SGD calls must use those values.
    /// `f` must not allocate: run the same work once before capturing so
    /// that workspaces have grown. An error (nothing ran) where the backend
    /// cannot capture.
    fn capture(&self, args: &StepArgs, f: &mut dyn FnMut() -> Result<()>) -> Result<Self::Graph> {
        let _ = (args, f);
        anyhow::bail!("the {} backend cannot capture graphs", self.name())
    }
    /// Whether `g` may still be replayed: false once something it was
    /// captured with has changed on the backend's side (a workspace or
    /// scratch buffer regrown, a setting such as the precision changed).
    fn graph_current(&self, g: &Self::Graph) -> bool;
    /// A count that moves whenever the backend replaces a buffer a graph
    /// would point at (see [`Backend::graph_current`]): an eager step that
    /// moved it grew something, so the buffers the next step sees differ
    /// from the ones it used, and it is no warm-up for a capture.
    fn buffers_generation(&self) -> u64 {
        0
    }
    /// Writes `args` (see [`StepArgs`]) and queues graph `g` once more.
    ///
    /// # Safety
    /// Every buffer the captured work used must still be alive and
    /// unmoved (the backend checks its own ones: see
    /// [`Backend::graph_current`]).
    unsafe fn replay(&self, g: &Self::Graph, args: &StepArgs) -> Result<()>;
}
