//! CUDA graphs of a training step, and the per-step values they read.
//!
//! A captured graph replays its launches with the arguments they had at
//! capture. The values that change every step ([`StepArgs`]: dropout's step,
//! the SGD hyper-parameters) are therefore not kernel arguments: they live in
//! one 32-byte device buffer, `[dropout step: u64 | lr, momentum,
//! weight_decay: f32 | 0, 0, 0]`, and `dropout_forward`/`dropout_backward`
//! and `sgd_update_all` get its address (`+ STEP_OFFSET`, `+ HYPER_OFFSET`).
//! The backend remembers what it last queued into the buffer:
//! - an eager launch that needs other values queues a write first (a
//!   stream-ordered `memcpy_htod` from a host array, which the driver copies
//!   at the call, so it is ordered like a kernel argument); unchanged values
//!   cost nothing, so a step writes once (twice when the learning rate moves);
//! - [`capture`] writes the step's values, then records with the stream in
//!   capture mode, where a launch that needs other values, or a workspace or
//!   scratch buffer that would grow, is an error (a graph cannot carry them);
//! - [`replay`] writes the new step's values, then launches the graph.
//!
//! A graph also points at the backend's split-K workspace and channels-last
//! scratch buffers and was recorded under its settings (precision, tile
//! choices): replacing one of those buffers (or an SGD table) and changing a
//! setting bump a generation counter, and a graph of an older generation is no
//! longer current ([`graph_current`]); the caller captures again.

use std::sync::atomic::Ordering;

use anyhow::{Result, anyhow, bail};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr, sys};

use super::{CudaBackend, gpu_err};
use crate::backend::StepArgs;

/// Byte offsets in the per-step buffer of the dropout step (u64) and of
/// `[lr, momentum, weight_decay]` (f32).
pub(super) const STEP_OFFSET: u64 = 0;
pub(super) const HYPER_OFFSET: u64 = 8;

/// The per-step values on the device and the ones last queued into them.
pub(super) struct StepValues {
    dev: CudaSlice<u32>,
    last: StepArgs,
}

impl StepValues {
    /// A zeroed buffer, which is [`StepArgs::default`]'s image.
    pub(super) fn new(stream: &std::sync::Arc<CudaStream>) -> Result<Self> {
        Ok(StepValues {
            dev: stream.alloc_zeros::<u32>(8).map_err(gpu_err)?,
            last: StepArgs::default(),
        })
    }
}

/// The device image of `a` (see the module docs).
pub(crate) fn image(a: &StepArgs) -> [u32; 8] {
    let s = a.dropout_step;
    [
        s as u32,
        (s >> 32) as u32,
        a.lr.to_bits(),
        a.momentum.to_bits(),
        a.weight_decay.to_bits(),
        0,
        0,
        0,
    ]
}

/// A captured training step ([`crate::backend::Backend::capture`]).
pub struct StepGraph {
    graph: CudaGraph,
    /// The backend's generation when it was captured.
    generation: u64,
}

impl CudaBackend {
    /// The device address of the per-step values once they hold the last
    /// queued ones changed by `update`; queues the write if that changes
    /// them (an error while capturing). `what` names the values in errors.
    pub(super) fn step_values(
        &self,
        what: &str,
        update: impl FnOnce(&mut StepArgs),
    ) -> Result<u64> {
        let mut sv = self.step_values.lock().unwrap_or_else(|e| e.into_inner());
        let mut args = sv.last;
        update(&mut args);
        let bytes = image(&args);
        if bytes != image(&sv.last) {
            if self.capturing.load(Ordering::SeqCst) {
                bail!(
                    "{what} differs from the captured step's ({:?} against {:?}): a CUDA graph cannot carry the write",
                    args,
                    sv.last
                );
            }
            self.stream
                .memcpy_htod(&bytes[..], &mut sv.dev)
                .map_err(gpu_err)?;
            sv.last = args;
        }
        Ok(sv.dev.device_ptr(&self.stream).0)
    }

    /// Marks everything captured so far stale before a workspace, scratch
    /// buffer or SGD table (`what`) is replaced; an error while capturing,
    /// where the allocation would become part of the graph.
    pub(super) fn before_replacing(&self, what: &str, bytes: usize) -> Result<()> {
        if self.capturing.load(Ordering::SeqCst) {
            bail!(
                "the {what} would be reallocated ({bytes} bytes) while capturing a CUDA graph; run the same step once eagerly first"
            );
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// [`crate::backend::Backend::capture`] on the CUDA backend.
pub(super) fn capture(
    be: &CudaBackend,
    args: &StepArgs,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<StepGraph> {
    if be.sync_each_launch {
        bail!(
            "ALEXNET_SYNC_LAUNCHES=1 synchronises after every launch, which a graph capture cannot"
        );
    }
    be.step_values("the step's values", |a| *a = *args)?;
    let generation = be.generation.load(Ordering::SeqCst);
    be.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| anyhow!("starting a CUDA graph capture failed: {e}"))?;
    be.capturing.store(true, Ordering::SeqCst);
    let recorded = f();
    be.capturing.store(false, Ordering::SeqCst);
    let ended = be.stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded?;
    let graph = ended
        .map_err(|e| anyhow!("capturing a CUDA graph failed: {e}"))?
        .ok_or_else(|| anyhow!("the CUDA graph capture recorded nothing"))?;
    Ok(StepGraph { graph, generation })
}

/// Whether `g` was captured in the backend's current generation.
pub(super) fn graph_current(be: &CudaBackend, g: &StepGraph) -> bool {
    g.generation == be.generation.load(Ordering::SeqCst)
}

/// Writes `args` and queues `g` on the backend's stream.
pub(super) fn replay(be: &CudaBackend, g: &StepGraph, args: &StepArgs) -> Result<()> {
    if !graph_current(be, g) {
        bail!("the CUDA graph is stale (a workspace or a setting changed since its capture)");
    }
    be.step_values("the step's values", |a| *a = *args)?;
    g.graph
        .launch()
        .map_err(|e| anyhow!("replaying the CUDA graph failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_args_image_is_step_words_then_float_bits() {
        let a = StepArgs {
            dropout_step: (7u64 << 32) | 5,
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 5e-4,
        };
        let im = image(&a);
        assert_eq!(im[..2], [5, 7]);
        assert_eq!(
            im[2..5],
            [0.01f32.to_bits(), 0.9f32.to_bits(), 5e-4f32.to_bits()]
        );
        assert_eq!(im[5..], [0, 0, 0]);
        assert_eq!(
            image(&StepArgs::default()),
            [0; 8],
            "a zeroed buffer holds the default"
        );
        assert_eq!(HYPER_OFFSET, 4 * 2, "the floats follow the two step words");
        let nan = StepArgs { lr: f32::NAN, ..a };
        assert_eq!(image(&nan), image(&nan), "NaN compares by its bits");
    }
}
