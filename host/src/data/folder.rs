//! Image folders in ImageNet's layout: `DIR/train/<class>/*` and
//! `DIR/val/<class>/*`, with files ending in `.jpeg`, `.jpg` or `.png` (any
//! case; other files are ignored and counted).
//!
//! Classes are the sorted subfolder names of `DIR/train`; a validation
//! folder must name one of them. Every read decodes the file (format guessed
//! from its bytes, so a PNG named `.JPEG` still works), converts it to RGB,
//! resizes it so the shorter side is [`IMAGE_SIDE`] (bilinear, area-averaging
//! when shrinking) and takes the centre square, as in the paper. A file that
//! cannot be read or decoded, including a truncated JPEG (one with no
//! end-of-image marker after its last scan; the decoder itself would fill the
//! missing rows with grey), makes `get` return an error that the loader
//! counts and skips.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use image::imageops::FilterType;
use image::{ImageFormat, RgbImage};

use super::{Dataset, Pixels, Sample, Split};

/// Side of the square images folder datasets produce (the paper's 256).
pub const IMAGE_SIDE: usize = 256;

/// File extensions that are read as images (compared case-insensitively).
const IMAGE_EXTENSIONS: [&str; 3] = ["jpeg", "jpg", "png"];

/// One split of an image folder, decoded on every read.
#[derive(Debug, Clone)]
pub struct FolderDataset {
    dir: PathBuf,
    files: Vec<(PathBuf, i32)>,
    class_names: Vec<String>,
    side: usize,
    ignored: usize,
}

impl FolderDataset {
    /// Opens `root/train` or `root/val` with 256×256 output.
    pub fn open(root: &Path, split: Split) -> Result<Self> {
        Self::open_with_side(root, split, IMAGE_SIDE)
    }

    /// Opens a split with `side`×`side` output (shorter side resized to
    /// `side`, then centre crop).
    pub fn open_with_side(root: &Path, split: Split, side: usize) -> Result<Self> {
        if side == 0 {
            bail!(
                "folder dataset {}: image side must be positive",
                root.display()
            );
        }
        let class_names = list_classes(&root.join(Split::Train.name()))?;
        let dir = root.join(split.name());
        let (files, ignored) = list_split(&dir, &class_names)?;
        Ok(FolderDataset {
            dir,
            files,
            class_names,
            side,
            ignored,
        })
    }

    /// Files in the class folders whose extension is not an image's.
    pub fn ignored(&self) -> usize {
        self.ignored
    }

    /// The image files and their labels, in read order.
    pub fn files(&self) -> &[(PathBuf, i32)] {
        &self.files
    }
}

/// Sorted names of the subfolders of `dir` (the classes of a split).
pub fn list_classes(dir: &Path) -> Result<Vec<String>> {
    let entries = fs::read_dir(dir)
        .with_context(|| format!("cannot list class folders in {}", dir.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        if entry.path().is_dir() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                bail!(
                    "{}: class folder name {:?} is not valid UTF-8",
                    dir.display(),
                    name
                );
            };
            names.push(name.to_string());
        }
    }
    if names.is_empty() {
        bail!("{}: no class folders found", dir.display());
    }
    names.sort();
    Ok(names)
}

/// Lists the image files of one split folder with their labels (sorted by
/// class, then file name), and counts the non-image files skipped.
pub(crate) fn list_split(
    dir: &Path,
    class_names: &[String],
) -> Result<(Vec<(PathBuf, i32)>, usize)> {
    let present = list_classes(dir)?;
    let mut files = Vec::new();
    let mut ignored = 0;
    for name in present {
        let Some(label) = class_names.iter().position(|c| *c == name) else {
            bail!(
                "{}: class folder {name:?} is not one of the {} training classes",
                dir.display(),
                class_names.len()
            );
        };
        let class_dir = dir.join(&name);
        let mut class_files = Vec::new();
        for entry in fs::read_dir(&class_dir)
            .with_context(|| format!("cannot list {}", class_dir.display()))?
        {
            let path = entry
                .with_context(|| format!("cannot list {}", class_dir.display()))?
                .path();
            if !path.is_file() {
                continue;
            }
            let is_image = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)));
            if is_image {
                class_files.push(path);
            } else {
                ignored += 1;
            }
        }
        class_files.sort();
        files.extend(class_files.into_iter().map(|p| (p, label as i32)));
    }
    if files.is_empty() {
        bail!(
            "{}: no .jpeg/.jpg/.png files in its class folders",
            dir.display()
        );
    }
    Ok((files, ignored))
}

/// Decodes an encoded image (JPEG or PNG), converts it to RGB, resizes its
/// shorter side to `side` and returns the centre `side`×`side` square as
/// `[3, side, side]` bytes.
pub fn decode_resized(bytes: &[u8], side: usize) -> Result<Vec<u8>> {
    let format = image::guess_format(bytes).context("not a recognised image format")?;
    if format == ImageFormat::Jpeg && !jpeg_is_complete(bytes) {
        bail!("truncated JPEG (no end-of-image marker after the last scan)");
    }
    let image = image::load_from_memory_with_format(bytes, format)
        .with_context(|| format!("cannot decode {format:?} data"))?
        .to_rgb8();
    let (w, h) = (image.width() as usize, image.height() as usize);
    if w == 0 || h == 0 {
        bail!("image has zero size {w}x{h}");
    }
    let short = w.min(h);
    let new_w = ((w * side) as f64 / short as f64).round().max(side as f64) as u32;
    let new_h = ((h * side) as f64 / short as f64).round().max(side as f64) as u32;
    let resized: RgbImage = if (new_w, new_h) == (w as u32, h as u32) {
        image
    } else {
        image::imageops::resize(&image, new_w, new_h, FilterType::Triangle)
    };
    let x0 = (new_w as usize - side) / 2;
    let y0 = (new_h as usize - side) / 2;
    let raw = resized.as_raw();
    let row = new_w as usize * 3;
    let mut out = vec![0u8; 3 * side * side];
    for y in 0..side {
        let src = &raw[(y0 + y) * row + x0 * 3..(y0 + y) * row + (x0 + side) * 3];
        for (x, px) in src.chunks_exact(3).enumerate() {
            for c in 0..3 {
                out[c * side * side + y * side + x] = px[c];
            }
        }
    }
    Ok(out)
}

/// Whether a JPEG stream has an end-of-image marker (`FF D9`) after its last
/// start-of-scan marker (`FF DA`). Entropy-coded data never contains these
/// byte pairs (an `FF` there is followed by `00` or a restart marker), so a
/// file cut short inside its image data fails this test.
fn jpeg_is_complete(bytes: &[u8]) -> bool {
    let last = |second: u8| {
        bytes
            .windows(2)
            .rposition(|w| w[0] == 0xFF && w[1] == second)
    };
    match (last(0xDA), last(0xD9)) {
        (Some(sos), Some(eoi)) => eoi > sos,
        _ => false,
    }
}

/// Reads and decodes one file; errors name the file.
pub(crate) fn load_file(path: &Path, side: usize) -> Result<Vec<u8>> {
    let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    decode_resized(&bytes, side).with_context(|| format!("{}", path.display()))
}

impl Dataset for FolderDataset {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn classes(&self) -> usize {
        self.class_names.len()
    }

    fn class_names(&self) -> Vec<String> {
        self.class_names.clone()
    }

    fn image_shape(&self) -> [usize; 3] {
        [3, self.side, self.side]
    }

    fn get(&self, i: usize) -> Result<Sample> {
        let Some((path, label)) = self.files.get(i) else {
            bail!(
                "folder dataset {}: index {i} out of range (len {})",
                self.dir.display(),
                self.files.len()
            );
        };
        Ok(Sample {
            pixels: Pixels::U8(load_file(path, self.side)?),
            label: *label,
        })
    }

    fn describe(&self) -> String {
        format!(
            "image folder {}: {} images, {} classes, decoded to [3, {}, {}]{}",
            self.dir.display(),
            self.files.len(),
            self.class_names.len(),
            self.side,
            self.side,
            if self.ignored > 0 {
                format!(", {} non-image files ignored", self.ignored)
            } else {
                String::new()
            }
        )
    }
}
