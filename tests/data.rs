//! Datasets, augmentation and the loader: determinism, sharding, resume,
//! corrupt-file handling and every source's reader, on small data the tests
//! make themselves (plus the installed Fashion-MNIST when it is there).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{Cursor, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, bail};
use host::data::{
    Augment, Batch, Corner, Dataset, FASHION_MNIST_DEFAULT_DIR, FashionMnist, FolderDataset,
    IMAGENET_PCA_EIGVEC, Loader, LoaderConfig, Normalize, Packed, Pixels, SafetensorsDataset,
    Sample, SourceSpec, Split, Synthetic, TEN_VIEWS, open_train_val, prepare,
};
use image::{ImageFormat, RgbImage};
use rand::SeedableRng;
use rand::rngs::StdRng;
use safetensors::{Dtype, tensor::TensorView};

// ---------------------------------------------------------------- helpers

/// Sample `i` has label `i` and every pixel equal to `i % 256`; indices in
/// `bad` fail to load. Makes batch contents easy to trace back to indices.
struct Indexed {
    n: usize,
    bad: HashSet<usize>,
}

impl Dataset for Indexed {
    fn len(&self) -> usize {
        self.n
    }
    fn classes(&self) -> usize {
        self.n
    }
    fn class_names(&self) -> Vec<String> {
        (0..self.n).map(|i| i.to_string()).collect()
    }
    fn image_shape(&self) -> [usize; 3] {
        [1, 2, 2]
    }
    fn get(&self, i: usize) -> Result<Sample> {
        if self.bad.contains(&i) {
            bail!("sample {i} is broken on purpose");
        }
        Ok(Sample {
            pixels: Pixels::U8(vec![(i % 256) as u8; 4]),
            label: i as i32,
        })
    }
}

fn indexed(n: usize, bad: &[usize]) -> Arc<dyn Dataset> {
    Arc::new(Indexed {
        n,
        bad: bad.iter().copied().collect(),
    })
}

fn plain(crop: usize) -> Augment {
    Augment::eval(crop, Normalize::unit())
}

fn collect(loader: &Loader, epoch: u64, first: usize) -> Vec<Batch> {
    loader
        .epoch_from(epoch, first)
        .collect::<Result<Vec<_>>>()
        .expect("loader epoch")
}

fn synthetic(len: usize, classes: usize, shape: [usize; 3], split: Split) -> Synthetic {
    Synthetic::new(len, classes, shape, 7, split).expect("synthetic dataset")
}

fn encode(image: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut bytes = Cursor::new(Vec::new());
    image.write_to(&mut bytes, format).expect("encode image");
    bytes.into_inner()
}

fn noisy_image(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(31) ^ y.wrapping_mul(17) ^ seed.wrapping_mul(101);
        image::Rgb([(v % 251) as u8, (x * 7 + seed) as u8, (y * 5) as u8])
    })
}

/// `root/{train,val}/{cat,dog}/` with valid PNG and JPEG files of assorted
/// sizes, plus in `train/cat`: random bytes named `.png`, a JPEG cut in half,
/// text named `.jpg` (the three unreadable files), and `notes.txt` (ignored).
fn write_image_folder(root: &Path) {
    for split in ["train", "val"] {
        for (k, class) in ["cat", "dog"].iter().enumerate() {
            let dir = root.join(split).join(class);
            fs::create_dir_all(&dir).unwrap();
            let seed = k as u32 * 10 + if split == "train" { 0 } else { 5 };
            fs::write(
                dir.join("a.png"),
                encode(&noisy_image(40, 30, seed), ImageFormat::Png),
            )
            .unwrap();
            fs::write(
                dir.join("b.JPEG"),
                encode(&noisy_image(24, 50, seed + 1), ImageFormat::Jpeg),
            )
            .unwrap();
            if split == "train" {
                fs::write(
                    dir.join("c.jpg"),
                    encode(&noisy_image(64, 64, seed + 2), ImageFormat::Jpeg),
                )
                .unwrap();
            }
        }
    }
    let cat = root.join("train/cat");
    fs::write(
        cat.join("corrupt.png"),
        [0x13u8, 0x57, 0x9b, 0xdf].repeat(50),
    )
    .unwrap();
    let jpeg = encode(&noisy_image(64, 64, 99), ImageFormat::Jpeg);
    fs::write(cat.join("truncated.jpg"), &jpeg[..jpeg.len() / 2]).unwrap();
    fs::write(cat.join("text.jpg"), b"this is not an image\n").unwrap();
    fs::write(cat.join("notes.txt"), b"ignored\n").unwrap();
}

/// Writes an unsigned-byte IDX file, gzipped when `gz`.
fn write_idx(path: &Path, dims: &[u32], data: &[u8], gz: bool) {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        bytes.extend(d.to_be_bytes());
    }
    bytes.extend(data);
    if gz {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&bytes).unwrap();
        bytes = enc.finish().unwrap();
    }
    fs::write(path, bytes).unwrap();
}

// ---------------------------------------------------------------- synthetic

#[test]
fn synthetic_is_deterministic_and_splits_differ() {
    let shape = [3, 12, 10];
    let a = synthetic(20, 5, shape, Split::Train);
    let b = synthetic(20, 5, shape, Split::Train);
    let val = synthetic(20, 5, shape, Split::Val);
    let other_seed = Synthetic::new(20, 5, shape, 8, Split::Train).unwrap();
    assert_eq!(a.image_shape(), shape);
    assert_eq!(a.classes(), 5);
    let mut differs_val = 0;
    let mut differs_seed = 0;
    for i in 0..20 {
        let s = a.get(i).unwrap();
        assert_eq!(s, b.get(i).unwrap(), "sample {i} not reproducible");
        assert_eq!(s.pixels.len(), 3 * 12 * 10);
        assert!((0..5).contains(&s.label));
        differs_val += usize::from(s != val.get(i).unwrap());
        differs_seed += usize::from(s != other_seed.get(i).unwrap());
    }
    assert_eq!(differs_val, 20, "train and val streams overlap");
    assert_eq!(differs_seed, 20, "seed does not change the samples");
    assert!(a.get(20).is_err());
    assert!(Synthetic::new(4, 0, shape, 1, Split::Train).is_err());
    assert!(Synthetic::new(4, 3, [3, 0, 8], 1, Split::Train).is_err());
}

#[test]
fn synthetic_classes_are_separable_but_not_identical() {
    let classes = 4;
    let shape = [3, 16, 16];
    let size: usize = shape.iter().product();
    let train = synthetic(2000, classes, shape, Split::Train);
    let val = synthetic(300, classes, shape, Split::Val);
    let as_f32 = |s: &Sample| -> Vec<f32> { (0..size).map(|i| s.pixels.unit(i)).collect() };

    // Per class: the mean image, and the means of its even and odd samples.
    let mut sums = vec![[vec![0.0f64; size], vec![0.0f64; size]]; classes];
    let mut counts = vec![[0usize; 2]; classes];
    for i in 0..train.len() {
        let s = train.get(i).unwrap();
        let k = s.label as usize;
        counts[k][i % 2] += 1;
        for (acc, v) in sums[k][i % 2].iter_mut().zip(as_f32(&s)) {
            *acc += f64::from(v);
        }
    }
    assert!(
        counts.iter().all(|c| c[0] + c[1] > 400),
        "unbalanced labels {counts:?}"
    );
    let mean = |k: usize, halves: &[usize]| -> Vec<f64> {
        let n: usize = halves.iter().map(|&h| counts[k][h]).sum();
        (0..size)
            .map(|p| halves.iter().map(|&h| sums[k][h][p]).sum::<f64>() / n as f64)
            .collect()
    };
    let rms = |a: &[f64], b: &[f64]| -> f64 {
        (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / size as f64).sqrt()
    };
    let means: Vec<Vec<f64>> = (0..classes).map(|k| mean(k, &[0, 1])).collect();
    // Two halves of one class differ by sampling noise only; that noise is
    // larger than in full-class means, so it bounds what chance can give.
    let noise = (0..classes)
        .map(|k| rms(&mean(k, &[0]), &mean(k, &[1])))
        .fold(0.0, f64::max);
    for a in 0..classes {
        for b in a + 1..classes {
            let d = rms(&means[a], &means[b]);
            assert!(
                d > 1.5 * noise,
                "class means {a} and {b} differ by rms {d}, within-class noise {noise}"
            );
        }
    }
    // Nearest class mean on held-out samples beats chance clearly, without
    // being perfect (the grating itself averages out of a class mean).
    let mut correct = 0;
    for i in 0..val.len() {
        let s = val.get(i).unwrap();
        let x: Vec<f64> = as_f32(&s).into_iter().map(f64::from).collect();
        let best = (0..classes)
            .min_by(|&a, &b| rms(&x, &means[a]).total_cmp(&rms(&x, &means[b])))
            .unwrap();
        correct += usize::from(best as i32 == s.label);
    }
    let accuracy = correct as f64 / val.len() as f64;
    assert!(
        accuracy > 1.5 / classes as f64 && accuracy < 0.95,
        "nearest-mean accuracy {accuracy} (chance {})",
        1.0 / classes as f64
    );
}

// ---------------------------------------------------------------- loader

#[test]
fn loader_order_is_deterministic_across_thread_counts() {
    let data: Arc<dyn Dataset> = Arc::new(synthetic(53, 5, [3, 12, 12], Split::Train));
    let augment = Augment::train(8, Normalize::alexnet());
    let run = |workers: usize, epoch: u64| {
        let cfg = LoaderConfig::train(8, augment.clone(), 42).with_workers(workers);
        let loader = Loader::new(data.clone(), cfg).unwrap();
        assert_eq!(loader.batches_per_epoch(), 6);
        collect(&loader, epoch, 0)
    };
    let reference = run(0, 3);
    assert_eq!(reference.len(), 6);
    for b in &reference {
        assert_eq!((b.n, b.labels.len(), b.views, b.skipped), (8, 8, 1, 0));
        assert_eq!(b.images.len(), 8 * 3 * 8 * 8);
        assert_eq!(b.shape, [3, 8, 8]);
        assert_eq!(b.epoch, 3);
    }
    assert_eq!(
        reference.iter().map(|b| b.index).collect::<Vec<_>>(),
        (0..6).collect::<Vec<_>>()
    );
    for workers in [1, 3, 7] {
        assert_eq!(run(workers, 3), reference, "{workers} workers");
    }
    assert_ne!(run(2, 4), reference, "epochs 3 and 4 gave the same batches");
}

#[test]
fn loader_resumes_mid_epoch_exactly() {
    let data: Arc<dyn Dataset> = Arc::new(synthetic(40, 3, [3, 10, 10], Split::Train));
    let cfg = LoaderConfig::train(6, Augment::train(8, Normalize::unit()), 9).with_workers(3);
    let loader = Loader::new(data, cfg).unwrap();
    let full = collect(&loader, 2, 0);
    assert_eq!(full.len(), 6);
    for first in [1, 4, 5] {
        assert_eq!(
            collect(&loader, 2, first),
            full[first..],
            "resume at {first}"
        );
        assert_eq!(loader.batch(2, first).unwrap(), full[first]);
    }
    assert!(collect(&loader, 2, 6).is_empty());
    assert!(loader.batch(2, 6).is_err());
    // Dropping an epoch half-way stops its workers cleanly.
    let mut epoch = loader.epoch(2);
    assert_eq!(epoch.next().unwrap().unwrap(), full[0]);
    assert_eq!(epoch.remaining(), 5);
    drop(epoch);
}

/// A dropped batch's image buffer is reused for the next one, and batches
/// built in reused buffers (of the same size, a smaller last batch, a
/// larger one after it) equal those of a fresh loader.
#[test]
fn batch_buffers_are_reused_without_changing_batches() {
    let data: Arc<dyn Dataset> = Arc::new(synthetic(10, 3, [3, 10, 10], Split::Val));
    let cfg = LoaderConfig::eval(4, &Augment::train(8, Normalize::alexnet()));
    let fresh = |index: usize| {
        Loader::new(data.clone(), cfg.clone())
            .unwrap()
            .batch(1, index)
            .unwrap()
    };
    let loader = Loader::new(data.clone(), cfg.clone()).unwrap();
    let first = loader.batch(1, 0).unwrap();
    let at = first.images.as_ptr();
    drop(first);
    let second = loader.batch(1, 1).unwrap();
    assert_eq!(second.images.as_ptr(), at, "the buffer was not reused");
    assert_eq!(second, fresh(1));
    drop(second);
    let last = loader.batch(1, 2).unwrap();
    assert_eq!((last.n, last.images.len()), (2, 2 * 3 * 8 * 8));
    assert_eq!(last, fresh(2));
    drop(last);
    assert_eq!(loader.batch(1, 0).unwrap(), fresh(0));
    let epoch: Vec<Batch> = loader.epoch(1).collect::<Result<_>>().unwrap();
    assert_eq!(epoch, (0..3).map(fresh).collect::<Vec<_>>());
}

#[test]
fn shards_are_disjoint_and_cover_each_global_batch() {
    let n = 50;
    let data = indexed(n, &[]);
    for drop_last in [true, false] {
        let base = LoaderConfig {
            drop_last,
            ..LoaderConfig::train(8, plain(2), 5)
        };
        let single = collect(&Loader::new(data.clone(), base.clone()).unwrap(), 1, 0);
        let shards: Vec<Vec<Batch>> = (0..4)
            .map(|rank| {
                let cfg = base.clone().shard(rank, 4).with_workers(2);
                collect(&Loader::new(data.clone(), cfg).unwrap(), 1, 0)
            })
            .collect();
        let mut seen: HashSet<i32> = HashSet::new();
        for (b, global) in single.iter().enumerate() {
            let mut labels: Vec<i32> = Vec::new();
            let mut images: Vec<f32> = Vec::new();
            for shard in &shards {
                let part = &shard[b];
                if global.n == 8 {
                    assert_eq!(part.n, 2, "full batch {b} splits evenly");
                }
                labels.extend(&part.labels);
                images.extend(part.images.iter());
            }
            assert_eq!(labels, global.labels, "batch {b}: shards != global batch");
            assert_eq!(
                images, *global.images,
                "batch {b}: augmentation depends on rank"
            );
            for l in labels {
                assert!(seen.insert(l), "sample {l} appears twice");
            }
        }
        let expected = if drop_last { 48 } else { 50 };
        assert_eq!(seen.len(), expected, "drop_last {drop_last}");
    }
    assert!(
        Loader::new(
            data.clone(),
            LoaderConfig::train(10, plain(2), 0).shard(0, 4)
        )
        .is_err()
    );
    assert!(
        Loader::new(
            data.clone(),
            LoaderConfig::train(8, plain(2), 0).shard(4, 4)
        )
        .is_err()
    );
    assert!(Loader::new(data, LoaderConfig::train(64, plain(2), 0)).is_err());
}

#[test]
fn shuffle_visits_every_sample_once_per_epoch() {
    let data = indexed(30, &[]);
    let loader = Loader::new(
        data,
        LoaderConfig {
            drop_last: false,
            ..LoaderConfig::train(7, plain(2), 3)
        },
    )
    .unwrap();
    let order = |e| -> Vec<i32> {
        collect(&loader, e, 0)
            .into_iter()
            .flat_map(|b| b.labels)
            .collect()
    };
    let (e0, e1) = (order(0), order(1));
    let sorted = |mut v: Vec<i32>| {
        v.sort();
        v
    };
    assert_eq!(sorted(e0.clone()), (0..30).collect::<Vec<_>>());
    assert_eq!(sorted(e1.clone()), (0..30).collect::<Vec<_>>());
    assert_ne!(e0, e1, "the permutation does not change between epochs");
    assert_ne!(e0, (0..30).collect::<Vec<_>>(), "not shuffled");
}

#[test]
fn unreadable_samples_are_replaced_in_training_and_dropped_in_eval() {
    let bad = [3, 10, 11, 25];
    let data = indexed(40, &bad);
    let train_cfg = LoaderConfig::train(8, plain(2), 1);
    let reference = collect(
        &Loader::new(data.clone(), train_cfg.clone().with_workers(0)).unwrap(),
        0,
        0,
    );
    assert_eq!(reference.len(), 5);
    let mut skipped = 0;
    for b in &reference {
        assert_eq!(b.n, 8, "training batches keep their size");
        assert!(b.labels.iter().all(|l| !bad.contains(&(*l as usize))));
        skipped += b.skipped;
    }
    assert!(
        skipped >= bad.len(),
        "counted {skipped} skipped, expected at least 4"
    );
    let threaded = collect(
        &Loader::new(data.clone(), train_cfg.with_workers(3)).unwrap(),
        0,
        0,
    );
    assert_eq!(threaded, reference, "replacement depends on threads");

    let eval = collect(
        &Loader::new(data.clone(), LoaderConfig::eval(8, &plain(2))).unwrap(),
        0,
        0,
    );
    let labels: Vec<i32> = eval.iter().flat_map(|b| b.labels.clone()).collect();
    let expected: Vec<i32> = (0..40)
        .filter(|i| !bad.contains(i))
        .map(|i| i as i32)
        .collect();
    assert_eq!(labels, expected);
    assert_eq!(eval.iter().map(|b| b.skipped).sum::<usize>(), 4);
    assert_eq!(eval[0].n, 7);
    assert_eq!(eval[0].images.len(), 7 * 4);

    let all_bad: Vec<usize> = (0..40).collect();
    let broken = Loader::new(indexed(40, &all_bad), LoaderConfig::train(8, plain(2), 1)).unwrap();
    let first = broken.epoch(0).next().unwrap();
    assert!(first.is_err(), "a batch with no loadable sample must fail");
}

#[test]
fn ten_view_loader_yields_ten_views_per_sample() {
    let data: Arc<dyn Dataset> = Arc::new(synthetic(10, 2, [3, 9, 9], Split::Val));
    let augment = Augment::train(7, Normalize::unit());
    let loader = Loader::new(data.clone(), LoaderConfig::ten_view(4, &augment)).unwrap();
    let batches = collect(&loader, 0, 0);
    assert_eq!(batches.iter().map(|b| b.n).collect::<Vec<_>>(), [4, 4, 2]);
    let b = &batches[1];
    assert_eq!(b.views, 10);
    assert_eq!(b.images.len(), 4 * 10 * 3 * 7 * 7);
    let expected = augment.ten_views(&data.get(5).unwrap(), [3, 9, 9]).unwrap();
    let view = 10 * 3 * 7 * 7;
    assert_eq!(b.images[view..2 * view], expected[..]);
}

// ---------------------------------------------------------------- augmentation

/// `[C, 4, 5]` image whose pixel (c, y, x) is `c·100 + y·10 + x`.
fn coded_image(channels: usize) -> Sample {
    let mut v = Vec::new();
    for c in 0..channels {
        for y in 0..4 {
            for x in 0..5 {
                v.push((c * 100 + y * 10 + x) as f32);
            }
        }
    }
    Sample {
        pixels: Pixels::F32(v),
        label: 0,
    }
}

/// The expected `crop`×`crop` window of [`coded_image`] at `(y0, x0)`.
fn coded_window(channels: usize, crop: usize, y0: usize, x0: usize, mirror: bool) -> Vec<f32> {
    let mut v = Vec::new();
    for c in 0..channels {
        for y in 0..crop {
            for x in 0..crop {
                let xs = if mirror { x0 + crop - 1 - x } else { x0 + x };
                v.push((c * 100 + (y0 + y) * 10 + xs) as f32);
            }
        }
    }
    v
}

#[test]
fn centre_crop_and_ten_views_geometry() {
    let shape = [2, 4, 5];
    let sample = coded_image(2);
    let aug = plain(3);
    let mut out = vec![0.0; 2 * 9];
    aug.apply(&sample, shape, &mut StdRng::seed_from_u64(0), &mut out)
        .unwrap();
    assert_eq!(out, coded_window(2, 3, 0, 1, false), "centre crop");

    let views = aug.ten_views(&sample, shape).unwrap();
    assert_eq!(views.len(), 10 * 18);
    let offsets = |corner| match corner {
        Corner::TopLeft => (0, 0),
        Corner::TopRight => (0, 2),
        Corner::BottomLeft => (1, 0),
        Corner::BottomRight => (1, 2),
        Corner::Centre => (0, 1),
    };
    for (k, (corner, mirror)) in TEN_VIEWS.into_iter().enumerate() {
        let (y0, x0) = offsets(corner);
        assert_eq!(aug.corner_offset(shape, corner), (y0, x0));
        assert_eq!(
            views[k * 18..(k + 1) * 18],
            coded_window(2, 3, y0, x0, mirror)[..],
            "view {k} ({corner:?}, mirrored {mirror})"
        );
    }
    assert_eq!(TEN_VIEWS.iter().filter(|(_, m)| *m).count(), 5);
}

#[test]
fn random_crops_and_flips_stay_inside_and_cover_all_positions() {
    let shape = [1, 4, 5];
    let sample = coded_image(1);
    let aug = Augment {
        pca_sigma: 0.1,
        ..Augment::train(3, Normalize::unit())
    };
    let mut seen = HashSet::new();
    let mut out = vec![0.0; 9];
    for seed in 0..400 {
        aug.apply(&sample, shape, &mut StdRng::seed_from_u64(seed), &mut out)
            .unwrap();
        let found = (0..=1)
            .flat_map(|y0| (0..=2).map(move |x0| (y0, x0)))
            .flat_map(|(y0, x0)| [false, true].map(|m| (y0, x0, m)))
            .find(|&(y0, x0, m)| coded_window(1, 3, y0, x0, m) == out);
        let Some(window) = found else {
            panic!(
                "seed {seed}: output {out:?} is no crop of the image (PCA noise must skip 1 channel)"
            );
        };
        seen.insert(window);
    }
    assert_eq!(
        seen.len(),
        12,
        "not every offset/mirror combination drawn: {seen:?}"
    );
    let mut again = vec![0.0; 9];
    aug.apply(&sample, shape, &mut StdRng::seed_from_u64(5), &mut out)
        .unwrap();
    aug.apply(&sample, shape, &mut StdRng::seed_from_u64(5), &mut again)
        .unwrap();
    assert_eq!(out, again);
    assert!(
        Augment::train(6, Normalize::unit())
            .output_shape(shape)
            .is_err()
    );
}

#[test]
fn normalisation_and_pca_noise() {
    let shape = [3, 2, 2];
    let sample = Sample {
        pixels: Pixels::U8(vec![255, 255, 255, 255, 0, 0, 0, 0, 51, 51, 51, 51]),
        label: 1,
    };
    let norm = Normalize {
        mean: vec![0.5, 0.0, 0.1],
        std: vec![0.25],
        scale: 2.0,
    };
    let aug = Augment::eval(2, norm.clone());
    let mut out = vec![0.0; 12];
    aug.apply(&sample, shape, &mut StdRng::seed_from_u64(0), &mut out)
        .unwrap();
    let expect = [2.0 * 0.5 / 0.25, 0.0, 2.0 * (0.2 - 0.1) / 0.25];
    for (i, v) in out.iter().enumerate() {
        assert!(
            (v - expect[i / 4]).abs() < 1e-5,
            "value {i}: {v} vs {}",
            expect[i / 4]
        );
    }

    let noisy = Augment {
        pca_sigma: 0.1,
        ..aug.clone()
    };
    let mut shifted = vec![0.0; 12];
    noisy
        .apply(&sample, shape, &mut StdRng::seed_from_u64(3), &mut shifted)
        .unwrap();
    // The noise is one RGB offset (in [0, 1] units) added to every pixel.
    let offset: Vec<f32> = (0..3)
        .map(|c| (shifted[c * 4] - out[c * 4]) * 0.25 / 2.0)
        .collect();
    for i in 0..12 {
        let d = (shifted[i] - out[i]) * 0.25 / 2.0;
        assert!(
            (d - offset[i / 4]).abs() < 1e-5,
            "offset differs within channel"
        );
    }
    let norm2: f32 = offset.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!(
        norm2 > 0.0 && norm2 < 0.2,
        "PCA offset {offset:?} out of range"
    );
    // It lies in the span of the eigenvectors, so projecting back onto them
    // reconstructs it exactly (they are orthonormal).
    let back: Vec<f32> = (0..3)
        .map(|c| {
            (0..3)
                .map(|j| {
                    let coef: f32 = (0..3).map(|k| IMAGENET_PCA_EIGVEC[k][j] * offset[k]).sum();
                    IMAGENET_PCA_EIGVEC[c][j] * coef
                })
                .sum()
        })
        .collect();
    for c in 0..3 {
        assert!((back[c] - offset[c]).abs() < 1e-3);
    }

    let bad = Augment::eval(
        2,
        Normalize {
            mean: vec![0.1, 0.2],
            ..Normalize::unit()
        },
    );
    assert!(bad.output_shape(shape).is_err(), "2 means for 3 channels");
    let zero_std = Augment::eval(
        2,
        Normalize {
            std: vec![0.0],
            ..Normalize::unit()
        },
    );
    assert!(zero_std.output_shape(shape).is_err());
}

// ---------------------------------------------------------------- folders and packing

#[test]
fn folder_dataset_skips_unreadable_files_and_the_run_completes() {
    let dir = tempfile::tempdir().unwrap();
    write_image_folder(dir.path());
    let train = FolderDataset::open_with_side(dir.path(), Split::Train, 16).unwrap();
    let val = FolderDataset::open_with_side(dir.path(), Split::Val, 16).unwrap();
    assert_eq!(train.class_names(), ["cat", "dog"]);
    assert_eq!(train.len(), 9, "3 good + 3 bad cat files, 3 good dog files");
    assert_eq!(train.ignored(), 1, "notes.txt");
    assert_eq!(val.len(), 4);
    assert_eq!(train.image_shape(), [3, 16, 16]);

    let mut errors = BTreeMap::new();
    for i in 0..train.len() {
        match train.get(i) {
            Ok(s) => {
                assert_eq!(s.pixels.len(), 3 * 16 * 16);
                let name = train.files()[i].0.file_name().unwrap().to_owned();
                assert!(["a.png", "b.JPEG", "c.jpg"].contains(&name.to_str().unwrap()));
            }
            Err(e) => {
                let name = train.files()[i]
                    .0
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                let msg = format!("{e:#}");
                assert!(msg.contains(&name), "error {msg:?} does not name the file");
                assert!(!msg.contains('\n'), "error is not one line: {msg:?}");
                errors.insert(name, msg);
            }
        }
    }
    assert_eq!(
        errors.keys().cloned().collect::<Vec<_>>(),
        ["corrupt.png", "text.jpg", "truncated.jpg"]
    );
    assert!(
        errors["truncated.jpg"].contains("truncated"),
        "{}",
        errors["truncated.jpg"]
    );

    let data: Arc<dyn Dataset> = Arc::new(train);
    let cfg = LoaderConfig {
        drop_last: false,
        ..LoaderConfig::train(4, Augment::train(12, Normalize::alexnet()), 0)
    };
    let batches = collect(
        &Loader::new(data.clone(), cfg.with_workers(2)).unwrap(),
        0,
        0,
    );
    assert_eq!(batches.iter().map(|b| b.n).sum::<usize>(), 9);
    assert!(batches.iter().map(|b| b.skipped).sum::<usize>() >= 3);
    let eval = collect(
        &Loader::new(
            data,
            LoaderConfig::eval(4, &Augment::train(12, Normalize::alexnet())),
        )
        .unwrap(),
        0,
        0,
    );
    assert_eq!(eval.iter().map(|b| b.n).sum::<usize>(), 6);
    assert_eq!(eval.iter().map(|b| b.skipped).sum::<usize>(), 3);
}

#[test]
fn decoded_images_are_resized_on_the_shorter_side_and_centre_cropped() {
    // Left half black, right half white, 40 wide and 20 high: after resizing
    // the height to 10 (width 20) and cropping the centre 10, the crop's left
    // half is black and its right half white.
    let image = RgbImage::from_fn(40, 20, |x, _| image::Rgb([if x < 20 { 0 } else { 255 }; 3]));
    let out = host::data::decode_resized(&encode(&image, ImageFormat::Png), 10).unwrap();
    assert_eq!(out.len(), 3 * 10 * 10);
    for c in 0..3 {
        for y in 0..10 {
            let row = &out[c * 100 + y * 10..c * 100 + y * 10 + 10];
            assert!(row[..4].iter().all(|&v| v < 10), "row {y}: {row:?}");
            assert!(row[6..].iter().all(|&v| v > 245), "row {y}: {row:?}");
        }
    }
    assert!(host::data::decode_resized(b"GIF89a not really", 10).is_err());
}

#[test]
fn prepare_and_packed_round_trip_equals_folder_decoding() {
    let src = tempfile::tempdir().unwrap();
    let dst = tempfile::tempdir().unwrap();
    write_image_folder(src.path());
    let report = prepare(src.path(), dst.path()).unwrap();
    assert_eq!((report.train, report.val, report.classes), (6, 4, 2));
    assert_eq!(report.ignored, 1);
    let mut skipped: Vec<String> = report
        .skipped
        .iter()
        .map(|s| s.path.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    skipped.sort();
    assert_eq!(skipped, ["corrupt.png", "text.jpg", "truncated.jpg"]);

    for split in [Split::Train, Split::Val] {
        let folder = FolderDataset::open(src.path(), split).unwrap();
        let packed = Packed::open(dst.path(), split).unwrap();
        assert_eq!(packed.image_shape(), [3, 256, 256]);
        assert_eq!(packed.class_names(), folder.class_names());
        assert_eq!(packed.skipped_at_prepare(), 3);
        let good: Vec<Sample> = (0..folder.len())
            .filter_map(|i| folder.get(i).ok())
            .collect();
        assert_eq!(packed.len(), good.len());
        for (i, want) in good.iter().enumerate() {
            assert_eq!(&packed.get(i).unwrap(), want, "{split:?} sample {i}");
        }
        assert!(packed.get(packed.len()).is_err());
    }

    let (train, val) = open_train_val(&SourceSpec::Packed {
        path: dst.path().to_path_buf(),
    })
    .unwrap();
    assert_eq!((train.len(), val.len()), (6, 4));

    // A data file that no longer matches its index is refused, naming it.
    let data = dst.path().join("val.u8");
    let bytes = fs::read(&data).unwrap();
    fs::write(&data, &bytes[..bytes.len() - 1]).unwrap();
    let err = format!("{:#}", Packed::open(dst.path(), Split::Val).unwrap_err());
    assert!(err.contains("val.u8"), "{err}");
    let err = format!("{:#}", Packed::open(src.path(), Split::Val).unwrap_err());
    assert!(err.contains("index.json"), "{err}");
}

// ---------------------------------------------------------------- safetensors

#[test]
fn safetensors_dataset_round_trip_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (n, c, h, w) = (5usize, 3usize, 4usize, 6usize);
    let images: Vec<u8> = (0..n * c * h * w).map(|i| (i * 7 % 256) as u8).collect();
    let labels: Vec<i64> = vec![0, 2, 1, 2, 0];
    let label_bytes: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
    let val_images: Vec<f32> = (0..2 * c * h * w).map(|i| i as f32 / 100.0).collect();
    let val_image_bytes: Vec<u8> = val_images.iter().flat_map(|v| v.to_le_bytes()).collect();
    let val_labels: Vec<u8> = [3u16, 1].iter().flat_map(|l| l.to_le_bytes()).collect();
    let view = |dtype, shape: Vec<usize>, data: &'static [u8]| {
        TensorView::new(dtype, shape, data).unwrap()
    };
    let leak = |v: Vec<u8>| -> &'static [u8] { Box::leak(v.into_boxed_slice()) };
    let path = dir.path().join("data.safetensors");
    let tensors = vec![
        (
            "images",
            view(Dtype::U8, vec![n, c, h, w], leak(images.clone())),
        ),
        ("labels", view(Dtype::I64, vec![n], leak(label_bytes))),
        (
            "val_images",
            view(Dtype::F32, vec![2, c, h, w], leak(val_image_bytes)),
        ),
        ("val_labels", view(Dtype::U16, vec![2], leak(val_labels))),
    ];
    safetensors::serialize_to_file(tensors, None, &path).unwrap();

    let (train, val) = open_train_val(&SourceSpec::Safetensors {
        path: path.clone(),
        val_path: None,
    })
    .unwrap();
    assert_eq!((train.len(), val.len()), (5, 2));
    assert_eq!(train.image_shape(), [3, 4, 6]);
    assert_eq!(train.classes(), 4, "largest label over both splits is 3");
    assert_eq!(val.classes(), 4);
    for i in 0..n {
        let s = train.get(i).unwrap();
        assert_eq!(s.label as i64, labels[i]);
        assert_eq!(s.pixels, Pixels::U8(images[i * 72..(i + 1) * 72].to_vec()));
    }
    let s = val.get(1).unwrap();
    assert_eq!(s.label, 1);
    assert_eq!(s.pixels, Pixels::F32(val_images[72..144].to_vec()));

    // Class names from metadata; a separate validation file.
    let named = dir.path().join("named.safetensors");
    let meta = HashMap::from([(
        "class_names".to_string(),
        r#"["zero","one","two"]"#.to_string(),
    )]);
    let small = vec![
        (
            "images",
            view(Dtype::U8, vec![1, 1, 2, 2], leak(vec![1, 2, 3, 4])),
        ),
        (
            "labels",
            view(Dtype::I32, vec![1], leak(2i32.to_le_bytes().to_vec())),
        ),
    ];
    safetensors::serialize_to_file(small, Some(meta), &named).unwrap();
    let (t, v) = SafetensorsDataset::open_pair(&named, Some(&named)).unwrap();
    assert_eq!(t.class_names(), ["zero", "one", "two"]);
    assert_eq!(v.get(0).unwrap().label, 2);

    // Errors name the file and the tensor.
    let err = format!(
        "{:#}",
        SafetensorsDataset::open_tensors(&path, "pixels", "labels").unwrap_err()
    );
    assert!(
        err.contains("data.safetensors") && err.contains("pixels"),
        "{err}"
    );
    let bad_shape = dir.path().join("bad.safetensors");
    let tensors = vec![
        (
            "images",
            view(Dtype::U8, vec![2, 1, 2, 2], leak(vec![0; 8])),
        ),
        ("labels", view(Dtype::U8, vec![2, 1], leak(vec![0, 1]))),
    ];
    safetensors::serialize_to_file(tensors, None, &bad_shape).unwrap();
    let err = format!("{:#}", SafetensorsDataset::open(&bad_shape).unwrap_err());
    assert!(
        err.contains("bad.safetensors") && err.contains("labels") && err.contains("[2, 1]"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        SafetensorsDataset::open_pair(&bad_shape, None).unwrap_err()
    );
    assert!(err.contains("labels"), "{err}");
    let negative = dir.path().join("negative.safetensors");
    let tensors = vec![
        ("images", view(Dtype::U8, vec![1, 1, 1, 1], leak(vec![0]))),
        ("labels", view(Dtype::I8, vec![1], leak(vec![0xff]))),
    ];
    safetensors::serialize_to_file(tensors, None, &negative).unwrap();
    let err = format!("{:#}", SafetensorsDataset::open(&negative).unwrap_err());
    assert!(err.contains("-1"), "{err}");
    let float_images = dir.path().join("f16.safetensors");
    let tensors = vec![
        (
            "images",
            view(Dtype::F16, vec![1, 1, 1, 1], leak(vec![0, 0])),
        ),
        ("labels", view(Dtype::U8, vec![1], leak(vec![0]))),
    ];
    safetensors::serialize_to_file(tensors, None, &float_images).unwrap();
    let err = format!("{:#}", SafetensorsDataset::open(&float_images).unwrap_err());
    assert!(err.contains("F16") && err.contains("images"), "{err}");
}

// ---------------------------------------------------------------- fashion-mnist

#[test]
fn fashion_mnist_reads_idx_files_gzipped_or_plain() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (4u32, 5u32);
    let train_images: Vec<u8> = (0..3 * 20).map(|i| i as u8).collect();
    write_idx(
        &dir.path().join("train-images-idx3-ubyte.gz"),
        &[3, rows, cols],
        &train_images,
        true,
    );
    write_idx(
        &dir.path().join("train-labels-idx1-ubyte.gz"),
        &[3],
        &[9, 0, 4],
        true,
    );
    write_idx(
        &dir.path().join("t10k-images-idx3-ubyte"),
        &[2, rows, cols],
        &[7; 40],
        false,
    );
    write_idx(
        &dir.path().join("t10k-labels-idx1-ubyte"),
        &[2],
        &[1, 2],
        false,
    );

    let (train, val) = open_train_val(&SourceSpec::FashionMnist {
        path: dir.path().to_path_buf(),
    })
    .unwrap();
    assert_eq!((train.len(), val.len()), (3, 2));
    assert_eq!(train.image_shape(), [1, 4, 5]);
    assert_eq!(train.classes(), 10);
    assert_eq!(train.class_names()[0], "T-shirt/top");
    assert_eq!(train.class_names()[9], "Ankle boot");
    let s = train.get(2).unwrap();
    assert_eq!(s.label, 4);
    assert_eq!(s.pixels, Pixels::U8(train_images[40..60].to_vec()));
    assert_eq!(val.get(1).unwrap().label, 2);
    assert!(train.get(3).is_err());

    // Truncated data, a bad label, corrupt gzip, a missing file.
    write_idx(
        &dir.path().join("t10k-images-idx3-ubyte"),
        &[2, rows, cols],
        &[7; 39],
        false,
    );
    let err = format!(
        "{:#}",
        FashionMnist::open(dir.path(), Split::Val).unwrap_err()
    );
    assert!(
        err.contains("t10k-images-idx3-ubyte") && err.contains("truncated"),
        "{err}"
    );
    write_idx(
        &dir.path().join("t10k-images-idx3-ubyte"),
        &[2, rows, cols],
        &[7; 40],
        false,
    );
    write_idx(
        &dir.path().join("t10k-labels-idx1-ubyte"),
        &[2],
        &[1, 12],
        false,
    );
    let err = format!(
        "{:#}",
        FashionMnist::open(dir.path(), Split::Val).unwrap_err()
    );
    assert!(err.contains("label 12"), "{err}");
    fs::write(
        dir.path().join("train-labels-idx1-ubyte.gz"),
        b"\x1f\x8b garbage",
    )
    .unwrap();
    let err = format!(
        "{:#}",
        FashionMnist::open(dir.path(), Split::Train).unwrap_err()
    );
    assert!(err.contains("train-labels-idx1-ubyte.gz"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let err = format!(
        "{:#}",
        FashionMnist::open(empty.path(), Split::Train).unwrap_err()
    );
    assert!(
        err.contains("dataset-fashion-mnist") && !err.contains('\n'),
        "{err}"
    );
}

#[test]
fn installed_fashion_mnist_has_60000_and_10000_images() {
    let dir = Path::new(FASHION_MNIST_DEFAULT_DIR);
    if !dir.join("train-images-idx3-ubyte.gz").exists() {
        println!(
            "skipped: Fashion-MNIST not installed at {FASHION_MNIST_DEFAULT_DIR} \
             (apt-get install dataset-fashion-mnist)"
        );
        return;
    }
    let train = FashionMnist::open(dir, Split::Train).unwrap();
    let val = FashionMnist::open(dir, Split::Val).unwrap();
    assert_eq!((train.len(), val.len()), (60000, 10000));
    assert_eq!(train.image_shape(), [1, 28, 28]);
    let mut counts = [0usize; 10];
    for i in 0..val.len() {
        counts[val.get(i).unwrap().label as usize] += 1;
    }
    assert_eq!(counts, [1000; 10], "the test split is balanced");
}

// ---------------------------------------------------------------- open_train_val

#[test]
fn open_train_val_synthetic_and_folder() {
    let (train, val) = open_train_val(&SourceSpec::Synthetic {
        train_size: 30,
        val_size: 10,
        classes: 3,
        shape: [1, 8, 8],
        seed: 1,
    })
    .unwrap();
    assert_eq!((train.len(), val.len(), train.classes()), (30, 10, 3));
    assert_ne!(train.get(0).unwrap(), val.get(0).unwrap());

    let dir = tempfile::tempdir().unwrap();
    write_image_folder(dir.path());
    let (train, val) = open_train_val(&SourceSpec::Folder {
        path: dir.path().to_path_buf(),
    })
    .unwrap();
    assert_eq!((train.len(), val.len()), (9, 4));
    assert_eq!(train.image_shape(), [3, 256, 256]);

    // A validation class unknown to the training split is an error naming it.
    fs::create_dir_all(dir.path().join("val/zebra")).unwrap();
    let err = format!(
        "{:#}",
        open_train_val(&SourceSpec::Folder {
            path: dir.path().to_path_buf(),
        })
        .err()
        .unwrap()
    );
    assert!(err.contains("zebra"), "{err}");
    let err = format!(
        "{:#}",
        open_train_val(&SourceSpec::Folder {
            path: dir.path().join("missing"),
        })
        .err()
        .unwrap()
    );
    assert!(err.contains("missing"), "{err}");
}

#[test]
fn random_erasing_fills_one_rectangle_with_noise() {
    // A constant image: every changed value belongs to the erased rectangle.
    let (c, side) = (2, 20);
    let sample = Sample {
        pixels: Pixels::U8(vec![255; c * side * side]),
        label: 0,
    };
    let base = Augment::eval(side, Normalize::unit());
    let aug = Augment {
        erase: 1.0,
        ..base.clone()
    };
    let mut clean = vec![0.0; c * side * side];
    base.apply(
        &sample,
        [c, side, side],
        &mut StdRng::seed_from_u64(0),
        &mut clean,
    )
    .unwrap();
    let mut areas = Vec::new();
    for seed in 0..200 {
        let mut out = vec![0.0; c * side * side];
        aug.apply(
            &sample,
            [c, side, side],
            &mut StdRng::seed_from_u64(seed),
            &mut out,
        )
        .unwrap();
        let changed: Vec<usize> = (0..side * side).filter(|&i| out[i] != clean[i]).collect();
        // Same rectangle in every channel, values in [0, 1).
        for ch in 1..c {
            let other: Vec<usize> = (0..side * side)
                .filter(|&i| out[ch * side * side + i] != clean[i])
                .collect();
            assert_eq!(changed, other, "seed {seed}: channels erased differently");
        }
        assert!(out.iter().all(|v| (0.0..=1.0).contains(v)));
        if changed.is_empty() {
            continue;
        }
        let rows: HashSet<usize> = changed.iter().map(|i| i / side).collect();
        let cols: HashSet<usize> = changed.iter().map(|i| i % side).collect();
        // A value can coincide with the clean 1.0 only with probability ~0,
        // so the changed set is the whole rectangle.
        assert_eq!(
            changed.len(),
            rows.len() * cols.len(),
            "seed {seed}: not a rectangle"
        );
        areas.push(changed.len() as f32 / (side * side) as f32);
    }
    assert!(
        areas.len() > 180,
        "erasing applied to {} of 200 views",
        areas.len()
    );
    let (lo, hi) = areas
        .iter()
        .fold((1.0f32, 0.0f32), |(l, h), &a| (l.min(a), h.max(a)));
    assert!(
        lo >= 0.01 && hi <= 0.45,
        "erased areas {lo}..{hi} outside 2–40% (± rounding)"
    );
    assert!(hi - lo > 0.2, "erased areas do not vary: {lo}..{hi}");
    let never = Augment { erase: 0.0, ..base };
    let mut out = vec![0.0; c * side * side];
    never
        .apply(
            &sample,
            [c, side, side],
            &mut StdRng::seed_from_u64(1),
            &mut out,
        )
        .unwrap();
    assert_eq!(out, clean);
}
