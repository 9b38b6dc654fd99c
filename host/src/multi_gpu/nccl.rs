//! [`NcclReducer`]: the [`Reducer`] collectives over NCCL, on a
//! communication stream beside the backend's compute stream.
//!
//! Ordering, all on the GPU (the host never waits):
//! - `start_mean`: record `ready` on the compute stream (the bucket's
//!   gradients are queued there), make the communication stream wait for it,
//!   and queue one NCCL group of in-place `ncclAvg` all-reduces, one per
//!   gradient buffer, on the communication stream. The compute stream goes on
//!   with the next layers' backward meanwhile; it never writes these buffers
//!   again before `finish`.
//! - `finish`: record `done` on the communication stream and make the compute
//!   stream wait for it, so the SGD update reads the mean gradients. When
//!   measuring, events on the compute stream just before and after that wait
//!   time how long the GPU sat idle waiting for communication.
//!
//! - the hybrid mode's collectives on activations (`all_gather`,
//!   `all_reduce_sum`, `reduce_scatter_sum`) are `start` and `finish` in
//!   one: the compute stream needs their result next. An all-gather of
//!   unequal counts is an NCCL group of one broadcast per rank into its
//!   part of the receiving buffer. The labels' all-gather runs on the
//!   communication stream alone (the host waits for it, not for compute).
//!   With waits measured, a step's waits add up to one entry, at `finish`.
//!
//! The communication stream has the highest priority the device offers, so
//! NCCL's kernels are scheduled ahead of queued compute blocks.
//!
//! NCCL is loaded at run time (cudarc's dynamic loading): check
//! [`nccl_unavailable_reason`] before anything that calls into it, since
//! cudarc panics when the library is missing.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, sys as cuda_sys};
use cudarc::nccl::{Comm, Id, ReduceOp, result as nccl_result, sys as nccl_sys};

use super::reducer::Reducer;
use crate::backend::cuda::{CudaBackend, DevBuf};

/// `ncclAvg` appeared in NCCL 2.10 (version code 2·10000 + 10·100).
const MIN_NCCL_VERSION: i32 = 21000;

fn nccl_err(what: &str, e: nccl_result::NcclError) -> anyhow::Error {
    anyhow!("NCCL {what} failed: {:?}", e.0)
}

fn cuda_err(what: &str, e: DriverError) -> anyhow::Error {
    anyhow!("{what}: CUDA error: {e}")
}

/// Why NCCL cannot be used, as one line; `None` when libnccl loads and is
/// recent enough.
pub fn nccl_unavailable_reason() -> Option<String> {
    if !unsafe { nccl_sys::is_culib_present() } {
        return Some(
            "NCCL could not be loaded (libnccl.so not found): install NCCL, or put the folder holding libnccl.so on LD_LIBRARY_PATH (pip's nvidia-nccl-cu12 ships only libnccl.so.2: make a symlink named libnccl.so to it in that folder or another one on the path)"
                .into(),
        );
    }
    match nccl_result::get_nccl_version() {
        Ok(v) if v >= MIN_NCCL_VERSION => None,
        Ok(v) => Some(format!(
            "NCCL {}.{}.{} is too old: multi-GPU training needs NCCL 2.10 or newer (ncclAvg)",
            v / 10000,
            v / 100 % 100,
            v % 100
        )),
        Err(e) => Some(format!(
            "NCCL does not work: ncclGetVersion failed: {:?}",
            e.0
        )),
    }
}

/// The number of visible CUDA devices (0 without a driver).
pub fn visible_gpus() -> Result<usize> {
    if let Some(why) = crate::backend::cuda::unavailable_reason() {
        bail!("{why}");
    }
    let n = CudaContext::device_count().map_err(|e| cuda_err("counting GPUs", e))?;
    Ok(n as usize)
}

/// The identifier that joins the ranks of one NCCL communicator: made once
/// (after checking [`nccl_unavailable_reason`]) and given to every rank.
#[derive(Clone, Copy, Debug)]
pub struct NcclId(Id);

impl NcclId {
    pub fn new() -> Result<Self> {
        if let Some(why) = nccl_unavailable_reason() {
            bail!("{why}");
        }
        Id::new()
            .map(NcclId)
            .map_err(|e| nccl_err("ncclGetUniqueId", e))
    }
}

/// One rank's NCCL communicator and communication stream.
pub struct NcclReducer {
    comm: Comm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ready: CudaEvent,
    done: CudaEvent,
    pending: bool,
    /// Event pairs around the compute stream's waits, when measuring: one
    /// group per `finish` (the waits since the one before).
    waits: Option<Vec<Vec<(CudaEvent, CudaEvent)>>>,
    /// The waits of the group being measured.
    current: Vec<(CudaEvent, CudaEvent)>,
}

impl NcclReducer {
    /// Joins the communicator `id` as `rank` of `world` on `be`'s GPU.
    /// Blocks until every rank has joined, so the ranks must call it
    /// concurrently (one thread each).
    pub fn new(be: &CudaBackend, rank: usize, world: usize, id: NcclId) -> Result<Self> {
        let ctx = be.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the GPU", e))?;
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| cuda_err("stream priorities", e))?;
        let stream = ctx
            .new_stream_with_priority(greatest)
            .map_err(|e| cuda_err("creating the communication stream", e))?;
        let event = || {
            ctx.new_event(None)
                .map_err(|e| cuda_err("creating an event", e))
        };
        let (ready, done) = (event()?, event()?);
        let comm = Comm::from_rank(stream.clone(), rank, world, id.0)
            .map_err(|e| nccl_err(&format!("ncclCommInitRank (rank {rank} of {world})"), e))?;
        Ok(Self {
            comm,
            ctx,
            stream,
            ready,
            done,
            pending: false,
            waits: None,
            current: Vec::new(),
        })
    }

    /// Makes the communication stream wait for the work queued so far on
    /// `be`'s stream.
    fn after_compute(&self, be: &CudaBackend) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the GPU", e))?;
        self.ready
            .record(be.stream())
            .map_err(|e| cuda_err("recording an event", e))?;
        self.stream
            .wait(&self.ready)
            .map_err(|e| cuda_err("ordering the communication stream", e))
    }

    /// Makes the compute stream wait for everything queued on the
    /// communication stream (timed when measuring).
    fn compute_waits(&mut self, be: &CudaBackend) -> Result<()> {
        self.done
            .record(&self.stream)
            .map_err(|e| cuda_err("recording an event", e))?;
        let flags = Some(cuda_sys::CUevent_flags::CU_EVENT_DEFAULT);
        let before = match self.waits {
            Some(_) => {
                let before = self
                    .ctx
                    .new_event(flags)
                    .map_err(|e| cuda_err("creating an event", e))?;
                before
                    .record(be.stream())
                    .map_err(|e| cuda_err("recording an event", e))?;
                Some(before)
            }
            None => None,
        };
        be.stream()
            .wait(&self.done)
            .map_err(|e| cuda_err("ordering the compute stream", e))?;
        if let Some(before) = before {
            let after = be
                .stream()
                .record_event(flags)
                .map_err(|e| cuda_err("recording an event", e))?;
            self.current.push((before, after));
        }
        self.pending = false;
        Ok(())
    }

    /// Runs `op` on every buffer inside one NCCL group (one fused launch).
    fn group(
        &self,
        what: &str,
        bufs: &mut [&mut DevBuf],
        op: impl Fn(&Comm, &mut DevBuf) -> Result<(), nccl_result::NcclError>,
    ) -> Result<()> {
        nccl_result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let queued = bufs.iter_mut().try_for_each(|b| op(&self.comm, b));
        let ended = nccl_result::group_end();
        queued.map_err(|e| nccl_err(what, e))?;
        ended.map_err(|e| nccl_err("ncclGroupEnd", e))?;
        Ok(())
    }
}

impl Drop for NcclReducer {
    /// Lets queued collectives finish before the communicator is destroyed
    /// (cudarc aborts it, which would cut them short).
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = self.stream.synchronize();
        }
    }
}

impl Reducer<CudaBackend> for NcclReducer {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn broadcast(&mut self, be: &CudaBackend, bufs: &mut [&mut DevBuf]) -> Result<()> {
        self.after_compute(be)?;
        self.group("ncclBroadcast", bufs, |c, b| {
            c.broadcast_in_place(b, 0).map(drop)
        })?;
        self.pending = true;
        self.finish(be)
    }

    fn start_mean(&mut self, be: &CudaBackend, grads: &mut [&mut DevBuf]) -> Result<()> {
        self.after_compute(be)?;
        self.group("ncclAllReduce (average)", grads, |c, b| {
            c.all_reduce_in_place(b, &ReduceOp::Avg).map(drop)
        })?;
        self.pending = true;
        Ok(())
    }

    fn start_sum(&mut self, be: &CudaBackend, grads: &mut [&mut DevBuf]) -> Result<()> {
        self.after_compute(be)?;
        self.group("ncclAllReduce (sum)", grads, |c, b| {
            c.all_reduce_in_place(b, &ReduceOp::Sum).map(drop)
        })?;
        self.pending = true;
        Ok(())
    }

    fn finish(&mut self, be: &CudaBackend) -> Result<()> {
        if self.pending {
            self.compute_waits(be)?;
        }
        if let Some(waits) = &mut self.waits
            && !self.current.is_empty()
        {
            waits.push(std::mem::take(&mut self.current));
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        be: &CudaBackend,
        send: &DevBuf,
        recv: &mut DevBuf,
        counts: &[usize],
    ) -> Result<()> {
        let (rank, world) = (self.rank(), self.world());
        if counts.len() != world || send.len() != counts[rank] {
            bail!(
                "all-gather: rank {rank} sends {} values, its count in {counts:?} (world {world}) differs",
                send.len()
            );
        }
        let total: usize = counts.iter().sum();
        if recv.len() != total {
            bail!(
                "all-gather: the receiving buffer holds {}, the counts add up to {total}",
                recv.len()
            );
        }
        self.after_compute(be)?;
        if counts.iter().all(|&c| c == counts[0]) {
            self.comm
                .all_gather(send, recv)
                .map_err(|e| nccl_err("ncclAllGather", e))?;
        } else {
            nccl_result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
            let mut at = 0;
            let mut queued = Ok(());
            for (root, &count) in counts.iter().enumerate() {
                let mut part = recv.slice_mut(at..at + count);
                let src = (root == rank).then_some(send);
                queued = self.comm.broadcast(src, &mut part, root as i32).map(drop);
                if queued.is_err() {
                    break;
                }
                at += count;
            }
            let ended = nccl_result::group_end();
            queued.map_err(|e| nccl_err("ncclBroadcast (all-gather of unequal parts)", e))?;
            ended.map_err(|e| nccl_err("ncclGroupEnd", e))?;
        }
        self.pending = true;
        self.compute_waits(be)
    }

    fn all_reduce_sum(&mut self, be: &CudaBackend, bufs: &mut [&mut DevBuf]) -> Result<()> {
        self.start_sum(be, bufs)?;
        self.compute_waits(be)
    }

    fn reduce_scatter_sum(
        &mut self,
        be: &CudaBackend,
        send: &DevBuf,
        recv: &mut DevBuf,
    ) -> Result<()> {
        let world = self.world();
        if send.len() != world * recv.len() {
            bail!(
                "reduce-scatter: sends {} values, {world} blocks of {} expected",
                send.len(),
                recv.len()
            );
        }
        self.after_compute(be)?;
        self.comm
            .reduce_scatter(send, recv, &ReduceOp::Sum)
            .map_err(|e| nccl_err("ncclReduceScatter", e))?;
        self.pending = true;
        self.compute_waits(be)
    }

    fn all_gather_labels(&mut self, _be: &CudaBackend, labels: &[i32]) -> Result<Vec<i32>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the GPU", e))?;
        let send = self
            .stream
            .clone_htod(labels)
            .map_err(|e| cuda_err("uploading labels", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<i32>(labels.len() * self.world())
            .map_err(|e| cuda_err("allocating labels", e))?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(|e| nccl_err("ncclAllGather (labels)", e))?;
        let all = self
            .stream
            .clone_dtoh(&recv)
            .map_err(|e| cuda_err("downloading labels", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("gathering labels", e))?;
        Ok(all)
    }

    fn measure_waits(&mut self, on: bool) {
        self.waits = on.then(Vec::new);
        self.current.clear();
    }

    fn take_wait_ms(&mut self) -> Result<Vec<f32>> {
        let Some(waits) = &mut self.waits else {
            return Ok(Vec::new());
        };
        std::mem::take(waits)
            .iter()
            .map(|group| {
                group
                    .iter()
                    .map(|(a, b)| a.elapsed_ms(b))
                    .sum::<Result<f32, _>>()
            })
            .collect::<Result<Vec<f32>, _>>()
            .map_err(|e| cuda_err("reading wait times", e))
            .context("measuring communication waits")
    }
}
