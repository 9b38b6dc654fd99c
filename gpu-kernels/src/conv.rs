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
//!   partials `splitk_reduce` sums in a fixed order.
//!
//! Grid (⌈N_gemm/64⌉, ⌈M_gemm/64⌉, G or G·splits), 256 threads,
//! `gemm::SHARED_BYTES` of dynamic shared memory.

use crate::device::{bdim_x, bid_x, bid_z, block_sum, shared, tid_x};
use crate::gemm::{Epilogue, OperandA, OperandB, gemm_kernels, gemm_tile};

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
}

/// w viewed as A(f, (c,kh,kw)) for one group: contiguous rows.
struct WeightRows {
    w: *const f32,
    k_len: u32,
}

impl OperandA for WeightRows {
    const K_FAST: bool = true;
    #[inline(always)]
    unsafe fn load(&self, m: u32, k: u32) -> f32 {
        unsafe { *self.w.add(m as usize * self.k_len as usize + k as usize) }
    }
}

/// x gathered as B((c,kh,kw), (n,oh,ow)) for one group.
struct Patches {
    x: *const f32,
    s: ConvShape,
    g: u32,
}

impl Patches {
    /// x at (n, g·Cg + c, oh·s−p+kh, ow·s−p+kw), or 0 in the padding.
    #[inline(always)]
    unsafe fn at(&self, n: u32, oh: u32, ow: u32, c: u32, kh: u32, kw: u32) -> f32 {
        let s = &self.s;
        let ih = (oh * s.stride + kh) as i32 - s.pad as i32;
        let iw = (ow * s.stride + kw) as i32 - s.pad as i32;
        if ih < 0 || iw < 0 || ih >= s.h as i32 || iw >= s.w as i32 {
            return 0.0;
        }
        let ch = (n * s.c_in + self.g * s.cg() + c) as usize;
        unsafe {
            *self
                .x
                .add((ch * s.h as usize + ih as usize) * s.w as usize + iw as usize)
        }
    }
}

impl OperandB for Patches {
    const K_FAST: bool = false;
    #[inline(always)]
    unsafe fn load(&self, k: u32, n: u32) -> f32 {
        let s = &self.s;
        let (img, p) = (n / (s.oh * s.ow), n % (s.oh * s.ow));
        let (c, r) = (k / s.kk(), k % s.kk());
        unsafe { self.at(img, p / s.ow, p % s.ow, c, r / s.kw, r % s.kw) }
    }
}

/// Stores y[n, g·Fg+f, oh, ow] = acc + bias.
struct StoreOutput {
    y: *mut f32,
    bias: *const f32,
    s: ConvShape,
    g: u32,
}

impl Epilogue for StoreOutput {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let (img, p) = (n / ohw, n % ohw);
        let f = self.g * s.fg() + m;
        let idx = (img as usize * s.c_out as usize + f as usize) * ohw as usize + p as usize;
        unsafe { *self.y.add(idx) = acc + *self.bias.add(f as usize) };
    }
}

/// Convolution forward, `y = conv(x, w) + bias`; see the module doc.
/// Grid (⌈N·OH·OW/64⌉, ⌈Fg/64⌉, G).
unsafe fn conv_forward_impl<const TF32: bool>(
    s: ConvShape,
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
) {
    let g = bid_z();
    let k_len = s.cg() * s.kk();
    let a = WeightRows {
        w: unsafe { w.add((g * s.fg() * k_len) as usize) },
        k_len,
    };
    let b = Patches { x, s, g };
    let e = StoreOutput { y, bias, s, g };
    unsafe { gemm_tile::<_, _, _, TF32>(&a, &b, &e, s.fg(), s.n * s.oh * s.ow, 0, k_len) };
}

gemm_kernels!(conv_forward_impl => conv_forward, conv_forward_tf32 (s: ConvShape, x: *const f32, w: *const f32, bias: *const f32, y: *mut f32));

/// w viewed as A(c, (f,kh,kw)) for one group (the transposed filter bank).
struct WeightCols {
    w: *const f32,
    s: ConvShape,
}

impl OperandA for WeightCols {
    const K_FAST: bool = true;
    #[inline(always)]
    unsafe fn load(&self, m: u32, k: u32) -> f32 {
        let kk = self.s.kk();
        let (f, r) = (k / kk, k % kk);
        let idx = ((f * self.s.cg() + m) * kk + r) as usize;
        unsafe { *self.w.add(idx) }
    }
}

/// dy gathered as B((f,kh,kw), (n,ih,iw)) for one group.
struct GradPatches {
    dy: *const f32,
    s: ConvShape,
    g: u32,
}

impl OperandB for GradPatches {
    const K_FAST: bool = false;
    #[inline(always)]
    unsafe fn load(&self, k: u32, n: u32) -> f32 {
        let s = &self.s;
        let hw = s.h * s.w;
        let (img, p) = (n / hw, n % hw);
        let (ih, iw) = (p / s.w, p % s.w);
        let (f, r) = (k / s.kk(), k % s.kk());
        let (kh, kw) = (r / s.kw, r % s.kw);
        let th = (ih + s.pad) as i32 - kh as i32;
        let tw = (iw + s.pad) as i32 - kw as i32;
        if th < 0 || tw < 0 {
            return 0.0;
        }
        let (th, tw) = (th as u32, tw as u32);
        if th % s.stride != 0 || tw % s.stride != 0 {
            return 0.0;
        }
        let (oh, ow) = (th / s.stride, tw / s.stride);
        if oh >= s.oh || ow >= s.ow {
            return 0.0;
        }
        let ch = (img * s.c_out + self.g * s.fg() + f) as usize;
        unsafe {
            *self
                .dy
                .add((ch * s.oh as usize + oh as usize) * s.ow as usize + ow as usize)
        }
    }
}

/// Stores dx[n, g·Cg+c, ih, iw].
struct StoreInputGrad {
    dx: *mut f32,
    s: ConvShape,
    g: u32,
}

impl Epilogue for StoreInputGrad {
    #[inline(always)]
    unsafe fn store(&self, m: u32, n: u32, acc: f32) {
        let s = &self.s;
        let hw = s.h * s.w;
        let (img, p) = (n / hw, n % hw);
        let ch = (img * s.c_in + self.g * s.cg() + m) as usize;
        unsafe { *self.dx.add(ch * hw as usize + p as usize) = acc };
    }
}

/// Convolution data gradient, `dx = ∂L/∂x`; see the module doc.
/// Grid (⌈N·H·W/64⌉, ⌈Cg/64⌉, G).
unsafe fn conv_backward_data_impl<const TF32: bool>(
    s: ConvShape,
    dy: *const f32,
    w: *const f32,
    dx: *mut f32,
) {
    let g = bid_z();
    let k_len = s.fg() * s.kk();
    let a = WeightCols {
        w: unsafe { w.add((g * s.fg() * s.cg() * s.kk()) as usize) },
        s,
    };
    let b = GradPatches { dy, s, g };
    let e = StoreInputGrad { dx, s, g };
    unsafe { gemm_tile::<_, _, _, TF32>(&a, &b, &e, s.cg(), s.n * s.h * s.w, 0, k_len) };
}

gemm_kernels!(conv_backward_data_impl => conv_backward_data, conv_backward_data_tf32 (s: ConvShape, dy: *const f32, w: *const f32, dx: *mut f32));

/// dy viewed as A(f, (n,oh,ow)) for one group.
struct GradRows {
    dy: *const f32,
    s: ConvShape,
    g: u32,
}

impl OperandA for GradRows {
    const K_FAST: bool = true;
    #[inline(always)]
    unsafe fn load(&self, m: u32, k: u32) -> f32 {
        let s = &self.s;
        let ohw = s.oh * s.ow;
        let (img, p) = (k / ohw, k % ohw);
        let ch = (img * s.c_out + self.g * s.fg() + m) as usize;
        unsafe { *self.dy.add(ch * ohw as usize + p as usize) }
    }
}

/// x gathered as B((n,oh,ow), (c,kh,kw)) for one group.
struct PatchesT {
    p: Patches,
}

impl OperandB for PatchesT {
    const K_FAST: bool = true;
    #[inline(always)]
    unsafe fn load(&self, k: u32, n: u32) -> f32 {
        let s = &self.p.s;
        let ohw = s.oh * s.ow;
        let (img, p) = (k / ohw, k % ohw);
        let (c, r) = (n / s.kk(), n % s.kk());
        unsafe { self.p.at(img, p / s.ow, p % s.ow, c, r / s.kw, r % s.kw) }
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
/// Grid (⌈Cg·KH·KW/64⌉, ⌈Fg/64⌉, G·splits).
unsafe fn conv_backward_filter_impl<const TF32: bool>(
    s: ConvShape,
    x: *const f32,
    dy: *const f32,
    ws: *mut f32,
    splits: u32,
) {
    let (g, slice) = (bid_z() / splits, bid_z() % splits);
    let k_total = s.n * s.oh * s.ow;
    let chunk = k_total.div_ceil(splits).div_ceil(crate::gemm::BK) * crate::gemm::BK;
    let k_begin = slice * chunk;
    let k_end = (k_begin + chunk).min(k_total);
    let n_len = s.cg() * s.kk();
    let dw_len = s.c_out as usize * n_len as usize;
    let a = GradRows { dy, s, g };
    let b = PatchesT {
        p: Patches { x, s, g },
    };
    let offset = slice as usize * dw_len + (g * s.fg()) as usize * n_len as usize;
    let e = StoreFilterGrad { ws, offset, n_len };
    unsafe { gemm_tile::<_, _, _, TF32>(&a, &b, &e, s.fg(), n_len, k_begin, k_end) };
}

gemm_kernels!(conv_backward_filter_impl => conv_backward_filter, conv_backward_filter_tf32 (s: ConvShape, x: *const f32, dy: *const f32, ws: *mut f32, splits: u32));

/// Convolution bias gradient, `db[c] = Σ_{n,h,w} dy[n, c, h, w]`: one block
/// per channel (grid x = C_out) walking its planes image by image (coalesced,
/// no index division), any multiple of 32 threads up to 1024; fixed-order
/// block reduction (deterministic). 32 floats of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn conv_backward_bias(
    dy: *const f32,
    db: *mut f32,
    n: u32,
    c_out: u32,
    hw: u32,
) {
    let c = bid_x() as usize;
    let (hw, c_out) = (hw as usize, c_out as usize);
    let mut s = 0.0f32;
    for img in 0..n as usize {
        let plane = unsafe { dy.add((img * c_out + c) * hw) };
        let mut p = tid_x() as usize;
        while p < hw {
            s += unsafe { *plane.add(p) };
            p += bdim_x() as usize;
        }
    }
    let total = unsafe { block_sum(s, shared::<f32>()) };
    if tid_x() == 0 {
        unsafe { *db.add(c) = total };
    }
}
