//! The `host` binary's subcommands end to end on the CPU backend (runs in
//! CI, no GPU needed): `configs/tiny.json` is trained for one epoch once, and
//! `test`, `predict`, `show-filters` and `prepare` are run on the result and
//! checked against the library (the trainer's own validation numbers, the
//! evaluation loader, a direct ten-view computation). Bad input must give a
//! one-line `error: ...` and a non-zero exit, never a panic.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use host::backend::cpu::CpuBackend;
use host::config::Config;
use host::data::{Dataset, Loader, LoaderConfig, Packed, Split, Synthetic};
use host::model::Model;
use host::report::{self, filter_grid_layout};
use host::train::train_augment;

/// Steps per epoch of `configs/tiny.json` (512 images, batch 16): the run
/// ends with a validation pass on exactly the checkpoint's weights.
const STEPS: &str = "32";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn host(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_host"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `host args` and returns its stdout, failing on a non-zero exit.
fn ok(args: &[&str]) -> String {
    let out = host(args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "host {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

/// Runs `host args`, expecting exit code 1 and exactly one stderr line,
/// `error: ...`, that contains `needle`.
fn one_line_error(args: &[&str], needle: &str) {
    let out = host(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "host {args:?}: {err}");
    assert!(!err.contains("panicked"), "host {args:?} panicked: {err}");
    let lines: Vec<_> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "host {args:?}: expected one line: {err:?}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "host {args:?}: {:?} does not name {needle:?}",
        lines[0]
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The tiny config trained for one epoch, shared by the tests: the run
/// directory and its checkpoint.
struct Trained {
    _dir: tempfile::TempDir,
    run: PathBuf,
    checkpoint: PathBuf,
}

fn trained() -> &'static Trained {
    static TRAINED: OnceLock<Trained> = OnceLock::new();
    TRAINED.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let config = root().join("configs/tiny.json");
        #[rustfmt::skip]
        ok(&["train", s(&config), "--device", "cpu", "--out", s(dir.path()),
             "--max-steps", STEPS, "--quiet"]);
        let run = dir.path().join("tiny");
        let checkpoint = run.join(format!("checkpoints/step-{:08}.safetensors", 32));
        assert!(checkpoint.is_file(), "no checkpoint at {checkpoint:?}");
        Trained {
            _dir: dir,
            run,
            checkpoint,
        }
    })
}

fn tiny_config(trained: &Trained) -> Config {
    let ckpt = host::checkpoint::load(&trained.checkpoint).unwrap();
    Config::from_str(&ckpt.meta.config_json, "stored").unwrap()
}

/// A model for `batch` samples with the checkpoint's weights.
fn model(trained: &Trained, batch: usize) -> Model<CpuBackend> {
    let cfg = tiny_config(trained);
    let ckpt = host::checkpoint::load(&trained.checkpoint).unwrap();
    let mut m = Model::new(&CpuBackend, &cfg.model, batch, 0).unwrap();
    m.upload_params(&CpuBackend, &ckpt.tensors, false).unwrap();
    m
}

/// `host test` output: (images, skipped, [ten-view, centre] × [top-1
/// accuracy, top-1 error, top-5 accuracy, top-5 error]) as fractions.
fn parse_test(out: &str) -> (usize, usize, [[f64; 4]; 2]) {
    let count = |key: &str| -> usize {
        let at = out.find(key).unwrap_or_else(|| panic!("{key:?} in {out}")) + key.len();
        let digits: String = out[at..]
            .chars()
            .skip_while(|c| c.is_whitespace())
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits.parse().unwrap()
    };
    let rates = |prefix: &str| -> [f64; 4] {
        let line = out
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line in {out}"));
        let values: Vec<f64> = line
            .split_whitespace()
            .filter_map(|w| w.strip_suffix('%'))
            .map(|v| v.parse::<f64>().unwrap() / 100.0)
            .collect();
        values.try_into().unwrap()
    };
    (
        count("images evaluated:"),
        count("skipped (unreadable):"),
        [rates("ten views:"), rates("centre crop:")],
    )
}

fn check_rates(r: &[f64; 4]) {
    for v in r {
        assert!((0.0..=1.0).contains(v), "{r:?}");
    }
    assert!((r[0] + r[1] - 1.0).abs() < 1e-3 && (r[2] + r[3] - 1.0).abs() < 1e-3);
    assert!(r[2] >= r[0], "top-5 below top-1: {r:?}");
}

#[test]
fn every_subcommand_has_help() {
    let top = ok(&["--help"]);
    for sub in [
        "train",
        "test",
        "predict",
        "prepare",
        "show-filters",
        "devices",
    ] {
        assert!(top.contains(sub), "`host --help` does not list {sub}");
        let help = ok(&[sub, "--help"]);
        assert!(help.contains("Usage:"), "host {sub} --help: {help}");
    }
}

#[test]
fn ten_view_test_matches_the_trainers_validation() {
    let t = trained();
    let ckpt = s(&t.checkpoint);
    let a = ok(&["test", ckpt, "--device", "cpu", "--quiet"]);
    let (images, skipped, [ten, centre]) = parse_test(&a);
    assert_eq!((images, skipped), (128, 0), "{a}");
    check_rates(&ten);
    check_rates(&centre);
    // The centre crop is what the trainer evaluated at the end of the epoch.
    let records = report::read_metrics(&t.run.join(report::METRICS_FILE)).unwrap();
    let val = records
        .iter()
        .rfind(|r| r.split == report::Split::Val)
        .unwrap();
    assert!(
        (centre[0] - f64::from(val.top1)).abs() < 1e-4,
        "centre-crop top-1 {} but training measured {}",
        centre[0],
        val.top1
    );
    // 128 images in batches of 3 leave a padded partial batch; the numbers
    // must not change.
    let b = ok(&[
        "test",
        ckpt,
        "--device",
        "cpu",
        "--quiet",
        "--batch-size",
        "3",
    ]);
    assert_eq!(parse_test(&a), parse_test(&b), "{a}\n{b}");
}

/// Writes `pixels` (`[3, h, w]` bytes) as a PNG.
fn write_png(path: &Path, pixels: &[u8], h: usize, w: usize) {
    let img = image::RgbImage::from_fn(w as u32, h as u32, |x, y| {
        let at = |c: usize| pixels[(c * h + y as usize) * w + x as usize];
        image::Rgb([at(0), at(1), at(2)])
    });
    img.save(path).unwrap();
}

#[test]
fn predict_matches_the_evaluation_pipeline() {
    let t = trained();
    let cfg = tiny_config(t);
    let dir = tempfile::tempdir().unwrap();
    // The tiny config's own validation images, saved as PNGs.
    let val = Synthetic::new(128, 4, [3, 16, 16], cfg.train.seed, Split::Val).unwrap();
    let mut files = Vec::new();
    for i in 0..3 {
        let host::data::Pixels::U8(px) = val.get(i).unwrap().pixels else {
            panic!("synthetic pixels are bytes")
        };
        let path = dir.path().join(format!("val-{i}.png"));
        write_png(&path, &px, 16, 16);
        files.push(path);
    }
    // Reference: the same images through the evaluation loader.
    let loader = Loader::new(
        std::sync::Arc::new(val),
        LoaderConfig::eval(16, &train_augment(&cfg)).with_workers(0),
    )
    .unwrap();
    let batch = loader.batch(0, 0).unwrap();
    let mut m = model(t, 16);
    m.set_batch(&CpuBackend, &batch.images, &batch.labels)
        .unwrap();
    m.forward(&CpuBackend, None).unwrap();
    let reference = m.read_probs(&CpuBackend).unwrap();

    let mut args = vec!["predict", s(&t.checkpoint), "--device", "cpu", "--top", "3"];
    args.extend(files.iter().map(|f| s(f)));
    let out = ok(&args);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3 * 4, "{out}");
    for (i, block) in lines.chunks(4).enumerate() {
        assert_eq!(block[0], s(&files[i]), "{out}");
        let top: Vec<(f32, &str)> = block[1..]
            .iter()
            .enumerate()
            .map(|(k, l)| {
                let rest = l
                    .trim_start()
                    .strip_prefix(&format!("{}. ", k + 1))
                    .unwrap_or_else(|| panic!("{l:?}"));
                let (p, name) = rest.split_once("  ").unwrap();
                (p.parse().unwrap(), name)
            })
            .collect();
        let sum: f32 = top.iter().map(|t| t.0).sum();
        assert!(sum <= 1.0 + 1e-3, "{out}");
        assert!(top.windows(2).all(|w| w[0].0 >= w[1].0), "{out}");
        let probs = &reference[i * 4..i * 4 + 4];
        for (p, name) in &top {
            let class: usize = name.strip_prefix("pattern-").unwrap().parse().unwrap();
            assert!(
                (p - probs[class]).abs() < 1e-4,
                "{}: predict says {name} {p}, the evaluation loader {}",
                files[i].display(),
                probs[class]
            );
        }
    }
    // All four classes (the default --top 5 is capped): probabilities sum to 1.
    let out = ok(&["predict", s(&t.checkpoint), s(&files[0]), "--device", "cpu"]);
    let sum: f32 = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<f32>().unwrap())
        .sum();
    assert_eq!(out.lines().count(), 5, "{out}");
    assert!((sum - 1.0).abs() < 1e-3, "{out}");
    // Without a dataset to name them, classes are numbered.
    let text = fs::read_to_string(root().join("configs/tiny.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["data"]["source"] = serde_json::json!({"type": "folder", "path": "/nonexistent/data"});
    let config = dir.path().join("nodata.json");
    fs::write(&config, json.to_string()).unwrap();
    #[rustfmt::skip]
    let out = ok(&["predict", s(&t.checkpoint), s(&files[0]), "--device", "cpu",
                   "--config", s(&config), "--top", "2"]);
    let names: Vec<&str> = out.lines().skip(1).map(|l| &l[l.len() - 7..]).collect();
    assert!(names.iter().all(|n| n.starts_with("class ")), "{out}");
}

#[test]
fn show_filters_draws_conv1() {
    let t = trained();
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("conv1.png");
    #[rustfmt::skip]
    ok(&["show-filters", s(&t.checkpoint), "--out", s(&png), "--scale", "5"]);
    // conv1 of tiny.json: 8 filters of 3×3, grid with 1-pixel gaps.
    let (rows, cols) = filter_grid_layout(8);
    let img = image::open(&png).unwrap();
    assert_eq!(
        (img.width() as usize, img.height() as usize),
        ((cols * 3 + cols - 1) * 5, (rows * 3 + rows - 1) * 5)
    );
}

#[test]
fn prepare_reports_skips_and_its_output_feeds_the_ten_view_test() {
    let t = trained();
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("images"), dir.path().join("packed"));
    // 4 classes (the tiny network's), 24×20 images packed at 20×20, so the
    // ten 16×16 views differ.
    for (split, per_class) in [("train", 2), ("val", 5)] {
        for class in 0..4 {
            let d = src.join(split).join(format!("c{class}"));
            fs::create_dir_all(&d).unwrap();
            for i in 0..per_class {
                let px: Vec<u8> = (0..3 * 24 * 20)
                    .map(|j| ((j * (7 + class) + i * 31 + j / 20 * class * 13) % 256) as u8)
                    .collect();
                write_png(&d.join(format!("{i}.png")), &px, 24, 20);
            }
        }
    }
    fs::write(src.join("train/c1/broken.png"), b"not an image at all").unwrap();
    fs::write(src.join("val/c2/notes.txt"), b"ignored").unwrap();
    let out = ok(&["prepare", s(&src), s(&dst), "--side", "20"]);
    assert!(
        out.contains("train: 8 images, val: 20 images, 4 classes"),
        "{out}"
    );
    assert!(out.contains("skipped (could not be decoded): 1"), "{out}");
    assert!(out.contains("broken.png"), "{out}");
    assert!(out.contains("ignored (not .jpeg/.jpg/.png): 1"), "{out}");

    #[rustfmt::skip]
    let out = ok(&["test", s(&t.checkpoint), "--data", s(&dst), "--device", "cpu",
                   "--quiet", "--batch-size", "6"]);
    let (images, skipped, [ten, centre]) = parse_test(&out);
    assert_eq!((images, skipped), (20, 0), "{out}");
    check_rates(&ten);
    check_rates(&centre);
    // Reference: every image's ten views in one forward pass, averaged.
    let cfg = tiny_config(t);
    let data = Packed::open(&dst, Split::Val).unwrap();
    let aug = train_augment(&cfg).without_randomness();
    let mut m = model(t, 10);
    let (mut top1_ten, mut top1_centre) = (0, 0);
    for i in 0..data.len() {
        let sample = data.get(i).unwrap();
        let views = aug.ten_views(&sample, data.image_shape()).unwrap();
        m.set_batch(&CpuBackend, &views, &[sample.label; 10])
            .unwrap();
        m.forward(&CpuBackend, None).unwrap();
        let probs = m.read_probs(&CpuBackend).unwrap();
        let mut mean = [0.0f32; 4];
        for view in probs.chunks_exact(4) {
            for (m, p) in mean.iter_mut().zip(view) {
                *m += p / 10.0;
            }
        }
        let best = |p: &[f32]| (0..4).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap();
        top1_ten += usize::from(best(&mean) == sample.label as usize);
        top1_centre += usize::from(best(&probs[16..20]) == sample.label as usize);
    }
    assert!((ten[0] - top1_ten as f64 / 20.0).abs() < 1e-4, "{out}");
    assert!(
        (centre[0] - top1_centre as f64 / 20.0).abs() < 1e-4,
        "{out}"
    );
}

#[test]
fn bad_input_is_a_one_line_error() {
    let t = trained();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    let m = s(&missing);
    one_line_error(&["test", m, "--device", "cpu"], "missing.safetensors");
    one_line_error(&["predict", m, m, "--device", "cpu"], "missing.safetensors");
    #[rustfmt::skip]
    one_line_error(&["show-filters", m, "--out", s(&dir.path().join("f.png"))], "missing.safetensors");

    let corrupt = dir.path().join("corrupt.png");
    fs::write(&corrupt, b"\x89PNG\r\n\x1a\n garbage").unwrap();
    #[rustfmt::skip]
    one_line_error(&["predict", s(&t.checkpoint), s(&corrupt), "--device", "cpu"], "corrupt.png");

    let file = dir.path().join("plain-file");
    fs::write(&file, b"x").unwrap();
    #[rustfmt::skip]
    one_line_error(&["prepare", s(&file), s(&dir.path().join("out"))], "plain-file");
    #[rustfmt::skip]
    one_line_error(&["test", s(&t.checkpoint), "--data", s(&file), "--device", "cpu"], "plain-file");
    #[rustfmt::skip]
    one_line_error(&["show-filters", s(&t.checkpoint), "--out", s(&dir.path().join("f.png")),
                     "--layer", "fc4"], "fc4.weight");
}

#[test]
fn bench_loader_reports_images_per_second() {
    let config = root().join("configs/tiny.json");
    let json = tempfile::tempdir().unwrap().keep().join("loader.json");
    let out = ok(&[
        "bench",
        config.to_str().unwrap(),
        "--loader",
        "--batch-size",
        "16",
        "--steps",
        "40",
        "--json",
        json.to_str().unwrap(),
    ]);
    // 512 training images make 32 batches of 16: the 40 timed batches run
    // into the second epoch, reported apart; the set is cached.
    assert!(out.contains("loader: 40 batches of 16"), "{out}");
    assert!(out.contains("(kept in memory once made)"), "{out}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for field in [
        "images_per_sec",
        "first_epoch_images_per_sec",
        "later_epochs_images_per_sec",
    ] {
        assert!(rows[0][field].as_f64().unwrap() > 0.0, "{field}: {rows}");
    }
    // --loader measures the data pipeline only: no model options with it.
    let both = host(&["bench", config.to_str().unwrap(), "--loader", "--profile"]);
    assert!(!both.status.success());
}
