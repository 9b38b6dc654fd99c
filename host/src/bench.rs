//! `host bench`: training-step throughput on data already on the device
//! (random images and labels uploaded once), so it measures the GPU work of a
//! step — forward, backward and the SGD update — and nothing of the loader.
//! Times are CUDA events (host clock on the CPU backend), median over many
//! steps after warm-up. On the GPU the timed steps replay the step captured
//! as a CUDA graph ([`crate::step_graph`]) unless `--no-graph` or
//! `ALEXNET_CUDA_GRAPH=0`; the result says which. `--profile` adds each
//! layer's forward and backward time, measured layer by layer (eagerly),
//! and, where the backend records launches (CUDA), the time of every kernel
//! launch of whole (eager) training steps, summed by kernel and by layer
//! (see [`KernelProfile`]). `--loader` instead times the config's training
//! data pipeline alone (no model, no GPU), to tell whether it can feed the
//! GPU.

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::backend::{Backend, LaunchTime, SgdParams};
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
    /// The model's arena (activations, gradients, kept buffers: planned at
    /// build, [`crate::arena`]) and what those buffers would take apart.
    pub arena_bytes: usize,
    pub arena_separate_bytes: usize,
    pub layers: Vec<LayerTime>,
    /// `--profile` on a backend that records launches: one step's launches
    /// by kernel and by layer.
    pub kernel_profile: Option<KernelProfile>,
    /// The convolution kernels the autotune chose (`train.autotune`), by
    /// layer: only products that had a choice.
    pub autotuned: Vec<AutotuneRow>,
}

/// One autotuned product of one layer.
#[derive(Clone, Debug, Serialize)]
pub struct AutotuneRow {
    pub layer: String,
    #[serde(flatten)]
    pub tuned: crate::backend::TunedKernel,
}

/// Launches of one training step by kernel and by layer: each figure is
/// the median over the recorded steps (so shares need not add up to
/// exactly 100%). A launch's time runs from the end of the launch before
/// it, so host-side gaps count towards the launch that waited.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KernelProfile {
    /// Recorded steps the medians are taken over.
    pub steps: usize,
    /// Launches in a step.
    pub launches: usize,
    /// Sum of a step's launch times (median over the steps).
    pub step_ms: f32,
    /// Largest total first.
    pub kernels: Vec<KernelRow>,
    /// In step order (forward layers, backward layers, then "sgd").
    pub layers: Vec<LayerRow>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KernelRow {
    pub kernel: String,
    /// Launches per step.
    pub count: usize,
    pub total_ms: f32,
    /// Of `step_ms`.
    pub share: f32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LayerRow {
    /// "conv2 fwd", "conv2 bwd", "sgd".
    pub label: String,
    pub launches: usize,
    pub total_ms: f32,
    pub share: f32,
    /// This layer's kernels, in launch order.
    pub kernels: Vec<KernelRow>,
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Running (count, ms) per key for each recorded step, keys in order of
/// first appearance.
#[derive(Default)]
struct Tally {
    keys: Vec<String>,
    /// `per_step[s][k]`: step s's (launches, ms) of key k.
    per_step: Vec<Vec<(usize, f32)>>,
}

impl Tally {
    fn add(&mut self, step: usize, key: &str, ms: f32) {
        let k = match self.keys.iter().position(|x| x == key) {
            Some(k) => k,
            None => {
                self.keys.push(key.to_string());
                self.keys.len() - 1
            }
        };
        if self.per_step.len() <= step {
            self.per_step.resize(step + 1, Vec::new());
        }
        let row = &mut self.per_step[step];
        if row.len() <= k {
            row.resize(k + 1, (0, 0.0));
        }
        row[k].0 += 1;
        row[k].1 += ms;
    }

    /// Per key: the median count and the median ms over `steps` steps (a
    /// step without the key counts as 0), in first-appearance order.
    fn medians(&self, steps: usize) -> Vec<(&str, usize, f32)> {
        let at = |s: usize, k: usize| {
            self.per_step
                .get(s)
                .and_then(|r| r.get(k))
                .copied()
                .unwrap_or((0, 0.0))
        };
        self.keys
            .iter()
            .enumerate()
            .map(|(k, key)| {
                let mut counts: Vec<usize> = (0..steps).map(|s| at(s, k).0).collect();
                counts.sort_unstable();
                let ms = median((0..steps).map(|s| at(s, k).1).collect());
                (key.as_str(), counts[steps / 2], ms)
            })
            .collect()
    }
}

impl KernelProfile {
    /// Aggregates the launches of several recorded steps (each a whole
    /// step's launches in order). `None` when nothing was recorded.
    pub fn from_steps(steps: &[Vec<LaunchTime>]) -> Option<Self> {
        if steps.is_empty() || steps.iter().all(|s| s.is_empty()) {
            return None;
        }
        let n = steps.len();
        let (mut kernels, mut layers) = (Tally::default(), Tally::default());
        // One tally per label for its kernels, labels in `layers`' order.
        let mut per_layer: Vec<Tally> = Vec::new();
        for (s, launches) in steps.iter().enumerate() {
            for l in launches {
                kernels.add(s, l.kernel, l.ms);
                layers.add(s, &l.label, l.ms);
                let k = layers.keys.iter().position(|x| *x == l.label).unwrap();
                if per_layer.len() <= k {
                    per_layer.resize_with(k + 1, Tally::default);
                }
                per_layer[k].add(s, l.kernel, l.ms);
            }
        }
        let step_ms = median(steps.iter().map(|s| s.iter().map(|l| l.ms).sum()).collect());
        let mut launches: Vec<usize> = steps.iter().map(Vec::len).collect();
        launches.sort_unstable();
        let share = |ms: f32| if step_ms > 0.0 { ms / step_ms } else { 0.0 };
        let rows = |t: &Tally| -> Vec<KernelRow> {
            t.medians(n)
                .into_iter()
                .map(|(k, count, ms)| KernelRow {
                    kernel: k.to_string(),
                    count,
                    total_ms: ms,
                    share: share(ms),
                })
                .collect()
        };
        let mut by_kernel = rows(&kernels);
        by_kernel.sort_by(|a, b| {
            b.total_ms
                .total_cmp(&a.total_ms)
                .then_with(|| a.kernel.cmp(&b.kernel))
        });
        let by_layer = layers
            .medians(n)
            .into_iter()
            .zip(&per_layer)
            .map(|((label, count, ms), t)| LayerRow {
                label: label.to_string(),
                launches: count,
                total_ms: ms,
                share: share(ms),
                kernels: rows(t),
            })
            .collect();
        Some(KernelProfile {
            steps: n,
            launches: launches[n / 2],
            step_ms,
            kernels: by_kernel,
            layers: by_layer,
        })
    }
}

/// One training step as `Model::forward`, `backward` and `sgd_step` run it,
/// layer by layer, labelling each layer's launches for the recorder.
fn labelled_step<B: Backend>(
    be: &B,
    model: &mut Model<B>,
    sgd: &SgdParams,
    dropout: Option<(u64, u64)>,
) -> Result<()> {
    let names: Vec<String> = model.layers.iter().map(|l| l.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        be.set_profile_label(&format!("{name} fwd"));
        model.forward_layer(be, i, dropout)?;
    }
    for (i, name) in names.iter().enumerate().rev() {
        be.set_profile_label(&format!("{name} bwd"));
        model.backward_layer(be, i, dropout)?;
    }
    be.set_profile_label("sgd");
    model.sgd_step(be, sgd)
}

/// Records the launches of `steps` training steps and aggregates them;
/// `None` where the backend records nothing. One more step is recorded
/// first and dropped (it creates the recorder's events).
fn profile_kernels<B: Backend>(
    be: &B,
    model: &mut Model<B>,
    sgd: &SgdParams,
    seed: u64,
    steps: usize,
) -> Result<Option<KernelProfile>> {
    let mut runs = Vec::with_capacity(steps);
    for s in 0..=steps {
        if !be.start_launch_profile()? {
            return Ok(None);
        }
        let step = labelled_step(be, model, sgd, Some((seed, s as u64 + 1)));
        // Stop the recording even when the step failed.
        let launches = be.finish_launch_profile()?;
        step?;
        if s > 0 {
            runs.push(launches);
        }
    }
    Ok(KernelProfile::from_steps(&runs))
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
    let mut kernel_profile = None;
    if profile {
        kernel_profile = profile_kernels(be, &mut model, &sgd, t.seed, steps.clamp(3, 10))?;
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
        arena_bytes: model.arena().total * 4,
        arena_separate_bytes: model.arena().separate * 4,
        layers,
        kernel_profile,
        autotuned: model
            .autotuned()
            .iter()
            .map(|(layer, tuned)| AutotuneRow {
                layer: layer.clone(),
                tuned: tuned.clone(),
            })
            .collect(),
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
        println!(
            "  arena (activations, gradients, kept buffers) {:.1} MiB, {:.1} MiB as separate buffers",
            self.arena_bytes as f64 / (1u64 << 20) as f64,
            self.arena_separate_bytes as f64 / (1u64 << 20) as f64
        );
        for r in &self.autotuned {
            let t = &r.tuned;
            let verdict = if t.kernel == t.heuristic_kernel {
                "the heuristic's choice".to_string()
            } else {
                format!("heuristic {} {:.3} ms", t.heuristic_kernel, t.heuristic_ms)
            };
            println!(
                "  autotune: {} {}: {} {:.3} ms ({verdict}; {} candidates)",
                r.layer, t.product, t.kernel, t.ms, t.candidates
            );
        }
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
        if let Some(k) = &self.kernel_profile {
            k.print();
        }
    }
}

impl KernelProfile {
    pub fn print(&self) {
        println!(
            "  kernels of one whole step ({} launches, {:.3} ms; median of {} recorded steps, each launch timed from the end of the one before):",
            self.launches, self.step_ms, self.steps
        );
        let width = self
            .kernels
            .iter()
            .map(|k| k.kernel.len())
            .max()
            .unwrap_or(6)
            .max(6);
        println!(
            "  {:<width$} {:>6} {:>9} {:>7}",
            "kernel", "count", "ms", "share"
        );
        for k in &self.kernels {
            println!(
                "  {:<width$} {:>6} {:>9.3} {:>6.1}%",
                k.kernel,
                k.count,
                k.total_ms,
                k.share * 100.0
            );
        }
        println!("  by layer:");
        println!(
            "  {:<16} {:>8} {:>9} {:>7}  kernels (ms)",
            "layer", "launches", "ms", "share"
        );
        for l in &self.layers {
            let kernels: Vec<String> = l
                .kernels
                .iter()
                .map(|k| {
                    let times = if k.count > 1 {
                        format!(" ×{}", k.count)
                    } else {
                        String::new()
                    };
                    format!("{}{times} {:.3}", k.kernel, k.total_ms)
                })
                .collect();
            println!(
                "  {:<16} {:>8} {:>9.3} {:>6.1}%  {}",
                l.label,
                l.launches,
                l.total_ms,
                l.share * 100.0,
                kernels.join(", ")
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
    /// All timed batches.
    pub images_per_sec: f32,
    /// The timed batches of the first epoch (a cached synthetic set makes
    /// its images then).
    pub first_epoch_images_per_sec: Option<f32>,
    /// The timed batches of later epochs, if the run reached one.
    pub later_epochs_images_per_sec: Option<f32>,
}

impl LoaderResult {
    pub fn print(&self) {
        let rate = |r: Option<f32>| r.map_or("-".to_string(), |r| format!("{r:.0}"));
        println!(
            "loader: {} batches of {} from {} on {} worker threads: {:.0} images/s \
             (first epoch {}, later epochs {})",
            self.batches,
            self.batch,
            self.dataset,
            self.workers,
            self.images_per_sec,
            rate(self.first_epoch_images_per_sec),
            rate(self.later_epochs_images_per_sec)
        );
    }
}

/// Times `batches` training batches of the config's loader (after one
/// warm-up batch per worker), wall clock, going on into further epochs
/// where one is too short; the first epoch and the later ones are also
/// reported apart.
pub fn bench_loader(cfg: &Config, batch: usize, batches: usize) -> Result<LoaderResult> {
    use crate::data::{Loader, LoaderConfig};
    let (train, _) = crate::train::open_data(cfg)?;
    let lc = LoaderConfig::train(batch, crate::train::train_augment(cfg), cfg.train.seed);
    let workers = lc.workers;
    let loader = Loader::new(train.clone(), lc)?;
    let available = loader.batches_per_epoch();
    if available == 0 {
        anyhow::bail!("the training set holds no full batch of {batch}");
    }
    if batches == 0 {
        anyhow::bail!("--steps must be at least 1 for --loader");
    }
    let warm = workers.min(available - 1);
    let mut epoch_index = 0;
    let mut epoch = loader.epoch(0);
    for _ in 0..warm {
        epoch.next().transpose()?;
    }
    // (images, seconds) of the first epoch's timed batches and the later ones'.
    let mut spans = [(0usize, 0f32); 2];
    let mut last = std::time::Instant::now();
    for _ in 0..batches {
        let b = match epoch.next() {
            Some(b) => b?,
            None => {
                epoch_index += 1;
                epoch = loader.epoch(epoch_index);
                epoch.next().ok_or_else(|| {
                    anyhow::anyhow!("epoch {epoch_index} of the loader is empty")
                })??
            }
        };
        let now = std::time::Instant::now();
        let span = &mut spans[usize::from(epoch_index > 0)];
        span.0 += b.n;
        span.1 += (now - last).as_secs_f32();
        last = now;
    }
    let rate = |(images, secs): (usize, f32)| (images > 0).then(|| images as f32 / secs);
    let (images, secs) = (spans[0].0 + spans[1].0, spans[0].1 + spans[1].1);
    Ok(LoaderResult {
        dataset: train.describe(),
        batch,
        batches,
        workers,
        images_per_sec: images as f32 / secs,
        first_epoch_images_per_sec: rate(spans[0]),
        later_epochs_images_per_sec: rate(spans[1]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(kernel: &'static str, label: &str, ms: f32) -> LaunchTime {
        LaunchTime {
            kernel,
            label: label.into(),
            ms,
        }
    }

    /// Three steps of the same launches with different times: medians per
    /// kernel and per layer, counts, shares, ordering.
    #[test]
    fn kernel_profile_takes_medians_by_kernel_and_layer() {
        let step = |a: f32, b: f32, c: f32| {
            vec![
                launch("transpose", "conv2 fwd", a),
                launch("conv_fwd", "conv2 fwd", 2.0),
                launch("lrn_pool", "norm2 fwd", b),
                launch("transpose", "conv2 bwd", 0.5),
                launch("sgd_update", "sgd", c),
                launch("sgd_update", "sgd", c),
            ]
        };
        let p = KernelProfile::from_steps(&[
            step(1.0, 3.0, 0.1),
            step(0.5, 1.0, 0.3),
            step(2.0, 2.0, 0.2),
        ])
        .unwrap();
        assert_eq!(p.steps, 3);
        assert_eq!(p.launches, 6);
        // Step sums 6.7, 4.6, 6.9: median 6.7.
        assert!((p.step_ms - 6.7).abs() < 1e-5);
        let k: Vec<_> = p
            .kernels
            .iter()
            .map(|k| (k.kernel.as_str(), k.count, k.total_ms))
            .collect();
        // transpose: 1.5, 1.0, 2.5 → 1.5; lrn_pool: 3, 1, 2 → 2; conv 2;
        // sgd: 0.2, 0.6, 0.4 → 0.4. Largest first, ties by name.
        assert_eq!(k[0], ("conv_fwd", 1, 2.0));
        assert_eq!(k[1], ("lrn_pool", 1, 2.0));
        assert_eq!(k[2].0, "transpose");
        assert_eq!(k[2].1, 2);
        assert!((k[2].2 - 1.5).abs() < 1e-6);
        assert_eq!(k[3].0, "sgd_update");
        assert_eq!(k[3].1, 2);
        assert!((k[3].2 - 0.4).abs() < 1e-6);
        assert!((p.kernels[0].share - 2.0 / 6.7).abs() < 1e-6);
        let l: Vec<_> = p
            .layers
            .iter()
            .map(|l| (l.label.as_str(), l.launches))
            .collect();
        assert_eq!(
            l,
            [
                ("conv2 fwd", 2),
                ("norm2 fwd", 1),
                ("conv2 bwd", 1),
                ("sgd", 2)
            ]
        );
        // conv2 fwd: 3.0, 2.5, 4.0 → 3.0; its kernels in launch order.
        assert!((p.layers[0].total_ms - 3.0).abs() < 1e-6);
        let inner: Vec<_> = p.layers[0]
            .kernels
            .iter()
            .map(|k| (k.kernel.as_str(), k.total_ms))
            .collect();
        assert_eq!(inner, [("transpose", 1.0), ("conv_fwd", 2.0)]);
        assert!((p.layers[3].total_ms - 0.4).abs() < 1e-6);
        p.print(); // the table formats every row without panicking
    }

    /// A kernel missing from one step counts as 0 ms there; nothing
    /// recorded gives no profile.
    #[test]
    fn kernel_profile_edge_cases() {
        assert_eq!(KernelProfile::from_steps(&[]), None);
        assert_eq!(KernelProfile::from_steps(&[vec![], vec![]]), None);
        let p = KernelProfile::from_steps(&[
            vec![launch("a", "x", 1.0), launch("b", "x", 1.0)],
            vec![launch("a", "x", 1.0)],
            vec![launch("a", "x", 1.0), launch("b", "y", 3.0)],
        ])
        .unwrap();
        let b = p.kernels.iter().find(|k| k.kernel == "b").unwrap();
        // b: 1.0, 0, 3.0 → median 1.0; count 1, 0, 1 → 1.
        assert_eq!((b.count, b.total_ms), (1, 1.0));
        let y = p.layers.iter().find(|l| l.label == "y").unwrap();
        // y appears in one step of three: median 0.
        assert_eq!((y.launches, y.total_ms), (0, 0.0));
    }
}
