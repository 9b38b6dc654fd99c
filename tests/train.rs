//! End-to-end training on the CPU backend (runs in CI, no GPU needed): the
//! tiny config learns, an interrupted-and-resumed run ends bit-identical to an
//! uninterrupted one, and bad input gives a one-line error from the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use host::checkpoint;
use host::report::{Split, read_metrics};
use host::train::{DeviceChoice, TrainOptions, train};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn tiny() -> host::config::Config {
    host::config::load(&root().join("configs/tiny.json")).unwrap()
}

fn opts(out: &Path) -> TrainOptions {
    TrainOptions {
        device: DeviceChoice::Cpu,
        out: out.to_path_buf(),
        progress: false,
        log_every: 8,
        ..Default::default()
    }
}

#[test]
fn tiny_config_loss_falls_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = train(tiny(), &opts(dir.path())).unwrap();
    let records = read_metrics(&outcome.run_dir.join("metrics.jsonl")).unwrap();
    let train: Vec<_> = records.iter().filter(|r| r.split == Split::Train).collect();
    let (first, last) = (train.first().unwrap().loss, train.last().unwrap().loss);
    println!("train loss {first} -> {last} over {} steps", outcome.steps);
    assert!(
        last < 0.5 * first,
        "loss did not fall clearly: {first} -> {last}"
    );
    let val_top1 = records
        .iter()
        .filter(|r| r.split == Split::Val)
        .map(|r| r.top1)
        .fold(0.0, f32::max);
    assert!(val_top1 > 0.6, "validation top-1 only {val_top1}");
    assert!(
        outcome.run_dir.join("loss.png").is_file()
            && outcome.run_dir.join("accuracy.png").is_file()
    );
}

#[test]
fn interrupted_and_resumed_run_equals_uninterrupted() {
    let mut cfg = tiny();
    cfg.train.epochs = 2;
    let a = tempfile::tempdir().unwrap();
    let full = train(cfg.clone(), &opts(a.path())).unwrap();
    let b = tempfile::tempdir().unwrap();
    // Stop mid-epoch (32 steps per epoch), then resume to the end.
    let part = train(
        cfg.clone(),
        &TrainOptions {
            max_steps: Some(37),
            ..opts(b.path())
        },
    )
    .unwrap();
    assert!(part.interrupted && part.steps == 37);
    let resumed = train(
        cfg,
        &TrainOptions {
            resume: part.last_checkpoint.clone(),
            ..opts(b.path())
        },
    )
    .unwrap();
    assert_eq!(resumed.steps, full.steps);
    let x = checkpoint::load(full.last_checkpoint.as_ref().unwrap()).unwrap();
    let y = checkpoint::load(resumed.last_checkpoint.as_ref().unwrap()).unwrap();
    assert_eq!(x.tensors.len(), y.tensors.len());
    for (p, q) in x.tensors.iter().zip(&y.tensors) {
        assert_eq!(p.name, q.name);
        let same = p
            .data
            .iter()
            .zip(&q.data)
            .all(|(u, v)| u.to_bits() == v.to_bits());
        assert!(same, "{} differs after resume", p.name);
    }
    for (p, q) in x.momentum.iter().zip(&y.momentum) {
        assert!(
            p.data
                .iter()
                .zip(&q.data)
                .all(|(u, v)| u.to_bits() == v.to_bits()),
            "{} momentum differs",
            p.name
        );
    }
}

/// Runs the `host` binary; returns (exit code, stderr).
fn host(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_one_line_error(args: &[&str], needle: &str) {
    let (code, err) = host(args);
    assert_ne!(code, 0, "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let lines: Vec<_> = err.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err:?}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{args:?}: {:?} lacks {needle:?}",
        lines[0]
    );
}

#[test]
fn every_bad_config_is_a_one_line_error_from_the_binary() {
    let dir = root().join("tests/bad-configs");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 15, "only {} bad configs", files.len());
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        assert_one_line_error(
            &[
                "train",
                f.to_str().unwrap(),
                "--device",
                "cpu",
                "--out",
                "/nonexistent-never-used",
            ],
            &name,
        );
    }
}

#[test]
fn missing_inputs_are_one_line_errors() {
    let tiny = root().join("configs/tiny.json");
    let tiny = tiny.to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let out = out.path().to_str().unwrap();
    assert_one_line_error(&["train", "no/such/config.json"], "no/such/config.json");
    assert_one_line_error(
        &[
            "train",
            tiny,
            "--device",
            "cpu",
            "--out",
            out,
            "--data",
            "/no/such/dir",
        ],
        "/no/such/dir",
    );
    let junk = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(junk.path(), b"not a checkpoint").unwrap();
    let junk = junk.path().to_str().unwrap();
    assert_one_line_error(
        &[
            "train", tiny, "--device", "cpu", "--out", out, "--resume", junk, "--quiet",
        ],
        junk,
    );
    assert_one_line_error(
        &[
            "train",
            tiny,
            "--device",
            "cpu",
            "--out",
            out,
            "--batch-size",
            "0",
        ],
        "--batch-size",
    );
}

#[test]
fn checkpoint_uses_pytorch_names_and_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny();
    let out = train(
        cfg.clone(),
        &TrainOptions {
            max_steps: Some(3),
            ..opts(dir.path())
        },
    )
    .unwrap();
    let ck = checkpoint::load(out.last_checkpoint.as_ref().unwrap()).unwrap();
    let got: Vec<_> = ck
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    assert_eq!(got, cfg.model.param_shapes());
    // conv2 has groups 2: [out, in/groups, kh, kw]; fc3 flattens (C, H, W).
    assert!(got.contains(&("conv2.weight".to_string(), vec![16, 4, 3, 3])));
    assert!(got.contains(&("fc3.weight".to_string(), vec![32, 16 * 4 * 4])));
    assert_eq!(ck.momentum.len(), ck.tensors.len());
    assert_eq!(ck.meta.step, 3);
    let again = host::config::Config::from_str(&ck.meta.config_json, "checkpoint").unwrap();
    assert_eq!(again.model, cfg.model);
}
