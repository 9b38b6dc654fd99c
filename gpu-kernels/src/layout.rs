//! Layout changes: `transpose` turns `batches` row-major `rows × cols`
//! matrices into `cols × rows_out` ones, `dst[b][j][i] = src[b][i][j]`,
//! zero for `rows ≤ i < rows_out` (padding, e.g. a fourth channel);
//! `transpose_bf16` does the same and stores bf16 (round to nearest even).
//! The channels-last convolution path uses them for NCHW → NHWC (a matrix
//! per image: rows = C, cols = H·W) and to reorder the filter bank.
//!
//! Mapping: a block of 32×8 threads moves a 32×32 tile through shared memory
//! (rows padded to 33 floats, so both the column reads and the row writes
//! are free of bank conflicts); each thread copies four elements, reading
//! along `cols` and writing along `rows`, both coalesced. Grid
//! (⌈cols/32⌉, ⌈rows_out/32⌉, batches), 32×33 floats of dynamic shared memory.

use crate::device::{bid_x, bid_y, bid_z, pack_bf16, shared, sync_threads, tid_x, tid_y};

const TILE: u32 = 32;

/// An element type `transpose_any` can store.
trait Store: Copy {
    fn from_f32(v: f32) -> Self;
}
impl Store for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Store for u16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        (pack_bf16(v, 0.0) & 0xffff) as u16
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose(
    src: *const f32,
    dst: *mut f32,
    rows: u32,
    cols: u32,
    rows_out: u32,
) {
    unsafe { transpose_any(src, dst, rows, cols, rows_out) }
}

/// `transpose` storing bf16 (`dst` holds `u16`s).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn transpose_bf16(
    src: *const f32,
    dst: *mut u16,
    rows: u32,
    cols: u32,
    rows_out: u32,
) {
    unsafe { transpose_any(src, dst, rows, cols, rows_out) }
}

#[inline(always)]
unsafe fn transpose_any<T: Store>(
    src: *const f32,
    dst: *mut T,
    rows: u32,
    cols: u32,
    rows_out: u32,
) {
    let buf = shared::<[f32; 33]>();
    let b = bid_z() as usize;
    let src = src.wrapping_add(b * rows as usize * cols as usize);
    let dst = dst.wrapping_add(b * rows_out as usize * cols as usize);
    let (tx, ty) = (tid_x(), tid_y());
    let (c0, r0) = (bid_x() * TILE, bid_y() * TILE);
    for i in 0..4 {
        let (r, c) = (r0 + ty + 8 * i, c0 + tx);
        if r < rows && c < cols {
            let v = unsafe { *src.add(r as usize * cols as usize + c as usize) };
            unsafe { (*buf.add((ty + 8 * i) as usize))[tx as usize] = v };
        }
    }
    sync_threads();
    for i in 0..4 {
        let (c, r) = (c0 + ty + 8 * i, r0 + tx);
        if r < rows_out && c < cols {
            let v = if r < rows {
                unsafe { (*buf.add(tx as usize))[(ty + 8 * i) as usize] }
            } else {
                0.0
            };
            unsafe { *dst.add(c as usize * rows_out as usize + r as usize) = T::from_f32(v) };
        }
    }
}
