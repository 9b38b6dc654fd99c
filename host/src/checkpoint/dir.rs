//! A directory of step-numbered checkpoints with a `latest` pointer and
//! keep-last-K retention.
//!
//! Files are `step-<NNNNNNNN>.safetensors` (zero-padded to 8 digits so `ls`
//! sorts them; larger steps simply get more digits). `latest` is a one-line
//! text file naming the newest checkpoint's file name.
//!
//! A save runs in this order: checkpoint file (atomic), `latest` (atomic),
//! then pruning. So `latest` only ever names a complete file, and a crash
//! between the first two steps leaves `latest` on the previous checkpoint,
//! which is still intact. `latest` is authoritative rather than "highest step
//! number": after a rollback (resuming from an earlier step), higher-numbered
//! files from the abandoned run may remain until the new run overwrites them,
//! and they must not be picked up on the next resume. Pruning never deletes
//! the file `latest` names. One writer per directory (rank 0 in multi-GPU).

use super::{Checkpoint, save_atomic, sync_parent_dir, tmp_path};
use anyhow::{Result, anyhow, bail};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Name of the pointer file inside a checkpoint directory.
pub const LATEST_FILE: &str = "latest";

/// Step-numbered checkpoints in `dir`, keeping the newest `keep`.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    pub dir: PathBuf,
    pub keep: usize,
}

impl CheckpointDir {
    /// Creates `dir` if needed. `keep` must be at least 1.
    pub fn new(dir: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let dir = dir.into();
        if keep == 0 {
            bail!(
                "{}: keep must be at least 1 checkpoint, got 0",
                dir.display()
            );
        }
        fs::create_dir_all(&dir)
            .map_err(|e| anyhow!("{}: cannot create directory: {e}", dir.display()))?;
        Ok(Self { dir, keep })
    }

    /// The file name used for `step`: `step-00001234.safetensors`.
    pub fn file_name(step: u64) -> String {
        format!("step-{step:08}.safetensors")
    }

    /// The path used for `step`.
    pub fn path_for(&self, step: u64) -> PathBuf {
        self.dir.join(Self::file_name(step))
    }

    /// Saves `ckpt` as `step-<meta.step>.safetensors`, points `latest` at it
    /// and prunes to the newest `keep`. Returns the checkpoint's path.
    pub fn save(&self, ckpt: &Checkpoint) -> Result<PathBuf> {
        let path = self.path_for(ckpt.meta.step);
        save_atomic(&path, ckpt)?;
        write_latest(&self.dir, &Self::file_name(ckpt.meta.step))?;
        self.prune()?;
        Ok(path)
    }

    /// Checkpoints in the directory as `(step, path)`, ascending by step.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        list_steps(&self.dir)
    }

    /// The checkpoint to resume from; see [`latest`].
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        latest(&self.dir)
    }

    /// Deletes all but the newest `keep` checkpoints (by step), never the one
    /// `latest` names, and removes leftover `.tmp` files of interrupted
    /// writes.
    pub fn prune(&self) -> Result<()> {
        let pinned = read_latest(&self.dir)?;
        let steps = self.list()?;
        let excess = steps.len().saturating_sub(self.keep);
        for (_, path) in &steps[..excess] {
            if pinned.as_deref() == Some(path.as_path()) {
                continue;
            }
            fs::remove_file(path)
                .map_err(|e| anyhow!("{}: cannot delete old checkpoint: {e}", path.display()))?;
        }
        for entry in read_dir(&self.dir)? {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let is_tmp = name
                .strip_suffix(".tmp")
                .is_some_and(|base| base == LATEST_FILE || parse_step(base).is_some());
            if is_tmp {
                let path = entry.path();
                fs::remove_file(&path)
                    .map_err(|e| anyhow!("{}: cannot delete stale file: {e}", path.display()))?;
            }
        }
        Ok(())
    }
}

/// The checkpoint to resume from in `dir`: the file `latest` names if it
/// exists, else (no pointer, or it names a missing file) the highest-step
/// `step-*.safetensors`, else `None`. A missing `dir` is `None`.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    if !dir.exists() {
        return Ok(None);
    }
    if let Some(path) = read_latest(dir)?
        && path.is_file()
    {
        return Ok(Some(path));
    }
    Ok(list_steps(dir)?.pop().map(|(_, p)| p))
}

/// The path the pointer file names, if the pointer exists.
fn read_latest(dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = dir.join(LATEST_FILE);
    match fs::read_to_string(&pointer) {
        Ok(s) => {
            let name = s.trim();
            if name.is_empty() || name.contains('/') || name.contains('\\') {
                bail!(
                    "{}: expected a checkpoint file name, found {name:?}",
                    pointer.display()
                );
            }
            Ok(Some(dir.join(name)))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow!("{}: cannot read: {e}", pointer.display())),
    }
}

/// Points `dir/latest` at `file_name`, atomically (tmp, fsync, rename,
/// fsync directory).
fn write_latest(dir: &Path, file_name: &str) -> Result<()> {
    let pointer = dir.join(LATEST_FILE);
    let tmp = tmp_path(&pointer);
    let written = fs::File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(file_name.as_bytes())?;
            f.write_all(b"\n")?;
            f.sync_all()
        })
        .map_err(|e| anyhow!("{}: cannot write: {e}", tmp.display()))
        .and_then(|()| {
            fs::rename(&tmp, &pointer)
                .map_err(|e| anyhow!("{}: cannot rename to latest: {e}", tmp.display()))
        });
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent_dir(&pointer)
}

/// `step-<digits>.safetensors` → the step.
fn parse_step(file_name: &str) -> Option<u64> {
    let digits = file_name
        .strip_prefix("step-")?
        .strip_suffix(".safetensors")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn read_dir(dir: &Path) -> Result<Vec<fs::DirEntry>> {
    fs::read_dir(dir)
        .and_then(|it| it.collect::<std::io::Result<Vec<_>>>())
        .map_err(|e| anyhow!("{}: cannot list directory: {e}", dir.display()))
}

fn list_steps(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut steps: Vec<(u64, PathBuf)> = read_dir(dir)?
        .into_iter()
        .filter_map(|e| {
            let step = parse_step(&e.file_name().to_string_lossy())?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort();
    Ok(steps)
}
