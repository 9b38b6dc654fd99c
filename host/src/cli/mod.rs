//! The subcommands behind `host`'s command line; `main.rs` only parses
//! arguments and calls these.
//!
//! Layout: this file holds `devices`, `train` and what the other commands
//! share (running a job on the chosen backend, loading a checkpoint with its
//! config, opening the validation split, building a model from checkpoint
//! weights); `ten_view` is `host test`, `predict` is `host predict`, `tools`
//! holds `host prepare` and `host show-filters`.
//!
//! Commands that run the network are written once, generic over
//! [`Backend`], as a [`BackendJob`]; [`on_backend`] picks the CPU or CUDA
//! backend from `--device` and runs the job on it.

mod predict;
mod ten_view;
mod tools;

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};

pub use predict::{PredictOptions, Prediction, predict, predict_files};
pub use ten_view::{TestOptions, TestResult, TopK, ten_view_test, test};
pub use tools::{prepare, show_filters};

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{self, CudaBackend};
use crate::checkpoint::{self, Checkpoint};
use crate::config::Config;
use crate::data::{
    Dataset, FashionMnist, FolderDataset, Packed, SafetensorsDataset, SourceSpec, Split, Synthetic,
};
use crate::model::Model;
use crate::train::{DeviceChoice, source_spec};

/// `host devices`: the project's deviceQuery.
pub fn devices() -> Result<()> {
    let list = cuda::devices()?;
    let (major, minor) = cuda::driver_version()?;
    println!(
        "CUDA driver {major}.{minor}, {} device(s); kernels built for {}",
        list.len(),
        env!("ALEXNET_CUDA_ARCH")
    );
    for d in list {
        println!(
            "  [{}] {}  sm_{}{}  {:.1} GiB  {} SMs  {} MHz  L2 {} MiB  {} KiB shared/block",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_mem as f64 / (1u64 << 30) as f64,
            d.sm_count,
            d.clock_mhz,
            d.l2_bytes >> 20,
            d.max_shared_per_block >> 10
        );
    }
    Ok(())
}

/// `host train CONFIG`: loads and validates the config, applies the
/// overrides, trains, prints the summary. Ctrl-C stops after the current step
/// with a checkpoint.
pub fn train(config: &std::path::Path, mut opts: crate::train::TrainOptions) -> Result<()> {
    let mut cfg = crate::config::load(config)?;
    crate::train::apply_overrides(&mut cfg, &opts)?;
    let stop = opts.stop.clone();
    let flag = stop.clone();
    if let Err(e) = ctrlc::set_handler(move || {
        if flag.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\ninterrupted: saving a checkpoint after this step (Ctrl-C again to quit at once)"
        );
    }) {
        eprintln!("warning: Ctrl-C handler not installed: {e}");
    }
    opts.stop = stop;
    let outcome = crate::train::train(cfg, &opts)?;
    outcome.summary.print();
    println!(
        "metrics, plots and checkpoints in {}",
        outcome.run_dir.display()
    );
    Ok(())
}

/// Work that runs the network, written once for every backend.
pub trait BackendJob {
    type Output;
    fn run<B: Backend>(self, be: &B) -> Result<Self::Output>;
}

/// Runs `job` on the backend `device` picks: `cuda` (GPU `gpu`), `cpu`, or
/// `auto` (the GPU when one is usable, else the CPU with a note on stderr).
pub fn on_backend<J: BackendJob>(device: DeviceChoice, gpu: usize, job: J) -> Result<J::Output> {
    let use_gpu = device.use_gpu();
    if use_gpu {
        let be = CudaBackend::new(gpu).with_context(|| format!("GPU {gpu}"))?;
        job.run(&be)
    } else {
        job.run(&CpuBackend)
    }
}

/// A checkpoint and the config its network was built from.
pub struct Trained {
    pub checkpoint: Checkpoint,
    pub config: Config,
}

/// Loads the checkpoint at `path` and its config: `config` when given, else
/// the config stored in the checkpoint. The weights are checked against the
/// config's network (names and shapes).
pub fn load_trained(path: &Path, config: Option<&Path>) -> Result<Trained> {
    let checkpoint = checkpoint::load(path)?;
    let config = match config {
        Some(file) => crate::config::load(file)?,
        None => Config::from_str(&checkpoint.meta.config_json, &path.display().to_string())
            .with_context(|| format!("{}: the stored config", path.display()))?,
    };
    checkpoint.validate(path, config.model.param_shapes())?;
    Ok(Trained { checkpoint, config })
}

/// A model for `batch` samples holding the checkpoint's weights.
pub fn model_from<B: Backend>(be: &B, trained: &Trained, batch: usize) -> Result<Model<B>> {
    let cfg = &trained.config;
    let mut model = Model::new(be, &cfg.model, batch, cfg.train.seed)?;
    model.upload_params(be, &trained.checkpoint.tensors, false)?;
    Ok(model)
}

/// Opens only the validation split of the config's data source (the training
/// split of an image folder can hold a million files).
pub fn open_val(cfg: &Config) -> Result<Arc<dyn Dataset>> {
    Ok(match source_spec(cfg) {
        SourceSpec::Synthetic {
            val_size,
            classes,
            shape,
            seed,
            ..
        } => Arc::new(Synthetic::new(val_size, classes, shape, seed, Split::Val)?.cached()),
        SourceSpec::Folder { path } => Arc::new(FolderDataset::open(&path, Split::Val)?),
        SourceSpec::Packed { path } => Arc::new(Packed::open(&path, Split::Val)?),
        SourceSpec::FashionMnist { path } => Arc::new(FashionMnist::open(&path, Split::Val)?),
        SourceSpec::Safetensors { path, val_path } => {
            Arc::new(SafetensorsDataset::open_pair(&path, val_path.as_deref())?.1)
        }
    })
}

/// Checks a dataset's classes and channels against the config's network.
fn check_against_model(ds: &dyn Dataset, cfg: &Config) -> Result<()> {
    if ds.classes() != cfg.model.classes {
        bail!(
            "{}: the dataset ({}) has {} classes but model.classes is {}",
            cfg.origin,
            ds.describe(),
            ds.classes(),
            cfg.model.classes
        );
    }
    if ds.image_shape()[0] != cfg.model.input[0] {
        bail!(
            "{}: the dataset's images have {} channels but model.input.channels is {}",
            cfg.origin,
            ds.image_shape()[0],
            cfg.model.input[0]
        );
    }
    Ok(())
}

/// `host bench CONFIG`: training-step images/s at each batch size; `graph`
/// false (`--no-graph`) times eager steps instead of a replayed CUDA graph.
#[allow(clippy::too_many_arguments)]
pub fn bench(
    config: &std::path::Path,
    batches: &[usize],
    steps: usize,
    profile: bool,
    graph: bool,
    precision: Option<crate::config::Precision>,
    device: crate::train::DeviceChoice,
    gpu: usize,
    json: Option<&std::path::Path>,
) -> Result<()> {
    use crate::backend::cpu::CpuBackend;
    let mut cfg = crate::config::load(config)?;
    if let Some(p) = precision {
        cfg.train.precision = p;
    }
    if batches.contains(&0) || steps == 0 {
        anyhow::bail!("--batch-size and --steps must be ≥ 1");
    }
    let use_gpu = device.use_gpu();
    let mut results = Vec::new();
    for &b in batches {
        let r = if use_gpu {
            let mut be = cuda::CudaBackend::new(gpu)?;
            be.set_precision(cfg.train.precision)?;
            be.set_autotune(cfg.train.autotune);
            crate::bench::bench(&be, &cfg, b, steps, profile, graph)?
        } else {
            crate::bench::bench(&CpuBackend, &cfg, b, steps, profile, graph)?
        };
        r.print();
        results.push(r);
    }
    write_json(json, &results)
}

/// `host bench --loader`: the training data pipeline's images/s.
pub fn bench_loader(
    config: &std::path::Path,
    batches: &[usize],
    steps: usize,
    json: Option<&std::path::Path>,
) -> Result<()> {
    let cfg = crate::config::load(config)?;
    if batches.contains(&0) || steps == 0 {
        anyhow::bail!("--batch-size and --steps must be ≥ 1");
    }
    let mut results = Vec::new();
    for &b in batches {
        let r = crate::bench::bench_loader(&cfg, b, steps)?;
        r.print();
        results.push(r);
    }
    write_json(json, &results)
}

/// Writes `--json` results, if asked for.
fn write_json<T: serde::Serialize>(json: Option<&std::path::Path>, results: &T) -> Result<()> {
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(results)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `--bucket-mb` in bytes.
pub fn bucket_bytes(mib: f64) -> Result<usize> {
    if !(mib.is_finite() && mib >= 0.0) {
        bail!("--bucket-mb: must be a size ≥ 0 in MiB, got {mib}");
    }
    Ok((mib * (1u64 << 20) as f64) as usize)
}

/// `host bench CONFIG --gpus N` / `--devices 0,2`: data-parallel (or,
/// with `--parallel hybrid`, hybrid) images/s, scaling efficiency against
/// one GPU at the same per-GPU batch, and the time spent waiting for
/// communication, at each per-GPU batch size. One GPU runs the plain
/// single-GPU benchmark (a replayed CUDA graph unless `graph` is false);
/// several run eagerly, and so does their one-GPU baseline.
#[allow(clippy::too_many_arguments)]
pub fn bench_gpus(
    config: &Path,
    batches: &[usize],
    steps: usize,
    (precision, parallel): (
        Option<crate::config::Precision>,
        Option<crate::config::Parallel>,
    ),
    (gpus, devices): (Option<usize>, Option<&[usize]>),
    bucket_bytes: usize,
    graph: bool,
    json: Option<&Path>,
) -> Result<()> {
    let mut cfg = crate::config::load(config)?;
    if let Some(p) = precision {
        cfg.train.precision = p;
    }
    if let Some(p) = parallel {
        cfg.train.parallel = p;
    }
    if batches.contains(&0) || steps == 0 {
        bail!("--batch-size and --steps must be ≥ 1");
    }
    let visible = crate::multi_gpu::visible_gpus()?;
    let devices = crate::multi_gpu::select_devices(gpus, devices, 0, visible)?;
    if devices.len() == 1 {
        let mut be = CudaBackend::new(devices[0])?;
        be.set_precision(cfg.train.precision)?;
        be.set_autotune(cfg.train.autotune);
        let mut results = Vec::new();
        for &b in batches {
            let r = crate::bench::bench(&be, &cfg, b, steps, false, graph)?;
            r.print();
            results.push(r);
        }
        write_json(json, &results)
    } else {
        let mut results = Vec::new();
        for &b in batches {
            let r = crate::multi_gpu::bench_data_parallel(&cfg, &devices, b, steps, bucket_bytes)?;
            r.print();
            results.push(r);
        }
        write_json(json, &results)
    }
}
