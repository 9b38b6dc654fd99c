//! Fashion-MNIST from its IDX files.
//!
//! IDX layout: two zero bytes, a type byte (`0x08` = unsigned byte, the only
//! one used here), the number of dimensions, each dimension as a big-endian
//! `u32`, then the values in row-major order. Images are `[N, 28, 28]`,
//! labels `[N]`. Files may be gzipped (`*.gz`, as shipped and as the Debian
//! package `dataset-fashion-mnist` installs them) or plain; the whole split is
//! read into memory (47 MB for the training images).

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use flate2::read::MultiGzDecoder;

use super::{Dataset, Pixels, Sample, Split};

/// Where the Debian package `dataset-fashion-mnist` installs the files.
pub const FASHION_MNIST_DEFAULT_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Class names in label order.
pub const FASHION_MNIST_CLASSES: [&str; 10] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
];

/// One split of Fashion-MNIST, held in memory.
#[derive(Debug, Clone)]
pub struct FashionMnist {
    images: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    source: PathBuf,
    split: Split,
}

impl FashionMnist {
    /// Reads `train-{images-idx3,labels-idx1}-ubyte[.gz]` (train) or
    /// `t10k-…` (val) from `dir`.
    pub fn open(dir: &Path, split: Split) -> Result<Self> {
        let prefix = match split {
            Split::Train => "train",
            Split::Val => "t10k",
        };
        let images_path = find_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
        let labels_path = find_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
        let (image_dims, images) = read_idx_file(&images_path)?;
        let (label_dims, labels) = read_idx_file(&labels_path)?;
        if image_dims.len() != 3 {
            bail!(
                "{}: expected 3 dimensions [N, rows, cols], found {image_dims:?}",
                images_path.display()
            );
        }
        if label_dims.len() != 1 {
            bail!(
                "{}: expected 1 dimension [N], found {label_dims:?}",
                labels_path.display()
            );
        }
        if image_dims[0] != label_dims[0] {
            bail!(
                "{} holds {} images but {} holds {} labels",
                images_path.display(),
                image_dims[0],
                labels_path.display(),
                label_dims[0]
            );
        }
        if let Some(pos) = labels
            .iter()
            .position(|&l| usize::from(l) >= FASHION_MNIST_CLASSES.len())
        {
            bail!(
                "{}: label {} at index {pos} is not a class (0..10)",
                labels_path.display(),
                labels[pos]
            );
        }
        Ok(FashionMnist {
            images,
            labels,
            rows: image_dims[1],
            cols: image_dims[2],
            source: dir.to_path_buf(),
            split,
        })
    }
}

/// `dir/name.gz` if it exists, else `dir/name`, else a one-line error.
fn find_file(dir: &Path, name: &str) -> Result<PathBuf> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    bail!(
        "fashion-mnist: {} not found (nor without .gz); install the Debian package \
         dataset-fashion-mnist or point the path at a directory holding the IDX files",
        gz.display()
    )
}

/// Reads an unsigned-byte IDX file (gunzipping it when its name ends in
/// `.gz`) and returns its dimensions and values.
pub fn read_idx_file(path: &Path) -> Result<(Vec<usize>, Vec<u8>)> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut bytes = Vec::new();
    if path.extension().is_some_and(|e| e == "gz") {
        MultiGzDecoder::new(BufReader::new(file))
            .read_to_end(&mut bytes)
            .with_context(|| format!("{}: corrupt gzip data", path.display()))?;
    } else {
        BufReader::new(file)
            .read_to_end(&mut bytes)
            .with_context(|| format!("cannot read {}", path.display()))?;
    }
    parse_idx(&bytes).with_context(|| format!("{}: not a valid IDX file", path.display()))
}

fn parse_idx(bytes: &[u8]) -> Result<(Vec<usize>, Vec<u8>)> {
    if bytes.len() < 4 {
        bail!("{} bytes is shorter than the 4-byte header", bytes.len());
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        bail!(
            "magic number starts with {:#04x} {:#04x}, expected 0x00 0x00",
            bytes[0],
            bytes[1]
        );
    }
    if bytes[2] != 0x08 {
        bail!("element type {:#04x} is not unsigned byte (0x08)", bytes[2]);
    }
    let ndims = usize::from(bytes[3]);
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        bail!("file ends inside the header of {ndims} dimensions");
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize)
        .collect();
    let count = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .with_context(|| format!("dimensions {dims:?} overflow"))?;
    let data = &bytes[header..];
    if data.len() != count {
        bail!(
            "dimensions {dims:?} need {count} values but the file holds {} (truncated or corrupt)",
            data.len()
        );
    }
    Ok((dims, data.to_vec()))
}

impl Dataset for FashionMnist {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn classes(&self) -> usize {
        FASHION_MNIST_CLASSES.len()
    }

    fn class_names(&self) -> Vec<String> {
        FASHION_MNIST_CLASSES
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    fn image_shape(&self) -> [usize; 3] {
        [1, self.rows, self.cols]
    }

    fn get(&self, i: usize) -> Result<Sample> {
        let Some(&label) = self.labels.get(i) else {
            bail!(
                "fashion-mnist: index {i} out of range (len {})",
                self.labels.len()
            );
        };
        let size = self.rows * self.cols;
        Ok(Sample {
            pixels: Pixels::U8(self.images[i * size..(i + 1) * size].to_vec()),
            label: i32::from(label),
        })
    }

    fn describe(&self) -> String {
        format!(
            "fashion-mnist {} ({}): {} images, 10 classes, shape [1, {}, {}]",
            self.split.name(),
            self.source.display(),
            self.labels.len(),
            self.rows,
            self.cols
        )
    }
}
