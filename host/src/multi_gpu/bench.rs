//! `host bench --gpus N`: data-parallel (or hybrid, `--parallel hybrid`)
//! training-step throughput.
//!
//! Weak scaling: every GPU trains on `batch` samples per step (random data
//! uploaded once, as in [`crate::bench`]), so N GPUs process N·batch images
//! per step. First one GPU runs the plain single-GPU step at that batch (no
//! NCCL), then all N run the data-parallel step; efficiency is the N-GPU
//! images/s over N times the one-GPU images/s. Each rank times its steps with
//! CUDA events; the slowest rank's median counts. The communication wait is
//! the time the compute stream sat idle waiting for the last all-reduce
//! before the SGD update (events around that wait), i.e. the communication
//! that backward did not hide; in the hybrid mode also the waits for the fc
//! layers' collectives, which nothing hides (a step's waits added up).

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use std::sync::Arc;

use super::hybrid::{HybridRank, initial_params};
use super::nccl::{NcclId, NcclReducer, nccl_unavailable_reason};
use super::reducer::Reducer;
use super::{Replica, on_ranks, plan_hybrid};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, SgdParams};
use crate::bench::BenchResult;
use crate::config::{Config, Parallel};

#[derive(Clone, Debug, Serialize)]
pub struct ScalingResult {
    pub devices: Vec<usize>,
    pub parallel: Parallel,
    /// Samples per GPU per step.
    pub batch_per_gpu: usize,
    pub steps: usize,
    /// The plain single-GPU step on the first device at the same batch.
    pub single: BenchResult,
    /// Median step time of the slowest rank.
    pub median_step_ms: f32,
    /// Images per second over all GPUs.
    pub images_per_sec: f32,
    /// `images_per_sec / (N · single.images_per_sec)`.
    pub efficiency: f32,
    /// Median per step of the time the compute stream waited for
    /// communication (the largest over the ranks).
    pub comm_wait_ms: f32,
    /// Parameter names of each gradient bucket, in launch order (the conv
    /// part's in the hybrid mode).
    pub buckets: Vec<Vec<String>>,
}

fn median(mut v: Vec<f32>) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// Measures `cfg`'s training step on one GPU and on `devices` at `batch`
/// samples per GPU, data-parallel or hybrid (`cfg.train.parallel`).
pub fn bench_data_parallel(
    cfg: &Config,
    devices: &[usize],
    batch: usize,
    steps: usize,
    bucket_bytes: usize,
) -> Result<ScalingResult> {
    if let Some(why) = nccl_unavailable_reason() {
        anyhow::bail!("{why}");
    }
    let single = {
        let mut be = CudaBackend::new(devices[0])?;
        be.set_precision(cfg.train.precision)?;
        be.set_autotune(cfg.train.autotune);
        // Eager, like the multi-GPU steps it is compared with.
        crate::bench::bench(&be, cfg, batch, steps, false, false)?
    };
    let world = devices.len();
    let parallel = cfg.train.parallel;
    let init = match parallel {
        Parallel::Data => None,
        Parallel::Hybrid => {
            plan_hybrid(&cfg.model, world)?;
            Some(Arc::new(initial_params(&cfg.model, cfg.train.seed)?))
        }
    };
    let id = NcclId::new()?;
    const WARMUP: usize = 3;
    let (cfg2, devs) = (cfg.clone(), devices.to_vec());
    let per_rank = on_ranks(world, move |rank| {
        let cfg = &cfg2;
        let gpu = devs[rank];
        let mut be = CudaBackend::new(gpu).with_context(|| format!("GPU {gpu}"))?;
        be.set_precision(cfg.train.precision)?;
        be.set_autotune(cfg.train.autotune);
        let reducer = NcclReducer::new(&be, rank, world, id)?;
        let t = &cfg.train;
        let mut rng = StdRng::seed_from_u64(1 + rank as u64);
        let images: Vec<f32> = (0..batch * cfg.model.input_len())
            .map(|_| rng.random_range(-100.0..100.0))
            .collect();
        let labels: Vec<i32> = (0..batch)
            .map(|_| rng.random_range(0..cfg.model.classes as i32))
            .collect();
        let sgd = SgdParams {
            lr: t.lr,
            momentum: t.momentum,
            weight_decay: t.weight_decay,
            rule: t.sgd_rule,
        };
        let mut step = 0u64;
        let (times, waits, buckets) = match &init {
            None => {
                let mut r = Replica::new(&be, &cfg.model, batch, t.seed, reducer, bucket_bytes)?;
                r.set_batch(&be, &images, &labels)?;
                r.reducer_mut().measure_waits(true);
                let times = be.time_ms(WARMUP, steps, &mut || {
                    step += 1;
                    r.train_step(&be, (t.seed, step), &sgd)
                })?;
                (times, r.reducer_mut().take_wait_ms()?, r.bucket_names())
            }
            Some(init) => {
                let global = world * batch;
                let mut h = HybridRank::new(&be, &cfg.model, global, init, reducer, bucket_bytes)?;
                h.set_batch(&be, &images, &labels)?;
                h.reducer_mut().measure_waits(true);
                let times = be.time_ms(WARMUP, steps, &mut || {
                    step += 1;
                    h.train_step(&be, (t.seed, step), &sgd)
                })?;
                (times, h.reducer_mut().take_wait_ms()?, h.bucket_names())
            }
        };
        let waits = waits.get(WARMUP..).unwrap_or_default().to_vec();
        Ok((median(times), median(waits), buckets))
    })?;
    let step_ms = per_rank.iter().map(|r| r.0).fold(0.0, f32::max);
    let wait_ms = per_rank.iter().map(|r| r.1).fold(0.0, f32::max);
    let images_per_sec = (world * batch) as f32 / step_ms * 1e3;
    Ok(ScalingResult {
        devices: devices.to_vec(),
        parallel,
        batch_per_gpu: batch,
        steps,
        efficiency: images_per_sec / (world as f32 * single.images_per_sec),
        single,
        median_step_ms: step_ms,
        images_per_sec,
        comm_wait_ms: wait_ms,
        buckets: per_rank.into_iter().next().map(|r| r.2).unwrap_or_default(),
    })
}

impl ScalingResult {
    pub fn print(&self) {
        let n = self.devices.len();
        println!(
            "1 GPU (cuda:{}): batch {}  step {:.2} ms  {:.0} images/s",
            self.devices[0],
            self.batch_per_gpu,
            self.single.median_step_ms,
            self.single.images_per_sec
        );
        let how = match self.parallel {
            Parallel::Data => "data-parallel",
            Parallel::Hybrid => "hybrid",
        };
        println!(
            "{n} GPUs {how} ({}): batch {} per GPU ({} global)  step {:.2} ms  {:.0} images/s  scaling efficiency {:.1}%  waiting for communication {:.2} ms/step ({:.1}% of the step)",
            self.devices
                .iter()
                .map(|d| format!("cuda:{d}"))
                .collect::<Vec<_>>()
                .join(","),
            self.batch_per_gpu,
            n * self.batch_per_gpu,
            self.median_step_ms,
            self.images_per_sec,
            self.efficiency * 100.0,
            self.comm_wait_ms,
            self.comm_wait_ms / self.median_step_ms * 100.0
        );
        let buckets: Vec<String> = self.buckets.iter().map(|b| b.join("+")).collect();
        println!(
            "  gradient buckets in launch order: {}",
            buckets.join(" | ")
        );
    }
}
