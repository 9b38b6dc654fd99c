//! Kernel benchmarks on AlexNet's layer shapes at batch 128 (override with
//! `ALEXNET_BENCH_BATCH`): each kernel's median time over many launches,
//! timed with CUDA events after warm-up, with GFLOP/s for the products and
//! GB/s (minimal bytes: every input read once, every output written once) for
//! the memory-bound kernels, each also as a fraction of the H200's ceiling
//! (dense fp32 67, TF32 495, bf16 989 TFLOP/s; 4.3 TB/s measured copy
//! bandwidth — other GPUs differ). Prints a table and writes JSON to
//! `ALEXNET_BENCH_JSON` (default `target/kernel-bench.json`).
//! The conv products run the kernels the training step's autotune picks for
//! each shape (TF32, bf16; printed as `autotune:` lines).
//! Arguments filter by substring of the kernel or the case (`a&b`: both
//! substrings, e.g. `conv_backward_filter&bf16`). Without a GPU it says so
//! and exits 0.

use anyhow::Result;
use host::backend::cuda::{CudaBackend, Elem, unavailable_reason};
use host::backend::*;
use host::config::Precision;

/// H200 ceilings: dense FLOP/s of the products per precision suffix, and the
/// measured device-to-device copy bandwidth, in GFLOP/s and GB/s.
fn ceiling_gflops(suffix: &str) -> f64 {
    match suffix {
        " tf32" => 495e3,
        " bf16" => 989e3,
        _ => 67e3,
    }
}
const COPY_GBPS: f64 = 4300.0;

struct Row {
    kernel: &'static str,
    case: String,
    median_ms: f64,
    min_ms: f64,
    gflops: Option<f64>,
    gbps: Option<f64>,
    /// Fraction of the matching ceiling (FLOP/s or bandwidth).
    fraction: Option<f64>,
}

struct Bench {
    be: CudaBackend,
    /// Suffix of the case names: the precision of the conv/fc products
    /// ("", " tf32" or " bf16").
    suffix: &'static str,
    rows: Vec<Row>,
    filters: Vec<String>,
}

impl Bench {
    /// Whether a filter matches the kernel or the case name with its
    /// precision suffix (`kernels "conv2 bf16"`).
    fn wanted(&self, kernel: &str, case: &str) -> bool {
        let case = format!("{case}{}", self.suffix);
        let part = |p: &str| kernel.contains(p) || case.contains(p);
        self.filters.is_empty() || self.filters.iter().any(|f| f.split('&').all(part))
    }

    /// Times `f`; `flops` and `bytes` per call give the rates.
    fn run(
        &mut self,
        kernel: &'static str,
        case: &str,
        flops: f64,
        bytes: f64,
        mut f: impl FnMut(&CudaBackend) -> Result<()>,
    ) -> Result<()> {
        if !self.wanted(kernel, case) {
            return Ok(());
        }
        let be = &self.be;
        // Kernels slower than 20 ms get 5 timed runs instead of 40.
        let once = be.time_events(1, 1, || f(be))?[0];
        let reps = if once > 20.0 { 5 } else { 40 };
        let mut t = be.time_events(4, reps, || f(be))?;
        t.sort_by(f32::total_cmp);
        let median = t[t.len() / 2] as f64;
        let gflops = (flops > 0.0).then(|| flops / median / 1e6);
        let gbps = (bytes > 0.0).then(|| bytes / median / 1e6);
        let row = Row {
            kernel,
            case: format!("{case}{}", self.suffix),
            median_ms: median,
            min_ms: t[0] as f64,
            gflops,
            gbps,
            fraction: gflops
                .map(|g| g / ceiling_gflops(self.suffix))
                .or(gbps.map(|b| b / COPY_GBPS)),
        };
        println!(
            "{:<22} {:<26} {:>9.3} ms {:>11} {:>10} {:>6}",
            row.kernel,
            row.case,
            row.median_ms,
            row.gflops
                .map(|v| format!("{v:.0} GF/s"))
                .unwrap_or_default(),
            row.gbps.map(|v| format!("{v:.0} GB/s")).unwrap_or_default(),
            row.fraction
                .map(|f| format!("{:.1}%", f * 100.0))
                .unwrap_or_default()
        );
        self.rows.push(row);
        Ok(())
    }
}

fn main() -> Result<()> {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if let Some(why) = unavailable_reason() {
        println!("kernel benchmarks SKIPPED, not run: {why}");
        return Ok(());
    }
    let n: usize = std::env::var("ALEXNET_BENCH_BATCH")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let be = CudaBackend::new(0)?;
    println!(
        "kernel benchmarks on {}, batch {n}, median of 40 (5 for kernels over 20 ms) after 5 warm-up\n",
        be.name()
    );
    let mut b = Bench {
        be,
        suffix: "",
        rows: vec![],
        filters,
    };

    let conv = |c_in, h, c_out, k, stride, pad, groups| ConvGeom {
        n,
        c_in,
        h,
        w: h,
        c_out,
        k_h: k,
        k_w: k,
        stride,
        pad,
        groups,
    };
    let convs = [
        ("conv1", conv(3, 224, 96, 11, 4, 2, 1)),
        ("conv2", conv(96, 27, 256, 5, 1, 2, 2)),
        ("conv3", conv(256, 13, 384, 3, 1, 1, 1)),
        ("conv4", conv(384, 13, 384, 3, 1, 1, 2)),
        ("conv5", conv(384, 13, 256, 3, 1, 1, 2)),
    ];
    for (p, suffix) in [
        (Precision::Fp32, ""),
        (Precision::Tf32, " tf32"),
        (Precision::Bf16, " bf16"),
    ] {
        b.suffix = suffix;
        b.be.set_precision(p)?;
        // The conv products the training step runs: its autotune's choice
        // (tensor-core precisions; `ALEXNET_AUTOTUNE=0` keeps the heuristic's).
        b.be.set_autotune(p != Precision::Fp32);
        for (i, (name, g)) in convs.iter().enumerate() {
            if b.wanted("conv_forward", name) || b.wanted("conv_backward_data", name) {
                for t in b.be.autotune_conv(g, true)? {
                    println!(
                        "  autotune: {name}{suffix} {}: {} {:.3} ms (heuristic {} {:.3} ms; {} candidates)",
                        t.product, t.kernel, t.ms, t.heuristic_kernel, t.heuristic_ms, t.candidates
                    );
                }
            }
            let seed = i as u64 * 10;
            let x = b.be.random(g.x_len(), seed)?;
            let w = b.be.random(g.w_len(), seed + 1)?;
            let bias = b.be.random(g.c_out, seed + 2)?;
            let dy = b.be.random(g.y_len(), seed + 3)?;
            let mut y = b.be.zeros(g.y_len())?;
            let mut dx = b.be.zeros(g.x_len())?;
            let mut dw = b.be.zeros(g.w_len())?;
            let mut db = b.be.zeros(g.c_out)?;
            let flops = 2.0 * g.macs() as f64;
            b.run("conv_forward", name, flops, 0.0, |be| {
                be.conv_forward(g, &x, &w, &bias, &mut y)
            })?;
            b.run("conv_backward_data", name, flops, 0.0, |be| {
                be.conv_backward_data(g, &dy, &w, &mut dx)
            })?;
            b.run("conv_backward_filter", name, flops, 0.0, |be| {
                be.conv_backward_filter(g, &x, &dy, &mut dw)
            })?;
            let bytes = 4.0 * (g.y_len() + g.c_out) as f64;
            b.run("conv_backward_bias", name, 0.0, bytes, |be| {
                be.conv_backward_bias(g, &dy, &mut db)
            })?;
        }

        for (i, (name, inputs, outputs)) in [
            ("fc6", 9216, 4096),
            ("fc7", 4096, 4096),
            ("fc8", 4096, 1000),
        ]
        .into_iter()
        .enumerate()
        {
            let g = FcGeom { n, inputs, outputs };
            let seed = 100 + i as u64 * 10;
            let x = b.be.random(n * inputs, seed)?;
            let w = b.be.random(inputs * outputs, seed + 1)?;
            let bias = b.be.random(outputs, seed + 2)?;
            let dy = b.be.random(n * outputs, seed + 3)?;
            let (mut y, mut dx, mut dw, mut db) = (
                b.be.zeros(n * outputs)?,
                b.be.zeros(n * inputs)?,
                b.be.zeros(inputs * outputs)?,
                b.be.zeros(outputs)?,
            );
            let flops = 2.0 * (n * inputs * outputs) as f64;
            // As in the step: where the products read a bf16 or TF32 copy
            // of w, the SGD update keeps it fresh, so neither makes one.
            let kept_len = b.be.fc_kept_len(&g);
            if kept_len > 0 {
                let mut kept = b.be.zeros(kept_len)?;
                b.be.fc_forward_keep(&g, &x, &w, &bias, &mut y, &mut kept, false)?;
                b.run("fc_forward", name, flops, 0.0, |be| {
                    be.fc_forward_keep(&g, &x, &w, &bias, &mut y, &mut kept, true)
                })?;
                b.run("fc_backward_data", name, flops, 0.0, |be| {
                    be.fc_backward_data_kept(&g, &dy, &w, &kept, &mut dx)
                })?;
            } else {
                b.run("fc_forward", name, flops, 0.0, |be| {
                    be.fc_forward(&g, &x, &w, &bias, &mut y)
                })?;
                b.run("fc_backward_data", name, flops, 0.0, |be| {
                    be.fc_backward_data(&g, &dy, &w, &mut dx)
                })?;
            }
            b.run("fc_backward_filter", name, flops, 0.0, |be| {
                be.fc_backward_filter(&g, &x, &dy, &mut dw)
            })?;
            b.run(
                "fc_backward_bias",
                name,
                0.0,
                4.0 * (n * outputs + outputs) as f64,
                |be| be.fc_backward_bias(&g, &dy, &mut db),
            )?;
        }
    }
    b.suffix = "";
    b.be.set_precision(Precision::Fp32)?;

    let relu_len = n * 96 * 55 * 55;
    let mut act = b.be.random(relu_len, 200)?;
    let mut grad = b.be.random(relu_len, 201)?;
    let act_y = b.be.random(relu_len, 202)?;
    b.run(
        "relu_forward",
        "conv1 out",
        0.0,
        8.0 * relu_len as f64,
        |be| be.relu_forward(&mut act),
    )?;
    b.run(
        "relu_backward",
        "conv1 out",
        0.0,
        12.0 * relu_len as f64,
        |be| be.relu_backward(&act_y, &mut grad),
    )?;

    // NCHW -> NHWC of the channels-last conv path (conv2's input and dy).
    for (name, c, hw) in [
        ("conv2 x 96x27x27", 96, 27),
        ("conv2 dy 256x27x27", 256, 27),
        ("conv1 dy 96x55x55", 96, 55),
        ("conv4 x 384x13x13", 384, 13),
    ] {
        let len = n * c * hw * hw;
        let src = b.be.random(len, 250)?;
        let mut dst = b.be.zeros(len)?;
        for (kernel, elem, bytes) in [
            ("transpose", Elem::F32, 8.0),
            ("transpose_tf32", Elem::Tf32, 8.0),
            ("transpose_bf16", Elem::Bf16, 6.0),
        ] {
            b.run(kernel, name, 0.0, bytes * len as f64, |be| {
                be.transpose(&src, &mut dst, [n, c, hw * hw], elem)
            })?;
        }
        // With the per-channel partial sums (dy's relayout in the backward).
        let mut sums = b.be.zeros(n * c * (hw * hw).div_ceil(64))?;
        b.run(
            "transpose_tf32",
            &format!("{name} +sums"),
            0.0,
            8.0 * len as f64,
            |be| be.transpose_sums(&src, &mut dst, [n, c, hw * hw], Elem::Tf32, &mut sums),
        )?;
    }

    // conv1's input cut into window rows (the row-patch conv path).
    {
        let g = convs[0].1;
        let src = b.be.random(g.x_len(), 260)?;
        for (kernel, rw, elem) in [
            ("row_patches", 36, Elem::F32),
            ("row_patches_tf32", 36, Elem::Tf32),
            ("row_patches_bf16", 40, Elem::Bf16),
        ] {
            let rg = RowGeom::patches(&g, rw);
            let mut dst = b.be.zeros(rg.len())?;
            let out = if elem == Elem::Bf16 { 2.0 } else { 4.0 };
            let bytes = 4.0 * rg.src_len() as f64 + out * rg.len() as f64;
            b.run(kernel, &format!("conv1 x rw{rw}"), 0.0, bytes, |be| {
                be.row_patches(&src, &mut dst, &rg, elem)
            })?;
        }
    }

    // x and dy on the TF32 weight gradient's padded pixel grid (conv2, conv3).
    for (layer, g) in [&convs[1], &convs[2]] {
        for (what, gg) in [("x", GridGeom::x(g)), ("dy", GridGeom::dy(g))] {
            let gg = gg.expect("stride 1");
            let src = b.be.random(gg.src_len(), 265)?;
            let mut dst = b.be.zeros(gg.grid_len())?;
            let bytes = 4.0 * (gg.src_len() + gg.grid_len()) as f64;
            b.run(
                "pixel_grid_tf32",
                &format!("{layer} {what} {}x{}x{}", gg.copies, gg.hp, gg.wp),
                0.0,
                bytes,
                |be| be.pixel_grid_tf32(&src, &mut dst, &gg),
            )?;
        }
    }

    // The TMA weight gradients' split-K sum from GEMM order into dw's
    // (conv2..conv5, at conv3's 7 slices of batch 128 on an H100).
    for (layer, g) in &convs[1..] {
        let splits = 7;
        let ws = b.be.random(g.w_len() * splits, 268)?;
        let mut dw = b.be.zeros(g.w_len())?;
        let bytes = 4.0 * (g.w_len() * (splits + 1)) as f64;
        b.run(
            "conv_backward_filter_sum",
            &format!("{layer} {splits} slices"),
            0.0,
            bytes,
            |be| be.conv_backward_filter_sum(g, g.c_in / g.groups, &ws, &mut dw, splits as u32),
        )?;
    }

    // conv1's data gradient by phases: its filter bank, and dx from the
    // phases' product, with the ReLU mask read (bytes: yp read, dx
    // written, the mask read).
    {
        let g = convs[0].1;
        let p = g.phases();
        let w = b.be.random(g.w_len(), 272)?;
        let mut wp = b.be.zeros(p.w_len())?;
        let bytes = 4.0 * (g.w_len() + p.w_len()) as f64;
        b.run("conv_phase_filters", "conv1", 0.0, bytes, |be| {
            be.conv_phase_filters(&g, &w, &mut wp)
        })?;
        let yp = b.be.random(p.x_len(), 273)?;
        let x = b.be.random(g.x_len(), 274)?;
        let mut dx = b.be.zeros(g.x_len())?;
        let bytes = 4.0 * (p.x_len() + 2 * g.x_len()) as f64;
        b.run("conv_phase_scatter", "conv1 relu", 0.0, bytes, |be| {
            be.conv_phase_scatter(&g, &yp, &mut dx, Some(&x))
        })?;
    }

    let w6 = b.be.random(4096 * 9216, 270)?;
    let mut w6h = b.be.zeros(4096 * 9216 / 2)?;
    b.run(
        "convert_bf16",
        "fc6 w 4096x9216",
        0.0,
        6.0 * (4096 * 9216) as f64,
        |be| be.convert_bf16(&w6, &mut w6h),
    )?;
    let mut w6t = b.be.zeros(4096 * 9216)?;
    b.run(
        "convert_tf32",
        "fc6 w 4096x9216",
        0.0,
        8.0 * (4096 * 9216) as f64,
        |be| be.convert_tf32(&w6, &mut w6t),
    )?;

    for (name, c, hw) in [("lrn1 96x55x55", 96, 55), ("lrn2 256x27x27", 256, 27)] {
        let p = LrnParams {
            n,
            c,
            h: hw,
            w: hw,
            size: 5,
            alpha: 1e-4,
            beta: 0.75,
            k: 2.0,
        };
        let len = p.len();
        let x = b.be.random(len, 300)?;
        let dy = b.be.random(len, 301)?;
        let (mut y, mut s, mut dx) = (b.be.zeros(len)?, b.be.zeros(len)?, b.be.zeros(len)?);
        b.run("lrn_forward", name, 0.0, 12.0 * len as f64, |be| {
            be.lrn_forward(&p, &x, &mut y, &mut s)
        })?;
        b.run("lrn_backward", name, 0.0, 20.0 * len as f64, |be| {
            be.lrn_backward(&p, &x, &y, &s, &dy, &mut dx)
        })?;
    }

    // The fused pair as the model runs it (x in; pooled output and argmax
    // out; backward: x, argmax and dz in, dx out).
    for (name, c, hw) in [
        ("norm1+pool1 96x55x55", 96, 55),
        ("norm2+pool2 256x27x27", 256, 27),
    ] {
        let p = LrnParams {
            n,
            c,
            h: hw,
            w: hw,
            size: 5,
            alpha: 1e-4,
            beta: 0.75,
            k: 2.0,
        };
        let g = PoolGeom {
            n,
            c,
            h: hw,
            w: hw,
            size: 3,
            stride: 2,
        };
        let x = b.be.random(p.len(), 310)?;
        let dz = b.be.random(g.y_len(), 311)?;
        let (mut z, mut arg, mut dx) = (
            b.be.zeros(g.y_len())?,
            b.be.zeros(g.y_len())?,
            b.be.zeros(p.len())?,
        );
        let (xb, zb) = (4.0 * p.len() as f64, 4.0 * g.y_len() as f64);
        b.run("lrn_pool_forward", name, 0.0, xb + 2.0 * zb, |be| {
            be.lrn_pool_forward(&p, &g, &x, &mut z, &mut arg)
        })?;
        b.run("lrn_pool_backward", name, 0.0, 2.0 * xb + 2.0 * zb, |be| {
            be.lrn_pool_backward(&p, &g, &x, &arg, &dz, &mut dx, true)
        })?;
    }

    for (name, c, hw) in [
        ("pool1 96x55x55", 96, 55),
        ("pool2 256x27x27", 256, 27),
        ("pool5 256x13x13", 256, 13),
    ] {
        let g = PoolGeom {
            n,
            c,
            h: hw,
            w: hw,
            size: 3,
            stride: 2,
        };
        let x = b.be.random(g.x_len(), 400)?;
        let dy = b.be.random(g.y_len(), 401)?;
        let (mut y, mut arg, mut dx) = (
            b.be.zeros(g.y_len())?,
            b.be.zeros(g.y_len())?,
            b.be.zeros(g.x_len())?,
        );
        let fwd = 4.0 * (g.x_len() + 2 * g.y_len()) as f64;
        b.run("maxpool_forward", name, 0.0, fwd, |be| {
            be.maxpool_forward(&g, &x, &mut y, &mut arg)
        })?;
        let bwd = 4.0 * (g.x_len() + 2 * g.y_len()) as f64;
        b.run("maxpool_backward", name, 0.0, bwd, |be| {
            be.maxpool_backward(&g, &arg, &dy, &mut dx)
        })?;
        // With the ReLU before the pool (reads y as well).
        let bwd_relu = bwd + 4.0 * g.y_len() as f64;
        b.run(
            "maxpool_backward",
            &format!("{name} +relu"),
            0.0,
            bwd_relu,
            |be| be.maxpool_backward_relu(&g, &arg, &x, &y, &dy, &mut dx),
        )?;
    }

    // One step throughout: a new step would add the write of the per-step
    // values (8 bytes, queued before the launch) to the kernel's time.
    let drop_len = n * 4096;
    let mut d = b.be.random(drop_len, 500)?;
    b.run(
        "dropout_forward",
        "fc6 out",
        0.0,
        8.0 * drop_len as f64,
        |be| {
            be.dropout_forward(
                &DropoutParams {
                    p: 0.5,
                    seed: 1,
                    step: 1,
                },
                &mut d,
            )
        },
    )?;
    b.run(
        "dropout_backward",
        "fc6 out",
        0.0,
        8.0 * drop_len as f64,
        |be| {
            be.dropout_backward(
                &DropoutParams {
                    p: 0.5,
                    seed: 1,
                    step: 1,
                },
                &mut d,
            )
        },
    )?;

    let classes = 1000;
    let logits = b.be.random(n * classes, 600)?;
    let labels = b.be.upload_labels(
        &(0..n as i32)
            .map(|i| (i * 7) % classes as i32)
            .collect::<Vec<_>>(),
    )?;
    let (mut probs, mut loss, mut dl, mut rank) = (
        b.be.zeros(n * classes)?,
        b.be.zeros(n)?,
        b.be.zeros(n * classes)?,
        b.be.zeros(n)?,
    );
    let nk = (n * classes) as f64;
    b.run("softmax_xent_forward", "fc8 out", 0.0, 8.0 * nk, |be| {
        be.softmax_xent_forward(n, classes, &logits, &labels, &mut probs, &mut loss)
    })?;
    b.run("softmax_xent_backward", "fc8 out", 0.0, 8.0 * nk, |be| {
        be.softmax_xent_backward(n, classes, &probs, &labels, &mut dl)
    })?;
    b.run("label_rank", "fc8 out", 0.0, 4.0 * nk, |be| {
        be.label_rank(n, classes, &logits, &labels, &mut rank)
    })?;

    // The SGD update of all 16 AlexNet parameter tensors (62M values; 20
    // bytes each: w, g, v read, w, v written): one launch, and for
    // comparison one launch per tensor (as before `sgd_update_all`).
    let alexnet = host::config::Config::from_str(
        include_str!("../configs/alexnet.json"),
        "configs/alexnet.json",
    )?;
    let mut params = alexnet
        .model
        .param_shapes()
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let len = shape.iter().product();
            let seed = 700 + 3 * i as u64;
            Ok([
                b.be.random(len, seed)?,
                b.be.random(len, seed + 1)?,
                b.be.random(len, seed + 2)?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    let total: usize = params.iter().map(|[w, _, _]| w.len()).sum();
    let p = SgdParams {
        lr: 0.01,
        momentum: 0.9,
        weight_decay: 5e-4,
        rule: SgdRule::Pytorch,
    };
    let mut table = host::backend::cuda::SgdTable::default();
    let bytes = 20.0 * total as f64;
    b.run("sgd_update_all", "alexnet, 1 launch", 0.0, bytes, |be| {
        let mut t: Vec<_> = params
            .iter_mut()
            .map(|[w, g, v]| SgdTensor {
                w,
                g: &*g,
                v,
                copy: None,
            })
            .collect();
        be.sgd_update_all(&p, &mut t, &mut table)
    })?;
    let mut tables: Vec<_> = params
        .iter()
        .map(|_| host::backend::cuda::SgdTable::default())
        .collect();
    let launches = format!("alexnet, {} launches", params.len());
    b.run("sgd_update_all", &launches, 0.0, bytes, |be| {
        for ([w, g, v], table) in params.iter_mut().zip(&mut tables) {
            be.sgd_update_all(
                &p,
                &mut [SgdTensor {
                    w,
                    g: &*g,
                    v,
                    copy: None,
                }],
                table,
            )?;
        }
        Ok(())
    })?;

    let path =
        std::env::var("ALEXNET_BENCH_JSON").unwrap_or_else(|_| "target/kernel-bench.json".into());
    let json: Vec<_> = b
        .rows
        .iter()
        .map(|r| {
            serde_json::json!({"kernel": r.kernel, "case": r.case, "batch": n, "median_ms": r.median_ms,
                "min_ms": r.min_ms, "gflops": r.gflops, "gbps": r.gbps, "fraction_of_ceiling": r.fraction})
        })
        .collect();
    let text =
        serde_json::to_string_pretty(&serde_json::json!({"device": b.be.name(), "rows": json}))?;
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!("could not write {path}: {e}");
    } else {
        println!("\nwrote {path}");
    }
    Ok(())
}
