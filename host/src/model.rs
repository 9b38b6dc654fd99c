//! A network on a backend: parameters, activation and gradient buffers, and
//! the forward and backward passes as a sequence of backend ops.
//!
//! Activations are NCHW; ReLU and dropout work in place on the previous
//! layer's buffer (so do their gradients), every other layer writes a buffer
//! of its own. An LRN followed by a max pool runs as one fused op each way
//! where the backend takes the shapes (the LRN's own output, gradient and
//! scale buffers are then one-element placeholders). fc layers read the NCHW activation as `[n, C·H·W]`, which is
//! PyTorch's flatten order, so fc6's weights need no permutation to match.
//! Parameters use PyTorch's layouts (conv `[out, in/groups, kh, kw]`,
//! fc `[out, in]`).

use anyhow::{Result, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::arena::{ArenaBuf, ArenaPlan};
use crate::backend::*;
use crate::checkpoint::NamedTensor;
use crate::config::{LayerKind, LayerSpec, ModelSpec};

/// One parameter tensor with its gradient and momentum.
pub struct Param<B: Backend> {
    /// `<layer>.weight` or `<layer>.bias`.
    pub name: String,
    pub shape: Vec<usize>,
    pub value: B::Buf,
    pub grad: B::Buf,
    pub momentum: B::Buf,
}

/// The fc layers that keep a copy of their weights: (layer, `saved` index).
fn fc_copies<'a>(
    layers: &'a [LayerSpec],
    slots: &'a [Slot],
) -> impl Iterator<Item = (usize, usize)> + 'a {
    layers
        .iter()
        .zip(slots)
        .enumerate()
        .filter_map(|(i, (l, s))| match l.kind {
            LayerKind::Fc(_) => s.saved.map(|k| (i, k)),
            _ => None,
        })
}

impl<B: Backend> Param<B> {
    /// The buffers an SGD update reads and writes.
    pub fn sgd_tensor(&mut self) -> SgdTensor<'_, B::Buf> {
        SgdTensor {
            w: &mut self.value,
            g: &self.grad,
            v: &mut self.momentum,
            copy: None,
        }
    }
}

/// Per-layer runtime data: which buffers it reads and writes, and which
/// parameters it owns.
struct Slot {
    src: usize,
    dst: usize,
    params: Option<(usize, usize)>,
    /// What the forward pass keeps for the backward pass besides the
    /// activations: LRN's scale, max pooling's argmax offsets, a conv
    /// layer's operand copy of x and an fc layer's of w where the backend
    /// keeps one ([`Backend::conv_kept_len`], [`Backend::fc_kept_len`]).
    saved: Option<usize>,
    /// An fc layer's kept copy of w (`saved`) holds the current weights:
    /// refreshed by the last SGD update or made by a forward since; false
    /// after the weights were overwritten by other means.
    w_copy_fresh: bool,
    /// A ReLU layer whose forward pass the conv layer before it does (in its
    /// epilogue), and whose backward pass the LRN, conv or max-pool layer
    /// after it does (LRN and pool in their pass, conv in its data
    /// gradient's epilogue).
    relu_in_prev: bool,
    relu_in_next: bool,
    /// An LRN layer that also does the max pool after it, both ways
    /// ([`Backend::lrn_pool_forward`]); that pool layer is `pool_in_prev`.
    pool_in_lrn: bool,
    pool_in_prev: bool,
}

/// A network instantiated for a fixed batch size on backend `B`.
///
/// Every buffer is allocated once, in [`Model::new`], and never replaced
/// (uploads write into them), so a captured step graph
/// ([`crate::step_graph`]) stays valid for the model's life.
pub struct Model<B: Backend> {
    /// Unique in the process (a captured step graph knows its model by it).
    id: u64,
    pub layers: Vec<LayerSpec>,
    pub batch: usize,
    pub classes: usize,
    pub params: Vec<Param<B>>,
    slots: Vec<Slot>,
    acts: Vec<B::Buf>,
    grads: Vec<B::Buf>,
    saved: Vec<B::Buf>,
    labels: B::Labels,
    probs: B::Buf,
    loss: B::Buf,
    rank: B::Buf,
    /// What the backend keeps for [`Model::sgd_step`]'s one update of every
    /// parameter.
    sgd_table: B::SgdTable,
    /// The kernels the backend's autotune chose, by layer name.
    autotuned: Vec<(String, TunedKernel)>,
    /// `acts`, `grads` and `saved`, in that order, in one allocation.
    arena: ArenaPlan,
}

/// The buffers layer `i` touches (indices into `acts`, `grads`, `saved`):
/// what [`Model::forward_layer`] and [`Model::backward_layer`] read or
/// write, kept beside them for the memory plan.
#[derive(Default)]
struct Touched {
    /// Activations its forward reads or writes.
    acts_fwd: Vec<usize>,
    /// Activations its backward reads.
    acts_bwd: Vec<usize>,
    /// Gradients its backward reads or writes.
    grads: Vec<usize>,
    /// Kept buffers its forward writes and its backward reads.
    saved: Vec<usize>,
}

fn touched(layers: &[LayerSpec], slots: &[Slot], i: usize) -> Touched {
    let s = &slots[i];
    let first = s.src == 0;
    let own = |k: Option<usize>| k.into_iter().collect::<Vec<_>>();
    let t = |acts_fwd: Vec<usize>, acts_bwd: Vec<usize>, grads: Vec<usize>, saved: Vec<usize>| {
        Touched {
            acts_fwd,
            acts_bwd,
            grads,
            saved,
        }
    };
    match layers[i].kind {
        LayerKind::Softmax => t(vec![s.src], vec![], vec![s.src], vec![]),
        LayerKind::Dropout(_) => t(vec![s.dst], vec![], vec![s.dst], vec![]),
        LayerKind::Relu if s.relu_in_prev && s.relu_in_next => Touched::default(),
        LayerKind::Relu if s.relu_in_prev => t(vec![], vec![s.dst], vec![s.dst], vec![]),
        LayerKind::Relu if s.relu_in_next => t(vec![s.dst], vec![], vec![], vec![]),
        LayerKind::Relu => t(vec![s.dst], vec![s.dst], vec![s.dst], vec![]),
        LayerKind::Fc(_) | LayerKind::Conv(_) => {
            let grads = if first {
                vec![s.dst]
            } else {
                vec![s.dst, s.src]
            };
            t(vec![s.src, s.dst], vec![s.src], grads, own(s.saved))
        }
        LayerKind::Lrn(_) if s.pool_in_lrn => {
            let p = &slots[i + 1];
            t(
                vec![s.src, p.dst],
                vec![s.src],
                vec![p.dst, s.src],
                own(p.saved),
            )
        }
        LayerKind::MaxPool(_) if s.pool_in_prev => Touched::default(),
        LayerKind::Lrn(_) => t(
            vec![s.src, s.dst],
            vec![s.src, s.dst],
            vec![s.dst, s.src],
            own(s.saved),
        ),
        LayerKind::MaxPool(_) => {
            let relu = i > 0 && slots[i - 1].relu_in_next;
            let read = if relu { vec![s.src, s.dst] } else { vec![] };
            t(vec![s.src, s.dst], read, vec![s.dst, s.src], own(s.saved))
        }
    }
}

/// The model's buffers on one timeline: 0 is the batch upload, `1 + i`
/// layer `i`'s forward, `1 + L` a gradient handed in from outside
/// ([`Model::output_grad_mut`]), `1 + 2L − i` layer `i`'s backward (`L`
/// layers). Each buffer lives from the first op that touches it to the
/// last, so gradients share bytes with each other and with activations and
/// kept buffers whose last backward read is behind them. Live the whole
/// step: the last activation (read after a forward pass, and across
/// ranks), the fc layers' weight copies (the SGD update writes them for the
/// next forward) and anything no op touches (a placeholder; the input's
/// gradient below a conv or fc layer becomes one float). `share` false
/// gives every buffer the whole step.
fn memory_plan(
    layers: &[LayerSpec],
    slots: &[Slot],
    act_lens: &[usize],
    saved_lens: &[usize],
    share: bool,
) -> ArenaPlan {
    let l = layers.len();
    let end = 2 + 2 * l;
    let (fwd, bwd) = (|i: usize| 1 + i, |i: usize| 1 + 2 * l - i);
    let (n_acts, n_saved) = (act_lens.len(), saved_lens.len());
    let mut acts: Vec<Vec<usize>> = vec![Vec::new(); n_acts];
    let mut grads: Vec<Vec<usize>> = vec![Vec::new(); n_acts];
    let mut saved: Vec<Vec<usize>> = vec![Vec::new(); n_saved];
    acts[0].push(0);
    acts[n_acts - 1].extend([0, end - 1]);
    grads[n_acts - 1].push(1 + l);
    for (i, _) in fc_copies(layers, slots) {
        saved[slots[i].saved.unwrap()].extend([0, end - 1]);
    }
    for i in 0..l {
        let t = touched(layers, slots, i);
        t.acts_fwd.iter().for_each(|&k| acts[k].push(fwd(i)));
        t.acts_bwd.iter().for_each(|&k| acts[k].push(bwd(i)));
        t.grads.iter().for_each(|&k| grads[k].push(bwd(i)));
        t.saved
            .iter()
            .for_each(|&k| saved[k].extend([fwd(i), bwd(i)]));
    }
    let span = |len: usize, times: &Vec<usize>| match (times.iter().min(), times.iter().max()) {
        (Some(_), Some(_)) if !share => ArenaBuf { len, live: 0..end },
        (Some(&a), Some(&b)) => ArenaBuf {
            len,
            live: a..b + 1,
        },
        _ => ArenaBuf { len, live: 0..end },
    };
    let bufs: Vec<ArenaBuf> = act_lens
        .iter()
        .zip(&acts)
        .map(|(&len, t)| span(len, t))
        .chain(
            act_lens
                .iter()
                .zip(&grads)
                .map(|(&len, t)| match t.is_empty() {
                    true => span(1, t),
                    false => span(len, t),
                }),
        )
        .chain(saved_lens.iter().zip(&saved).map(|(&len, t)| span(len, t)))
        .collect();
    ArenaPlan::new(&bufs)
}

/// `(a, b)` as shared and mutable borrows of two different elements.
fn pair<T>(v: &mut [T], shared: usize, mutable: usize) -> (&T, &mut T) {
    assert_ne!(shared, mutable);
    if shared < mutable {
        let (lo, hi) = v.split_at_mut(mutable);
        (&lo[shared], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(shared);
        (&hi[0], &mut lo[mutable])
    }
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

impl<B: Backend> Model<B> {
    /// Allocates everything for `batch` samples and initialises the weights
    /// from `seed` (N(0, init_std²) weights, constant biases).
    pub fn new(be: &B, spec: &ModelSpec, batch: usize, seed: u64) -> Result<Self> {
        Self::from_spec(be, spec, batch, seed, true)
    }

    /// As [`Model::new`], with every buffer in bytes of its own for the
    /// whole step (the arena's sharing off): what the shared arena is
    /// checked against.
    pub fn new_apart(be: &B, spec: &ModelSpec, batch: usize, seed: u64) -> Result<Self> {
        Self::from_spec(be, spec, batch, seed, false)
    }

    fn from_spec(be: &B, spec: &ModelSpec, batch: usize, seed: u64, share: bool) -> Result<Self> {
        let Some(last) = spec.layers.last() else {
            bail!("the model has no layers")
        };
        if last.kind != LayerKind::Softmax {
            bail!("the last layer must be softmax");
        }
        Self::build(be, &spec.layers, numel(&last.in_shape), batch, seed, share)
    }

    /// The layers `..end` of `spec` alone, without a loss (the convolutional
    /// part of a hybrid-parallel rank, [`crate::multi_gpu`]), initialised as
    /// [`Model::new`] initialises those layers. It takes `spec`'s labels.
    pub fn new_prefix(
        be: &B,
        spec: &ModelSpec,
        end: usize,
        batch: usize,
        seed: u64,
    ) -> Result<Self> {
        if end == 0 || end > spec.layers.len() {
            bail!(
                "a model prefix needs 1..={} layers, got {end}",
                spec.layers.len()
            );
        }
        Self::build(be, &spec.layers[..end], spec.classes, batch, seed, true)
    }

    fn build(
        be: &B,
        layers: &[LayerSpec],
        classes: usize,
        batch: usize,
        seed: u64,
        share: bool,
    ) -> Result<Self> {
        let layers = layers.to_vec();
        // Kernel choices first, while no activation holds device memory.
        let mut autotuned = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            if let Some(g) = l.conv_geom(batch) {
                for t in be.autotune_conv(&g, i > 0)? {
                    autotuned.push((l.name.clone(), t));
                }
            }
        }
        let mut rng = StdRng::seed_from_u64(seed);
        // Buffer lengths first (activations and their gradients share an
        // index; `saved` holds what a layer keeps for its backward), then
        // one arena for all of them.
        let mut act_lens = vec![batch * numel(&layers[0].in_shape)];
        let (mut params, mut slots, mut saved_lens) = (Vec::new(), Vec::new(), Vec::new());
        // LRN layers that also do the max pool after them: their output,
        // its gradient and their scale are never touched, so they get
        // one-element placeholders.
        let pool_in_lrn: Vec<bool> = (0..layers.len())
            .map(|i| {
                let p = layers[i].lrn_params(batch);
                let g = layers.get(i + 1).and_then(|l| l.pool_geom(batch));
                p.zip(g).is_some_and(|(p, g)| be.lrn_pool_fusable(&p, &g))
            })
            .collect();
        for (i, l) in layers.iter().enumerate() {
            let src = act_lens.len() - 1;
            let in_place = matches!(
                l.kind,
                LayerKind::Relu | LayerKind::Dropout(_) | LayerKind::Softmax
            );
            let dst = if in_place {
                src
            } else {
                let len = if pool_in_lrn[i] {
                    1
                } else {
                    batch * numel(&l.out_shape)
                };
                act_lens.push(len);
                act_lens.len() - 1
            };
            let mut slot = Slot {
                src,
                dst,
                params: None,
                saved: None,
                w_copy_fresh: false,
                relu_in_prev: false,
                relu_in_next: false,
                pool_in_lrn: false,
                pool_in_prev: false,
            };
            let init = match &l.kind {
                LayerKind::Conv(c) => Some((c.init_std, c.init_bias)),
                LayerKind::Fc(f) => Some((f.init_std, f.init_bias)),
                _ => None,
            };
            if let Some((std, bias)) = init {
                let shapes = l.param_shapes();
                let normal = Normal::new(0.0f32, std.max(0.0))?;
                let w: Vec<f32> = (0..numel(&shapes[0].1))
                    .map(|_| normal.sample(&mut rng))
                    .collect();
                let b = vec![bias; numel(&shapes[1].1)];
                let first = params.len();
                for ((name, shape), host) in shapes.into_iter().zip([w, b]) {
                    let len = host.len();
                    params.push(Param {
                        name,
                        shape,
                        value: be.upload(&host)?,
                        grad: be.zeros(len)?,
                        momentum: be.zeros(len)?,
                    });
                }
                slot.params = Some((first, first + 1));
            }
            if let Some(g) = l.conv_geom(batch) {
                let len = be.conv_kept_len(&g);
                if len > 0 {
                    saved_lens.push(len);
                    slot.saved = Some(saved_lens.len() - 1);
                }
            }
            if let Some(g) = l.fc_geom(batch) {
                let len = be.fc_kept_len(&g);
                if len > 0 {
                    saved_lens.push(len);
                    slot.saved = Some(saved_lens.len() - 1);
                }
            }
            if let LayerKind::Lrn(_) | LayerKind::MaxPool(_) = l.kind {
                let len = if pool_in_lrn[i] {
                    1
                } else {
                    batch * numel(&l.out_shape)
                };
                saved_lens.push(len);
                slot.saved = Some(saved_lens.len() - 1);
            }
            slots.push(slot);
        }
        for i in 0..layers.len() {
            if let LayerKind::Relu = layers[i].kind {
                let prev = i.checked_sub(1).map(|p| &layers[p].kind);
                let next = layers.get(i + 1).map(|l| &l.kind);
                slots[i].relu_in_prev = matches!(prev, Some(LayerKind::Conv(_)));
                slots[i].relu_in_next = matches!(
                    next,
                    Some(LayerKind::Lrn(_) | LayerKind::Conv(_) | LayerKind::MaxPool(_))
                );
            }
            if pool_in_lrn[i] {
                slots[i].pool_in_lrn = true;
                slots[i + 1].pool_in_prev = true;
            }
        }
        let arena = memory_plan(&layers, &slots, &act_lens, &saved_lens, share);
        let mut acts = be.arena(&arena)?;
        let saved = acts.split_off(2 * act_lens.len());
        let grads = acts.split_off(act_lens.len());
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Self {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sgd_table: Default::default(),
            autotuned,
            labels: be.upload_labels(&vec![0; batch])?,
            probs: be.zeros(batch * classes)?,
            loss: be.zeros(batch)?,
            rank: be.zeros(batch)?,
            layers,
            batch,
            classes,
            params,
            slots,
            acts,
            grads,
            saved,
            arena,
        })
    }

    /// Where the activations, gradients and kept buffers lie in the
    /// model's arena: buffers share bytes where their lifetimes in the step
    /// do not meet (see `memory_plan`).
    pub fn arena(&self) -> &ArenaPlan {
        &self.arena
    }

    /// The kernels the backend's autotune chose at build, by layer name
    /// (empty where it is off or had no choice).
    pub fn autotuned(&self) -> &[(String, TunedKernel)] {
        &self.autotuned
    }

    /// The model's process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The layer that does layer `i`'s work along with its own (a max pool
    /// fused into the LRN before it), if any.
    pub fn done_by(&self, i: usize) -> Option<usize> {
        self.slots[i].pool_in_prev.then(|| i - 1)
    }

    /// The last layer's output activation.
    pub fn output(&self) -> &B::Buf {
        &self.acts[self.acts.len() - 1]
    }

    /// The gradient of the last layer's output, which that layer's backward
    /// reads.
    pub fn output_grad_mut(&mut self) -> &mut B::Buf {
        let last = self.grads.len() - 1;
        &mut self.grads[last]
    }

    /// Values in one input sample (`C·H·W`).
    pub fn input_len_per_sample(&self) -> usize {
        numel(&self.layers[0].in_shape)
    }

    /// Indices in [`Model::params`] of layer `i`'s parameters (empty for a
    /// layer without any), e.g. to hand one layer's gradients to a reducer.
    pub fn param_range(&self, i: usize) -> std::ops::Range<usize> {
        match self.slots[i].params {
            Some((w, b)) => w..b + 1,
            None => 0..0,
        }
    }

    /// Number of trainable values.
    pub fn param_count(&self, be: &B) -> usize {
        self.params.iter().map(|p| be.len(&p.value)).sum()
    }

    /// Copies a batch (NCHW images, labels) to the backend.
    pub fn set_batch(&mut self, be: &B, images: &[f32], labels: &[i32]) -> Result<()> {
        if labels.len() != self.batch {
            bail!(
                "batch of {} samples given to a model built for {}",
                labels.len(),
                self.batch
            );
        }
        if let Some(bad) = labels
            .iter()
            .find(|&&l| l < 0 || l as usize >= self.classes)
        {
            bail!("label {bad} is outside 0..{}", self.classes);
        }
        be.write(&mut self.acts[0], images)?;
        be.write_labels(&mut self.labels, labels)
    }

    /// Forward pass: probabilities, per-sample loss and label ranks.
    /// `dropout` is `Some((seed, step))` in training, `None` in evaluation.
    pub fn forward(&mut self, be: &B, dropout: Option<(u64, u64)>) -> Result<()> {
        for i in 0..self.layers.len() {
            self.forward_layer(be, i, dropout)?;
        }
        Ok(())
    }

    /// Forward pass of layer `i` alone (the layers before it must have run).
    pub fn forward_layer(&mut self, be: &B, i: usize, dropout: Option<(u64, u64)>) -> Result<()> {
        let n = self.batch;
        let (l, s) = (&self.layers[i], &self.slots[i]);
        {
            match &l.kind {
                LayerKind::Conv(_) => {
                    let g = l.conv_geom(n).unwrap();
                    let (w, b) = s.params.unwrap();
                    let (x, y) = pair(&mut self.acts, s.src, s.dst);
                    let (w, b) = (&self.params[w].value, &self.params[b].value);
                    let relu = self.slots.get(i + 1).is_some_and(|r| r.relu_in_prev);
                    match s.saved {
                        Some(k) => {
                            be.conv_forward_keep(&g, x, w, b, y, relu, &mut self.saved[k])?
                        }
                        None if relu => be.conv_forward_relu(&g, x, w, b, y)?,
                        None => be.conv_forward(&g, x, w, b, y)?,
                    }
                }
                LayerKind::Fc(_) => {
                    let g = l.fc_geom(n).unwrap();
                    let (w, b) = s.params.unwrap();
                    let (x, y) = pair(&mut self.acts, s.src, s.dst);
                    let (w, b) = (&self.params[w].value, &self.params[b].value);
                    match s.saved {
                        Some(k) => {
                            let kept = &mut self.saved[k];
                            be.fc_forward_keep(&g, x, w, b, y, kept, s.w_copy_fresh)?;
                            self.slots[i].w_copy_fresh = true;
                        }
                        None => be.fc_forward(&g, x, w, b, y)?,
                    }
                }
                LayerKind::Relu if s.relu_in_prev => {}
                LayerKind::Relu => be.relu_forward(&mut self.acts[s.dst])?,
                LayerKind::Lrn(_) if s.pool_in_lrn => {
                    let p = l.lrn_params(n).unwrap();
                    let (pl, ps) = (&self.layers[i + 1], &self.slots[i + 1]);
                    let g = pl.pool_geom(n).unwrap();
                    let (x, z) = pair(&mut self.acts, s.src, ps.dst);
                    be.lrn_pool_forward(&p, &g, x, z, &mut self.saved[ps.saved.unwrap()])?;
                }
                LayerKind::Lrn(_) => {
                    let p = l.lrn_params(n).unwrap();
                    let (x, y) = pair(&mut self.acts, s.src, s.dst);
                    be.lrn_forward(&p, x, y, &mut self.saved[s.saved.unwrap()])?;
                }
                LayerKind::MaxPool(_) if s.pool_in_prev => {}
                LayerKind::MaxPool(_) => {
                    let g = l.pool_geom(n).unwrap();
                    let (x, y) = pair(&mut self.acts, s.src, s.dst);
                    be.maxpool_forward(&g, x, y, &mut self.saved[s.saved.unwrap()])?;
                }
                LayerKind::Dropout(d) => {
                    if let Some((seed, step)) = dropout {
                        let dp = DropoutParams {
                            p: d.p,
                            seed: seed ^ ((i as u64) << 48),
                            step,
                        };
                        be.dropout_forward(&dp, &mut self.acts[s.dst])?;
                    }
                }
                LayerKind::Softmax => {
                    let x = &self.acts[s.src];
                    be.softmax_xent_forward(
                        n,
                        self.classes,
                        x,
                        &self.labels,
                        &mut self.probs,
                        &mut self.loss,
                    )?;
                    be.label_rank(n, self.classes, x, &self.labels, &mut self.rank)?;
                }
            }
        }
        Ok(())
    }

    /// Backward pass after a training `forward` with the same `dropout`;
    /// leaves every parameter's gradient in `Param::grad`.
    pub fn backward(&mut self, be: &B, dropout: Option<(u64, u64)>) -> Result<()> {
        for i in (0..self.layers.len()).rev() {
            self.backward_layer(be, i, dropout)?;
        }
        Ok(())
    }

    /// Backward pass of layer `i` alone (the layers after it must have run).
    pub fn backward_layer(&mut self, be: &B, i: usize, dropout: Option<(u64, u64)>) -> Result<()> {
        let n = self.batch;
        let (l, s) = (&self.layers[i], &self.slots[i]);
        {
            let first = s.src == 0;
            match &l.kind {
                LayerKind::Softmax => {
                    be.softmax_xent_backward(
                        n,
                        self.classes,
                        &self.probs,
                        &self.labels,
                        &mut self.grads[s.src],
                    )?;
                }
                LayerKind::Dropout(d) => {
                    if let Some((seed, step)) = dropout {
                        let dp = DropoutParams {
                            p: d.p,
                            seed: seed ^ ((i as u64) << 48),
                            step,
                        };
                        be.dropout_backward(&dp, &mut self.grads[s.dst])?;
                    }
                }
                LayerKind::Relu if s.relu_in_next => {}
                LayerKind::Relu => be.relu_backward(&self.acts[s.dst], &mut self.grads[s.dst])?,
                LayerKind::Fc(_) => {
                    let g = l.fc_geom(n).unwrap();
                    let (w, b) = s.params.unwrap();
                    be.fc_backward_filter(
                        &g,
                        &self.acts[s.src],
                        &self.grads[s.dst],
                        &mut self.params[w].grad,
                    )?;
                    be.fc_backward_bias(&g, &self.grads[s.dst], &mut self.params[b].grad)?;
                    if !first {
                        let (dy, dx) = pair(&mut self.grads, s.dst, s.src);
                        let w = &self.params[w].value;
                        match s.saved {
                            Some(k) => be.fc_backward_data_kept(&g, dy, w, &self.saved[k], dx)?,
                            None => be.fc_backward_data(&g, dy, w, dx)?,
                        }
                    }
                }
                LayerKind::Conv(_) => {
                    let g = l.conv_geom(n).unwrap();
                    let (w, b) = s.params.unwrap();
                    let (pw, pb) = self.params.split_at_mut(b);
                    let (w, db) = (&mut pw[w], &mut pb[0].grad);
                    let (x, dy, dx) = if first {
                        (&self.acts[s.src], &self.grads[s.dst], None)
                    } else {
                        let (dy, dx) = pair(&mut self.grads, s.dst, s.src);
                        (&self.acts[s.src], dy, Some(dx))
                    };
                    let relu = i > 0 && self.slots[i - 1].relu_in_next;
                    match s.saved {
                        Some(k) => {
                            let kept = &self.saved[k];
                            be.conv_backward_kept(
                                &g,
                                x,
                                kept,
                                dy,
                                &w.value,
                                &mut w.grad,
                                db,
                                dx,
                                relu,
                            )?
                        }
                        None => be.conv_backward(&g, x, dy, &w.value, &mut w.grad, db, dx, relu)?,
                    }
                }
                LayerKind::Lrn(_) if s.pool_in_lrn => {
                    let p = l.lrn_params(n).unwrap();
                    let (pl, ps) = (&self.layers[i + 1], &self.slots[i + 1]);
                    let g = pl.pool_geom(n).unwrap();
                    let (dz, dx) = pair(&mut self.grads, ps.dst, s.src);
                    let (x, arg) = (&self.acts[s.src], &self.saved[ps.saved.unwrap()]);
                    let relu = i > 0 && self.slots[i - 1].relu_in_next;
                    be.lrn_pool_backward(&p, &g, x, arg, dz, dx, relu)?;
                }
                LayerKind::Lrn(_) => {
                    let p = l.lrn_params(n).unwrap();
                    let (dy, dx) = pair(&mut self.grads, s.dst, s.src);
                    let (x, y) = (&self.acts[s.src], &self.acts[s.dst]);
                    let scale = &self.saved[s.saved.unwrap()];
                    if i > 0 && self.slots[i - 1].relu_in_next {
                        be.lrn_backward_relu(&p, x, y, scale, dy, dx)?;
                    } else {
                        be.lrn_backward(&p, x, y, scale, dy, dx)?;
                    }
                }
                LayerKind::MaxPool(_) if s.pool_in_prev => {}
                LayerKind::MaxPool(_) => {
                    let g = l.pool_geom(n).unwrap();
                    let (dy, dx) = pair(&mut self.grads, s.dst, s.src);
                    let arg = &self.saved[s.saved.unwrap()];
                    if i > 0 && self.slots[i - 1].relu_in_next {
                        let (x, y) = (&self.acts[s.src], &self.acts[s.dst]);
                        be.maxpool_backward_relu(&g, arg, x, y, dy, dx)?;
                    } else {
                        be.maxpool_backward(&g, arg, dy, dx)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// One SGD step over every parameter (after `backward`), in one
    /// [`Backend::sgd_update_all`].
    /// The fc layers' kept copies of their weights are refreshed by
    /// the same update, so the next forward reads them as they are.
    pub fn sgd_step(&mut self, be: &B, p: &SgdParams) -> Result<()> {
        let mut copies: Vec<Option<&mut B::Buf>> = self.saved.iter_mut().map(Some).collect();
        let mut halves: Vec<Option<&mut B::Buf>> = self.params.iter().map(|_| None).collect();
        let fc_copies: Vec<_> = fc_copies(&self.layers, &self.slots).collect();
        for &(i, k) in &fc_copies {
            let (w, _) = self.slots[i].params.expect("an fc layer has parameters");
            halves[w] = copies[k].take();
        }
        let mut tensors: Vec<_> = self
            .params
            .iter_mut()
            .zip(halves)
            .map(|(p, copy)| SgdTensor {
                copy,
                ..p.sgd_tensor()
            })
            .collect();
        be.sgd_update_all(p, &mut tensors, &mut self.sgd_table)?;
        for (i, _) in fc_copies {
            self.slots[i].w_copy_fresh = true;
        }
        Ok(())
    }

    /// Whether every fc layer's kept copy of its weights is current (the
    /// forward then only reads them): part of what a captured step holds.
    pub fn w_copies_fresh(&self) -> bool {
        fc_copies(&self.layers, &self.slots).all(|(i, _)| self.slots[i].w_copy_fresh)
    }

    /// Marks the fc layers' kept weight copies stale after the weights were
    /// written other than by `sgd_step` (loaded, broadcast).
    pub(crate) fn weights_changed(&mut self) {
        for s in &mut self.slots {
            s.w_copy_fresh = false;
        }
    }

    /// One training step on the batch set last: forward and backward with
    /// dropout `(seed, step)`, then the SGD update (eagerly; see
    /// [`crate::step_graph::StepRunner`] for the captured one).
    pub fn train_step(&mut self, be: &B, dropout: (u64, u64), sgd: &SgdParams) -> Result<()> {
        self.forward(be, Some(dropout))?;
        self.backward(be, Some(dropout))?;
        self.sgd_step(be, sgd)
    }

    /// Per-sample losses and true-class ranks of the last forward pass
    /// (waits for the backend).
    pub fn read_metrics(&self, be: &B) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((be.download(&self.loss)?, be.download(&self.rank)?))
    }

    /// Softmax outputs `[batch, classes]` of the last forward pass.
    pub fn read_probs(&self, be: &B) -> Result<Vec<f32>> {
        be.download(&self.probs)
    }

    /// Downloads every parameter (or, with `momentum`, its momentum buffer).
    pub fn download_params(&self, be: &B, momentum: bool) -> Result<Vec<NamedTensor>> {
        self.params
            .iter()
            .map(|p| {
                let data = be.download(if momentum { &p.momentum } else { &p.value })?;
                NamedTensor::new(p.name.clone(), p.shape.clone(), data)
            })
            .collect()
    }

    /// Overwrites parameters (or momentum buffers) by name; every parameter
    /// must be given, with its exact shape.
    pub fn upload_params(&mut self, be: &B, tensors: &[NamedTensor], momentum: bool) -> Result<()> {
        for p in &mut self.params {
            let Some(t) = tensors.iter().find(|t| t.name == p.name) else {
                bail!("{} is missing", p.name);
            };
            if t.shape != p.shape {
                bail!(
                    "{} has shape {:?}, the model expects {:?}",
                    p.name,
                    t.shape,
                    p.shape
                );
            }
            be.write(
                if momentum {
                    &mut p.momentum
                } else {
                    &mut p.value
                },
                &t.data,
            )?;
        }
        if !momentum {
            self.weights_changed();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::ALIGN;
    use crate::backend::cpu::CpuBackend;

    fn alexnet() -> ModelSpec {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/alexnet.json");
        crate::config::load(std::path::Path::new(path))
            .unwrap()
            .model
    }

    fn disjoint(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> bool {
        a.end <= b.start || b.end <= a.start
    }

    /// AlexNet's convolutional part (its fc weights would cost the test 700
    /// MB): the buffers one op touches share no bytes, the last activation
    /// shares none at all, and the gradients add less than the largest of
    /// them to the activations and kept buffers (they fit mostly in what
    /// dead activations and kept buffers leave).
    #[test]
    fn alexnet_buffers_share_the_arena() {
        let spec = alexnet();
        let end = spec
            .layers
            .iter()
            .position(|l| l.fc_geom(1).is_some())
            .unwrap();
        let m = Model::new_prefix(&CpuBackend, &spec, end, 3, 1).unwrap();
        let plan = m.arena();
        let (na, ns) = (m.acts.len(), m.saved.len());
        assert_eq!(plan.lens.len(), 2 * na + ns);
        let last = na - 1;
        for j in (0..plan.lens.len()).filter(|&j| j != last) {
            assert!(disjoint(plan.range(last), plan.range(j)), "{j}");
        }
        for i in 0..m.layers.len() {
            let t = touched(&m.layers, &m.slots, i);
            let grads = t.grads.iter().map(|&k| na + k);
            let saved = t.saved.iter().map(|&k| 2 * na + k);
            for op in [
                t.acts_fwd
                    .iter()
                    .copied()
                    .chain(saved.clone())
                    .collect::<Vec<_>>(),
                t.acts_bwd
                    .iter()
                    .copied()
                    .chain(grads)
                    .chain(saved)
                    .collect(),
            ] {
                for (a, &x) in op.iter().enumerate() {
                    for &y in &op[a + 1..] {
                        if x != y {
                            assert!(disjoint(plan.range(x), plan.range(y)), "layer {i}: {x} {y}");
                        }
                    }
                }
            }
        }
        let padded = |i: usize| plan.lens[i].max(1).next_multiple_of(ALIGN);
        let acts_and_saved: usize = (0..na).chain(2 * na..2 * na + ns).map(padded).sum();
        println!(
            "arena {} floats, activations and kept buffers {}, apart {}",
            plan.total, acts_and_saved, plan.separate
        );
        let largest_grad = (na..2 * na).map(padded).max().unwrap();
        assert!(plan.total <= acts_and_saved + largest_grad);
    }
}
