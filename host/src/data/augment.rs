//! Per-sample augmentation on the CPU: crop, mirror, PCA colour noise and
//! normalisation, writing `f32` `[C, crop, crop]` network input.
//!
//! Pixel units: augmentation reads every pixel in `[0, 1]` units (bytes are
//! divided by 255; float sources are taken as they are). PCA noise, the mean
//! and the std are in those units too. The result is
//! `scale · (x + pca_c − mean_c) / std_c`, one affine map per channel fused
//! into the crop copy. `scale` 255 with the ImageNet mean and no std gives
//! the byte-valued, mean-subtracted inputs of the original cuda-convnet
//! AlexNet (what its N(0, 0.01²) initialisation was tuned for); scale 1 with
//! mean and std gives the torchvision convention.
//!
//! PCA colour noise (Krizhevsky et al. 2012, §4.1): draw `α ~ N(0, σ²)` per
//! principal component and add `Σ_j eigvec[:, j] · α_j · eigval_j` to every
//! pixel's RGB value. It applies to 3-channel images only; for other channel
//! counts it is left out.
//!
//! Random erasing (Zhong et al. 2017, "Random Erasing Data Augmentation"):
//! with probability `erase`, one rectangle of the crop covering 2–40% of its
//! area, aspect ratio in [0.3, 3.3] (log-uniform), is filled with uniform
//! random pixel values (`[0, 1]` units, through the same affine map).
//!
//! Randomness: one sample's crop offsets, mirror flag, α and erasing draws
//! come from the generator the caller passes, drawn in that order, so a
//! seeded generator gives the same output every time.

use anyhow::{Result, bail};
use rand::Rng;
use rand_distr::{Distribution, Normal};

use super::{Pixels, Sample};

/// ImageNet per-channel RGB mean, `[0, 1]` units.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet per-channel RGB standard deviation, `[0, 1]` units.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// Eigenvalues of the RGB covariance of ImageNet pixels (`[0, 1]` units),
/// largest first.
pub const IMAGENET_PCA_EIGVAL: [f32; 3] = [0.2175, 0.0188, 0.0045];
/// The matching eigenvectors, one per column: `IMAGENET_PCA_EIGVEC[c][j]` is
/// component `c` (R, G, B) of eigenvector `j`.
pub const IMAGENET_PCA_EIGVEC: [[f32; 3]; 3] = [
    [-0.5675, 0.7192, 0.4009],
    [-0.5808, -0.0045, -0.8140],
    [-0.5836, -0.6948, 0.4203],
];

/// The paper's ten test views, in output order: (corner, mirrored). Corners
/// are top-left, top-right, bottom-left, bottom-right, centre; the five
/// mirrored views follow the five plain ones.
pub const TEN_VIEWS: [(Corner, bool); 10] = [
    (Corner::TopLeft, false),
    (Corner::TopRight, false),
    (Corner::BottomLeft, false),
    (Corner::BottomRight, false),
    (Corner::Centre, false),
    (Corner::TopLeft, true),
    (Corner::TopRight, true),
    (Corner::BottomLeft, true),
    (Corner::BottomRight, true),
    (Corner::Centre, true),
];

/// Where a fixed crop sits in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corner {
    TopLeft,
    TopRight,
    BottomLeft,
    BottomRight,
    Centre,
}

/// Per-channel normalisation applied after cropping and colour noise.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalize {
    /// Subtracted per channel (`[0, 1]` units); empty for none, one value
    /// for every channel, or one per channel.
    pub mean: Vec<f32>,
    /// Divided per channel after the mean; empty for none, one value, or
    /// one per channel. Values must be positive.
    pub std: Vec<f32>,
    /// Multiplies the result: 1 keeps `[0, 1]` units, 255 gives byte units.
    pub scale: f32,
}

impl Normalize {
    /// Pixels in `[0, 1]`, nothing subtracted.
    pub fn unit() -> Self {
        Normalize {
            mean: Vec::new(),
            std: Vec::new(),
            scale: 1.0,
        }
    }

    /// The original AlexNet's inputs: byte units with the ImageNet mean
    /// subtracted, no std division.
    pub fn alexnet() -> Self {
        Normalize {
            mean: IMAGENET_MEAN.to_vec(),
            std: Vec::new(),
            scale: 255.0,
        }
    }

    /// torchvision's convention: `(x − mean) / std` in `[0, 1]` units.
    pub fn imagenet_standard() -> Self {
        Normalize {
            mean: IMAGENET_MEAN.to_vec(),
            std: IMAGENET_STD.to_vec(),
            scale: 1.0,
        }
    }

    fn per_channel(values: &[f32], c: usize, default: f32) -> f32 {
        match values.len() {
            0 => default,
            1 => values[0],
            _ => values[c],
        }
    }
}

/// What to do to one sample; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct Augment {
    /// Output side: every view is `crop`×`crop` (at most the image's H and W).
    pub crop: usize,
    /// Random crop position (training) instead of the centre.
    pub random_crop: bool,
    /// Mirror left-right with probability 0.5.
    pub flip: bool,
    /// σ of the PCA colour noise; 0 turns it off.
    pub pca_sigma: f32,
    pub normalize: Normalize,
    /// Zero padding added on every side before a random crop (training
    /// only; the CIFAR-style pad-and-crop used for small images).
    pub pad: usize,
    /// Probability of random erasing (training only); 0 turns it off.
    pub erase: f32,
}

impl Augment {
    /// The paper's training augmentation: random `crop` square, mirror, PCA
    /// noise with σ = 0.1, and `normalize`.
    pub fn train(crop: usize, normalize: Normalize) -> Self {
        Augment {
            crop,
            random_crop: true,
            flip: true,
            pca_sigma: 0.1,
            normalize,
            pad: 0,
            erase: 0.0,
        }
    }

    /// Centre `crop` square and `normalize`, nothing random.
    pub fn eval(crop: usize, normalize: Normalize) -> Self {
        Augment {
            crop,
            random_crop: false,
            flip: false,
            pca_sigma: 0.0,
            normalize,
            pad: 0,
            erase: 0.0,
        }
    }

    /// The same crop size and normalisation with the randomness removed.
    pub fn without_randomness(&self) -> Self {
        Augment::eval(self.crop, self.normalize.clone())
    }

    /// Output shape `[C, crop, crop]` for stored images of `shape`, or an
    /// error naming what does not fit.
    pub fn output_shape(&self, shape: [usize; 3]) -> Result<[usize; 3]> {
        let [c, h, w] = shape;
        if self.crop == 0 || self.crop > h || self.crop > w {
            bail!(
                "crop {} does not fit images of shape [C, H, W] = {shape:?}",
                self.crop
            );
        }
        for (name, values) in [("mean", &self.normalize.mean), ("std", &self.normalize.std)] {
            if values.len() > 1 && values.len() != c {
                bail!(
                    "normalisation {name} has {} values but images have {c} channels",
                    values.len()
                );
            }
        }
        if let Some(s) = self
            .normalize
            .std
            .iter()
            .find(|s| !s.is_finite() || **s <= 0.0)
        {
            bail!("normalisation std {s} must be positive");
        }
        if !self.normalize.scale.is_finite() || self.normalize.scale == 0.0 {
            bail!(
                "normalisation scale {} must be finite and non-zero",
                self.normalize.scale
            );
        }
        if !self.pca_sigma.is_finite() || self.pca_sigma < 0.0 {
            bail!("PCA noise sigma {} must be non-negative", self.pca_sigma);
        }
        if !(0.0..=1.0).contains(&self.erase) {
            bail!(
                "random erasing probability {} must be in [0, 1]",
                self.erase
            );
        }
        Ok([c, self.crop, self.crop])
    }

    /// Augments `sample` (stored as `shape`) into `out` (`C·crop·crop`
    /// values), drawing crop offsets, mirror and PCA α from `rng`.
    pub fn apply<R: Rng>(
        &self,
        sample: &Sample,
        shape: [usize; 3],
        rng: &mut R,
        out: &mut [f32],
    ) -> Result<()> {
        if self.random_crop && self.pad > 0 {
            let (padded, padded_shape) = pad_sample(sample, shape, self.pad)?;
            let unpadded = Augment {
                pad: 0,
                ..self.clone()
            };
            return unpadded.apply(&padded, padded_shape, rng, out);
        }
        let [c, h, w] = shape;
        self.output_shape(shape)?;
        let (y0, x0) = if self.random_crop {
            (
                rng.random_range(0..=h - self.crop),
                rng.random_range(0..=w - self.crop),
            )
        } else {
            ((h - self.crop) / 2, (w - self.crop) / 2)
        };
        let mirror = self.flip && rng.random_bool(0.5);
        let mut shift = vec![0.0f32; c];
        if self.pca_sigma > 0.0 && c == 3 {
            let normal = Normal::new(0.0f32, self.pca_sigma)
                .map_err(|e| anyhow::anyhow!("PCA noise sigma {}: {e}", self.pca_sigma))?;
            let alpha: [f32; 3] = std::array::from_fn(|_| normal.sample(rng));
            for (ch, s) in shift.iter_mut().enumerate() {
                *s = (0..3)
                    .map(|j| IMAGENET_PCA_EIGVEC[ch][j] * alpha[j] * IMAGENET_PCA_EIGVAL[j])
                    .sum();
            }
        }
        self.crop_into(sample, shape, y0, x0, mirror, &shift, out)?;
        if self.erase > 0.0 && rng.random_bool(f64::from(self.erase)) {
            self.erase_rectangle(c, rng, out);
        }
        Ok(())
    }

    /// Fills one random rectangle of the `[c, crop, crop]` view `out` with
    /// uniform random pixels (see the module docs); up to ten draws for a
    /// rectangle that fits, none if all miss.
    fn erase_rectangle<R: Rng>(&self, c: usize, rng: &mut R, out: &mut [f32]) {
        let crop = self.crop;
        let area = (crop * crop) as f32;
        for _ in 0..10 {
            let target = area * rng.random_range(0.02f32..0.4);
            let ratio = rng.random_range(0.3f32.ln()..3.3f32.ln()).exp();
            let eh = (target * ratio).sqrt().round() as usize;
            let ew = (target / ratio).sqrt().round() as usize;
            if eh == 0 || ew == 0 || eh > crop || ew > crop {
                continue;
            }
            let y0 = rng.random_range(0..=crop - eh);
            let x0 = rng.random_range(0..=crop - ew);
            let norm = &self.normalize;
            for ch in 0..c {
                let a = norm.scale / Normalize::per_channel(&norm.std, ch, 1.0);
                let b = -Normalize::per_channel(&norm.mean, ch, 0.0) * a;
                let plane = &mut out[ch * crop * crop..(ch + 1) * crop * crop];
                for row in plane.chunks_exact_mut(crop).skip(y0).take(eh) {
                    for v in &mut row[x0..x0 + ew] {
                        *v = rng.random::<f32>() * a + b;
                    }
                }
            }
            return;
        }
    }

    /// Writes the ten test views of `sample` (see [`TEN_VIEWS`]) into `out`
    /// (`10·C·crop·crop` values), normalised, without colour noise.
    pub fn ten_views_into(
        &self,
        sample: &Sample,
        shape: [usize; 3],
        out: &mut [f32],
    ) -> Result<()> {
        let [c, h, w] = self.output_shape(shape)?;
        let view_len = c * h * w;
        if out.len() != 10 * view_len {
            bail!(
                "ten views need {} values, the buffer holds {}",
                10 * view_len,
                out.len()
            );
        }
        let shift = vec![0.0f32; c];
        for (view, (corner, mirror)) in out.chunks_exact_mut(view_len).zip(TEN_VIEWS) {
            let (y0, x0) = self.corner_offset(shape, corner);
            self.crop_into(sample, shape, y0, x0, mirror, &shift, view)?;
        }
        Ok(())
    }

    /// The ten test views of `sample` as `[10, C, crop, crop]`.
    pub fn ten_views(&self, sample: &Sample, shape: [usize; 3]) -> Result<Vec<f32>> {
        let [c, h, w] = self.output_shape(shape)?;
        let mut out = vec![0.0; 10 * c * h * w];
        self.ten_views_into(sample, shape, &mut out)?;
        Ok(out)
    }

    /// Top-left offset `(y0, x0)` of the crop at `corner`.
    pub fn corner_offset(&self, shape: [usize; 3], corner: Corner) -> (usize, usize) {
        let (dy, dx) = (
            shape[1].saturating_sub(self.crop),
            shape[2].saturating_sub(self.crop),
        );
        match corner {
            Corner::TopLeft => (0, 0),
            Corner::TopRight => (0, dx),
            Corner::BottomLeft => (dy, 0),
            Corner::BottomRight => (dy, dx),
            Corner::Centre => (dy / 2, dx / 2),
        }
    }

    /// Copies the `crop`×`crop` window at `(y0, x0)`, mirrored if asked,
    /// through each channel's affine map `scale · (x + shift − mean) / std`.
    #[allow(clippy::too_many_arguments)]
    fn crop_into(
        &self,
        sample: &Sample,
        shape: [usize; 3],
        y0: usize,
        x0: usize,
        mirror: bool,
        shift: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let [c, h, w] = shape;
        if sample.pixels.len() != c * h * w {
            bail!(
                "sample has {} pixel values but shape {shape:?} needs {}",
                sample.pixels.len(),
                c * h * w
            );
        }
        let crop = self.crop;
        if out.len() != c * crop * crop {
            bail!(
                "output buffer holds {} values but a {crop}x{crop} crop of {c} channels needs {}",
                out.len(),
                c * crop * crop
            );
        }
        let norm = &self.normalize;
        for ch in 0..c {
            let a = norm.scale / Normalize::per_channel(&norm.std, ch, 1.0);
            let b = (shift[ch] - Normalize::per_channel(&norm.mean, ch, 0.0)) * a;
            let plane = &mut out[ch * crop * crop..(ch + 1) * crop * crop];
            for (y, row) in plane.chunks_exact_mut(crop).enumerate() {
                let start = ch * h * w + (y0 + y) * w + x0;
                match &sample.pixels {
                    Pixels::U8(v) => {
                        let a = a / 255.0;
                        copy_row(&v[start..start + crop], row, mirror, |p| {
                            f32::from(p) * a + b
                        })
                    }
                    Pixels::F32(v) => copy_row(&v[start..start + crop], row, mirror, |p| p * a + b),
                }
            }
        }
        Ok(())
    }
}

/// `sample` with `pad` zeros added on every side of each plane.
fn pad_sample(sample: &Sample, shape: [usize; 3], pad: usize) -> Result<(Sample, [usize; 3])> {
    let [c, h, w] = shape;
    if sample.pixels.len() != c * h * w {
        bail!(
            "sample has {} pixel values but shape {shape:?} needs {}",
            sample.pixels.len(),
            c * h * w
        );
    }
    let (ph, pw) = (h + 2 * pad, w + 2 * pad);
    fn grow<T: Copy + Default>(v: &[T], c: usize, h: usize, w: usize, pad: usize) -> Vec<T> {
        let (ph, pw) = (h + 2 * pad, w + 2 * pad);
        let mut out = vec![T::default(); c * ph * pw];
        for ch in 0..c {
            for y in 0..h {
                let src = &v[(ch * h + y) * w..][..w];
                out[(ch * ph + y + pad) * pw + pad..][..w].copy_from_slice(src);
            }
        }
        out
    }
    let pixels = match &sample.pixels {
        Pixels::U8(v) => Pixels::U8(grow(v, c, h, w, pad)),
        Pixels::F32(v) => Pixels::F32(grow(v, c, h, w, pad)),
    };
    Ok((
        Sample {
            pixels,
            label: sample.label,
        },
        [c, ph, pw],
    ))
}

fn copy_row<T: Copy>(src: &[T], dst: &mut [f32], mirror: bool, f: impl Fn(T) -> f32) {
    if mirror {
        for (d, &s) in dst.iter_mut().zip(src.iter().rev()) {
            *d = f(s);
        }
    } else {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f(s);
        }
    }
}
