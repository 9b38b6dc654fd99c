//! The subcommands behind `host`'s command line.

use anyhow::Result;

use crate::backend::cuda;

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

/// `host bench CONFIG`: training-step images/s at each batch size.
#[allow(clippy::too_many_arguments)]
pub fn bench(
    config: &std::path::Path,
    batches: &[usize],
    steps: usize,
    profile: bool,
    precision: Option<crate::config::Precision>,
    device: crate::train::DeviceChoice,
    gpu: usize,
    json: Option<&std::path::Path>,
) -> Result<()> {
    use crate::backend::cpu::CpuBackend;
    use crate::train::DeviceChoice;
    let mut cfg = crate::config::load(config)?;
    if let Some(p) = precision {
        cfg.train.precision = p;
    }
    if batches.contains(&0) || steps == 0 {
        anyhow::bail!("--batch-size and --steps must be ≥ 1");
    }
    let use_gpu = match device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => match cuda::unavailable_reason() {
            None => true,
            Some(why) => {
                eprintln!("no usable GPU ({why}); benchmarking the CPU backend");
                false
            }
        },
    };
    let mut results = Vec::new();
    for &b in batches {
        let r = if use_gpu {
            let mut be = cuda::CudaBackend::new(gpu)?;
            be.set_precision(cfg.train.precision)?;
            crate::bench::bench(&be, &cfg, b, steps, profile)?
        } else {
            crate::bench::bench(&CpuBackend, &cfg, b, steps, profile)?
        };
        r.print();
        results.push(r);
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&results)?;
        std::fs::write(path, text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    Ok(())
}
