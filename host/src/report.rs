//! Run reporting: the metrics log, training-curve plots, the conv1 filter
//! grid and the end-of-run summary.
//!
//! Everything a run reports lives in its run directory:
//! - `metrics.jsonl`: one JSON object per line ([`MetricsRecord`]), appended
//!   and flushed per line, so a crashed or running job can be inspected and a
//!   resumed job continues the same file.
//! - `loss.png`, `accuracy.png`: drawn from `metrics.jsonl` by
//!   [`plot_curves`] (plotters, bitmap backend, an embedded DejaVu Sans font
//!   so no system fonts are needed).
//! - a conv1 filter grid like the paper's Figure 3 ([`filter_grid_png`]).
//!
//! Accuracies are fractions in `[0, 1]` everywhere in data; plots and the
//! summary show percentages. Nothing here panics on bad data: plotting
//! returns errors the trainer can log as warnings.

mod filters;
mod metrics;
mod plot;
mod summary;

pub use filters::{filter_grid_layout, filter_grid_png};
pub use metrics::{METRICS_FILE, MetricsLog, MetricsRecord, Split, read_metrics, resolve_resumed};
pub use plot::{ACCURACY_PNG, LOSS_PNG, PlotFiles, Plotter, plot_curves};
pub use summary::Summary;
