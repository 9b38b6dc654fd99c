//! Launchers for `softmax_xent_forward` and `label_rank` (one 256-thread block
//! per row, 32 floats of shared memory for the reductions) and
//! `softmax_xent_backward` (1-D grid-stride).

use super::{CudaBackend, check_len, grid_1d, launch};
use anyhow::{Result, bail};
use cudarc::driver::{CudaSlice, LaunchConfig};

fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 32 * 4,
    }
}

fn check_labels(labels: &CudaSlice<i32>, n: usize) -> Result<()> {
    if labels.len() != n {
        bail!(
            "labels: buffer holds {} labels, the batch has {n}",
            labels.len()
        );
    }
    Ok(())
}

pub(super) fn softmax_xent_forward(
    be: &CudaBackend,
    n: usize,
    classes: usize,
    logits: &CudaSlice<f32>,
    labels: &CudaSlice<i32>,
    probs: &mut CudaSlice<f32>,
    loss: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("softmax_xent_forward logits", logits, n * classes)?;
    check_len("softmax_xent_forward probs", probs, n * classes)?;
    check_len("softmax_xent_forward loss", loss, n)?;
    check_labels(labels, n)?;
    let c = classes as u32;
    launch!(be, "softmax_xent_forward", rows(n), || format!("n={n} classes={classes}");
        logits, labels, probs, loss, &c)
}

pub(super) fn softmax_xent_backward(
    be: &CudaBackend,
    n: usize,
    classes: usize,
    probs: &CudaSlice<f32>,
    labels: &CudaSlice<i32>,
    dlogits: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("softmax_xent_backward probs", probs, n * classes)?;
    check_len("softmax_xent_backward dlogits", dlogits, n * classes)?;
    check_labels(labels, n)?;
    let (nn, c) = (n as u32, classes as u32);
    launch!(be, "softmax_xent_backward", grid_1d(be, n * classes), || format!("n={n} classes={classes}");
        probs, labels, dlogits, &nn, &c)
}

pub(super) fn label_rank(
    be: &CudaBackend,
    n: usize,
    classes: usize,
    scores: &CudaSlice<f32>,
    labels: &CudaSlice<i32>,
    rank: &mut CudaSlice<f32>,
) -> Result<()> {
    check_len("label_rank scores", scores, n * classes)?;
    check_len("label_rank rank", rank, n)?;
    check_labels(labels, n)?;
    let c = classes as u32;
    launch!(be, "label_rank", rows(n), || format!("n={n} classes={classes}"); scores, labels, rank, &c)
}
