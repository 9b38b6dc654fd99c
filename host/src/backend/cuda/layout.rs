//! Launchers for `transpose` / `transpose_tf32` / `transpose_bf16` (32×32
//! tiles through shared memory, one 32×8 block per tile, grid z over the
//! batch of matrices), `row_patches` / `row_patches_tf32` /
//! `row_patches_bf16` (a thread per 16 bytes of output, 1-D grid-stride),
//! `convert_bf16` / `convert_tf32` (a thread per 8 elements, 1-D
//! grid-stride) and `pixel_grid_tf32` (a thread per 16 bytes of output,
//! 1-D grid-stride).

use super::{CudaBackend, Scratch, grid_1d, launch};
use crate::backend::{GridGeom, RowGeom};
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// Mirror of `gpu_kernels::layout::RowGeom` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RowShape {
    batches: u32,
    c: u32,
    h: u32,
    w: u32,
    rows: u32,
    ow: u32,
    kw: u32,
    stride: u32,
    pad: u32,
    rw: u32,
}

unsafe impl DeviceRepr for RowShape {}

/// How a layout kernel stores its output: fp32 as is, fp32 rounded to TF32
/// (the operands of the TF32 vector kernels, which feed them to the tensor
/// cores unconverted), or bf16 (raw storage, two values per float).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Tf32,
    Bf16,
}

impl Elem {
    /// Floats of storage for `len` values.
    pub fn floats(self, len: usize) -> usize {
        if self == Elem::Bf16 {
            len.div_ceil(2)
        } else {
            len
        }
    }
    /// Values per 16-byte vector.
    fn per_vec(self) -> usize {
        if self == Elem::Bf16 { 8 } else { 4 }
    }
}

/// `src` cut into window rows as `g` describes (see [`RowGeom`]), stored as
/// `elem`; `dst` may be longer than needed.
pub(super) fn row_patches(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    g: &RowGeom,
    elem: Elem,
) -> Result<()> {
    let out_floats = elem.floats(g.len());
    let per = elem.per_vec();
    ensure!(
        g.rw >= g.kw * g.c
            && g.rw.is_multiple_of(per)
            && src.len() >= g.src_len()
            && dst.len() >= out_floats,
        "row_patches: {g:?} needs rw ≥ kw·c in whole 16-byte vectors ({per} elements), {} floats in and {out_floats} out, buffers hold {} and {}",
        g.src_len(),
        src.len(),
        dst.len()
    );
    let u = |v: usize| {
        u32::try_from(v).map_err(|_| anyhow::anyhow!("row_patches: {g:?} exceeds 32 bits"))
    };
    let shape = RowShape {
        batches: u(g.batches)?,
        c: u(g.c)?,
        h: u(g.h)?,
        w: u(g.w)?,
        rows: u(g.rows)?,
        ow: u(g.ow)?,
        kw: u(g.kw)?,
        stride: u(g.stride)?,
        pad: u(g.pad)?,
        rw: u(g.rw)?,
    };
    // One thread per 16 bytes of output, 32-bit indices in the kernel.
    let cfg = grid_1d(be, g.len() / per);
    let step = cfg.grid_dim.0 as usize * cfg.block_dim.0 as usize;
    ensure!(
        g.len() + step * per < u32::MAX as usize,
        "row_patches: {g:?} has too many elements for 32-bit indexing"
    );
    let name = match elem {
        Elem::F32 => "row_patches",
        Elem::Tf32 => "row_patches_tf32",
        Elem::Bf16 => "row_patches_bf16",
    };
    launch!(be, name, cfg, || format!("{g:?}"); src, dst, &shape)
}

/// Mirror of `gpu_kernels::layout::GridGeom` (passed by value).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GridShape {
    batches: u32,
    c: u32,
    h: u32,
    w: u32,
    hp: u32,
    wp: u32,
    len: u32,
    copies: u32,
    shift: i32,
}

unsafe impl DeviceRepr for GridShape {}

/// `src` copied channel-major onto the padded pixel grid `g` describes,
/// rounded to TF32 (see [`GridGeom`]); `dst` may be longer than needed.
pub(super) fn pixel_grid_tf32(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    g: &GridGeom,
) -> Result<()> {
    ensure!(
        g.hp >= g.h
            && g.wp >= g.w
            && g.len.is_multiple_of(4)
            && src.len() >= g.src_len()
            && dst.len() >= g.grid_len(),
        "pixel_grid_tf32: {g:?} needs a grid holding the images in rows of whole 16-byte vectors, {} floats in and {} out, buffers hold {} and {}",
        g.src_len(),
        g.grid_len(),
        src.len(),
        dst.len()
    );
    let cfg = grid_1d(be, g.grid_len() / 4);
    let step = cfg.grid_dim.0 as usize * cfg.block_dim.0 as usize;
    let pixels = g.batches * g.hp * g.wp + g.len + g.copies;
    ensure!(
        g.grid_len().max(g.src_len()).max(pixels) + step * 4 < i32::MAX as usize
            && g.shift.unsigned_abs() < i32::MAX as usize / 2,
        "pixel_grid_tf32: {g:?} has too many elements for 32-bit indexing"
    );
    let shape = GridShape {
        batches: g.batches as u32,
        c: g.c as u32,
        h: g.h as u32,
        w: g.w as u32,
        hp: g.hp as u32,
        wp: g.wp as u32,
        len: g.len as u32,
        copies: g.copies as u32,
        shift: g.shift as i32,
    };
    launch!(be, "pixel_grid_tf32", cfg, || format!("{g:?}"); src, dst, &shape)
}

/// Columns of a `transpose` tile: `sums` holds `⌈cols/TRANSPOSE_COLS⌉`
/// partial sums per row.
pub(super) const TRANSPOSE_COLS: usize = 64;

/// `dst[b][j][i] = src[b][i][j]` for `batches` row-major `rows × cols`
/// matrices at the start of `src` and `dst` (which may be longer), each
/// output row padded with zeros to `rows_out` ≥ `rows` elements; stored as
/// `elem`. With `sums`, also each source row's partial sums over tiles of
/// `TRANSPOSE_COLS` columns, `sums[b][i][tile]`.
pub(super) fn transpose(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    [batches, rows, cols]: [usize; 3],
    rows_out: usize,
    elem: Elem,
    sums: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let (len, out) = (batches * rows * cols, batches * rows_out * cols);
    let out_floats = elem.floats(out);
    ensure!(
        rows_out >= rows && src.len() >= len && dst.len() >= out_floats,
        "transpose: {batches}×{rows}×{cols} (rows padded to {rows_out}) needs {len} floats in and {out_floats} out, buffers hold {} and {}",
        src.len(),
        dst.len()
    );
    ensure!(
        batches <= 65_535,
        "transpose: {batches} matrices exceed grid z (65535)"
    );
    let tiles = cols.div_ceil(TRANSPOSE_COLS);
    let cfg = LaunchConfig {
        grid_dim: (tiles as u32, rows_out.div_ceil(32) as u32, batches as u32),
        block_dim: (32, 8, 1),
        shared_mem_bytes: (32 * (TRANSPOSE_COLS + 1) * 4) as u32,
    };
    let (r, c, ro) = (rows as u32, cols as u32, rows_out as u32);
    let name = match elem {
        Elem::F32 => "transpose",
        Elem::Tf32 => "transpose_tf32",
        Elem::Bf16 => "transpose_bf16",
    };
    let what = || format!("{batches}x{rows}x{cols} -> {rows_out}");
    match sums {
        Some(sums) => {
            ensure!(
                sums.len() >= batches * rows * tiles,
                "transpose: {} floats for {batches}×{rows}×{tiles} row sums",
                sums.len()
            );
            launch!(be, name, cfg, what; src, dst, &r, &c, &ro, sums)
        }
        None => launch!(be, name, cfg, what; src, dst, &r, &c, &ro, &0u64),
    }
}

/// `dst` (raw bf16 storage, two values per float) = `src` rounded to bf16.
pub(super) fn convert_bf16(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
) -> Result<()> {
    convert(be, "convert_bf16", src, dst, src.len().div_ceil(2))
}

/// `src` rounded to TF32 into `dst` (fp32 storage, the low 13 bits zero).
pub(super) fn convert_tf32(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
) -> Result<()> {
    convert(be, "convert_tf32", src, dst, src.len())
}

/// Launches conversion kernel `name` (8 values a thread) of `src` into
/// `dst`, which must hold at least `floats`.
fn convert(
    be: &CudaBackend,
    name: &'static str,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    floats: usize,
) -> Result<()> {
    let len = src.len();
    ensure!(
        dst.len() >= floats && len < u32::MAX as usize,
        "{name}: {len} values (at most 2^32) into {} floats, {floats} needed",
        dst.len()
    );
    let n = len as u32;
    launch!(be, name, grid_1d(be, len.div_ceil(8)), || format!("len {len}"); src, dst, &n)
}

/// Runs `f` with a TF32-rounded copy of `src` in scratch `slot`.
pub(super) fn as_tf32<R>(
    be: &CudaBackend,
    slot: Scratch,
    src: &CudaSlice<f32>,
    f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    be.with_scratch(slot, src.len(), |t| {
        convert_tf32(be, src, t)?;
        f(t)
    })
}

/// Runs `f` with a bf16 copy of `src` in scratch `slot`.
pub(super) fn as_bf16<R>(
    be: &CudaBackend,
    slot: Scratch,
    src: &CudaSlice<f32>,
    f: impl FnOnce(&CudaSlice<f32>) -> Result<R>,
) -> Result<R> {
    be.with_scratch(slot, src.len().div_ceil(2), |t| {
        convert_bf16(be, src, t)?;
        f(t)
    })
}
