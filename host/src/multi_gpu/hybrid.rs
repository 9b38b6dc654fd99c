//! [`HybridRank`]: one rank of the hybrid mode (Krizhevsky 2014): the
//! layers before the first fc layer data-parallel, the fc layers split by
//! output rows.
//!
//! A rank's step, `N` the global batch:
//! - conv part: a [`Model`] of the layers before the first fc layer on the
//!   rank's `N / world` samples; its gradients are summed over the ranks in
//!   buckets during backward.
//! - fc part, forward: all-gather the conv features (`[N, in]` on every
//!   rank); each fc layer computes the rank's rows of its weight
//!   ([`split_range`] of the outputs) for all `N` samples, and an
//!   all-gather plus one block copy per rank assemble the full `[N, out]`
//!   activation. ReLU, dropout and the softmax loss run on full
//!   activations, identically on every rank.
//! - fc part, backward: each fc layer copies its columns of the output
//!   gradient, computes its weight and bias gradients from the whole batch
//!   (its own rows: nothing to reduce) and a partial input gradient, summed
//!   over the ranks: all-reduce between fc layers, reduce-scatter into the
//!   conv features (each rank gets its own samples' rows).
//!
//! Scales: the loss gradient is divided by `N`, so the fc gradients are
//! those of the global mean loss and each sample's conv-feature gradient is
//! its whole share of it; hence conv gradients are summed, not averaged.
//!
//! Dropout: fc-part masks are drawn for the full `[N, out]` activation from
//! the run's seed and layer, as one model on the global batch draws them,
//! the same on every rank; a dropout layer in the conv part (AlexNet has
//! none) uses [`rank_seed`] as the data-parallel mode does.
//!
//! Why all-reduce rather than a reduce-scatter of columns between fc
//! layers: dropout's masks are indexed by position in the full activation,
//! so ReLU's and dropout's backward run on the full gradient; the extra
//! volume is small next to the fc products. The collectives are not
//! overlapped with the fc products (the paper pipelines them in batch
//! parts).

use std::ops::Range;

use anyhow::{Context, Result, bail};

use super::{Bucket, backward_in_buckets, plan_model_buckets, rank_seed, split_range};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BlockCopy, DropoutParams, FcGeom, SgdParams};
use crate::checkpoint::NamedTensor;
use crate::config::{LayerKind, ModelSpec};
use crate::data::Loader;
use crate::model::{Model, Param};
use crate::multi_gpu::Reducer;
use crate::train::{EvalSums, Tensors};

/// How the hybrid mode splits a network over `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridPlan {
    /// Layers `..first_fc` form the data-parallel part.
    pub first_fc: usize,
    /// For each fc layer (by layer index), the output rows of every rank.
    pub fc_rows: Vec<(usize, Vec<Range<usize>>)>,
}

/// Splits `spec` for `world` ranks: an error unless the fc layers come
/// after at least one other layer, only ReLU, dropout, fc and the softmax
/// follow the first one, and every fc layer has at least `world` outputs.
pub fn plan_hybrid(spec: &ModelSpec, world: usize) -> Result<HybridPlan> {
    if world == 0 {
        bail!("the number of ranks must be ≥ 1");
    }
    let Some(first_fc) = spec
        .layers
        .iter()
        .position(|l| matches!(l.kind, LayerKind::Fc(_)))
    else {
        bail!("the hybrid mode splits the fc layers, but the model has none");
    };
    if first_fc == 0 {
        bail!("the hybrid mode needs a layer before the first fc layer");
    }
    let mut fc_rows = Vec::new();
    for (i, l) in spec.layers.iter().enumerate().skip(first_fc) {
        match &l.kind {
            LayerKind::Fc(f) => {
                if f.outputs < world {
                    bail!(
                        "the hybrid mode splits layer {:?}'s {} outputs over {world} GPUs: it needs at least one per GPU",
                        l.name,
                        f.outputs
                    );
                }
                let rows = (0..world).map(|r| split_range(f.outputs, world, r));
                fc_rows.push((i, rows.collect()));
            }
            LayerKind::Relu | LayerKind::Dropout(_) | LayerKind::Softmax => {}
            other => bail!(
                "the hybrid mode supports only fc, relu, dropout and softmax layers after the first fc layer, got {:?} ({})",
                l.name,
                other.type_name()
            ),
        }
    }
    Ok(HybridPlan { first_fc, fc_rows })
}

/// The initial parameters of the whole network for `seed`, as
/// [`Model::new`] draws them (built on the CPU backend, so nothing is
/// allocated on a GPU).
pub fn initial_params(spec: &ModelSpec, seed: u64) -> Result<Tensors> {
    let be = CpuBackend;
    Model::new(&be, spec, 1, seed)?.download_params(&be, false)
}

/// One fc layer's slice on this rank.
struct FcSlice<B: Backend> {
    /// Input and output features of the whole layer.
    inputs: usize,
    outputs: usize,
    /// Every rank's output rows; this rank's is `rows[rank]`.
    rows: Vec<Range<usize>>,
    /// This rank's rows of the weight (`[k, inputs]`) and bias (`[k]`).
    weight: Param<B>,
    bias: Param<B>,
    /// This rank's outputs `[N, k]`.
    y: B::Buf,
    /// Every rank's outputs, rank after rank (`[N, k_r]` each).
    gathered: B::Buf,
    /// This rank's columns of the output gradient, `[N, k]`.
    dy: B::Buf,
}

/// One layer of the fc part: what it does and its activation buffers.
enum Op {
    Fc {
        slice: usize,
        src: usize,
        dst: usize,
    },
    Relu {
        at: usize,
    },
    Dropout {
        at: usize,
        p: f32,
        layer: usize,
    },
    Softmax {
        at: usize,
    },
}

/// One rank of the hybrid mode; see the module docs.
pub struct HybridRank<B: Backend, R: Reducer<B>> {
    /// The data-parallel part on the rank's share of the batch.
    pub conv: Model<B>,
    reducer: R,
    buckets: Vec<Bucket>,
    /// Samples of the global batch, and of the rank's share.
    global: usize,
    share: usize,
    classes: usize,
    param_count: usize,
    fcs: Vec<FcSlice<B>>,
    /// What the backend keeps for the fc slices' one SGD update.
    fc_sgd_table: B::SgdTable,
    ops: Vec<Op>,
    /// Full activations `[N, ·]` of the fc part: `acts[0]` the gathered
    /// conv features, then one per fc layer; `grads` their gradients.
    acts: Vec<B::Buf>,
    grads: Vec<B::Buf>,
    labels: B::Labels,
    probs: B::Buf,
    loss: B::Buf,
    rank_of_label: B::Buf,
}

impl<B: Backend, R: Reducer<B>> HybridRank<B, R> {
    /// The rank's part of `spec` for a global batch of `global` samples,
    /// holding its share of `init` (the whole network's parameters, e.g.
    /// [`initial_params`]; every rank must pass the same). Conv gradient
    /// buckets hold at least `bucket_bytes`.
    pub fn new(
        be: &B,
        spec: &ModelSpec,
        global: usize,
        init: &[NamedTensor],
        reducer: R,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let (rank, world) = (reducer.rank(), reducer.world());
        let share = super::per_rank_batch(global, world)?;
        let plan = plan_hybrid(spec, world)?;
        let mut conv = Model::new_prefix(be, spec, plan.first_fc, share, 0)?;
        conv.upload_params(be, init, false)?;
        let buckets = plan_model_buckets(be, &conv, bucket_bytes);
        let features = conv.layers[plan.first_fc - 1].out_len();
        let n = global;
        let mut acts = vec![be.zeros(n * features)?];
        let mut grads = vec![be.zeros(n * features)?];
        let (mut fcs, mut ops) = (Vec::new(), Vec::new());
        let mut fc_rows = plan.fc_rows.into_iter();
        for (i, l) in spec.layers.iter().enumerate().skip(plan.first_fc) {
            let at = acts.len() - 1;
            match &l.kind {
                LayerKind::Fc(f) => {
                    let (_, rows) = fc_rows.next().context("fc plan")?;
                    let inputs = l.in_len();
                    let mine = rows[rank].clone();
                    let slice = |name: &str, per_row: usize| -> Result<Param<B>> {
                        let full = init
                            .iter()
                            .find(|t| t.name == name)
                            .with_context(|| format!("{name} is missing"))?;
                        let want = if per_row == 1 {
                            vec![f.outputs]
                        } else {
                            vec![f.outputs, per_row]
                        };
                        if full.shape != want {
                            bail!("{name} has shape {:?}, expected {want:?}", full.shape);
                        }
                        let part = &full.data[mine.start * per_row..mine.end * per_row];
                        let mut shape = want;
                        shape[0] = mine.len();
                        Ok(Param {
                            name: name.to_string(),
                            shape,
                            value: be.upload(part)?,
                            grad: be.zeros(part.len())?,
                            momentum: be.zeros(part.len())?,
                        })
                    };
                    let k = mine.len();
                    fcs.push(FcSlice {
                        inputs,
                        outputs: f.outputs,
                        weight: slice(&format!("{}.weight", l.name), inputs)?,
                        bias: slice(&format!("{}.bias", l.name), 1)?,
                        rows,
                        y: be.zeros(n * k)?,
                        gathered: be.zeros(n * f.outputs)?,
                        dy: be.zeros(n * k)?,
                    });
                    acts.push(be.zeros(n * f.outputs)?);
                    grads.push(be.zeros(n * f.outputs)?);
                    ops.push(Op::Fc {
                        slice: fcs.len() - 1,
                        src: at,
                        dst: at + 1,
                    });
                }
                LayerKind::Relu => ops.push(Op::Relu { at }),
                LayerKind::Dropout(d) => ops.push(Op::Dropout {
                    at,
                    p: d.p,
                    layer: i,
                }),
                LayerKind::Softmax => ops.push(Op::Softmax { at }),
                _ => unreachable!("plan_hybrid admits no other layer"),
            }
        }
        let classes = spec.classes;
        Ok(Self {
            conv,
            reducer,
            buckets,
            global,
            share,
            classes,
            param_count: spec.param_count(),
            fcs,
            fc_sgd_table: Default::default(),
            ops,
            acts,
            grads,
            labels: be.upload_labels(&vec![0; n])?,
            probs: be.zeros(n * classes)?,
            loss: be.zeros(n)?,
            rank_of_label: be.zeros(n)?,
        })
    }

    pub fn rank(&self) -> usize {
        self.reducer.rank()
    }

    pub fn world(&self) -> usize {
        self.reducer.world()
    }

    pub fn reducer_mut(&mut self) -> &mut R {
        &mut self.reducer
    }

    /// Samples of the rank's share of each batch.
    pub fn share(&self) -> usize {
        self.share
    }

    /// Trainable values of the whole network.
    pub fn param_count(&self) -> usize {
        self.param_count
    }

    /// The conv gradient buckets in launch order (parameter names).
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        super::bucket_names(&self.conv, &self.buckets)
    }

    /// The rank's parameters: the conv part's, then its fc slices (named as
    /// the whole tensors, shaped as the slices).
    pub fn params(&self) -> impl Iterator<Item = &Param<B>> {
        let fc = self.fcs.iter().flat_map(|f| [&f.weight, &f.bias]);
        self.conv.params.iter().chain(fc)
    }

    /// The rows of the global batch this rank's samples are.
    fn own_rows(&self) -> Range<usize> {
        split_range(self.global, self.world(), self.rank())
    }

    /// Copies this rank's share of the batch to the device and gathers every
    /// rank's labels (collective). Labels are checked after the gather, so
    /// every rank fails alike on a bad one.
    pub fn set_batch(&mut self, be: &B, images: &[f32], labels: &[i32]) -> Result<()> {
        if labels.len() != self.share {
            bail!(
                "batch of {} samples given to a rank built for {}",
                labels.len(),
                self.share
            );
        }
        let all = self.reducer.all_gather_labels(be, labels)?;
        if let Some(bad) = all.iter().find(|&&l| l < 0 || l as usize >= self.classes) {
            bail!("label {bad} is outside 0..{}", self.classes);
        }
        be.write_labels(&mut self.labels, &all)?;
        self.conv.set_batch(be, images, labels)
    }

    /// Forward pass of the whole network (collective); `dropout` is the
    /// run's `(seed, step)` in training, `None` in evaluation.
    pub fn forward(&mut self, be: &B, dropout: Option<(u64, u64)>) -> Result<()> {
        let rank = self.rank();
        let conv_dropout = dropout.map(|(seed, step)| (rank_seed(seed, rank), step));
        self.conv.forward(be, conv_dropout)?;
        let n = self.global;
        let counts = vec![be.len(self.conv.output()); self.world()];
        self.reducer
            .all_gather(be, self.conv.output(), &mut self.acts[0], &counts)?;
        for op in &self.ops {
            match *op {
                Op::Fc { slice, src, dst } => {
                    let f = &mut self.fcs[slice];
                    let k = f.rows[rank].len();
                    let g = FcGeom {
                        n,
                        inputs: f.inputs,
                        outputs: k,
                    };
                    be.fc_forward(
                        &g,
                        &self.acts[src],
                        &f.weight.value,
                        &f.bias.value,
                        &mut f.y,
                    )?;
                    let counts: Vec<usize> = f.rows.iter().map(|r| n * r.len()).collect();
                    self.reducer
                        .all_gather(be, &f.y, &mut f.gathered, &counts)?;
                    let mut at = 0;
                    for r in &f.rows {
                        let block = BlockCopy {
                            rows: n,
                            cols: r.len(),
                            src_offset: at,
                            src_stride: r.len(),
                            dst_offset: r.start,
                            dst_stride: f.outputs,
                        };
                        be.copy_block(&block, &f.gathered, &mut self.acts[dst])?;
                        at += n * r.len();
                    }
                }
                Op::Relu { at } => be.relu_forward(&mut self.acts[at])?,
                Op::Dropout { at, p, layer } => {
                    if let Some((seed, step)) = dropout {
                        let dp = dropout_params(p, seed, step, layer);
                        be.dropout_forward(&dp, &mut self.acts[at])?;
                    }
                }
                Op::Softmax { at } => {
                    let (x, c) = (&self.acts[at], self.classes);
                    be.softmax_xent_forward(
                        n,
                        c,
                        x,
                        &self.labels,
                        &mut self.probs,
                        &mut self.loss,
                    )?;
                    be.label_rank(n, c, x, &self.labels, &mut self.rank_of_label)?;
                }
            }
        }
        Ok(())
    }

    /// Forward and backward on the global batch (collective): afterwards
    /// each rank holds the gradients of its fc slices and the summed conv
    /// gradients, and the backend's later work waits for them.
    pub fn compute_gradients(&mut self, be: &B, dropout: (u64, u64)) -> Result<()> {
        self.forward(be, Some(dropout))?;
        let (rank, n) = (self.rank(), self.global);
        for op in self.ops.iter().rev() {
            match *op {
                Op::Softmax { at } => {
                    be.softmax_xent_backward(
                        n,
                        self.classes,
                        &self.probs,
                        &self.labels,
                        &mut self.grads[at],
                    )?;
                }
                Op::Dropout { at, p, layer } => {
                    let dp = dropout_params(p, dropout.0, dropout.1, layer);
                    be.dropout_backward(&dp, &mut self.grads[at])?;
                }
                Op::Relu { at } => be.relu_backward(&self.acts[at], &mut self.grads[at])?,
                Op::Fc { slice, src, dst } => {
                    let f = &mut self.fcs[slice];
                    let mine = f.rows[rank].clone();
                    let g = FcGeom {
                        n,
                        inputs: f.inputs,
                        outputs: mine.len(),
                    };
                    let columns = BlockCopy {
                        rows: n,
                        cols: mine.len(),
                        src_offset: mine.start,
                        src_stride: f.outputs,
                        dst_offset: 0,
                        dst_stride: mine.len(),
                    };
                    be.copy_block(&columns, &self.grads[dst], &mut f.dy)?;
                    let x = &self.acts[src];
                    be.fc_backward_filter(&g, x, &f.dy, &mut f.weight.grad)?;
                    be.fc_backward_bias(&g, &f.dy, &mut f.bias.grad)?;
                    let dx = &mut self.grads[src];
                    be.fc_backward_data(&g, &f.dy, &f.weight.value, dx)?;
                    if src == 0 {
                        let own = self.conv.output_grad_mut();
                        self.reducer.reduce_scatter_sum(be, &self.grads[0], own)?;
                    } else {
                        self.reducer
                            .all_reduce_sum(be, &mut [&mut self.grads[src]])?;
                    }
                }
            }
        }
        let conv_dropout = Some((rank_seed(dropout.0, rank), dropout.1));
        backward_in_buckets(be, &mut self.conv, &self.buckets, conv_dropout, |grads| {
            self.reducer.start_sum(be, grads)
        })?;
        self.reducer.finish(be)
    }

    /// The SGD update of the rank's parameters (after
    /// [`HybridRank::compute_gradients`]).
    pub fn sgd_step(&mut self, be: &B, sgd: &SgdParams) -> Result<()> {
        self.conv.sgd_step(be, sgd)?;
        let mut tensors: Vec<_> = self
            .fcs
            .iter_mut()
            .flat_map(|f| [&mut f.weight, &mut f.bias])
            .map(Param::sgd_tensor)
            .collect();
        be.sgd_update_all(sgd, &mut tensors, &mut self.fc_sgd_table)
    }

    /// One training step (collective).
    pub fn train_step(&mut self, be: &B, dropout: (u64, u64), sgd: &SgdParams) -> Result<()> {
        self.compute_gradients(be, dropout)?;
        self.sgd_step(be, sgd)
    }

    /// Per-sample losses and true-class ranks of the rank's own samples in
    /// the last forward pass (every rank computed the whole batch's).
    pub fn read_metrics(&self, be: &B) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = self.own_rows();
        let loss = be.download(&self.loss)?[rows.clone()].to_vec();
        let rank = be.download(&self.rank_of_label)?[rows].to_vec();
        Ok((loss, rank))
    }

    /// Softmax outputs `[N, classes]` of the last forward pass (the whole
    /// batch).
    pub fn read_probs(&self, be: &B) -> Result<Vec<f32>> {
        be.download(&self.probs)
    }

    /// The whole network's parameters (or momentum buffers) with their full
    /// shapes, in the model's order: the fc slices are gathered from every
    /// rank (collective).
    pub fn download_params(&mut self, be: &B, momentum: bool) -> Result<Tensors> {
        let mut out = self.conv.download_params(be, momentum)?;
        for f in &self.fcs {
            let whole = [f.outputs * f.inputs, f.outputs];
            for (p, len) in [&f.weight, &f.bias].into_iter().zip(whole) {
                let per_row = len / f.outputs;
                let counts: Vec<usize> = f.rows.iter().map(|r| r.len() * per_row).collect();
                let mut full = be.zeros(len)?;
                let part = if momentum { &p.momentum } else { &p.value };
                self.reducer.all_gather(be, part, &mut full, &counts)?;
                let mut shape = p.shape.clone();
                shape[0] = f.outputs;
                out.push(NamedTensor::new(
                    p.name.clone(),
                    shape,
                    be.download(&full)?,
                )?);
            }
        }
        Ok(out)
    }

    /// Overwrites the parameters (or momentum buffers) from whole tensors
    /// by name: the conv part's, and this rank's rows of each fc tensor.
    pub fn upload_params(&mut self, be: &B, tensors: &[NamedTensor], momentum: bool) -> Result<()> {
        self.conv.upload_params(be, tensors, momentum)?;
        let rank = self.rank();
        for f in &mut self.fcs {
            let mine = f.rows[rank].clone();
            for p in [&mut f.weight, &mut f.bias] {
                let Some(t) = tensors.iter().find(|t| t.name == p.name) else {
                    bail!("{} is missing", p.name);
                };
                let mut want = p.shape.clone();
                want[0] = f.outputs;
                if t.shape != want {
                    bail!(
                        "{} has shape {:?}, the model expects {want:?}",
                        p.name,
                        t.shape
                    );
                }
                let per_row: usize = want[1..].iter().product();
                let part = &t.data[mine.start * per_row..mine.end * per_row];
                be.write(
                    if momentum {
                        &mut p.momentum
                    } else {
                        &mut p.value
                    },
                    part,
                )?;
            }
        }
        Ok(())
    }

    /// Loss and accuracy sums over this rank's shard of `loader`'s batches
    /// (collective: every rank runs every batch, a short or empty share
    /// padded, the padding not counted).
    pub fn eval_sums(&mut self, be: &B, loader: &Loader) -> Result<EvalSums> {
        let mut sums = EvalSums::default();
        let per = self.conv.input_len_per_sample();
        for batch in loader.epoch(0) {
            let mut batch = batch?;
            let n = batch.n;
            batch.images.resize(self.share * per, 0.0);
            batch.labels.resize(self.share, 0);
            self.set_batch(be, &batch.images, &batch.labels)?;
            self.forward(be, None)?;
            let (l, r) = self.read_metrics(be)?;
            sums.loss += l[..n].iter().map(|&v| v as f64).sum::<f64>();
            sums.top1 += r[..n].iter().filter(|&&v| v < 1.0).count();
            sums.top5 += r[..n].iter().filter(|&&v| v < 5.0).count();
            sums.count += n;
        }
        Ok(sums)
    }
}

fn dropout_params(p: f32, seed: u64, step: u64, layer: usize) -> DropoutParams {
    // The key `Model` uses for layer `layer`, so masks match one model's.
    DropoutParams {
        p,
        seed: seed ^ ((layer as u64) << 48),
        step,
    }
}
