//! Training on several GPUs of one host, data-parallel or hybrid
//! (`train.parallel`).
//!
//! Data-parallel: each GPU holds a full replica of the network and trains on its
//! contiguous share of the global batch (`batch_size / N` samples, the
//! loader's shard); after the backward pass the gradients are averaged over
//! the replicas, so every replica applies the same SGD update, the one a
//! single GPU would apply to the whole batch (the loss gradient is already
//! divided by the per-rank batch, and the mean of the N per-rank gradients is
//! the gradient of the global mean loss).
//!
//! Hybrid, Krizhevsky's "one weird trick" (2014): the layers before the
//! first fc layer are data-parallel as above (gradients summed rather than
//! averaged, see `hybrid`), the fc layers model-parallel: each GPU holds a
//! slice of every fc layer's output rows ([`split_range`]) and computes it
//! for the whole global batch, with all-gathers of activations forward and
//! sums of input gradients backward. Checkpoints hold the whole tensors
//! (gathered), so either mode, or one GPU, resumes from them.
//!
//! Steps run eagerly here: the CUDA graph of one GPU ([`crate::step_graph`])
//! does not capture the collectives on their second stream.
//!
//! Layout:
//! - this file: the pure planning ([`plan_buckets`], [`split_range`],
//!   [`per_rank_batch`], [`select_devices`]) and [`Replica`], one rank's model
//!   with the backward pass that hands each gradient bucket to the reducer as
//!   soon as its layers are done;
//! - `reducer`: the [`Reducer`] trait (broadcast, means and sums of
//!   gradients, all-gather, reduce-scatter, the labels' gather) and
//!   [`HostReducer`], an in-process implementation for any backend (CPU
//!   tests, and a no-op for one replica);
//! - `nccl`: [`NcclReducer`], NCCL collectives on a second stream per GPU;
//! - `hybrid`: [`plan_hybrid`] (the split) and [`HybridRank`], one rank of
//!   the hybrid mode;
//! - `engine`: [`DataParallel`], one worker thread per rank (either mode) driven by the
//!   training loop of [`crate::train`], the entry points
//!   [`train_data_parallel`] (GPUs, NCCL) and [`train_replicated`] (any
//!   backend and reducer), and [`on_ranks`] (a function on one thread per
//!   rank, for tests and benchmarks);
//! - `bench`: `host bench --gpus N` (images/s, scaling efficiency, time spent
//!   waiting for communication).
//!
//! Why this shape: one thread per GPU, each with its own context and stream
//! (the single-GPU backend unchanged), keeps every GPU's launches flowing
//! without one host thread serialising N devices. Gradients are reduced in
//! buckets of at least [`DEFAULT_BUCKET_BYTES`], launched in backward order,
//! so fc8's and fc7's gradients travel while the conv layers' backward still
//! runs; a bucket is an NCCL group of the layers' own gradient buffers
//! (aggregated by NCCL, no copy into a flat buffer). The mean is NCCL's `ncclAvg`
//! (NCCL ≥ 2.10), so no scale kernel is needed.
//!
//! Dropout: rank 0 draws its masks from the run's seed, rank r > 0 from
//! [`rank_seed`], so replicas do not repeat each other's masks. N replicas
//! therefore match one GPU on the global batch (up to rounding) only without
//! dropout (p = 0); with dropout they are statistically equivalent. The
//! hybrid mode's fc layers draw one GPU's masks for the whole batch, so it
//! matches one GPU with dropout too (AlexNet has no dropout before fc6).
//! One rank of either mode is bit-identical to the single-GPU path.
//!
//! Reproducibility: a replica's work is as deterministic as the single-GPU
//! path, and for a given set of GPUs and NCCL version NCCL picks the same
//! algorithm and reduces in the same order (in practice; NCCL does not
//! promise it), so a resumed run on the same GPUs should end as an
//! uninterrupted one; runs on different numbers of GPUs differ by rounding
//! (and by dropout masks).

mod bench;
mod engine;
mod hybrid;
mod nccl;
mod reducer;

use std::ops::Range;

use anyhow::{Result, bail};

use crate::backend::{Backend, SgdParams};
use crate::config::ModelSpec;
use crate::model::Model;

pub use bench::{ScalingResult, bench_data_parallel};
pub use engine::{DataParallel, on_ranks, train_data_parallel, train_replicated};
pub use hybrid::{HybridPlan, HybridRank, initial_params, plan_hybrid};
pub use nccl::{NcclId, NcclReducer, nccl_unavailable_reason, visible_gpus};
pub use reducer::{HostReducer, Reducer};

/// Smallest gradient bucket: 8 MiB. AlexNet's fc8 (16 MB), fc7 (67 MB) and
/// fc6 (151 MB) each go alone, then conv5 + conv4 (8.9 MB), then conv3 to
/// conv1 (4 MB).
pub const DEFAULT_BUCKET_BYTES: usize = 8 << 20;

/// Groups layers into gradient buckets. `sizes[k]` is the parameter bytes of
/// the `k`-th layer in backward order (0 for a layer without parameters).
///
/// Returns ranges of positions in that order. A bucket starts where the one
/// before it ended and closes at the first layer with parameters at which it
/// holds at least `min_bytes`, or at the last layer with parameters, so every
/// bucket but the last holds `min_bytes` or more and ends at a layer whose
/// backward produces gradients. Layers after the last one with parameters
/// (nothing to reduce) belong to no bucket; no parameters gives no buckets.
pub fn plan_buckets(sizes: &[usize], min_bytes: usize) -> Vec<Range<usize>> {
    let Some(last) = sizes.iter().rposition(|&s| s > 0) else {
        return Vec::new();
    };
    let (mut buckets, mut start, mut held) = (Vec::new(), 0, 0usize);
    for (k, &s) in sizes.iter().enumerate().take(last + 1) {
        held += s;
        if s > 0 && (held >= min_bytes || k == last) {
            buckets.push(start..k + 1);
            start = k + 1;
            held = 0;
        }
    }
    buckets
}

/// Rank `rank`'s contiguous share of `total` items split over `world` ranks:
/// `rank·total/world .. (rank+1)·total/world`, the split the loader applies
/// to each global batch. Shares differ by at most one item and together
/// cover `0..total` in order.
pub fn split_range(total: usize, world: usize, rank: usize) -> Range<usize> {
    assert!(rank < world, "rank {rank} is not in a world of {world}");
    rank * total / world..(rank + 1) * total / world
}

/// Samples each of `world` ranks trains on when the global batch is
/// `global`; an error unless it divides evenly.
pub fn per_rank_batch(global: usize, world: usize) -> Result<usize> {
    if world == 0 {
        bail!("the number of GPUs must be ≥ 1");
    }
    if global == 0 || !global.is_multiple_of(world) {
        bail!(
            "batch size {global} is not divisible by {world} GPUs: the batch is global and each GPU takes batch/GPUs samples"
        );
    }
    Ok(global / world)
}

/// The GPU ordinals to use. `devices` (`--devices 0,2`) when given, checked
/// against `gpus` if that is given too; else `0..gpus` (`--gpus N`), where
/// one GPU means `default_gpu` (`--gpu`); else `default_gpu`. Every ordinal
/// must be below `visible` and appear once.
pub fn select_devices(
    gpus: Option<usize>,
    devices: Option<&[usize]>,
    default_gpu: usize,
    visible: usize,
) -> Result<Vec<usize>> {
    let chosen: Vec<usize> = match (gpus, devices) {
        (Some(0), _) => bail!("--gpus: must be ≥ 1, got 0"),
        (_, Some([])) => bail!("--devices: no GPU ordinal given"),
        (Some(n), Some(d)) if n != d.len() => bail!(
            "--gpus {n} disagrees with --devices {}, which names {} GPU(s)",
            list(d),
            d.len()
        ),
        (_, Some(d)) => d.to_vec(),
        (Some(n), None) if n > visible => bail!(
            "{n} GPUs requested but only {visible} CUDA device(s) are visible (check CUDA_VISIBLE_DEVICES)"
        ),
        (Some(1) | None, None) => vec![default_gpu],
        (Some(n), None) => (0..n).collect(),
    };
    for (i, &d) in chosen.iter().enumerate() {
        if d >= visible {
            bail!(
                "GPU {d} requested but only {visible} CUDA device(s) are visible (ordinals 0..{visible})"
            );
        }
        if chosen[..i].contains(&d) {
            bail!("--devices {}: GPU {d} is listed twice", list(&chosen));
        }
    }
    Ok(chosen)
}

fn list(d: &[usize]) -> String {
    d.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The dropout seed of rank `rank`: the run's seed on rank 0 (so one replica
/// is the single-GPU run), `seed ⊕ rank·φ` (φ = 2⁶⁴/golden ratio, odd) on
/// the others. Its low 48 bits differ from the seed's, so it never collides
/// with the per-layer variation the model applies to the top 16 bits.
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// One bucket of a replica: reduce `params` after the backward of layer
/// `after_layer`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Bucket {
    after_layer: usize,
    params: Range<usize>,
}

/// Runs `model`'s backward pass layer by layer and hands each bucket's
/// gradients to `start` as soon as its last layer is done (backward order),
/// so their reduction overlaps the rest of the pass.
fn backward_in_buckets<B: Backend>(
    be: &B,
    model: &mut Model<B>,
    buckets: &[Bucket],
    dropout: Option<(u64, u64)>,
    mut start: impl FnMut(&mut [&mut B::Buf]) -> Result<()>,
) -> Result<()> {
    let mut next = 0;
    for i in (0..model.layers.len()).rev() {
        model.backward_layer(be, i, dropout)?;
        while let Some(b) = buckets.get(next).filter(|b| b.after_layer == i) {
            let mut grads: Vec<&mut B::Buf> = model.params[b.params.clone()]
                .iter_mut()
                .map(|p| &mut p.grad)
                .collect();
            start(&mut grads)?;
            next += 1;
        }
    }
    Ok(())
}

/// The gradient buckets of `model`'s layers, at least `bucket_bytes` each
/// ([`plan_buckets`] over the layers in backward order).
fn plan_model_buckets<B: Backend>(be: &B, model: &Model<B>, bucket_bytes: usize) -> Vec<Bucket> {
    let layers = model.layers.len();
    let sizes: Vec<usize> = (0..layers)
        .rev()
        .map(|i| {
            model.params[model.param_range(i)]
                .iter()
                .map(|p| be.len(&p.value) * 4)
                .sum()
        })
        .collect();
    plan_buckets(&sizes, bucket_bytes)
        .into_iter()
        .map(|positions| {
            // Positions a..b in backward order are layers L-b ..= L-1-a.
            let first = layers - positions.end;
            let last = layers - 1 - positions.start;
            let ranges: Vec<Range<usize>> = (first..=last)
                .map(|i| model.param_range(i))
                .filter(|r| !r.is_empty())
                .collect();
            Bucket {
                after_layer: first,
                params: ranges[0].start..ranges[ranges.len() - 1].end,
            }
        })
        .collect()
}

/// The parameter names of each bucket (in the model's order).
fn bucket_names<B: Backend>(model: &Model<B>, buckets: &[Bucket]) -> Vec<Vec<String>> {
    buckets
        .iter()
        .map(|b| {
            model.params[b.params.clone()]
                .iter()
                .map(|p| p.name.clone())
                .collect()
        })
        .collect()
}

/// One rank's model and its side of the communication.
pub struct Replica<B: Backend, R: Reducer<B>> {
    pub model: Model<B>,
    reducer: R,
    buckets: Vec<Bucket>,
}

impl<B: Backend, R: Reducer<B>> Replica<B, R> {
    /// The rank's model for `batch` samples (its share of the global batch),
    /// initialised from `seed` and then overwritten with rank 0's parameters
    /// (a collective: every rank calls it). Gradient buckets hold at least
    /// `bucket_bytes`.
    pub fn new(
        be: &B,
        spec: &ModelSpec,
        batch: usize,
        seed: u64,
        reducer: R,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let model = Model::new(be, spec, batch, seed)?;
        let buckets = plan_model_buckets(be, &model, bucket_bytes);
        let mut replica = Self {
            model,
            reducer,
            buckets,
        };
        replica.sync_params(be)?;
        Ok(replica)
    }

    pub fn rank(&self) -> usize {
        self.reducer.rank()
    }

    pub fn world(&self) -> usize {
        self.reducer.world()
    }

    pub fn reducer_mut(&mut self) -> &mut R {
        &mut self.reducer
    }

    /// The gradient buckets in launch order: the parameter names of each
    /// (in the model's order).
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        bucket_names(&self.model, &self.buckets)
    }

    /// Overwrites every rank's parameters and momentum with rank 0's
    /// (collective).
    pub fn sync_params(&mut self, be: &B) -> Result<()> {
        self.model.weights_changed();
        let mut bufs: Vec<&mut B::Buf> = self
            .model
            .params
            .iter_mut()
            .flat_map(|p| [&mut p.value, &mut p.momentum])
            .collect();
        self.reducer.broadcast(be, &mut bufs)
    }

    /// Copies this rank's share of the batch to the device.
    pub fn set_batch(&mut self, be: &B, images: &[f32], labels: &[i32]) -> Result<()> {
        self.model.set_batch(be, images, labels)
    }

    /// Forward and backward on the rank's batch, each bucket's gradients
    /// handed to the reducer as soon as its layers' backward is queued; on
    /// return the backend's later work waits for the mean gradients.
    /// `dropout` is the run's `(seed, step)`; the rank's seed is derived with
    /// [`rank_seed`]. Collective.
    pub fn compute_gradients(&mut self, be: &B, dropout: (u64, u64)) -> Result<()> {
        let dropout = Some((rank_seed(dropout.0, self.rank()), dropout.1));
        self.model.forward(be, dropout)?;
        backward_in_buckets(be, &mut self.model, &self.buckets, dropout, |grads| {
            self.reducer.start_mean(be, grads)
        })?;
        self.reducer.finish(be)
    }

    /// One training step: [`Replica::compute_gradients`], then the SGD
    /// update, identical on every rank. Collective.
    pub fn train_step(&mut self, be: &B, dropout: (u64, u64), sgd: &SgdParams) -> Result<()> {
        self.compute_gradients(be, dropout)?;
        self.model.sgd_step(be, sgd)
    }
}

#[cfg(test)]
mod tests;
