//! [`StepRunner`]: the training steps of one model (forward, backward and
//! the SGD update), run eagerly or captured once as a CUDA graph and
//! replayed, which saves the launch gaps between the step's 89–107 kernels
//! (AlexNet in TF32 / bf16).
//!
//! A graph replays its launches with the buffers, shapes, kernel choices and
//! arguments they had at capture. The values that change per step
//! ([`StepArgs`]: dropout's step, the learning rate and the other SGD
//! hyper-parameters) reach the kernels through a device buffer that each
//! replay writes first (see the CUDA backend's `graph.rs`). Everything else
//! a step depends on is either its key here (the model, which allocates all
//! its buffers once; the dropout seed; the SGD rule), or backend state whose
//! changes make the graph stale ([`Backend::graph_current`]: a regrown
//! workspace, a new precision). A step with another key or a stale graph
//! runs eagerly, and the next one with the same key captures again: capture
//! needs an eager step first, because workspaces grow on first use and
//! must not allocate during a capture; an eager step that grew one is no
//! warm-up (a buffer used before the growth, such as a TMA tensor map's
//! operand, would have another address in the capture), so eager steps go
//! on until one leaves the backend's buffers as they were. Batch uploads
//! ([`Model::set_batch`]) stay outside the graph and write into the same
//! device buffers.
//!
//! Graphs are on where the backend has them (CUDA, single GPU; the
//! multi-GPU engines run eagerly); `--no-graph` or `ALEXNET_CUDA_GRAPH=0`
//! turns them off. A capture that fails prints a warning and the runner
//! stays eager.

use anyhow::Result;

use crate::backend::{Backend, SgdParams, SgdRule, StepArgs};
use crate::model::Model;

/// Whether the environment allows graphs (`ALEXNET_CUDA_GRAPH=0` does not).
pub fn allowed_by_env() -> bool {
    std::env::var("ALEXNET_CUDA_GRAPH").map_or(true, |v| v != "0")
}

/// Steps a runner ran each way so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepStats {
    pub eager: u64,
    pub captures: u64,
    pub replays: u64,
}

/// What a captured step depends on besides the backend's own state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StepKey {
    model: u64,
    dropout_seed: u64,
    rule: SgdRule,
    /// The fc layers' kept weight copies were current at the step's start
    /// ([`Model::w_copies_fresh`]): a step captured so reads them as they
    /// are instead of making them.
    w_copies_fresh: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Eager,
    Capture,
    Replay,
}

/// The runner's rules, apart from the backend so they are tested without a
/// GPU: replay the held graph while its key matches and it is current;
/// otherwise drop it, and capture if the last eager step had this key and
/// replaced no buffer (so workspaces have grown for it and stayed put),
/// else run eagerly.
#[derive(Debug, Default)]
struct Plan {
    /// The key of the last eager step; forgotten when a graph goes stale,
    /// since workspaces may have to grow again.
    warm: Option<StepKey>,
    /// The key of the held graph.
    held: Option<StepKey>,
}

impl Plan {
    /// The action for a step with `key`; `current` says whether the held
    /// graph, if any, may still be replayed.
    fn next(&mut self, key: StepKey, current: bool) -> Action {
        if let Some(held) = self.held {
            if held == key && current {
                return Action::Replay;
            }
            self.held = None;
            if !current {
                self.warm = None;
            }
        }
        if self.warm == Some(key) {
            Action::Capture
        } else {
            Action::Eager
        }
    }

    /// Notes an eager step of `key` (the key as it ends the step): a
    /// warm-up for the next step unless it `regrew` a backend buffer.
    fn ran_eagerly(&mut self, key: StepKey, regrew: bool) {
        self.warm = (!regrew).then_some(key);
    }
}

/// Runs one model's training steps, as a replayed graph where it can (see
/// the module docs).
pub struct StepRunner<B: Backend> {
    /// Why steps run eagerly, when graphs are off.
    off: Option<String>,
    plan: Plan,
    graph: Option<B::Graph>,
    stats: StepStats,
}

impl<B: Backend> StepRunner<B> {
    /// A runner for `be`; `requested` is false for `--no-graph`.
    pub fn new(be: &B, requested: bool) -> Self {
        let off = if !requested {
            Some("--no-graph".to_string())
        } else if !allowed_by_env() {
            Some("ALEXNET_CUDA_GRAPH=0".to_string())
        } else {
            be.no_graphs_reason()
        };
        StepRunner {
            off,
            plan: Plan::default(),
            graph: None,
            stats: StepStats::default(),
        }
    }

    /// One training step of `model` on the batch set last: forward and
    /// backward with dropout `(seed, step)`, then the SGD update `sgd`.
    /// The same result as [`Model::train_step`], bit for bit.
    pub fn step(
        &mut self,
        be: &B,
        model: &mut Model<B>,
        dropout: (u64, u64),
        sgd: &SgdParams,
    ) -> Result<()> {
        let mut warms = None;
        if self.off.is_none() {
            let key = StepKey {
                model: model.id(),
                dropout_seed: dropout.0,
                rule: sgd.rule,
                w_copies_fresh: model.w_copies_fresh(),
            };
            let args = StepArgs::new(dropout.1, sgd);
            let current = self.graph.as_ref().is_some_and(|g| be.graph_current(g));
            match self.plan.next(key, current) {
                Action::Replay => {
                    if let Some(g) = &self.graph {
                        // SAFETY: the graph was captured from this model
                        // (the key holds its id), which is alive (borrowed
                        // here) and never replaces its buffers; the
                        // backend's own buffers are covered by
                        // `graph_current`.
                        unsafe { be.replay(g, &args) }?;
                        self.stats.replays += 1;
                        return Ok(());
                    }
                }
                Action::Capture => {
                    self.graph = None;
                    match be.capture(&args, &mut || model.train_step(be, dropout, sgd)) {
                        Ok(g) => {
                            // SAFETY: as above; captured from `model` just now.
                            unsafe { be.replay(&g, &args) }?;
                            self.graph = Some(g);
                            self.plan.held = Some(key);
                            self.stats.captures += 1;
                            self.stats.replays += 1;
                            return Ok(());
                        }
                        Err(e) => {
                            eprintln!(
                                "warning: capturing the training step as a CUDA graph failed ({e:#}); running steps eagerly"
                            );
                            self.off = Some(format!("capture failed: {e:#}"));
                        }
                    }
                }
                Action::Eager => self.graph = None,
            }
            warms = Some(key);
        }
        let generation = be.buffers_generation();
        model.train_step(be, dropout, sgd)?;
        self.stats.eager += 1;
        if let Some(key) = warms {
            // The step warmed the workspaces for the key the model has now
            // (its fc weight copies made by this step's forward and
            // refreshed by its update: a step that makes them needs all a
            // step that reads them does).
            let key = StepKey {
                w_copies_fresh: model.w_copies_fresh(),
                ..key
            };
            self.plan
                .ran_eagerly(key, be.buffers_generation() != generation);
        }
        Ok(())
    }

    /// Whether steps may be replayed as a graph (false once a capture failed).
    pub fn uses_graph(&self) -> bool {
        self.off.is_none()
    }

    /// Why steps run eagerly, when they do.
    pub fn off_reason(&self) -> Option<&str> {
        self.off.as_deref()
    }

    pub fn stats(&self) -> StepStats {
        self.stats
    }

    /// One line for logs: `CUDA graph (1 capture, 33 replays, 1 eager
    /// step)` or `eager (why)`.
    pub fn describe(&self) -> String {
        let s = self.stats;
        match &self.off {
            None => format!(
                "CUDA graph ({} capture(s), {} replays, {} eager step(s))",
                s.captures, s.replays, s.eager
            ),
            Some(why) => format!("eager ({why})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn key(model: u64, seed: u64) -> StepKey {
        StepKey {
            model,
            dropout_seed: seed,
            rule: SgdRule::Pytorch,
            w_copies_fresh: true,
        }
    }

    /// Plays `steps` (key, whether the held graph is current) through a
    /// plan as the runner does, returning the actions.
    fn play(steps: &[(StepKey, bool)]) -> Vec<Action> {
        let steps: Vec<_> = steps.iter().map(|&(k, c)| (k, c, false)).collect();
        play_growing(&steps)
    }

    /// [`play`] with, per step, whether an eager run of it regrows a buffer.
    fn play_growing(steps: &[(StepKey, bool, bool)]) -> Vec<Action> {
        let mut plan = Plan::default();
        steps
            .iter()
            .map(|&(k, current, regrew)| {
                let a = plan.next(k, current);
                match a {
                    Action::Capture => plan.held = Some(k),
                    Action::Eager => plan.ran_eagerly(k, regrew),
                    Action::Replay => {}
                }
                a
            })
            .collect()
    }

    #[test]
    fn plan_warms_up_until_an_eager_step_regrows_nothing() {
        use Action::*;
        let a = key(1, 7);
        // The first two eager steps grow scratch buffers (the backward's
        // dy and filter copies grow layer by layer): capture only after a
        // step that left them alone.
        let steps = [
            (a, true, true),
            (a, true, true),
            (a, true, false),
            (a, true, false),
            (a, true, false),
        ];
        assert_eq!(play_growing(&steps), [Eager, Eager, Eager, Capture, Replay]);
    }

    #[test]
    fn plan_warms_up_captures_once_then_replays() {
        use Action::*;
        let a = key(1, 7);
        let steps = vec![(a, true); 5];
        assert_eq!(play(&steps), [Eager, Capture, Replay, Replay, Replay]);
    }

    #[test]
    fn plan_recaptures_after_a_key_change_or_a_stale_graph() {
        use Action::*;
        let (a, b) = (key(1, 7), key(2, 7));
        // Another model (or seed) in between: eager for it, and since the
        // last eager step was b's, a needs an eager step again.
        let steps = [
            (a, true),
            (a, true),
            (a, true),
            (b, true),
            (b, true),
            (a, true),
            (a, true),
        ];
        assert_eq!(
            play(&steps),
            [Eager, Capture, Replay, Eager, Capture, Eager, Capture]
        );
        // A stale graph: eager again (workspaces may have to grow), then
        // capture.
        let steps = [(a, true), (a, true), (a, false), (a, true), (a, true)];
        assert_eq!(play(&steps), [Eager, Capture, Eager, Capture, Replay]);
        // The seed is part of the key.
        let steps = [(a, true), (a, true), (key(1, 8), true)];
        assert_eq!(play(&steps), [Eager, Capture, Eager]);
    }

    #[test]
    fn runner_on_the_cpu_is_eager_and_matches_plain_steps() -> Result<()> {
        let be = CpuBackend;
        let cfg = crate::config::Config::from_str(
            include_str!("../../configs/tiny.json"),
            "configs/tiny.json",
        )?;
        let batch = 3;
        let mut plain = Model::new(&be, &cfg.model, batch, 5)?;
        let mut run = Model::new(&be, &cfg.model, batch, 5)?;
        assert_ne!(plain.id(), run.id());
        let mut runner = StepRunner::new(&be, true);
        assert!(!runner.uses_graph());
        assert!(
            runner.describe().starts_with("eager ("),
            "{}",
            runner.describe()
        );
        let per = run.input_len_per_sample();
        for step in 0..3u64 {
            let x: Vec<f32> = (0..batch * per)
                .map(|i| ((i as u64 * 31 + step * 7) % 17) as f32 - 8.0)
                .collect();
            let y: Vec<i32> = (0..batch as i32)
                .map(|i| (i + step as i32) % cfg.model.classes as i32)
                .collect();
            let sgd = SgdParams {
                lr: 0.05 / (step + 1) as f32,
                momentum: 0.9,
                weight_decay: 5e-4,
                rule: SgdRule::Pytorch,
            };
            plain.set_batch(&be, &x, &y)?;
            run.set_batch(&be, &x, &y)?;
            plain.train_step(&be, (3, step), &sgd)?;
            runner.step(&be, &mut run, (3, step), &sgd)?;
        }
        assert_eq!(runner.stats().eager, 3);
        let (a, b) = (
            plain.download_params(&be, false)?,
            run.download_params(&be, false)?,
        );
        for (a, b) in a.iter().zip(&b) {
            assert_eq!(a.data, b.data, "{}", a.name);
        }
        let off = StepRunner::<CpuBackend>::new(&be, false);
        assert_eq!(off.off_reason(), Some("--no-graph"));
        Ok(())
    }
}
