//! The training loop: config → datasets and loader → model on a backend →
//! steps of forward, backward and SGD → validation, learning-rate schedule,
//! checkpoints, metrics and plots.
//!
//! Determinism: data order and augmentation depend only on (seed, epoch,
//! batch), dropout masks on (seed, step), initial weights on the seed, and
//! every GPU reduction has a fixed order. A checkpoint stores the weights,
//! momentum, step, position in the epoch and schedule state, so an
//! interrupted run resumed from it ends with the same weights as an
//! uninterrupted one on the same device.
//!
//! The host reads results back only at logging intervals and evaluations.
//!
//! Layout: the loop ([`run`]) drives an [`Engine`]: what runs the network on
//! the data. [`Single`] is one model on one backend; the data-parallel
//! engine of [`crate::multi_gpu`] runs replicas on several GPUs behind the
//! same trait, so schedule, logging, checkpoints and evaluation exist once.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{self, CudaBackend};
use crate::backend::{Backend, SgdParams};
use crate::checkpoint::{self, Checkpoint, CheckpointDir, CheckpointMeta, NamedTensor};
use crate::config::{Config, DataSource, LrSchedule};
use crate::data::{self, Dataset, Epoch, Loader, LoaderConfig, Normalize, SourceSpec};
use crate::model::Model;
use crate::report::{self, MetricsLog, MetricsRecord, Split, Summary};
use crate::step_graph::StepRunner;

/// Which backend runs the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if one is usable, else the CPU (with a warning).
    Auto,
    Cpu,
    Cuda,
}

impl DeviceChoice {
    /// Whether to run on the GPU: `Auto` says on stderr why not when no GPU
    /// is usable, then falls back to the CPU backend.
    pub fn use_gpu(self) -> bool {
        match self {
            DeviceChoice::Cpu => false,
            DeviceChoice::Cuda => true,
            DeviceChoice::Auto => match cuda::unavailable_reason() {
                None => true,
                Some(why) => {
                    eprintln!("no usable GPU ({why}); running on the CPU backend, which is slow");
                    false
                }
            },
        }
    }
}

/// Command-line overrides and run controls.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub device: DeviceChoice,
    /// GPU ordinal for the CUDA backend (one GPU).
    pub gpu: usize,
    /// Train data-parallel on this many GPUs (overrides `train.gpus`).
    pub gpus: Option<usize>,
    /// Train on these GPU ordinals (their count is the number of GPUs).
    pub devices: Option<Vec<usize>>,
    /// How several GPUs share the work (overrides `train.parallel`).
    pub parallel: Option<crate::config::Parallel>,
    /// Smallest gradient bucket all-reduced at once on several GPUs, bytes.
    pub bucket_bytes: usize,
    /// Runs go to `<out>/<config name>/`.
    pub out: PathBuf,
    pub seed: Option<u64>,
    pub batch_size: Option<usize>,
    pub epochs: Option<usize>,
    /// An ImageNet-layout folder, or a folder made by `host prepare`.
    pub data: Option<PathBuf>,
    pub resume: Option<PathBuf>,
    pub init: Option<PathBuf>,
    /// Overrides `train.precision`.
    pub precision: Option<crate::config::Precision>,
    /// Stop (with a checkpoint) after this many steps in total.
    pub max_steps: Option<u64>,
    /// Read back and log the training loss every this many steps.
    pub log_every: u64,
    pub progress: bool,
    /// Set (by Ctrl-C) to stop after the current step with a checkpoint.
    pub stop: Arc<AtomicBool>,
    /// Replay the step as a CUDA graph on one GPU (`--no-graph` clears it;
    /// see [`crate::step_graph`]). Several GPUs always run eagerly.
    pub cuda_graph: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            device: DeviceChoice::Auto,
            gpu: 0,
            gpus: None,
            devices: None,
            parallel: None,
            bucket_bytes: crate::multi_gpu::DEFAULT_BUCKET_BYTES,
            out: PathBuf::from("runs"),
            seed: None,
            batch_size: None,
            epochs: None,
            data: None,
            resume: None,
            init: None,
            precision: None,
            max_steps: None,
            log_every: 20,
            progress: true,
            stop: Arc::new(AtomicBool::new(false)),
            cuda_graph: true,
        }
    }
}

/// How a run ended.
#[derive(Debug)]
pub struct TrainOutcome {
    pub summary: Summary,
    pub run_dir: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
    pub steps: u64,
    /// Whether the run stopped early (Ctrl-C or `max_steps`).
    pub interrupted: bool,
}

/// Learning-rate schedule state saved in checkpoints.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct ScheduleState {
    best_top1: Option<f32>,
    evals_without_improvement: usize,
    drops: usize,
}

/// Applies command-line overrides to the config.
pub fn apply_overrides(cfg: &mut Config, opts: &TrainOptions) -> Result<()> {
    if let Some(seed) = opts.seed {
        cfg.train.seed = seed;
    }
    if let Some(b) = opts.batch_size {
        if b == 0 {
            bail!("--batch-size: must be ≥ 1, got 0");
        }
        cfg.train.batch_size = b;
    }
    if let Some(e) = opts.epochs {
        if e == 0 {
            bail!("--epochs: must be ≥ 1, got 0");
        }
        cfg.train.epochs = e;
    }
    if let Some(p) = opts.precision {
        cfg.train.precision = p;
    }
    if let Some(p) = opts.parallel {
        cfg.train.parallel = p;
    }
    if let Some(dir) = &opts.data {
        if !dir.is_dir() {
            bail!("--data {}: not a directory", dir.display());
        }
        cfg.data.source = if dir.join("index.json").is_file() {
            DataSource::Packed { path: dir.clone() }
        } else {
            DataSource::Folder { path: dir.clone() }
        };
    }
    Ok(())
}

/// The dataset description for a config.
pub fn source_spec(cfg: &Config) -> SourceSpec {
    let [c, h, _] = cfg.model.input;
    match &cfg.data.source {
        DataSource::Synthetic {
            train_size,
            val_size,
            classes,
            image_size,
        } => SourceSpec::Synthetic {
            train_size: *train_size,
            val_size: *val_size,
            classes: classes.unwrap_or(cfg.model.classes),
            shape: [c, image_size.unwrap_or(h), image_size.unwrap_or(h)],
            seed: cfg.train.seed,
        },
        DataSource::Folder { path } => SourceSpec::Folder { path: path.clone() },
        DataSource::Packed { path } => SourceSpec::Packed { path: path.clone() },
        DataSource::FashionMnist { path } => SourceSpec::FashionMnist { path: path.clone() },
        DataSource::Safetensors { path } => SourceSpec::Safetensors {
            path: path.clone(),
            val_path: None,
        },
    }
}

/// Training augmentation from the config (pixels in [0, 255] units there).
pub fn train_augment(cfg: &Config) -> data::Augment {
    let a = &cfg.data.augment;
    let crop = a.crop.unwrap_or(cfg.model.input[1]);
    let mut aug = data::Augment::train(crop, normalize(cfg));
    aug.flip = a.flip;
    aug.pca_sigma = a.pca_noise;
    aug.pad = a.pad;
    aug.erase = a.erase;
    aug
}

fn normalize(cfg: &Config) -> Normalize {
    let a = &cfg.data.augment;
    let mean: Vec<f32> = a.mean.iter().flatten().map(|m| m / 255.0).collect();
    match &a.std {
        Some(std) => Normalize {
            mean,
            std: std.iter().map(|s| s / 255.0).collect(),
            scale: 1.0,
        },
        None => Normalize {
            mean,
            std: Vec::new(),
            scale: 255.0,
        },
    }
}

/// Opens the datasets and checks them against the model.
pub fn open_data(cfg: &Config) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let (train, val) = data::open_train_val(&source_spec(cfg))?;
    if train.classes() > cfg.model.classes {
        bail!(
            "{}: the dataset has {} classes but model.classes is only {}",
            cfg.origin,
            train.classes(),
            cfg.model.classes
        );
    }
    if train.image_shape()[0] != cfg.model.input[0] {
        bail!(
            "{}: the dataset's images have {} channels but model.input.channels is {}",
            cfg.origin,
            train.image_shape()[0],
            cfg.model.input[0]
        );
    }
    Ok((train, val))
}

/// Picks the backend (and, with several GPUs, the data-parallel engine) and
/// runs the training.
pub fn train(cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let gpus = opts.gpus.unwrap_or(cfg.train.gpus);
    if gpus == 0 {
        bail!("--gpus: must be ≥ 1, got 0");
    }
    if opts.devices.is_none() && gpus == 1 {
        return train_single(cfg, opts);
    }
    if opts.device == DeviceChoice::Cpu {
        bail!(
            "--gpus/--devices/train.gpus choose GPUs, but --device cpu was given (the CPU backend trains one replica)"
        );
    }
    if let Some(why) = cuda::unavailable_reason() {
        bail!("training on {gpus} GPU(s) needs the CUDA backend: {why}");
    }
    let visible = crate::multi_gpu::visible_gpus()?;
    let count = if opts.devices.is_some() {
        opts.gpus
    } else {
        Some(gpus)
    };
    let devices =
        crate::multi_gpu::select_devices(count, opts.devices.as_deref(), opts.gpu, visible)?;
    if devices.len() > 1 {
        return crate::multi_gpu::train_data_parallel(cfg, opts, &devices);
    }
    let one = TrainOptions {
        device: DeviceChoice::Cuda,
        gpu: devices[0],
        ..opts.clone()
    };
    train_single(cfg, &one)
}

/// One model on one backend (no NCCL involved).
fn train_single(cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let use_gpu = opts.device.use_gpu();
    if use_gpu {
        let mut be = CudaBackend::new(opts.gpu)?;
        be.set_precision(cfg.train.precision)?;
        be.set_autotune(cfg.train.autotune);
        run_single(&be, cfg, opts)
    } else {
        if cfg.train.precision != crate::config::Precision::Fp32 {
            eprintln!(
                "note: the CPU backend computes in fp32 (precision {} applies to the GPU)",
                cfg.train.precision
            );
        }
        run_single(&CpuBackend, cfg, opts)
    }
}

fn run_single<B: Backend>(be: &B, cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let data = RunData::open(&cfg)?;
    let mut engine = Single::new(be, &cfg, &data, opts.cuda_graph)?;
    run(&mut engine, cfg, opts)
}

/// The datasets of a run and how its loaders read them (the global batch;
/// a data-parallel engine shards these configs per rank).
pub struct RunData {
    pub train: Arc<dyn Dataset>,
    pub val: Arc<dyn Dataset>,
    pub train_loader: LoaderConfig,
    pub val_loader: LoaderConfig,
}

impl RunData {
    /// Opens the config's datasets, checks them against the model and says
    /// what is trained on.
    pub fn open(cfg: &Config) -> Result<Self> {
        let (train, val) = open_data(cfg)?;
        if matches!(cfg.data.source, DataSource::Synthetic { .. }) {
            println!(
                "no dataset given: training on the built-in synthetic image set ({})",
                train.describe()
            );
        } else {
            println!("training data: {}", train.describe());
        }
        let t = &cfg.train;
        let aug = train_augment(cfg);
        Ok(Self {
            train,
            val,
            val_loader: LoaderConfig::eval(t.batch_size, &aug),
            train_loader: LoaderConfig::train(t.batch_size, aug, t.seed),
        })
    }
}

/// Sums over the validation set (or one rank's shard of it); shards add up
/// with [`EvalSums::add`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalSums {
    pub loss: f64,
    pub top1: usize,
    pub top5: usize,
    pub count: usize,
}

impl EvalSums {
    pub fn add(&mut self, other: &EvalSums) {
        self.loss += other.loss;
        self.top1 += other.top1;
        self.top5 += other.top5;
        self.count += other.count;
    }

    /// Mean loss, top-1 and top-5 accuracy.
    pub fn means(&self) -> Result<(f32, f32, f32)> {
        if self.count == 0 {
            bail!("the validation set is empty");
        }
        let c = self.count as f64;
        Ok((
            (self.loss / c) as f32,
            (self.top1 as f64 / c) as f32,
            (self.top5 as f64 / c) as f32,
        ))
    }
}

/// Named parameter tensors as `(name, shape, values)`, what checkpoints hold.
pub type Tensors = Vec<NamedTensor>;

/// What the training loop drives: the network's replicas, their parameters
/// and their data. Every call concerns the whole (global) batch.
pub trait Engine {
    /// Where it runs, e.g. `cuda:0 NVIDIA H200`.
    fn describe(&self) -> String;
    /// Trainable values in the model.
    fn param_count(&self) -> usize;
    /// Global batches in one epoch.
    fn batches_per_epoch(&self) -> usize;
    /// Overwrites the parameters (or momentum buffers) by name.
    fn load_params(&mut self, tensors: &[NamedTensor], momentum: bool) -> Result<()>;
    /// The parameters (or momentum buffers), as the checkpoint stores them.
    fn save_params(&mut self, momentum: bool) -> Result<Tensors>;
    /// Positions the data at batch `first_batch` of `epoch`.
    fn start_epoch(&mut self, epoch: u64, first_batch: usize) -> Result<()>;
    /// One training step on the epoch's next batch; returns its sample count.
    fn step(&mut self, dropout: (u64, u64), sgd: &SgdParams) -> Result<usize>;
    /// Per-sample losses and true-class ranks of the last step, in the
    /// global batch's order (waits for the device).
    fn train_metrics(&mut self) -> Result<(Vec<f32>, Vec<f32>)>;
    /// Sums over the whole validation set (centre crops).
    fn evaluate(&mut self) -> Result<EvalSums>;
    /// Waits for all queued work.
    fn synchronize(&mut self) -> Result<()>;
}

/// One model on one backend; its steps replay a CUDA graph where the
/// backend has them ([`StepRunner`]).
pub struct Single<'a, B: Backend> {
    be: &'a B,
    pub model: Model<B>,
    runner: StepRunner<B>,
    loader: Loader,
    val_loader: Loader,
    epoch: Option<Epoch>,
}

impl<'a, B: Backend> Single<'a, B> {
    /// A model for the config's batch, initialised from its seed; `graph`
    /// false runs every step eagerly.
    pub fn new(be: &'a B, cfg: &Config, data: &RunData, graph: bool) -> Result<Self> {
        let loader = Loader::new(data.train.clone(), data.train_loader.clone())?;
        let val_loader = Loader::new(data.val.clone(), data.val_loader.clone())?;
        let batch = cfg.train.batch_size;
        let model = Model::new(be, &cfg.model, batch, cfg.train.seed).map_err(|e| {
            if e.to_string().contains("out of GPU memory") && batch > 1 {
                e.context(format!(
                    "batch {batch} does not fit; try --batch-size {}",
                    batch / 2
                ))
            } else {
                e
            }
        })?;
        for (layer, t) in model.autotuned() {
            if t.kernel != t.heuristic_kernel {
                println!(
                    "autotune: {layer} {}: {} {:.3} ms (heuristic {} {:.3} ms)",
                    t.product, t.kernel, t.ms, t.heuristic_kernel, t.heuristic_ms
                );
            }
        }
        Ok(Self {
            be,
            model,
            runner: StepRunner::new(be, graph),
            loader,
            val_loader,
            epoch: None,
        })
    }
}

/// The next batch of a started epoch.
pub(crate) fn next_batch(epoch: &mut Option<Epoch>) -> Result<data::Batch> {
    epoch
        .as_mut()
        .context("no epoch started")?
        .next()
        .context("the loader ended the epoch early")?
}

impl<B: Backend> Engine for Single<'_, B> {
    fn describe(&self) -> String {
        match self.runner.off_reason() {
            None => format!("{}, step as a CUDA graph", self.be.name()),
            Some(why) if self.be.no_graphs_reason().is_none() => {
                format!("{}, eager steps ({why})", self.be.name())
            }
            Some(_) => self.be.name(),
        }
    }
    fn param_count(&self) -> usize {
        self.model.param_count(self.be)
    }
    fn batches_per_epoch(&self) -> usize {
        self.loader.batches_per_epoch()
    }
    fn load_params(&mut self, tensors: &[NamedTensor], momentum: bool) -> Result<()> {
        self.model.upload_params(self.be, tensors, momentum)
    }
    fn save_params(&mut self, momentum: bool) -> Result<Tensors> {
        self.model.download_params(self.be, momentum)
    }
    fn start_epoch(&mut self, epoch: u64, first_batch: usize) -> Result<()> {
        self.epoch = Some(self.loader.epoch_from(epoch, first_batch));
        Ok(())
    }
    fn step(&mut self, dropout: (u64, u64), sgd: &SgdParams) -> Result<usize> {
        let batch = next_batch(&mut self.epoch)?;
        let (be, model) = (self.be, &mut self.model);
        model.set_batch(be, &batch.images, &batch.labels)?;
        self.runner.step(be, model, dropout, sgd)?;
        Ok(batch.n)
    }
    fn train_metrics(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        self.model.read_metrics(self.be)
    }
    fn evaluate(&mut self) -> Result<EvalSums> {
        eval_sums(self.be, &mut self.model, &self.val_loader)
    }
    fn synchronize(&mut self) -> Result<()> {
        self.be.synchronize()
    }
}

fn lr_at(cfg: &Config, epoch: u64, sched: &ScheduleState) -> f32 {
    match &cfg.train.lr_schedule {
        LrSchedule::Step { epochs, factor } => {
            let drops = epochs.iter().filter(|&&e| e as u64 <= epoch).count();
            cfg.train.lr * factor.powi(drops as i32)
        }
        LrSchedule::Plateau { factor, .. } => cfg.train.lr * factor.powi(sched.drops as i32),
    }
}

/// The training loop over `engine` (see the module docs); `engine` was built
/// for `cfg`.
pub fn run<E: Engine>(engine: &mut E, cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let started = Instant::now();
    let t = &cfg.train;
    let name = Path::new(&cfg.origin)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or("run".into());
    let run_dir = opts.out.join(&name);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let per_epoch = engine.batches_per_epoch();
    if per_epoch == 0 {
        bail!(
            "{}: the training set is smaller than one batch ({})",
            cfg.origin,
            t.batch_size
        );
    }
    println!(
        "{} on {}: {} parameters, batch {}, {} steps per epoch, run dir {}",
        name,
        engine.describe(),
        engine.param_count(),
        t.batch_size,
        per_epoch,
        run_dir.display()
    );
    let ckpt_dir = CheckpointDir::new(run_dir.join("checkpoints"), t.keep_checkpoints)?;
    let mut sched = ScheduleState::default();
    let (mut step, mut epoch, mut first_batch) = (0u64, 0u64, 0usize);
    if let Some(path) = &opts.init {
        let tensors = checkpoint::load_tensors(path)?;
        let c = Checkpoint {
            tensors,
            ..Default::default()
        };
        c.validate(path, cfg.model.param_shapes())?;
        engine
            .load_params(&c.tensors, false)
            .with_context(|| format!("{}", path.display()))?;
        println!("initial weights from {}", path.display());
    }
    if let Some(path) = &opts.resume {
        let c = checkpoint::load(path)?;
        c.validate(path, cfg.model.param_shapes())?;
        engine
            .load_params(&c.tensors, false)
            .with_context(|| format!("{}", path.display()))?;
        if !c.momentum.is_empty() {
            engine
                .load_params(&c.momentum, true)
                .with_context(|| format!("{}", path.display()))?;
        }
        step = c.meta.step;
        epoch = c.meta.epoch;
        first_batch = c.meta.batch_in_epoch as usize;
        sched = serde_json::from_str(&c.meta.rng_state).unwrap_or_default();
        println!(
            "resuming from {} at step {step} (epoch {}, batch {first_batch})",
            path.display(),
            epoch + 1
        );
    }

    let mut log = MetricsLog::open(&run_dir)?;
    let sgd = |lr| SgdParams {
        lr,
        momentum: t.momentum,
        weight_decay: t.weight_decay,
        rule: t.sgd_rule,
    };
    let mut last_ckpt: Option<PathBuf> = None;
    let mut interrupted = false;
    let save = |engine: &mut E,
                step,
                epoch,
                batch_in_epoch: usize,
                lr,
                sched: &ScheduleState|
     -> Result<PathBuf> {
        let tensors = engine.save_params(false)?;
        let momentum = engine.save_params(true)?;
        let meta = CheckpointMeta {
            step,
            epoch,
            batch_in_epoch: batch_in_epoch as u64,
            seed: cfg.train.seed,
            rng_state: serde_json::to_string(sched)?,
            config_json: cfg.to_json(),
            lr,
            best_val_top1: sched.best_top1,
            extra: Default::default(),
        };
        ckpt_dir.save(&Checkpoint {
            tensors,
            momentum,
            meta,
        })
    };

    'epochs: while (epoch as usize) < t.epochs {
        let lr = lr_at(&cfg, epoch, &sched);
        let bar = if opts.progress {
            let b = ProgressBar::new(per_epoch as u64);
            b.set_style(
                ProgressStyle::with_template(
                    "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ETA {eta}",
                )
                .unwrap()
                .progress_chars("=> "),
            );
            b.set_prefix(format!("{}/{}", epoch + 1, t.epochs));
            b.set_position(first_batch as u64);
            b
        } else {
            ProgressBar::hidden()
        };
        let mut window = (Instant::now(), 0usize);
        engine.start_epoch(epoch, first_batch)?;
        for index in first_batch..per_epoch {
            window.1 += engine.step((t.seed, step), &sgd(lr))?;
            step += 1;
            bar.inc(1);
            let done_epoch = index + 1 == per_epoch;
            if step % opts.log_every == 0 || done_epoch {
                let (loss, rank) = engine.train_metrics()?;
                let (l, top1, top5) = summarize(&loss, &rank);
                if !l.is_finite() {
                    bar.abandon();
                    bail!(
                        "the training loss became {l} at step {step} (epoch {}, batch {}); stopped without saving it; last good checkpoint: {}",
                        epoch + 1,
                        index + 1,
                        last_ckpt
                            .as_ref()
                            .map_or("none".into(), |p| p.display().to_string())
                    );
                }
                let ips = window.1 as f32 / window.0.elapsed().as_secs_f32();
                bar.set_message(format!(
                    "loss {l:.4} top1 {:.1}% {ips:.0} img/s",
                    top1 * 100.0
                ));
                log.append(&MetricsRecord {
                    step,
                    epoch: epoch as f64 + (index + 1) as f64 / per_epoch as f64,
                    split: Split::Train,
                    loss: l,
                    top1,
                    top5,
                    lr,
                    images_per_sec: ips,
                    time_s: started.elapsed().as_secs_f64(),
                })?;
                window = (Instant::now(), 0);
            }
            let stop_now =
                opts.stop.load(Ordering::SeqCst) || opts.max_steps.is_some_and(|m| step >= m);
            if stop_now && !done_epoch {
                bar.abandon();
                engine.synchronize()?;
                let path = save(engine, step, epoch, index + 1, lr, &sched)?;
                println!("stopped at step {step}; checkpoint {}", path.display());
                last_ckpt = Some(path);
                interrupted = true;
                break 'epochs;
            }
        }
        bar.finish_and_clear();
        first_batch = 0;
        epoch += 1;
        let last = epoch as usize == t.epochs;
        if (epoch as usize).is_multiple_of(t.eval_every) || last {
            let eval_started = Instant::now();
            let sums = engine.evaluate()?;
            let (l, top1, top5) = sums.means()?;
            let ips = (sums.count as f64 / eval_started.elapsed().as_secs_f64()) as f32;
            println!(
                "epoch {epoch}/{}: val loss {l:.4}  top-1 {:.2}%  top-5 {:.2}%  (lr {lr:.2e})",
                t.epochs,
                top1 * 100.0,
                top5 * 100.0
            );
            log.append(&MetricsRecord {
                step,
                epoch: epoch as f64,
                split: Split::Val,
                loss: l,
                top1,
                top5,
                lr,
                images_per_sec: ips,
                time_s: started.elapsed().as_secs_f64(),
            })?;
            if sched.best_top1.is_none_or(|b| top1 > b) {
                sched.best_top1 = Some(top1);
                sched.evals_without_improvement = 0;
            } else {
                sched.evals_without_improvement += 1;
                if let LrSchedule::Plateau {
                    patience,
                    max_drops,
                    ..
                } = t.lr_schedule
                    && sched.evals_without_improvement >= patience
                    && sched.drops < max_drops
                {
                    sched.drops += 1;
                    sched.evals_without_improvement = 0;
                    println!(
                        "validation top-1 stopped improving: learning rate now {:.2e}",
                        lr_at(&cfg, epoch, &sched)
                    );
                }
            }
            if let Err(e) = report::plot_curves(&run_dir) {
                eprintln!("warning: plots not written: {e:#}");
            }
        }
        let stop_now =
            opts.stop.load(Ordering::SeqCst) || opts.max_steps.is_some_and(|m| step >= m);
        if (epoch as usize).is_multiple_of(t.checkpoint_every) || last || stop_now {
            last_ckpt = Some(save(
                engine,
                step,
                epoch,
                0,
                lr_at(&cfg, epoch, &sched),
                &sched,
            )?);
        }
        if stop_now && !last {
            interrupted = true;
            println!(
                "stopped at step {step}; checkpoint {}",
                last_ckpt.as_ref().unwrap().display()
            );
            break;
        }
    }
    let records = report::resolve_resumed(report::read_metrics(log.path())?);
    let mut summary = Summary::from_metrics(&records);
    summary.wall_time_s = started.elapsed().as_secs_f64();
    summary.checkpoint = last_ckpt.clone();
    Ok(TrainOutcome {
        summary,
        run_dir,
        last_checkpoint: last_ckpt,
        steps: step,
        interrupted,
    })
}

/// Mean loss, top-1 and top-5 accuracy of one batch's per-sample values.
fn summarize(loss: &[f32], rank: &[f32]) -> (f32, f32, f32) {
    let n = loss.len().max(1) as f32;
    let l = loss.iter().map(|&v| v as f64).sum::<f64>() as f32 / n;
    let top = |k: f32| rank.iter().filter(|&&r| r < k).count() as f32 / n;
    (l, top(1.0), top(5.0))
}

/// Loss, top-1, top-5 and images/s over the whole validation set (centre
/// crops).
pub fn evaluate<B: Backend>(
    be: &B,
    model: &mut Model<B>,
    loader: &Loader,
) -> Result<(f32, f32, f32, f32)> {
    let started = Instant::now();
    let sums = eval_sums(be, model, loader)?;
    let (l, top1, top5) = sums.means()?;
    let ips = (sums.count as f64 / started.elapsed().as_secs_f64()) as f32;
    Ok((l, top1, top5, ips))
}

/// Loss and accuracy sums over the batches of `loader` (a rank's shard
/// or the whole set). A partial batch is padded by repeating its first sample
/// and the padding is not counted.
pub fn eval_sums<B: Backend>(be: &B, model: &mut Model<B>, loader: &Loader) -> Result<EvalSums> {
    let mut sums = EvalSums::default();
    let per = model.input_len_per_sample();
    for batch in loader.epoch(0) {
        let mut batch = batch?;
        let n = batch.n;
        if n == 0 {
            continue;
        }
        while batch.labels.len() < model.batch {
            batch.labels.push(batch.labels[0]);
            batch.images.extend_from_within(0..per);
        }
        model.set_batch(be, &batch.images, &batch.labels)?;
        model.forward(be, None)?;
        let (l, r) = model.read_metrics(be)?;
        sums.loss += l[..n].iter().map(|&v| v as f64).sum::<f64>();
        sums.top1 += r[..n].iter().filter(|&&v| v < 1.0).count();
        sums.top5 += r[..n].iter().filter(|&&v| v < 5.0).count();
        sums.count += n;
    }
    Ok(sums)
}
