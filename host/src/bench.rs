//! `host bench`: training-step throughput on data already on the device
//! (random images and labels uploaded once), so it measures the GPU work of a
//! step — forward, backward and the SGD update — and nothing of the loader.
//! Times are CUDA events (host clock on the CPU backend), median over many
//! steps after warm-up. On the GPU the timed steps replay the step captured
//! as a CUDA graph ([`crate::step_graph`]) unless `--no-graph` or
//! `ALEXNET_CUDA_GRAPH=0`; the result says which. `--profile` adds each
//! layer's forward and backward time, measured layer by layer (eagerly).
//! `--loader` instead times the config's training data pipeline alone (no
//! model, no GPU), to tell whether it can feed the GPU.

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::backend::{Backend, SgdParams};
use crate::config::Config;
use crate::model::Model;
use crate::step_graph::StepRunner;

#[derive(Clone, Debug, Serialize)]
pub struct LayerTime {
    pub name: String,
    pub forward_ms: f32,
    pub backward_ms: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub device: String,
    pub batch: usize,
    pub steps: usize,
    pub median_step_ms: f32,
    pub min_step_ms: f32,
    pub images_per_sec: f32,
    /// Whether the timed steps replayed a captured CUDA graph.
    pub cuda_graph: bool,
    /// How the steps ran, e.g. `CUDA graph (1 capture(s), 32 replays, 1
    /// eager step(s))` or `eager (--no-graph)`.
    pub step_mode: String,
    /// Model parameters, activations and gradients (device backends only).
    pub model_memory_bytes: Option<usize>,
    /// Device memory in use after the timed steps, over what was in use
    /// before the model: the model plus the workspaces the step grew (split-K
    /// partial sums, channels-last copies) — the step's peak, since
    /// workspaces are kept.
    pub step_memory_bytes: Option<usize>,
    pub layers: Vec<LayerTime>,
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Benchmarks a training step of `cfg`'s model at `batch`; `graph` false
/// runs the steps eagerly (`--no-graph`).
pub fn bench<B: Backend>(
    be: &B,
    cfg: &Config,
    batch: usize,
    steps: usize,
    profile: bool,
    graph: bool,
) -> Result<BenchResult> {
    let free_before = be.memory_info().map(|m| m.0);
    let mut model = Model::new(be, &cfg.model, batch, cfg.train.seed)?;
    let model_memory_bytes = free_before
        .zip(be.memory_info())
        .map(|(a, (b, _))| a.saturating_sub(b));
    let mut rng = StdRng::seed_from_u64(1);
    let images: Vec<f32> = (0..batch * model.input_len_per_sample())
        .map(|_| rng.random_range(-100.0..100.0))
        .collect();
    let labels: Vec<i32> = (0..batch)
        .map(|_| rng.random_range(0..cfg.model.classes as i32))
        .collect();
    model.set_batch(be, &images, &labels)?;
    let t = &cfg.train;
    let sgd = SgdParams {
        lr: t.lr,
        momentum: t.momentum,
        weight_decay: t.weight_decay,
        rule: t.sgd_rule,
    };
    let mut runner = StepRunner::new(be, graph);
    let mut step = 0u64;
    // Warm-up: with a graph, one eager step and the capture (replayed).
    for _ in 0..3 {
        step += 1;
        runner.step(be, &mut model, (t.seed, step), &sgd)?;
    }
    let before = runner.stats();
    let times = be.time_ms(0, steps, &mut || {
        step += 1;
        runner.step(be, &mut model, (t.seed, step), &sgd)
    })?;
    let cuda_graph = runner.stats().replays - before.replays == steps as u64;
    let step_memory_bytes = free_before
        .zip(be.memory_info())
        .map(|(a, (b, _))| a.saturating_sub(b));
    let min = times.iter().copied().fold(f32::INFINITY, f32::min);
    let med = median(times);
    let mut layers = Vec::new();
    if profile {
        let dropout = Some((t.seed, 1));
        model.forward(be, dropout)?;
        let reps = steps.clamp(3, 20);
        for i in 0..model.layers.len() {
            let f = median(be.time_ms(1, reps, &mut || model.forward_layer(be, i, dropout))?);
            let name = &model.layers[i].name;
            layers.push(LayerTime {
                name: match model.done_by(i) {
                    Some(j) => format!("{name} (in {})", model.layers[j].name),
                    None => name.clone(),
                },
                forward_ms: f,
                backward_ms: 0.0,
            });
        }
        for i in (0..model.layers.len()).rev() {
            layers[i].backward_ms =
                median(be.time_ms(1, reps, &mut || model.backward_layer(be, i, dropout))?);
        }
    }
    Ok(BenchResult {
        device: be.name(),
        batch,
        steps,
        median_step_ms: med,
        min_step_ms: min,
        images_per_sec: batch as f32 / med * 1e3,
        cuda_graph,
        step_mode: runner.describe(),
        model_memory_bytes,
        step_memory_bytes,
        layers,
    })
}

impl BenchResult {
    pub fn print(&self) {
        println!(
            "{}: batch {}  step {:.2} ms (median of {}, min {:.2})  {:.0} images/s  [{}]{}",
            self.device,
            self.batch,
            self.median_step_ms,
            self.steps,
            self.min_step_ms,
            self.images_per_sec,
            if self.cuda_graph {
                "CUDA graph"
            } else {
                "eager"
            },
            self.model_memory_bytes
                .zip(self.step_memory_bytes)
                .map(|(m, s)| format!(
                    "  model memory {:.2} GiB, with workspaces {:.2} GiB",
                    m as f64 / (1u64 << 30) as f64,
                    s as f64 / (1u64 << 30) as f64
                ))
                .unwrap_or_default()
        );
        println!("  steps: {}", self.step_mode);
        if !self.layers.is_empty() {
            let total: f32 = self
                .layers
                .iter()
                .map(|l| l.forward_ms + l.backward_ms)
                .sum();
            println!(
                "  {:<16} {:>10} {:>10} {:>7}",
                "layer", "fwd ms", "bwd ms", "share"
            );
            for l in &self.layers {
                let share = (l.forward_ms + l.backward_ms) / total * 100.0;
                println!(
                    "  {:<16} {:>10.3} {:>10.3} {:>6.1}%",
                    l.name, l.forward_ms, l.backward_ms, share
                );
            }
            println!(
                "  {:<16} {:>21.3} ms (sum of layers; the SGD update is the rest of a step)",
                "total", total
            );
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct LoaderResult {
    pub dataset: String,
    pub batch: usize,
    pub batches: usize,
    pub workers: usize,
    pub images_per_sec: f32,
}

impl LoaderResult {
    pub fn print(&self) {
        println!(
            "loader: {} batches of {} from {} on {} worker threads: {:.0} images/s",
            self.batches, self.batch, self.dataset, self.workers, self.images_per_sec
        );
    }
}

/// Times `batches` training batches of the config's loader (after one
/// warm-up batch per worker), wall clock.
pub fn bench_loader(cfg: &Config, batch: usize, batches: usize) -> Result<LoaderResult> {
    use crate::data::{Loader, LoaderConfig};
    let (train, _) = crate::train::open_data(cfg)?;
    let lc = LoaderConfig::train(batch, crate::train::train_augment(cfg), cfg.train.seed);
    let workers = lc.workers;
    let loader = Loader::new(train.clone(), lc)?;
    let available = loader.batches_per_epoch();
    let warm = workers.min(available.saturating_sub(1));
    let batches = batches.min(available - warm);
    if batches == 0 {
        anyhow::bail!("the dataset holds fewer than two batches of {batch}");
    }
    let mut epoch = loader.epoch(0);
    for _ in 0..warm {
        epoch.next().transpose()?;
    }
    let start = std::time::Instant::now();
    let mut images = 0;
    for _ in 0..batches {
        let b = epoch
            .next()
            .ok_or_else(|| anyhow::anyhow!("the loader ended the epoch early"))??;
        images += b.n;
    }
    let secs = start.elapsed().as_secs_f32();
    Ok(LoaderResult {
        dataset: train.describe(),
        batch,
        batches,
        workers,
        images_per_sec: images as f32 / secs,
    })
}
