//! 2-D convolution (stride, zero padding, groups) as implicit GEMM on the
//! tiled engine of `gemm.rs`: the image patches are gathered on the fly while
//! loading shared-memory tiles, never materialised (no im2col buffer).
//!
//! Layouts (PyTorch's): x `[N, C_in, H, W]`, w `[C_out, C_in/G, KH, KW]`,
//! y `[N, C_out, OH, OW]`. Per group g (grid z), with Cg = C_in/G, Fg = C_out/G:
//! - forward:  C[f, (n,oh,ow)] = Σ_(c,kh,kw) w[g·Fg+f, c, kh, kw] · x[n, g·Cg+c, oh·s−p+kh, ow·s−p+kw]
//! - data:     C[c, (n,ih,iw)] = Σ_(f,kh,kw) w[g·Fg+f, c, kh, kw] · dy[n, g·Fg+f, (ih+p−kh)/s, (iw+p−kw)/s]
//!   (terms where the division is inexact or out of range are zero)
//! - filter:   C[f, (c,kh,kw)] = Σ_(n,oh,ow) dy[n, g·Fg+f, oh, ow] · x[n, g·Cg+c, oh·s−p+kh, ow·s−p+kw],
//!   split over K into `splits` slices (grid z = g·splits + slice) whose
//!   partials `splitk_reduce` sums in a fixed order (the TMA kernels' in
//!   GEMM order, which `conv_backward_filter_sum` sums and permutes).
//!
//! Grid (⌈N_gemm/64⌉, ⌈M_gemm/BM⌉, G or G·splits) with BM = 64, or 128 for
//! the `_wide` variants, 256 threads, `gemm::shared_bytes(wide)` of dynamic
//! shared memory.
//!
//! The channels-last kernels (`*_nhwc*`, `*_rows*`) read NHWC copies on the
//! vector and warpgroup engines; on Hopper the 128×128 forwards, stride-1
//! data gradients and bf16 weight gradients whose groups' channels fill a
//! tap's 128-byte K tiles (at least three quarters of the last) also come
//! fed by the tensor memory accelerator (`*_wg_tma_big`, [`ConvTma`]: the
//! im2col is done by the copy engine, from tensor maps the host makes).

use crate::device::{
    FastDiv, bdim_x, bid_x, bid_y, bid_z, block_sum, grid_stride, grid_stride_u32, shared, tid_x,
};
use crate::gemm::{
    BK, Epilogue, Operand, SLOT_STRIDE, Strided, Transposed, VStrided, VecOperand, elem_at, gemm_kernels,
    gemm_tile, gemm_tile_v, split_range, vbk, vlen,
};

/// Convolution shape, passed by value to every conv kernel.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ConvShape {
    pub n: u32,
    pub c_in: u32,
    pub h: u32,
    pub w: u32,
    pub c_out: u32,
    pub kh: u32,
    pub kw: u32,
    pub stride: u32,
    pub pad: u32,
    pub groups: u32,
    pub oh: u32,
    pub ow: u32,
    /// Forward: nonzero to apply ReLU in the epilogue (`max(0, ·)`). Data
    /// gradient: nonzero to apply the backward of the ReLU whose output x is.
    pub relu: u32,
}

impl ConvShape {
    #[inline(always)]
    fn cg(&self) -> u32 {
        self.c_in / self.groups
    }
    #[inline(always)]
    fn fg(&self) -> u32 {
        self.c_out / self.groups
    }
    #[inline(always)]
    fn kk(&self) -> u32 {
        self.kh * self.kw
    }

    /// The output position `(th/s, tw/s)` that input offset `(th, tw) =
    /// (ih+p−kh, iw+p−kw)` comes from, `None` where the division is inexact
    /// or the position lies outside the output (the data gradient's rule).
    #[inline(always)]
    fn out_pos(&self, th: i32, tw: i32) -> Option<(u32, u32)> {
        let (oh, ow) = if self.stride == 1 {
            (th as u32, tw as u32)
        } else {
            if th < 0 || tw < 0 {
                return None;
            }
            let (th, tw) = (th as u32, tw as u32);
            if th % self.stride != 0 || tw % self.stride != 0 {
                return None;
            }
            (th / self.stride, tw / self.stride)
        };
        // A negative th or tw wraps to a huge unsigned value: out of range.
        (oh < self.oh && ow < self.ow).then_some((oh, ow))
    }
}

/// `BK` written in a three-digit mixed radix `(top, hi, lo)` with digit
/// limits `(·, h, l)`: `BK = top·h·l + hi·l + lo`. Computed once per thread,
/// it lets a cursor step along k with adds and compares.
#[derive(Clone, Copy)]
struct Step {
    top: u32,
    hi: u32,
    lo: u32,
}

impl Step {
    #[inline(always)]
    fn new(h: u32, l: u32) -> Self {
        Self::with(BK, h, l)
    }

    /// The step `bk` (instead of `BK`) in the same radix.
    #[inline(always)]
    fn with(bk: u32, h: u32, l: u32) -> Self {
        let r = bk % (h * l);
        Step {
            top: bk / (h * l),
            hi: r / l,
            lo: r % l,
        }
    }

    /// Adds the step to the digits `(hi, lo)` (limits `h`, `l`) and returns
    /// how far the top digit moves. Each digit overflows at most once
    /// (`digit + step digit + carry ≤ 2·limit − 1`).
    #[inline(always)]
    fn advance(self, hi: &mut u32, lo: &mut u32, h: u32, l: u32) -> u32 {
        *lo += self.lo;
        let mut carry = 0;
        if *lo >= l {
            *lo -= l;
            carry = 1;
        }
        *hi += self.hi + carry;
        let mut top = self.top;
        if *hi >= h {
            *hi -= h;
            top += 1;
        }
        top
    }
}

/// x gathered as B((c,kh,kw), (n,oh,ow)) for one group.
struct Patches {
    x: *const f32,
    s: ConvShape,
    g: u32,
    step: Step,
}

impl Patches {
    #[inline(always)]
    fn new(x: *const f32, s: ConvShape, g: u32) -> Self {
        let step = Step::new(s.kh, s.kw);
        Patches { x, s, g, step }
    }

    /// Offset of the plane (n, g·Cg + c) of x.
    #[inline(always)]
    fn plane(&self, n: u32, c: u32) -> usize {
        let s = &self.s;
        (n as usize * s.c_in as usize + (self.g * s.cg() + c) as usize) * (s.h * s.w) as usize
    }

    #[inline(always)]
    fn inside(&self, ih: i32, iw: i32) -> bool {
        (ih as u32) < self.s.h && (iw as u32) < self.s.w
    }
}

/// A `Patches` cursor: the shared tap `(c, kh, kw)` (as `chan` = c·H·W and
/// `tap` = chan + kh·W + kw) and, per element j, the window origin
/// `(ih0, iw0) = (oh·s−p, ow·s−p)` and `origin` = the offset of that pixel in
/// the image's first channel of the group (wrapping: it may lie before it).
#[derive(Clone, Copy)]
struct PatchCursor {
    origin: [usize; 4],
    ih0: [i32; 4],
    iw0: [i32; 4],
    kh: u32,
    kw: u32,
    chan: usize,
    tap: usize,
}

impl Operand for Patches {
    const K_FAST: bool = false;
    type Cursor = PatchCursor;
    #[inline(always)]
    fn open(&self, k: u32, n0: u32) -> PatchCursor {
        let s = &self.s;
        let (c, r) = (k / s.kk(), k % s.kk());
        let (kh, kw) = (r / s.kw, r % s.kw);
        let mut cur = PatchCursor {
            origin: [0; 4],
            ih0: [0; 4],
            iw0: [0; 4],
            kh,
            kw,
            chan: c as usize * (s.h * s.w) as usize,
            tap: 0,
        };
        for j in 0..4 {
            let n = n0 + SLOT_STRIDE * j as u32;
            let (img, p) = (n / (s.oh * s.ow), n % (s.oh * s.ow));
            let ih0 = ((p / s.ow) * s.stride) as i32 - s.pad as i32;
            let iw0 = ((p % s.ow) * s.stride) as i32 - s.pad as i32;
            cur.ih0[j] = ih0;
            cur.iw0[j] = iw0;
            let within = ih0 as isize * s.w as isize + iw0 as isize;
            cur.origin[j] = self.plane(img, 0).wrapping_add(within as usize);
        }
        cur.tap = cur.chan + (kh * s.w + kw) as usize;
        cur
    }
    #[inline(always)]
    fn src(&self, c: &PatchCursor, j: usize) -> Option<*const f32> {
        if self.inside(c.ih0[j] + c.kh as i32, c.iw0[j] + c.kw as i32) {
            Some(self.x.wrapping_add(c.origin[j].wrapping_add(c.tap)))
        } else {
            None
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.x
    }
    #[inline(always)]
    fn step(&self, c: &mut PatchCursor) {
        let s = &self.s;
        let channels = self.step.advance(&mut c.kh, &mut c.kw, s.kh, s.kw);
        c.chan += channels as usize * (s.h * s.w) as usize;
        c.tap = c.chan + (c.kh * s.w + c.kw) as usize;
    }
}

/// Stores y[n, g·Fg+f, oh, ow] = acc + bias, through ReLU if `s.relu`.
/// With `FAST` (the TMA kernels), a [`FastDiv`](crate::device::FastDiv)
/// made once per tile divides by OH·OW; without, a plain division.
struct StoreOutput<const FAST: bool> {
    y: *mut f32,
    bias: *const f32,
    s: ConvShape,
    g: u32,
    ohw: crate::device::FastDiv,
}

impl<const FAST: bool> StoreOutput<FAST> {
    #[inline(always)]
    fn new(y: *mut f32, bias: *const f32, s: ConvShape, g: u32) -> Self {
        let ohw = fast_div::<FAST>(s.oh * s.ow);
        StoreOutput { y, bias, s, g, ohw }
    }
}

/// A [`FastDiv`](crate::device::FastDiv) by `d` where `FAST`, else an
/// unused placeholder (the epilogue then divides by `d` itself).
#[inline(always)]
fn fast_div<const FAST: bool>(d: u32) -> crate::device::FastDiv {
    if FAST {
        crate::device::FastDiv::new(d)
    } else {
        crate::device::FastDiv { d: 0, mul: 0, shr: 0 }
    }
}

impl<const FAST: bool> Epilogue for StoreOutput<FAST> {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let (img, p) = if FAST {
            self.ohw.divmod(n)
        } else {
            (n / ohw, n % ohw)
        };
        let f = self.g * s.fg() + m;
        let idx = (img as usize * s.c_out as usize + f as usize) * ohw as usize + p as usize;
        let v = acc + unsafe { *self.bias.add(f as usize) };
        unsafe { *self.y.add(idx) = if s.relu != 0 { v.max(0.0) } else { v } };
    }
}

/// Convolution forward, `y = conv(x, w) + bias`; see the module doc.
/// Grid (⌈N·OH·OW/64⌉, ⌈Fg/BM⌉, G).
unsafe fn conv_forward_impl<const MODE: u8, const WIDE: bool>(
    s: ConvShape,
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    let g = bid_z();
    let k_len = s.cg() * s.kk();
    let a = Strided::<true> {
        p: unsafe { w.add((g * s.fg() * k_len) as usize) },
        ks: 1,
        is: k_len as usize,
    };
    let b = Patches::new(x, s, g);
    let e = StoreOutput::<false>::new(y, bias, s, g);
    unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, s.fg(), s.n * s.oh * s.ow, 0, k_len) };
}

gemm_kernels!(conv_forward_impl (s: ConvShape, x: *const f32, w: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward: FP32, false; conv_forward_tf32: TF32, false; conv_forward_bf16: BF16, false; conv_forward_wide: FP32, true; conv_forward_tf32_wide: TF32, true; conv_forward_bf16_wide: BF16, true);

/// w viewed as A(c, (f,kh,kw)) for one group (the transposed filter bank):
/// `w[(f·Cg + c)·KK + r]`, r = kh·KW + kw.
struct WeightCols {
    w: *const f32,
    s: ConvShape,
    step: Step,
}

/// A `WeightCols` cursor: the shared filter (as `f_off` = f·Cg·KK) and tap
/// r, and the first element's channel offset `c0·KK`.
#[derive(Clone, Copy)]
struct TapCursor {
    f_off: usize,
    r: u32,
    c_off: usize,
}

impl Operand for WeightCols {
    const K_FAST: bool = true;
    type Cursor = TapCursor;
    #[inline(always)]
    fn open(&self, k: u32, c0: u32) -> TapCursor {
        let kk = self.s.kk();
        TapCursor {
            f_off: (k / kk) as usize * (self.s.cg() * kk) as usize,
            r: k % kk,
            c_off: c0 as usize * kk as usize,
        }
    }
    #[inline(always)]
    fn src(&self, c: &TapCursor, j: usize) -> Option<*const f32> {
        let slot = j * (SLOT_STRIDE * self.s.kk()) as usize;
        Some(self.w.wrapping_add(c.f_off + c.r as usize + c.c_off + slot))
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.w
    }
    #[inline(always)]
    fn step(&self, c: &mut TapCursor) {
        let mut unused = 0;
        let filters = self.step.advance(&mut unused, &mut c.r, 1, self.s.kk());
        c.f_off += filters as usize * (self.s.cg() * self.s.kk()) as usize;
    }
}

/// dy gathered as B((f,kh,kw), (n,ih,iw)) for one group.
struct GradPatches {
    dy: *const f32,
    s: ConvShape,
    g: u32,
    step: Step,
}

/// A `GradPatches` cursor: the shared filter (as `f_off` = f·OH·OW) and
/// tap, and per element j dy's plane (n, g·Fg) and `(ih+p, iw+p)`.
#[derive(Clone, Copy)]
struct GradPatchCursor {
    plane: [usize; 4],
    th0: [i32; 4],
    tw0: [i32; 4],
    kh: u32,
    kw: u32,
    f_off: usize,
}

impl Operand for GradPatches {
    const K_FAST: bool = false;
    type Cursor = GradPatchCursor;
    #[inline(always)]
    fn open(&self, k: u32, n0: u32) -> GradPatchCursor {
        let s = &self.s;
        let (f, r) = (k / s.kk(), k % s.kk());
        let mut cur = GradPatchCursor {
            plane: [0; 4],
            th0: [0; 4],
            tw0: [0; 4],
            kh: r / s.kw,
            kw: r % s.kw,
            f_off: f as usize * (s.oh * s.ow) as usize,
        };
        for j in 0..4 {
            let n = n0 + SLOT_STRIDE * j as u32;
            let (img, p) = (n / (s.h * s.w), n % (s.h * s.w));
            let ch = img as usize * s.c_out as usize + (self.g * s.fg()) as usize;
            cur.plane[j] = ch * (s.oh * s.ow) as usize;
            cur.th0[j] = (p / s.w + s.pad) as i32;
            cur.tw0[j] = (p % s.w + s.pad) as i32;
        }
        cur
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.dy
    }
    #[inline(always)]
    fn src(&self, c: &GradPatchCursor, j: usize) -> Option<*const f32> {
        let s = &self.s;
        let (oh, ow) = s.out_pos(c.th0[j] - c.kh as i32, c.tw0[j] - c.kw as i32)?;
        Some(
            self.dy
                .wrapping_add(c.plane[j] + c.f_off + oh as usize * s.ow as usize + ow as usize),
        )
    }
    #[inline(always)]
    fn step(&self, c: &mut GradPatchCursor) {
        let filters = self
            .step
            .advance(&mut c.kh, &mut c.kw, self.s.kh, self.s.kw);
        c.f_off += filters as usize * (self.s.oh * self.s.ow) as usize;
    }
}

/// Stores dx[n, g·Cg+c, ih, iw]; with `s.relu` set, 0 where `mask` (x, the
/// output of the ReLU before the convolution, NCHW) is ≤ 0: that ReLU's
/// backward, so it needs no pass of its own.
/// With `FAST` (the TMA kernels), a [`FastDiv`](crate::device::FastDiv)
/// made once per tile divides by H·W; without, a plain division.
struct StoreInputGrad<const FAST: bool> {
    dx: *mut f32,
    mask: *const f32,
    s: ConvShape,
    g: u32,
    hw: crate::device::FastDiv,
}

impl<const FAST: bool> StoreInputGrad<FAST> {
    #[inline(always)]
    fn new(dx: *mut f32, mask: *const f32, s: ConvShape, g: u32) -> Self {
        let hw = fast_div::<FAST>(s.h * s.w);
        StoreInputGrad { dx, mask, s, g, hw }
    }
}

impl<const FAST: bool> Epilogue for StoreInputGrad<FAST> {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let hw = s.h * s.w;
        let (img, p) = if FAST {
            self.hw.divmod(n)
        } else {
            (n / hw, n % hw)
        };
        let ch = (img * s.c_in + self.g * s.cg() + m) as usize;
        let at = ch * hw as usize + p as usize;
        let v = if s.relu != 0 && !(unsafe { *self.mask.add(at) } > 0.0) {
            0.0
        } else {
            acc
        };
        unsafe { *self.dx.add(at) = v };
    }
}

/// Convolution data gradient, `dx = ∂L/∂x`; see the module doc.
/// Grid (⌈N·H·W/64⌉, ⌈Cg/BM⌉, G).
unsafe fn conv_backward_data_impl<const MODE: u8, const WIDE: bool>(
    s: ConvShape,
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    let g = bid_z();
    let k_len = s.fg() * s.kk();
    let a = WeightCols {
        w: unsafe { w.add((g * s.fg() * s.cg() * s.kk()) as usize) },
        s,
        step: Step::new(1, s.kk()),
    };
    let b = GradPatches {
        dy,
        s,
        g,
        step: Step::new(s.kh, s.kw),
    };
    let e = StoreInputGrad::<false>::new(dx, mask, s, g);
    unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, s.cg(), s.n * s.h * s.w, 0, k_len) };
}

gemm_kernels!(conv_backward_data_impl (s: ConvShape, dy: *const f32, w: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data: FP32, false; conv_backward_data_tf32: TF32, false; conv_backward_data_bf16: BF16, false; conv_backward_data_wide: FP32, true; conv_backward_data_tf32_wide: TF32, true; conv_backward_data_bf16_wide: BF16, true);

// ---------------------------------------------------------------------------
// The data gradient by columns, for strided convolutions with few channels
// per group (conv1: 3 channels, stride 4), where the gathered products
// above pad the channels to whole tiles and, at stride s, multiply s² − 1
// of every s² taps by zero. Two launches per chunk of images `img0..+imgs`:
// - `conv_backward_data_cols`: cols[img][(c,kh,kw)][oh·OW+ow] =
//   Σ_f w[g·Fg+f, c, kh, kw] · dy[img0+img, g·Fg+f, oh, ow], a dense
//   product with M = Cg·KH·KW, N = imgs·OH·OW, K = Fg; grid (⌈N/64⌉,
//   ⌈M/BM⌉, G), 256 threads.
// - `conv_cols_sum`: dx[img0+img, c, ih, iw] = Σ of the cols entries whose
//   tap lands on (ih, iw), at most ⌈KH/s⌉·⌈KW/s⌉ of them, then the ReLU
//   mask; a thread per element of dx (NCHW), grid-stride.
// ---------------------------------------------------------------------------

/// dy of images `img0..` as B(f, (img, oh, ow)) for one group: element at
/// `dy[((img0+img)·C_out + g·Fg + f)·OH·OW + oh·OW + ow]`.
struct DyPlanes {
    dy: *const f32,
    s: ConvShape,
    g: u32,
    img0: u32,
}

impl Operand for DyPlanes {
    const K_FAST: bool = false;
    type Cursor = [usize; 4];
    #[inline(always)]
    fn open(&self, k: u32, n0: u32) -> [usize; 4] {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let mut at = [0; 4];
        for (j, a) in at.iter_mut().enumerate() {
            let n = n0 + SLOT_STRIDE * j as u32;
            let (img, p) = (n / ohw, n % ohw);
            let plane = (self.img0 + img) as usize * s.c_out as usize + (self.g * s.fg() + k) as usize;
            *a = plane * ohw as usize + p as usize;
        }
        at
    }
    #[inline(always)]
    fn src(&self, c: &[usize; 4], j: usize) -> Option<*const f32> {
        Some(self.dy.wrapping_add(c[j]))
    }
    #[inline(always)]
    fn step(&self, c: &mut [usize; 4]) {
        let plane = BK as usize * (self.s.oh * self.s.ow) as usize;
        for a in c.iter_mut() {
            *a = a.wrapping_add(plane);
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.dy
    }
}

/// Stores C[(c,kh,kw), (img, p)] of group g at
/// `cols[(img·C_in + g·Cg + c)·KH·KW + kh·KW + kw)·OH·OW + p]`.
struct StoreCols {
    cols: *mut f32,
    s: ConvShape,
    g: u32,
}

impl Epilogue for StoreCols {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let (img, p) = (n / ohw, n % ohw);
        let row = (img * s.c_in + self.g * s.cg()) as usize * s.kk() as usize + m as usize;
        unsafe { *self.cols.add(row * ohw as usize + p as usize) = acc };
    }
}

/// The column product of the data gradient for images `img0..img0+imgs`
/// (see the section comment above).
unsafe fn conv_backward_data_cols_impl<const MODE: u8, const WIDE: bool>(
    s: ConvShape,
    dy: *const f32,
    w: *const f32,
    cols: *mut f32,
    img0: u32,
    imgs: u32,
) {
    let g = bid_z();
    let m = s.cg() * s.kk();
    let a = Strided::<false> {
        p: w.wrapping_add((g * s.fg()) as usize * m as usize),
        ks: m as usize,
        is: 1,
    };
    let b = DyPlanes { dy, s, g, img0 };
    let e = StoreCols { cols, s, g };
    unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, m, imgs * s.oh * s.ow, 0, s.fg()) };
}

gemm_kernels!(conv_backward_data_cols_impl (s: ConvShape, dy: *const f32, w: *const f32, cols: *mut f32, img0: u32, imgs: u32) =>
    conv_backward_data_cols: FP32, false; conv_backward_data_cols_tf32: TF32, false; conv_backward_data_cols_bf16: BF16, false; conv_backward_data_cols_wide: FP32, true; conv_backward_data_cols_tf32_wide: TF32, true; conv_backward_data_cols_bf16_wide: BF16, true);

/// The taps of one dimension that land on input position `t + pad` = `tp`:
/// `k ≡ tp (mod stride)`, `k < k_len`, `k ≤ tp` and output `(tp − k)/stride
/// < out`, as (first k, output of that k), or None when no tap lands there;
/// later taps are `stride` further with outputs one less.
#[inline(always)]
fn first_tap(tp: u32, stride: u32, k_len: u32, out: u32) -> Option<(u32, u32)> {
    // The largest output o < out with o·stride ≤ tp gives the smallest tap.
    let o = (tp / stride).min(out.wrapping_sub(1));
    let k = tp.wrapping_sub(o * stride);
    (k < k_len).then_some((k, o))
}

/// Sums the column entries of images `img0..img0+imgs` into dx (NCHW): see
/// the section comment above. With `s.relu`, 0 where `mask` (x) ≤ 0.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_cols_sum(
    s: ConvShape,
    cols: *const f32,
    dx: *mut f32,
    mask: *const f32,
    img0: u32,
    imgs: u32,
) {
    let (hw, ohw) = (s.h * s.w, s.oh * s.ow);
    let total = imgs as usize * s.c_in as usize * hw as usize;
    let base = img0 as usize * s.c_in as usize * hw as usize;
    let (mut i, step) = grid_stride();
    while i < total {
        let (plane, p) = ((i / hw as usize) as u32, (i % hw as usize) as u32);
        let (ih, iw) = (p / s.w, p % s.w);
        let mut acc = 0.0f32;
        if let (Some((kh0, oh0)), Some((kw0, ow0))) = (
            first_tap(ih + s.pad, s.stride, s.kh, s.oh),
            first_tap(iw + s.pad, s.stride, s.kw, s.ow),
        ) {
            let row0 = plane as usize * s.kk() as usize;
            let (mut kh, mut oh) = (kh0, oh0 as i32);
            while kh < s.kh && oh >= 0 {
                let (mut kw, mut ow) = (kw0, ow0 as i32);
                while kw < s.kw && ow >= 0 {
                    let row = row0 + (kh * s.kw + kw) as usize;
                    let at = row * ohw as usize + (oh as u32 * s.ow + ow as u32) as usize;
                    acc += unsafe { *cols.add(at) };
                    kw += s.stride;
                    ow -= 1;
                }
                kh += s.stride;
                oh -= 1;
            }
        }
        let at = base + i;
        if s.relu != 0 && !(unsafe { *mask.add(at) } > 0.0) {
            acc = 0.0;
        }
        unsafe { *dx.add(at) = acc };
        i += step;
    }
}

// ---------------------------------------------------------------------------
// The data gradient by phases, for strided convolutions: input row
// `s·a + r − p` takes only the taps `kh = r + s·j`, from output rows `a − j`,
// so dx split by phase (r, r') is the stride-1 data gradient of
// `ConvGeom::phases` (channels (c, r, r'), ⌈KH/s⌉×⌈KW/s⌉ taps, no padding,
// input Ah×Aw = (OH + Jh − 1)×(OW + Jw − 1)) over dy itself, which the
// stride-1 kernels above run. Around it:
// - `conv_phase_filters`: its filter bank, wp[f, (c·s + r)·s + r', j, l] =
//   w[f, c, r + s·j, r' + s·l], 0 past the window; a thread per element,
//   grid-stride.
// - `conv_phase_scatter`: dx[n, c, ih, iw] = yp[n, (c·s + r)·s + r', a, b]
//   with ih + p = s·a + r, iw + p = s·b + r' (0 where (a, b) is past Ah×Aw),
//   then the ReLU mask; a thread per element of dx (NCHW), grid-stride,
//   dividing by the `FastDiv`s of W, H and s.
// ---------------------------------------------------------------------------

/// The filter bank of the data gradient by phases (see the section comment).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_phase_filters(s: ConvShape, w: *const f32, wp: *mut f32) {
    let st = s.stride;
    let (jh, jw) = (s.kh.div_ceil(st), s.kw.div_ceil(st));
    let per_filter = s.cg() * st * st * jh * jw;
    let total = s.c_out * per_filter;
    let (mut i, step) = grid_stride_u32();
    while i < total {
        let (f, e) = (i / per_filter, i % per_filter);
        let (crr, jl) = (e / (jh * jw), e % (jh * jw));
        let (c, r) = (crr / (st * st), crr % (st * st));
        let (kh, kw) = (r / st + st * (jl / jw), r % st + st * (jl % jw));
        let v = if kh < s.kh && kw < s.kw {
            unsafe { *w.add(((f * s.cg() + c) * s.kk() + kh * s.kw + kw) as usize) }
        } else {
            0.0
        };
        unsafe { *wp.add(i as usize) = v };
        i += step;
    }
}

/// dx from the data gradient by phases `yp` (see the section comment); with
/// `s.relu`, 0 where `mask` (x) ≤ 0. `fw`, `fh`, `fs` divide by W, H and s.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_phase_scatter(
    s: ConvShape,
    yp: *const f32,
    dx: *mut f32,
    mask: *const f32,
    fw: FastDiv,
    fh: FastDiv,
    fs: FastDiv,
) {
    let st = s.stride;
    let (ah, aw) = (s.oh + s.kh.div_ceil(st) - 1, s.ow + s.kw.div_ceil(st) - 1);
    let total = s.n * s.c_in * s.h * s.w;
    let (mut i, step) = grid_stride_u32();
    while i < total {
        let (row, iw) = fw.divmod(i);
        let (plane, ih) = fh.divmod(row);
        let ((a, r), (b, rw)) = (fs.divmod(ih + s.pad), fs.divmod(iw + s.pad));
        let mut v = 0.0;
        if a < ah && b < aw {
            let ch = ((plane * st + r) * st + rw) as usize;
            v = unsafe { *yp.add((ch * ah as usize + a as usize) * aw as usize + b as usize) };
        }
        if s.relu != 0 && !(unsafe { *mask.add(i as usize) } > 0.0) {
            v = 0.0;
        }
        unsafe { *dx.add(i as usize) = v };
        i += step;
    }
}

/// dy viewed as A(f, (n,oh,ow)) for one group.
struct GradRows {
    dy: *const f32,
    s: ConvShape,
    g: u32,
    step: Step,
}

/// A `GradRows` cursor: the shared image (as `img_off` = n·C_out·OH·OW) and
/// position p = oh·OW+ow, and the first element's channel offset.
#[derive(Clone, Copy)]
struct RowCursor {
    img_off: usize,
    p: u32,
    f_off: usize,
}

impl Operand for GradRows {
    const K_FAST: bool = true;
    type Cursor = RowCursor;
    #[inline(always)]
    fn open(&self, k: u32, f0: u32) -> RowCursor {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        RowCursor {
            img_off: (k / ohw) as usize * (s.c_out * ohw) as usize,
            p: k % ohw,
            f_off: (self.g * s.fg() + f0) as usize * ohw as usize,
        }
    }
    #[inline(always)]
    fn src(&self, c: &RowCursor, j: usize) -> Option<*const f32> {
        let slot = j * (SLOT_STRIDE * self.s.oh * self.s.ow) as usize;
        Some(
            self.dy
                .wrapping_add(c.img_off + c.p as usize + c.f_off + slot),
        )
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.dy
    }
    #[inline(always)]
    fn step(&self, c: &mut RowCursor) {
        let ohw = self.s.oh * self.s.ow;
        let mut unused = 0;
        let images = self.step.advance(&mut unused, &mut c.p, 1, ohw);
        c.img_off += images as usize * (self.s.c_out * ohw) as usize;
    }
}

/// x gathered as B((n,oh,ow), (c,kh,kw)) for one group: `Patches` walked
/// along the output positions instead of the filter taps.
struct PatchesT {
    p: Patches,
    step: Step,
}

/// A `PatchesT` cursor: the shared output position (image offset `img_off`
/// = plane (n, g·Cg), oh, ow) and per element j its channel's offset and tap
/// offset `(kh−p, kw−p)`.
#[derive(Clone, Copy)]
struct PositionCursor {
    img_off: usize,
    oh: u32,
    ow: u32,
    chan: [usize; 4],
    dh: [i32; 4],
    dw: [i32; 4],
}

impl Operand for PatchesT {
    const K_FAST: bool = true;
    type Cursor = PositionCursor;
    #[inline(always)]
    fn open(&self, k: u32, n0: u32) -> PositionCursor {
        let s = &self.p.s;
        let ohw = s.oh * s.ow;
        let (img, p) = (k / ohw, k % ohw);
        let mut cur = PositionCursor {
            img_off: self.p.plane(img, 0),
            oh: p / s.ow,
            ow: p % s.ow,
            chan: [0; 4],
            dh: [0; 4],
            dw: [0; 4],
        };
        for j in 0..4 {
            let n = n0 + SLOT_STRIDE * j as u32;
            let (c, r) = (n / s.kk(), n % s.kk());
            cur.chan[j] = c as usize * (s.h * s.w) as usize;
            cur.dh[j] = (r / s.kw) as i32 - s.pad as i32;
            cur.dw[j] = (r % s.kw) as i32 - s.pad as i32;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &PositionCursor, j: usize) -> Option<*const f32> {
        let s = &self.p.s;
        let ih = (c.oh * s.stride) as i32 + c.dh[j];
        let iw = (c.ow * s.stride) as i32 + c.dw[j];
        if self.p.inside(ih, iw) {
            let at = c.img_off + c.chan[j] + ih as usize * s.w as usize + iw as usize;
            Some(self.p.x.wrapping_add(at))
        } else {
            None
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.p.x
    }
    #[inline(always)]
    fn step(&self, c: &mut PositionCursor) {
        let s = &self.p.s;
        let images = self.step.advance(&mut c.oh, &mut c.ow, s.oh, s.ow);
        c.img_off += images as usize * (s.c_in * s.h * s.w) as usize;
    }
}

/// Stores a split-K partial of dw at `ws[slice·len(dw) + idx(dw)]`.
struct StoreFilterGrad {
    ws: *mut f32,
    offset: usize,
    n_len: u32,
}

impl Epilogue for StoreFilterGrad {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let idx = self.offset + m as usize * self.n_len as usize + n as usize;
        unsafe { *self.ws.add(idx) = acc };
    }
}

/// Convolution weight gradient, one split-K slice per z; see the module doc.
/// `ws` holds `splits` copies of dw (with `splits == 1` it may be dw itself).
/// Grid (⌈Cg·KH·KW/64⌉, ⌈Fg/BM⌉, G·splits).
unsafe fn conv_backward_filter_impl<const MODE: u8, const WIDE: bool>(
    s: ConvShape,
    x: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    let (g, slice) = (bid_z() / splits, bid_z() % splits);
    let (k_begin, k_end) = split_range(s.n * s.oh * s.ow, splits, slice);
    let n_len = s.cg() * s.kk();
    let dw_len = s.c_out as usize * n_len as usize;
    let a = GradRows {
        dy,
        s,
        g,
        step: Step::new(1, s.oh * s.ow),
    };
    let b = PatchesT {
        p: Patches::new(x, s, g),
        step: Step::new(s.oh, s.ow),
    };
    let offset = slice as usize * dw_len + (g * s.fg()) as usize * n_len as usize;
    let e = StoreFilterGrad { ws, offset, n_len };
    unsafe { gemm_tile::<_, _, _, MODE, WIDE>(&a, &b, &e, s.fg(), n_len, k_begin, k_end) };
}

gemm_kernels!(conv_backward_filter_impl (s: ConvShape, x: *const f32, dy: *const f32, ws: *mut f32, splits: u32) =>
    conv_backward_filter: FP32, false; conv_backward_filter_tf32: TF32, false; conv_backward_filter_bf16: BF16, false; conv_backward_filter_wide: FP32, true; conv_backward_filter_tf32_wide: TF32, true; conv_backward_filter_bf16_wide: BF16, true);

/// Convolution bias gradient, `db[c] = Σ_{n,h,w} dy[n, c, h, w]`, or with
/// `splits` > 1 one partial sum per slice of the images, at
/// `db[slice·C_out + c]` (summed in a fixed order by `splitk_reduce`).
/// Block (c, slice) walks its channel's planes for images
/// `slice·per..(slice+1)·per` as one flat run of `per·hw` elements (256
/// threads, each stepping 256 along it, four loads in flight; plane and
/// position by a multiply-shift division), then a fixed-order block reduction
/// (deterministic). Grid (C_out, splits), 32 floats of dynamic shared
/// memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_bias(
    dy: *const f32,
    db: *mut f32,
    n: u32,
    c_out: u32,
    hw: FastDiv,
    per: u32,
) {
    let (c, slice) = (bid_x() as usize, bid_y());
    let first = slice * per;
    let len = (first + per).min(n).saturating_sub(first) * hw.d;
    let (plane, image) = (hw.d as usize, c_out as usize * hw.d as usize);
    let base = first as usize * image + c * plane;
    let at = |i: u32| {
        let (img, p) = hw.divmod(i);
        unsafe { *dy.add(base + img as usize * image + p as usize) }
    };
    // Four independent loads and sums per round (memory-level parallelism).
    let (mut i, step) = (tid_x(), bdim_x());
    let mut s = [0.0f32; 4];
    while i + 3 * step < len {
        s[0] += at(i);
        s[1] += at(i + step);
        s[2] += at(i + 2 * step);
        s[3] += at(i + 3 * step);
        i += 4 * step;
    }
    while i < len {
        s[0] += at(i);
        i += step;
    }
    let s = (s[0] + s[1]) + (s[2] + s[3]);
    let total = unsafe { block_sum(s, shared::<f32>()) };
    if tid_x() == 0 {
        unsafe { *db.add(slice as usize * c_out as usize + c) = total };
    }
}

// ---------------------------------------------------------------------------
// Channels-last products on the vector engine (`gemm::gemm_tile_v`). The
// launcher transposes x and dy to NHWC (`layout::transpose`, or
// `transpose_bf16` for bf16 storage) and the filter bank to the k order each
// product reads, so that consecutive k of a gathered patch are consecutive
// channels at one tap: 16-byte copies. Results are written in the usual
// NCHW / OIHW layouts, in fp32. `_nhwc_tf32` / `_nhwc_bf16` read fp32
// operands (tiles 16 deep); `_nhwc16_bf16` reads bf16 operands (32 deep).
// - forward: k = (kh, kw, c), A = w as [F][KH][KW][Cg]; needs Cg a multiple
//   of the vector length (4 fp32, 8 bf16).
// - data:    k = (kh, kw, f), A = w as [G][Cg][KH][KW][Fg]; the same on Fg.
// - filter:  k = (n, oh, ow), N index (kh, kw, c); A = dy (NHWC), B = x
//   (NHWC) both copied along their channels; needs Cg and Fg multiples of
//   the vector length.
// A thread's B operand has 2 (64-wide B tiles) or 4 (128-wide) vectors
// per tile: pixels 32 apart (K-major) or positions along k (filter).
// ---------------------------------------------------------------------------

/// Copy slots per thread of a B tile of the vector engine, at most (the
/// engine uses the first `vbn/32`).
const BSLOTS: usize = 4;

/// Moves the k position (tap `kh, kw` of a `_ × kw_len` filter, channel `c`
/// of `cg`) one tile of `bk` along k: one tap step per wrap of the channel
/// (several when `cg` < `bk`).
#[inline(always)]
fn next_tap(kh: &mut u32, kw: &mut u32, c: &mut u32, kw_len: u32, cg: u32, bk: u32) {
    *c += bk;
    while *c >= cg {
        *c -= cg;
        *kw += 1;
        if *kw == kw_len {
            *kw = 0;
            *kh += 1;
        }
    }
}

/// x (NHWC, fp32 or bf16 when `H`) gathered as B((kh,kw,c), (n,oh,ow)) for
/// one group, K-major.
struct NhwcPatches<const H: bool> {
    x: *const f32,
    s: ConvShape,
    g: u32,
}

/// An `NhwcPatches` cursor: the tap (kh, kw) and channel c shared by the
/// thread's slots (as `tap` = (kh·W + kw)·C + c), and per slot (pixel) the
/// window origin `(ih0, iw0)` and the offset of that pixel's group channels
/// (wrapping: it may lie outside x).
#[derive(Clone, Copy)]
struct NhwcPatchCursor {
    pix: [usize; BSLOTS],
    ih0: [i32; BSLOTS],
    iw0: [i32; BSLOTS],
    kh: u32,
    kw: u32,
    c: u32,
    tap: usize,
}

impl<const H: bool> NhwcPatches<H> {
    #[inline(always)]
    fn tap(&self, kh: u32, kw: u32, c: u32) -> usize {
        (kh * self.s.w + kw) as usize * self.s.c_in as usize + c as usize
    }
}

impl<const H: bool> VecOperand for NhwcPatches<H> {
    const L1: bool = true;
    const K_MAJOR: bool = true;
    const HALF: bool = H;
    type Cursor = NhwcPatchCursor;
    #[inline(always)]
    fn open(&self, k: u32, n: u32, _: u32, di: u32) -> NhwcPatchCursor {
        let s = &self.s;
        let (r, c) = (k / s.cg(), k % s.cg());
        let (kh, kw) = (r / s.kw, r % s.kw);
        let mut cur = NhwcPatchCursor {
            pix: [0; BSLOTS],
            ih0: [0; BSLOTS],
            iw0: [0; BSLOTS],
            kh,
            kw,
            c,
            tap: self.tap(kh, kw, c),
        };
        for j in 0..BSLOTS {
            let n = n + di * j as u32;
            let (img, p) = (n / (s.oh * s.ow), n % (s.oh * s.ow));
            let ih0 = ((p / s.ow) * s.stride) as i32 - s.pad as i32;
            let iw0 = ((p % s.ow) * s.stride) as i32 - s.pad as i32;
            let within =
                (img as isize * s.h as isize + ih0 as isize) * s.w as isize + iw0 as isize;
            cur.pix[j] =
                ((within * s.c_in as isize) as usize).wrapping_add((self.g * s.cg()) as usize);
            cur.ih0[j] = ih0;
            cur.iw0[j] = iw0;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &NhwcPatchCursor, j: usize) -> Option<*const f32> {
        let (ih, iw) = (c.ih0[j] + c.kh as i32, c.iw0[j] + c.kw as i32);
        if (ih as u32) < self.s.h && (iw as u32) < self.s.w {
            Some(elem_at(self.x, c.pix[j].wrapping_add(c.tap), H))
        } else {
            None
        }
    }
    #[inline(always)]
    fn step(&self, c: &mut NhwcPatchCursor) {
        let s = &self.s;
        next_tap(&mut c.kh, &mut c.kw, &mut c.c, s.kw, s.cg(), vbk(H));
        c.tap = self.tap(c.kh, c.kw, c.c);
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.x
    }
}

/// The K-major filter rows of a channels-last product, `k_len` long,
/// starting at row `first` (the group's first filter or channel); through
/// L1 when `CA`.
#[inline(always)]
fn group_rows<const H: bool, const CA: bool>(
    wt: *const f32,
    first: u32,
    k_len: u32,
) -> VStrided<true, H, CA> {
    VStrided {
        p: elem_at(wt, (first * k_len) as usize, H),
        ks: 1,
        is: k_len as usize,
    }
}

/// Convolution forward from NHWC x and `[F][KH][KW][Cg]` weights `wt` (fp32,
/// or bf16 when `H`); writes y (NCHW) like `conv_forward`. Grid
/// (⌈N·OH·OW/64⌉, ⌈Fg/BM⌉, G), `gemm::vshared_bytes(wide)` of dynamic
/// shared memory. The filter bank is copied through L1: blocks of
/// one column of the grid re-read it (4–11% faster TF32 forwards).
/// `TR`: the transposed product, pixels × filters, in 128-pixel tiles of
/// 64 filters (`gemm::VWIDE`, for groups of 192 filters, which 128-row
/// tiles pad; bf16 only: in TF32 it measured slower than 64×64 tiles);
/// grid (⌈Fg/64⌉, ⌈N·OH·OW/128⌉, G).
#[inline(always)]
unsafe fn conv_forward_nhwc_any<const MODE: u8, const T: u8, const H: bool, const TR: bool>(
    s: ConvShape,
    x: *const f32,
    wt: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    let g = bid_z();
    let k_len = s.cg() * s.kk();
    let w = group_rows::<H, true>(wt, g * s.fg(), k_len);
    let p = NhwcPatches::<H> { x, s, g };
    let e = StoreOutput::<false>::new(y, bias, s, g);
    let n = s.n * s.oh * s.ow;
    if TR {
        unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&p, &w, &Transposed(e), n, s.fg(), 0, k_len) };
    } else {
        unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&w, &p, &e, s.fg(), n, 0, k_len) };
    }
}

unsafe fn conv_forward_nhwc_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    wt: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_nhwc_any::<MODE, T, false, false>(s, x, wt, bias, y) }
}

unsafe fn conv_forward_nhwc16_t_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    wt: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_nhwc_any::<MODE, T, true, true>(s, x, wt, bias, y) }
}

unsafe fn conv_forward_nhwc_t_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    wt: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_nhwc_any::<MODE, T, false, true>(s, x, wt, bias, y) }
}

gemm_kernels!(conv_forward_nhwc_t_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc_t_tf32_wide: TF32_ROUNDED, 1);
gemm_kernels!(conv_forward_nhwc16_t_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc16_t_bf16_wide: BF16, 1);

unsafe fn conv_forward_nhwc16_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    wt: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_nhwc_any::<MODE, T, true, false>(s, x, wt, bias, y) }
}

gemm_kernels!(conv_forward_nhwc_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc_tf32: TF32_ROUNDED, 0; conv_forward_nhwc_bf16: BF16, 0; conv_forward_nhwc_tf32_wide: TF32_ROUNDED, 1; conv_forward_nhwc_tf32_big: TF32_ROUNDED, 2; conv_forward_nhwc_bf16_wide: BF16, 1);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_forward_nhwc_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc_tf32_wg: WGMMA, 0; conv_forward_nhwc_tf32_wg_wide: WGMMA, 1; conv_forward_nhwc_tf32_wg_big: WGMMA, 2; conv_forward_nhwc_tf32_wg_long: WGMMA, 3);
gemm_kernels!(conv_forward_nhwc16_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc16_bf16: BF16, 0; conv_forward_nhwc16_bf16_big: BF16, 2; conv_forward_nhwc16_bf16_long: BF16, 3);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_forward_nhwc16_impl (s: ConvShape, x: *const f32, wt: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_nhwc16_bf16_wg: WGMMA, 0; conv_forward_nhwc16_bf16_wg_wide: WGMMA, 1; conv_forward_nhwc16_bf16_wg_big: WGMMA, 2; conv_forward_nhwc16_bf16_wg_long: WGMMA, 3);

/// The operands of a channels-last conv product for the tensor memory
/// accelerator. Forward: A, group g's filter rows, a 3-D tiled map of the
/// `[F][KK][Cg]` weights at `maps`; B, the filter windows of x, an im2col
/// map of the NHWC x at `maps + 128` whose boxes are 128 windows × one
/// tap's `bk` channels (32 TF32 or 64 bf16 values, 128 bytes). Each tap
/// takes ⌈Cg/bk⌉ K tiles, channels `0, bk, …` of the group: where `bk`
/// divides Cg the order of k the other channels-last kernels use; else
/// the last tile runs past the group, where A's map reads zeros (past its
/// Cg) and B the next group's channels or zeros (past C), so those terms
/// add nothing (x must be finite). Data gradient (stride 1): A, group g's
/// rows of the `[G·Cg][KK][Fg]` weights; B, dy's windows around each input
/// pixel (corner `(ih, iw) − (K − 1 − pad)`), tap (kh, kw) at offset `(K −
/// 1 − kh, K − 1 − kw)`, i.e. dy at `(ih + pad − kh, iw + pad − kw)`, Fg
/// in place of Cg.
#[cfg(feature = "wgmma")]
struct ConvTma {
    maps: *const u8,
    s: ConvShape,
    /// The tile's first row of A (of all groups'), its first window's
    /// image and corner, and the group's first channel of B's tensor.
    row: u32,
    img: u32,
    ih: i32,
    iw: i32,
    chan: u32,
    /// Channels of B's tensor per group (Cg, or Fg for the data gradient).
    chans: u32,
    bk: u32,
    /// The data gradient's mirrored taps.
    flip: bool,
    /// Roles swapped (`data_t`): the windows are A (the tile's 128 rows)
    /// and the weight rows B.
    swap: bool,
}

#[cfg(feature = "wgmma")]
impl ConvTma {
    /// Tile (x, y) (128 output pixels × 128 filters) of group g.
    #[inline(always)]
    fn forward(maps: *const u8, s: ConvShape, half: bool, [x, y, g]: [u32; 3]) -> Self {
        let p = x * 128;
        let (img, q) = (p / (s.oh * s.ow), p % (s.oh * s.ow));
        ConvTma {
            maps,
            s,
            row: g * s.fg() + y * 128,
            img,
            ih: ((q / s.ow) * s.stride) as i32 - s.pad as i32,
            iw: ((q % s.ow) * s.stride) as i32 - s.pad as i32,
            chan: g * s.cg(),
            chans: s.cg(),
            bk: vbk(half) * 2,
            flip: false,
            swap: false,
        }
    }

    /// Tile (x, y) (128 input pixels × 128 channels) of group g.
    #[inline(always)]
    fn data(maps: *const u8, s: ConvShape, half: bool, [x, y, g]: [u32; 3]) -> Self {
        let p = x * 128;
        let (img, q) = (p / (s.h * s.w), p % (s.h * s.w));
        ConvTma {
            maps,
            s,
            row: g * s.cg() + y * 128,
            img,
            ih: (q / s.w) as i32 - (s.kh - 1 - s.pad) as i32,
            iw: (q % s.w) as i32 - (s.kw - 1 - s.pad) as i32,
            chan: g * s.fg(),
            chans: s.fg(),
            bk: vbk(half) * 2,
            flip: true,
            swap: false,
        }
    }

    /// [`ConvTma::data`] with the roles swapped: tile (x, y) (64 channels ×
    /// 128 input pixels) of group g, the windows of dy as A and the weight
    /// rows (a 64-row box, `TmaProduct::DataSwapped`'s map) as B.
    #[inline(always)]
    fn data_t(maps: *const u8, s: ConvShape, half: bool, [x, y, g]: [u32; 3]) -> Self {
        ConvTma {
            row: g * s.cg() + x * 64,
            swap: true,
            ..ConvTma::data(maps, s, half, [y, 0, g])
        }
    }
}

/// Readies a TMA conv kernel's two tensor maps (at `maps` and `maps + 128`).
#[cfg(feature = "wgmma")]
#[inline(always)]
unsafe fn acquire_maps(maps: *const u8) {
    use crate::device::tma_map_acquire;
    unsafe {
        tma_map_acquire(maps);
        tma_map_acquire(maps.add(128));
    }
}

/// Where [`ConvTma`]'s next K tile starts: tap (kh, kw), its index
/// `kh·KW + kw`, and channel c of the group.
#[cfg(feature = "wgmma")]
struct TmaCursor {
    kh: u32,
    kw: u32,
    tap: u32,
    c: u32,
}

#[cfg(feature = "wgmma")]
impl crate::gemm::TmaTiles for ConvTma {
    type Cursor = TmaCursor;
    #[inline(always)]
    unsafe fn acquire(&self) {
        unsafe { acquire_maps(self.maps) }
    }
    #[inline(always)]
    fn start(&self) -> TmaCursor {
        TmaCursor { kh: 0, kw: 0, tap: 0, c: 0 }
    }
    #[inline(always)]
    fn tiles(&self) -> u32 {
        self.chans.div_ceil(self.bk) * self.s.kk()
    }
    #[inline(always)]
    unsafe fn load(&self, t: &mut TmaCursor, a: u32, b: u32, bar: u32) {
        use crate::device::{tma_im2col_4d, tma_tile_3d};
        let s = &self.s;
        let (dh, dw) = if self.flip {
            (s.kh - 1 - t.kh, s.kw - 1 - t.kw)
        } else {
            (t.kh, t.kw)
        };
        let (w, x) = if self.swap { (b, a) } else { (a, b) };
        unsafe {
            tma_tile_3d(w, self.maps, t.c as i32, t.tap as i32, self.row as i32, bar);
            let c = (self.chan + t.c) as i32;
            let map = self.maps.add(128);
            tma_im2col_4d(x, map, c, self.iw, self.ih, self.img as i32, dw as u16, dh as u16, bar);
        }
        t.c += self.bk;
        if t.c >= self.chans {
            t.c = 0;
            t.tap += 1;
            t.kw += 1;
            if t.kw == s.kw {
                t.kw = 0;
                t.kh += 1;
            }
        }
    }
}

/// The operands of the bf16 weight gradient for the tensor memory
/// accelerator, both MN-major with k = output pixels down the rows: A, dy
/// (NHWC, a 2-D tiled map of `[N·OH·OW][F]` at `maps`, boxes of 64
/// filters × 64 pixels, two per tile: filters `row..row + 128`); B, x's
/// filter windows (the forwards' im2col map of the NHWC x at `maps + 128`,
/// but boxes of 64 windows × one tap's 64 channels), two per tile: GEMM
/// columns `col..col + 64` and `col + 64..col + 128` of the group's
/// `(kh·KW + kw)·Cgp + c`, Cgp being Cg rounded up to 64, so each box lies
/// within one tap; where Cg is not a multiple of 64, a tap's columns past
/// Cg read the next group's channels or zeros and are not summed. Columns
/// past the group's `KH·KW·Cgp` (half tiles) load tap 0 again and are not
/// stored. K tiles `k_begin..k_end` of 64 pixels (this split
/// slice's); pixels past the batch read as zeros.
#[cfg(feature = "wgmma")]
struct ConvTmaFilter {
    maps: *const u8,
    s: ConvShape,
    span: FilterSpan,
    /// A K tile's 64 pixels as output rows and columns: `(64 / OW, 64 % OW)`.
    step: (u32, u32),
    /// A tap's columns, Cg rounded up to 64.
    cgp: u32,
}

/// A TMA weight gradient's tile: its first filter row (of all groups'),
/// its first GEMM column `(kh·KW + kw)·Cg + c` of the group as the tap and
/// channel `(kh, kw, c)`, the group's first channel, and its split slice's
/// K tiles `k_begin..k_end`.
#[cfg(feature = "wgmma")]
#[derive(Clone, Copy)]
struct FilterSpan {
    row: u32,
    col: (u32, u32, u32),
    chan: u32,
    k_begin: u32,
    k_end: u32,
}

/// The column box `bx` columns after the one starting at tap (kh, kw),
/// channel c, a tap having `cgp` columns (`bx` divides `cgp`): on to the
/// next tap at its last column, back to tap (0, 0) past the last tap (a
/// half tile's columns past `KH·KW·cgp`, loaded but not stored). What
/// `col / cgp` and `% cgp` would give, without dividing in the producer's
/// loop.
#[cfg(feature = "wgmma")]
#[inline(always)]
fn next_box(s: &ConvShape, (kh, kw, c): (u32, u32, u32), bx: u32, cgp: u32) -> (u32, u32, u32) {
    if c + bx < cgp {
        (kh, kw, c + bx)
    } else if kw + 1 < s.kw {
        (kh, kw + 1, 0)
    } else if kh + 1 < s.kh {
        (kh + 1, 0, 0)
    } else {
        (0, 0, 0)
    }
}

/// Where [`ConvTmaFilter`]'s next K tile starts: pixel p of the batch's
/// `N·OH·OW`, as image and output row and column (stepped, not divided).
#[cfg(feature = "wgmma")]
struct PixelCursor {
    p: u32,
    img: u32,
    oy: u32,
    ox: u32,
}

/// Tile `[x, y, group·splits + slice]` of a TMA weight gradient over
/// `k_tiles` K tiles cut into `splits` slices, a tap having `cgp` columns:
/// its [`FilterSpan`] and the epilogue storing that slice's partial of dw
/// into `ws` in GEMM order.
#[cfg(feature = "wgmma")]
#[inline(always)]
fn filter_span(
    s: ConvShape,
    ws: *mut f32,
    splits: u32,
    k_tiles: u32,
    cgp: u32,
    [x, y, p]: [u32; 3],
) -> (FilterSpan, StoreFilterGradGemm) {
    let (g, slice) = (p / splits, p % splits);
    let chunk = k_tiles.div_ceil(splits);
    let k_begin = (slice * chunk).min(k_tiles);
    let (tap, c) = (x * 128 / cgp, x * 128 % cgp);
    let span = FilterSpan {
        row: g * s.fg() + y * 128,
        col: (tap / s.kw, tap % s.kw, c),
        chan: g * s.cg(),
        k_begin,
        k_end: (k_begin + chunk).min(k_tiles),
    };
    let n_len = cgp * s.kk();
    let dw_len = s.c_out as usize * n_len as usize;
    let offset = slice as usize * dw_len + (g * s.fg()) as usize * n_len as usize;
    (span, StoreFilterGradGemm { ws, offset, len: n_len })
}

#[cfg(feature = "wgmma")]
impl crate::gemm::TmaTiles for ConvTmaFilter {
    type Cursor = PixelCursor;
    #[inline(always)]
    unsafe fn acquire(&self) {
        unsafe { acquire_maps(self.maps) }
    }
    #[inline(always)]
    fn start(&self) -> PixelCursor {
        let (p, ohw) = (self.span.k_begin * 64, self.s.oh * self.s.ow);
        let q = p % ohw;
        PixelCursor {
            p,
            img: p / ohw,
            oy: q / self.s.ow,
            ox: q % self.s.ow,
        }
    }
    #[inline(always)]
    fn tiles(&self) -> u32 {
        self.span.k_end - self.span.k_begin
    }
    #[inline(always)]
    unsafe fn load(&self, t: &mut PixelCursor, a: u32, b: u32, bar: u32) {
        use crate::device::{tma_im2col_4d, tma_tile_2d};
        let s = &self.s;
        let ih = (t.oy * s.stride) as i32 - s.pad as i32;
        let iw = (t.ox * s.stride) as i32 - s.pad as i32;
        unsafe {
            let (row, chan) = (self.span.row, self.span.chan);
            tma_tile_2d(a, self.maps, row as i32, t.p as i32, bar);
            tma_tile_2d(a + 8192, self.maps, (row + 64) as i32, t.p as i32, bar);
            let mut col = self.span.col;
            for j in 0..2u32 {
                let (kh, kw, c) = col;
                let x = self.maps.add(128);
                let at = b + 8192 * j;
                tma_im2col_4d(at, x, (chan + c) as i32, iw, ih, t.img as i32, kw as u16, kh as u16, bar);
                col = next_box(s, col, 64, self.cgp);
            }
        }
        t.p += 64;
        t.oy += self.step.0;
        t.ox += self.step.1;
        if t.ox >= s.ow {
            t.ox -= s.ow;
            t.oy += 1;
        }
        while t.oy >= s.oh {
            t.oy -= s.oh;
            t.img += 1;
        }
    }
}

/// Convolution weight gradient in bf16 on the warpgroup engine, both
/// operands fetched by the tensor memory accelerator ([`ConvTmaFilter`];
/// `maps`: dy's and x's tensor maps), products MN-major
/// (`gemm::gemm_tile_tma` with `MN`): tiles of 128 filters × 128 columns
/// `(kh·KW + kw)·Cgp + c` per group and split slice (Cgp: Cg rounded up
/// to 64; ⌈KH·KW·Cgp/128⌉ × ⌈Fg/128⌉ × G·splits of them, over a 1-D grid),
/// each summing its slice of the ⌈N·OH·OW/64⌉ pixel tiles; partials
/// stored in that GEMM order ([`StoreFilterGradGemm`], one slice too), for
/// [`conv_backward_filter_sum`] to sum into dw. `gemm::TMA_THREADS`
/// threads, `gemm::tma_shared_bytes(stages)` bytes. Needs Fg a multiple
/// of 64 and Cg of 8.
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_filter_nhwc16_bf16_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    ws: *mut f32,
    splits: u32,
) {
    let k_tiles = (s.n * s.oh * s.ow).div_ceil(64);
    let cgp = s.cg().next_multiple_of(64);
    let tile = |t: [u32; 3]| {
        let (span, e) = filter_span(s, ws, splits, k_tiles, cgp, t);
        let step = (64 / s.ow, 64 % s.ow);
        (ConvTmaFilter { maps, s, span, step, cgp }, e)
    };
    let dims = [cgp * s.kk(), s.fg(), s.groups * splits];
    unsafe { crate::gemm::gemm_tile_tma::<_, _, _, true, true, 128>(tile, dims, ring) };
}

/// The operands of the TF32 weight gradient for the tensor memory
/// accelerator, both K-major over the padded pixel grid (`layout::
/// pixel_grid_tf32`: each channel's pixels as one row, image b's pixel
/// (y, x) at `(b·Hp + y)·Wp + x`, zeros between the images' rows): A, dy's
/// grid `[F][len]` at `maps` (boxes of 32 pixels × 128 filters: filters
/// `row..row + 128`); B, x's grid in KW copies `[KW][C][len]`, copy kw
/// shifted by `kw − (pad·Wp + pad)`, at `maps + 128` (boxes of 32 pixels ×
/// `bx` channels, `128 / bx` per tile): GEMM column `(kh·KW + kw)·Cg + c`
/// reads channel c of copy kw at pixel `p + kh·Wp`, the tap's input pixel
/// or a zero of the padding (or past the end, which the copy engine fills
/// with zeros). Every box starts on a 16-byte boundary (p a multiple of 32,
/// Wp of 4), which the copy engine requires. Columns past the group's
/// `KH·KW·Cg` load tap 0 again and are not stored. K tiles `k_begin..k_end`
/// of 32 pixels (this split slice's).
#[cfg(feature = "wgmma")]
struct ConvTmaGrid {
    maps: *const u8,
    s: ConvShape,
    span: FilterSpan,
    wp: u32,
    bx: u32,
    /// B boxes per K tile, `128 / bx`.
    boxes: u32,
}

#[cfg(feature = "wgmma")]
impl crate::gemm::TmaTiles for ConvTmaGrid {
    /// The next K tile's first pixel.
    type Cursor = u32;
    #[inline(always)]
    unsafe fn acquire(&self) {
        unsafe { acquire_maps(self.maps) }
    }
    #[inline(always)]
    fn start(&self) -> u32 {
        self.span.k_begin * 32
    }
    #[inline(always)]
    fn tiles(&self) -> u32 {
        self.span.k_end - self.span.k_begin
    }
    #[inline(always)]
    unsafe fn load(&self, p: &mut u32, a: u32, b: u32, bar: u32) {
        use crate::device::tma_tile_2d;
        let s = &self.s;
        unsafe {
            let FilterSpan { row, mut col, chan, .. } = self.span;
            tma_tile_2d(a, self.maps, *p as i32, row as i32, bar);
            let x = self.maps.add(128);
            for j in 0..self.boxes {
                let (kh, kw, c) = col;
                let at = (*p + kh * self.wp) as i32;
                tma_tile_2d(b + 128 * self.bx * j, x, at, (kw * s.c_in + chan + c) as i32, bar);
                col = next_box(s, col, self.bx, s.cg());
            }
        }
        *p += 32;
    }
}

/// Convolution weight gradient in TF32 (stride 1) on the warpgroup engine
/// over the padded pixel grid ([`ConvTmaGrid`]; `maps`: dy's and x's grid
/// maps, `wp` the grid's row length, `len` its pixels per channel, `bx`
/// channels per B box, dividing Cg and 128): tiles of 128 filters × 128
/// columns `(kh·KW + kw)·Cg + c` per group and split slice, as
/// [`conv_backward_filter_nhwc16_bf16_wg_tma_big`]'s, each summing its
/// slice of the ⌈len/32⌉ K tiles; the same partials and launch.
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_filter_grid_tf32_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    ws: *mut f32,
    splits: u32,
    wp: u32,
    len: u32,
    bx: u32,
) {
    let (k_tiles, boxes) = (len.div_ceil(32), 128 / bx);
    let tile = |t: [u32; 3]| {
        let (span, e) = filter_span(s, ws, splits, k_tiles, s.cg(), t);
        (ConvTmaGrid { maps, s, span, wp, bx, boxes }, e)
    };
    let dims = [s.cg() * s.kk(), s.fg(), s.groups * splits];
    unsafe { crate::gemm::gemm_tile_tma::<_, _, _, false, false, 128>(tile, dims, ring) };
}

/// Convolution forward as [`conv_forward_nhwc_any`]'s 128×128 warpgroup
/// kernels (not transposed), with both operands fetched by the tensor
/// memory accelerator ([`ConvTma`]; `maps`: its two 128-byte tensor maps,
/// made by the host for these x and wt) into a ring of stages (`ring`: see
/// `gemm::gemm_tile_tma`). Tiles
/// (⌈N·OH·OW/128⌉ × ⌈Fg/128⌉ × G of them) over a 1-D grid of any size,
/// `gemm::TMA_THREADS` threads, `gemm::tma_shared_bytes(stages)` bytes.
#[cfg(feature = "wgmma")]
unsafe fn conv_forward_tma<const HALF: bool>(s: ConvShape, maps: *const u8, ring: u32, bias: *const f32, y: *mut f32) {
    let tile = |t: [u32; 3]| {
        let l = ConvTma::forward(maps, s, HALF, t);
        let e = StoreOutput::<true>::new(y, bias, s, t[2]);
        (l, e)
    };
    let dims = [s.n * s.oh * s.ow, s.fg(), s.groups];
    unsafe { crate::gemm::gemm_tile_tma::<_, _, _, HALF, false, 128>(tile, dims, ring) };
}

/// Convolution data gradient (stride 1) as
/// [`conv_backward_data_nhwc_any`]'s 128×128 warpgroup kernels, with both
/// operands (the `[G][Cg][KH][KW][Fg]` weights, NHWC dy) fetched by the
/// tensor memory accelerator ([`ConvTma::data`]). Tiles (⌈N·H·W/128⌉ ×
/// ⌈Cg/128⌉ × G tiles over a 1-D grid of any size), `gemm::TMA_THREADS`
/// threads, `gemm::tma_shared_bytes(stages)` bytes.
#[cfg(feature = "wgmma")]
unsafe fn conv_backward_data_tma<const HALF: bool>(s: ConvShape, maps: *const u8, ring: u32, dx: *mut f32, mask: *const f32) {
    let tile = |t: [u32; 3]| {
        let l = ConvTma::data(maps, s, HALF, t);
        let e = StoreInputGrad::<true>::new(dx, mask, s, t[2]);
        (l, e)
    };
    let dims = [s.n * s.h * s.w, s.cg(), s.groups];
    unsafe { crate::gemm::gemm_tile_tma::<_, _, _, HALF, false, 128>(tile, dims, ring) };
}

/// [`conv_backward_data_tma`] with the roles swapped ([`ConvTma::data_t`]):
/// 128 input pixels × 64 channels a tile (⌈N·H·W/128⌉ × ⌈Cg/64⌉ × G
/// tiles), for groups of at most 64 channels, which 128-channel tiles
/// would mostly pad (conv2's 48, and conv1's 48 phases).
#[cfg(feature = "wgmma")]
unsafe fn conv_backward_data_tma_t<const HALF: bool>(s: ConvShape, maps: *const u8, ring: u32, dx: *mut f32, mask: *const f32) {
    let tile = |t: [u32; 3]| {
        let l = ConvTma::data_t(maps, s, HALF, t);
        let e = Transposed(StoreInputGrad::<true>::new(dx, mask, s, t[2]));
        (l, e)
    };
    let dims = [s.cg(), s.n * s.h * s.w, s.groups];
    unsafe { crate::gemm::gemm_tile_tma::<_, _, _, HALF, false, 64>(tile, dims, ring) };
}

/// [`conv_backward_data_tma_t`] in TF32 (dy and wt TF32-rounded fp32).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_data_nhwc_tf32_wg_tma_t(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_tma_t::<false>(s, maps, ring, dx, mask) }
}

/// [`conv_backward_data_tma_t`] in bf16 (dy and wt bf16).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_data_nhwc16_bf16_wg_tma_t(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_tma_t::<true>(s, maps, ring, dx, mask) }
}

/// [`conv_backward_data_tma`] in TF32 (dy and wt TF32-rounded fp32).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_data_nhwc_tf32_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_tma::<false>(s, maps, ring, dx, mask) }
}

/// [`conv_backward_data_tma`] in bf16 (dy and wt bf16).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_data_nhwc16_bf16_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_tma::<true>(s, maps, ring, dx, mask) }
}

/// [`conv_forward_tma`] in TF32 (x and wt TF32-rounded fp32, NHWC and
/// `[F][KH][KW][Cg]`).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_forward_nhwc_tf32_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_tma::<false>(s, maps, ring, bias, y) }
}

/// [`conv_forward_tma`] in bf16 (x and wt bf16).
#[cfg(feature = "wgmma")]
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_forward_nhwc16_bf16_wg_tma_big(
    s: ConvShape,
    maps: *const u8,
    ring: u32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_tma::<true>(s, maps, ring, bias, y) }
}

/// dy (NHWC, fp32 or bf16 when `H`) gathered as B((kh,kw,f), (n,ih,iw)) for
/// one group, K-major. `S1`: the convolution's stride is 1.
struct NhwcGradPatches<const H: bool, const S1: bool> {
    dy: *const f32,
    s: ConvShape,
    g: u32,
}

/// An `NhwcGradPatches` cursor: the tap (kh, kw) and filter f shared by
/// the thread's slots, and per slot (pixel) `(ih+p, iw+p)` and the offset
/// in dy of output pixel `(ih+p, iw+p)` of the image's group channels
/// (wrapping: it may lie outside dy). At stride 1 (`S1`) the element is
/// that offset plus `tap` = f − (kh·OW + kw)·C_out, one add and two
/// compares as in the forward's gather; other strides take
/// `ConvShape::out_pos`, whose divisions were 8 of the ~300 instructions
/// of the K loop when one kernel served both.
#[derive(Clone, Copy)]
struct NhwcGradCursor {
    pix: [usize; BSLOTS],
    th0: [i32; BSLOTS],
    tw0: [i32; BSLOTS],
    kh: u32,
    kw: u32,
    f: u32,
    tap: usize,
}

impl<const H: bool, const S1: bool> NhwcGradPatches<H, S1> {
    #[inline(always)]
    fn tap(&self, kh: u32, kw: u32, f: u32) -> usize {
        (f as usize).wrapping_sub((kh * self.s.ow + kw) as usize * self.s.c_out as usize)
    }
}

impl<const H: bool, const S1: bool> VecOperand for NhwcGradPatches<H, S1> {
    const L1: bool = true;
    const K_MAJOR: bool = true;
    const HALF: bool = H;
    type Cursor = NhwcGradCursor;
    #[inline(always)]
    fn open(&self, k: u32, n: u32, _: u32, di: u32) -> NhwcGradCursor {
        let s = &self.s;
        let (r, f) = (k / s.fg(), k % s.fg());
        let (kh, kw) = (r / s.kw, r % s.kw);
        let mut cur = NhwcGradCursor {
            pix: [0; BSLOTS],
            th0: [0; BSLOTS],
            tw0: [0; BSLOTS],
            kh,
            kw,
            f,
            tap: self.tap(kh, kw, f),
        };
        for j in 0..BSLOTS {
            let n = n + di * j as u32;
            let (img, p) = (n / (s.h * s.w), n % (s.h * s.w));
            let (th0, tw0) = (p / s.w + s.pad, p % s.w + s.pad);
            let within = ((img * s.oh + th0) * s.ow + tw0) as usize;
            cur.pix[j] = within * s.c_out as usize + (self.g * s.fg()) as usize;
            cur.th0[j] = th0 as i32;
            cur.tw0[j] = tw0 as i32;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &NhwcGradCursor, j: usize) -> Option<*const f32> {
        let s = &self.s;
        let (th, tw) = (c.th0[j] - c.kh as i32, c.tw0[j] - c.kw as i32);
        if S1 {
            return ((th as u32) < s.oh && (tw as u32) < s.ow)
                .then(|| elem_at(self.dy, c.pix[j].wrapping_add(c.tap), H));
        }
        let (oh, ow) = s.out_pos(th, tw)?;
        let origin = (c.th0[j] as usize * s.ow as usize + c.tw0[j] as usize) * s.c_out as usize;
        let at = (oh * s.ow + ow) as usize * s.c_out as usize + c.f as usize;
        Some(elem_at(self.dy, (c.pix[j] - origin) + at, H))
    }
    #[inline(always)]
    fn step(&self, c: &mut NhwcGradCursor) {
        let s = &self.s;
        next_tap(&mut c.kh, &mut c.kw, &mut c.f, s.kw, s.fg(), vbk(H));
        c.tap = self.tap(c.kh, c.kw, c.f);
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.dy
    }
}

/// Convolution data gradient from NHWC dy and `[G][Cg][KH][KW][Fg]` weights
/// `wt` (fp32, or bf16 when `H`); writes dx (NCHW) like
/// `conv_backward_data`. Grid (⌈N·H·W/64⌉, ⌈Cg/BM⌉, G),
/// `gemm::vshared_bytes(wide)` of dynamic shared memory. `TR`: the
/// transposed product, pixels × channels, in 128-pixel tiles of 48
/// (`gemm::VSLIM`: groups of 48 channels, which 64-row tiles pad by a
/// quarter) or, bf16 only, 64 channels (`VWIDE`: groups of 192, which
/// 128-row tiles pad); grid (⌈Cg/48 or 64⌉, ⌈N·H·W/128⌉, G). The filter
/// rows are copied through L1 as in the forward (H100, batch 128: conv3's
/// TF32 data gradient 0.505 → 0.386 ms on the heuristic's tiles; the
/// autotuned conv2–5 sum 1.2–1.6% less at batch 256).
#[inline(always)]
unsafe fn conv_backward_data_nhwc_any<const MODE: u8, const T: u8, const H: bool, const TR: bool>(
    s: ConvShape,
    dy: *const f32,
    wt: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    let g = bid_z();
    let k_len = s.fg() * s.kk();
    let w = group_rows::<H, true>(wt, g * s.cg(), k_len);
    let e = StoreInputGrad::<false>::new(dx, mask, s, g);
    let n = s.n * s.h * s.w;
    // One engine per stride case, so the stride-1 gather carries no test.
    macro_rules! product {
        ($s1:literal) => {{
            let p = NhwcGradPatches::<H, $s1> { dy, s, g };
            if TR {
                unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&p, &w, &Transposed(e), n, s.cg(), 0, k_len) };
            } else {
                unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&w, &p, &e, s.cg(), n, 0, k_len) };
            }
        }};
    }
    if s.stride == 1 {
        product!(true)
    } else {
        product!(false)
    }
}

unsafe fn conv_backward_data_nhwc_t_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    dy: *const f32,
    wt: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_nhwc_any::<MODE, T, false, true>(s, dy, wt, dx, mask) }
}

unsafe fn conv_backward_data_nhwc16_t_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    dy: *const f32,
    wt: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_nhwc_any::<MODE, T, true, true>(s, dy, wt, dx, mask) }
}

gemm_kernels!(conv_backward_data_nhwc_t_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc_t_tf32_slim: TF32_ROUNDED, 4; conv_backward_data_nhwc_t_tf32_wide: TF32_ROUNDED, 1);
gemm_kernels!(conv_backward_data_nhwc16_t_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc16_t_bf16_slim: BF16, 4; conv_backward_data_nhwc16_t_bf16_wide: BF16, 1);

unsafe fn conv_backward_data_nhwc_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    dy: *const f32,
    wt: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_nhwc_any::<MODE, T, false, false>(s, dy, wt, dx, mask) }
}

unsafe fn conv_backward_data_nhwc16_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    dy: *const f32,
    wt: *const f32,
    dx: *mut f32,
    mask: *const f32,
) {
    unsafe { conv_backward_data_nhwc_any::<MODE, T, true, false>(s, dy, wt, dx, mask) }
}

gemm_kernels!(conv_backward_data_nhwc_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc_tf32: TF32_ROUNDED, 0; conv_backward_data_nhwc_bf16: BF16, 0; conv_backward_data_nhwc_tf32_wide: TF32_ROUNDED, 1; conv_backward_data_nhwc_tf32_big: TF32_ROUNDED, 2; conv_backward_data_nhwc_bf16_wide: BF16, 1);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_backward_data_nhwc_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc_tf32_wg: WGMMA, 0; conv_backward_data_nhwc_tf32_wg_wide: WGMMA, 1; conv_backward_data_nhwc_tf32_wg_big: WGMMA, 2; conv_backward_data_nhwc_tf32_wg_long: WGMMA, 3);
gemm_kernels!(conv_backward_data_nhwc16_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc16_bf16: BF16, 0; conv_backward_data_nhwc16_bf16_big: BF16, 2; conv_backward_data_nhwc16_bf16_long: BF16, 3);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_backward_data_nhwc16_impl (s: ConvShape, dy: *const f32, wt: *const f32, dx: *mut f32, mask: *const f32) =>
    conv_backward_data_nhwc16_bf16_wg: WGMMA, 0; conv_backward_data_nhwc16_bf16_wg_wide: WGMMA, 1; conv_backward_data_nhwc16_bf16_wg_big: WGMMA, 2; conv_backward_data_nhwc16_bf16_wg_long: WGMMA, 3);

/// x (NHWC, fp32 or bf16 when `H`) gathered as B((n,oh,ow), (kh,kw,c)) for
/// one group, copied along c (one tap's channels per vector).
struct NhwcPatchesT<const H: bool> {
    x: *const f32,
    s: ConvShape,
    g: u32,
    step: Step,
}

/// An `NhwcPatchesT` cursor: the column's channel offset and its tap offset
/// `(kh−p, kw−p)`, shared by the thread's slots, and per slot the output
/// position (image offset `img_off`, oh, ow).
#[derive(Clone, Copy)]
struct NhwcPositionCursor {
    img_off: [usize; BSLOTS],
    oh: [u32; BSLOTS],
    ow: [u32; BSLOTS],
    chan: usize,
    dh: i32,
    dw: i32,
}

impl<const H: bool> VecOperand for NhwcPatchesT<H> {
    const L1: bool = true;
    const K_MAJOR: bool = false;
    const HALF: bool = H;
    type Cursor = NhwcPositionCursor;
    #[inline(always)]
    fn open(&self, k: u32, n: u32, dk: u32, _: u32) -> NhwcPositionCursor {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let (r, c) = (n / s.cg(), n % s.cg());
        let mut cur = NhwcPositionCursor {
            img_off: [0; BSLOTS],
            oh: [0; BSLOTS],
            ow: [0; BSLOTS],
            chan: (self.g * s.cg() + c) as usize,
            dh: (r / s.kw) as i32 - s.pad as i32,
            dw: (r % s.kw) as i32 - s.pad as i32,
        };
        for j in 0..BSLOTS {
            let k = k + dk * j as u32;
            let (img, p) = (k / ohw, k % ohw);
            cur.img_off[j] = img as usize * (s.h * s.w * s.c_in) as usize;
            cur.oh[j] = p / s.ow;
            cur.ow[j] = p % s.ow;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &NhwcPositionCursor, j: usize) -> Option<*const f32> {
        let s = &self.s;
        let ih = (c.oh[j] * s.stride) as i32 + c.dh;
        let iw = (c.ow[j] * s.stride) as i32 + c.dw;
        if (ih as u32) < s.h && (iw as u32) < s.w {
            let at = (ih as usize * s.w as usize + iw as usize) * s.c_in as usize;
            Some(elem_at(self.x, c.img_off[j] + at + c.chan, H))
        } else {
            None
        }
    }
    #[inline(always)]
    fn step(&self, c: &mut NhwcPositionCursor) {
        let s = &self.s;
        for j in 0..BSLOTS {
            let images = self.step.advance(&mut c.oh[j], &mut c.ow[j], s.oh, s.ow);
            c.img_off[j] += images as usize * (s.c_in * s.h * s.w) as usize;
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.x
    }
}

/// Stores a split-K partial of dw, whose GEMM column is `(kh·KW + kw)·Cg +
/// c`, at `ws[slice·len(dw) + idx(dw)]` with dw in `[F][Cg][KH][KW]`.
struct StoreFilterGradNhwc {
    ws: *mut f32,
    offset: usize,
    s: ConvShape,
}

impl Epilogue for StoreFilterGradNhwc {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let (r, c) = (n / s.cg(), n % s.cg());
        let idx = self.offset + (m * s.cg() + c) as usize * s.kk() as usize + r as usize;
        unsafe { *self.ws.add(idx) = acc };
    }
}

/// Stores a split-K partial of dw in the GEMM's own order, `ws[slice][f]
/// [(kh·KW + kw)·Cgp + c]` (Cgp ≥ Cg columns a tap; `offset` = the
/// slice's and the group's first row, `len` = KH·KW·Cgp a row), so that
/// a warp's 32 consecutive columns are 128 consecutive bytes;
/// [`conv_backward_filter_sum`] sums the slices into dw's `[F][Cg][KH][KW]`.
#[cfg(feature = "wgmma")]
struct StoreFilterGradGemm {
    ws: *mut f32,
    offset: usize,
    len: u32,
}

#[cfg(feature = "wgmma")]
impl Epilogue for StoreFilterGradGemm {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        unsafe { *self.ws.add(self.offset + (m * self.len + n) as usize) = acc };
    }
}

/// Sums `splits` partials of dw in GEMM order (`ws[slice][f][(kh·KW + kw)·
/// cgp + c]`, as [`StoreFilterGradGemm`] writes them; columns `c ≥ cg` of
/// a tap are not read) into dw in `[F][Cg][KH][KW]`, slices in a fixed
/// order. Block (x, f) takes channels `x·chunk..` of filter f: it sums
/// them tap by tap, reading along c, into shared memory `[KH·KW][chunk +
/// 1]`, then writes dw's contiguous `(c, kh, kw)` run from there. Grid
/// (⌈Cg/chunk⌉, F), any block size, `4·KH·KW·(chunk + 1)` bytes of
/// dynamic shared memory; `kk` = KH·KW.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn conv_backward_filter_sum(
    ws: *const f32,
    dw: *mut f32,
    f_total: u32,
    cg: u32,
    cgp: u32,
    kk: FastDiv,
    chunk: u32,
    splits: u32,
) {
    let (f, c0) = (bid_y(), bid_x() * chunk);
    let cn = chunk.min(cg - c0);
    let row = (cg * kk.d) as usize;
    let ws_len = f_total as usize * (cgp * kk.d) as usize;
    let (sm, stride) = (shared::<f32>(), chunk + 1);
    let src = unsafe { ws.add(f as usize * (cgp * kk.d) as usize + c0 as usize) };
    for r in 0..kk.d {
        let mut c = tid_x();
        while c < cn {
            let at = (r * cgp + c) as usize;
            let mut sum = 0.0f32;
            for p in 0..splits as usize {
                sum += unsafe { *src.add(p * ws_len + at) };
            }
            unsafe { *sm.add((r * stride + c) as usize) = sum };
            c += bdim_x();
        }
    }
    crate::device::sync_threads();
    let dst = unsafe { dw.add(f as usize * row + (c0 * kk.d) as usize) };
    let mut i = tid_x();
    while i < cn * kk.d {
        let (c, r) = kk.divmod(i);
        unsafe { *dst.add(i as usize) = *sm.add((r * stride + c) as usize) };
        i += bdim_x();
    }
}

/// Convolution weight gradient from NHWC x and dy (fp32, or bf16 when `H`),
/// one split-K slice per z; writes dw (or its partials in `ws`) like
/// `conv_backward_filter`. Grid (⌈Cg·KH·KW/64⌉, ⌈Fg/BM⌉, G·splits),
/// `gemm::vshared_bytes(wide)` of dynamic shared memory.
#[inline(always)]
unsafe fn conv_backward_filter_nhwc_any<const MODE: u8, const T: u8, const H: bool>(
    s: ConvShape,
    x: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    let (g, slice) = (bid_z() / splits, bid_z() % splits);
    let (k_begin, k_end) = split_range(s.n * s.oh * s.ow, splits, slice);
    let n_len = s.cg() * s.kk();
    let dw_len = s.c_out as usize * n_len as usize;
    let a = VStrided::<false, H> {
        p: elem_at(dy, (g * s.fg()) as usize, H),
        ks: s.c_out as usize,
        is: 1,
    };
    let b = NhwcPatchesT::<H> {
        x,
        s,
        g,
        step: Step::with(vbk(H), s.oh, s.ow),
    };
    let offset = slice as usize * dw_len + (g * s.fg()) as usize * n_len as usize;
    let e = StoreFilterGradNhwc { ws, offset, s };
    unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, s.fg(), n_len, k_begin, k_end) };
}

unsafe fn conv_backward_filter_nhwc_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    unsafe { conv_backward_filter_nhwc_any::<MODE, T, false>(s, x, dy, ws, splits) }
}

unsafe fn conv_backward_filter_nhwc16_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    x: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    unsafe { conv_backward_filter_nhwc_any::<MODE, T, true>(s, x, dy, ws, splits) }
}

gemm_kernels!(conv_backward_filter_nhwc_impl (s: ConvShape, x: *const f32, dy: *const f32, ws: *mut f32, splits: u32) =>
    conv_backward_filter_nhwc_tf32: TF32_ROUNDED, 0; conv_backward_filter_nhwc_bf16: BF16, 0; conv_backward_filter_nhwc_tf32_wide: TF32_ROUNDED, 1; conv_backward_filter_nhwc_bf16_wide: BF16, 1);
gemm_kernels!(conv_backward_filter_nhwc16_impl (s: ConvShape, x: *const f32, dy: *const f32, ws: *mut f32, splits: u32) =>
    conv_backward_filter_nhwc16_bf16: BF16, 0; conv_backward_filter_nhwc16_bf16_wide: BF16, 1);

// ---------------------------------------------------------------------------
// Row-patch products for layers with few channels and one group (conv1: 3
// channels, 11×11, stride 4). The launcher cuts x into the rows of its
// windows with `layout::row_patches`: `P[n][r][ow][rw]`, r < RH =
// stride·(OH−1) + KH, where element j = kw·C + c of a row is tap kw,
// channel c (zero-padded to `rw`, the next multiple of the vector length:
// 36 for conv1 in fp32, 40 in bf16). The filter bank goes through the same
// kernel into `[F][KH][rw]`. Then k = (kh, j): K = KH·rw, and every vector
// of a patch is 16 contiguous bytes of P, with no bounds checks (the
// padding is in P). `_rows_tf32` reads fp32 copies rounded to TF32
// (`row_patches_tf32`; tiles 16 deep), `_rows16_bf16` bf16 copies (32
// deep).
// - forward: A = filter rows (K-major), B = patches (K-major).
// - filter:  k = (n, oh, ow), N index (kh, j); A = dy (NHWC), B = P rows;
//   needs F a multiple of the vector length. Columns j ≥ KW·C are dropped.
// ---------------------------------------------------------------------------

/// Elements of one stored window row: `KW·C` rounded up to whole vectors.
#[inline(always)]
fn row_len(s: &ConvShape, half: bool) -> u32 {
    (s.kw * s.c_in).next_multiple_of(vlen(half))
}

/// Rows of P per image.
#[inline(always)]
fn patch_rows(s: &ConvShape) -> u32 {
    s.stride * (s.oh - 1) + s.kh
}

/// P gathered as B((kh, j), (n, oh, ow)), K-major.
struct RowPatches<const H: bool> {
    p: *const f32,
    s: ConvShape,
}

/// A `RowPatches` cursor: (kh, j) shared by the thread's slots, and per slot
/// the offset of its window's first row in P.
#[derive(Clone, Copy)]
struct RowPatchCursor {
    base: [usize; BSLOTS],
    kh: u32,
    j: u32,
}

impl<const H: bool> VecOperand for RowPatches<H> {
    const L1: bool = true;
    const K_MAJOR: bool = true;
    const HALF: bool = H;
    type Cursor = RowPatchCursor;
    #[inline(always)]
    fn open(&self, k: u32, n: u32, _: u32, di: u32) -> RowPatchCursor {
        let s = &self.s;
        let rw = row_len(s, H);
        let mut cur = RowPatchCursor {
            base: [0; BSLOTS],
            kh: k / rw,
            j: k % rw,
        };
        for slot in 0..BSLOTS {
            let n = n + di * slot as u32;
            let (img, p) = (n / (s.oh * s.ow), n % (s.oh * s.ow));
            let r = img * patch_rows(s) + s.stride * (p / s.ow);
            cur.base[slot] = (r as usize * s.ow as usize + (p % s.ow) as usize) * rw as usize;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &RowPatchCursor, slot: usize) -> Option<*const f32> {
        let s = &self.s;
        let at = (c.kh * s.ow) as usize * row_len(s, H) as usize + c.j as usize;
        Some(elem_at(self.p, c.base[slot] + at, H))
    }
    #[inline(always)]
    fn step(&self, c: &mut RowPatchCursor) {
        let rw = row_len(&self.s, H);
        c.j += vbk(H);
        while c.j >= rw {
            c.j -= rw;
            c.kh += 1;
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.p
    }
}

/// Convolution forward from row patches `p` and filter rows `wr` (fp32, or
/// bf16 when `H`); writes y (NCHW) like `conv_forward`. Grid
/// (⌈N·OH·OW/64⌉, ⌈F/BM⌉, 1), `gemm::vshared_bytes(wide)` of dynamic shared
/// memory. The filter bank is copied through L1: blocks of
/// one column of the grid re-read it (4–11% faster TF32 forwards).
#[inline(always)]
unsafe fn conv_forward_rows_any<const MODE: u8, const T: u8, const H: bool>(
    s: ConvShape,
    p: *const f32,
    wr: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    let k_len = s.kh * row_len(&s, H);
    let a = VStrided::<true, H, true> {
        p: wr,
        ks: 1,
        is: k_len as usize,
    };
    let b = RowPatches::<H> { p, s };
    let e = StoreOutput::<false>::new(y, bias, s, 0);
    let n = s.n * s.oh * s.ow;
    unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, s.c_out, n, 0, k_len) };
}

unsafe fn conv_forward_rows_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    p: *const f32,
    wr: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_rows_any::<MODE, T, false>(s, p, wr, bias, y) }
}

unsafe fn conv_forward_rows16_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    p: *const f32,
    wr: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    unsafe { conv_forward_rows_any::<MODE, T, true>(s, p, wr, bias, y) }
}

gemm_kernels!(conv_forward_rows_impl (s: ConvShape, p: *const f32, wr: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_rows_tf32: TF32_ROUNDED, 0; conv_forward_rows_tf32_wide: TF32_ROUNDED, 1; conv_forward_rows_tf32_big: TF32_ROUNDED, 2);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_forward_rows_impl (s: ConvShape, p: *const f32, wr: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_rows_tf32_wg: WGMMA, 0; conv_forward_rows_tf32_wg_wide: WGMMA, 1; conv_forward_rows_tf32_wg_big: WGMMA, 2; conv_forward_rows_tf32_wg_long: WGMMA, 3);
gemm_kernels!(conv_forward_rows16_impl (s: ConvShape, p: *const f32, wr: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_rows16_bf16: BF16, 0; conv_forward_rows16_bf16_big: BF16, 2);
#[cfg(feature = "wgmma")]
gemm_kernels!(conv_forward_rows16_impl (s: ConvShape, p: *const f32, wr: *const f32, bias: *const f32, y: *mut f32) =>
    conv_forward_rows16_bf16_wg: WGMMA, 0; conv_forward_rows16_bf16_wg_wide: WGMMA, 1; conv_forward_rows16_bf16_wg_big: WGMMA, 2; conv_forward_rows16_bf16_wg_long: WGMMA, 3);

/// P gathered as B((n, oh, ow), (kh, j)), copied along j.
struct RowPatchesT<const H: bool> {
    p: *const f32,
    s: ConvShape,
    step: Step,
}

/// A `RowPatchesT` cursor: the column's offset `kh·OW·rw + j`, shared by the
/// thread's slots, and per slot the output position (image offset
/// `img_off` in P, oh, ow).
#[derive(Clone, Copy)]
struct RowPositionCursor {
    img_off: [usize; BSLOTS],
    oh: [u32; BSLOTS],
    ow: [u32; BSLOTS],
    col: usize,
}

impl<const H: bool> VecOperand for RowPatchesT<H> {
    const L1: bool = true;
    const K_MAJOR: bool = false;
    const HALF: bool = H;
    type Cursor = RowPositionCursor;
    #[inline(always)]
    fn open(&self, k: u32, n: u32, dk: u32, _: u32) -> RowPositionCursor {
        let s = &self.s;
        let (rw, ohw) = (row_len(s, H), s.oh * s.ow);
        let mut cur = RowPositionCursor {
            img_off: [0; BSLOTS],
            oh: [0; BSLOTS],
            ow: [0; BSLOTS],
            col: ((n / rw) * s.ow) as usize * rw as usize + (n % rw) as usize,
        };
        for slot in 0..BSLOTS {
            let k = k + dk * slot as u32;
            let (img, p) = (k / ohw, k % ohw);
            cur.img_off[slot] = img as usize * (patch_rows(s) * s.ow) as usize * rw as usize;
            cur.oh[slot] = p / s.ow;
            cur.ow[slot] = p % s.ow;
        }
        cur
    }
    #[inline(always)]
    fn src(&self, c: &RowPositionCursor, slot: usize) -> Option<*const f32> {
        let s = &self.s;
        let win = (s.stride * c.oh[slot] * s.ow + c.ow[slot]) as usize * row_len(s, H) as usize;
        Some(elem_at(self.p, c.img_off[slot] + win + c.col, H))
    }
    #[inline(always)]
    fn step(&self, c: &mut RowPositionCursor) {
        let s = &self.s;
        let image = (patch_rows(s) * s.ow) as usize * row_len(s, H) as usize;
        for slot in 0..BSLOTS {
            let images = self.step.advance(&mut c.oh[slot], &mut c.ow[slot], s.oh, s.ow);
            c.img_off[slot] += images as usize * image;
        }
    }
    #[inline(always)]
    fn base(&self) -> *const f32 {
        self.p
    }
}

/// Stores a split-K partial of dw from GEMM column `kh·rw + j` (dropped for
/// `j ≥ KW·C`), at `ws[slice·len(dw) + idx(dw)]`, dw in `[F][C][KH][KW]`.
struct StoreFilterGradRows {
    ws: *mut f32,
    s: ConvShape,
    rw: u32,
}

impl Epilogue for StoreFilterGradRows {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let (kh, j) = (n / self.rw, n % self.rw);
        if j < s.kw * s.c_in {
            let (kw, c) = (j / s.c_in, j % s.c_in);
            let idx = ((m * s.c_in + c) * s.kh + kh) * s.kw + kw;
            unsafe { *self.ws.add(idx as usize) = acc };
        }
    }
}

/// Convolution weight gradient from row patches `p` and NHWC dy (fp32, or
/// bf16 when `H`), one split-K slice per z; writes dw (or its partials in
/// `ws`) like `conv_backward_filter`. Grid (⌈KH·rw/64⌉, ⌈F/BM⌉, splits),
/// `gemm::vshared_bytes(wide)` of dynamic shared memory.
#[inline(always)]
unsafe fn conv_backward_filter_rows_any<const MODE: u8, const T: u8, const H: bool>(
    s: ConvShape,
    p: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    let slice = bid_z();
    let (k_begin, k_end) = split_range(s.n * s.oh * s.ow, splits, slice);
    let rw = row_len(&s, H);
    let dw_len = (s.c_out * s.c_in * s.kk()) as usize;
    let a = VStrided::<false, H> {
        p: dy,
        ks: s.c_out as usize,
        is: 1,
    };
    let b = RowPatchesT::<H> {
        p,
        s,
        step: Step::with(vbk(H), s.oh, s.ow),
    };
    let e = StoreFilterGradRows {
        ws: ws.wrapping_add(slice as usize * dw_len),
        s,
        rw,
    };
    unsafe { gemm_tile_v::<_, _, _, MODE, T, H>(&a, &b, &e, s.c_out, s.kh * rw, k_begin, k_end) };
}

unsafe fn conv_backward_filter_rows_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    p: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    unsafe { conv_backward_filter_rows_any::<MODE, T, false>(s, p, dy, ws, splits) }
}

unsafe fn conv_backward_filter_rows16_impl<const MODE: u8, const T: u8>(
    s: ConvShape,
    p: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    unsafe { conv_backward_filter_rows_any::<MODE, T, true>(s, p, dy, ws, splits) }
}

gemm_kernels!(conv_backward_filter_rows_impl (s: ConvShape, p: *const f32, dy: *const f32, ws: *mut f32, splits: u32) =>
    conv_backward_filter_rows_tf32: TF32_ROUNDED, 0; conv_backward_filter_rows_tf32_wide: TF32_ROUNDED, 1);
gemm_kernels!(conv_backward_filter_rows16_impl (s: ConvShape, p: *const f32, dy: *const f32, ws: *mut f32, splits: u32) =>
    conv_backward_filter_rows16_bf16: BF16, 0; conv_backward_filter_rows16_bf16_wide: BF16, 1; conv_backward_filter_rows16_bf16_big: BF16, 2);
