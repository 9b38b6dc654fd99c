//! Launchers for `transpose` and `transpose_bf16` (32×32 tiles through
//! shared memory, one 32×8 block per tile, grid z over the batch of
//! matrices).

use super::{CudaBackend, launch};
use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, LaunchConfig};

/// `dst[b][j][i] = src[b][i][j]` for `batches` row-major `rows × cols`
/// matrices at the start of `src` and `dst` (which may be longer), each
/// output row padded with zeros to `rows_out` ≥ `rows` elements; stored as
/// fp32, or as bf16 when `half` (`dst` is then raw storage: two values per
/// float).
pub(super) fn transpose(
    be: &CudaBackend,
    src: &CudaSlice<f32>,
    dst: &mut CudaSlice<f32>,
    [batches, rows, cols]: [usize; 3],
    rows_out: usize,
    half: bool,
) -> Result<()> {
    let (len, out) = (batches * rows * cols, batches * rows_out * cols);
    let out_floats = if half { out.div_ceil(2) } else { out };
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
    let cfg = LaunchConfig {
        grid_dim: (
            cols.div_ceil(32) as u32,
            rows_out.div_ceil(32) as u32,
            batches as u32,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 32 * 33 * 4,
    };
    let (r, c, ro) = (rows as u32, cols as u32, rows_out as u32);
    let name = if half { "transpose_bf16" } else { "transpose" };
    launch!(be, name, cfg, || format!("{batches}x{rows}x{cols} -> {rows_out}"); src, dst, &r, &c, &ro)
}
