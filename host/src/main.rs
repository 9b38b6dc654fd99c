//! The `host` command line. Only argument parsing lives here; the work is in
//! the library (`host::cli` and the modules it calls).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
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
        /// Train data-parallel on GPUs 0..N (overrides train.gpus). The batch
        /// size stays global: each GPU takes batch/N samples of every batch.
        #[arg(long)]
        gpus: Option<usize>,
        /// Train on these GPUs, e.g. 0,2 (data-parallel when more than one).
        #[arg(long, value_delimiter = ',', conflicts_with = "gpu")]
        devices: Option<Vec<usize>>,
        /// How several GPUs share the work: data (whole network on each) or
        /// hybrid (conv layers data-parallel, fc layers split over the GPUs).
        /// Overrides train.parallel.
        #[arg(long, value_enum)]
        parallel: Option<host::config::Parallel>,
        /// Smallest gradient bucket all-reduced at once on several GPUs, MiB.
        #[arg(long, default_value_t = 8.0)]
        bucket_mb: f64,
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
        /// Run every step eagerly instead of replaying it as a CUDA graph
        /// (one GPU; also ALEXNET_CUDA_GRAPH=0). Several GPUs always run
        /// eagerly.
        #[arg(long)]
        no_graph: bool,
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
        /// Time the config's training data pipeline alone (no model, no
        /// GPU): --steps batches of each --batch-size, into later epochs
        /// where one is shorter (reported apart from the first).
        #[arg(long, conflicts_with_all = ["profile", "gpus", "devices"])]
        loader: bool,
        /// Arithmetic of the conv/fc products (default: the config's train.precision).
        #[arg(long, value_enum)]
        precision: Option<host::config::Precision>,
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceChoice,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Data-parallel scaling on GPUs 0..N: --batch-size is then per GPU,
        /// and one GPU runs the same per-GPU batch for the efficiency.
        #[arg(long)]
        gpus: Option<usize>,
        /// Data-parallel scaling on these GPUs, e.g. 0,2.
        #[arg(long, value_delimiter = ',', conflicts_with = "gpu")]
        devices: Option<Vec<usize>>,
        /// With --gpus/--devices: data or hybrid (conv layers data-parallel,
        /// fc layers split over the GPUs). Default: the config's
        /// train.parallel.
        #[arg(long, value_enum)]
        parallel: Option<host::config::Parallel>,
        /// Smallest gradient bucket all-reduced at once, MiB.
        #[arg(long, default_value_t = 8.0)]
        bucket_mb: f64,
        /// Time eager steps instead of the step replayed as a CUDA graph
        /// (also ALEXNET_CUDA_GRAPH=0), to compare the two. Several GPUs
        /// always run eagerly.
        #[arg(long)]
        no_graph: bool,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run the paper's 10-view test of a checkpoint on validation data.
    ///
    /// Each validation image gives its four corner and centre crops and their
    /// mirror images; the network's softmax outputs are averaged over the ten
    /// views, then ranked for top-1/top-5 accuracy and error. The single
    /// centre crop's numbers (what training reports) are printed for
    /// comparison. Unreadable images are left out and counted.
    Test(TestArgs),
    /// Print a checkpoint's top classes for image files.
    ///
    /// Each JPEG or PNG file is read as validation images are (shorter side
    /// resized to the dataset's image side, centre square, centre crop,
    /// normalisation); its top classes are printed with their names (from
    /// the config's dataset, else `class <i>`) and probabilities.
    Predict(PredictArgs),
    /// Pack an image folder into a fast-loading dataset.
    ///
    /// Decodes SRC/train/<class>/* and SRC/val/<class>/* (JPEG or PNG) once,
    /// resized to --side, into DST, which `train --data DST` and
    /// `test --data DST` then read without decoding. Files that cannot be
    /// decoded are skipped and listed in DST/index.json.
    Prepare(PrepareArgs),
    /// Draw a conv layer's filters as a PNG grid.
    ///
    /// Like Figure 3 of the AlexNet paper: each filter is stretched to the
    /// full colour range by its own min and max, and the grid is upscaled
    /// --scale times. The layer's input must have 1 or 3 channels (conv1).
    ShowFilters(ShowFiltersArgs),
    /// List the visible GPUs (name, compute capability, memory, SMs, driver).
    Devices,
}

#[derive(Args)]
struct TestArgs {
    /// Checkpoint written by `train` (.safetensors).
    checkpoint: PathBuf,
    /// Validation data: an ImageNet-layout folder or a folder made by
    /// `host prepare` (default: the config's data source).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Config to build the network from (default: the one stored in the
    /// checkpoint).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Backend: auto (GPU if usable, else CPU), cpu or cuda.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// GPU ordinal for --device cuda/auto.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Images per forward pass (the network runs ten times as many views).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args)]
struct PredictArgs {
    /// Checkpoint written by `train` (.safetensors).
    checkpoint: PathBuf,
    /// Image files (JPEG or PNG).
    #[arg(required = true)]
    images: Vec<PathBuf>,
    /// Config to build the network from (default: the one stored in the
    /// checkpoint); its data source supplies the class names.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Classes shown per image.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Backend: auto (GPU if usable, else CPU), cpu or cuda.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    /// GPU ordinal for --device cuda/auto.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
}

#[derive(Args)]
struct PrepareArgs {
    /// Image folder in ImageNet's layout.
    src: PathBuf,
    /// Output folder (created if needed).
    dst: PathBuf,
    /// Side of the stored square images (shorter side resized, centre kept).
    #[arg(long, default_value_t = host::data::IMAGE_SIDE)]
    side: usize,
}

#[derive(Args)]
struct ShowFiltersArgs {
    /// Checkpoint (or any safetensors file with PyTorch-layout weights).
    checkpoint: PathBuf,
    /// PNG file to write.
    #[arg(long)]
    out: PathBuf,
    /// Layer whose `<layer>.weight` [out, in, kh, kw] is drawn (in = 1 or 3).
    #[arg(long, default_value = "conv1")]
    layer: String,
    /// Pixels per filter weight.
    #[arg(long, default_value_t = 4)]
    scale: u32,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train {
            config,
            device,
            gpu,
            gpus,
            devices,
            parallel,
            bucket_mb,
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
            no_graph,
        } => host::cli::bucket_bytes(bucket_mb).and_then(|bucket_bytes| {
            host::cli::train(
                &config,
                host::train::TrainOptions {
                    device,
                    gpu,
                    gpus,
                    devices,
                    parallel,
                    bucket_bytes,
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
                    cuda_graph: !no_graph,
                    ..Default::default()
                },
            )
        }),
        Command::Bench {
            config,
            batch_size,
            steps,
            profile,
            loader,
            precision,
            device,
            gpu,
            gpus,
            devices,
            parallel,
            bucket_mb,
            no_graph,
            json,
        } => {
            if loader {
                host::cli::bench_loader(&config, &batch_size, steps, json.as_deref())
            } else if gpus.is_some() || devices.is_some() {
                host::cli::bucket_bytes(bucket_mb).and_then(|bucket_bytes| {
                    host::cli::bench_gpus(
                        &config,
                        &batch_size,
                        steps,
                        (precision, parallel),
                        (gpus, devices.as_deref()),
                        bucket_bytes,
                        !no_graph,
                        json.as_deref(),
                    )
                })
            } else {
                host::cli::bench(
                    &config,
                    &batch_size,
                    steps,
                    profile,
                    !no_graph,
                    precision,
                    device,
                    gpu,
                    json.as_deref(),
                )
            }
        }
        Command::Test(a) => host::cli::test(
            &a.checkpoint,
            &host::cli::TestOptions {
                config: a.config,
                data: a.data,
                device: a.device,
                gpu: a.gpu,
                batch_size: a.batch_size,
                progress: !a.quiet,
            },
        ),
        Command::Predict(a) => host::cli::predict(
            &a.checkpoint,
            &a.images,
            &host::cli::PredictOptions {
                config: a.config,
                top: a.top,
                device: a.device,
                gpu: a.gpu,
            },
        ),
        Command::Prepare(a) => host::cli::prepare(&a.src, &a.dst, a.side).map(drop),
        Command::ShowFilters(a) => {
            host::cli::show_filters(&a.checkpoint, &a.out, &a.layer, a.scale).map(drop)
        }
        Command::Devices => host::cli::devices(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
