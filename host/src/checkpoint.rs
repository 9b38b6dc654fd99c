//! Checkpoints: model parameters, SGD momentum and training state in one
//! safetensors file.
//!
//! # Layout
//! Every tensor is little-endian `F32` with PyTorch's parameter name and
//! layout, so a checkpoint loads into a PyTorch AlexNet without conversion:
//! - `<layer>.weight`: conv `[out, in/groups, kh, kw]`, fc `[out, in]`;
//!   `<layer>.bias`: `[out]`.
//! - fc6's `in` axis uses PyTorch's (C, H, W) flatten order of pool5's
//!   output. The model keeps activations NCHW, so its own flatten order is
//!   already that one and weights are stored as they are in memory.
//! - `<name>.momentum`: the SGD momentum buffer of parameter `<name>`, same
//!   shape. Momentum is optional (a weights-only export has none).
//!
//! Training state goes in the safetensors header's `__metadata__` string map:
//! `alexnet.meta` holds [`CheckpointMeta`] (minus the config) as JSON with a
//! format version and the saved tensor order, `alexnet.config` holds the run's
//! config JSON verbatim so it can be read with any safetensors tool, and
//! `format = "pt"` marks the file as PyTorch-layout for Hugging Face tooling.
//!
//! # Loading in PyTorch
//! ```python
//! from safetensors.torch import load_file
//! d = load_file("step-00001000.safetensors")
//! model.load_state_dict({k: v for k, v in d.items() if not k.endswith(".momentum")})
//! ```
//! (`load_state_dict(d, strict=False)` also works but would hide a real
//! mismatch.) The layer names must match the PyTorch module's names; the
//! caller chooses them.
//!
//! # Durability
//! [`save_atomic`] writes `<path>.tmp`, fsyncs it, renames it over `<path>`
//! and fsyncs the directory, so after a crash `<path>` is either the old or
//! the new checkpoint, never a mix. [`CheckpointDir`] adds step-numbered
//! names, a `latest` pointer and retention on top.
//!
//! Everything here is plain host code (no GPU): the trainer copies
//! parameters to host vectors first.

mod dir;

pub use dir::{CheckpointDir, latest};

use anyhow::{Result, anyhow, bail};
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::path::{Path, PathBuf};

/// Header key holding [`CheckpointMeta`] (without the config) as JSON.
pub const META_KEY: &str = "alexnet.meta";
/// Header key holding the run's config JSON verbatim.
pub const CONFIG_KEY: &str = "alexnet.config";
/// Suffix that marks a momentum tensor: `conv1.weight.momentum`.
pub const MOMENTUM_SUFFIX: &str = ".momentum";
/// Version of the `alexnet.meta` JSON; bumped on incompatible changes.
pub const FORMAT_VERSION: u32 = 1;

/// One named f32 tensor, row-major (the last axis varies fastest).
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl NamedTensor {
    /// A tensor whose `data` length is checked against `shape`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let t = Self {
            name: name.into(),
            shape,
            data,
        };
        t.check_len()?;
        Ok(t)
    }

    /// Number of elements the shape describes.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn check_len(&self) -> Result<()> {
        let expected = self
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| anyhow!("{} has shape {:?}, too large", self.name, self.shape))?;
        if self.data.len() != expected {
            bail!(
                "{} has shape {:?} ({expected} values) but {} values",
                self.name,
                self.shape,
                self.data.len()
            );
        }
        Ok(())
    }
}

/// Training state saved with the tensors.
///
/// Accuracies are fractions in `[0, 1]`, as in the metrics log.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Optimizer steps completed.
    pub step: u64,
    /// Epoch the next batch belongs to (0-based).
    pub epoch: u64,
    /// Batches of `epoch` already consumed (resume skips them).
    pub batch_in_epoch: u64,
    /// The run's base seed.
    pub seed: u64,
    /// Opaque serialised RNG state (the trainer picks the encoding).
    pub rng_state: String,
    /// The run's config JSON, stored under [`CONFIG_KEY`].
    pub config_json: String,
    /// Learning rate in effect at `step`.
    pub lr: f32,
    /// Best validation top-1 accuracy so far, if validated yet.
    pub best_val_top1: Option<f32>,
    /// Free-form extra state.
    pub extra: BTreeMap<String, String>,
}

/// A checkpoint in memory: parameters, momentum and training state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Checkpoint {
    /// Parameters in the caller's order (kept across save and load).
    pub tensors: Vec<NamedTensor>,
    /// Momentum buffers named after their parameter (no suffix here; the
    /// file stores them as `<name>.momentum`). Empty for weights-only files.
    pub momentum: Vec<NamedTensor>,
    pub meta: CheckpointMeta,
}

impl Checkpoint {
    /// The parameter called `name`.
    pub fn tensor(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The momentum buffer of parameter `name`.
    pub fn momentum_for(&self, name: &str) -> Option<&NamedTensor> {
        self.momentum.iter().find(|t| t.name == name)
    }

    /// Checks the parameters against the model's expected `(name, shape)`
    /// list: same names (order free) and shapes, and if momentum is present,
    /// a momentum buffer for every parameter. `source` names the file in the
    /// error, e.g. `ckpt.safetensors: conv2.weight has shape [256, 48, 5, 5],
    /// model expects [256, 96, 5, 5]`. Reports the first problem and how
    /// many more there are.
    pub fn validate<I, N, S>(&self, source: &Path, expected: I) -> Result<()>
    where
        I: IntoIterator<Item = (N, S)>,
        N: AsRef<str>,
        S: AsRef<[usize]>,
    {
        let mut problems = Vec::new();
        let mut expected_names = HashSet::new();
        for (name, shape) in expected {
            let (name, shape) = (name.as_ref(), shape.as_ref());
            expected_names.insert(name.to_string());
            match self.tensor(name) {
                None => problems.push(format!("missing {name} (model expects {shape:?})")),
                Some(t) if t.shape != shape => problems.push(format!(
                    "{name} has shape {:?}, model expects {shape:?}",
                    t.shape
                )),
                Some(_) => {}
            }
            if !self.momentum.is_empty() && self.momentum_for(name).is_none() {
                problems.push(format!("momentum for {name} missing"));
            }
        }
        for t in &self.tensors {
            if !expected_names.contains(&t.name) {
                problems.push(format!(
                    "has {} {:?}, which the model does not have",
                    t.name, t.shape
                ));
            }
        }
        match problems.len() {
            0 => Ok(()),
            1 => bail!("{}: {}", source.display(), problems[0]),
            n => bail!(
                "{}: {} (and {} more mismatches)",
                source.display(),
                problems[0],
                n - 1
            ),
        }
    }

    /// Checks internal consistency: data lengths, unique names, no parameter
    /// named like a momentum tensor, every momentum buffer matching a
    /// parameter's shape, and finite `lr`/`best_val_top1` (JSON has no NaN).
    fn check(&self) -> Result<()> {
        let mut shapes: HashMap<&str, &[usize]> = HashMap::new();
        for t in &self.tensors {
            t.check_len()?;
            if t.name.ends_with(MOMENTUM_SUFFIX) {
                bail!("parameter name {} ends with {MOMENTUM_SUFFIX}", t.name);
            }
            if shapes.insert(&t.name, &t.shape).is_some() {
                bail!("parameter {} appears twice", t.name);
            }
        }
        let mut seen = HashSet::new();
        for m in &self.momentum {
            m.check_len()?;
            match shapes.get(m.name.as_str()) {
                None => bail!("momentum for {} has no matching parameter", m.name),
                Some(s) if *s != m.shape.as_slice() => bail!(
                    "momentum for {} has shape {:?}, parameter has {:?}",
                    m.name,
                    m.shape,
                    s
                ),
                Some(_) => {}
            }
            if !seen.insert(&m.name) {
                bail!("momentum for {} appears twice", m.name);
            }
        }
        if !self.meta.lr.is_finite() {
            bail!("meta.lr is {}", self.meta.lr);
        }
        if let Some(b) = self.meta.best_val_top1.filter(|b| !b.is_finite()) {
            bail!("meta.best_val_top1 is {b}");
        }
        Ok(())
    }
}

/// The `alexnet.meta` JSON: the meta fields plus format version and the
/// parameter order (safetensors itself sorts tensors by name).
#[derive(Serialize, Deserialize)]
struct MetaRecord {
    version: u32,
    step: u64,
    epoch: u64,
    batch_in_epoch: u64,
    seed: u64,
    rng_state: String,
    lr: f32,
    best_val_top1: Option<f32>,
    extra: BTreeMap<String, String>,
    tensor_order: Vec<String>,
}

/// A borrowed f32 tensor as safetensors sees it.
struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// `path` with `.tmp` appended to its file name: `a/b.safetensors.tmp`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Writes `ckpt` to `path` atomically: `<path>.tmp` in the same directory,
/// fsync, rename over `path`, fsync the directory. A stale `.tmp` from an
/// interrupted earlier write is overwritten. On error `path` is untouched
/// and the `.tmp` is removed.
pub fn save_atomic(path: &Path, ckpt: &Checkpoint) -> Result<()> {
    ckpt.check()
        .map_err(|e| anyhow!("{}: not saved: {e}", path.display()))?;
    let meta = &ckpt.meta;
    let record = MetaRecord {
        version: FORMAT_VERSION,
        step: meta.step,
        epoch: meta.epoch,
        batch_in_epoch: meta.batch_in_epoch,
        seed: meta.seed,
        rng_state: meta.rng_state.clone(),
        lr: meta.lr,
        best_val_top1: meta.best_val_top1,
        extra: meta.extra.clone(),
        tensor_order: ckpt.tensors.iter().map(|t| t.name.clone()).collect(),
    };
    let header: HashMap<String, String> = [
        ("format".to_string(), "pt".to_string()),
        (
            META_KEY.to_string(),
            serde_json::to_string(&record)
                .map_err(|e| anyhow!("{}: cannot encode meta: {e}", path.display()))?,
        ),
        (CONFIG_KEY.to_string(), meta.config_json.clone()),
    ]
    .into();
    let views = ckpt
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t))
        .chain(
            ckpt.momentum
                .iter()
                .map(|t| (format!("{}{MOMENTUM_SUFFIX}", t.name), t)),
        )
        .map(|(name, t)| {
            (
                name,
                F32View {
                    shape: &t.shape,
                    data: &t.data,
                },
            )
        });

    let tmp = tmp_path(path);
    let written = safetensors::serialize_to_file(views, Some(header), &tmp)
        .map_err(|e| anyhow!("{}: cannot write: {e}", tmp.display()))
        .and_then(|()| {
            File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| anyhow!("{}: cannot fsync: {e}", tmp.display()))
        })
        .and_then(|()| {
            fs::rename(&tmp, path).map_err(|e| {
                anyhow!(
                    "{}: cannot rename to {}: {e}",
                    tmp.display(),
                    path.display()
                )
            })
        });
    if let Err(e) = written {
        // Best effort: the error above is the one worth reporting.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent_dir(path)
}

/// Fsyncs the directory holding `path` so a rename into it is durable.
pub(crate) fn sync_parent_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| anyhow!("{}: cannot fsync directory: {e}", dir.display()))
}

/// Reads a checkpoint written by [`save_atomic`]. Errors are one line naming
/// the file: missing/unreadable, not safetensors, a non-F32 tensor, missing
/// or invalid `alexnet.meta`, or inconsistent momentum.
///
/// The file is read into memory whole (no mmap), so a file replaced or
/// truncated by another process while loading cannot crash the reader.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let p = path.display();
    let bytes = fs::read(path).map_err(|e| anyhow!("{p}: cannot read checkpoint: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow!("{p}: not a safetensors file ({e})"))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{p}: not a safetensors file ({e})"))?;
    let strings = header.metadata().as_ref();
    let meta_json = strings
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| anyhow!("{p}: missing {META_KEY} metadata (not an alexnet checkpoint)"))?;
    let record: MetaRecord = serde_json::from_str(meta_json)
        .map_err(|e| anyhow!("{p}: invalid {META_KEY} metadata: {e}"))?;
    if record.version != FORMAT_VERSION {
        bail!(
            "{p}: checkpoint format version {}, this build reads version {FORMAT_VERSION}",
            record.version
        );
    }
    let config_json = strings
        .and_then(|m| m.get(CONFIG_KEY))
        .cloned()
        .ok_or_else(|| anyhow!("{p}: missing {CONFIG_KEY} metadata"))?;

    let mut params: HashMap<String, NamedTensor> = HashMap::new();
    let mut momentum = Vec::new();
    for name in header.offset_keys() {
        let t = read_f32(&st, &name).map_err(|e| anyhow!("{p}: {e}"))?;
        match name.strip_suffix(MOMENTUM_SUFFIX) {
            Some(param) => momentum.push(NamedTensor {
                name: param.to_string(),
                ..t
            }),
            None => {
                params.insert(name, t);
            }
        }
    }
    if record.tensor_order.len() != params.len() {
        bail!(
            "{p}: {META_KEY} lists {} parameters, the file holds {}",
            record.tensor_order.len(),
            params.len()
        );
    }
    let tensors = record
        .tensor_order
        .iter()
        .map(|name| {
            params
                .remove(name)
                .ok_or_else(|| anyhow!("{p}: {META_KEY} lists {name}, the file has no such tensor"))
        })
        .collect::<Result<Vec<_>>>()?;
    // Momentum follows the parameter order.
    momentum.sort_by_key(|m| record.tensor_order.iter().position(|n| *n == m.name));

    let ckpt = Checkpoint {
        tensors,
        momentum,
        meta: CheckpointMeta {
            step: record.step,
            epoch: record.epoch,
            batch_in_epoch: record.batch_in_epoch,
            seed: record.seed,
            rng_state: record.rng_state,
            config_json,
            lr: record.lr,
            best_val_top1: record.best_val_top1,
            extra: record.extra,
        },
    };
    ckpt.check().map_err(|e| anyhow!("{p}: {e}"))?;
    Ok(ckpt)
}

/// Reads every tensor of any f32 safetensors file (e.g. weights exported from
/// PyTorch with `safetensors.torch.save_file`), in file order, without
/// requiring `alexnet.meta`. Momentum tensors, if any, are returned as they
/// are named in the file.
pub fn load_tensors(path: &Path) -> Result<Vec<NamedTensor>> {
    let p = path.display();
    let bytes = fs::read(path).map_err(|e| anyhow!("{p}: cannot read: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow!("{p}: not a safetensors file ({e})"))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{p}: not a safetensors file ({e})"))?;
    header
        .offset_keys()
        .iter()
        .map(|name| read_f32(&st, name).map_err(|e| anyhow!("{p}: {e}")))
        .collect()
}

/// Copies tensor `name` out of the file as f32 (the bytes need not be
/// 4-aligned in the buffer).
fn read_f32(st: &SafeTensors<'_>, name: &str) -> Result<NamedTensor> {
    let view = st.tensor(name).map_err(|e| anyhow!("{name}: {e}"))?;
    if view.dtype() != Dtype::F32 {
        bail!("tensor {name} has dtype {}, expected F32", view.dtype());
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(NamedTensor {
        name: name.to_string(),
        shape: view.shape().to_vec(),
        data,
    })
}
