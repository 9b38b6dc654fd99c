//! `host predict`: the top classes of a checkpoint's network for image files.
//!
//! Each file goes through the validation path of the config's data: decoded
//! with the `image` crate, its shorter side resized to the dataset's stored
//! image side and the centre square kept ([`decode_resized`], as image-folder
//! datasets do), then the evaluation augmentation (centre crop and
//! normalisation). Every file is decoded before the network is built, so an
//! unreadable one fails at once, naming the file. Class names come from the
//! config's dataset when it can be opened, else they are `class <i>`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{BackendJob, Trained, load_trained, model_from, on_backend, open_val};
use crate::backend::Backend;
use crate::config::{Config, DataSource};
use crate::data::{IMAGE_SIDE, Pixels, Sample, decode_resized};
use crate::train::{DeviceChoice, train_augment};

/// Images per forward pass.
const MAX_BATCH: usize = 16;
/// Side of Fashion-MNIST's images.
const FASHION_MNIST_SIDE: usize = 28;

/// How `host predict` runs.
#[derive(Clone, Debug)]
pub struct PredictOptions {
    /// Config to build the network from instead of the checkpoint's own.
    pub config: Option<PathBuf>,
    /// Classes shown per image (at most the number of classes).
    pub top: usize,
    pub device: DeviceChoice,
    pub gpu: usize,
}

impl Default for PredictOptions {
    fn default() -> Self {
        PredictOptions {
            config: None,
            top: 5,
            device: DeviceChoice::Auto,
            gpu: 0,
        }
    }
}

/// The top classes for one image, most probable first.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub path: PathBuf,
    /// `(class index, class name, probability)`.
    pub top: Vec<(usize, String, f32)>,
}

/// `host predict CKPT IMAGE...`: runs [`predict_files`] and prints each
/// file's top classes.
pub fn predict(checkpoint: &Path, images: &[PathBuf], opts: &PredictOptions) -> Result<()> {
    for p in predict_files(checkpoint, images, opts)? {
        println!("{}", p.path.display());
        for (i, (_, name, prob)) in p.top.iter().enumerate() {
            println!("  {}. {prob:.4}  {name}", i + 1);
        }
    }
    Ok(())
}

/// The top `opts.top` classes of each image in `images` (see the module
/// docs).
pub fn predict_files(
    checkpoint: &Path,
    images: &[PathBuf],
    opts: &PredictOptions,
) -> Result<Vec<Prediction>> {
    if opts.top == 0 {
        bail!("--top: must be ≥ 1, got 0");
    }
    if images.is_empty() {
        bail!("no image files given");
    }
    let trained = load_trained(checkpoint, opts.config.as_deref())?;
    let cfg = &trained.config;
    let classes = cfg.model.classes;
    let (mut names, side) = match open_val(cfg) {
        Ok(ds) if ds.classes() == classes => {
            let [_, h, w] = ds.image_shape();
            (ds.class_names(), h.min(w))
        }
        Ok(ds) => {
            eprintln!(
                "note: the dataset has {} classes, the network {classes}; showing class numbers",
                ds.classes()
            );
            (Vec::new(), stored_side(cfg))
        }
        Err(e) => {
            eprintln!("note: class names unavailable ({e:#}); showing class numbers");
            (Vec::new(), stored_side(cfg))
        }
    };
    names.resize_with(classes, String::new);
    for (i, name) in names.iter_mut().enumerate() {
        if name.is_empty() {
            *name = format!("class {i}");
        }
    }
    let inputs = images
        .iter()
        .map(|path| network_input(cfg, path, side))
        .collect::<Result<Vec<_>>>()?;
    let probs = on_backend(
        opts.device,
        opts.gpu,
        Job {
            trained: &trained,
            inputs: &inputs,
        },
    )?;
    Ok(images
        .iter()
        .zip(probs.chunks_exact(classes))
        .map(|(path, p)| {
            let mut order: Vec<usize> = (0..classes).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            Prediction {
                path: path.clone(),
                top: order
                    .into_iter()
                    .take(opts.top)
                    .map(|c| (c, names[c].clone(), p[c]))
                    .collect(),
            }
        })
        .collect())
}

/// The side of the dataset's stored images when the dataset itself cannot be
/// opened: what its source produces, and never less than the crop.
fn stored_side(cfg: &Config) -> usize {
    let input = cfg.model.input[1];
    let side = match &cfg.data.source {
        DataSource::Synthetic { image_size, .. } => image_size.unwrap_or(input),
        DataSource::Folder { .. } | DataSource::Packed { .. } => IMAGE_SIDE,
        DataSource::FashionMnist { .. } => FASHION_MNIST_SIDE,
        DataSource::Safetensors { .. } => input,
    };
    side.max(cfg.data.augment.crop.unwrap_or(input))
}

/// Decodes `path` and turns it into one network input `[C, H, W]`.
fn network_input(cfg: &Config, path: &Path, side: usize) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let rgb = decode_resized(&bytes, side).with_context(|| format!("{}", path.display()))?;
    let channels = cfg.model.input[0];
    let pixels = match channels {
        3 => rgb,
        1 => {
            let plane = side * side;
            (0..plane)
                .map(|i| {
                    let (r, g, b) = (rgb[i], rgb[plane + i], rgb[2 * plane + i]);
                    (0.299 * f32::from(r) + 0.587 * f32::from(g) + 0.114 * f32::from(b))
                        .round()
                        .clamp(0.0, 255.0) as u8
                })
                .collect()
        }
        c => bail!(
            "{}: model.input.channels is {c}; only 1 (grey) or 3 (RGB) can be read from image files",
            cfg.origin
        ),
    };
    let sample = Sample {
        pixels: Pixels::U8(pixels),
        label: 0,
    };
    let aug = train_augment(cfg).without_randomness();
    let mut input = vec![0.0f32; cfg.model.input.iter().product()];
    aug.apply(
        &sample,
        [channels, side, side],
        &mut StdRng::seed_from_u64(0),
        &mut input,
    )
    .with_context(|| format!("{}", path.display()))?;
    Ok(input)
}

struct Job<'a> {
    trained: &'a Trained,
    inputs: &'a [Vec<f32>],
}

impl BackendJob for Job<'_> {
    /// Softmax outputs, `[images, classes]`.
    type Output = Vec<f32>;

    fn run<B: Backend>(self, be: &B) -> Result<Vec<f32>> {
        let batch = self.inputs.len().min(MAX_BATCH);
        let mut model = model_from(be, self.trained, batch)?;
        let classes = model.classes;
        let labels = vec![0; batch];
        let mut out = Vec::with_capacity(self.inputs.len() * classes);
        for chunk in self.inputs.chunks(batch) {
            let mut images = chunk.concat();
            images.resize(batch * model.input_len_per_sample(), 0.0);
            model.set_batch(be, &images, &labels)?;
            model.forward(be, None)?;
            let probs = model.read_probs(be)?;
            let probs = &probs[..chunk.len() * classes];
            if let Some(bad) = probs.iter().find(|p| !p.is_finite()) {
                bail!("the network's output {bad} is not finite (are the checkpoint's weights?)");
            }
            out.extend_from_slice(probs);
        }
        Ok(out)
    }
}
