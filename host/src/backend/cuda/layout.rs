//! Launchers for `transpose` and `transpose_bf16` (32×32 tiles through
//! shared memory, one 32×8 block per tile, grid z over the batch of
//! matrices).

use super::{CudaBackend, launch};
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, LaunchConfig};

/// `dst[b][j][i] = src[b][i][j]` for `batches` row-major `rows × cols`
/// matrices at the start of `src` and `dst` (which may be longer).
pub(super) fn transpose(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    batches: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let len = batches * rows * cols;
    ensure!(
        src.len() >= len && dst.len() >= len,
        "transpose: {batches}×{rows}×{cols} needs {len} floats, buffers hold {} and {}",
        src.len(),
        dst.len()
    );
    let (cfg, r, c) = tile_grid(batches, rows, cols)?;
    launch!(be, "transpose", cfg, || format!("{batches}x{rows}x{cols}"); src, dst, &r, &c)
}

/// `transpose` storing bf16: `dst` is raw storage for `batches·rows·cols`
/// bf16 values (half as many floats, rounded up).
pub(super) fn transpose_bf16(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    batches: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let len = batches * rows * cols;
    ensure!(
        src.len() >= len && dst.len() >= len.div_ceil(2),
        "transpose_bf16: {batches}×{rows}×{cols} needs {len} floats in and {} out, buffers hold {} and {}",
        len.div_ceil(2),
        src.len(),
        dst.len()
    );
    let (cfg, r, c) = tile_grid(batches, rows, cols)?;
    launch!(be, "transpose_bf16", cfg, || format!("{batches}x{rows}x{cols}"); src, dst, &r, &c)
}

/// The tile grid of a batched transpose, and rows/cols as kernel arguments.
fn tile_grid(batches: usize, rows: usize, cols: usize) -> Result<(LaunchConfig, u32, u32)> {
    ensure!(
        batches <= 65_535,
        "transpose: {batches} matrices exceed grid z (65535)"
    );
    let cfg = LaunchConfig {
        grid_dim: (
            cols.div_ceil(32) as u32,
            rows.div_ceil(32) as u32,
            batches as u32,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 32 * 33 * 4,
    };
    Ok((cfg, rows as u32, cols as u32))
}
