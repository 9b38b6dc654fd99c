//! Launcher for `sgd_update_all`: one launch over a list of parameter
//! tensors, described to the kernel by a device table ([`SgdTable`]) of seven
//! 64-bit words per tensor: `w`, `g`, `v` addresses, length, first chunk
//! (chunks of [`CHUNK`] elements numbered across the tensors), and the
//! addresses of the bf16 and the TF32 copy of `w` to refresh (0 for none;
//! an fc layer's kept copy is TF32 in TF32 mode where it holds a float per
//! weight, otherwise bf16). The table is
//! written once per list of tensors and only rewritten if they change; the
//! hyper-parameters come from the backend's per-step values (`graph.rs`).
//! 256 threads a block, each block striding over chunks.

use super::graph::HYPER_OFFSET;
use super::{CudaBackend, DevBuf, check_len, gpu_err, inplace_ptr, launch};
use crate::backend::{SgdParams, SgdRule, SgdTensor};
use anyhow::{Result, anyhow};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

/// Threads per block.
const THREADS: u32 = 256;
/// Elements a block updates per chunk: the kernel's `PER_THREAD` (4) per
/// thread.
const CHUNK: usize = THREADS as usize * 4;

/// `sgd_update_all`'s table for one list of tensors (see the module docs):
/// the image last written and its device copy.
#[derive(Default)]
pub struct SgdTable {
    host: Vec<u64>,
    dev: Option<CudaSlice<u64>>,
    chunks: usize,
}

/// Words per tensor in the table.
const WORDS: usize = 7;

/// The table of tensors `[w, g, v, len, half, tf32]` (addresses, length,
/// the bf16 and TF32 copies' addresses or 0): seven words per tensor, the
/// fifth its first chunk; and the number of chunks in all.
pub(crate) fn table_image(tensors: &[[u64; 6]]) -> (Vec<u64>, usize) {
    let mut words = Vec::with_capacity(tensors.len() * WORDS);
    let mut chunks = 0;
    for t in tensors {
        words.extend_from_slice(&t[..4]);
        words.push(chunks as u64);
        words.extend_from_slice(&t[4..]);
        chunks += (t[3] as usize).div_ceil(CHUNK);
    }
    (words, chunks)
}

pub(super) fn sgd_update_all(
    be: &CudaBackend,
    p: &SgdParams,
    tensors: &mut [SgdTensor<'_, DevBuf>],
    table: &mut SgdTable,
) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let mut entries = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter_mut().enumerate() {
        let n = t.w.len();
        check_len(&format!("sgd_update_all tensor {i} grad"), t.g, n)?;
        check_len(&format!("sgd_update_all tensor {i} momentum"), t.v, n)?;
        let g = t.g.device_ptr(&be.stream).0;
        let tf32_mode = be.precision == crate::config::Precision::Tf32;
        let (half, tf32) = match t.copy.as_mut().map(|h| &mut ***h) {
            Some(h) if tf32_mode && h.len() >= n => (0, inplace_ptr(be, h)),
            Some(h) => {
                check_len(
                    &format!("sgd_update_all tensor {i} bf16 copy"),
                    h,
                    n.div_ceil(2),
                )?;
                (inplace_ptr(be, h), 0)
            }
            None => (0, 0),
        };
        entries.push([
            inplace_ptr(be, t.w),
            g,
            inplace_ptr(be, t.v),
            n as u64,
            half,
            tf32,
        ]);
    }
    let (image, chunks) = table_image(&entries);
    if table.dev.is_none() || table.host != image {
        // A graph may hold the old table's address, and the copy cannot be
        // part of one.
        be.before_replacing("SGD table", image.len() * 8)?;
        match &mut table.dev {
            Some(dev) if dev.len() == image.len() => {
                be.stream.memcpy_htod(&image, dev).map_err(gpu_err)?
            }
            _ => {
                let dev = be
                    .stream
                    .clone_htod(&image)
                    .map_err(|e| be.alloc_error("the SGD table", image.len() * 8, e))?;
                table.dev = Some(dev);
            }
        }
        table.host = image;
        table.chunks = chunks;
    }
    let Some(dev) = &table.dev else {
        return Err(anyhow!("sgd_update_all: the table was not written"));
    };
    if chunks == 0 {
        return Ok(());
    }
    let rule: u32 = match p.rule {
        SgdRule::Pytorch => 0,
        SgdRule::Paper => 1,
    };
    let hyper = be.step_values("the SGD hyper-parameters", |a| {
        a.lr = p.lr;
        a.momentum = p.momentum;
        a.weight_decay = p.weight_decay;
    })? + HYPER_OFFSET;
    let count = tensors.len();
    let cfg = LaunchConfig {
        grid_dim: (chunks.min(be.sm_count as usize * 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(be, "sgd_update_all", cfg, || format!("{count} tensors, {chunks} chunks");
        dev, &count, &chunks, &hyper, &rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's walk (block `b` takes chunks `b, b + grid, …`, finding
    /// each one's tensor by moving forward through the table), run on the
    /// host over a table image: how often each element of each tensor is
    /// visited.
    fn visits(image: &[u64], chunks: usize, grid: usize) -> Vec<Vec<u32>> {
        let tensors = image.len() / WORDS;
        let entry = |t: usize| &image[t * WORDS..(t + 1) * WORDS];
        let mut seen: Vec<Vec<u32>> = (0..tensors)
            .map(|t| vec![0; entry(t)[3] as usize])
            .collect();
        for b in 0..grid {
            let mut t = 0;
            let mut c = b;
            while c < chunks {
                while t + 1 < tensors && entry(t + 1)[4] as usize <= c {
                    t += 1;
                }
                let (n, first) = (entry(t)[3] as usize, entry(t)[4] as usize);
                for x in 0..THREADS as usize {
                    for k in 0..4 {
                        let i = (c - first) * CHUNK + x + k * THREADS as usize;
                        if i < n {
                            seen[t][i] += 1;
                        }
                    }
                }
                c += grid;
            }
        }
        seen
    }

    #[test]
    fn table_covers_every_element_once() {
        // Odd lengths, an empty tensor, one exactly a chunk, one a chunk + 1.
        let lens = [1usize, 0, 1023, 1024, 1025, 5000, 3, 0];
        let tensors: Vec<[u64; 6]> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                [
                    0x1000 * i as u64,
                    0x2000 * i as u64,
                    0x3000 * i as u64,
                    n as u64,
                    0x4000 * (i % 2) as u64,
                    0x5000 * (i % 3) as u64,
                ]
            })
            .collect();
        let (image, chunks) = table_image(&tensors);
        assert_eq!(image.len(), WORDS * lens.len());
        // ⌈len / 1024⌉ each: 1, 0, 1, 1, 2, 5, 1, 0.
        assert_eq!(chunks, 11);
        let firsts: Vec<u64> = image.chunks(WORDS).map(|e| e[4]).collect();
        assert_eq!(firsts, [0, 1, 1, 2, 3, 5, 10, 11]);
        assert_eq!(image[7..11], tensors[1][..4]);
        assert_eq!(image[12..14], tensors[1][4..]);
        for grid in [1, 2, 3, 7, chunks, chunks + 5] {
            for (t, seen) in visits(&image, chunks, grid).iter().enumerate() {
                assert!(
                    seen.iter().all(|&v| v == 1),
                    "grid {grid}: tensor {t} (len {}) not covered exactly once",
                    lens[t]
                );
            }
        }
    }
}
