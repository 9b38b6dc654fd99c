//! A folder dataset decoded once into raw bytes, memory-mapped at read time.
//!
//! [`prepare`] reads `SRC/{train,val}/<class>/*` (see [`FolderDataset`]),
//! decodes and resizes every file in parallel (rayon), and writes to `DST`:
//! - `train.u8`, `val.u8`: sample after sample, each `[3, side, side]` bytes
//!   (channel-major, the order [`Sample`] uses), with no header: sample `i`
//!   starts at byte `i · 3 · side · side`;
//! - `index.json`: the format tag, the shape, the class names, per split the
//!   data file, the sample count and the labels, and the files that were
//!   skipped because they could not be decoded, with the reason.
//!
//! Data files are written under a temporary name and renamed when complete,
//! and `index.json` is written last, so an interrupted prepare never leaves
//! a directory that [`Packed::open`] accepts. Reading is a bounds-checked copy
//! out of the mapping: no decoding, so the loader's cost per sample is the
//! augmentation alone.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::folder::{IMAGE_SIDE, list_classes, list_split, load_file};
use super::{Dataset, Pixels, Sample, Split};

/// Tag stored in `index.json`; bumped if the layout ever changes.
const FORMAT: &str = "alexnet-packed-v1";
/// Files decoded in parallel before their bytes are written, in order.
const CHUNK: usize = 512;

#[derive(Debug, Serialize, Deserialize)]
struct Index {
    format: String,
    /// `[C, H, W]` of every sample.
    shape: [usize; 3],
    class_names: Vec<String>,
    train: SplitIndex,
    val: SplitIndex,
    skipped: Vec<SkippedFile>,
}

#[derive(Debug, Serialize, Deserialize)]
struct SplitIndex {
    file: String,
    count: usize,
    labels: Vec<i32>,
}

/// A source file left out of a packed dataset, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SkippedFile {
    pub path: PathBuf,
    pub error: String,
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareReport {
    pub train: usize,
    pub val: usize,
    pub classes: usize,
    /// Files that could not be decoded (also listed in `index.json`).
    pub skipped: Vec<SkippedFile>,
    /// Files in class folders whose extension is not an image's.
    pub ignored: usize,
}

/// Packs `src` (ImageNet layout) into `dst` at 256×256; see the module docs.
pub fn prepare(src: &Path, dst: &Path) -> Result<PrepareReport> {
    prepare_with_side(src, dst, IMAGE_SIDE)
}

/// [`prepare`] with `side`×`side` images.
pub fn prepare_with_side(src: &Path, dst: &Path, side: usize) -> Result<PrepareReport> {
    if side == 0 {
        bail!("prepare {}: image side must be positive", src.display());
    }
    let class_names = list_classes(&src.join(Split::Train.name()))?;
    fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
    let index_path = dst.join("index.json");
    if index_path.exists() {
        fs::remove_file(&index_path)
            .with_context(|| format!("cannot remove the old {}", index_path.display()))?;
    }
    // List both splits before decoding anything, so a bad validation folder
    // fails at once rather than after the training set has been packed.
    let (train_files, train_ignored) = list_split(&src.join(Split::Train.name()), &class_names)?;
    let (val_files, val_ignored) = list_split(&src.join(Split::Val.name()), &class_names)?;
    let mut skipped = Vec::new();
    let train = pack_split(&train_files, side, dst, Split::Train, &mut skipped)?;
    let val = pack_split(&val_files, side, dst, Split::Val, &mut skipped)?;
    let report = PrepareReport {
        train: train.count,
        val: val.count,
        classes: class_names.len(),
        skipped: skipped.clone(),
        ignored: train_ignored + val_ignored,
    };
    let index = Index {
        format: FORMAT.to_string(),
        shape: [3, side, side],
        class_names,
        train,
        val,
        skipped,
    };
    let tmp = dst.join("index.json.partial");
    fs::write(&tmp, serde_json::to_vec_pretty(&index)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, &index_path).with_context(|| {
        format!(
            "cannot rename {} to {}",
            tmp.display(),
            index_path.display()
        )
    })?;
    Ok(report)
}

/// Decodes `files` in parallel chunks and appends the good ones, in order,
/// to `dst/<split>.u8`.
fn pack_split(
    files: &[(PathBuf, i32)],
    side: usize,
    dst: &Path,
    split: Split,
    skipped: &mut Vec<SkippedFile>,
) -> Result<SplitIndex> {
    let name = format!("{}.u8", split.name());
    let path = dst.join(&name);
    let tmp = dst.join(format!("{name}.partial"));
    let mut out = BufWriter::new(
        File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?,
    );
    let progress = indicatif::ProgressBar::new(files.len() as u64)
        .with_message(format!("packing {} images", split.name()));
    let mut labels = Vec::with_capacity(files.len());
    for chunk in files.chunks(CHUNK) {
        let decoded: Vec<Result<Vec<u8>>> = chunk
            .par_iter()
            .map(|(file, _)| load_file(file, side))
            .collect();
        for ((file, label), result) in chunk.iter().zip(decoded) {
            match result {
                Ok(bytes) => {
                    out.write_all(&bytes)
                        .with_context(|| format!("cannot write {}", tmp.display()))?;
                    labels.push(*label);
                }
                Err(e) => skipped.push(SkippedFile {
                    path: file.clone(),
                    error: format!("{e:#}"),
                }),
            }
        }
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    out.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, &path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    Ok(SplitIndex {
        file: name,
        count: labels.len(),
        labels,
    })
}

/// One split of a packed dataset, memory-mapped.
#[derive(Debug)]
pub struct Packed {
    map: Option<Mmap>,
    labels: Vec<i32>,
    shape: [usize; 3],
    class_names: Vec<String>,
    skipped_at_prepare: usize,
    path: PathBuf,
}

impl Packed {
    /// Opens `dir/index.json` and maps the split's data file, checking that
    /// its size matches the index.
    pub fn open(dir: &Path, split: Split) -> Result<Self> {
        let index_path = dir.join("index.json");
        let text = fs::read_to_string(&index_path).with_context(|| {
            format!(
                "cannot read {} (run prepare on the image folder first)",
                index_path.display()
            )
        })?;
        let index: Index = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a packed-dataset index", index_path.display()))?;
        if index.format != FORMAT {
            bail!(
                "{}: format {:?} is not {FORMAT:?}",
                index_path.display(),
                index.format
            );
        }
        let entry = match split {
            Split::Train => index.train,
            Split::Val => index.val,
        };
        if entry.labels.len() != entry.count {
            bail!(
                "{}: {} split has count {} but {} labels",
                index_path.display(),
                split.name(),
                entry.count,
                entry.labels.len()
            );
        }
        let classes = index.class_names.len();
        if let Some(pos) = entry
            .labels
            .iter()
            .position(|&l| l < 0 || l as usize >= classes)
        {
            bail!(
                "{}: {} label {} at index {pos} is not in 0..{classes}",
                index_path.display(),
                split.name(),
                entry.labels[pos]
            );
        }
        let path = dir.join(&entry.file);
        let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let expected = entry.count as u64 * index.shape.iter().product::<usize>() as u64;
        let actual = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        if actual != expected {
            bail!(
                "{}: {actual} bytes, but the index describes {} samples of {:?} = {expected} bytes",
                path.display(),
                entry.count,
                index.shape
            );
        }
        // An empty file cannot be mapped on every platform; nothing to read anyway.
        let map = if actual == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only; prepare never rewrites a
            // finished data file in place (it writes a new file and renames).
            Some(
                unsafe { Mmap::map(&file) }
                    .with_context(|| format!("cannot map {}", path.display()))?,
            )
        };
        Ok(Packed {
            map,
            labels: entry.labels,
            shape: index.shape,
            class_names: index.class_names,
            skipped_at_prepare: index.skipped.len(),
            path,
        })
    }

    /// Files that prepare could not decode (both splits).
    pub fn skipped_at_prepare(&self) -> usize {
        self.skipped_at_prepare
    }
}

impl Dataset for Packed {
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
        let (Some(&label), Some(map)) = (self.labels.get(i), self.map.as_ref()) else {
            bail!(
                "{}: index {i} out of range (len {})",
                self.path.display(),
                self.labels.len()
            );
        };
        let size: usize = self.shape.iter().product();
        Ok(Sample {
            pixels: Pixels::U8(map[i * size..(i + 1) * size].to_vec()),
            label,
        })
    }

    fn describe(&self) -> String {
        format!(
            "packed {}: {} images, {} classes, shape {:?}",
            self.path.display(),
            self.labels.len(),
            self.class_names.len(),
            self.shape
        )
    }
}
