//! The `host` command line. Only argument parsing lives here; the work is in
//! the library (`host::cli` and the modules it calls).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use host::train::DeviceChoice;

#[derive(Parser)]
#[command(
    name = "host",
    version,
    about = "AlexNet training in pure Rust on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a network from a JSON config (built-in synthetic data unless the
    /// config or --data names a dataset).
    Train {
        /// Model/training/data config, e.g. configs/alexnet.json.
        config: PathBuf,
        /// Backend: auto (GPU if usable, else CPU), cpu or cuda.
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceChoice,
        /// GPU ordinal for --device cuda/auto.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// ImageNet-layout folder (train/<class>/*, val/<class>/*) or a folder made by `host prepare`.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Runs are written to OUT/<config name>/.
        #[arg(long, default_value = "runs")]
        out: PathBuf,
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long)]
        batch_size: Option<usize>,
        #[arg(long)]
        epochs: Option<usize>,
        /// Continue exactly from a checkpoint written by `train`.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Start from the weights of a safetensors file (PyTorch names and layouts).
        #[arg(long, conflicts_with = "resume")]
        init: Option<PathBuf>,
        /// Arithmetic of the conv/fc products on the GPU (overrides train.precision).
        #[arg(long, value_enum)]
        precision: Option<host::config::Precision>,
        /// Stop after this many steps (with a checkpoint).
        #[arg(long)]
        max_steps: Option<u64>,
        /// Log the training loss every this many steps.
        #[arg(long, default_value_t = 20)]
        log_every: u64,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Training-step throughput (images/s) on device-resident synthetic data.
    Bench {
        /// Model config, e.g. configs/alexnet.json.
        config: PathBuf,
        /// Batch sizes to measure, e.g. 128,256.
        #[arg(long, value_delimiter = ',', default_values_t = [128usize, 256])]
        batch_size: Vec<usize>,
        /// Timed steps per batch size (after 3 warm-up steps).
        #[arg(long, default_value_t = 30)]
        steps: usize,
        /// Also time each layer's forward and backward pass.
        #[arg(long)]
        profile: bool,
        /// Arithmetic of the conv/fc products (default: the config's train.precision).
        #[arg(long, value_enum)]
        precision: Option<host::config::Precision>,
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceChoice,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// List the visible GPUs (name, compute capability, memory, SMs, driver).
    Devices,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train {
            config,
            device,
            gpu,
            data,
            out,
            seed,
            batch_size,
            epochs,
            resume,
            init,
            precision,
            max_steps,
            log_every,
            quiet,
        } => host::cli::train(
            &config,
            host::train::TrainOptions {
                device,
                gpu,
                out,
                seed,
                batch_size,
                epochs,
                data,
                resume,
                init,
                precision,
                max_steps,
                log_every: log_every.max(1),
                progress: !quiet,
                ..Default::default()
            },
        ),
        Command::Bench {
            config,
            batch_size,
            steps,
            profile,
            precision,
            device,
            gpu,
            json,
        } => host::cli::bench(
            &config,
            &batch_size,
            steps,
            profile,
            precision,
            device,
            gpu,
            json.as_deref(),
        ),
        Command::Devices => host::cli::devices(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
