//! The [`Reducer`] trait, one rank's side of the collectives multi-GPU
//! training needs (data-parallel: broadcast and gradient means; hybrid:
//! also gradient sums, all-gather, all-reduce and reduce-scatter sums, and a
//! gather of the batch's labels), and [`HostReducer`], its in-process
//! implementation.
//!
//! `HostReducer` moves buffers through host memory (download, combine,
//! write back), so it works for every backend; it exists for the CPU tests
//! of the multi-GPU code (N CPU ranks on threads of one process) and as the
//! reducer of a single rank (nothing is exchanged when the world is one).
//! Each rank computes sums and means itself, adding the ranks in rank order,
//! so every rank gets bit-identical values, and runs are reproducible.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::{Result, anyhow, bail};

use crate::backend::{Backend, BlockCopy};

/// One rank's side of the collectives. Every rank of a group calls the same
/// collectives in the same order with buffers of the same lengths.
pub trait Reducer<B: Backend> {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Overwrites every rank's `bufs` with rank 0's (collective).
    fn broadcast(&mut self, be: &B, bufs: &mut [&mut B::Buf]) -> Result<()>;
    /// Starts replacing each of `grads` by its mean over the ranks
    /// (collective). Called once the work that writes them has been queued on
    /// `be`; may return before the mean is computed.
    fn start_mean(&mut self, be: &B, grads: &mut [&mut B::Buf]) -> Result<()>;
    /// Like [`Reducer::start_mean`], but the sum over the ranks.
    fn start_sum(&mut self, be: &B, grads: &mut [&mut B::Buf]) -> Result<()>;
    /// Makes the work queued on `be` after this call wait for every started
    /// mean or sum.
    fn finish(&mut self, be: &B) -> Result<()>;
    /// Fills `recv` with every rank's `send`, one after another in rank
    /// order; rank `r`'s `send` holds `counts[r]` values (collective). Work
    /// queued on `be` after this call sees `recv`.
    fn all_gather(
        &mut self,
        be: &B,
        send: &B::Buf,
        recv: &mut B::Buf,
        counts: &[usize],
    ) -> Result<()>;
    /// Replaces each of `bufs` by its sum over the ranks (collective); work
    /// queued on `be` after this call sees the sums.
    fn all_reduce_sum(&mut self, be: &B, bufs: &mut [&mut B::Buf]) -> Result<()>;
    /// Fills `recv` with block `rank` of the sum over the ranks of `send`,
    /// split into `world` blocks of `recv`'s length (collective); work
    /// queued on `be` after this call sees `recv`.
    fn reduce_scatter_sum(&mut self, be: &B, send: &B::Buf, recv: &mut B::Buf) -> Result<()>;
    /// Every rank's `labels` (host values, the same count on every rank),
    /// one after another in rank order (collective; waits for the result).
    fn all_gather_labels(&mut self, be: &B, labels: &[i32]) -> Result<Vec<i32>>;
    /// Starts (or stops) measuring how long the backend waits for
    /// communication at each `finish` (off by default).
    fn measure_waits(&mut self, on: bool);
    /// Milliseconds the backend waited for communication at each measured
    /// `finish` since the last call (call after synchronising).
    fn take_wait_ms(&mut self) -> Result<Vec<f32>>;
}

/// Where the ranks of a [`HostReducer`] group meet.
struct Rendezvous {
    world: usize,
    state: Mutex<State>,
    turn: Condvar,
}

struct State {
    arrived: usize,
    generation: u64,
    /// Ranks whose reducer was dropped.
    gone: usize,
    /// Each rank's contribution to the collective in progress.
    slots: Vec<Vec<f32>>,
}

impl Rendezvous {
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| anyhow!("a replica panicked during a collective"))
    }

    /// Waits until every rank has arrived. Fails, instead of waiting
    /// forever, once a rank has left the group.
    fn barrier<'a>(&'a self, mut st: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>> {
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.turn.notify_all();
            return Ok(st);
        }
        loop {
            if st.generation != generation {
                return Ok(st);
            }
            if st.gone > 0 {
                bail!("another replica stopped during a collective");
            }
            st = self
                .turn
                .wait(st)
                .map_err(|_| anyhow!("a replica panicked during a collective"))?;
        }
    }
}

/// An in-process reducer for any backend; see the module docs.
pub struct HostReducer {
    rank: usize,
    shared: Arc<Rendezvous>,
    /// Host time spent in `start_mean` since the last `finish` (for a host
    /// reducer, the time the backend waits for communication).
    spent: f32,
    /// Measured waits, when measuring.
    waits: Option<Vec<f32>>,
}

impl HostReducer {
    /// The `world` reducers of one group, rank 0 first; hand one to each
    /// replica's thread.
    pub fn group(world: usize) -> Vec<HostReducer> {
        assert!(world > 0, "a group needs at least one rank");
        let shared = Arc::new(Rendezvous {
            world,
            state: Mutex::new(State {
                arrived: 0,
                generation: 0,
                gone: 0,
                slots: vec![Vec::new(); world],
            }),
            turn: Condvar::new(),
        });
        (0..world)
            .map(|rank| HostReducer {
                rank,
                shared: shared.clone(),
                spent: 0.0,
                waits: None,
            })
            .collect()
    }

    /// Deposits `mine`, waits for every rank, lets `combine` read all the
    /// deposits, and waits again so no rank overwrites its deposit while
    /// another still reads it.
    fn exchange<T>(&self, mine: Vec<f32>, combine: impl FnOnce(&[Vec<f32>]) -> T) -> Result<T> {
        let mut st = self.shared.lock()?;
        st.slots[self.rank] = mine;
        let st = self.shared.barrier(st)?;
        let out = combine(&st.slots);
        drop(self.shared.barrier(st)?);
        Ok(out)
    }
}

impl Drop for HostReducer {
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.gone += 1;
        }
        self.shared.turn.notify_all();
    }
}

/// The buffers' contents, one after another.
fn gather<B: Backend>(be: &B, bufs: &[&mut B::Buf]) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for b in bufs {
        flat.extend(be.download(b)?);
    }
    Ok(flat)
}

/// Writes `flat` back into the buffers it was gathered from.
fn scatter<B: Backend>(be: &B, bufs: &mut [&mut B::Buf], flat: &[f32]) -> Result<()> {
    let mut at = 0;
    for b in bufs.iter_mut() {
        let len = be.len(b);
        be.write(b, &flat[at..at + len])?;
        at += len;
    }
    Ok(())
}

impl HostReducer {
    /// Replaces each of `bufs` by its sum (or `mean`) over the ranks.
    fn reduce<B: Backend>(
        &mut self,
        be: &B,
        bufs: &mut [&mut B::Buf],
        mean: bool,
        what: &str,
    ) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let mine = gather(be, bufs)?;
        let len = mine.len();
        let out = self.exchange(mine, |slots| {
            if slots.iter().any(|s| s.len() != len) {
                return None;
            }
            let n = if mean { slots.len() as f32 } else { 1.0 };
            Some(
                (0..len)
                    .map(|j| slots.iter().map(|s| s[j]).sum::<f32>() / n)
                    .collect::<Vec<f32>>(),
            )
        })?;
        let Some(out) = out else {
            bail!("{what}: the ranks passed buffers of different lengths");
        };
        scatter(be, bufs, &out)?;
        self.spent += started.elapsed().as_secs_f32() * 1e3;
        Ok(())
    }
}

impl<B: Backend> Reducer<B> for HostReducer {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }

    fn broadcast(&mut self, be: &B, bufs: &mut [&mut B::Buf]) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let mine = if self.rank == 0 {
            gather(be, bufs)?
        } else {
            Vec::new()
        };
        let root = self.exchange(mine, |slots| (self.rank != 0).then(|| slots[0].clone()))?;
        if let Some(root) = root {
            let want: usize = bufs.iter().map(|b| be.len(b)).sum();
            if root.len() != want {
                bail!(
                    "broadcast: rank 0 sent {} values, rank {} expects {want}",
                    root.len(),
                    self.rank
                );
            }
            scatter(be, bufs, &root)?;
        }
        Ok(())
    }

    fn start_mean(&mut self, be: &B, grads: &mut [&mut B::Buf]) -> Result<()> {
        self.reduce(be, grads, true, "mean of gradients")
    }

    fn start_sum(&mut self, be: &B, grads: &mut [&mut B::Buf]) -> Result<()> {
        self.reduce(be, grads, false, "sum of gradients")
    }

    fn all_gather(
        &mut self,
        be: &B,
        send: &B::Buf,
        recv: &mut B::Buf,
        counts: &[usize],
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.shared.world);
        if counts.len() != world || be.len(send) != counts[rank] {
            bail!(
                "all-gather: rank {rank} sends {} values, its count in {counts:?} (world {world}) differs",
                be.len(send)
            );
        }
        let total: usize = counts.iter().sum();
        if be.len(recv) != total {
            bail!(
                "all-gather: the receiving buffer holds {}, the counts add up to {total}",
                be.len(recv)
            );
        }
        if world == 1 {
            return be.copy_block(&BlockCopy::run(0, 0, total), send, recv);
        }
        let started = Instant::now();
        let all = self.exchange(be.download(send)?, |slots| {
            let ok = slots.iter().zip(counts).all(|(s, &c)| s.len() == c);
            ok.then(|| slots.concat())
        })?;
        let Some(all) = all else {
            bail!("all-gather: the ranks disagree on the counts");
        };
        be.write(recv, &all)?;
        self.spent += started.elapsed().as_secs_f32() * 1e3;
        Ok(())
    }

    fn all_reduce_sum(&mut self, be: &B, bufs: &mut [&mut B::Buf]) -> Result<()> {
        self.reduce(be, bufs, false, "all-reduce")
    }

    fn reduce_scatter_sum(&mut self, be: &B, send: &B::Buf, recv: &mut B::Buf) -> Result<()> {
        let (rank, world, block) = (self.rank, self.shared.world, be.len(recv));
        if be.len(send) != world * block {
            bail!(
                "reduce-scatter: sends {} values, {world} blocks of {block} expected",
                be.len(send)
            );
        }
        if world == 1 {
            return be.copy_block(&BlockCopy::run(0, 0, block), send, recv);
        }
        let started = Instant::now();
        let len = world * block;
        let mine = self.exchange(be.download(send)?, |slots| {
            if slots.iter().any(|s| s.len() != len) {
                return None;
            }
            let at = rank * block;
            Some(
                (at..at + block)
                    .map(|j| slots.iter().map(|s| s[j]).sum::<f32>())
                    .collect::<Vec<f32>>(),
            )
        })?;
        let Some(mine) = mine else {
            bail!("reduce-scatter: the ranks passed buffers of different lengths");
        };
        be.write(recv, &mine)?;
        self.spent += started.elapsed().as_secs_f32() * 1e3;
        Ok(())
    }

    fn all_gather_labels(&mut self, _be: &B, labels: &[i32]) -> Result<Vec<i32>> {
        if self.shared.world == 1 {
            return Ok(labels.to_vec());
        }
        // Slots hold f32, exact for integers up to 2²⁴.
        const EXACT: i32 = 1 << 24;
        if let Some(bad) = labels.iter().find(|l| !(-EXACT..=EXACT).contains(*l)) {
            bail!("label {bad} cannot be exchanged (beyond ±2²⁴)");
        }
        let len = labels.len();
        let mine = labels.iter().map(|&l| l as f32).collect();
        let all = self.exchange(mine, |slots| {
            slots.iter().all(|s| s.len() == len).then(|| slots.concat())
        })?;
        let Some(all) = all else {
            bail!("gathering labels: the ranks passed different counts");
        };
        Ok(all.into_iter().map(|l| l as i32).collect())
    }

    fn finish(&mut self, _be: &B) -> Result<()> {
        let spent = std::mem::take(&mut self.spent);
        if let Some(w) = &mut self.waits {
            w.push(spent);
        }
        Ok(())
    }

    fn measure_waits(&mut self, on: bool) {
        self.waits = on.then(Vec::new);
    }

    fn take_wait_ms(&mut self) -> Result<Vec<f32>> {
        Ok(self.waits.as_mut().map(std::mem::take).unwrap_or_default())
    }
}
