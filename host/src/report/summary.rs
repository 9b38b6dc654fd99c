//! The end-of-run summary: a short table of what a run achieved.
//!
//! [`Summary::from_metrics`] fills what the metrics log knows; the trainer
//! sets the rest (checkpoint path, exact wall time) before printing. The
//! paper reports error rates, so accuracies are shown with their error rate.

use super::metrics::{MetricsRecord, Split};
use std::fmt;
use std::path::PathBuf;

/// End-of-run numbers. Accuracies are fractions in `[0, 1]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Epochs completed (fractional).
    pub epochs: f64,
    /// Optimizer steps completed.
    pub steps: u64,
    /// Best validation top-1 accuracy and the epoch it was measured at.
    pub best_val_top1: Option<(f32, f64)>,
    /// Best validation top-5 accuracy (over all validations, not
    /// necessarily at the best top-1 epoch).
    pub best_val_top5: Option<f32>,
    pub final_train_loss: Option<f32>,
    pub final_val_loss: Option<f32>,
    pub wall_time_s: f64,
    /// Mean training throughput over the logged windows.
    pub images_per_sec: Option<f32>,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
}

impl Summary {
    /// Summarises `records` (resolve resumes first with
    /// [`resolve_resumed`](super::resolve_resumed)). Non-finite values are
    /// ignored; `checkpoint` is left empty.
    pub fn from_metrics(records: &[MetricsRecord]) -> Self {
        let of = |split: Split| records.iter().filter(move |r| r.split == split);
        let finite = |v: f32| v.is_finite().then_some(v);
        let best_val_top1 =
            of(Split::Val)
                .filter(|r| r.top1.is_finite())
                .fold(None::<(f32, f64)>, |best, r| match best {
                    Some((b, _)) if b >= r.top1 => best,
                    _ => Some((r.top1, r.epoch)),
                });
        let best_val_top5 = of(Split::Val)
            .filter_map(|r| finite(r.top5))
            .reduce(f32::max);
        let rates: Vec<f32> = of(Split::Train)
            .filter_map(|r| finite(r.images_per_sec))
            .collect();
        Self {
            epochs: records.iter().map(|r| r.epoch).fold(0.0, f64::max),
            steps: records.iter().map(|r| r.step).max().unwrap_or(0),
            best_val_top1,
            best_val_top5,
            final_train_loss: of(Split::Train).next_back().and_then(|r| finite(r.loss)),
            final_val_loss: of(Split::Val).next_back().and_then(|r| finite(r.loss)),
            wall_time_s: records.iter().map(|r| r.time_s).fold(0.0, f64::max),
            images_per_sec: (!rates.is_empty())
                .then(|| rates.iter().sum::<f32>() / rates.len() as f32),
            checkpoint: None,
        }
    }

    /// Prints the table to stdout.
    pub fn print(&self) {
        print!("{self}");
    }
}

const NONE: &str = "n/a";

fn accuracy(a: f32) -> String {
    format!("{:.2}%  (error {:.2}%)", a * 100.0, (1.0 - a) * 100.0)
}

fn loss(l: Option<f32>) -> String {
    l.map_or(NONE.into(), |l| format!("{l:.4}"))
}

/// `3d 04h 05m 06s`, leading zero units dropped.
fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return NONE.into();
    }
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s:02}s"),
        (0, _, _) => format!("{h}h {m:02}m {s:02}s"),
        _ => format!("{d}d {h:02}h {m:02}m {s:02}s"),
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows = [
            (
                "epochs",
                format!("{:.2}  ({} steps)", self.epochs, self.steps),
            ),
            (
                "best val top-1",
                self.best_val_top1.map_or(NONE.into(), |(a, e)| {
                    format!("{}  at epoch {e:.2}", accuracy(a))
                }),
            ),
            (
                "best val top-5",
                self.best_val_top5.map_or(NONE.into(), accuracy),
            ),
            ("final train loss", loss(self.final_train_loss)),
            ("final val loss", loss(self.final_val_loss)),
            ("wall time", duration(self.wall_time_s)),
            (
                "throughput",
                self.images_per_sec
                    .map_or(NONE.into(), |r| format!("{r:.1} images/s")),
            ),
            (
                "checkpoint",
                self.checkpoint
                    .as_ref()
                    .map_or(NONE.into(), |p| p.display().to_string()),
            ),
        ];
        let label_w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
        let value_w = rows
            .iter()
            .map(|(_, v)| v.chars().count())
            .max()
            .unwrap_or(0);
        let rule = "-".repeat(label_w + value_w + 7);
        writeln!(f, "{rule}")?;
        writeln!(f, "| {:<w$} |", "run summary", w = label_w + value_w + 3)?;
        writeln!(f, "{rule}")?;
        for (label, value) in rows {
            writeln!(f, "| {label:<label_w$} | {value:<value_w$} |")?;
        }
        writeln!(f, "{rule}")
    }
}
