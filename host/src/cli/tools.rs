//! `host prepare` (pack an image folder for fast loading) and
//! `host show-filters` (a conv layer's filters as a PNG grid, like Figure 3
//! of the AlexNet paper).

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::checkpoint;
use crate::data;
use crate::report::filter_grid_png;

/// Skipped files named in `host prepare`'s report; the rest are counted
/// (all are listed in the output's `index.json`).
const SKIPPED_SHOWN: usize = 5;

/// `host prepare SRC DST`: decodes the image folder `SRC`
/// (`train/<class>/*`, `val/<class>/*`) once into a packed dataset in `DST`
/// with `side`×`side` images, and prints what was written and skipped.
pub fn prepare(src: &Path, dst: &Path, side: usize) -> Result<data::PrepareReport> {
    if !src.is_dir() {
        bail!(
            "{}: not a directory (expected an image folder with train/<class>/* and val/<class>/*)",
            src.display()
        );
    }
    let report = data::prepare_with_side(src, dst, side)?;
    println!(
        "packed {} into {} ({side}×{side} images)",
        src.display(),
        dst.display()
    );
    println!(
        "  train: {} images, val: {} images, {} classes",
        report.train, report.val, report.classes
    );
    println!("  skipped (could not be decoded): {}", report.skipped.len());
    for s in report.skipped.iter().take(SKIPPED_SHOWN) {
        println!("    {}: {}", s.path.display(), s.error);
    }
    if report.skipped.len() > SKIPPED_SHOWN {
        println!(
            "    ... and {} more (all listed in {})",
            report.skipped.len() - SKIPPED_SHOWN,
            dst.join("index.json").display()
        );
    }
    if report.ignored > 0 {
        println!("  ignored (not .jpeg/.jpg/.png): {} files", report.ignored);
    }
    Ok(report)
}

/// `host show-filters CKPT --out PNG`: draws the filters of conv layer
/// `layer` (weights `[out, in, kh, kw]`, `in` 1 or 3) from any safetensors
/// file (a checkpoint or exported PyTorch weights) as a grid upscaled
/// `scale` times. Returns the image's `(width, height)`.
pub fn show_filters(checkpoint: &Path, out: &Path, layer: &str, scale: u32) -> Result<(u32, u32)> {
    let tensors = checkpoint::load_tensors(checkpoint)?;
    let name = format!("{layer}.weight");
    let Some(weights) = tensors.iter().find(|t| t.name == name) else {
        let convs: Vec<&str> = tensors
            .iter()
            .filter(|t| t.shape.len() == 4)
            .filter_map(|t| t.name.strip_suffix(".weight"))
            .collect();
        bail!(
            "{}: no tensor {name}; conv layers in it: {}",
            checkpoint.display(),
            if convs.is_empty() {
                "none".to_string()
            } else {
                convs.join(", ")
            }
        );
    };
    let Ok(shape) = <[usize; 4]>::try_from(weights.shape.as_slice()) else {
        bail!(
            "{}: {name} has shape {:?}, not a conv layer's [out, in, kh, kw]",
            checkpoint.display(),
            weights.shape
        );
    };
    let (w, h) = filter_grid_png(&weights.data, shape, out, scale)
        .with_context(|| format!("layer {layer} of {}", checkpoint.display()))?;
    println!(
        "wrote {}: {w}×{h}, {} filters of {}×{}×{} from {layer}",
        out.display(),
        shape[0],
        shape[1],
        shape[2],
        shape[3]
    );
    Ok((w, h))
}
