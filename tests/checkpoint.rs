//! Checkpoint files and run reports: round trips, durability, retention,
//! error messages, metrics log, plots and the filter grid.

use host::checkpoint::{
    self, Checkpoint, CheckpointDir, CheckpointMeta, NamedTensor, load, save_atomic,
};
use host::report::{
    self, MetricsLog, MetricsRecord, Plotter, Split, Summary, filter_grid_layout, filter_grid_png,
    read_metrics, resolve_resumed,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;
use std::process::Command;

/// A small AlexNet-shaped parameter set, deliberately not in name order.
const LAYERS: &[(&str, &[usize])] = &[
    ("conv1.weight", &[8, 3, 5, 5]),
    ("conv1.bias", &[8]),
    ("conv2.weight", &[16, 4, 3, 3]),
    ("conv2.bias", &[16]),
    ("fc6.weight", &[10, 64]),
    ("fc6.bias", &[10]),
];

fn random_tensor(rng: &mut StdRng, name: &str, shape: &[usize]) -> NamedTensor {
    let n = shape.iter().product();
    let data = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    NamedTensor::new(name, shape.to_vec(), data).unwrap()
}

fn sample_checkpoint(seed: u64, step: u64) -> Checkpoint {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tensors: Vec<NamedTensor> = LAYERS
        .iter()
        .map(|(n, s)| random_tensor(&mut rng, n, s))
        .collect();
    // Values whose bits a lossy path would change.
    tensors[1].data[..6].copy_from_slice(&[
        -0.0,
        f32::MIN_POSITIVE / 2.0,
        f32::from_bits(0x7fc0_1234),
        f32::INFINITY,
        f32::MAX,
        1.0 + f32::EPSILON,
    ]);
    let momentum = LAYERS
        .iter()
        .map(|(n, s)| random_tensor(&mut rng, n, s))
        .collect();
    Checkpoint {
        tensors,
        momentum,
        meta: CheckpointMeta {
            step,
            epoch: 3,
            batch_in_epoch: 17,
            seed,
            rng_state: r#"{"s":[1,2,3,18446744073709551615]}"#.into(),
            config_json: "{\n  \"name\": \"tiny\",\n  \"lr\": 0.01\n}".into(),
            lr: 0.01 * 0.1,
            best_val_top1: Some(0.4321),
            extra: BTreeMap::from([("note".into(), "résumé \"quoted\"\nline".into())]),
        },
    }
}

fn assert_bits_eq(a: &[NamedTensor], b: &[NamedTensor]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.shape, y.shape, "{}", x.name);
        let xb: Vec<u32> = x.data.iter().map(|v| v.to_bits()).collect();
        let yb: Vec<u32> = y.data.iter().map(|v| v.to_bits()).collect();
        assert!(xb == yb, "{}: data differs", x.name);
    }
}

fn assert_one_line_naming(err: &anyhow::Error, path: &Path, needle: &str) {
    let msg = format!("{err:#}");
    assert!(!msg.contains('\n'), "not one line: {msg}");
    assert!(
        msg.contains(&path.display().to_string()),
        "does not name {}: {msg}",
        path.display()
    );
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
}

#[test]
fn round_trip_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let ckpt = sample_checkpoint(7, 1234);
    save_atomic(&path, &ckpt).unwrap();
    let back = load(&path).unwrap();
    assert_bits_eq(&ckpt.tensors, &back.tensors);
    assert_bits_eq(&ckpt.momentum, &back.momentum);
    assert_eq!(ckpt.meta, back.meta);
    assert!(back.meta.lr.to_bits() == ckpt.meta.lr.to_bits());

    // The file itself: PyTorch names, momentum under its suffix, metadata keys.
    let tensors = checkpoint::load_tensors(&path).unwrap();
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort();
    let mut expected: Vec<String> = LAYERS
        .iter()
        .flat_map(|(n, _)| [n.to_string(), format!("{n}.momentum")])
        .collect();
    expected.sort();
    assert_eq!(names, expected);
}

#[test]
fn weights_only_checkpoint_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut ckpt = sample_checkpoint(3, 0);
    ckpt.momentum.clear();
    ckpt.meta = CheckpointMeta::default();
    save_atomic(&path, &ckpt).unwrap();
    let back = load(&path).unwrap();
    assert!(back.momentum.is_empty());
    assert_eq!(back.meta, CheckpointMeta::default());
    assert_bits_eq(&ckpt.tensors, &back.tensors);
}

#[test]
fn atomic_write_leaves_no_tmp_and_survives_stale_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let tmp = checkpoint::tmp_path(&path);
    assert_eq!(tmp, dir.path().join("ckpt.safetensors.tmp"));

    let first = sample_checkpoint(1, 100);
    save_atomic(&path, &first).unwrap();
    assert!(!tmp.exists());

    // An interrupted write: a half-written tmp next to the good checkpoint.
    let good_bytes = fs::read(&path).unwrap();
    fs::write(&tmp, &good_bytes[..good_bytes.len() / 2]).unwrap();
    let still = load(&path).unwrap();
    assert_bits_eq(&first.tensors, &still.tensors);

    // The next save replaces both.
    let second = sample_checkpoint(2, 200);
    save_atomic(&path, &second).unwrap();
    assert!(!tmp.exists());
    let back = load(&path).unwrap();
    assert_eq!(back.meta.step, 200);
    assert_bits_eq(&second.tensors, &back.tensors);
}

#[test]
fn failed_save_keeps_existing_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    save_atomic(&path, &sample_checkpoint(1, 100)).unwrap();
    let before = fs::read(&path).unwrap();

    let mut bad = sample_checkpoint(2, 200);
    bad.tensors[0].data.pop();
    let err = save_atomic(&path, &bad).unwrap_err();
    assert_one_line_naming(&err, &path, "conv1.weight");

    let mut bad = sample_checkpoint(2, 200);
    bad.momentum[2].shape = vec![16, 36];
    let err = save_atomic(&path, &bad).unwrap_err();
    assert_one_line_naming(&err, &path, "momentum for conv2.weight");

    let mut bad = sample_checkpoint(2, 200);
    bad.meta.lr = f32::NAN;
    assert!(save_atomic(&path, &bad).is_err());

    assert_eq!(fs::read(&path).unwrap(), before);
    assert!(!checkpoint::tmp_path(&path).exists());
}

#[test]
fn checkpoint_dir_keeps_last_k() {
    let dir = tempfile::tempdir().unwrap();
    let ckdir = CheckpointDir::new(dir.path().join("ckpts"), 3).unwrap();
    for step in (100..=700).step_by(100) {
        let path = ckdir.save(&sample_checkpoint(step, step)).unwrap();
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            format!("step-{step:08}.safetensors")
        );
    }
    let steps: Vec<u64> = ckdir.list().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [500, 600, 700]);
    let latest = ckdir.latest().unwrap().unwrap();
    assert_eq!(latest, ckdir.path_for(700));
    assert_eq!(load(&latest).unwrap().meta.step, 700);
    let pointer = fs::read_to_string(ckdir.dir.join("latest")).unwrap();
    assert_eq!(pointer.trim(), "step-00000700.safetensors");

    let mut files: Vec<String> = fs::read_dir(&ckdir.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "latest",
            "step-00000500.safetensors",
            "step-00000600.safetensors",
            "step-00000700.safetensors"
        ]
    );
}

#[test]
fn checkpoint_dir_latest_follows_pointer_after_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let ckdir = CheckpointDir::new(dir.path(), 1).unwrap();
    ckdir.save(&sample_checkpoint(1, 1000)).unwrap();
    ckdir.save(&sample_checkpoint(1, 2000)).unwrap();
    assert_eq!(ckdir.list().unwrap().len(), 1);
    // Resumed from an earlier point: step 1500 is newer than step 2000.
    ckdir.save(&sample_checkpoint(1, 1500)).unwrap();
    assert_eq!(ckdir.latest().unwrap().unwrap(), ckdir.path_for(1500));
    // Pruning never removes the pointed-to checkpoint.
    assert!(ckdir.path_for(1500).exists());

    // Without a pointer, the highest step wins; a stale tmp is cleaned up.
    fs::remove_file(dir.path().join("latest")).unwrap();
    assert_eq!(
        checkpoint::latest(dir.path()).unwrap().unwrap(),
        ckdir.path_for(2000)
    );
    let stale = dir.path().join("step-00009999.safetensors.tmp");
    fs::write(&stale, b"partial").unwrap();
    ckdir.save(&sample_checkpoint(1, 1600)).unwrap();
    assert!(!stale.exists());

    assert_eq!(
        checkpoint::latest(&dir.path().join("absent")).unwrap(),
        None
    );
    assert!(CheckpointDir::new(dir.path(), 0).is_err());
}

#[test]
fn bad_files_give_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    assert_one_line_naming(&load(&missing).unwrap_err(), &missing, "cannot read");

    let garbage = dir.path().join("garbage.safetensors");
    fs::write(&garbage, b"this is not a safetensors file at all").unwrap();
    assert_one_line_naming(&load(&garbage).unwrap_err(), &garbage, "not a safetensors");

    let empty = dir.path().join("empty.safetensors");
    fs::write(&empty, b"").unwrap();
    assert_one_line_naming(&load(&empty).unwrap_err(), &empty, "not a safetensors");

    let truncated = dir.path().join("truncated.safetensors");
    save_atomic(&truncated, &sample_checkpoint(1, 1)).unwrap();
    let bytes = fs::read(&truncated).unwrap();
    fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    assert_one_line_naming(
        &load(&truncated).unwrap_err(),
        &truncated,
        "not a safetensors",
    );

    // A valid safetensors file without our metadata (e.g. a PyTorch export).
    let plain = dir.path().join("plain.safetensors");
    let data = [1.0f32, 2.0];
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![2],
        bytemuck::cast_slice(&data),
    )
    .unwrap();
    fs::write(
        &plain,
        safetensors::serialize([("fc8.bias", view)], None).unwrap(),
    )
    .unwrap();
    assert_one_line_naming(&load(&plain).unwrap_err(), &plain, "alexnet.meta");
    let loose = checkpoint::load_tensors(&plain).unwrap();
    assert_eq!(loose[0].data, data);

    // Our metadata but an f16 tensor.
    let half = dir.path().join("half.safetensors");
    let ok = dir.path().join("ok.safetensors");
    save_atomic(&ok, &sample_checkpoint(1, 1)).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&fs::read(&ok).unwrap()).unwrap();
    let f16 = [0u8; 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![2], &f16).unwrap();
    let meta: HashMap<String, String> = header.metadata().clone().unwrap();
    fs::write(
        &half,
        safetensors::serialize([("fc8.bias", view)], Some(meta)).unwrap(),
    )
    .unwrap();
    assert_one_line_naming(&load(&half).unwrap_err(), &half, "dtype F16");
}

#[test]
fn validate_reports_shape_mismatch() {
    let ckpt = Checkpoint {
        tensors: vec![
            NamedTensor::new(
                "conv2.weight",
                vec![256, 48, 5, 5],
                vec![0.0; 256 * 48 * 25],
            )
            .unwrap(),
            NamedTensor::new("conv2.bias", vec![256], vec![0.0; 256]).unwrap(),
        ],
        ..Default::default()
    };
    let path = Path::new("ckpt.safetensors");
    let err = ckpt
        .validate(
            path,
            [
                ("conv2.weight", &[256, 96, 5, 5][..]),
                ("conv2.bias", &[256]),
            ],
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt.safetensors: conv2.weight has shape [256, 48, 5, 5], model expects [256, 96, 5, 5]"
    );

    let expected: Vec<(String, Vec<usize>)> = vec![
        ("conv2.weight".into(), vec![256, 48, 5, 5]),
        ("conv2.bias".into(), vec![256]),
    ];
    ckpt.validate(path, expected.iter().map(|(n, s)| (n, s)))
        .unwrap();

    let err = ckpt
        .validate(
            path,
            [
                ("conv2.weight", &[256, 48, 5, 5][..]),
                ("conv3.weight", &[384, 256, 3, 3]),
            ],
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt.safetensors: missing conv3.weight (model expects [384, 256, 3, 3]) (and 1 more mismatches)"
    );

    // Momentum, when present, must cover every parameter.
    let mut with_momentum = sample_checkpoint(1, 1);
    with_momentum.momentum.pop();
    let err = with_momentum
        .validate(path, LAYERS.iter().copied())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt.safetensors: momentum for fc6.bias missing"
    );
}

fn record(step: u64, split: Split, loss: f32, top1: f32) -> MetricsRecord {
    MetricsRecord {
        step,
        epoch: step as f64 / 100.0,
        split,
        loss,
        top1,
        top5: (top1 * 1.5).min(1.0),
        lr: 0.01,
        images_per_sec: 1000.0 + step as f32,
        time_s: step as f64 * 0.5,
    }
}

/// A plausible run: falling loss, rising accuracy, a validation per epoch.
fn sample_run() -> Vec<MetricsRecord> {
    let mut records = Vec::new();
    for step in (10..=500).step_by(10) {
        let t = step as f32 / 500.0;
        records.push(record(step, Split::Train, 6.9 * (1.0 - 0.7 * t), 0.6 * t));
        if step % 100 == 0 {
            records.push(record(step, Split::Val, 6.9 * (1.0 - 0.6 * t), 0.5 * t));
        }
    }
    records
}

#[test]
fn metrics_lines_parse_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut records = sample_run();
    records[3].loss = f32::NAN;
    {
        let mut log = MetricsLog::open(dir.path()).unwrap();
        for r in &records {
            log.append(r).unwrap();
        }
        assert_eq!(log.path(), dir.path().join("metrics.jsonl"));
    }
    let text = fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), records.len());
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in [
            "step",
            "epoch",
            "split",
            "loss",
            "top1",
            "top5",
            "lr",
            "images_per_sec",
            "time_s",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {line}");
        }
        assert!(matches!(v["split"].as_str(), Some("train" | "val")));
    }

    let back = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    assert!(back[3].loss.is_nan());
    let mut expected = records.clone();
    expected[3].loss = 0.0;
    let mut got = back.clone();
    got[3].loss = 0.0;
    assert_eq!(got, expected);

    // A crash mid-line: reopening starts a fresh line, the fragment is skipped.
    let path = dir.path().join("metrics.jsonl");
    let mut bytes = fs::read(&path).unwrap();
    bytes.extend_from_slice(b"{\"step\":99");
    fs::write(&path, &bytes).unwrap();
    let extra = record(510, Split::Train, 1.0, 0.5);
    MetricsLog::open(dir.path())
        .unwrap()
        .append(&extra)
        .unwrap();
    let back = read_metrics(&path).unwrap();
    assert_eq!(back.len(), records.len() + 1);
    assert_eq!(back.last(), Some(&extra));
}

#[test]
fn resumed_stretch_is_replaced() {
    let mut records = sample_run();
    let resume_at = 350;
    records.extend(
        (resume_at + 10..=400)
            .step_by(10)
            .map(|s| record(s, Split::Train, 0.123, 0.9)),
    );
    records.push(record(400, Split::Val, 0.456, 0.8));
    let resolved = resolve_resumed(records);
    let train: Vec<u64> = resolved
        .iter()
        .filter(|r| r.split == Split::Train)
        .map(|r| r.step)
        .collect();
    let expected: Vec<u64> = (10..=400).step_by(10).collect();
    assert_eq!(train, expected);
    assert!(
        resolved
            .iter()
            .filter(|r| r.step > resume_at)
            .all(|r| r.loss == 0.123 || r.loss == 0.456)
    );
    let val: Vec<u64> = resolved
        .iter()
        .filter(|r| r.split == Split::Val)
        .map(|r| r.step)
        .collect();
    assert_eq!(val, [100, 200, 300, 400]);
}

/// Pixels close to `rgb`.
fn count_color(img: &image::RgbImage, rgb: [u8; 3]) -> usize {
    img.pixels()
        .filter(|p| p.0.iter().zip(rgb).all(|(&a, b)| a.abs_diff(b) < 12))
        .count()
}

#[test]
fn plots_are_pngs_of_the_configured_size() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = MetricsLog::open(dir.path()).unwrap();
    for r in sample_run() {
        log.append(&r).unwrap();
    }
    let files = report::plot_curves(dir.path()).unwrap();
    let default = Plotter::default();
    assert!(default.text, "embedded font did not register");
    let mut dark_with_text = 0;
    for path in [&files.loss, &files.accuracy] {
        assert_eq!(&fs::read(path).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
        let img = image::open(path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (default.width, default.height));
        assert!(
            count_color(&img, [31, 119, 180]) > 200,
            "{path:?}: no train line"
        );
        assert!(
            count_color(&img, [214, 39, 40]) > 50,
            "{path:?}: no val line"
        );
        dark_with_text += count_color(&img, [0, 0, 0]);
    }

    // Without text: same size, still lines, fewer black (glyph) pixels.
    let bare = Plotter {
        width: 640,
        height: 400,
        text: false,
    };
    let files = bare.plot(dir.path()).unwrap();
    let mut dark_without = 0;
    for path in [&files.loss, &files.accuracy] {
        let img = image::open(path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (640, 400));
        assert!(count_color(&img, [31, 119, 180]) > 100);
        dark_without += count_color(&img, [0, 0, 0]);
    }
    assert!(dark_with_text > dark_without);

    // Degenerate input draws instead of failing; bad settings are errors.
    let empty = tempfile::tempdir().unwrap();
    MetricsLog::open(empty.path()).unwrap();
    report::plot_curves(empty.path()).unwrap();
    let err = report::plot_curves(&empty.path().join("none")).unwrap_err();
    assert!(err.to_string().contains("metrics.jsonl"));
    let tiny = Plotter {
        width: 0,
        height: 0,
        text: false,
    };
    assert!(tiny.plot(dir.path()).is_err());
}

#[test]
fn filter_grid_has_expected_layout_and_pixels() {
    assert_eq!(filter_grid_layout(96), (8, 12));
    assert_eq!(filter_grid_layout(64), (8, 8));
    assert_eq!(filter_grid_layout(7), (3, 3));
    assert_eq!(filter_grid_layout(1), (1, 1));

    let (out, kh, kw, scale) = (96, 11, 11, 3);
    let mut rng = StdRng::seed_from_u64(5);
    let mut w: Vec<f32> = (0..out * 3 * kh * kw)
        .map(|_| rng.random_range(-0.5f32..0.5))
        .collect();
    // Filter 1, pixel (0, 0): R at its max, G at its min, B half-way.
    let base = 3 * kh * kw;
    let (lo, hi) = (-2.0, 4.0);
    w[base] = hi;
    w[base + kh * kw] = lo;
    w[base + 2 * kh * kw] = 1.0;
    // Filter 2 constant: mid-grey.
    w[2 * base..3 * base].fill(0.25);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("conv1.png");
    let (width, height) = filter_grid_png(&w, [out, 3, kh, kw], &path, scale).unwrap();
    assert_eq!((width, height), ((12 * 11 + 11) * 3, (8 * 11 + 7) * 3));
    let img = image::open(&path).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), (width, height));

    let px = |x: usize, y: usize| img.get_pixel(x as u32, y as u32).0;
    let s = scale as usize;
    let filter1_x = (kw + 1) * s;
    for dy in 0..s {
        for dx in 0..s {
            assert_eq!(px(filter1_x + dx, dy), [255, 0, 128]);
        }
    }
    assert_eq!(px(2 * (kw + 1) * s + 4, 5), [128, 128, 128]);
    // Gap column between filters 0 and 1, and gap row under row 0.
    assert_eq!(px(kw * s, 0), [255, 255, 255]);
    assert_eq!(px(0, kh * s + 1), [255, 255, 255]);

    assert!(filter_grid_png(&w[1..], [out, 3, kh, kw], &path, 1).is_err());
    assert!(filter_grid_png(&w, [out, 3, kh, kw], &path, 0).is_err());
    assert!(filter_grid_png(&w, [out / 2, 6, kh, kw], &path, 1).is_err());
}

#[test]
fn summary_reports_best_and_final() {
    let records = sample_run();
    let mut s = Summary::from_metrics(&records);
    let last_val = records
        .iter()
        .rev()
        .find(|r| r.split == Split::Val)
        .unwrap();
    assert_eq!(s.best_val_top1, Some((last_val.top1, last_val.epoch)));
    assert_eq!(s.best_val_top5, Some(last_val.top5));
    assert_eq!(s.final_val_loss, Some(last_val.loss));
    assert_eq!(s.steps, 500);
    assert_eq!(s.wall_time_s, 250.0);
    s.checkpoint = Some("runs/x/step-00000500.safetensors".into());
    let text = s.to_string();
    assert!(
        text.contains(&format!("{:.2}%", last_val.top1 * 100.0)),
        "{text}"
    );
    assert!(text.contains("4m 10s"), "{text}");
    assert!(text.contains("step-00000500.safetensors"), "{text}");
    assert!(text.lines().count() <= 24, "more than one screen:\n{text}");
    let widths: Vec<usize> = text.lines().map(|l| l.chars().count()).collect();
    assert!(
        widths.iter().all(|&w| w == widths[0]),
        "ragged table:\n{text}"
    );
}

/// Loads a checkpoint with Python's `safetensors.numpy` (what PyTorch users
/// would run, minus torch) and compares names, shapes, dtypes and values.
#[test]
fn python_safetensors_reads_checkpoint() {
    let probe = Command::new("python3")
        .args(["-c", "import safetensors.numpy, numpy"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("skipped: python safetensors not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let mut ckpt = sample_checkpoint(11, 42);
    // JSON has no NaN/inf; keep the values Python echoes back finite.
    ckpt.tensors[1].data[2] = 0.5;
    ckpt.tensors[1].data[3] = -0.25;
    save_atomic(&path, &ckpt).unwrap();

    let script = r#"
import json, sys
from safetensors import safe_open
from safetensors.numpy import load_file
d = load_file(sys.argv[1])
params = {k: v for k, v in d.items() if not k.endswith(".momentum")}
with safe_open(sys.argv[1], framework="numpy") as f:
    meta = f.metadata()
print(json.dumps({
    "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                    "values": v.ravel().tolist()} for k, v in d.items()},
    "params": sorted(params),
    "meta": meta,
}))
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    let check = |file_name: &str, t: &NamedTensor| {
        let e = &v["tensors"][file_name];
        assert_eq!(e["dtype"], "float32", "{file_name}");
        let shape: Vec<usize> = serde_json::from_value(e["shape"].clone()).unwrap();
        assert_eq!(shape, t.shape, "{file_name}");
        let values: Vec<f64> = serde_json::from_value(e["values"].clone()).unwrap();
        let values: Vec<u32> = values.iter().map(|&x| (x as f32).to_bits()).collect();
        let want: Vec<u32> = t.data.iter().map(|x| x.to_bits()).collect();
        assert!(values == want, "{file_name}: values differ");
    };
    for t in &ckpt.tensors {
        check(&t.name, t);
    }
    for m in &ckpt.momentum {
        check(&format!("{}.momentum", m.name), m);
    }
    assert_eq!(
        v["tensors"].as_object().unwrap().len(),
        ckpt.tensors.len() + ckpt.momentum.len()
    );
    let mut params: Vec<&str> = LAYERS.iter().map(|(n, _)| *n).collect();
    params.sort();
    assert_eq!(v["params"], serde_json::json!(params));
    assert_eq!(v["meta"]["format"], "pt");
    assert_eq!(v["meta"]["alexnet.config"], ckpt.meta.config_json.as_str());
    let meta: serde_json::Value =
        serde_json::from_str(v["meta"]["alexnet.meta"].as_str().unwrap()).unwrap();
    assert_eq!(meta["step"], 42);
    assert_eq!(meta["batch_in_epoch"], 17);
}
