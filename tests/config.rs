//! Config loading through the library API: the shipped configs load with the
//! expected shapes, and every malformed config in `tests/bad-configs/` fails
//! with its expected one-line message.

use std::path::{Path, PathBuf};

use host::backend::{ConvGeom, SgdRule};
use host::config::{
    self, Config, DataSource, FASHION_MNIST_DEFAULT_PATH, LayerKind, LrSchedule, Precision,
};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn load(rel: &str) -> Config {
    let path = repo(rel);
    config::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn out_shape(cfg: &Config, name: &str) -> [usize; 3] {
    cfg.model
        .layer(name)
        .unwrap_or_else(|| panic!("no layer {name}"))
        .out_shape
}

#[test]
fn alexnet_shapes_and_parameters() {
    let cfg = load("configs/alexnet.json");
    let m = &cfg.model;
    assert_eq!(m.input, [3, 224, 224]);
    assert_eq!(m.classes, 1000);
    assert_eq!(out_shape(&cfg, "conv1"), [96, 55, 55]);
    assert_eq!(out_shape(&cfg, "norm1"), [96, 55, 55]);
    assert_eq!(out_shape(&cfg, "pool1"), [96, 27, 27]);
    assert_eq!(out_shape(&cfg, "conv2"), [256, 27, 27]);
    assert_eq!(out_shape(&cfg, "pool2"), [256, 13, 13]);
    assert_eq!(out_shape(&cfg, "conv3"), [384, 13, 13]);
    assert_eq!(out_shape(&cfg, "conv4"), [384, 13, 13]);
    assert_eq!(out_shape(&cfg, "conv5"), [256, 13, 13]);
    assert_eq!(out_shape(&cfg, "pool5"), [256, 6, 6]);
    let fc6 = m.layer("fc6").unwrap();
    assert_eq!(fc6.in_shape, [256, 6, 6]);
    assert_eq!(fc6.in_len(), 9216);
    assert_eq!(out_shape(&cfg, "fc6"), [4096, 1, 1]);
    assert_eq!(out_shape(&cfg, "fc8"), [1000, 1, 1]);
    assert_eq!(m.layers.last().unwrap().kind, LayerKind::Softmax);

    // The 2012 network with its two-GPU groups has 60,965,224 parameters.
    assert_eq!(m.param_count(), 60_965_224);
    let shapes = m.param_shapes();
    assert_eq!(shapes.len(), 16);
    let shape = |n: &str| shapes.iter().find(|(k, _)| k == n).unwrap().1.clone();
    assert_eq!(shape("conv1.weight"), [96, 3, 11, 11]);
    assert_eq!(shape("conv2.weight"), [256, 48, 5, 5]);
    assert_eq!(shape("conv4.weight"), [384, 192, 3, 3]);
    assert_eq!(shape("fc6.weight"), [4096, 9216]);
    assert_eq!(shape("fc8.bias"), [1000]);
    let total: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(total, m.param_count());
    // ≈ 0.72 G multiply-adds per image forward.
    let macs = m.macs() as f64;
    assert!((0.72e9..0.73e9).contains(&macs), "{macs}");
}

#[test]
fn alexnet_follows_the_paper() {
    let cfg = load("configs/alexnet.json");
    for layer in &cfg.model.layers {
        let (std, bias) = match &layer.kind {
            LayerKind::Conv(c) => (c.init_std, c.init_bias),
            LayerKind::Fc(f) => (f.init_std, f.init_bias),
            LayerKind::Lrn(l) => {
                assert_eq!((l.size, l.alpha, l.beta, l.k), (5, 1e-4, 0.75, 2.0));
                continue;
            }
            LayerKind::Dropout(d) => {
                assert_eq!(d.p, 0.5);
                continue;
            }
            _ => continue,
        };
        let ones = ["conv2", "conv4", "conv5", "fc6", "fc7"];
        let expected = if ones.contains(&layer.name.as_str()) {
            1.0
        } else {
            0.0
        };
        assert_eq!(bias, expected, "{}", layer.name);
        assert_eq!(std, 0.01, "{}", layer.name);
    }
    let t = &cfg.train;
    assert_eq!((t.batch_size, t.epochs), (128, 90));
    assert_eq!((t.lr, t.momentum, t.weight_decay), (0.01, 0.9, 5e-4));
    assert_eq!(
        t.lr_schedule,
        LrSchedule::Plateau {
            factor: 0.1,
            patience: 5,
            max_drops: 3
        }
    );
    assert_eq!(t.precision, Precision::Fp32);
    assert!(matches!(cfg.data.source, DataSource::Synthetic { .. }));
    let a = &cfg.data.augment;
    assert_eq!((a.crop, a.flip, a.pca_noise), (Some(224), true, 0.1));
    assert_eq!(a.mean.as_ref().map(Vec::len), Some(3));
}

#[test]
fn geometries_agree_with_the_backend() {
    for rel in [
        "configs/alexnet.json",
        "configs/fashion-mnist.json",
        "configs/tiny.json",
    ] {
        let cfg = load(rel);
        for l in &cfg.model.layers {
            if let Some(g) = l.conv_geom(4) {
                assert_eq!([g.c_out, g.out_h(), g.out_w()], l.out_shape, "{}", l.name);
                assert_eq!(g.w_len() + g.c_out, l.param_count());
                assert_eq!(g.macs(), 4 * l.macs());
            }
            if let Some(g) = l.pool_geom(4) {
                assert_eq!([g.c, g.out_h(), g.out_w()], l.out_shape, "{}", l.name);
            }
            if let Some(g) = l.fc_geom(4) {
                assert_eq!(g.inputs * g.outputs + g.outputs, l.param_count());
            }
            if let Some(p) = l.lrn_params(4) {
                assert_eq!(p.len(), 4 * l.in_len());
            }
        }
    }
    let cfg = load("configs/alexnet.json");
    let conv2 = cfg.model.layer("conv2").unwrap().conv_geom(128).unwrap();
    let expected = ConvGeom {
        n: 128,
        c_in: 96,
        h: 27,
        w: 27,
        c_out: 256,
        k_h: 5,
        k_w: 5,
        stride: 1,
        pad: 2,
        groups: 2,
    };
    assert_eq!(conv2, expected);
}

#[test]
fn fashion_mnist_shapes() {
    let cfg = load("configs/fashion-mnist.json");
    assert_eq!(cfg.model.input, [1, 28, 28]);
    assert_eq!(out_shape(&cfg, "conv1"), [64, 28, 28]);
    assert_eq!(out_shape(&cfg, "pool1"), [64, 13, 13]);
    assert_eq!(out_shape(&cfg, "conv2"), [128, 13, 13]);
    assert_eq!(out_shape(&cfg, "pool2"), [128, 6, 6]);
    assert_eq!(out_shape(&cfg, "conv5"), [128, 6, 6]);
    assert!(cfg.model.layer("pool5").is_none(), "no pool5 at 6×6");
    assert_eq!(cfg.model.layer("fc6").unwrap().in_len(), 128 * 6 * 6);
    assert_eq!(out_shape(&cfg, "fc8"), [10, 1, 1]);
    assert!(matches!(cfg.data.source, DataSource::FashionMnist { .. }));
    let a = &cfg.data.augment;
    assert_eq!((a.crop, a.pad, a.flip), (Some(28), 2, true));
    assert_eq!(cfg.train.epochs, 60);
}

#[test]
fn tiny_shapes() {
    let cfg = load("configs/tiny.json");
    assert_eq!(cfg.model.input, [3, 16, 16]);
    assert_eq!(out_shape(&cfg, "conv1"), [8, 16, 16]);
    assert_eq!(out_shape(&cfg, "pool1"), [8, 8, 8]);
    assert_eq!(out_shape(&cfg, "conv2"), [16, 8, 8]);
    assert_eq!(out_shape(&cfg, "pool2"), [16, 4, 4]);
    assert_eq!(cfg.model.layer("fc3").unwrap().in_len(), 256);
    assert_eq!(out_shape(&cfg, "fc4"), [4, 1, 1]);
    // conv1 8·3·3·3+8, conv2 16·4·3·3+16, fc3 32·256+32, fc4 4·32+4.
    assert_eq!(cfg.model.param_count(), 224 + 592 + 8224 + 132);
    assert_eq!(cfg.train.batch_size, 16);
    assert!(matches!(cfg.data.source, DataSource::Synthetic { .. }));
}

#[test]
fn configs_round_trip_through_json() {
    for rel in [
        "configs/alexnet.json",
        "configs/fashion-mnist.json",
        "configs/tiny.json",
    ] {
        let cfg = load(rel);
        let again = Config::from_str(&cfg.to_json(), &cfg.origin).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again, cfg, "{rel}");
    }
}

const MINIMAL: &str = r#"{
  "model": {
    "input": { "channels": 2, "height": 9, "width": 7 },
    "classes": 3,
    "layers": [
      { "name": "c", "type": "conv", "filters": 4, "size": 3, "init_std": 0.1, "init_bias": 0 },
      { "name": "f", "type": "fc", "outputs": 3, "init_std": 0.1, "init_bias": 0 },
      { "name": "s", "type": "softmax" }
    ]
  },
  "train": {
    "batch_size": 2, "epochs": 1, "lr": 0.1, "momentum": 0, "weight_decay": 0,
    "lr_schedule": { "type": "step", "epochs": [], "factor": 0.5 }
  },
  "data": { "source": { "type": "fashion-mnist" } }
}"#;

#[test]
fn defaults() {
    let cfg = Config::from_str(MINIMAL, "minimal.json").unwrap_or_else(|e| panic!("{e}"));
    let LayerKind::Conv(c) = &cfg.model.layers[0].kind else {
        panic!("not a conv")
    };
    assert_eq!((c.stride, c.pad, c.groups), (1, 0, 1));
    assert_eq!(cfg.model.layers[0].out_shape, [4, 7, 5]);
    assert_eq!(cfg.model.layers[1].in_len(), 4 * 7 * 5);
    let t = &cfg.train;
    assert_eq!(t.sgd_rule, SgdRule::Pytorch);
    assert_eq!(
        (t.eval_every, t.checkpoint_every, t.keep_checkpoints),
        (1, 1, 3)
    );
    assert_eq!(
        (t.seed, t.deterministic, t.precision),
        (0, true, Precision::Fp32)
    );
    let a = &cfg.data.augment;
    assert_eq!((a.crop, a.pad, a.flip, a.pca_noise), (None, 0, false, 0.0));
    assert_eq!(
        cfg.data.source,
        DataSource::FashionMnist {
            path: FASHION_MNIST_DEFAULT_PATH.into()
        }
    );
    assert_eq!(cfg.description, None);
}

#[test]
fn pool_and_conv_sizes_use_the_floor_rule() {
    // 9×7 input, 3×3 pool at stride 2: floor((9-3)/2)+1 = 4, floor((7-3)/2)+1 = 3;
    // then a stride-2 5×5 conv with pad 1: floor((4+2-5)/2)+1 = 1, floor((3+2-5)/2)+1 = 1.
    let text = MINIMAL.replace(
        r#"{ "name": "c", "type": "conv", "filters": 4, "size": 3, "init_std": 0.1, "init_bias": 0 },"#,
        r#"{ "name": "p", "type": "maxpool", "size": 3, "stride": 2 },
      { "name": "c", "type": "conv", "filters": 4, "size": 5, "stride": 2, "pad": 1, "init_std": 0.1, "init_bias": 0 },"#,
    );
    let cfg = Config::from_str(&text, "floor.json").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cfg.model.layers[0].out_shape, [2, 4, 3]);
    assert_eq!(cfg.model.layers[1].out_shape, [4, 1, 1]);
}

/// Every file in `tests/bad-configs/`, the JSON path its error must name and
/// what the message must say. The CLI tests use the same folder.
#[rustfmt::skip]
const BAD: &[(&str, &str, &str)] = &[
    ("batch-not-divisible-by-gpus", "train.batch_size", "16 is not divisible by train.gpus (3)"),
    ("batch-size-zero", "train.batch_size", "must be ≥ 1, got 0"),
    ("channels-not-divisible-by-groups", "model.layers[0].groups", "input channels 3 are not divisible by groups 2"),
    ("classes-mismatch", "model.classes", "5 does not match the 4 outputs of layer \"fc4\""),
    ("conv-stride-zero", "model.layers[4].stride", "must be ≥ 1, got 0"),
    ("conv-window-larger-than-padded-input", "model.layers[4].size", "11×11 window does not fit the 8×8 input padded by 1"),
    ("crop-mismatch", "data.augment.crop", "24 does not match the model input 16×16"),
    ("deterministic-false", "train.deterministic", "false is not offered: every kernel reduces in a fixed order"),
    ("dropout-p-one", "model.layers[9].p", "must be in [0, 1), got 1"),
    ("duplicate-layer-field", "model.layers[0].size", "duplicate field `size`"),
    ("duplicate-layer-names", "model.layers[4].name", "duplicate layer name \"conv1\" (also model.layers[0])"),
    ("empty-file", "", "EOF while parsing a value"),
    ("empty-layers", "model.layers", "must not be empty"),
    ("erase-above-one", "data.augment.erase", "must be in [0, 1], got 1.5"),
    ("filters-not-divisible-by-groups", "model.layers[4].groups", "filters 15 are not divisible by groups 2"),
    ("hybrid-more-gpus-than-fc-outputs", "train.parallel", "hybrid splits layer \"fc4\"'s 4 outputs over the GPUs, but train.gpus is 8"),
    ("invalid-json-syntax", "train", "key must be a string"),
    ("invalid-layer-name", "model.layers[4].name", "\"conv.2\" is not a valid layer name"),
    ("lrn-even-size", "model.layers[2].size", "must be odd"),
    ("mean-wrong-length", "data.augment.mean", "has 2 values but the model input has 3 channels"),
    ("missing-conv-filters", "model.layers[0]", "layer \"conv1\": missing field `filters`"),
    ("missing-layer-name", "model.layers[5]", "missing field `name`"),
    ("missing-softmax", "model.layers[10].type", "the last layer must be softmax"),
    ("missing-train-lr", "train", "missing field `lr`"),
    ("momentum-one", "train.momentum", "must be in [0, 1), got 1"),
    ("negative-lr", "train.lr", "must be > 0, got -0.01"),
    ("negative-pad", "model.layers[0]", "layer \"conv1\": invalid value: integer `-1`, expected usize"),
    ("not-an-object", "", "a config must be a JSON object"),
    ("pool-larger-than-input", "model.layers[6].size", "9×9 window is larger than the 8×8 input"),
    ("softmax-after-conv", "model.layers[7]", "softmax needs a flat input from an fc layer, got 16×4×4"),
    ("softmax-not-last", "model.layers[8].type", "softmax must be the last layer"),
    ("step-epoch-past-end", "train.lr_schedule.epochs[1]", "epoch 6 is never reached"),
    ("step-epochs-not-increasing", "train.lr_schedule.epochs[1]", "must be greater than the one before (4), got 2"),
    ("synthetic-too-many-classes", "data.source.classes", "must be in 1..=4"),
    ("truncated-file", "", "EOF while parsing"),
    ("unknown-data-source", "data.source.type", "unknown variant `imagenet`"),
    ("unknown-field-in-last-layer", "model.layers[11]", "layer \"loss\": unknown field `classes`, a softmax layer has no parameters"),
    ("unknown-layer-field", "model.layers[4]", "layer \"conv2\": unknown field `strides`"),
    ("unknown-layer-type", "model.layers[0]", "layer \"conv1\": unknown variant `convolution`"),
    ("unknown-parallel-mode", "train.parallel", "unknown variant `model`, expected `data` or `hybrid`"),
    ("unknown-precision", "train.precision", "unknown variant `fp16`, expected one of `fp32`, `tf32`, `bf16`"),
    ("unknown-schedule-type", "train.lr_schedule.type", "unknown variant `cosine`"),
    ("unknown-sgd-rule", "train.sgd_rule", "unknown variant `adam`"),
    ("unknown-top-level-field", "comment", "unknown field `comment`"),
    ("unknown-train-field", "train.learning_rate", "unknown field `learning_rate`"),
    ("wrong-type-batch-size", "train.batch_size", "invalid type: string \"16\", expected usize"),
    ("wrong-type-flip", "data.augment.flip", "invalid type: string \"yes\", expected a boolean"),
    ("wrong-type-mean-value", "data.augment.mean[0]", "invalid type: string \"a\""),
    ("zero-input-height", "model.input.height", "must be ≥ 1, got 0"),
    ("zero-std", "data.augment.std[1]", "must be > 0, got 0"),
];

#[test]
fn bad_configs_fail_with_one_line_messages() {
    let dir = repo("tests/bad-configs");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let listed: Vec<String> = BAD.iter().map(|(f, _, _)| format!("{f}.json")).collect();
    assert_eq!(
        files, listed,
        "every bad config needs exactly one row in BAD"
    );
    assert!(BAD.len() >= 15);

    for &(file, path, problem) in BAD {
        let p = dir.join(format!("{file}.json"));
        let err = match config::load(&p) {
            Ok(_) => panic!("{file}.json loaded without error"),
            Err(e) => e,
        };
        let msg = err.to_string();
        assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg}");
        let origin = p.display().to_string();
        assert!(msg.starts_with(&origin), "{file}: {msg}");
        let expected = if path.is_empty() {
            format!(": {problem}")
        } else {
            format!(": {path}: {problem}")
        };
        assert!(
            msg.contains(&expected),
            "{file}: expected {expected:?} in\n{msg}"
        );
        assert_eq!(err.path, path, "{file}: {msg}");
    }
}

/// serde errors carry a line and column, and they point at the value.
#[test]
fn parse_errors_point_at_the_offending_line() {
    let cases = [
        ("wrong-type-batch-size", "\"batch_size\": \"16\""),
        ("unknown-parallel-mode", "\"model\""),
        ("unknown-precision", "\"fp16\""),
        ("missing-conv-filters", "\"name\": \"conv1\""),
        ("unknown-layer-field", "\"strides\""),
        ("unknown-field-in-last-layer", "\"classes\": 4"),
        ("wrong-type-mean-value", "\"a\""),
        ("invalid-json-syntax", ",,"),
        ("duplicate-layer-field", "\"size\": 5"),
    ];
    for (file, snippet) in cases {
        let p = repo(&format!("tests/bad-configs/{file}.json"));
        let text = std::fs::read_to_string(&p).unwrap();
        let err = config::load(&p).unwrap_err();
        let (line, column) = err
            .position
            .unwrap_or_else(|| panic!("{file}: no position"));
        let shown = format!("{}:{line}:{column}: ", p.display());
        assert!(err.to_string().starts_with(&shown), "{err}");
        let text_line = text.lines().nth(line - 1).unwrap();
        assert!(
            text_line.contains(snippet),
            "{file}: line {line} is {text_line:?}"
        );
        assert!(column <= text_line.len(), "{file}: column {column}");
    }
}

#[test]
fn control_characters_stay_escaped() {
    let text = MINIMAL.replace(r#""type": "softmax""#, r#""type": "soft\nmax""#);
    let err = Config::from_str(&text, "nl.json").unwrap_err().to_string();
    assert!(!err.contains('\n'), "{err}");
    assert!(err.contains("unknown variant `soft\\nmax`"), "{err}");

    let text = MINIMAL.replace(r#""name": "f""#, r#""name": "f\r\n""#);
    let err = Config::from_str(&text, "nl.json").unwrap_err().to_string();
    assert!(!err.contains('\n') && !err.contains('\r'), "{err}");
    assert!(err.contains("model.layers[1].name"), "{err}");
}

#[test]
fn unreadable_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let err = config::load(&missing).unwrap_err().to_string();
    assert!(err.starts_with(&missing.display().to_string()), "{err}");
    assert!(err.contains("cannot read the config"), "{err}");
    assert!(!err.contains('\n'));
}

#[test]
fn huge_sizes_are_errors_not_overflows() {
    let text = MINIMAL.replace(
        r#""filters": 4, "size": 3"#,
        r#""filters": 4, "size": 3, "pad": 18446744073709551615"#,
    );
    let err = Config::from_str(&text, "big.json").unwrap_err().to_string();
    assert!(err.contains("model.layers[0].pad"), "{err}");
    let text = MINIMAL.replace(r#""outputs": 3"#, r#""outputs": 9223372036854775807"#);
    let err = Config::from_str(&text, "big.json").unwrap_err().to_string();
    assert!(err.contains("model.layers[1]"), "{err}");
    assert!(err.contains("too large"), "{err}");
}

/// `train.parallel` defaults to data; `"hybrid"` loads for AlexNet on 8
/// GPUs and survives the JSON round trip.
#[test]
fn parallel_mode_loads_and_round_trips() {
    use host::config::Parallel;
    assert_eq!(load("configs/alexnet.json").train.parallel, Parallel::Data);
    let text = std::fs::read_to_string(repo("configs/alexnet.json"))
        .unwrap()
        .replace(
            "\"batch_size\": 128,",
            "\"batch_size\": 128, \"gpus\": 8, \"parallel\": \"hybrid\",",
        );
    let cfg = Config::from_str(&text, "hybrid.json").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((cfg.train.parallel, cfg.train.gpus), (Parallel::Hybrid, 8));
    let again = Config::from_str(&cfg.to_json(), "hybrid.json").unwrap();
    assert_eq!(again, cfg);
}
