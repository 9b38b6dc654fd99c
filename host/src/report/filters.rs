//! conv1 filters as an image grid, like Figure 3 of the AlexNet paper.
//!
//! Each filter `[in, kh, kw]` (in = 3: RGB, in = 1: grey) is stretched to
//! 0..=255 by its own min and max over all its channels, so colour balance
//! within a filter is kept while filters of different magnitude stay
//! visible. Filters are laid out row-major with 1-pixel white gaps between
//! them, and the whole grid is upscaled by an integer factor with
//! nearest-neighbour sampling (11×11 filters are too small to see as is).

use anyhow::{Result, anyhow, bail};
use image::{ImageFormat, Rgb, RgbImage};
use std::path::Path;

/// Refuse images over 100 megapixels (a mistyped scale, not a plot).
const MAX_PIXELS: u64 = 100_000_000;

/// Grid `(rows, cols)` for `n` filters: the smallest divisor of `n` that is
/// at least `sqrt(n)` as the column count when it keeps the grid within 2:1
/// (a full rectangle, e.g. 96 → 8×12), otherwise `ceil(sqrt(n))` columns.
pub fn filter_grid_layout(n: usize) -> (usize, usize) {
    if n == 0 {
        return (0, 0);
    }
    let root = (n as f64).sqrt();
    let cols = (1..=n)
        .find(|&c| n.is_multiple_of(c) && c as f64 >= root)
        .filter(|&c| c as f64 <= 2.0 * root)
        .unwrap_or(root.ceil() as usize);
    (n.div_ceil(cols), cols)
}

/// Writes the filters in `weights` (layout `shape = [out, in, kh, kw]`,
/// `in` 1 or 3) as a PNG grid to `path`, upscaled `scale` times. Returns the
/// image's `(width, height)`: `(cols·kw + cols − 1)·scale` by
/// `(rows·kh + rows − 1)·scale`, with `(rows, cols)` from
/// [`filter_grid_layout`].
pub fn filter_grid_png(
    weights: &[f32],
    shape: [usize; 4],
    path: &Path,
    scale: u32,
) -> Result<(u32, u32)> {
    let [out, ch, kh, kw] = shape;
    let p = path.display();
    if ch != 1 && ch != 3 {
        bail!("{p}: filters have {ch} input channels, only 1 (grey) or 3 (RGB) can be drawn");
    }
    if out == 0 || kh == 0 || kw == 0 {
        bail!("{p}: nothing to draw for filter shape {shape:?}");
    }
    if scale == 0 {
        bail!("{p}: scale must be at least 1, got 0");
    }
    let per_filter = ch * kh * kw;
    if out.checked_mul(per_filter) != Some(weights.len()) {
        bail!(
            "{p}: {} weights do not match filter shape {shape:?}",
            weights.len()
        );
    }

    let (rows, cols) = filter_grid_layout(out);
    let base_w = cols * kw + cols - 1;
    let base_h = rows * kh + rows - 1;
    let dim = |base: usize| {
        u32::try_from(base)
            .ok()
            .and_then(|b| b.checked_mul(scale))
            .ok_or_else(|| anyhow!("{p}: grid of {shape:?} at scale {scale} is too large"))
    };
    let (width, height) = (dim(base_w)?, dim(base_h)?);
    if u64::from(width) * u64::from(height) > MAX_PIXELS {
        bail!("{p}: a {width}x{height} image is too large; use a smaller scale");
    }

    let mut base = RgbImage::from_pixel(base_w as u32, base_h as u32, Rgb([255, 255, 255]));
    for (f, filter) in weights.chunks_exact(per_filter).enumerate() {
        let (lo, hi) = filter
            .iter()
            .filter(|v| v.is_finite())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let to_u8 = |v: f32| -> u8 {
            if !v.is_finite() {
                0
            } else if hi > lo {
                ((v - lo) / (hi - lo) * 255.0).round().clamp(0.0, 255.0) as u8
            } else {
                128
            }
        };
        let (x0, y0) = ((f % cols) * (kw + 1), (f / cols) * (kh + 1));
        for y in 0..kh {
            for x in 0..kw {
                let at = |c: usize| to_u8(filter[(c * kh + y) * kw + x]);
                let px = if ch == 3 {
                    Rgb([at(0), at(1), at(2)])
                } else {
                    Rgb([at(0); 3])
                };
                base.put_pixel((x0 + x) as u32, (y0 + y) as u32, px);
            }
        }
    }

    let img = if scale == 1 {
        base
    } else {
        RgbImage::from_fn(width, height, |x, y| *base.get_pixel(x / scale, y / scale))
    };
    img.save_with_format(path, ImageFormat::Png)
        .map_err(|e| anyhow!("{p}: cannot write PNG: {e}"))?;
    Ok((width, height))
}
