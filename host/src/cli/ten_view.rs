//! `host test`: the paper's ten-view test (Krizhevsky et al. 2012, §4.1).
//!
//! Every validation image gives ten views: the four corner crops and the
//! centre crop, and their mirror images ([`TEN_VIEWS`]). The network's
//! softmax outputs are averaged over the ten views and the average is
//! ranked for top-1 and top-5. The plain centre view's own outputs give the
//! single-crop numbers (what training reports) from the same pass.
//!
//! The model has a fixed batch, so it is built for `10 · batch_size` views:
//! a loader batch of `batch_size` images fills it exactly, and the last,
//! partial batch is padded with zeros whose outputs are not counted.
//! Unreadable images are left out and counted (as in the trainer's
//! evaluation).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use super::{
    BackendJob, Trained, check_against_model, load_trained, model_from, on_backend, open_val,
};
use crate::backend::Backend;
use crate::data::{Corner, Dataset, Loader, LoaderConfig, TEN_VIEWS};
use crate::train::{DeviceChoice, TrainOptions, apply_overrides, train_augment};

/// Views per image.
const VIEWS: usize = TEN_VIEWS.len();

/// What `host test` evaluates, and where.
#[derive(Clone, Debug)]
pub struct TestOptions {
    /// Config to build the network from instead of the checkpoint's own.
    pub config: Option<PathBuf>,
    /// Replaces the config's data source, as `train --data` does.
    pub data: Option<PathBuf>,
    pub device: DeviceChoice,
    pub gpu: usize,
    /// Images per forward pass (the model holds ten times as many views).
    pub batch_size: usize,
    pub progress: bool,
}

impl Default for TestOptions {
    fn default() -> Self {
        TestOptions {
            config: None,
            data: None,
            device: DeviceChoice::Auto,
            gpu: 0,
            batch_size: 16,
            progress: true,
        }
    }
}

/// Top-1 and top-5 accuracy, as fractions in `[0, 1]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopK {
    pub top1: f64,
    pub top5: f64,
}

/// The outcome of a ten-view test.
#[derive(Clone, Debug, PartialEq)]
pub struct TestResult {
    /// The validation set, as the dataset describes itself.
    pub dataset: String,
    /// The backend that ran it.
    pub backend: String,
    /// Images evaluated.
    pub images: usize,
    /// Images that could not be read and were left out.
    pub skipped: usize,
    /// Softmax outputs averaged over the ten views.
    pub ten_view: TopK,
    /// The plain centre crop alone.
    pub centre: TopK,
}

/// `host test CKPT`: runs [`ten_view_test`] and prints its result.
pub fn test(checkpoint: &Path, opts: &TestOptions) -> Result<()> {
    let r = ten_view_test(checkpoint, opts)?;
    println!(
        "10-view test of {} on {}: {}",
        checkpoint.display(),
        r.backend,
        r.dataset
    );
    println!(
        "images evaluated: {}, skipped (unreadable): {}",
        r.images, r.skipped
    );
    for (name, k) in [("ten views:  ", r.ten_view), ("centre crop:", r.centre)] {
        println!(
            "{name} top-1 accuracy {:6.2}%  error {:6.2}%   top-5 accuracy {:6.2}%  error {:6.2}%",
            100.0 * k.top1,
            100.0 * (1.0 - k.top1),
            100.0 * k.top5,
            100.0 * (1.0 - k.top5)
        );
    }
    Ok(())
}

/// The ten-view test of the checkpoint at `checkpoint` on the validation
/// split of its config's data (see the module docs).
pub fn ten_view_test(checkpoint: &Path, opts: &TestOptions) -> Result<TestResult> {
    if opts.batch_size == 0 {
        bail!("--batch-size: must be ≥ 1, got 0");
    }
    let mut trained = load_trained(checkpoint, opts.config.as_deref())?;
    let overrides = TrainOptions {
        data: opts.data.clone(),
        ..Default::default()
    };
    apply_overrides(&mut trained.config, &overrides)?;
    let val = open_val(&trained.config)?;
    check_against_model(val.as_ref(), &trained.config)?;
    on_backend(
        opts.device,
        opts.gpu,
        Job {
            trained: &trained,
            val,
            batch_size: opts.batch_size,
            progress: opts.progress,
        },
    )
}

struct Job<'a> {
    trained: &'a Trained,
    val: Arc<dyn Dataset>,
    batch_size: usize,
    progress: bool,
}

impl BackendJob for Job<'_> {
    type Output = TestResult;

    fn run<B: Backend>(self, be: &B) -> Result<TestResult> {
        let cfg = &self.trained.config;
        let loader = Loader::new(
            self.val.clone(),
            LoaderConfig::ten_view(self.batch_size, &train_augment(cfg)),
        )?;
        if loader.output_shape() != cfg.model.input {
            bail!(
                "{}: the views are {:?} but the network's input is {:?}",
                cfg.origin,
                loader.output_shape(),
                cfg.model.input
            );
        }
        let centre = TEN_VIEWS
            .iter()
            .position(|&v| v == (Corner::Centre, false))
            .context("the ten views have no plain centre crop")?;
        let mut model = model_from(be, self.trained, VIEWS * self.batch_size)?;
        let classes = model.classes;
        let per_view = model.input_len_per_sample();
        let bar = progress_bar(self.progress, loader.batches_per_epoch());

        let (mut images, mut skipped) = (0usize, 0usize);
        let (mut ten, mut single) = (Counts::default(), Counts::default());
        let mut labels = Vec::with_capacity(model.batch);
        let mut mean = vec![0.0f32; classes];
        for batch in loader.epoch(0) {
            let mut batch = batch?;
            bar.inc(1);
            skipped += batch.skipped;
            let Some(&first) = batch.labels.first() else {
                continue;
            };
            labels.clear();
            for &l in &batch.labels {
                labels.extend(std::iter::repeat_n(l, VIEWS));
            }
            labels.resize(model.batch, first);
            batch.images.resize(model.batch * per_view, 0.0);
            model.set_batch(be, &batch.images, &labels)?;
            model.forward(be, None)?;
            let probs = model.read_probs(be)?;
            for (views, &label) in probs.chunks_exact(VIEWS * classes).zip(&batch.labels) {
                mean.fill(0.0);
                for view in views.chunks_exact(classes) {
                    for (m, &p) in mean.iter_mut().zip(view) {
                        *m += p / VIEWS as f32;
                    }
                }
                ten.add(rank(&mean, label as usize)?);
                single.add(rank(
                    &views[centre * classes..(centre + 1) * classes],
                    label as usize,
                )?);
            }
            images += batch.n;
        }
        bar.finish_and_clear();
        if images == 0 {
            bail!(
                "{}: no readable validation images ({skipped} skipped)",
                self.val.describe()
            );
        }
        Ok(TestResult {
            dataset: self.val.describe(),
            backend: be.name(),
            images,
            skipped,
            ten_view: ten.rates(images),
            centre: single.rates(images),
        })
    }
}

/// Images ranked within the top 1 and top 5.
#[derive(Default)]
struct Counts {
    top1: usize,
    top5: usize,
}

impl Counts {
    fn add(&mut self, rank: usize) {
        self.top1 += usize::from(rank < 1);
        self.top5 += usize::from(rank < 5);
    }

    fn rates(&self, images: usize) -> TopK {
        TopK {
            top1: self.top1 as f64 / images as f64,
            top5: self.top5 as f64 / images as f64,
        }
    }
}

/// How many classes score strictly higher than `label` (top-k correct ⇔
/// rank < k, the backend's `label_rank` convention).
fn rank(probs: &[f32], label: usize) -> Result<usize> {
    if let Some(bad) = probs.iter().find(|p| !p.is_finite()) {
        bail!("the network's output {bad} is not finite (are the checkpoint's weights?)");
    }
    let p = probs[label];
    Ok(probs.iter().filter(|&&q| q > p).count())
}

fn progress_bar(show: bool, len: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("test [{bar:30}] {pos}/{len} batches ETA {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_counts_strictly_higher_scores() {
        assert_eq!(rank(&[0.1, 0.6, 0.3], 1).unwrap(), 0);
        assert_eq!(rank(&[0.1, 0.6, 0.3], 0).unwrap(), 2);
        assert_eq!(rank(&[0.5, 0.5], 1).unwrap(), 0);
        assert!(rank(&[f32::NAN, 0.5], 1).is_err());
    }
}
