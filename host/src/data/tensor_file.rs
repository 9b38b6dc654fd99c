//! Images and labels from a safetensors file.
//!
//! The file holds `images` (`U8`, or `F32` in `[0, 1]` units) of shape
//! `[N, C, H, W]` and `labels` (any integer dtype) of shape `[N]`. The file is
//! memory-mapped and its header parsed once; `get` copies one image out of the
//! mapping. Labels are read into memory as `i32` and must be non-negative.
//! Class names come from the header's `__metadata__` entry `class_names` (a
//! JSON list of strings) when present; otherwise the class count is the
//! largest label plus one and classes are named by number.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::{Dataset, Pixels, Sample};

/// Pixel type of the images tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ImageDtype {
    U8,
    F32,
}

/// Labelled images from one pair of tensors of a safetensors file.
#[derive(Debug)]
pub struct SafetensorsDataset {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the images tensor's data inside the mapping.
    offset: usize,
    dtype: ImageDtype,
    shape: [usize; 3],
    labels: Vec<i32>,
    class_names: Vec<String>,
}

impl SafetensorsDataset {
    /// Opens the tensors `images` and `labels` of `path`.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_tensors(path, "images", "labels")
    }

    /// Opens the tensors named `images` and `labels` of `path`.
    pub fn open_tensors(path: &Path, images: &str, labels: &str) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: read-only mapping; the file must not be truncated while in use.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        let tensors = SafeTensors::deserialize(&map)
            .with_context(|| format!("{}: not a valid safetensors file", path.display()))?;

        let image_view = tensors.tensor(images).with_context(|| {
            format!(
                "{}: no tensor {images:?} (has {:?})",
                path.display(),
                tensors.names()
            )
        })?;
        let dtype = match image_view.dtype() {
            Dtype::U8 => ImageDtype::U8,
            Dtype::F32 => ImageDtype::F32,
            other => bail!(
                "{}: tensor {images:?} has dtype {other:?}; expected U8 or F32",
                path.display()
            ),
        };
        let &[n, c, h, w] = image_view.shape() else {
            bail!(
                "{}: tensor {images:?} has shape {:?}; expected [N, C, H, W]",
                path.display(),
                image_view.shape()
            );
        };
        if c == 0 || h == 0 || w == 0 {
            bail!(
                "{}: tensor {images:?} has an empty image shape {:?}",
                path.display(),
                [c, h, w]
            );
        }
        let offset = image_view.data().as_ptr() as usize - map.as_ptr() as usize;

        let label_view = tensors.tensor(labels).with_context(|| {
            format!(
                "{}: no tensor {labels:?} (has {:?})",
                path.display(),
                tensors.names()
            )
        })?;
        if label_view.shape() != [n] {
            bail!(
                "{}: tensor {labels:?} has shape {:?}; expected [{n}] to match {images:?}",
                path.display(),
                label_view.shape()
            );
        }
        let label_values = read_integers(label_view.dtype(), label_view.data())
            .with_context(|| format!("{}: tensor {labels:?}", path.display()))?;
        let mut label_i32 = Vec::with_capacity(n);
        for (i, &v) in label_values.iter().enumerate() {
            match i32::try_from(v) {
                Ok(l) if l >= 0 => label_i32.push(l),
                _ => bail!(
                    "{}: tensor {labels:?} value {v} at index {i} is not a class index",
                    path.display()
                ),
            }
        }

        let (_, metadata) = SafeTensors::read_metadata(&map)
            .with_context(|| format!("{}: not a valid safetensors file", path.display()))?;
        let named = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get("class_names"))
            .map(|text| {
                serde_json::from_str::<Vec<String>>(text).with_context(|| {
                    format!(
                        "{}: metadata class_names is not a JSON list of strings",
                        path.display()
                    )
                })
            })
            .transpose()?;
        let needed = label_i32.iter().max().map_or(0, |&m| m as usize + 1);
        let class_names = match named {
            Some(names) => {
                if names.len() < needed {
                    bail!(
                        "{}: tensor {labels:?} has label {} but metadata class_names lists {} classes",
                        path.display(),
                        needed - 1,
                        names.len()
                    );
                }
                names
            }
            None => (0..needed).map(|k| k.to_string()).collect(),
        };
        drop(tensors);
        Ok(SafetensorsDataset {
            path: path.to_path_buf(),
            map,
            offset,
            dtype,
            shape: [c, h, w],
            labels: label_i32,
            class_names,
        })
    }

    /// Training and validation data: `images`/`labels` of `path`, and those
    /// of `val_path`, or else `val_images`/`val_labels` of `path`. Without
    /// class names in the metadata, both get the larger class count.
    pub fn open_pair(path: &Path, val_path: Option<&Path>) -> Result<(Self, Self)> {
        let mut train = Self::open(path)?;
        let mut val = match val_path {
            Some(v) => Self::open(v)?,
            None => Self::open_tensors(path, "val_images", "val_labels").with_context(|| {
                format!(
                    "no validation data: give a validation file or put val_images and val_labels in {}",
                    path.display()
                )
            })?,
        };
        let classes = train.class_names.len().max(val.class_names.len());
        for d in [&mut train, &mut val] {
            let numbered = d
                .class_names
                .iter()
                .enumerate()
                .all(|(k, n)| *n == k.to_string());
            if numbered {
                d.class_names = (0..classes).map(|k| k.to_string()).collect();
            }
        }
        Ok((train, val))
    }
}

/// Integer tensor data (little-endian) widened to `i64`; `u64` values above
/// `i64::MAX` become -1 so the caller rejects them.
fn read_integers(dtype: Dtype, data: &[u8]) -> Result<Vec<i64>> {
    fn each<const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> i64) -> Vec<i64> {
        data.chunks_exact(N)
            .map(|b| f(b.try_into().expect("chunks_exact yields N bytes")))
            .collect()
    }
    Ok(match dtype {
        Dtype::U8 => each::<1>(data, |b| i64::from(b[0])),
        Dtype::I8 => each::<1>(data, |b| i64::from(i8::from_le_bytes(b))),
        Dtype::U16 => each::<2>(data, |b| i64::from(u16::from_le_bytes(b))),
        Dtype::I16 => each::<2>(data, |b| i64::from(i16::from_le_bytes(b))),
        Dtype::U32 => each::<4>(data, |b| i64::from(u32::from_le_bytes(b))),
        Dtype::I32 => each::<4>(data, |b| i64::from(i32::from_le_bytes(b))),
        Dtype::U64 => each::<8>(data, |b| i64::try_from(u64::from_le_bytes(b)).unwrap_or(-1)),
        Dtype::I64 => each::<8>(data, i64::from_le_bytes),
        other => bail!("has dtype {other:?}; expected an integer dtype"),
    })
}

impl Dataset for SafetensorsDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn classes(&self) -> usize {
        self.class_names.len()
    }

    fn class_names(&self) -> Vec<String> {
        self.class_names.clone()
    }

    fn image_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn get(&self, i: usize) -> Result<Sample> {
        let Some(&label) = self.labels.get(i) else {
            bail!(
                "{}: index {i} out of range (len {})",
                self.path.display(),
                self.labels.len()
            );
        };
        let size: usize = self.shape.iter().product();
        let pixels = match self.dtype {
            ImageDtype::U8 => {
                let start = self.offset + i * size;
                Pixels::U8(self.map[start..start + size].to_vec())
            }
            ImageDtype::F32 => {
                let start = self.offset + i * size * 4;
                Pixels::F32(
                    self.map[start..start + size * 4]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                )
            }
        };
        Ok(Sample { pixels, label })
    }

    fn describe(&self) -> String {
        format!(
            "safetensors {}: {} images ({:?}), {} classes, shape {:?}",
            self.path.display(),
            self.labels.len(),
            self.dtype,
            self.class_names.len(),
            self.shape
        )
    }
}
