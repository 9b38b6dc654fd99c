//! Planning (buckets, work split, devices) and, on the CPU backend, N
//! replicas with the in-process reducer against one model on the global
//! batch.

use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::backend::SgdRule;
use crate::backend::cpu::CpuBackend;
use crate::config::Config;
use crate::data::{Loader, LoaderConfig, Split, Synthetic};

const MIB: usize = 1 << 20;

/// Checks the documented invariants of a plan.
fn check_plan(sizes: &[usize], min: usize, plan: &[Range<usize>]) {
    let last = sizes.iter().rposition(|&s| s > 0);
    let Some(last) = last else {
        assert!(plan.is_empty(), "{sizes:?}: {plan:?}");
        return;
    };
    assert_eq!(plan[0].start, 0, "{plan:?}");
    assert_eq!(plan.last().unwrap().end, last + 1, "{sizes:?}: {plan:?}");
    for (i, b) in plan.iter().enumerate() {
        assert!(b.start < b.end);
        if i > 0 {
            assert_eq!(b.start, plan[i - 1].end, "{plan:?}");
        }
        assert!(
            sizes[b.end - 1] > 0,
            "bucket {b:?} ends at a layer without parameters"
        );
        let held: usize = sizes[b.clone()].iter().sum();
        if i + 1 < plan.len() {
            assert!(held >= min, "bucket {b:?} holds {held} < {min}");
        }
        // It closed at the first layer with parameters that reached the
        // minimum.
        for k in b.start..b.end - 1 {
            let held: usize = sizes[b.start..=k].iter().sum();
            assert!(
                sizes[k] == 0 || held < min,
                "{b:?} should have closed at {k}"
            );
        }
    }
}

#[test]
fn buckets_alexnet() {
    // AlexNet in backward order (softmax, fc8, drop, relu, fc7, ..., conv1):
    // parameter bytes per layer.
    let mb = |floats: usize| floats * 4;
    let sizes = [
        0,
        mb(4_097_000),
        0,
        0,
        mb(16_781_312),
        0,
        0,
        mb(37_752_832),
        0,
        mb(884_992),
        0,
        mb(1_327_488),
        0,
        mb(663_936),
        0,
        0,
        0,
        mb(307_392),
        0,
        0,
        0,
        mb(34_944),
    ];
    let plan = plan_buckets(&sizes, DEFAULT_BUCKET_BYTES);
    check_plan(&sizes, DEFAULT_BUCKET_BYTES, &plan);
    // fc8, fc7, fc6 alone; conv5 + conv4 (8.9 MB); conv3 + conv2 + conv1.
    assert_eq!(plan, vec![0..2, 2..5, 5..8, 8..12, 12..22]);
    // A huge minimum gives one bucket closing at conv1.
    assert_eq!(plan_buckets(&sizes, usize::MAX), vec![0..22]);
    // No minimum: one bucket per layer with parameters.
    let per_layer = plan_buckets(&sizes, 0);
    assert_eq!(per_layer.len(), 8);
    assert!(
        per_layer
            .iter()
            .all(|b| sizes[b.clone()].iter().filter(|&&s| s > 0).count() == 1)
    );
    // 32 MiB: fc8 + fc7 (83 MB) close together.
    assert_eq!(plan_buckets(&sizes, 32 * MIB)[0], 0..5);
}

#[test]
fn buckets_edge_cases() {
    assert!(plan_buckets(&[], MIB).is_empty());
    assert!(plan_buckets(&[0, 0, 0], MIB).is_empty());
    // Trailing layers without parameters belong to no bucket.
    assert_eq!(plan_buckets(&[0, 5, 0, 0], 1), vec![0..2]);
    assert_eq!(plan_buckets(&[3, 3, 3], 6), vec![0..2, 2..3]);
    assert_eq!(plan_buckets(&[3, 3, 3], 7), vec![0..3]);
}

#[test]
fn buckets_random_plans_keep_the_invariants() {
    let mut rng = StdRng::seed_from_u64(11);
    for _ in 0..500 {
        let n = rng.random_range(0..30);
        let sizes: Vec<usize> = (0..n)
            .map(|_| {
                if rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(1..100)
                }
            })
            .collect();
        let min = rng.random_range(0..300);
        check_plan(&sizes, min, &plan_buckets(&sizes, min));
    }
}

#[test]
fn split_covers_in_order_and_matches_the_loader() {
    for total in 0..40 {
        for world in 1..6 {
            let parts: Vec<_> = (0..world).map(|r| split_range(total, world, r)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[world - 1].end, total);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            assert!(hi - lo <= 1, "{total}/{world}: {lens:?}");
        }
    }
    // The loader's shards of a full and of a last partial batch.
    let ds: Arc<dyn crate::data::Dataset> =
        Arc::new(Synthetic::new(22, 3, [1, 4, 4], 5, Split::Val).unwrap());
    let aug = crate::data::Augment::eval(4, crate::data::Normalize::unit());
    for world in [1, 2, 4] {
        for rank in 0..world {
            let cfg = LoaderConfig::eval(8, &aug).shard(rank, world);
            let loader = Loader::new(ds.clone(), cfg).unwrap();
            for index in 0..3 {
                let (lo, hi) = loader.shard_range(index);
                let len = 8.min(22 - index * 8);
                let want = split_range(len, world, rank);
                assert_eq!((lo, hi), (index * 8 + want.start, index * 8 + want.end));
            }
        }
    }
}

#[test]
fn per_rank_batch_divides_or_fails() {
    assert_eq!(per_rank_batch(128, 2).unwrap(), 64);
    assert_eq!(per_rank_batch(128, 1).unwrap(), 128);
    let e = per_rank_batch(100, 3).unwrap_err().to_string();
    assert!(e.contains("100 is not divisible by 3 GPUs"), "{e}");
    assert!(per_rank_batch(0, 2).is_err());
    assert!(per_rank_batch(8, 0).is_err());
}

#[test]
fn device_selection() {
    assert_eq!(select_devices(None, None, 3, 4).unwrap(), vec![3]);
    assert_eq!(select_devices(Some(1), None, 2, 4).unwrap(), vec![2]);
    assert_eq!(
        select_devices(Some(4), None, 2, 4).unwrap(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(
        select_devices(None, Some(&[0, 2]), 0, 4).unwrap(),
        vec![0, 2]
    );
    assert_eq!(
        select_devices(Some(2), Some(&[3, 1]), 0, 4).unwrap(),
        vec![3, 1]
    );
    let err = |g, d: Option<&[usize]>, v| select_devices(g, d, 0, v).unwrap_err().to_string();
    assert!(
        err(Some(8), None, 2).contains("8 GPUs requested but only 2 CUDA device(s) are visible")
    );
    assert!(err(None, Some(&[0, 2]), 2).contains("GPU 2 requested but only 2"));
    assert!(err(None, Some(&[1, 1]), 4).contains("GPU 1 is listed twice"));
    assert!(err(Some(3), Some(&[0, 1]), 4).contains("--gpus 3 disagrees with --devices 0,1"));
    assert!(err(Some(0), None, 4).contains("must be ≥ 1"));
    assert!(err(None, Some(&[]), 4).contains("no GPU ordinal"));
    assert!(err(Some(1), None, 0).contains("only 0 CUDA device(s)"));
}

#[test]
fn rank_seeds_differ_from_each_other_and_from_layer_offsets() {
    assert_eq!(rank_seed(42, 0), 42);
    let seeds: Vec<u64> = (0..64).map(|r| rank_seed(42, r)).collect();
    for (i, a) in seeds.iter().enumerate() {
        for b in &seeds[i + 1..] {
            // The model varies the top 16 bits per layer: the low 48 must differ.
            assert_ne!(a & ((1 << 48) - 1), b & ((1 << 48) - 1));
        }
    }
}

/// configs/tiny.json with dropout off (see `replicas_match_one_model`).
fn tiny_without_dropout() -> Config {
    let text = include_str!("../../../configs/tiny.json").replace("\"p\": 0.25", "\"p\": 0.0");
    assert!(text.contains("\"p\": 0.0"));
    Config::from_str(&text, "tiny.json (p = 0)").unwrap()
}

fn sgd() -> SgdParams {
    SgdParams {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
        rule: SgdRule::Pytorch,
    }
}

/// ‖a − b‖ / ‖b‖.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

type Params = Vec<crate::checkpoint::NamedTensor>;

/// What each replica reports: gradients after the first step (before its
/// SGD update), and parameters after every step.
struct Trace {
    first_grads: Vec<Vec<f32>>,
    params: Vec<Params>,
}

/// `world` CPU replicas on threads, each with its shard of every batch.
/// Rank r is initialised from seed `7 + r`, so only the broadcast makes
/// them equal.
fn run_replicas(
    cfg: &Config,
    world: usize,
    batches: &[(Vec<f32>, Vec<i32>)],
    bucket_bytes: usize,
) -> Vec<Trace> {
    let reducers = Arc::new(Mutex::new(
        HostReducer::group(world)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    ));
    let (spec, batches) = (cfg.model.clone(), batches.to_vec());
    let global = batches[0].1.len();
    on_ranks(world, move |rank| {
        let be = CpuBackend;
        let reducer = reducers.lock().unwrap()[rank].take().unwrap();
        let per = global / world;
        let mut r = Replica::new(&be, &spec, per, 7 + rank as u64, reducer, bucket_bytes)?;
        let sample = r.model.input_len_per_sample();
        let mut trace = Trace {
            first_grads: Vec::new(),
            params: Vec::new(),
        };
        for (step, (x, y)) in batches.iter().enumerate() {
            let share = split_range(global, world, rank);
            r.set_batch(&be, &x[share.start * sample..share.end * sample], &y[share])?;
            r.compute_gradients(&be, (3, step as u64))?;
            if step == 0 {
                trace.first_grads = r.model.params.iter().map(|p| p.grad.clone()).collect();
            }
            r.model.sgd_step(&be, &sgd())?;
            trace.params.push(r.model.download_params(&be, false)?);
        }
        Ok(trace)
    })
    .unwrap()
}

fn random_batches(
    cfg: &Config,
    global: usize,
    steps: usize,
    seed: u64,
) -> Vec<(Vec<f32>, Vec<i32>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..steps)
        .map(|_| {
            let x = (0..global * cfg.model.input_len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let y = (0..global)
                .map(|_| rng.random_range(0..cfg.model.classes as i32))
                .collect();
            (x, y)
        })
        .collect()
}

/// One model on the whole batch: first-step gradients and parameters after
/// every step.
fn run_single(cfg: &Config, batches: &[(Vec<f32>, Vec<i32>)]) -> Trace {
    let be = CpuBackend;
    let mut m = Model::new(&be, &cfg.model, batches[0].1.len(), 7).unwrap();
    let mut trace = Trace {
        first_grads: Vec::new(),
        params: Vec::new(),
    };
    for (step, (x, y)) in batches.iter().enumerate() {
        m.set_batch(&be, x, y).unwrap();
        m.forward(&be, Some((3, step as u64))).unwrap();
        m.backward(&be, Some((3, step as u64))).unwrap();
        if step == 0 {
            trace.first_grads = m.params.iter().map(|p| p.grad.clone()).collect();
        }
        m.sgd_step(&be, &sgd()).unwrap();
        trace.params.push(m.download_params(&be, false).unwrap());
    }
    trace
}

/// N replicas on shards of a global batch, gradients averaged by the
/// in-process reducer, against one model on the whole batch: gradients
/// after one step and weights after four steps within 2e-6 (relative L2).
/// Dropout is off (p = 0): rank r > 0 draws its masks from another seed
/// (and each rank indexes its masks from its own first sample), so with
/// dropout the two runs would differ by design. The CPU backend accumulates
/// in f64, so the only differences are the f32 roundings of the per-rank
/// gradient sums and of the mean: about 1e-7. The replicas themselves must
/// hold bit-identical weights.
#[test]
fn replicas_match_one_model() {
    let cfg = tiny_without_dropout();
    let global = 12;
    let batches = random_batches(&cfg, global, 4, 99);
    let single = run_single(&cfg, &batches);
    for (world, bucket) in [(2, 0), (3, DEFAULT_BUCKET_BYTES), (4, 2000)] {
        let ranks = run_replicas(&cfg, world, &batches, bucket);
        for (i, g) in single.first_grads.iter().enumerate() {
            let e = rel_err(&ranks[0].first_grads[i], g);
            assert!(
                e < 2e-6,
                "{world} replicas: gradient {i} rel. error {e:.2e}"
            );
        }
        for (step, want) in single.params.iter().enumerate() {
            for (j, t) in want.iter().enumerate() {
                let (name, w) = (&t.name, &t.data);
                let e = rel_err(&ranks[0].params[step][j].data, w);
                assert!(
                    e < 2e-6,
                    "{world} replicas, step {step}, {name}: rel. error {e:.2e}"
                );
            }
        }
        for r in &ranks[1..] {
            assert_eq!(r.params, ranks[0].params, "{world} replicas drifted apart");
        }
    }
}

/// One replica (world 1: nothing to reduce) is the plain single-model step,
/// bit for bit, with dropout on.
#[test]
fn one_replica_is_the_plain_path_bit_for_bit() {
    let text = include_str!("../../../configs/tiny.json");
    let cfg = Config::from_str(text, "tiny.json").unwrap();
    let batches = random_batches(&cfg, 6, 3, 5);
    let single = run_single(&cfg, &batches);
    let ranks = run_replicas(&cfg, 1, &batches, 0);
    assert_eq!(ranks[0].first_grads, single.first_grads);
    assert_eq!(ranks[0].params, single.params);
}

#[test]
fn buckets_of_a_replica_follow_backward_order() {
    let cfg = tiny_without_dropout();
    let names = |bytes| {
        let mut g = HostReducer::group(1);
        let r = Replica::new(&CpuBackend, &cfg.model, 2, 7, g.pop().unwrap(), bytes).unwrap();
        r.bucket_names()
    };
    let w_b = |l: &str| vec![format!("{l}.weight"), format!("{l}.bias")];
    assert_eq!(
        names(0),
        vec![w_b("fc4"), w_b("fc3"), w_b("conv2"), w_b("conv1")]
    );
    let all: Vec<String> = ["conv1", "conv2", "fc3", "fc4"]
        .into_iter()
        .flat_map(w_b)
        .collect();
    assert_eq!(names(usize::MAX), vec![all]);
    // fc4 is 4·33 floats (528 bytes), fc3 32·257 (32 896 bytes).
    assert_eq!(names(1000).len(), 3);
    // Inside a bucket, parameters keep the model's order.
    assert_eq!(names(1000)[0], [w_b("fc3"), w_b("fc4")].concat());
}

#[test]
fn host_reducer_broadcasts_and_averages() {
    let world = 3;
    let reducers = Arc::new(Mutex::new(
        HostReducer::group(world)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    ));
    let out = on_ranks(world, move |rank| {
        let be = CpuBackend;
        let mut red = reducers.lock().unwrap()[rank].take().unwrap();
        let mut a = vec![rank as f32; 3];
        let mut b = vec![10.0 * rank as f32 + 1.0; 2];
        Reducer::<CpuBackend>::broadcast(&mut red, &be, &mut [&mut a, &mut b])?;
        let bcast = (a.clone(), b.clone());
        let mut g = vec![rank as f32, 2.0 * rank as f32];
        let mut h = vec![1.0 + rank as f32];
        red.start_mean(&be, &mut [&mut g, &mut h])?;
        red.finish(&be)?;
        Ok((bcast, g, h))
    })
    .unwrap();
    for (bcast, g, h) in out {
        assert_eq!(bcast, (vec![0.0; 3], vec![1.0; 2]));
        assert_eq!(g, vec![1.0, 2.0]);
        assert_eq!(h, vec![2.0]);
    }
}

#[test]
fn host_reducer_fails_instead_of_hanging_when_a_peer_is_gone() {
    let mut group = HostReducer::group(2);
    drop(group.pop());
    let mut alone = group.pop().unwrap();
    let mut g = vec![1.0f32];
    let err = alone.start_mean(&CpuBackend, &mut [&mut g]).unwrap_err();
    assert!(err.to_string().contains("another replica stopped"), "{err}");
}

// The hybrid mode: planning, the in-process collectives it adds, and N
// hybrid ranks on the CPU backend against one model on the global batch.

/// configs/tiny.json with `edit` applied to its text.
fn tiny_edited(edit: impl Fn(String) -> String) -> Config {
    let text = edit(include_str!("../../../configs/tiny.json").to_string());
    Config::from_str(&text, "tiny.json (edited)").unwrap()
}

#[test]
fn hybrid_plan_splits_fc_rows() {
    let cfg = tiny_without_dropout();
    let plan = plan_hybrid(&cfg.model, 3).unwrap();
    assert_eq!(plan.first_fc, 7);
    assert_eq!(
        plan.fc_rows,
        vec![
            (7, vec![0..10, 10..21, 21..32]),
            (10, vec![0..1, 1..2, 2..4])
        ]
    );
    let one = plan_hybrid(&cfg.model, 1).unwrap();
    let (layer, rows) = &one.fc_rows[1];
    assert_eq!((*layer, rows.len(), rows[0].clone()), (10, 1, 0..4));
    // An fc8 of 10 outputs over 4 ranks: 2, 3, 2, 3 rows.
    let ten = tiny_edited(|t| {
        t.replace("\"classes\": 4", "\"classes\": 10")
            .replace("\"outputs\": 4,", "\"outputs\": 10,")
    });
    let plan = plan_hybrid(&ten.model, 4).unwrap();
    assert_eq!(plan.fc_rows[1], (10, vec![0..2, 2..5, 5..7, 7..10]));
    // Any world up to the smallest fc layer: every rank gets rows, in
    // order, covering all outputs, sizes within one of each other.
    for world in 1..=10 {
        for (_, rows) in plan_hybrid(&ten.model, world).unwrap().fc_rows {
            assert_eq!(rows.len(), world);
            assert_eq!(rows[0].start, 0);
            for w in rows.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let lens: Vec<usize> = rows.iter().map(|r| r.len()).collect();
            assert!(lens.iter().all(|&l| l >= 1), "{lens:?}");
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }
}

#[test]
fn hybrid_plan_rejects_what_it_cannot_split() {
    let err = |spec: &ModelSpec, world| plan_hybrid(spec, world).unwrap_err().to_string();
    let cfg = tiny_without_dropout();
    assert!(
        err(&cfg.model, 5).contains("layer \"fc4\"'s 4 outputs over 5 GPUs"),
        "{}",
        err(&cfg.model, 5)
    );
    let lrn = tiny_edited(|t| {
        t.replace(
            "{ \"name\": \"relu3\", \"type\": \"relu\" },",
            "{ \"name\": \"relu3\", \"type\": \"relu\" }, { \"name\": \"norm3\", \"type\": \"lrn\", \"size\": 5, \"alpha\": 0.0001, \"beta\": 0.75, \"k\": 2 },",
        )
    });
    assert!(err(&lrn.model, 2).contains("got \"norm3\" (lrn)"));
}

/// The in-process all-gather (unequal parts), all-reduce and
/// reduce-scatter sums, gradient sums and label gather.
#[test]
fn host_reducer_gathers_and_sums() {
    let world = 3;
    let reducers = Arc::new(Mutex::new(
        HostReducer::group(world)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    ));
    let out = on_ranks(world, move |rank| {
        let be = CpuBackend;
        let mut red = reducers.lock().unwrap()[rank].take().unwrap();
        let r = rank as f32;
        // Rank r sends r + 1 values 10r, 10r + 1, ...
        let send: Vec<f32> = (0..=rank).map(|j| 10.0 * r + j as f32).collect();
        let mut all = vec![f32::NAN; 6];
        red.all_gather(&be, &send, &mut all, &[1, 2, 3])?;
        let mut sum = vec![r, 1.0];
        red.all_reduce_sum(&be, &mut [&mut sum])?;
        let mut mine = vec![f32::NAN; 2];
        let scattered: Vec<f32> = (0..6).map(|j| j as f32 * (r + 1.0)).collect();
        red.reduce_scatter_sum(&be, &scattered, &mut mine)?;
        let mut g = vec![r];
        red.start_sum(&be, &mut [&mut g])?;
        red.finish(&be)?;
        let labels = red.all_gather_labels(&be, &[rank as i32, 7])?;
        Ok((all, sum, mine, g, labels))
    })
    .unwrap();
    for (rank, (all, sum, mine, g, labels)) in out.into_iter().enumerate() {
        assert_eq!(all, vec![0.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
        assert_eq!(sum, vec![3.0, 3.0]);
        // Σ_r j·(r + 1) = 6j for j in the rank's block.
        let j = 2 * rank;
        assert_eq!(mine, vec![6.0 * j as f32, 6.0 * (j + 1) as f32]);
        assert_eq!(g, vec![3.0]);
        assert_eq!(labels, vec![0, 7, 1, 7, 2, 7]);
    }
    // One rank: gathers and scatters are copies, sums leave values alone.
    let (be, mut red) = (CpuBackend, HostReducer::group(1).pop().unwrap());
    let mut recv = vec![0.0; 2];
    red.all_gather(&be, &vec![1.0, 2.0], &mut recv, &[2])
        .unwrap();
    assert_eq!(recv, vec![1.0, 2.0]);
    let err = red
        .all_gather(&be, &vec![1.0], &mut recv, &[2])
        .unwrap_err();
    assert!(err.to_string().contains("count"), "{err}");
}

#[test]
fn block_copy_moves_strided_blocks_and_checks_bounds() {
    let be = CpuBackend;
    // Columns 1..3 of a 3×4 matrix into a 3×2 one and back into a zeroed
    // 3×5 at column 2.
    let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let mut cols = vec![f32::NAN; 6];
    let take = crate::backend::BlockCopy {
        rows: 3,
        cols: 2,
        src_offset: 1,
        src_stride: 4,
        dst_offset: 0,
        dst_stride: 2,
    };
    be.copy_block(&take, &src, &mut cols).unwrap();
    assert_eq!(cols, vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    let mut wide = vec![0.0; 15];
    let put = crate::backend::BlockCopy {
        rows: 3,
        cols: 2,
        src_offset: 0,
        src_stride: 2,
        dst_offset: 2,
        dst_stride: 5,
    };
    be.copy_block(&put, &cols, &mut wide).unwrap();
    let want = [0., 0., 1., 2., 0., 0., 0., 5., 6., 0., 0., 0., 9., 10., 0.];
    assert_eq!(wide, want);
    let too_far = crate::backend::BlockCopy {
        dst_offset: 4,
        ..put
    };
    assert!(be.copy_block(&too_far, &cols, &mut wide).is_err());
    let overlapping = crate::backend::BlockCopy {
        dst_stride: 1,
        ..put
    };
    assert!(be.copy_block(&overlapping, &cols, &mut wide).is_err());
}

/// What each hybrid rank reports: the per-sample losses of its own samples
/// at the first step, its parameters' gradients after the first step (fc
/// ones are its slices), and the whole network's parameters after every
/// step (gathered).
struct HybridTrace {
    losses: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
    conv_params: usize,
    params: Vec<Params>,
}

/// `world` hybrid ranks on CPU threads on `batches` (the global batches),
/// initialised from seed 7 like [`run_single`], dropout keyed `(3, step)`.
fn run_hybrid(cfg: &Config, world: usize, batches: &[(Vec<f32>, Vec<i32>)]) -> Vec<HybridTrace> {
    let reducers = Arc::new(Mutex::new(
        HostReducer::group(world)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    ));
    let (spec, batches) = (cfg.model.clone(), batches.to_vec());
    let init = Arc::new(initial_params(&spec, 7).unwrap());
    let global = batches[0].1.len();
    on_ranks(world, move |rank| {
        let be = CpuBackend;
        let reducer = reducers.lock().unwrap()[rank].take().unwrap();
        let mut h = HybridRank::new(&be, &spec, global, &init, reducer, 0)?;
        let sample = spec.input_len();
        let share = split_range(global, world, rank);
        let mut trace = HybridTrace {
            losses: Vec::new(),
            grads: Vec::new(),
            conv_params: h.conv.params.len(),
            params: Vec::new(),
        };
        for (step, (x, y)) in batches.iter().enumerate() {
            h.set_batch(
                &be,
                &x[share.start * sample..share.end * sample],
                &y[share.clone()],
            )?;
            h.compute_gradients(&be, (3, step as u64))?;
            if step == 0 {
                trace.losses = h.read_metrics(&be)?.0;
                trace.grads = h
                    .params()
                    .map(|p| (p.name.clone(), p.grad.clone()))
                    .collect();
            }
            h.sgd_step(&be, &sgd())?;
            trace.params.push(h.download_params(&be, false)?);
        }
        Ok(trace)
    })
    .unwrap()
}

/// The whole network's first-step gradients from the ranks' traces: conv
/// gradients from rank 0 (all ranks hold the same sums), fc gradients as
/// the ranks' slices one after another.
fn whole_grads(ranks: &[HybridTrace]) -> Vec<Vec<f32>> {
    let conv = ranks[0].conv_params;
    (0..ranks[0].grads.len())
        .map(|j| {
            if j < conv {
                ranks[0].grads[j].1.clone()
            } else {
                ranks.iter().flat_map(|r| r.grads[j].1.clone()).collect()
            }
        })
        .collect()
}

/// The first-step losses of one model on the whole batch.
fn single_losses(cfg: &Config, batch: &(Vec<f32>, Vec<i32>)) -> Vec<f32> {
    let be = CpuBackend;
    let mut m = Model::new(&be, &cfg.model, batch.1.len(), 7).unwrap();
    m.set_batch(&be, &batch.0, &batch.1).unwrap();
    m.forward(&be, Some((3, 0))).unwrap();
    m.read_metrics(&be).unwrap().0
}

/// Largest |a − b| / max(|b|, 1e-3) (how far the losses are apart).
fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / (*y as f64).abs().max(1e-3))
        .fold(0.0, f64::max)
}

/// Checks `world` hybrid ranks against one model on the global batch;
/// returns the largest relative L2 error of any gradient or weight.
fn check_hybrid_against_one_model(cfg: &Config, world: usize, steps: usize) -> f64 {
    let global = 12;
    let batches = random_batches(cfg, global, steps, 41);
    let single = run_single(cfg, &batches);
    let ranks = run_hybrid(cfg, world, &batches);
    let losses: Vec<f32> = ranks.iter().flat_map(|r| r.losses.clone()).collect();
    let loss_err = max_rel_diff(&losses, &single_losses(cfg, &batches[0]));
    assert!(
        loss_err < 1e-6,
        "{world} ranks: losses differ by {loss_err:.2e}"
    );
    let mut worst = 0.0f64;
    for (j, (got, want)) in whole_grads(&ranks)
        .iter()
        .zip(&single.first_grads)
        .enumerate()
    {
        let e = rel_err(got, want);
        worst = worst.max(e);
        assert!(e < 2e-6, "{world} ranks: gradient {j} rel. error {e:.2e}");
    }
    for (step, want) in single.params.iter().enumerate() {
        for (j, t) in want.iter().enumerate() {
            let got = &ranks[0].params[step][j];
            assert_eq!((&got.name, &got.shape), (&t.name, &t.shape));
            let e = rel_err(&got.data, &t.data);
            worst = worst.max(e);
            assert!(
                e < 2e-6,
                "{world} ranks, step {step}, {}: rel. error {e:.2e}",
                t.name
            );
        }
    }
    for r in &ranks[1..] {
        assert_eq!(r.params, ranks[0].params, "{world} ranks drifted apart");
    }
    println!(
        "{world} hybrid ranks: losses within {loss_err:.2e}, gradients and weights within {worst:.2e} (relative L2)"
    );
    worst
}

/// N hybrid ranks (conv part on shares of the batch, fc layers split by
/// output rows) against one model on the global batch of 12, dropout off:
/// first-step losses within 1e-6, gradients and weights after each of 3
/// SGD steps within 2e-6 (relative L2). The forward pass computes the same
/// products as one model; the differences are the f32 roundings of the
/// partial sums added over the ranks (the fc input gradients, the conv
/// gradients): about 1e-7. Every rank gathers the same whole weights.
#[test]
fn hybrid_ranks_match_one_model() {
    let cfg = tiny_without_dropout();
    for world in [2, 3, 4] {
        check_hybrid_against_one_model(&cfg, world, 3);
    }
}

/// With dropout on (tiny's dropout follows fc3): the fc part draws its
/// masks for the whole batch from the run's seed, as one model does, so
/// the hybrid mode still matches one model within rounding.
#[test]
fn hybrid_ranks_match_one_model_with_dropout() {
    let cfg = Config::from_str(include_str!("../../../configs/tiny.json"), "tiny.json").unwrap();
    check_hybrid_against_one_model(&cfg, 2, 3);
    check_hybrid_against_one_model(&cfg, 3, 2);
}

/// One hybrid rank is the plain single-model step, bit for bit, with
/// dropout on.
#[test]
fn one_hybrid_rank_is_the_plain_path_bit_for_bit() {
    let cfg = Config::from_str(include_str!("../../../configs/tiny.json"), "tiny.json").unwrap();
    let batches = random_batches(&cfg, 6, 3, 5);
    let single = run_single(&cfg, &batches);
    let rank = run_hybrid(&cfg, 1, &batches).remove(0);
    let grads: Vec<Vec<f32>> = rank.grads.into_iter().map(|g| g.1).collect();
    assert_eq!(grads, single.first_grads);
    assert_eq!(rank.params, single.params);
    assert_eq!(rank.losses, single_losses(&cfg, &batches[0]));
}

/// Whole parameters and momentum gathered from 2 hybrid ranks load into 3
/// hybrid ranks (each takes its rows) and into one model; one more step on
/// the same batch leaves both within rounding of each other.
#[test]
fn hybrid_params_gather_whole_and_load_anywhere() {
    let cfg = tiny_without_dropout();
    let batches = random_batches(&cfg, 6, 3, 17);
    type Saved = (Params, Params);
    let saved: Vec<Saved> = {
        let reducers = Arc::new(Mutex::new(
            HostReducer::group(2)
                .into_iter()
                .map(Some)
                .collect::<Vec<_>>(),
        ));
        let (spec, batches) = (cfg.model.clone(), batches.clone());
        let init = Arc::new(initial_params(&spec, 7).unwrap());
        on_ranks(2, move |rank| {
            let be = CpuBackend;
            let reducer = reducers.lock().unwrap()[rank].take().unwrap();
            let mut h = HybridRank::new(&be, &spec, 6, &init, reducer, 0)?;
            let share = split_range(6, 2, rank);
            let per = spec.input_len();
            for (step, (x, y)) in batches[..2].iter().enumerate() {
                h.set_batch(
                    &be,
                    &x[share.start * per..share.end * per],
                    &y[share.clone()],
                )?;
                h.train_step(&be, (3, step as u64), &sgd())?;
            }
            Ok((
                h.download_params(&be, false)?,
                h.download_params(&be, true)?,
            ))
        })
        .unwrap()
    };
    let (weights, momentum) = saved[0].clone();
    assert_eq!(saved[1], saved[0]);
    let shapes: Vec<(String, Vec<usize>)> = weights
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    assert_eq!(shapes, cfg.model.param_shapes());
    // One model resumes from them...
    let be = CpuBackend;
    let mut m = Model::new(&be, &cfg.model, 6, 1).unwrap();
    m.upload_params(&be, &weights, false).unwrap();
    m.upload_params(&be, &momentum, true).unwrap();
    let (x, y) = &batches[2];
    m.set_batch(&be, x, y).unwrap();
    m.forward(&be, Some((3, 2))).unwrap();
    m.backward(&be, Some((3, 2))).unwrap();
    m.sgd_step(&be, &sgd()).unwrap();
    let want = m.download_params(&be, false).unwrap();
    // ... and so do three hybrid ranks.
    let reducers = Arc::new(Mutex::new(
        HostReducer::group(3)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    ));
    let (spec, batch) = (cfg.model.clone(), batches[2].clone());
    let init = Arc::new(initial_params(&spec, 1).unwrap());
    let got = on_ranks(3, move |rank| {
        let be = CpuBackend;
        let reducer = reducers.lock().unwrap()[rank].take().unwrap();
        let mut h = HybridRank::new(&be, &spec, 6, &init, reducer, 0)?;
        h.upload_params(&be, &weights, false)?;
        h.upload_params(&be, &momentum, true)?;
        let share = split_range(6, 3, rank);
        let per = spec.input_len();
        h.set_batch(
            &be,
            &batch.0[share.start * per..share.end * per],
            &batch.1[share],
        )?;
        h.train_step(&be, (3, 2), &sgd())?;
        h.download_params(&be, false)
    })
    .unwrap();
    for (g, w) in got[0].iter().zip(&want) {
        let e = rel_err(&g.data, &w.data);
        assert!(e < 2e-6, "{}: rel. error {e:.2e}", w.name);
    }
}
