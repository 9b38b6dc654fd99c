//! Datasets, augmentation and the batch loader.
//!
//! Every image source implements [`Dataset`]: a fixed-length, random-access
//! list of labelled images, all of one stored shape `[C, H, W]`. A [`Sample`]
//! keeps the source's own pixel type ([`Pixels::U8`] for bytes, or
//! [`Pixels::F32`] for float sources, read as values in `[0, 1]`), so decoding
//! stays cheap and conversion happens once, inside augmentation.
//!
//! Sources:
//! - [`Synthetic`]: procedural oriented gratings, generated from `(seed, index)`;
//! - [`FashionMnist`]: the IDX files (gzipped or not) of Fashion-MNIST;
//! - [`FolderDataset`]: ImageNet's `DIR/{train,val}/<class>/*.JPEG` layout,
//!   decoded and resized to 256×256 on every read;
//! - [`Packed`]: a folder dataset decoded once by [`prepare`] into raw
//!   `uint8` files that are memory-mapped at read time;
//! - [`SafetensorsDataset`]: `images` `[N, C, H, W]` and `labels` `[N]` tensors.
//!
//! [`Augment`] turns one sample into network input (random or centre crop,
//! mirror, PCA colour noise, normalisation); [`Loader`] runs it on worker
//! threads and yields [`Batch`]es whose content depends only on
//! `(seed, epoch, batch index)`, never on thread timing, so a run can be
//! resumed exactly and sharded across GPUs. [`open_train_val`] opens a
//! train/validation pair from a [`SourceSpec`].
//!
//! Randomness: every stream (class prototypes, samples, shuffles, crops) is a
//! `StdRng` seeded by hashing a tuple such as `(seed, tag, epoch, position)`,
//! so any one of them can be recomputed alone. `StdRng` is ChaCha12 in rand
//! 0.9; the lock file pins it, and a rand upgrade may change the streams.

mod augment;
mod fashion_mnist;
mod folder;
mod loader;
mod packed;
mod synthetic;
mod tensor_file;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;

pub use augment::{
    Augment, Corner, IMAGENET_MEAN, IMAGENET_PCA_EIGVAL, IMAGENET_PCA_EIGVEC, IMAGENET_STD,
    Normalize, TEN_VIEWS,
};
pub use fashion_mnist::{
    FASHION_MNIST_CLASSES, FASHION_MNIST_DEFAULT_DIR, FashionMnist, read_idx_file,
};
pub use folder::{FolderDataset, IMAGE_SIDE, decode_resized, list_classes};
pub use loader::{Batch, Epoch, Images, Loader, LoaderConfig, Views};
pub use packed::{Packed, PrepareReport, SkippedFile, prepare, prepare_with_side};
pub use synthetic::Synthetic;
pub use tensor_file::SafetensorsDataset;

/// Pixels of one image, stored `[C, H, W]` in the source's own type.
#[derive(Debug, Clone, PartialEq)]
pub enum Pixels {
    /// Bytes, 0..=255 (read as `v / 255` by augmentation).
    U8(Vec<u8>),
    /// Floats already in `[0, 1]` units (values outside are kept as they are).
    F32(Vec<f32>),
}

impl Pixels {
    /// Number of values (C·H·W).
    pub fn len(&self) -> usize {
        match self {
            Pixels::U8(v) => v.len(),
            Pixels::F32(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` in `[0, 1]` units.
    pub fn unit(&self, i: usize) -> f32 {
        match self {
            Pixels::U8(v) => f32::from(v[i]) / 255.0,
            Pixels::F32(v) => v[i],
        }
    }
}

/// One labelled image as stored by its source.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `[C, H, W]` pixels, with the shape of [`Dataset::image_shape`].
    pub pixels: Pixels,
    /// Class index in `0..classes`.
    pub label: i32,
}

/// A fixed-length, random-access list of labelled images of one shape.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether the dataset holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of classes; labels are in `0..classes()`.
    fn classes(&self) -> usize;
    /// One name per class, in label order.
    fn class_names(&self) -> Vec<String>;
    /// Stored shape `[C, H, W]` of every sample.
    fn image_shape(&self) -> [usize; 3];
    /// Sample `i`; an error means this one sample cannot be read (a corrupt
    /// file, say): the loader counts it and carries on.
    fn get(&self, i: usize) -> Result<Sample>;
    /// One line for logs: source, size, classes and shape.
    fn describe(&self) -> String {
        format!(
            "{} images, {} classes, shape {:?}",
            self.len(),
            self.classes(),
            self.image_shape()
        )
    }
}

/// Which half of a dataset to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Val,
}

impl Split {
    /// `"train"` or `"val"`: the folder and file names used for the split.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }
}

/// Where the training and validation images come from. The trainer's
/// config maps onto this; it is kept free of config details on purpose.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceSpec {
    /// Procedural images (see [`Synthetic`]).
    Synthetic {
        train_size: usize,
        val_size: usize,
        classes: usize,
        /// `[C, H, W]`.
        shape: [usize; 3],
        seed: u64,
    },
    /// `path/train/<class>/*` and `path/val/<class>/*`, decoded on every read.
    Folder { path: PathBuf },
    /// The output directory of [`prepare`].
    Packed { path: PathBuf },
    /// A directory with the four Fashion-MNIST IDX files
    /// ([`FASHION_MNIST_DEFAULT_DIR`] when installed from Debian).
    FashionMnist { path: PathBuf },
    /// A safetensors file with `images` and `labels`; validation data comes
    /// from `val_path` (same tensor names) or else from the tensors
    /// `val_images` and `val_labels` of the same file.
    Safetensors {
        path: PathBuf,
        val_path: Option<PathBuf>,
    },
}

/// Opens the training and validation datasets described by `source`. Both
/// halves are checked to agree on the class count and image shape.
pub fn open_train_val(source: &SourceSpec) -> Result<(Arc<dyn Dataset>, Arc<dyn Dataset>)> {
    let (train, val): (Arc<dyn Dataset>, Arc<dyn Dataset>) = match source {
        SourceSpec::Synthetic {
            train_size,
            val_size,
            classes,
            shape,
            seed,
        } => (
            Arc::new(Synthetic::new(*train_size, *classes, *shape, *seed, Split::Train)?.cached()),
            Arc::new(Synthetic::new(*val_size, *classes, *shape, *seed, Split::Val)?.cached()),
        ),
        SourceSpec::Folder { path } => {
            let train = FolderDataset::open(path, Split::Train)?;
            let val = FolderDataset::open(path, Split::Val)?;
            (Arc::new(train), Arc::new(val))
        }
        SourceSpec::Packed { path } => (
            Arc::new(Packed::open(path, Split::Train)?),
            Arc::new(Packed::open(path, Split::Val)?),
        ),
        SourceSpec::FashionMnist { path } => (
            Arc::new(FashionMnist::open(path, Split::Train)?),
            Arc::new(FashionMnist::open(path, Split::Val)?),
        ),
        SourceSpec::Safetensors { path, val_path } => {
            let (train, val) = SafetensorsDataset::open_pair(path, val_path.as_deref())?;
            (Arc::new(train), Arc::new(val))
        }
    };
    if train.classes() != val.classes() {
        bail!(
            "training data has {} classes but validation data has {} ({} / {})",
            train.classes(),
            val.classes(),
            train.describe(),
            val.describe()
        );
    }
    if train.image_shape() != val.image_shape() {
        bail!(
            "training images have shape {:?} but validation images {:?}",
            train.image_shape(),
            val.image_shape()
        );
    }
    Ok((train, val))
}

/// Hashes a list of integers into one 64-bit seed (SplitMix64's finaliser
/// applied after folding in each part), so every random stream in this
/// module is named by a tuple such as `(seed, TAG, epoch, position)`.
pub(crate) fn mix_seed(parts: &[u64]) -> u64 {
    fn finalise(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    parts
        .iter()
        .fold(0x6A09_E667_F3BC_C908, |h, &p| finalise(h ^ finalise(p)))
}

/// A generator for the stream named by `parts` (see [`mix_seed`]).
pub(crate) fn rng_for(parts: &[u64]) -> StdRng {
    StdRng::seed_from_u64(mix_seed(parts))
}
