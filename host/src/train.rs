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
use crate::data::{self, Dataset, Loader, LoaderConfig, Normalize, SourceSpec};
use crate::model::Model;
use crate::report::{self, MetricsLog, MetricsRecord, Split, Summary};

/// Which backend runs the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU if one is usable, else the CPU (with a warning).
    Auto,
    Cpu,
    Cuda,
}

/// Command-line overrides and run controls.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub device: DeviceChoice,
    /// GPU ordinal for the CUDA backend.
    pub gpu: usize,
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
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            device: DeviceChoice::Auto,
            gpu: 0,
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

/// Picks the backend and runs the training.
pub fn train(cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let use_gpu = match opts.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => match cuda::unavailable_reason() {
            None => true,
            Some(why) => {
                eprintln!("no usable GPU ({why}); training on the CPU backend, which is slow");
                false
            }
        },
    };
    if use_gpu {
        let mut be = CudaBackend::new(opts.gpu)?;
        be.set_precision(cfg.train.precision)?;
        run(&be, cfg, opts)
    } else {
        if cfg.train.precision != crate::config::Precision::Fp32 {
            eprintln!(
                "note: the CPU backend computes in fp32 (precision {:?} applies to the GPU)",
                cfg.train.precision
            );
        }
        run(&CpuBackend, cfg, opts)
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

fn run<B: Backend>(be: &B, cfg: Config, opts: &TrainOptions) -> Result<TrainOutcome> {
    let started = Instant::now();
    let t = &cfg.train;
    let name = Path::new(&cfg.origin)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or("run".into());
    let run_dir = opts.out.join(&name);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let (train_ds, val_ds) = open_data(&cfg)?;
    if matches!(cfg.data.source, DataSource::Synthetic { .. }) {
        println!(
            "no dataset given: training on the built-in synthetic image set ({})",
            train_ds.describe()
        );
    } else {
        println!("training data: {}", train_ds.describe());
    }
    let aug = train_augment(&cfg);
    let loader = Loader::new(
        train_ds.clone(),
        LoaderConfig::train(t.batch_size, aug.clone(), t.seed),
    )?;
    let val_loader = Loader::new(val_ds, LoaderConfig::eval(t.batch_size, &aug))?;
    let per_epoch = loader.batches_per_epoch();
    if per_epoch == 0 {
        bail!(
            "{}: the training set ({} images) is smaller than one batch ({})",
            cfg.origin,
            train_ds.len(),
            t.batch_size
        );
    }

    let mut model = Model::new(be, &cfg.model, t.batch_size, t.seed)?;
    println!(
        "{} on {}: {} parameters, batch {}, {} steps per epoch, run dir {}",
        name,
        be.name(),
        model.param_count(be),
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
        model
            .upload_params(be, &as_triples(&c.tensors), false)
            .with_context(|| format!("{}", path.display()))?;
        println!("initial weights from {}", path.display());
    }
    if let Some(path) = &opts.resume {
        let c = checkpoint::load(path)?;
        c.validate(path, cfg.model.param_shapes())?;
        model
            .upload_params(be, &as_triples(&c.tensors), false)
            .with_context(|| format!("{}", path.display()))?;
        if !c.momentum.is_empty() {
            model
                .upload_params(be, &as_triples(&c.momentum), true)
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
    let save = |model: &Model<B>,
                step,
                epoch,
                batch_in_epoch: usize,
                lr,
                sched: &ScheduleState|
     -> Result<PathBuf> {
        let tensors = to_named(model.download_params(be, false)?)?;
        let momentum = to_named(model.download_params(be, true)?)?;
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
        for (i, batch) in loader.epoch_from(epoch, first_batch).enumerate() {
            let index = first_batch + i;
            let batch = batch?;
            model.set_batch(be, &batch.images, &batch.labels)?;
            let dropout = Some((t.seed, step));
            model.forward(be, dropout)?;
            model.backward(be, dropout)?;
            model.sgd_step(be, &sgd(lr))?;
            step += 1;
            window.1 += batch.n;
            bar.inc(1);
            let done_epoch = index + 1 == per_epoch;
            if step % opts.log_every == 0 || done_epoch {
                let (loss, rank) = model.read_metrics(be)?;
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
                be.synchronize()?;
                let path = save(&model, step, epoch, index + 1, lr, &sched)?;
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
        if epoch as usize % t.eval_every == 0 || last {
            let (l, top1, top5, ips) = evaluate(be, &mut model, &val_loader)?;
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
                {
                    if sched.evals_without_improvement >= patience && sched.drops < max_drops {
                        sched.drops += 1;
                        sched.evals_without_improvement = 0;
                        println!(
                            "validation top-1 stopped improving: learning rate now {:.2e}",
                            lr_at(&cfg, epoch, &sched)
                        );
                    }
                }
            }
            if let Err(e) = report::plot_curves(&run_dir) {
                eprintln!("warning: plots not written: {e:#}");
            }
        }
        let stop_now =
            opts.stop.load(Ordering::SeqCst) || opts.max_steps.is_some_and(|m| step >= m);
        if epoch as usize % t.checkpoint_every == 0 || last || stop_now {
            last_ckpt = Some(save(
                &model,
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
/// crops). A last partial batch is padded by repeating its first sample and
/// the padding is not counted.
pub fn evaluate<B: Backend>(
    be: &B,
    model: &mut Model<B>,
    loader: &Loader,
) -> Result<(f32, f32, f32, f32)> {
    let started = Instant::now();
    let (mut loss, mut top1, mut top5, mut count) = (0.0f64, 0usize, 0usize, 0usize);
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
        loss += l[..n].iter().map(|&v| v as f64).sum::<f64>();
        top1 += r[..n].iter().filter(|&&v| v < 1.0).count();
        top5 += r[..n].iter().filter(|&&v| v < 5.0).count();
        count += n;
    }
    if count == 0 {
        bail!("the validation set is empty");
    }
    let c = count as f64;
    Ok((
        (loss / c) as f32,
        (top1 as f64 / c) as f32,
        (top5 as f64 / c) as f32,
        (c / started.elapsed().as_secs_f64()) as f32,
    ))
}

fn to_named(v: Vec<(String, Vec<usize>, Vec<f32>)>) -> Result<Vec<NamedTensor>> {
    v.into_iter()
        .map(|(n, s, d)| NamedTensor::new(n, s, d))
        .collect()
}

fn as_triples(v: &[NamedTensor]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    v.iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.data.clone()))
        .collect()
}
