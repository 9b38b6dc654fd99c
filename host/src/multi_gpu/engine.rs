//! [`DataParallel`]: the training loop's [`Engine`] over N ranks, one
//! worker thread per rank; each rank is a data-parallel [`Replica`] or a
//! [`HybridRank`] (`train.parallel`).
//!
//! The loop runs on the leader thread, as for one GPU; each engine call
//! becomes a command sent to every rank (or to rank 0 alone for reading
//! checkpoints) and waits for all of their replies. A rank replies to a
//! training step as soon as the step is queued on its GPU, so the host does
//! not stall the devices. Each rank reads its own shard of every batch from
//! its own loader (the loaders shard deterministically, so the ranks
//! together see exactly the single-GPU run's batches). Metrics are gathered
//! to the leader in rank order (the global batch's order), validation sums
//! are added up there, and checkpoints are read from rank 0 (in the hybrid
//! mode every rank takes part, since the fc slices are gathered); the
//! leader alone writes files.
//!
//! Failure: replies arrive on one channel, so the first error of any rank
//! ends the wait at once. A rank that fails leaves its loop (its reducer is
//! dropped, which wakes peers waiting in a host collective), and the engine
//! stops accepting calls. Worker threads are joined when the engine is
//! dropped after clean work; after a failure they are left to end on their
//! own, since a GPU collective that lost a peer may never complete.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail};

use super::hybrid::{HybridRank, initial_params};
use super::nccl::{NcclId, NcclReducer, nccl_unavailable_reason};
use super::{Replica, per_rank_batch, plan_hybrid};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, SgdParams};
use crate::checkpoint::NamedTensor;
use crate::config::{Config, ModelSpec, Parallel};
use crate::data::{Epoch, Loader};
use crate::multi_gpu::Reducer;
use crate::train::{
    Engine, EvalSums, RunData, Tensors, TrainOptions, TrainOutcome, eval_sums, next_batch,
};

/// What the leader asks a rank to do.
#[derive(Clone)]
enum Cmd {
    StartEpoch {
        epoch: u64,
        first: usize,
    },
    Step {
        dropout: (u64, u64),
        sgd: SgdParams,
    },
    Metrics,
    Load {
        tensors: Arc<Tensors>,
        momentum: bool,
    },
    Save {
        momentum: bool,
    },
    Eval,
    Sync,
}

enum Reply {
    Ready { name: String, params: usize },
    Done,
    Samples(usize),
    Metrics(Vec<f32>, Vec<f32>),
    Params(Tensors),
    Eval(EvalSums),
}

type Replies = Receiver<(usize, Result<Reply>)>;

/// N ranks behind the training loop's [`Engine`]; see the module docs.
pub struct DataParallel {
    parallel: Parallel,
    commands: Vec<Sender<Cmd>>,
    threads: Vec<JoinHandle<()>>,
    replies: Replies,
    names: Vec<String>,
    per_rank: usize,
    param_count: usize,
    per_epoch: usize,
    failed: bool,
}

/// A rank's network: a whole replica, or its part of the hybrid split.
enum Net<B: Backend, R: Reducer<B>> {
    Data(Replica<B, R>),
    Hybrid(HybridRank<B, R>),
}

/// One rank: its backend, network and loader shards.
struct Worker<B: Backend, R: Reducer<B>> {
    net: Net<B, R>,
    be: B,
    train: Loader,
    val: Loader,
    epoch: Option<Epoch>,
}

impl<B: Backend, R: Reducer<B>> Worker<B, R> {
    fn handle(&mut self, cmd: Cmd) -> Result<Reply> {
        let be = &self.be;
        Ok(match cmd {
            Cmd::StartEpoch { epoch, first } => {
                self.epoch = None;
                self.epoch = Some(self.train.epoch_from(epoch, first));
                Reply::Done
            }
            Cmd::Step { dropout, sgd } => {
                let batch = next_batch(&mut self.epoch)?;
                match &mut self.net {
                    Net::Data(r) => {
                        r.set_batch(be, &batch.images, &batch.labels)?;
                        r.train_step(be, dropout, &sgd)?;
                    }
                    Net::Hybrid(h) => {
                        h.set_batch(be, &batch.images, &batch.labels)?;
                        h.train_step(be, dropout, &sgd)?;
                    }
                }
                Reply::Samples(batch.n)
            }
            Cmd::Metrics => {
                let (loss, rank) = match &self.net {
                    Net::Data(r) => r.model.read_metrics(be)?,
                    Net::Hybrid(h) => h.read_metrics(be)?,
                };
                Reply::Metrics(loss, rank)
            }
            Cmd::Load { tensors, momentum } => {
                // Every rank uploads the same values (its part of them in
                // the hybrid mode): as exact as a broadcast and fails
                // identically everywhere on a bad tensor.
                match &mut self.net {
                    Net::Data(r) => r.model.upload_params(be, &tensors, momentum)?,
                    Net::Hybrid(h) => h.upload_params(be, &tensors, momentum)?,
                }
                Reply::Done
            }
            Cmd::Save { momentum } => Reply::Params(match &mut self.net {
                Net::Data(r) => r.model.download_params(be, momentum)?,
                Net::Hybrid(h) => h.download_params(be, momentum)?,
            }),
            Cmd::Eval => Reply::Eval(match &mut self.net {
                Net::Data(r) => eval_sums(be, &mut r.model, &self.val)?,
                Net::Hybrid(h) => h.eval_sums(be, &self.val)?,
            }),
            Cmd::Sync => {
                be.synchronize()?;
                Reply::Done
            }
        })
    }
}

/// What a rank's thread needs besides its backend and reducer.
struct RankSetup {
    rank: usize,
    spec: ModelSpec,
    /// The rank's share of the batch, and the global batch.
    batch: usize,
    global: usize,
    seed: u64,
    /// The whole network's initial parameters, in the hybrid mode.
    hybrid_init: Option<Arc<Tensors>>,
    bucket_bytes: usize,
    train: Loader,
    val: Loader,
}

/// A rank's thread: builds the worker, then serves commands until the leader
/// hangs up or a command fails.
fn serve<B, R>(
    s: RankSetup,
    make: &(dyn Fn(usize) -> Result<(B, R)> + Send + Sync),
    commands: Receiver<Cmd>,
    replies: &Sender<(usize, Result<Reply>)>,
) where
    B: Backend,
    R: Reducer<B>,
{
    let rank = s.rank;
    let setup = || -> Result<Worker<B, R>> {
        let (be, reducer) = make(rank)?;
        let net = match &s.hybrid_init {
            None => Net::Data(Replica::new(
                &be,
                &s.spec,
                s.batch,
                s.seed,
                reducer,
                s.bucket_bytes,
            )?),
            Some(init) => Net::Hybrid(HybridRank::new(
                &be,
                &s.spec,
                s.global,
                init,
                reducer,
                s.bucket_bytes,
            )?),
        };
        Ok(Worker {
            net,
            be,
            train: s.train,
            val: s.val,
            epoch: None,
        })
    };
    let mut worker = match setup() {
        Ok(w) => w,
        Err(e) => {
            let _ = replies.send((rank, Err(e)));
            return;
        }
    };
    let params = match &worker.net {
        Net::Data(r) => r.model.param_count(&worker.be),
        Net::Hybrid(h) => h.param_count(),
    };
    let ready = Reply::Ready {
        name: worker.be.name(),
        params,
    };
    if replies.send((rank, Ok(ready))).is_err() {
        return;
    }
    while let Ok(cmd) = commands.recv() {
        let reply = worker.handle(cmd);
        let failed = reply.is_err();
        if replies.send((rank, reply)).is_err() || failed {
            return;
        }
    }
    let _ = worker.be.synchronize();
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl DataParallel {
    /// Starts `world` ranks. On each rank's thread, `make(rank)` builds its
    /// backend and reducer; the rank then builds its network for
    /// `batch_size / world` samples (a replica with rank 0's parameters
    /// broadcast to all, or in the hybrid mode its part of the network
    /// initialised from the run's seed) and its shards of the run's loaders.
    /// Returns once every rank is ready.
    pub fn start<B, R, F>(
        cfg: &Config,
        data: &RunData,
        world: usize,
        bucket_bytes: usize,
        make: F,
    ) -> Result<Self>
    where
        B: Backend + 'static,
        R: Reducer<B> + 'static,
        F: Fn(usize) -> Result<(B, R)> + Send + Sync + 'static,
    {
        let per_rank = per_rank_batch(cfg.train.batch_size, world)?;
        let parallel = cfg.train.parallel;
        let hybrid_init = match parallel {
            Parallel::Data => None,
            Parallel::Hybrid => {
                plan_hybrid(&cfg.model, world).with_context(|| cfg.origin.clone())?;
                Some(Arc::new(initial_params(&cfg.model, cfg.train.seed)?))
            }
        };
        let workers = (data.train_loader.workers / world).max(1);
        let make = Arc::new(make);
        let (reply_tx, replies) = channel();
        let mut engine = DataParallel {
            parallel,
            commands: Vec::new(),
            threads: Vec::new(),
            replies,
            names: (0..world).map(|r| format!("rank {r}")).collect(),
            per_rank,
            param_count: 0,
            per_epoch: 0,
            failed: false,
        };
        // Every fallible step that needs no thread first: once a rank's
        // thread runs, it may wait for its peers (NCCL's init) forever.
        let mut setups = Vec::with_capacity(world);
        for rank in 0..world {
            let shard =
                |c: &crate::data::LoaderConfig| c.clone().shard(rank, world).with_workers(workers);
            let train = Loader::new(data.train.clone(), shard(&data.train_loader))?;
            let val = Loader::new(data.val.clone(), shard(&data.val_loader))?;
            engine.per_epoch = train.batches_per_epoch();
            setups.push(RankSetup {
                rank,
                spec: cfg.model.clone(),
                batch: per_rank,
                global: cfg.train.batch_size,
                seed: cfg.train.seed,
                hybrid_init: hybrid_init.clone(),
                bucket_bytes,
                train,
                val,
            });
        }
        for setup in setups {
            let rank = setup.rank;
            let (tx, rx) = channel();
            let (make, reply_tx) = (make.clone(), reply_tx.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let run = AssertUnwindSafe(|| serve(setup, &*make, rx, &reply_tx));
                    if let Err(p) = catch_unwind(run) {
                        let _ =
                            reply_tx.send((rank, Err(anyhow!("panicked: {}", panic_text(&*p)))));
                    }
                });
            match spawned {
                Ok(thread) => {
                    engine.commands.push(tx);
                    engine.threads.push(thread);
                }
                Err(e) => {
                    engine.failed = true;
                    bail!("cannot start the thread of rank {rank}: {e}");
                }
            }
        }
        for (rank, reply) in engine.collect(world)?.into_iter().enumerate() {
            if let Reply::Ready { name, params } = reply {
                engine.names[rank] = name;
                engine.param_count = params;
            }
        }
        Ok(engine)
    }

    pub fn world(&self) -> usize {
        self.commands.len()
    }

    /// Waits for `count` replies (one per rank asked), in rank order.
    fn collect(&mut self, count: usize) -> Result<Vec<Reply>> {
        let mut got: Vec<Option<Reply>> = (0..self.world()).map(|_| None).collect();
        for _ in 0..count {
            match self.replies.recv() {
                Ok((rank, Ok(reply))) => got[rank] = Some(reply),
                Ok((rank, Err(e))) => {
                    self.failed = true;
                    return Err(e.context(format!("replica {rank} ({})", self.names[rank])));
                }
                Err(_) => {
                    self.failed = true;
                    bail!("the replicas' threads stopped without a reply");
                }
            }
        }
        Ok(got.into_iter().flatten().collect())
    }

    fn send(&mut self, rank: usize, cmd: Cmd) -> Result<()> {
        if self.failed {
            bail!("the replicas stopped after an earlier error");
        }
        if self.commands[rank].send(cmd).is_err() {
            self.failed = true;
            bail!("replica {rank} ({}) is no longer running", self.names[rank]);
        }
        Ok(())
    }

    /// Sends `cmd` to every rank and waits for all replies.
    fn all(&mut self, cmd: Cmd) -> Result<Vec<Reply>> {
        for rank in 0..self.world() {
            self.send(rank, cmd.clone())?;
        }
        self.collect(self.world())
    }
}

fn unexpected() -> anyhow::Error {
    anyhow!("a replica answered with the wrong kind of reply")
}

impl Engine for DataParallel {
    fn describe(&self) -> String {
        let how = match self.parallel {
            Parallel::Data => "replicas",
            Parallel::Hybrid => "ranks (hybrid: conv data-parallel, fc model-parallel)",
        };
        format!(
            "{} {how}, {} samples each ({})",
            self.world(),
            self.per_rank,
            self.names.join(", ")
        )
    }
    fn param_count(&self) -> usize {
        self.param_count
    }
    fn batches_per_epoch(&self) -> usize {
        self.per_epoch
    }
    fn load_params(&mut self, tensors: &[NamedTensor], momentum: bool) -> Result<()> {
        let tensors = Arc::new(tensors.to_vec());
        self.all(Cmd::Load { tensors, momentum }).map(drop)
    }
    fn save_params(&mut self, momentum: bool) -> Result<Tensors> {
        let reply = match self.parallel {
            Parallel::Data => {
                self.send(0, Cmd::Save { momentum })?;
                self.collect(1)?.pop()
            }
            // Gathering the fc slices is a collective.
            Parallel::Hybrid => self.all(Cmd::Save { momentum })?.into_iter().next(),
        };
        match reply {
            Some(Reply::Params(p)) => Ok(p),
            _ => Err(unexpected()),
        }
    }
    fn start_epoch(&mut self, epoch: u64, first: usize) -> Result<()> {
        self.all(Cmd::StartEpoch { epoch, first }).map(drop)
    }
    fn step(&mut self, dropout: (u64, u64), sgd: &SgdParams) -> Result<usize> {
        let replies = self.all(Cmd::Step { dropout, sgd: *sgd })?;
        replies
            .into_iter()
            .map(|r| match r {
                Reply::Samples(n) => Ok(n),
                _ => Err(unexpected()),
            })
            .sum()
    }
    fn train_metrics(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut loss, mut rank) = (Vec::new(), Vec::new());
        for r in self.all(Cmd::Metrics)? {
            let Reply::Metrics(l, k) = r else {
                return Err(unexpected());
            };
            loss.extend(l);
            rank.extend(k);
        }
        Ok((loss, rank))
    }
    fn evaluate(&mut self) -> Result<EvalSums> {
        let mut sums = EvalSums::default();
        for r in self.all(Cmd::Eval)? {
            let Reply::Eval(s) = r else {
                return Err(unexpected());
            };
            sums.add(&s);
        }
        Ok(sums)
    }
    fn synchronize(&mut self) -> Result<()> {
        self.all(Cmd::Sync).map(drop)
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        self.commands.clear();
        if !self.failed {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// Runs `f(rank)` for `world` ranks, each on a new thread, and returns the
/// results in rank order. The first error (or panic) is returned as soon as
/// it arrives; threads still running are then left to end on their own,
/// since they may wait for the failed rank forever.
pub fn on_ranks<T, F>(world: usize, f: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(usize) -> Result<T> + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (tx, rx) = channel();
    let mut threads = Vec::new();
    for rank in 0..world {
        let (f, tx) = (f.clone(), tx.clone());
        let t = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let out = catch_unwind(AssertUnwindSafe(|| f(rank)))
                    .unwrap_or_else(|p| Err(anyhow!("panicked: {}", panic_text(&*p))));
                let _ = tx.send((rank, out));
            })
            .with_context(|| format!("starting the thread of rank {rank}"))?;
        threads.push(t);
    }
    drop(tx);
    let mut out: Vec<Option<T>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let (rank, r) = rx
            .recv()
            .context("a rank's thread ended without a result")?;
        out[rank] = Some(r.with_context(|| format!("rank {rank}"))?);
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(out.into_iter().flatten().collect())
}

/// Trains on `world` ranks (`train.parallel` says how they split the
/// work): `make(rank)` builds each rank's backend and reducer on the rank's
/// thread. The config's batch is global.
pub fn train_replicated<B, R, F>(
    cfg: Config,
    opts: &TrainOptions,
    world: usize,
    make: F,
) -> Result<TrainOutcome>
where
    B: Backend + 'static,
    R: Reducer<B> + 'static,
    F: Fn(usize) -> Result<(B, R)> + Send + Sync + 'static,
{
    per_rank_batch(cfg.train.batch_size, world).with_context(|| cfg.origin.clone())?;
    let data = RunData::open(&cfg)?;
    let mut engine = DataParallel::start(&cfg, &data, world, opts.bucket_bytes, make)?;
    crate::train::run(&mut engine, cfg, opts)
}

/// Trains `cfg` on the GPUs `devices` over NCCL, data-parallel or hybrid
/// (`train.parallel`).
pub fn train_data_parallel(
    cfg: Config,
    opts: &TrainOptions,
    devices: &[usize],
) -> Result<TrainOutcome> {
    let world = devices.len();
    per_rank_batch(cfg.train.batch_size, world).with_context(|| cfg.origin.clone())?;
    if let Some(why) = nccl_unavailable_reason() {
        bail!("{why}");
    }
    let id = NcclId::new()?;
    let (precision, autotune) = (cfg.train.precision, cfg.train.autotune);
    let devices = devices.to_vec();
    train_replicated(cfg, opts, world, move |rank| {
        let gpu = devices[rank];
        let mut be = CudaBackend::new(gpu).with_context(|| format!("GPU {gpu}"))?;
        be.set_precision(precision)?;
        be.set_autotune(autotune);
        let reducer =
            NcclReducer::new(&be, rank, world, id).with_context(|| format!("GPU {gpu}"))?;
        Ok((be, reducer))
    })
}
