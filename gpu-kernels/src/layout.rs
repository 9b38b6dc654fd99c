//! Layout changes: `transpose` turns `batches` row-major `rows × cols`
//! matrices into `cols × rows_out` ones, `dst[b][j][i] = src[b][i][j]`,
//! zero for `rows ≤ i < rows_out` (padding, e.g. a fourth channel);
//! `transpose_bf16` does the same and stores bf16 (round to nearest even),
//! `transpose_tf32` fp32 rounded to TF32 (nearest, ties away; the low 13
//! bits zero), the operands of the TF32 products.
//! The channels-last convolution path uses them for NCHW → NHWC (a matrix
//! per image: rows = C, cols = H·W) and to reorder the filter bank.
//!
//! Mapping: a block of 32×8 threads moves a 32-row × 64-column tile
//! through shared memory (rows padded to 65 floats: the column reads and row
//! writes are free of bank conflicts); each thread loads 8 elements along
//! `cols` (coalesced), then, where `rows_out` is a multiple of a 16-byte
//! vector, stores one or two vectors of a destination row (4 fp32 or 8 bf16
//! channels of one pixel), else 8 single elements. Against the earlier
//! 32×32 tile with single-element stores (`…-v19/transpose/`, batch 128,
//! TF32): conv2's dy 54% → 85% of the copy bandwidth, conv1's 56% → 89%.
//! Grid (⌈cols/64⌉, ⌈rows_out/32⌉, batches), 32×65 floats of dynamic
//! shared memory.
//!
//! With `sums` not null, the same pass also writes each row's sum over the
//! tile's columns to `sums[b][i][tile]` (`⌈cols/64⌉` tiles): dy's
//! per-channel partial sums, which `conv_backward_bias` then adds up as if
//! they were an image `⌈cols/64⌉` pixels large, sparing the bias gradient
//! its own pass over dy.
//!
//! `row_patches` (and `row_patches_bf16`, `row_patches_tf32`) cut an NCHW tensor into the rows of
//! a strided convolution's windows, for layers with few channels (conv1):
//! `dst[b][r][o][j] = src[b][c][r − pad][stride·o − pad + kw]` with
//! `j = kw·C + c < KW·C`, zero outside the image and for `KW·C ≤ j < rw`
//! (rows padded to whole 16-byte vectors). A window's row `kh` is then `rw`
//! contiguous elements, so the product reads whole vectors with no bounds
//! checks. One thread per 16 bytes of output (4 fp32 or 8 bf16 elements,
//! one vector store); 1-D grid-stride.
//!
//! `convert_bf16` / `convert_tf32` round a flat array to bf16 / TF32 (the fc
//! products' operand copies, which need no reordering).
//!
//! `pixel_grid_tf32` copies an NCHW tensor channel-major onto a padded
//! pixel grid, `[copies][C][N·Hp·Wp]` rounded to TF32, each copy shifted
//! by one more pixel (the TF32 weight gradient's K-major operands); a
//! thread per 16-byte store, 1-D grid-stride, its divisions by `FastDiv`s.

use crate::device::{
    FastDiv, bf16_bits, bid_x, bid_y, bid_z, gdim_x, grid_stride, pack_bf16, shared, sync_threads, tid_x, tid_y,
    tf32_rounded, warp_sum,
};

const TILE: u32 = 32;
/// Columns (pixels) of a `transpose` tile.
const W: usize = 64;

/// Sixteen bytes, aligned so that a store of it is one `st.global.v4`.
#[repr(C, align(16))]
struct Vec16([u32; 4]);

/// An element type the layout kernels can store.
trait Store: Copy {
    /// Elements in 16 bytes.
    const PER_VEC: u32;
    fn from_f32(v: f32) -> Self;
    /// Stores `v[..PER_VEC]` at elements `i..` of `dst` (16-byte aligned).
    unsafe fn store_vec(dst: *mut Self, i: usize, v: [f32; 8]);
}
impl Store for f32 {
    const PER_VEC: u32 = 4;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    unsafe fn store_vec(dst: *mut f32, i: usize, v: [f32; 8]) {
        let w = [v[0].to_bits(), v[1].to_bits(), v[2].to_bits(), v[3].to_bits()];
        unsafe { *(dst.add(i) as *mut Vec16) = Vec16(w) };
    }
}
impl Store for u16 {
    const PER_VEC: u32 = 8;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16_bits(v)
    }
    #[inline(always)]
    unsafe fn store_vec(dst: *mut u16, i: usize, v: [f32; 8]) {
        let w = [
            pack_bf16(v[0], v[1]),
            pack_bf16(v[2], v[3]),
            pack_bf16(v[4], v[5]),
            pack_bf16(v[6], v[7]),
        ];
        unsafe { *(dst.add(i) as *mut Vec16) = Vec16(w) };
    }
}

/// fp32 rounded to TF32 (`cvt.rna.tf32.f32`, low 13 bits cleared), stored
/// as its fp32 bit pattern.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Tf32(u32);
impl Tf32 {
    #[inline(always)]
    fn bits(v: f32) -> u32 {
        tf32_rounded(v).to_bits()
    }
}
impl Store for Tf32 {
    const PER_VEC: u32 = 4;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Tf32(Self::bits(v))
    }
    #[inline(always)]
    unsafe fn store_vec(dst: *mut Tf32, i: usize, v: [f32; 8]) {
        let w = [v[0], v[1], v[2], v[3]].map(Self::bits);
        unsafe { *(dst.add(i) as *mut Vec16) = Vec16(w) };
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose(
    src: *const f32,
    dst: *mut f32,
    rows: u32,
    cols: u32,
    rows_out: u32,
    sums: *mut f32,
) {
    unsafe { transpose_any(src, dst, rows, cols, rows_out, sums) }
}

/// `transpose` storing bf16 (`dst` holds `u16`s).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_bf16(
    src: *const f32,
    dst: *mut u16,
    rows: u32,
    cols: u32,
    rows_out: u32,
    sums: *mut f32,
) {
    unsafe { transpose_any(src, dst, rows, cols, rows_out, sums) }
}

/// `transpose` rounding to TF32 (`dst` holds fp32 bit patterns).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_tf32(
    src: *const f32,
    dst: *mut f32,
    rows: u32,
    cols: u32,
    rows_out: u32,
    sums: *mut f32,
) {
    unsafe { transpose_any(src, dst as *mut Tf32, rows, cols, rows_out, sums) }
}

#[inline(always)]
unsafe fn transpose_any<T: Store>(
    src: *const f32,
    dst: *mut T,
    rows: u32,
    cols: u32,
    rows_out: u32,
    sums: *mut f32,
) {
    let buf = shared::<f32>();
    // buf[r][c] at r·(W+1) + c: a row per channel, padded by one float.
    let at = |r: u32, c: u32| (r * (W as u32 + 1) + c) as usize;
    let b = bid_z() as usize;
    let src = src.wrapping_add(b * rows as usize * cols as usize);
    let dst = dst.wrapping_add(b * rows_out as usize * cols as usize);
    let (tx, ty) = (tid_x(), tid_y());
    let (c0, r0) = (bid_x() * W as u32, bid_y() * TILE);
    for i in 0..4 {
        for k in 0..W as u32 / 32 {
            let (r, c) = (r0 + ty + 8 * i, c0 + tx + 32 * k);
            if r < rows && c < cols {
                let v = unsafe { *src.add(r as usize * cols as usize + c as usize) };
                unsafe { *buf.add(at(ty + 8 * i, tx + 32 * k)) = v };
            }
        }
    }
    sync_threads();
    if !sums.is_null() {
        // Each warp sums the rows it loaded: its lanes' columns, then
        // across the warp (a fixed butterfly: deterministic).
        for i in 0..4 {
            let r = ty + 8 * i;
            let mut v = 0.0f32;
            for k in 0..W as u32 / 32 {
                if c0 + tx + 32 * k < cols && r0 + r < rows {
                    v += unsafe { *buf.add(at(r, tx + 32 * k)) };
                }
            }
            let total = warp_sum(v);
            if tx == 0 && r0 + r < rows {
                let row = b * rows as usize + (r0 + r) as usize;
                unsafe { *sums.add(row * gdim_x() as usize + bid_x() as usize) = total };
            }
        }
    }
    let t = ty * 32 + tx;
    let per = T::PER_VEC;
    if rows_out.is_multiple_of(per) {
        // 32/per vectors per pixel, W pixels: W·32/per vectors, 256 a pass.
        let vecs = W as u32 * (32 / per);
        for pass in 0..(W as u32 * 32 / per).div_ceil(256) {
            let v_idx = t + 256 * pass;
            let (p, j) = (v_idx / (32 / per), v_idx % (32 / per));
            let (c, r) = (c0 + p, r0 + j * per);
            if v_idx < vecs && c < cols && r < rows_out {
                let mut v = [0.0f32; 8];
                #[allow(clippy::needless_range_loop)] // constant bounds: unrolled
                for e in 0..8 {
                    if (e as u32) < per && r + (e as u32) < rows {
                        v[e] = unsafe { *buf.add(at(j * per + e as u32, p)) };
                    }
                }
                unsafe { T::store_vec(dst, c as usize * rows_out as usize + r as usize, v) };
            }
        }
    } else {
        for i in 0..4 * W as u32 / 32 {
            let (c, r) = (c0 + ty + 8 * i, r0 + tx);
            if r < rows_out && c < cols {
                let v = if r < rows {
                    unsafe { *buf.add(at(tx, ty + 8 * i)) }
                } else {
                    0.0
                };
                unsafe { *dst.add(c as usize * rows_out as usize + r as usize) = T::from_f32(v) };
            }
        }
    }
}

/// Shape of a `row_patches` call (passed by value): `batches` NCHW images of
/// `c × h × w` cut into `rows` rows of `ow` windows of `kw` taps, stride
/// `stride`, padding `pad`, each window row stored as `rw` elements.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RowGeom {
    pub batches: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub rows: u32,
    pub ow: u32,
    pub kw: u32,
    pub stride: u32,
    pub pad: u32,
    pub rw: u32,
}

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_patches(src: *const f32, dst: *mut f32, g: RowGeom) {
    unsafe { row_patches_any(src, dst, g) }
}

/// `row_patches` storing bf16 (`dst` holds `u16`s).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_patches_bf16(src: *const f32, dst: *mut u16, g: RowGeom) {
    unsafe { row_patches_any(src, dst, g) }
}

/// `row_patches` rounding to TF32 (`dst` holds fp32 bit patterns).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn row_patches_tf32(src: *const f32, dst: *mut f32, g: RowGeom) {
    unsafe { row_patches_any(src, dst as *mut Tf32, g) }
}

#[inline(always)]
unsafe fn row_patches_any<T: Store>(src: *const f32, dst: *mut T, g: RowGeom) {
    // 32-bit index math (the launcher checks the element count fits).
    let per = g.rw / T::PER_VEC;
    let total = g.batches * g.rows * g.ow * per;
    let plane = g.h * g.w;
    let (i, step) = grid_stride();
    let (mut idx, step) = (i as u32, step as u32);
    while idx < total {
        let (win, jv) = (idx / per, idx % per);
        let (br, o) = (win / g.ow, win % g.ow);
        let (b, r) = (br / g.rows, br % g.rows);
        let ih = r as i32 - g.pad as i32;
        let iw0 = (g.stride * o) as i32 - g.pad as i32;
        let at = b as usize * (g.c * plane) as usize + (ih.max(0) as u32 * g.w) as usize;
        let j0 = jv * T::PER_VEC;
        let (mut kw, mut c) = (j0 / g.c, j0 % g.c);
        let mut v = [0.0f32; 8];
        for e in v.iter_mut().take(T::PER_VEC as usize) {
            let iw = iw0 + kw as i32;
            if kw < g.kw && (ih as u32) < g.h && (iw as u32) < g.w {
                *e = unsafe { *src.add(at + (c * plane) as usize + iw as usize) };
            }
            c += 1;
            if c == g.c {
                c = 0;
                kw += 1;
            }
        }
        unsafe { T::store_vec(dst, (idx * T::PER_VEC) as usize, v) };
        idx += step;
    }
}

/// `dst[i]` = `src[i]` rounded to bf16 (nearest even), for `len` elements:
/// the bf16 operand copies of the fc products. One thread per 8 elements
/// (two 16-byte loads, one 16-byte store where all 8 are in range), 1-D
/// grid-stride; `src` and `dst` 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn convert_bf16(src: *const f32, dst: *mut u16, len: u32) {
    unsafe { convert(src, dst, len) }
}

/// `dst[i]` = `src[i]` rounded to TF32 (as `transpose_tf32`), for `len`
/// elements: the TF32 operand copies of the fc products. As
/// `convert_bf16`, with two 16-byte stores per thread.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn convert_tf32(src: *const f32, dst: *mut f32, len: u32) {
    unsafe { convert(src, dst as *mut Tf32, len) }
}

#[inline(always)]
unsafe fn convert<T: Store>(src: *const f32, dst: *mut T, len: u32) {
    let (mut i, step) = grid_stride();
    let len = len as usize;
    while i * 8 < len {
        let at = i * 8;
        if at + 8 <= len {
            let (lo, hi) = unsafe {
                let p = src.add(at) as *const Vec16;
                (&(*p).0, &(*p.add(1)).0)
            };
            let v = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]].map(f32::from_bits);
            unsafe { T::store_vec(dst, at, v) };
            if T::PER_VEC == 4 {
                let h = [v[4], v[5], v[6], v[7], 0.0, 0.0, 0.0, 0.0];
                unsafe { T::store_vec(dst, at + 4, h) };
            }
        } else {
            for j in at..len {
                unsafe { *dst.add(j) = T::from_f32(*src.add(j)) };
            }
        }
        i += step;
    }
}

/// Shape of a `pixel_grid_tf32` call (passed by value): `batches` NCHW
/// images of `c × h × w` laid on a grid of `hp × wp` pixels per image
/// (`hp ≥ h`, `wp ≥ w`), `copies` copies of `c` rows of `len` elements
/// (a multiple of 4), copy k shifted by `shift + k` grid pixels.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct GridGeom {
    pub batches: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub hp: u32,
    pub wp: u32,
    pub len: u32,
    pub copies: u32,
    pub shift: i32,
}

/// `dst[k][c][q]` = grid pixel `q + shift + k` of channel c rounded to
/// TF32, where image b's pixel (y, x) is grid pixel `(b·hp + y)·wp + x`
/// and every other one is zero: channel-major copies on the padded pixel
/// grid of the TF32 weight gradient
/// (`conv::conv_backward_filter_grid_tf32_wg_tma_big`), where each filter
/// tap is a shift of the pixel index. One thread per 4 destination
/// elements (a 16-byte store), 1-D grid-stride; the four divisors are
/// `FastDiv`s made once per thread.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn pixel_grid_tf32(src: *const f32, dst: *mut f32, g: GridGeom) {
    if g.len < 4 || g.c == 0 || g.hp == 0 || g.wp == 0 {
        return;
    }
    let (i, step) = grid_stride();
    let (mut idx, step) = (i as u32, step as u32);
    let per_row = FastDiv::new(g.len / 4);
    let chans = FastDiv::new(g.c);
    let image = FastDiv::new(g.hp * g.wp);
    let wp = FastDiv::new(g.wp);
    let plane = (g.h * g.w) as usize;
    while idx < g.copies * g.c * per_row.d {
        let (row, q) = per_row.divmod(idx);
        let (k, c) = chans.divmod(row);
        let first = (q * 4 + k) as i32 + g.shift;
        let value = |j: i32| {
            let at = first + j;
            if at < 0 {
                return 0.0;
            }
            let (b, r) = image.divmod(at as u32);
            let (y, x) = wp.divmod(r);
            if b < g.batches && y < g.h && x < g.w {
                let at = (b * g.c + c) as usize * plane + (y * g.w + x) as usize;
                unsafe { *src.add(at) }
            } else {
                0.0
            }
        };
        let v = [value(0), value(1), value(2), value(3), 0.0, 0.0, 0.0, 0.0];
        unsafe { Tf32::store_vec(dst as *mut Tf32, idx as usize * 4, v) };
        idx += step;
    }
}
