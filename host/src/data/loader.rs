//! Batches from a [`Dataset`] on worker threads, in an order fixed by
//! `(seed, epoch)`.
//!
//! Order: epoch `e` visits the samples in a permutation drawn from
//! `(seed, e)` (or in index order without shuffling). Global batch `b` is
//! positions `b·B .. b·B + B` of that order; with sharding, rank `r` of
//! `world` takes the `r`-th contiguous slice of it, so the ranks' slices are
//! disjoint and together make up the global batch. The sample at global
//! position `p` is augmented with a generator seeded from `(seed, e, p)`, so
//! its pixels do not depend on the number of workers, on thread timing, on
//! the world size, or on where an epoch was started: [`Loader::epoch_from`]
//! resumes exactly.
//!
//! Threads: batch `first + k` is built by worker `k mod W`, which sends it
//! through its own bounded channel; the consumer reads the workers' channels
//! round-robin, so batches arrive in order while up to `prefetch` of them are
//! built ahead. Dropping the [`Epoch`] stops and joins the workers.
//!
//! Memory: a batch's image buffer ([`Images`]) goes back to its loader
//! when dropped and is reused for a later batch, so the pages of a
//! 77 MB buffer are faulted in once, not once per batch (`host bench
//! --loader` on two cores: 1,800 → 2,500 images/s).
//!
//! Unreadable samples: a training loader replaces a sample whose `get` fails
//! by another one drawn from `(seed, e, p, attempt)`, so the batch keeps its
//! size; an evaluation loader leaves it out (replacing would bias the
//! measurement). Either way [`Batch::skipped`] counts the failures, and each
//! failing index is logged once.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail};
use rand::Rng;
use rand::seq::SliceRandom;

use super::augment::Augment;
use super::{Dataset, mix_seed, rng_for};

const TAG_SHUFFLE: u64 = 0x4c44_5f53_4855_4646;
const TAG_AUGMENT: u64 = 0x4c44_5f41_5547_4d54;
const TAG_REPLACE: u64 = 0x4c44_5f52_4550_4c43;

/// Replacement draws tried for one position before the batch fails.
const MAX_REPLACEMENTS: u64 = 32;

/// How many views each sample contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Views {
    /// One view, from [`Augment::apply`].
    One,
    /// The paper's ten test views ([`Augment::ten_views`]).
    Ten,
}

/// How a [`Loader`] batches, shuffles, shards and augments.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderConfig {
    /// Global batch size (all ranks together).
    pub batch_size: usize,
    /// Worker threads; 0 builds batches on the calling thread.
    pub workers: usize,
    /// Finished batches queued ahead of the consumer (rounded up to a
    /// multiple of `workers`, at least one each). Memory: up to
    /// `prefetch + workers` batches exist at once (queued plus being built),
    /// each `4 · batch · C · h · w` bytes (77 MB for 128 AlexNet crops);
    /// their buffers stay with the loader for reuse while it lives.
    pub prefetch: usize,
    pub seed: u64,
    /// Draw a new permutation every epoch (else index order).
    pub shuffle: bool,
    /// Leave out the last, partial batch.
    pub drop_last: bool,
    /// Replace unreadable samples (training) instead of leaving them out.
    pub replace_skipped: bool,
    /// This process's shard, `0..world`.
    pub rank: usize,
    pub world: usize,
    pub augment: Augment,
    pub views: Views,
}

impl LoaderConfig {
    /// Training: shuffled, last partial batch dropped, unreadable samples
    /// replaced, one augmented view per sample.
    pub fn train(batch_size: usize, augment: Augment, seed: u64) -> Self {
        LoaderConfig {
            batch_size,
            workers: default_workers(),
            prefetch: default_workers(),
            seed,
            shuffle: true,
            drop_last: true,
            replace_skipped: true,
            rank: 0,
            world: 1,
            augment,
            views: Views::One,
        }
    }

    /// Evaluation: index order, every sample once, unreadable ones left out,
    /// the augmentation's randomness removed (centre crop).
    pub fn eval(batch_size: usize, augment: &Augment) -> Self {
        LoaderConfig {
            shuffle: false,
            drop_last: false,
            replace_skipped: false,
            ..LoaderConfig::train(batch_size, augment.without_randomness(), 0)
        }
    }

    /// Evaluation on the paper's ten views per sample.
    pub fn ten_view(batch_size: usize, augment: &Augment) -> Self {
        LoaderConfig {
            views: Views::Ten,
            ..LoaderConfig::eval(batch_size, augment)
        }
    }

    /// This config for shard `rank` of `world`.
    pub fn shard(self, rank: usize, world: usize) -> Self {
        LoaderConfig {
            rank,
            world,
            ..self
        }
    }

    /// This config with `workers` threads, each with one finished batch
    /// queued.
    pub fn with_workers(self, workers: usize) -> Self {
        LoaderConfig {
            workers,
            prefetch: workers,
            ..self
        }
    }
}

fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 16)
}

/// Image buffers of finished batches, kept for reuse (see the module docs):
/// at most `keep`, as many as an epoch's pipeline can have in flight, so
/// the pool holds no more than the pipeline's own peak (for the life of
/// the loader, where it used to be freed with each epoch).
#[derive(Default)]
struct Pool {
    free: Mutex<Vec<Vec<f32>>>,
    keep: usize,
}

impl Pool {
    /// A zeroed buffer of `len` values.
    fn take(&self, len: usize) -> Vec<f32> {
        let reused = self.free.lock().map(|mut f| f.pop()).unwrap_or(None);
        match reused {
            Some(mut v) if v.capacity() >= len => {
                v.clear();
                v.resize(len, 0.0);
                v
            }
            _ => vec![0.0; len],
        }
    }

    fn give(&self, v: Vec<f32>) {
        if let Ok(mut free) = self.free.lock()
            && free.len() < self.keep
            && v.capacity() > 0
        {
            free.push(v);
        }
    }
}

/// A batch's image values: a `Vec<f32>` (through `Deref`) that goes back
/// to its loader's pool when dropped (see the module docs).
#[derive(Clone, Default)]
pub struct Images {
    values: Vec<f32>,
    pool: Option<Arc<Pool>>,
}

impl std::ops::Deref for Images {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.values
    }
}

impl std::ops::DerefMut for Images {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.values
    }
}

impl Drop for Images {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(std::mem::take(&mut self.values));
        }
    }
}

impl PartialEq for Images {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl std::fmt::Debug for Images {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.values.fmt(f)
    }
}

/// One batch of network input, for this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `[n · views, C, h, w]` (NCHW); a sample's views are adjacent.
    pub images: Images,
    /// `[n]`, one per sample.
    pub labels: Vec<i32>,
    /// Samples in this batch (on this rank).
    pub n: usize,
    /// Views per sample (1 or 10).
    pub views: usize,
    /// `[C, h, w]` of one view.
    pub shape: [usize; 3],
    /// Samples whose `get` failed while building this batch.
    pub skipped: usize,
    pub epoch: u64,
    /// Batch index within the epoch.
    pub index: usize,
}

struct Inner {
    dataset: Arc<dyn Dataset>,
    cfg: LoaderConfig,
    in_shape: [usize; 3],
    out_shape: [usize; 3],
    warned: Mutex<HashSet<usize>>,
    pool: Arc<Pool>,
}

/// Yields [`Batch`]es of a dataset; see the module docs.
#[derive(Clone)]
pub struct Loader {
    inner: Arc<Inner>,
}

impl Loader {
    /// Checks `cfg` against `dataset` (batch size, shard, crop, normalisation).
    pub fn new(dataset: Arc<dyn Dataset>, cfg: LoaderConfig) -> Result<Self> {
        let in_shape = dataset.image_shape();
        let out_shape = cfg
            .augment
            .output_shape(in_shape)
            .with_context(|| format!("augmenting {}", dataset.describe()))?;
        if cfg.batch_size == 0 {
            bail!("batch size must be positive");
        }
        if cfg.world == 0 || cfg.rank >= cfg.world {
            bail!("rank {} is not in a world of {}", cfg.rank, cfg.world);
        }
        if !cfg.batch_size.is_multiple_of(cfg.world) {
            bail!(
                "batch size {} is not divisible by the world size {}",
                cfg.batch_size,
                cfg.world
            );
        }
        if dataset.len() > u32::MAX as usize {
            bail!(
                "{} has more samples than the loader indexes",
                dataset.describe()
            );
        }
        // Queued (≤ prefetch + workers − 1), being built (workers), with
        // the consumer (about two).
        let cfg_keep = cfg.prefetch + 2 * cfg.workers + 2;
        let loader = Loader {
            inner: Arc::new(Inner {
                dataset,
                cfg,
                in_shape,
                out_shape,
                warned: Mutex::new(HashSet::new()),
                pool: Arc::new(Pool {
                    free: Mutex::default(),
                    keep: cfg_keep,
                }),
            }),
        };
        if loader.batches_per_epoch() == 0 && loader.inner.cfg.drop_last {
            bail!(
                "{} holds fewer samples than one batch of {} (with drop_last)",
                loader.inner.dataset.describe(),
                loader.inner.cfg.batch_size
            );
        }
        Ok(loader)
    }

    /// Batches in one epoch (the same on every rank).
    pub fn batches_per_epoch(&self) -> usize {
        let (n, b) = (self.inner.dataset.len(), self.inner.cfg.batch_size);
        if self.inner.cfg.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// `[C, h, w]` of one output view.
    pub fn output_shape(&self) -> [usize; 3] {
        self.inner.out_shape
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.inner.cfg
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.inner.dataset
    }

    /// All batches of `epoch`.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        self.epoch_from(epoch, 0)
    }

    /// The batches of `epoch` from index `first_batch` on (exact resume).
    pub fn epoch_from(&self, epoch: u64, first_batch: usize) -> Epoch {
        let order = Arc::new(self.inner.order(epoch));
        let end = self.batches_per_epoch();
        let first = first_batch.min(end);
        let workers = self.inner.cfg.workers;
        let stop = Arc::new(AtomicBool::new(false));
        let mut receivers = Vec::with_capacity(workers);
        let mut handles = Vec::with_capacity(workers);
        if workers > 0 {
            let depth = self.inner.cfg.prefetch.div_ceil(workers).max(1);
            for w in 0..workers {
                let (tx, rx) = sync_channel(depth);
                let (inner, order, flag) = (self.inner.clone(), order.clone(), stop.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("loader-{w}"))
                    .spawn(move || worker(inner, order, epoch, first + w, workers, end, tx, flag));
                match spawned {
                    Ok(handle) => {
                        receivers.push(rx);
                        handles.push(handle);
                    }
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        return Epoch::failed(
                            self.inner.clone(),
                            anyhow!("cannot start loader thread {w}: {e}"),
                            receivers,
                            handles,
                            stop,
                        );
                    }
                }
            }
        }
        Epoch {
            inner: self.inner.clone(),
            order,
            epoch,
            next: first,
            first,
            end,
            receivers,
            handles,
            stop,
            pending_error: None,
        }
    }

    /// Builds batch `index` of `epoch` on the calling thread.
    pub fn batch(&self, epoch: u64, index: usize) -> Result<Batch> {
        if index >= self.batches_per_epoch() {
            bail!(
                "batch {index} is past the end of the epoch ({} batches)",
                self.batches_per_epoch()
            );
        }
        self.inner.build(&self.inner.order(epoch), epoch, index)
    }

    /// Global positions `lo..hi` of batch `index` that this rank takes.
    pub fn shard_range(&self, index: usize) -> (usize, usize) {
        self.inner.shard_range(index)
    }
}

#[allow(clippy::too_many_arguments)]
fn worker(
    inner: Arc<Inner>,
    order: Arc<Vec<u32>>,
    epoch: u64,
    start: usize,
    step: usize,
    end: usize,
    tx: SyncSender<Result<Batch>>,
    stop: Arc<AtomicBool>,
) {
    for index in (start..end).step_by(step) {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let batch = inner.build(&order, epoch, index);
        if tx.send(batch).is_err() {
            return;
        }
    }
}

impl Inner {
    /// The epoch's visiting order of sample indices.
    fn order(&self, epoch: u64) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.dataset.len() as u32).collect();
        if self.cfg.shuffle {
            order.shuffle(&mut rng_for(&[self.cfg.seed, TAG_SHUFFLE, epoch]));
        }
        order
    }

    fn shard_range(&self, index: usize) -> (usize, usize) {
        let b = self.cfg.batch_size;
        let start = index * b;
        let len = b.min(self.dataset.len().saturating_sub(start));
        let (r, w) = (self.cfg.rank, self.cfg.world);
        (start + r * len / w, start + (r + 1) * len / w)
    }

    fn build(&self, order: &[u32], epoch: u64, index: usize) -> Result<Batch> {
        let (lo, hi) = self.shard_range(index);
        let views = match self.cfg.views {
            Views::One => 1,
            Views::Ten => 10,
        };
        let view_len: usize = self.out_shape.iter().product();
        let sample_len = views * view_len;
        let mut images = self.pool.take((hi - lo) * sample_len);
        let mut labels = Vec::with_capacity(hi - lo);
        let mut skipped = 0;
        for (pos, &idx) in (lo..hi).zip(&order[lo..hi]) {
            let Some(sample) = self.fetch(idx as usize, epoch, pos, &mut skipped)? else {
                continue;
            };
            let slot = &mut images[labels.len() * sample_len..(labels.len() + 1) * sample_len];
            let augmented = match self.cfg.views {
                Views::One => {
                    let mut rng = rng_for(&[self.cfg.seed, TAG_AUGMENT, epoch, pos as u64]);
                    self.cfg
                        .augment
                        .apply(&sample, self.in_shape, &mut rng, slot)
                }
                Views::Ten => self
                    .cfg
                    .augment
                    .ten_views_into(&sample, self.in_shape, slot),
            };
            augmented
                .with_context(|| format!("augmenting sample at position {pos} of epoch {epoch}"))?;
            labels.push(sample.label);
        }
        let n = labels.len();
        images.truncate(n * sample_len);
        Ok(Batch {
            images: Images {
                values: images,
                pool: Some(self.pool.clone()),
            },
            labels,
            n,
            views,
            shape: self.out_shape,
            skipped,
            epoch,
            index,
        })
    }

    /// Reads the sample for global position `pos`: `idx` itself, or (when it
    /// fails and replacement is on) a replacement drawn from
    /// `(seed, epoch, pos, attempt)`. `None` means left out.
    fn fetch(
        &self,
        idx: usize,
        epoch: u64,
        pos: usize,
        skipped: &mut usize,
    ) -> Result<Option<super::Sample>> {
        let mut candidate = idx;
        let mut attempt = 0;
        loop {
            match self.dataset.get(candidate) {
                Ok(sample) => return Ok(Some(sample)),
                Err(e) => {
                    *skipped += 1;
                    self.warn_once(candidate, &e);
                    if !self.cfg.replace_skipped {
                        return Ok(None);
                    }
                    attempt += 1;
                    if attempt > MAX_REPLACEMENTS {
                        bail!(
                            "epoch {epoch}, position {pos}: sample {idx} and {MAX_REPLACEMENTS} \
                             replacements all failed to load; last error: {e:#}"
                        );
                    }
                    let draw = mix_seed(&[self.cfg.seed, TAG_REPLACE, epoch, pos as u64, attempt]);
                    candidate = rng_for(&[draw]).random_range(0..self.dataset.len());
                }
            }
        }
    }

    fn warn_once(&self, idx: usize, err: &anyhow::Error) {
        let first = self
            .warned
            .lock()
            .map(|mut seen| seen.insert(idx))
            .unwrap_or(true);
        if first {
            tracing::warn!("skipping unreadable sample {idx}: {err:#}");
        }
    }
}

/// The batches of one epoch, in order; see [`Loader::epoch`].
pub struct Epoch {
    inner: Arc<Inner>,
    order: Arc<Vec<u32>>,
    epoch: u64,
    next: usize,
    first: usize,
    end: usize,
    receivers: Vec<Receiver<Result<Batch>>>,
    handles: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    pending_error: Option<anyhow::Error>,
}

impl Epoch {
    fn failed(
        inner: Arc<Inner>,
        error: anyhow::Error,
        receivers: Vec<Receiver<Result<Batch>>>,
        handles: Vec<JoinHandle<()>>,
        stop: Arc<AtomicBool>,
    ) -> Self {
        Epoch {
            inner,
            order: Arc::new(Vec::new()),
            epoch: 0,
            next: 0,
            first: 0,
            end: 0,
            receivers,
            handles,
            stop,
            pending_error: Some(error),
        }
    }

    /// Index of the batch the next call to `next` yields.
    pub fn next_index(&self) -> usize {
        self.next
    }

    /// Batches left in this epoch.
    pub fn remaining(&self) -> usize {
        self.end - self.next
    }
}

impl Iterator for Epoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if let Some(e) = self.pending_error.take() {
            self.next = self.end;
            return Some(Err(e));
        }
        if self.next >= self.end {
            return None;
        }
        let index = self.next;
        let item = if self.receivers.is_empty() {
            self.inner.build(&self.order, self.epoch, index)
        } else {
            let w = (index - self.first) % self.receivers.len();
            self.receivers[w]
                .recv()
                .unwrap_or_else(|_| Err(anyhow!("loader thread {w} stopped unexpectedly")))
        };
        self.next = if item.is_ok() { index + 1 } else { self.end };
        Some(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.remaining() + usize::from(self.pending_error.is_some());
        (left, Some(left))
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.receivers.clear();
        for handle in self.handles.drain(..) {
            // A panicking worker already reported through a closed channel.
            let _ = handle.join();
        }
    }
}
