//! Per-launch timing for `host bench --profile`. While a recording is on,
//! `after_launch` (every `launch!` and `copy_block`) records a CUDA event
//! on the backend's stream right after the launch; one more event marks
//! the start. A launch's time is the time between its event and the one
//! before it, so everything the stream did in between (the kernel, and any
//! wait for the host to queue it) is charged to it. Each launch keeps the
//! kernel's name and the label current when it was queued (the bench sets
//! one per layer and pass).
//!
//! Off (the default) it costs one relaxed atomic load per launch. Events
//! are created on first use and reused by later recordings.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, bail};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};

use super::gpu_err;
use crate::backend::LaunchTime;

#[derive(Default)]
pub(super) struct Recorder {
    on: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Timing events, reused across recordings; the first `used` hold this
    /// recording's marks (the start, then one per launch).
    events: Vec<CudaEvent>,
    used: usize,
    /// Per launch: its kernel and the index of its label in `labels`.
    launches: Vec<(&'static str, usize)>,
    labels: Vec<String>,
    label: usize,
}

impl State {
    /// Records the next event on `stream`, creating it if the pool is short.
    fn mark(&mut self, ctx: &std::sync::Arc<CudaContext>, stream: &CudaStream) -> Result<()> {
        if self.used == self.events.len() {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            self.events.push(ctx.new_event(flags).map_err(gpu_err)?);
        }
        self.events[self.used].record(stream).map_err(gpu_err)?;
        self.used += 1;
        Ok(())
    }
}

impl Recorder {
    /// Whether a recording is on (checked after every launch).
    #[inline]
    pub(super) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(super) fn start(
        &self,
        ctx: &std::sync::Arc<CudaContext>,
        stream: &CudaStream,
    ) -> Result<()> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_on() {
            bail!("a launch profile is already being recorded");
        }
        s.used = 0;
        s.launches.clear();
        s.labels.clear();
        s.labels.push(String::new());
        s.label = 0;
        s.mark(ctx, stream)?;
        self.on.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn set_label(&self, label: &str) {
        if !self.is_on() {
            return;
        }
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.label = match s.labels.iter().position(|l| l == label) {
            Some(i) => i,
            None => {
                s.labels.push(label.to_string());
                s.labels.len() - 1
            }
        };
    }

    /// Marks the end of a launch of `kernel` just queued on `stream`.
    pub(super) fn launched(
        &self,
        ctx: &std::sync::Arc<CudaContext>,
        stream: &CudaStream,
        kernel: &'static str,
    ) -> Result<()> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.mark(ctx, stream)?;
        let label = s.label;
        s.launches.push((kernel, label));
        Ok(())
    }

    /// Ends the recording; waits for `stream` and returns each launch's time.
    pub(super) fn finish(&self, stream: &CudaStream) -> Result<Vec<LaunchTime>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !self.is_on() {
            return Ok(Vec::new());
        }
        self.on.store(false, Ordering::Relaxed);
        stream.synchronize().map_err(gpu_err)?;
        let s = &mut *s;
        s.launches
            .iter()
            .zip(s.events[..s.used].windows(2))
            .map(|(&(kernel, label), w)| {
                Ok(LaunchTime {
                    kernel,
                    label: s.labels[label].clone(),
                    ms: w[0].elapsed_ms(&w[1]).map_err(gpu_err)?,
                })
            })
            .collect()
    }
}
