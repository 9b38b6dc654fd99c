//! `metrics.jsonl`: one [`MetricsRecord`] per line.
//!
//! Each line is written with a single `write` on an unbuffered append-mode
//! file, so readers (plots, `tail -f`) see whole lines. Non-finite floats
//! (a diverged loss) are written as `null` and read back as NaN.
//!
//! A resumed run appends to the same file, so records past the resumed
//! checkpoint may appear twice; [`resolve_resumed`] keeps the newer ones.

use anyhow::{Result, anyhow};
use serde::{Deserialize, Deserializer, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// File name of the metrics log inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Which data a record was measured on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// Optimizer steps completed.
    pub step: u64,
    /// Epochs completed, fractional: 2.5 is half-way through the third
    /// epoch; a validation after the third epoch has 3.0.
    pub epoch: f64,
    pub split: Split,
    /// Mean cross-entropy loss over the logging window (train) or the
    /// validation set (val).
    #[serde(deserialize_with = "null_as_nan")]
    pub loss: f32,
    /// Top-1 accuracy as a fraction in `[0, 1]`.
    #[serde(deserialize_with = "null_as_nan")]
    pub top1: f32,
    /// Top-5 accuracy as a fraction in `[0, 1]`.
    #[serde(deserialize_with = "null_as_nan")]
    pub top5: f32,
    /// Learning rate in effect.
    #[serde(deserialize_with = "null_as_nan")]
    pub lr: f32,
    /// Throughput over the logging window (val: evaluation throughput).
    #[serde(deserialize_with = "null_as_nan")]
    pub images_per_sec: f32,
    /// Wall-clock seconds since the run (first launch) started.
    pub time_s: f64,
}

/// serde_json writes non-finite floats as `null`; read them back as NaN.
fn null_as_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

/// Appends records to `<run_dir>/metrics.jsonl`.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Opens (creating `run_dir` and the file if needed) for appending. If a
    /// crash left a partial last line, a newline is added so the next record
    /// starts on its own line.
    pub fn open(run_dir: &Path) -> Result<Self> {
        fs::create_dir_all(run_dir)
            .map_err(|e| anyhow!("{}: cannot create run directory: {e}", run_dir.display()))?;
        let path = run_dir.join(METRICS_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| anyhow!("{}: cannot open: {e}", path.display()))?;
        let ends_mid_line = (|| -> std::io::Result<bool> {
            let len = file.metadata()?.len();
            if len == 0 {
                return Ok(false);
            }
            file.seek(SeekFrom::Start(len - 1))?;
            let mut last = [0u8];
            file.read_exact(&mut last)?;
            Ok(last[0] != b'\n')
        })()
        .map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
        if ends_mid_line {
            file.write_all(b"\n")
                .map_err(|e| anyhow!("{}: cannot write: {e}", path.display()))?;
        }
        Ok(Self { path, file })
    }

    /// Appends one record as one line and flushes it.
    pub fn append(&mut self, record: &MetricsRecord) -> Result<()> {
        let mut line = serde_json::to_vec(record)
            .map_err(|e| anyhow!("{}: cannot encode record: {e}", self.path.display()))?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.flush())
            .map_err(|e| anyhow!("{}: cannot write: {e}", self.path.display()))
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every record of a metrics log in file order. Blank lines are
/// ignored; a line that does not parse (e.g. cut short by a crash) is skipped
/// with a warning naming `file:line`, so one bad line does not cost the plots.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsRecord>> {
    let text =
        fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(r) => records.push(r),
            Err(e) => tracing::warn!("{}:{}: skipped: {e}", path.display(), i + 1),
        }
    }
    Ok(records)
}

/// Removes records superseded by a resume. When a record's step is not past
/// the latest step already seen for its split, the run was resumed from an
/// earlier checkpoint: every earlier record (either split) at or after that
/// step belongs to the abandoned stretch and is dropped.
pub fn resolve_resumed(records: Vec<MetricsRecord>) -> Vec<MetricsRecord> {
    let mut out: Vec<MetricsRecord> = Vec::with_capacity(records.len());
    let mut last = [None::<u64>; 2];
    let slot = |s: Split| match s {
        Split::Train => 0,
        Split::Val => 1,
    };
    for r in records {
        if last[slot(r.split)].is_some_and(|s| r.step <= s) {
            out.retain(|o| o.step < r.step);
            for split in [Split::Train, Split::Val] {
                last[slot(split)] = out
                    .iter()
                    .filter(|o| o.split == split)
                    .map(|o| o.step)
                    .max();
            }
        }
        last[slot(r.split)] = Some(r.step);
        out.push(r);
    }
    out
}
