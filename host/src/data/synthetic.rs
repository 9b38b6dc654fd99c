//! Procedural labelled images, generated on the fly from `(seed, split, index)`.
//!
//! Each class is a prototype: an orientation, a spatial frequency, a colour
//! (per-channel weights of the grating) and a faint background tint. A sample
//! draws its class, then a sinusoidal grating of that class with random phase,
//! a little orientation jitter, a Gaussian window at a jittered position, a
//! random brightness and per-pixel Gaussian noise. The tint makes class means
//! differ (a linear model gets a little above chance); orientation and
//! frequency need spatial filters, which is what a convolutional network
//! learns, so accuracy starts near chance and climbs. Class prototypes depend
//! on the seed only, so the train and validation splits share them while
//! their samples differ. `get(i)` computes the image from scratch, unless
//! the set was made with [`Synthetic::cached`]: then each image is kept in
//! memory the first time it is made (about 1 ms of a core for 256×256×3)
//! and later epochs only copy it, within a memory budget shared by all
//! cached sets ([`cache_budget`]).

use std::f32::consts::PI;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{Result, bail};
use rand::Rng;

use super::{Dataset, Pixels, Sample, Split, rng_for};

/// Stream tags, so class prototypes and samples never share a random stream.
const TAG_CLASS: u64 = 0x5359_4e5f_434c_4153;
const TAG_SAMPLE: u64 = 0x5359_4e5f_5341_4d50;

/// Distinct orientations before classes start to differ by frequency.
const ORIENTATIONS: usize = 8;
/// Grating frequencies, in cycles across the image width.
const FREQUENCIES: [f32; 3] = [2.0, 3.5, 5.5];
/// Standard deviation of the per-pixel noise, in `[0, 1]` units.
const NOISE_STD: f32 = 0.12;

/// Per-pixel noise, mean 0 and standard deviation `NOISE_STD`: the sum of
/// four 16-bit uniforms from one SplitMix64 draw (Irwin–Hall, close to a
/// Gaussian). A sample's generator seeds it once; drawing a Gaussian from the
/// sample's ChaCha stream for each of 200k pixels made the synthetic set the
/// slowest part of a training step.
struct PixelNoise {
    state: u64,
}

impl PixelNoise {
    fn new(seed: u64) -> Self {
        PixelNoise { state: seed }
    }

    #[inline]
    fn next(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let sum = (z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48);
        // Four U(0, 1): mean 2, variance 4/12.
        let u = sum as f32 / 65536.0;
        (u - 2.0) * (NOISE_STD / (1.0f32 / 3.0).sqrt())
    }
}

#[derive(Debug, Clone)]
struct Prototype {
    angle: f32,
    cycles: f32,
    colour: Vec<f32>,
    tint: Vec<f32>,
}

/// Procedural oriented-grating images; see the module docs.
#[derive(Debug, Clone)]
pub struct Synthetic {
    len: usize,
    shape: [usize; 3],
    seed: u64,
    split: Split,
    prototypes: Vec<Prototype>,
    /// Images made so far, where the set is cached (shared by clones).
    cache: Option<Arc<Cache>>,
}

/// Upper bound of the memory all cached synthetic sets may hold together.
const CACHE_MAX: usize = 8 << 30;

/// Bytes reserved by the cached sets alive now.
static CACHE_RESERVED: AtomicUsize = AtomicUsize::new(0);

/// The memory all cached sets together may hold: [`CACHE_MAX`] or half of
/// what the system reports available when the first set asks, whichever
/// is less (nothing where the figure cannot be read: no Linux
/// `/proc/meminfo`).
pub fn cache_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let available_kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| {
                let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
                line.split_whitespace().nth(1)?.parse::<usize>().ok()
            })
            .unwrap_or(0);
        (available_kib.saturating_mul(1024) / 2).min(CACHE_MAX)
    })
}

/// A cached set's images (pixels and label), each filled on first use; its
/// share of [`CACHE_RESERVED`] is given back when the last clone drops.
struct Cache {
    images: Vec<OnceLock<(Box<[u8]>, i32)>>,
    bytes: usize,
}

impl Drop for Cache {
    fn drop(&mut self) {
        CACHE_RESERVED.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let made = self.images.iter().filter(|i| i.get().is_some()).count();
        write!(
            f,
            "Cache({made} of {} images, {} bytes)",
            self.images.len(),
            self.bytes
        )
    }
}

impl Synthetic {
    /// `len` images of `shape` `[C, H, W]` in `classes` classes. The split
    /// picks a disjoint sample stream; prototypes depend on `seed` only.
    pub fn new(
        len: usize,
        classes: usize,
        shape: [usize; 3],
        seed: u64,
        split: Split,
    ) -> Result<Self> {
        if classes == 0 {
            bail!("synthetic data: classes must be at least 1, got 0");
        }
        if classes > i32::MAX as usize {
            bail!("synthetic data: {classes} classes is more than labels can hold");
        }
        if shape.contains(&0) {
            bail!(
                "synthetic data: every dimension of shape [C, H, W] must be positive, got {shape:?}"
            );
        }
        let channels = shape[0];
        let prototypes = (0..classes)
            .map(|k| {
                let mut rng = rng_for(&[seed, TAG_CLASS, k as u64]);
                let orientations = classes.min(ORIENTATIONS);
                let angle = PI * (k % orientations) as f32 / orientations as f32;
                let cycles = FREQUENCIES[(k / orientations) % FREQUENCIES.len()];
                let mut colour: Vec<f32> = (0..channels)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let peak = colour.iter().fold(0.0f32, |m, c| m.max(c.abs()));
                colour.iter_mut().for_each(|c| *c /= peak.max(1e-3));
                let tint = (0..channels)
                    .map(|_| rng.random_range(-0.05f32..0.05))
                    .collect();
                Prototype {
                    angle,
                    cycles,
                    colour,
                    tint,
                }
            })
            .collect();
        Ok(Synthetic {
            len,
            shape,
            seed,
            split,
            prototypes,
            cache: None,
        })
    }

    /// This set, keeping each image in memory once made, if all of them
    /// fit what is left of [`cache_budget`]; else unchanged (the images
    /// are the same bytes either way).
    pub fn cached(mut self) -> Self {
        if self.cache.is_some() {
            return self;
        }
        let bytes = self.len.saturating_mul(self.shape.iter().product());
        let budget = cache_budget();
        let reserved = CACHE_RESERVED.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
            r.checked_add(bytes).filter(|&t| t <= budget)
        });
        if reserved.is_ok() {
            self.cache = Some(Arc::new(Cache {
                images: (0..self.len).map(|_| OnceLock::new()).collect(),
                bytes,
            }));
        }
        self
    }

    /// Whether made images are kept in memory (see [`Synthetic::cached`]).
    pub fn is_cached(&self) -> bool {
        self.cache.is_some()
    }

    /// Image `i` (below `len`) and its label, computed.
    fn make(&self, i: usize) -> (Vec<u8>, i32) {
        let [c, h, w] = self.shape;
        let split = match self.split {
            Split::Train => 0,
            Split::Val => 1,
        };
        let mut rng = rng_for(&[self.seed, TAG_SAMPLE, split, i as u64]);
        let label = rng.random_range(0..self.prototypes.len());
        let proto = &self.prototypes[label];
        let orientations = self.prototypes.len().min(ORIENTATIONS) as f32;
        let angle = proto.angle + rng.random_range(-0.15f32..0.15) * PI / orientations;
        let phase = rng.random_range(0.0f32..2.0 * PI);
        let (wf, hf) = (w as f32, h as f32);
        let cx = wf * (0.5 + rng.random_range(-0.2f32..0.2));
        let cy = hf * (0.5 + rng.random_range(-0.2f32..0.2));
        let sigma = wf.min(hf) * rng.random_range(0.25f32..0.4);
        let amplitude = rng.random_range(0.2f32..0.4);
        let brightness = rng.random_range(-0.1f32..0.1);
        let (sin, cos) = angle.sin_cos();
        let k = 2.0 * PI * proto.cycles / wf;

        // Window and wave are both separable in x and y:
        // exp(-(dx² + dy²)/2σ²) = gx(x)·gy(y), and
        // sin(u(x) + v(y)) = sin u·cos v + cos u·sin v,
        // so each pixel costs a few multiplies instead of an exp and a sin.
        let gauss = |d: f32| (-(d * d) / (2.0 * sigma * sigma)).exp();
        let column = |x: usize| {
            let u = k * x as f32 * cos + phase;
            (gauss(x as f32 - cx), u.sin(), u.cos())
        };
        let columns: Vec<(f32, f32, f32)> = (0..w).map(column).collect();
        let mut grating = Vec::with_capacity(h * w);
        for y in 0..h {
            let v = k * y as f32 * sin;
            let (gy, sin_v, cos_v) = (amplitude * gauss(y as f32 - cy), v.sin(), v.cos());
            grating.extend(
                columns
                    .iter()
                    .map(|&(gx, sin_u, cos_u)| gx * gy * (sin_u * cos_v + cos_u * sin_v)),
            );
        }
        let mut noise = PixelNoise::new(rng.random());
        let mut pixels = vec![0u8; c * h * w];
        for (ch, plane) in pixels.chunks_exact_mut(h * w).enumerate() {
            let base = 0.5 + brightness + proto.tint[ch];
            let colour = proto.colour[ch];
            for (&g, p) in grating.iter().zip(plane) {
                let v = base + colour * g + noise.next();
                // Rounds to nearest (v ≥ 0 after the clamp); `f32::round`
                // is a libm call that cost a fifth of the loader's time.
                *p = (v.clamp(0.0, 1.0) * 255.0 + 0.5) as u8;
            }
        }
        (pixels, label as i32)
    }
}

impl Dataset for Synthetic {
    fn len(&self) -> usize {
        self.len
    }

    fn classes(&self) -> usize {
        self.prototypes.len()
    }

    fn class_names(&self) -> Vec<String> {
        (0..self.prototypes.len())
            .map(|k| format!("pattern-{k}"))
            .collect()
    }

    fn image_shape(&self) -> [usize; 3] {
        self.shape
    }

    fn get(&self, i: usize) -> Result<Sample> {
        if i >= self.len {
            bail!("synthetic data: index {i} out of range (len {})", self.len);
        }
        let (pixels, label) = match &self.cache {
            Some(cache) => {
                let (pixels, label) = cache.images[i].get_or_init(|| {
                    let (pixels, label) = self.make(i);
                    (pixels.into_boxed_slice(), label)
                });
                (pixels.to_vec(), *label)
            }
            None => self.make(i),
        };
        Ok(Sample {
            pixels: Pixels::U8(pixels),
            label,
        })
    }

    fn describe(&self) -> String {
        format!(
            "synthetic {} split (seed {}): {} images, {} classes, shape {:?}{}",
            self.split.name(),
            self.seed,
            self.len,
            self.prototypes.len(),
            self.shape,
            if self.is_cached() {
                " (kept in memory once made)"
            } else {
                ""
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a of the pixels and labels of images `0..n` of a split.
    fn fingerprint(split: Split, n: usize) -> u64 {
        let set = Synthetic::new(25_600, 100, [3, 256, 256], 2012, split).unwrap();
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |b: u8| h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        for i in 0..n {
            let s = set.get(i).unwrap();
            let Pixels::U8(px) = s.pixels else {
                panic!("synthetic images are bytes")
            };
            px.iter().for_each(|&b| eat(b));
            s.label.to_le_bytes().into_iter().for_each(&mut eat);
        }
        h
    }

    /// The default synthetic set (`configs/alexnet.json`'s: seed 2012, 100
    /// classes, 3×256×256) is a fixed dataset: runs and checkpoints made
    /// on it stay comparable across versions, so a faster generator must
    /// produce the same bytes. Pinned for x86-64 Linux with glibc (CI's
    /// platform): another libm may round `sin`/`cos`/`exp` differently in
    /// the last bit and flip a pixel.
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    #[test]
    fn default_set_bytes_are_fixed() {
        assert_eq!(fingerprint(Split::Train, 6), 4158714050515713815, "train");
        assert_eq!(fingerprint(Split::Val, 6), 15754697298104867975, "val");
    }

    /// A cached set gives the same samples as an uncached one, on first
    /// use (made) and after (copied), from clones sharing the cache too.
    #[cfg(target_os = "linux")]
    #[test]
    fn cached_set_gives_the_same_samples() {
        let plain = Synthetic::new(40, 7, [3, 9, 11], 3, Split::Train).unwrap();
        let cached = plain.clone().cached();
        assert!(cached.is_cached() && !plain.is_cached());
        assert!(cached.describe().ends_with("(kept in memory once made)"));
        let twin = cached.clone();
        for round in 0..2 {
            for i in 0..40 {
                let want = plain.get(i).unwrap();
                assert_eq!(cached.get(i).unwrap(), want, "image {i}, round {round}");
                assert_eq!(twin.get(i).unwrap(), want, "clone, image {i}");
            }
        }
        assert!(cached.get(40).is_err());
    }

    /// A set larger than the budget stays uncached (and reserves nothing).
    #[test]
    fn oversized_set_is_not_cached() {
        let huge = Synthetic::new(usize::MAX / 4, 2, [3, 256, 256], 1, Split::Val).unwrap();
        let huge = huge.cached();
        assert!(!huge.is_cached());
        assert!(huge.get(12345).is_ok());
    }

    #[test]
    fn pixel_noise_has_the_stated_mean_and_std() {
        let mut noise = PixelNoise::new(42);
        let n = 200_000;
        let draws: Vec<f64> = (0..n).map(|_| f64::from(noise.next())).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let var = draws.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard error of the mean is σ/√n ≈ 2.7e-4; of the std ≈ 2e-4.
        assert!(mean.abs() < 2e-3, "mean {mean}");
        assert!(
            (var.sqrt() - f64::from(NOISE_STD)).abs() < 2e-3,
            "std {}",
            var.sqrt()
        );
        // Bounded by Irwin–Hall's support: ±2 units of 1/√(1/3)·σ.
        let bound = 2.0 * f64::from(NOISE_STD) / (1.0f64 / 3.0).sqrt();
        assert!(draws.iter().all(|d| d.abs() <= bound + 1e-6));
    }
}
