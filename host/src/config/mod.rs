//! Validated JSON configs: `model`, `train` and `data` sections, cuda-convnet
//! style (the network is a list of named layers, separate from the schedule).
//!
//! Loading is two steps. serde parses the text into the section structs,
//! rejecting unknown fields everywhere, so a typo is an error rather than a
//! silently ignored setting. Validation then checks every value and infers
//! every layer's shape ([`ModelSpec`]), so a bad config fails in
//! milliseconds, before any data is read or GPU memory allocated. Every
//! failure is one [`ConfigError`] line naming the file, the JSON path and the
//! problem.
//!
//! Layout: `error` (the error type and JSON-path recovery), `model` (layers
//! and shape inference), this file (the `train` and `data` sections, their
//! checks, and loading).

mod error;
mod model;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use self::error::ConfigError;
use self::error::{Invalid, invalid, require};
pub use self::model::{
    ConvLayer, DropoutLayer, FcLayer, InputShape, LayerConfig, LayerKind, LayerSpec, LrnLayer,
    ModelConfig, ModelSpec, PoolLayer,
};
pub use crate::backend::SgdRule;

/// Where the `fashion-mnist` source looks when no `path` is given.
pub const FASHION_MNIST_DEFAULT_PATH: &str = "/usr/share/datasets/fashion-mnist";

/// A loaded and validated config.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Where it was read from (for messages and reports).
    pub origin: String,
    /// Free text describing the config (the file's optional `description`).
    pub description: Option<String>,
    pub model: ModelSpec,
    pub train: TrainConfig,
    pub data: DataConfig,
}

/// The file as written: the three sections and an optional description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    model: ModelConfig,
    train: TrainConfig,
    data: DataConfig,
}

/// The `train` section: optimiser, schedule, evaluation and checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The global batch: with `gpus` GPUs each takes `batch_size / gpus`
    /// samples of it (which must divide evenly), and their gradients are
    /// averaged, so the update is that of one GPU on the whole batch.
    pub batch_size: usize,
    /// GPUs to train on, data-parallel (default 1; `--gpus`/`--devices`
    /// override it).
    #[serde(default = "one")]
    pub gpus: usize,
    /// How several GPUs share the work (default `"data"`).
    #[serde(default)]
    pub parallel: Parallel,
    pub epochs: usize,
    /// Initial learning rate.
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    /// Which momentum-SGD update (`"pytorch"` by default, or `"paper"`).
    #[serde(default)]
    pub sgd_rule: SgdRule,
    pub lr_schedule: LrSchedule,
    /// Evaluate on the validation set every this many epochs (default 1).
    #[serde(default = "one")]
    pub eval_every: usize,
    /// Write a checkpoint every this many epochs (default 1).
    #[serde(default = "one")]
    pub checkpoint_every: usize,
    /// Keep this many most recent checkpoints (default 3).
    #[serde(default = "three")]
    pub keep_checkpoints: usize,
    /// Seeds initialisation, data order, augmentation and dropout (default 0).
    #[serde(default)]
    pub seed: u64,
    /// Bitwise-reproducible training on one device. Always true: every
    /// kernel sums in a fixed order (no atomics, split-K partial sums added
    /// by a separate pass), so a run repeats bit for bit with the same seed;
    /// `false` is rejected rather than silently ignored.
    #[serde(default = "yes")]
    pub deterministic: bool,
    #[serde(default)]
    pub precision: Precision,
    /// Time each convolution's candidate kernels (forward and data
    /// gradient) once when the model is built and keep the fastest
    /// (default true), as cuDNN's benchmark mode does. The candidates give
    /// bit-identical results, so this changes speed, not results; false
    /// (or `ALEXNET_AUTOTUNE=0`) keeps the built-in choices. Settings forced
    /// with `ALEXNET_TRANSPOSED` / `ALEXNET_BIG_TILES` are kept.
    #[serde(default = "yes")]
    pub autotune: bool,
}

/// How the learning rate changes during training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum LrSchedule {
    /// Multiply by `factor` once each listed epoch is reached: with
    /// `[30, 60]`, epochs 0–29 use `lr`, 30–59 `lr·factor`, 60– `lr·factor²`.
    /// An empty list keeps the rate constant.
    Step { epochs: Vec<usize>, factor: f32 },
    /// Multiply by `factor` when the validation top-1 error has not improved
    /// for `patience` evaluations in a row, at most `max_drops` times (the
    /// paper's rule: ÷10, three times).
    Plateau {
        factor: f32,
        patience: usize,
        max_drops: usize,
    },
}

/// How several GPUs share a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Parallel {
    /// Data-parallel: every GPU holds the whole network and trains on its
    /// share of the batch; gradients are averaged.
    #[default]
    Data,
    /// Krizhevsky's "one weird trick" (2014): the layers before the first fc
    /// layer data-parallel, the fc layers model-parallel (each GPU holds a
    /// slice of every fc layer's outputs and computes it for the whole
    /// batch).
    Hybrid,
}

/// Arithmetic precision of the training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Plain fp32 everywhere.
    #[default]
    Fp32,
    /// fp32 storage, TF32 tensor-core products.
    Tf32,
    /// fp32 storage, bf16 tensor-core products (operands rounded to bf16),
    /// fp32 accumulation and master weights.
    Bf16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// The `data` section: where samples come from and how they are augmented.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    #[serde(default)]
    pub augment: Augment,
}

/// Where the training and validation samples come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum DataSource {
    /// Generated images, so training runs on a machine without datasets.
    Synthetic {
        train_size: usize,
        val_size: usize,
        /// Labels are drawn from this many classes (default: all of the
        /// model's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        classes: Option<usize>,
        /// Side of the generated square images before cropping (default:
        /// the model's input size).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image_size: Option<usize>,
    },
    /// An image folder (`train/<class>/…`, `val/<class>/…`).
    Folder { path: PathBuf },
    /// A packed binary dataset.
    Packed { path: PathBuf },
    /// The Fashion-MNIST idx files.
    FashionMnist {
        #[serde(default = "fashion_mnist_path")]
        path: PathBuf,
    },
    /// Images and labels stored as safetensors.
    Safetensors { path: PathBuf },
}

/// Training-time augmentation and input normalisation. Pixels are in
/// [0, 255]. Training: pad by `pad` zeros on each side, take a random
/// `crop × crop` window, mirror it with probability ½ if `flip`, add PCA
/// colour noise with standard deviation `pca_noise`, then subtract `mean`
/// and divide by `std` per channel, then with probability `erase` fill one
/// random rectangle with noise (random erasing). Evaluation: the centre `crop` window of
/// the unpadded image, then the same normalisation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Augment {
    /// Crop size; must equal the model's input height and width. None: the
    /// images already have the input size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crop: Option<usize>,
    #[serde(default)]
    pub pad: usize,
    #[serde(default)]
    pub flip: bool,
    /// σ of the paper's PCA colour noise (3-channel inputs); 0 disables it.
    #[serde(default)]
    pub pca_noise: f32,
    /// Per-channel values subtracted from the pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean: Option<Vec<f32>>,
    /// Per-channel divisors applied after subtracting `mean`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<Vec<f32>>,
    /// Probability of random erasing (one random rectangle of 2–40% of the
    /// crop filled with noise); 0 disables it.
    #[serde(default)]
    pub erase: f32,
}

fn one() -> usize {
    1
}

fn three() -> usize {
    3
}

fn yes() -> bool {
    true
}

fn fashion_mnist_path() -> PathBuf {
    PathBuf::from(FASHION_MNIST_DEFAULT_PATH)
}

/// Reads and validates the config at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        origin: origin.clone(),
        position: None,
        path: String::new(),
        message: format!("cannot read the config: {e}"),
    })?;
    Config::from_str(&text, &origin)
}

impl Config {
    /// Parses and validates `text`; `origin` names it in error messages.
    pub fn from_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let body = text.trim_start_matches([' ', '\t', '\n', '\r']);
        if !body.is_empty() && !body.starts_with('{') {
            return Err(ConfigError::at_char(
                origin,
                text,
                text.len() - body.len(),
                "a config must be a JSON object with model, train and data sections",
            ));
        }
        let file: ConfigFile =
            serde_json::from_str(text).map_err(|e| ConfigError::from_serde(origin, text, &e))?;
        let at = |invalid| ConfigError::at(origin, invalid);
        let model = ModelSpec::from_config(&file.model).map_err(at)?;
        check_train(&file.train).map_err(at)?;
        if file.train.parallel == Parallel::Hybrid {
            check_hybrid(&model, file.train.gpus).map_err(at)?;
        }
        check_data(&file.data, &model).map_err(at)?;
        Ok(Config {
            origin: origin.to_string(),
            description: file.description,
            model,
            train: file.train,
            data: file.data,
        })
    }

    /// The config as pretty JSON that loads back to an equal `Config`
    /// (defaults written out), e.g. to store next to a checkpoint.
    pub fn to_json(&self) -> String {
        let file = ConfigFile {
            description: self.description.clone(),
            model: self.model.to_config(),
            train: self.train.clone(),
            data: self.data.clone(),
        };
        serde_json::to_string_pretty(&file).expect("config values always serialise to JSON")
    }
}

fn positive_int(path: &str, value: usize) -> Result<(), Invalid> {
    if value == 0 {
        return invalid(path, "must be ≥ 1, got 0");
    }
    Ok(())
}

fn check_train(t: &TrainConfig) -> Result<(), Invalid> {
    positive_int("train.batch_size", t.batch_size)?;
    positive_int("train.gpus", t.gpus)?;
    if !t.batch_size.is_multiple_of(t.gpus) {
        return invalid(
            "train.batch_size",
            format!(
                "{} is not divisible by train.gpus ({}): the batch is global and each GPU takes an equal share",
                t.batch_size, t.gpus
            ),
        );
    }
    positive_int("train.epochs", t.epochs)?;
    require("train.lr", t.lr, t.lr > 0.0, "> 0")?;
    let momentum_ok = (0.0..1.0).contains(&t.momentum);
    require("train.momentum", t.momentum, momentum_ok, "in [0, 1)")?;
    let decay_ok = t.weight_decay >= 0.0;
    require("train.weight_decay", t.weight_decay, decay_ok, "≥ 0")?;
    positive_int("train.eval_every", t.eval_every)?;
    positive_int("train.checkpoint_every", t.checkpoint_every)?;
    positive_int("train.keep_checkpoints", t.keep_checkpoints)?;
    if !t.deterministic {
        return invalid(
            "train.deterministic",
            "false is not offered: every kernel reduces in a fixed order, so training is always \
             bitwise reproducible on one device (set true or leave the field out)",
        );
    }
    let factor = match &t.lr_schedule {
        LrSchedule::Step { epochs, factor } => {
            let mut previous = 0;
            for (i, &epoch) in epochs.iter().enumerate() {
                let path = format!("train.lr_schedule.epochs[{i}]");
                if epoch == 0 {
                    return invalid(path, "must be ≥ 1, got 0");
                }
                if epoch <= previous {
                    return invalid(
                        path,
                        format!("must be greater than the one before ({previous}), got {epoch}"),
                    );
                }
                if epoch >= t.epochs {
                    return invalid(
                        path,
                        format!(
                            "epoch {epoch} is never reached (training runs epochs 0 to {})",
                            t.epochs - 1
                        ),
                    );
                }
                previous = epoch;
            }
            *factor
        }
        LrSchedule::Plateau { factor, .. } => *factor,
    };
    let factor_ok = factor > 0.0 && factor < 1.0;
    require("train.lr_schedule.factor", factor, factor_ok, "in (0, 1)")
}

/// The hybrid mode splits the fc layers: they must come after at least one
/// other layer and be followed only by ReLU, dropout, more fc layers and the
/// softmax, and each must have an output for every GPU.
fn check_hybrid(model: &ModelSpec, gpus: usize) -> Result<(), Invalid> {
    let path = "train.parallel";
    let Some(first) = model
        .layers
        .iter()
        .position(|l| matches!(l.kind, LayerKind::Fc(_)))
    else {
        return invalid(path, "hybrid splits the fc layers, but the model has none");
    };
    if first == 0 {
        return invalid(
            path,
            "hybrid needs a layer before the first fc layer (the data-parallel part)",
        );
    }
    for l in &model.layers[first..] {
        match &l.kind {
            LayerKind::Fc(f) if f.outputs < gpus => {
                return invalid(
                    path,
                    format!(
                        "hybrid splits layer {:?}'s {} outputs over the GPUs, but train.gpus is {gpus}",
                        l.name, f.outputs
                    ),
                );
            }
            LayerKind::Fc(_) | LayerKind::Relu | LayerKind::Dropout(_) | LayerKind::Softmax => {}
            other => {
                return invalid(
                    path,
                    format!(
                        "hybrid supports only fc, relu, dropout and softmax layers after the first fc layer, got {:?} ({})",
                        l.name,
                        other.type_name()
                    ),
                );
            }
        }
    }
    Ok(())
}

fn check_data(d: &DataConfig, model: &ModelSpec) -> Result<(), Invalid> {
    let [channels, height, width] = model.input;
    let a = &d.augment;
    if let Some(crop) = a.crop {
        if crop != height || crop != width {
            return invalid(
                "data.augment.crop",
                format!("{crop} does not match the model input {height}×{width}"),
            );
        }
    } else if a.pad != 0 {
        return invalid(
            "data.augment.pad",
            "padding needs a crop size (data.augment.crop)",
        );
    }
    let noise = a.pca_noise;
    require("data.augment.pca_noise", noise, noise >= 0.0, "≥ 0")?;
    let erase = a.erase;
    require(
        "data.augment.erase",
        erase,
        (0.0..=1.0).contains(&erase),
        "in [0, 1]",
    )?;
    if noise > 0.0 && channels != 3 {
        return invalid(
            "data.augment.pca_noise",
            format!("PCA colour noise needs 3 input channels, the model has {channels}"),
        );
    }
    for (name, values) in [("mean", &a.mean), ("std", &a.std)] {
        let Some(values) = values else { continue };
        let path = format!("data.augment.{name}");
        if values.len() != channels {
            return invalid(
                path,
                format!(
                    "has {} values but the model input has {channels} channels",
                    values.len()
                ),
            );
        }
        for (i, &v) in values.iter().enumerate() {
            let path = format!("{path}[{i}]");
            match name {
                "std" => require(&path, v, v > 0.0, "> 0")?,
                _ => require(&path, v, true, "finite")?,
            }
        }
    }
    match &d.source {
        DataSource::Synthetic {
            train_size,
            val_size,
            classes,
            image_size,
        } => {
            positive_int("data.source.train_size", *train_size)?;
            positive_int("data.source.val_size", *val_size)?;
            if let Some(c) = *classes
                && !(1..=model.classes).contains(&c)
            {
                return invalid(
                    "data.source.classes",
                    format!(
                        "must be in 1..={} (the model's classes), got {c}",
                        model.classes
                    ),
                );
            }
            if let Some(side) = *image_size {
                check_image_size(side, a, height, width)?;
            }
        }
        DataSource::Folder { path }
        | DataSource::Packed { path }
        | DataSource::FashionMnist { path }
        | DataSource::Safetensors { path } => {
            if path.as_os_str().is_empty() {
                return invalid("data.source.path", "must not be empty");
            }
        }
    }
    Ok(())
}

/// Synthetic `side × side` images must yield the model input: at least the
/// crop once padded, or exactly the input size when there is no crop.
fn check_image_size(side: usize, a: &Augment, height: usize, width: usize) -> Result<(), Invalid> {
    let path = "data.source.image_size";
    match a.crop {
        Some(crop) if side.saturating_add(a.pad.saturating_mul(2)) < crop => invalid(
            path,
            format!(
                "{side}×{side} images padded by {} are smaller than the {crop}×{crop} crop",
                a.pad
            ),
        ),
        None if side != height || side != width => invalid(
            path,
            format!(
                "{side}×{side} images need data.augment.crop to fit the model input {height}×{width}"
            ),
        ),
        _ => Ok(()),
    }
}
