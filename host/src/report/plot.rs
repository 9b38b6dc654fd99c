//! Training curves: `loss.png` (loss vs step) and `accuracy.png` (top-1 and
//! top-5 vs epoch), drawn with plotters' bitmap backend from `metrics.jsonl`.
//!
//! Text uses DejaVu Sans embedded from `host/assets/` (its license is next to
//! it) and registered with plotters' `ab_glyph` renderer, so plots render on
//! machines without system fonts. If registration fails, the plots are drawn
//! without text (axes, grid and lines only) rather than not at all.
//!
//! Drawing returns errors instead of panicking; as a last guard, a panic
//! inside plotters is caught and returned as an error too.

use super::metrics::{METRICS_FILE, MetricsRecord, Split, read_metrics, resolve_resumed};
use anyhow::{Result, anyhow, bail};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// File name of the loss plot inside a run directory.
pub const LOSS_PNG: &str = "loss.png";
/// File name of the accuracy plot inside a run directory.
pub const ACCURACY_PNG: &str = "accuracy.png";

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
const FONT_FAMILY: &str = "sans-serif";

const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const TRAIN_TOP5_COLOR: RGBColor = RGBColor(140, 190, 230);
const VAL_TOP5_COLOR: RGBColor = RGBColor(240, 150, 150);

/// Registers the embedded font once; `true` if text can be drawn.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).is_ok()
    })
}

/// Paths of the plots written.
#[derive(Clone, Debug, PartialEq)]
pub struct PlotFiles {
    pub loss: PathBuf,
    pub accuracy: PathBuf,
}

/// Plot settings: image size in pixels and whether to draw text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plotter {
    pub width: u32,
    pub height: u32,
    /// Captions, axis labels and legends. [`Plotter::default`] turns this on
    /// when the embedded font registered.
    pub text: bool,
}

impl Default for Plotter {
    fn default() -> Self {
        Self {
            width: 1024,
            height: 640,
            text: font_ready(),
        }
    }
}

/// Writes `loss.png` and `accuracy.png` into `run_dir` from its
/// `metrics.jsonl`, with [`Plotter::default`] settings.
pub fn plot_curves(run_dir: &Path) -> Result<PlotFiles> {
    Plotter::default().plot(run_dir)
}

impl Plotter {
    /// Reads `<run_dir>/metrics.jsonl` (resumed stretches resolved) and
    /// writes both plots next to it.
    pub fn plot(&self, run_dir: &Path) -> Result<PlotFiles> {
        let records = resolve_resumed(read_metrics(&run_dir.join(METRICS_FILE))?);
        let files = PlotFiles {
            loss: run_dir.join(LOSS_PNG),
            accuracy: run_dir.join(ACCURACY_PNG),
        };
        self.plot_records(&records, &files)?;
        Ok(files)
    }

    /// Draws both plots from `records` to the given paths.
    pub fn plot_records(&self, records: &[MetricsRecord], files: &PlotFiles) -> Result<()> {
        if self.width < 64 || self.height < 64 {
            bail!(
                "plot size {}x{} too small (at least 64x64)",
                self.width,
                self.height
            );
        }
        if self.text && !font_ready() {
            bail!("plot text requested but the embedded font did not register");
        }
        self.guarded(&files.loss, |area| self.draw_loss(area, records))?;
        self.guarded(&files.accuracy, |area| self.draw_accuracy(area, records))
    }

    /// Runs `draw` on a fresh white bitmap for `path` and saves it, turning
    /// plotters errors (and panics) into one-line errors naming the file.
    fn guarded<F>(&self, path: &Path, draw: F) -> Result<()>
    where
        F: FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
    {
        let outcome = catch_unwind(AssertUnwindSafe(|| -> DrawResult {
            let area = BitMapBackend::new(path, (self.width, self.height)).into_drawing_area();
            area.fill(&WHITE).map_err(|e| e.to_string())?;
            draw(&area)?;
            area.present().map_err(|e| e.to_string())
        }));
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(anyhow!("{}: cannot draw plot: {e}", path.display())),
            Err(_) => Err(anyhow!("{}: plotting library panicked", path.display())),
        }
    }

    fn draw_loss(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        records: &[MetricsRecord],
    ) -> DrawResult {
        let train = series(records, Split::Train, |r| r.step as f64, |r| r.loss);
        let val = series(records, Split::Val, |r| r.step as f64, |r| r.loss);
        let x = padded_range(train.iter().chain(&val).map(|p| p.0), false);
        let y_max = train.iter().chain(&val).map(|p| p.1).fold(0.0, f64::max);
        let y = 0.0..if y_max > 0.0 { y_max * 1.05 } else { 1.0 };
        let lines = [
            Line {
                points: &train,
                color: TRAIN_COLOR,
                label: "train loss",
                markers: false,
            },
            Line {
                points: &val,
                color: VAL_COLOR,
                label: "val loss",
                markers: true,
            },
        ];
        self.draw_chart(area, "Loss", "step", "cross-entropy loss", x, y, &lines)
    }

    fn draw_accuracy(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        records: &[MetricsRecord],
    ) -> DrawResult {
        let pct = |f: fn(&MetricsRecord) -> f32| move |r: &MetricsRecord| f(r) * 100.0;
        let train1 = series(records, Split::Train, |r| r.epoch, pct(|r| r.top1));
        let train5 = series(records, Split::Train, |r| r.epoch, pct(|r| r.top5));
        let val1 = series(records, Split::Val, |r| r.epoch, pct(|r| r.top1));
        let val5 = series(records, Split::Val, |r| r.epoch, pct(|r| r.top5));
        let x = padded_range(
            [&train1, &train5, &val1, &val5]
                .into_iter()
                .flatten()
                .map(|p| p.0),
            true,
        );
        let lines = [
            Line {
                points: &train1,
                color: TRAIN_COLOR,
                label: "train top-1",
                markers: false,
            },
            Line {
                points: &train5,
                color: TRAIN_TOP5_COLOR,
                label: "train top-5",
                markers: false,
            },
            Line {
                points: &val1,
                color: VAL_COLOR,
                label: "val top-1",
                markers: true,
            },
            Line {
                points: &val5,
                color: VAL_TOP5_COLOR,
                label: "val top-5",
                markers: true,
            },
        ];
        self.draw_chart(
            area,
            "Accuracy",
            "epoch",
            "accuracy (%)",
            x,
            0.0..100.0,
            &lines,
        )
    }

    /// One chart: mesh, lines, and (with text) caption, axis names, legend.
    #[allow(clippy::too_many_arguments)]
    fn draw_chart(
        &self,
        area: &DrawingArea<BitMapBackend<'_>, Shift>,
        caption: &str,
        x_desc: &str,
        y_desc: &str,
        x: Range<f64>,
        y: Range<f64>,
        lines: &[Line<'_>],
    ) -> DrawResult {
        let mut builder = ChartBuilder::on(area);
        builder.margin(16).margin_right(32);
        if self.text {
            builder
                .caption(caption, (FONT_FAMILY, 24))
                .x_label_area_size(44)
                .y_label_area_size(64);
        } else {
            builder.x_label_area_size(8).y_label_area_size(8);
        }
        let mut chart = builder.build_cartesian_2d(x, y).map_err(err)?;
        let mut mesh = chart.configure_mesh();
        if self.text {
            mesh.x_desc(x_desc)
                .y_desc(y_desc)
                .x_label_formatter(&tick)
                .y_label_formatter(&tick)
                .label_style((FONT_FAMILY, 14))
                .axis_desc_style((FONT_FAMILY, 16));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(err)?;
        for line in lines {
            let style = line.color.stroke_width(2);
            let drawn = chart
                .draw_series(LineSeries::new(line.points.iter().copied(), style))
                .map_err(err)?;
            if self.text {
                let color = line.color;
                drawn.label(line.label).legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
            }
            if line.markers {
                chart
                    .draw_series(
                        line.points
                            .iter()
                            .map(|&p| Circle::new(p, 3, line.color.filled())),
                    )
                    .map_err(err)?;
            }
        }
        if self.text && lines.iter().any(|l| !l.points.is_empty()) {
            chart
                .configure_series_labels()
                .label_font((FONT_FAMILY, 14))
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(err)?;
        }
        Ok(())
    }
}

type DrawResult = std::result::Result<(), String>;

/// Axis tick text: whole numbers without decimals, others with up to 3.
fn tick(v: &f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

struct Line<'a> {
    points: &'a [(f64, f64)],
    color: RGBColor,
    label: &'static str,
    markers: bool,
}

/// `(x, y)` points of one split, skipping non-finite values.
fn series(
    records: &[MetricsRecord],
    split: Split,
    x: impl Fn(&MetricsRecord) -> f64,
    y: impl Fn(&MetricsRecord) -> f32,
) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter(|r| r.split == split)
        .map(|r| (x(r), y(r) as f64))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect()
}

/// The span of `xs` (from 0 when `from_zero`), widened when empty or a
/// single point so the chart always has a non-empty range.
fn padded_range(xs: impl Iterator<Item = f64>, from_zero: bool) -> Range<f64> {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if lo > hi {
        return 0.0..1.0;
    }
    let lo = if from_zero { lo.min(0.0) } else { lo };
    if hi - lo > 0.0 { lo..hi } else { lo..lo + 1.0 }
}
