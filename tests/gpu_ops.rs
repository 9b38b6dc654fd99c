//! GPU kernels against the CPU reference backend.
//!
//! Every kernel runs on fresh random inputs (seed printed; set
//! `ALEXNET_TEST_SEED` to repeat one) over odd shapes that are not multiples
//! of any tile size, batch 1, groups 2 and AlexNet's exact layer shapes, with
//! its outputs poisoned with NaN first, and must reach ‖gpu − ref‖/‖ref‖ ≤ tol.
//! Tolerances: 1e-5 for fp32 products and sums (the f64 reference differs
//! from fp32 accumulation by about ε·√K ≈ 6e-8·60 for K ≈ 4k), 1e-5 for LRN and
//! softmax (PTX ex2/lg2 have ~2^-22 relative error), 0 where the GPU must be
//! bit-identical (dropout masks, pooling forward, ranks, the SGD update, and
//! a step replayed as a CUDA graph against the same step run eagerly). The
//! conv and fc products also run in TF32 (operands rounded to 10 mantissa
//! bits, relative error ≤ 2^-11 each, ≈ 4e-4 on a product of random values):
//! tolerance 1e-3; and in bf16 (8 mantissa bits, ≤ 2^-9 each, ≈ 3e-3 on a
//! product of random values, summed in fp32): tolerance 1e-2.
//!
//! A custom harness (no libtest): without a GPU it prints one SKIPPED line per
//! test and a summary saying why, so a skip is never mistaken for a pass.
//! Arguments filter tests by substring (`cargo test --test gpu_ops -- conv`).

use anyhow::Result;
use host::backend::cpu::CpuBackend;
use host::backend::cuda::{
    CudaBackend, Elem, GemmTiles, StridedData, TmaFilter, TmaGrid, unavailable_reason,
};
use host::backend::*;
use host::config::Precision;
use host::model::Model;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Ctx {
    gpu: CudaBackend,
    cpu: CpuBackend,
    rng: StdRng,
    checks: usize,
    failures: Vec<String>,
    /// The GEMM engine's tile height forced for the product tests.
    wide: bool,
    /// Whether vector products use their 128-column variants (64×128,
    /// 128×128) where they have them.
    big: bool,
    /// Whether bf16 vector products read bf16 operand copies (and TF32 fc
    /// products TF32-rounded ones).
    operand_copies: bool,
    /// Whether the product under test is an fc one (whose TF32 products
    /// also run on fp32 operands, converted as fragments are read).
    fc: bool,
    /// Whether the vector engine is on (the product tests run with it on and
    /// off).
    vec: bool,
    /// Whether the vector engine's products take their warpgroup (`wgmma`)
    /// twins where they have one (Hopper only; run with it on and off).
    wg: bool,
}

impl Ctx {
    fn randn(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|_| (self.rng.random::<f32>() * 2.0 - 1.0) * scale)
            .collect()
    }

    /// Compares and records; prints one line per comparison.
    fn check(&mut self, test: &str, case: &str, got: &[f32], want: &[f32], tol: f64) {
        self.check_floor(test, case, got, want, tol, 0.0);
    }

    /// A yes/no check (bit-identical output, an untouched tail, a rate
    /// within bounds), counted and reported like the others.
    fn check_true(&mut self, test: &str, case: &str, ok: bool) {
        self.check(test, case, &[ok as u8 as f32], &[1.0], 0.0);
    }

    /// That `got` (a gradient through a ReLU whose output is `x`) is exactly
    /// zero wherever `x ≤ 0`.
    fn check_relu_mask(&mut self, test: &str, case: &str, got: &[f32], x: &[f32]) {
        let leaks = got
            .iter()
            .zip(x)
            .filter(|(g, x)| **x <= 0.0 && **g != 0.0)
            .count();
        self.check(test, &format!("{case} mask"), &[leaks as f32], &[0.0], 0.0);
    }

    /// As `check`, with ‖ref‖ taken as at least `floor`: for outputs whose
    /// values may legitimately be ~0 (a confident sample's loss is 1e-18 in
    /// f64 but 0 in fp32), where only an absolute error makes sense.
    fn check_floor(
        &mut self,
        test: &str,
        case: &str,
        got: &[f32],
        want: &[f32],
        tol: f64,
        floor: f64,
    ) {
        self.checks += 1;
        let (mut num, mut den, mut nan) = (0.0f64, 0.0f64, 0usize);
        for (&g, &w) in got.iter().zip(want) {
            if !g.is_finite() {
                nan += 1;
            }
            num += (g as f64 - w as f64).powi(2);
            den += (w as f64).powi(2);
        }
        let den = den.sqrt().max(floor);
        let rel = if den > 0.0 {
            num.sqrt() / den
        } else {
            num.sqrt()
        };
        let ok = got.len() == want.len() && nan == 0 && rel <= tol;
        println!(
            "  {} {test:<24} {case:<44} rel_err {rel:.2e} (tol {tol:.0e}){}",
            if ok { "ok  " } else { "FAIL" },
            if nan > 0 {
                format!(" {nan} non-finite")
            } else {
                String::new()
            }
        );
        if !ok {
            self.failures.push(format!(
                "{test} {case}: rel_err {rel:.2e}, {nan} non-finite, len {} vs {}",
                got.len(),
                want.len()
            ));
        }
    }
}

type Test = fn(&mut Ctx) -> Result<()>;

/// `ALEXNET_TEST_SMALL=1` drops the AlexNet-sized cases (for the sanitizers,
/// which slow kernels down a hundredfold or more).
fn small_only() -> bool {
    std::env::var("ALEXNET_TEST_SMALL").is_ok_and(|v| v == "1")
}

fn keep<T>(cases: Vec<(&'static str, T)>) -> Vec<(&'static str, T)> {
    cases
        .into_iter()
        .filter(|(name, _)| !(small_only() && name.starts_with("alexnet")))
        .collect()
}

const TESTS: &[(&str, Test)] = &[
    ("conv_forward", conv_forward),
    ("conv_backward_data", conv_backward_data),
    ("conv_data_cols", conv_data_cols),
    ("conv_data_phases", conv_data_phases),
    ("conv_backward_filter", conv_backward_filter),
    ("conv_backward_bias", conv_backward_bias),
    ("conv_backward", conv_backward),
    ("conv_kept", conv_kept),
    ("conv_autotune", conv_autotune),
    ("conv_wg_big", conv_wg_big),
    ("conv_tma", conv_tma),
    ("conv_tma_filter", conv_tma_filter),
    ("conv_backward_filter_sum", conv_backward_filter_sum),
    ("transpose", transpose),
    ("row_patches", row_patches),
    ("pixel_grid", pixel_grid),
    ("convert_bf16", convert_bf16),
    ("convert_tf32", convert_tf32),
    ("fc_forward", fc_forward),
    ("fc_backward_data", fc_backward_data),
    ("fc_backward_filter", fc_backward_filter),
    ("fc_backward_bias", fc_backward_bias),
    ("fc_kept", fc_kept),
    ("relu_forward", relu_forward),
    ("relu_backward", relu_backward),
    ("lrn_forward", lrn_forward),
    ("lrn_backward", lrn_backward),
    ("lrn_pool_forward", lrn_pool_forward),
    ("lrn_pool_backward", lrn_pool_backward),
    ("maxpool_forward", maxpool_forward),
    ("maxpool_backward", maxpool_backward),
    ("dropout_forward", dropout_forward),
    ("dropout_backward", dropout_backward),
    ("softmax_xent_forward", softmax_xent_forward),
    ("softmax_xent_backward", softmax_xent_backward),
    ("label_rank", label_rank),
    ("sgd_update_all", sgd_update_all),
    ("train_steps", train_steps),
    ("train_steps_graph", train_steps_graph),
    ("arena_parts", arena_parts),
    ("arena_sharing", arena_sharing),
    ("staged_writes", staged_writes),
];

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<_> = TESTS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    if let Some(why) = unavailable_reason() {
        for (name, _) in &selected {
            println!("test {name} ... SKIPPED (no GPU)");
        }
        println!(
            "\ngpu_ops: {} GPU tests SKIPPED, not run: {why}",
            selected.len()
        );
        return;
    }
    let seed = std::env::var("ALEXNET_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let gpu = CudaBackend::new(0).unwrap_or_else(|e| {
        eprintln!("gpu_ops: cannot open GPU 0: {e:#}");
        std::process::exit(1);
    });
    println!(
        "gpu_ops on {} (seed {seed}; ALEXNET_TEST_SEED={seed} repeats it)",
        gpu.name()
    );
    let mut ctx = Ctx {
        gpu,
        cpu: CpuBackend,
        rng: StdRng::seed_from_u64(seed),
        checks: 0,
        failures: vec![],
        wide: false,
        big: false,
        operand_copies: true,
        fc: false,
        vec: true,
        wg: false,
    };
    let mut errors = 0;
    if small_only() {
        println!("ALEXNET_TEST_SMALL=1: AlexNet-sized cases left out");
    }
    for (name, test) in &selected {
        println!("test {name}");
        if let Err(e) = test(&mut ctx).and_then(|_| ctx.gpu.synchronize()) {
            println!("  ERROR {e:#}");
            ctx.failures.push(format!("{name}: {e:#}"));
            errors += 1;
        }
    }
    println!(
        "\ngpu_ops: {} tests, {} comparisons, {} failed",
        selected.len(),
        ctx.checks,
        ctx.failures.len()
    );
    for f in &ctx.failures {
        println!("  FAILED {f}");
    }
    if !ctx.failures.is_empty() || errors > 0 {
        std::process::exit(1);
    }
}

fn conv_cases() -> Vec<(&'static str, ConvGeom)> {
    keep(all_conv_cases())
}

/// A convolution with a square `k × k` kernel.
#[allow(clippy::too_many_arguments)]
fn conv_geom(
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    groups: usize,
) -> ConvGeom {
    ConvGeom {
        n,
        c_in,
        h,
        w,
        c_out,
        k_h: k,
        k_w: k,
        stride,
        pad,
        groups,
    }
}

fn all_conv_cases() -> Vec<(&'static str, ConvGeom)> {
    let g = conv_geom;
    vec![
        (
            "odd 3x5x13x13 -> 7 k3 s2 p1",
            g(3, 5, 13, 13, 7, 3, 2, 1, 1),
        ),
        (
            "groups2 2x6x11x9 -> 10 k5 s1 p2",
            g(2, 6, 11, 9, 10, 5, 1, 2, 2),
        ),
        (
            "batch1 1x3x17x17 -> 65 k4 s3 p0",
            g(1, 3, 17, 17, 65, 4, 3, 0, 1),
        ),
        (
            "even kernel 2x4x7x12 -> 70 k2 s1 p1",
            g(2, 4, 7, 12, 70, 2, 1, 1, 1),
        ),
        (
            "nhwc fwd+filter 3x32x9x7 -> 24 k3 s1 p1 g2",
            g(3, 32, 9, 7, 24, 3, 1, 1, 2),
        ),
        (
            "nhwc all 2x64x11x10 -> 64 k5 s2 p2 g2",
            g(2, 64, 11, 10, 64, 5, 2, 2, 2),
        ),
        (
            "nhwc16 channels 40 2x80x7x9 -> 80 k3 s1 p1 g2",
            g(2, 80, 7, 9, 80, 3, 1, 1, 2),
        ),
        (
            "nhwc transposed 192 ch 3x192x7x6 -> 192 k3 s1 p1",
            g(3, 192, 7, 6, 192, 3, 1, 1, 1),
        ),
        (
            "nhwc batch1 1x16x5x5 -> 16 k3 s1 p0",
            g(1, 16, 5, 5, 16, 3, 1, 0, 1),
        ),
        (
            "rows fwd+filter 3x3x19x15 -> 16 k5 s2 p2",
            g(3, 3, 19, 15, 16, 5, 2, 2, 1),
        ),
        (
            "alexnet conv1 n2 3x224 -> 96 k11 s4 p2",
            g(2, 3, 224, 224, 96, 11, 4, 2, 1),
        ),
        (
            "alexnet conv2 n2 96x27 -> 256 k5 p2 g2",
            g(2, 96, 27, 27, 256, 5, 1, 2, 2),
        ),
        (
            "alexnet conv3 n2 256x13 -> 384 k3 p1",
            g(2, 256, 13, 13, 384, 3, 1, 1, 1),
        ),
        (
            "alexnet conv4 n2 384x13 -> 384 k3 p1 g2",
            g(2, 384, 13, 13, 384, 3, 1, 1, 2),
        ),
        (
            "alexnet conv5 n2 384x13 -> 256 k3 p1 g2",
            g(2, 384, 13, 13, 256, 3, 1, 1, 2),
        ),
    ]
}

/// Runs a product test in every precision and both GEMM tile heights (64 and
/// 128 rows; on the vector engine each with 64 and with 128 columns where a
/// product has both: 64×64, 64×128, 128×128, 128×64; with 128 columns on,
/// so do the transposed channels-last products, pixels × channels, where
/// the channel count takes them: ≤ 48 channels per group in 128×48 tiles
/// (data gradient), 192 in 128×64), leaving the GPU in fp32 with the
/// automatic tile choice.
fn each_precision(c: &mut Ctx, test: fn(&mut Ctx, Precision) -> Result<()>) -> Result<()> {
    let tf32_copies = c.gpu.tf32_copies();
    let filter_copies = c.gpu.fc_filter_copies();
    let result = (|| {
        for (wide, tiles, big) in [
            (false, GemmTiles::Narrow, false),
            (false, GemmTiles::Narrow, true),
            (true, GemmTiles::Wide, true),
            (true, GemmTiles::Wide, false),
        ] {
            if big && !c.vec {
                continue;
            }
            c.wide = wide;
            c.big = big;
            c.gpu.set_gemm_tiles(tiles);
            c.gpu.set_big_tiles(Some(big));
            c.gpu.set_transposed(big);
            // bf16 (and the fc products' TF32) twice on the vector engine:
            // with operand copies and on fp32 operands (converted as
            // fragments are read).
            for (p, ops16) in [
                (Precision::Fp32, true),
                (Precision::Tf32, true),
                (Precision::Tf32, false),
                (Precision::Bf16, true),
                (Precision::Bf16, false),
            ] {
                if !ops16 && (!c.vec || (p == Precision::Tf32 && !c.fc)) {
                    continue;
                }
                c.operand_copies = ops16;
                c.gpu.set_operand_copies(ops16);
                c.gpu.set_tf32_copies(ops16);
                c.gpu.set_fc_filter_copies(ops16);
                c.gpu.set_precision(p)?;
                test(c, p)?;
            }
            c.operand_copies = true;
            c.gpu.set_operand_copies(true);
            c.gpu.set_tf32_copies(tf32_copies);
            c.gpu.set_fc_filter_copies(filter_copies);
        }
        Ok(())
    })();
    c.wide = false;
    c.big = false;
    c.gpu.set_gemm_tiles(GemmTiles::Auto);
    c.gpu.set_big_tiles(None);
    c.gpu.set_transposed(true);
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

/// `each_precision` with the vector engine on (on Hopper first with its
/// warpgroup twins, then with `mma.sync` only), then off (TF32/bf16 products
/// whose shapes allow it take it: channels-last convolutions and fc; see
/// `host/src/backend/cuda/conv.rs` and `gemm.rs`).
fn each_precision_engines(c: &mut Ctx, test: fn(&mut Ctx, Precision) -> Result<()>) -> Result<()> {
    let mut result = Ok(());
    let has_wg = c.gpu.has_wgmma();
    let (was_wg, was_big) = (c.gpu.wgmma_enabled(), c.gpu.wg_big_enabled());
    for (vec, wg) in [(true, true), (true, false), (false, false)] {
        if wg && !has_wg {
            continue;
        }
        c.vec = vec;
        c.wg = wg;
        c.gpu.set_vec_engine(vec);
        c.gpu.set_wgmma(wg);
        result = each_precision(c, test);
        if result.is_err() {
            break;
        }
    }
    c.vec = true;
    c.wg = false;
    c.gpu.set_vec_engine(true);
    c.gpu.set_wgmma(was_wg);
    c.gpu.set_wg_big(was_big);
    result
}

/// Case-name suffix and tolerance of the products in precision `p` and the
/// current tile height and engine (see the module docs).
fn label_tol(c: &Ctx, p: Precision) -> (String, f64) {
    let (name, tol) = match p {
        Precision::Fp32 => ("", 1e-5),
        Precision::Tf32 => (" tf32", 1e-3),
        Precision::Bf16 => (" bf16", 1e-2),
    };
    let engine = if !(c.vec || p == Precision::Fp32) {
        " scalar"
    } else if !c.operand_copies {
        " fp32-operands"
    } else if c.wg && p != Precision::Fp32 {
        " wgmma"
    } else {
        ""
    };
    (
        format!(
            "{name}{}{engine}",
            match (c.wide, c.big) {
                (false, false) => "",
                (false, true) => " 128-col",
                (true, false) if c.vec => " wide 64-col",
                (true, _) => " wide",
            }
        ),
        tol,
    )
}

fn conv_forward(c: &mut Ctx) -> Result<()> {
    each_precision_engines(c, conv_forward_in)
}

fn conv_forward_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let (x, w, b) = (
            c.randn(g.x_len(), 1.0),
            c.randn(g.w_len(), 0.1),
            c.randn(g.c_out, 1.0),
        );
        let mut want = vec![0.0; g.y_len()];
        c.cpu.conv_forward(&g, &x, &w, &b, &mut want)?;
        let (gx, gw, gb) = (c.gpu.upload(&x)?, c.gpu.upload(&w)?, c.gpu.upload(&b)?);
        let mut gy = c.gpu.poisoned(g.y_len())?;
        c.gpu.conv_forward(&g, &gx, &gw, &gb, &mut gy)?;
        let got = c.gpu.download(&gy)?;
        c.check("conv_forward", &format!("{case}{label}"), &got, &want, tol);
        // With the ReLU fused into the epilogue (ReLU is 1-Lipschitz, so the
        // same tolerance holds).
        c.cpu.conv_forward_relu(&g, &x, &w, &b, &mut want)?;
        let mut gy = c.gpu.poisoned(g.y_len())?;
        c.gpu.conv_forward_relu(&g, &gx, &gw, &gb, &mut gy)?;
        let got = c.gpu.download(&gy)?;
        c.check(
            "conv_forward",
            &format!("{case}{label} +relu"),
            &got,
            &want,
            tol,
        );
    }
    Ok(())
}

fn conv_backward_data(c: &mut Ctx) -> Result<()> {
    each_precision_engines(c, conv_backward_data_in)
}

/// Strided shapes three times: by phases (the default), by columns and
/// through the gathered products (`set_strided_data`).
fn conv_backward_data_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let (dy, w) = (c.randn(g.y_len(), 1.0), c.randn(g.w_len(), 0.1));
        let mut want = vec![0.0; g.x_len()];
        c.cpu.conv_backward_data(&g, &dy, &w, &mut want)?;
        let (gdy, gw) = (c.gpu.upload(&dy)?, c.gpu.upload(&w)?);
        for how in [
            StridedData::Phases,
            StridedData::Columns,
            StridedData::Gather,
        ] {
            if how != StridedData::Phases && g.stride == 1 {
                continue;
            }
            c.gpu.set_strided_data(how, None);
            let mut gdx = c.gpu.poisoned(g.x_len())?;
            let r = c.gpu.conv_backward_data(&g, &gdy, &gw, &mut gdx);
            c.gpu.set_strided_data(StridedData::Phases, None);
            r?;
            let got = c.gpu.download(&gdx)?;
            let path = match how {
                _ if g.stride == 1 => "",
                StridedData::Phases => " by phases",
                StridedData::Columns => " by columns",
                StridedData::Gather => " gathered",
            };
            c.check(
                "conv_backward_data",
                &format!("{case}{path}{label}"),
                &got,
                &want,
                tol,
            );
        }
    }
    Ok(())
}

/// The data gradient by columns (`StridedData::Columns`): strided shapes
/// take it (and stride 1 does not); images in chunks of one, two and all
/// (batch 5, so the last chunk is short), with the ReLU mask, in each
/// precision; conv1's shape at batch 3 with one image per chunk.
fn conv_data_cols(c: &mut Ctx) -> Result<()> {
    let g = conv_geom(5, 6, 15, 13, 10, 5, 3, 2, 2);
    let conv1 = conv_geom(3, 3, 224, 224, 96, 11, 4, 2, 1);
    let stride1 = conv_geom(2, 6, 9, 9, 8, 3, 1, 1, 1);
    c.gpu.set_strided_data(StridedData::Columns, None);
    let kernel = c.gpu.conv_data_kernel(&g);
    c.check_true(
        "conv_data_cols",
        &format!("stride 3 takes the columns path ({kernel})"),
        kernel.starts_with("conv_backward_data_cols"),
    );
    let kernel = c.gpu.conv_data_kernel(&stride1);
    c.check_true(
        "conv_data_cols",
        &format!("stride 1 does not ({kernel})"),
        !kernel.starts_with("conv_backward_data_cols"),
    );
    let result = (|| {
        for p in [Precision::Fp32, Precision::Tf32, Precision::Bf16] {
            c.gpu.set_precision(p)?;
            let (label, tol) = label_tol(c, p);
            for (name, g, chunks) in [
                ("5x6x15x13 -> 10 k5 s3 p2 g2", g, &[1, 2, 5][..]),
                ("conv1 n3", conv1, &[1][..]),
            ] {
                let per_image = g.c_in * g.k_h * g.k_w * g.out_h() * g.out_w();
                let (x, dy, w) = (
                    c.randn(g.x_len(), 1.0),
                    c.randn(g.y_len(), 1.0),
                    c.randn(g.w_len(), 0.1),
                );
                let mut want = vec![0.0; g.x_len()];
                c.cpu.conv_backward_data(&g, &dy, &w, &mut want)?;
                for (d, x) in want.iter_mut().zip(&x) {
                    *d = if *x > 0.0 { *d } else { 0.0 };
                }
                let (gx, gdy, gw) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?, c.gpu.upload(&w)?);
                for &imgs in chunks {
                    c.gpu
                        .set_strided_data(StridedData::Columns, Some(imgs * per_image));
                    let mut gdx = c.gpu.poisoned(g.x_len())?;
                    let (mut gdw, mut gdb) = (c.gpu.zeros(g.w_len())?, c.gpu.zeros(g.c_out)?);
                    let dx = Some(&mut gdx);
                    c.gpu
                        .conv_backward(&g, &gx, &gdy, &gw, &mut gdw, &mut gdb, dx, true)?;
                    let got = c.gpu.download(&gdx)?;
                    c.check(
                        "conv_data_cols",
                        &format!("{name} chunks of {imgs} relu{label}"),
                        &got,
                        &want,
                        tol,
                    );
                }
            }
        }
        Ok(())
    })();
    c.gpu.set_strided_data(StridedData::Phases, Some(1 << 26));
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

/// The data gradient by phases (the default for strides above 1): the
/// shape takes it, running the stride-1 product of `ConvGeom::phases`;
/// its two kernels against their CPU twins bit for bit (copies, on
/// poisoned outputs); the whole data gradient with and without the ReLU
/// mask against the CPU's direct one, in each precision, on conv1's shape
/// (batch 3 and 1), groups 2 with a 5×4 window at stride 3, a window
/// smaller than the stride, and a shape whose last rows and columns no
/// tap reaches.
fn conv_data_phases(c: &mut Ctx) -> Result<()> {
    let g = conv_geom;
    let odd = ConvGeom {
        k_w: 4,
        ..g(5, 6, 15, 13, 10, 5, 3, 2, 2)
    };
    let cases = keep(vec![
        ("odd k5x4 s3 p2 g2", odd),
        (
            "k2x1 s3 n1",
            ConvGeom {
                k_w: 1,
                ..g(1, 4, 8, 7, 6, 2, 3, 0, 2)
            },
        ),
        ("k3 s4 uncovered edge", g(2, 5, 13, 14, 8, 3, 4, 0, 1)),
        ("conv1 n1", g(1, 3, 224, 224, 96, 11, 4, 2, 1)),
        ("alexnet conv1 n3", g(3, 3, 224, 224, 96, 11, 4, 2, 1)),
    ]);
    let result = (|| {
        for (name, geom) in &cases {
            let p = geom.phases();
            let (kernel, inner) = (c.gpu.conv_data_kernel(geom), c.gpu.conv_data_kernel(&p));
            c.check_true(
                "conv_data_phases",
                &format!("{name} runs its phases' product ({kernel})"),
                kernel == inner && !kernel.starts_with("conv_backward_data_cols"),
            );
            let w = c.randn(geom.w_len(), 0.1);
            let mut want = vec![0.0; p.w_len()];
            host::backend::cpu::conv::conv_phase_filters(geom, &w, &mut want);
            let gw = c.gpu.upload(&w)?;
            let mut gwp = c.gpu.poisoned(p.w_len())?;
            c.gpu.conv_phase_filters(geom, &gw, &mut gwp)?;
            let got = c.gpu.download(&gwp)?;
            c.check("conv_phase_filters", name, &got, &want, 0.0);
            let (yp, x) = (c.randn(p.x_len(), 1.0), c.randn(geom.x_len(), 1.0));
            let (gyp, gx) = (c.gpu.upload(&yp)?, c.gpu.upload(&x)?);
            for masked in [false, true] {
                let mut want = vec![0.0; geom.x_len()];
                let mask = masked.then_some(&x[..]);
                host::backend::cpu::conv::conv_phase_scatter(geom, &yp, &mut want, mask);
                let mut gdx = c.gpu.poisoned(geom.x_len())?;
                c.gpu
                    .conv_phase_scatter(geom, &gyp, &mut gdx, masked.then_some(&gx))?;
                let got = c.gpu.download(&gdx)?;
                let case = format!("{name}{}", if masked { " relu" } else { "" });
                c.check("conv_phase_scatter", &case, &got, &want, 0.0);
            }
        }
        for p in [Precision::Fp32, Precision::Tf32, Precision::Bf16] {
            c.gpu.set_precision(p)?;
            let (label, tol) = label_tol(c, p);
            for (name, g) in &cases {
                let (x, dy, w) = (
                    c.randn(g.x_len(), 1.0),
                    c.randn(g.y_len(), 1.0),
                    c.randn(g.w_len(), 0.1),
                );
                let mut want = vec![0.0; g.x_len()];
                c.cpu.conv_backward_data(g, &dy, &w, &mut want)?;
                let (gx, gdy, gw) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?, c.gpu.upload(&w)?);
                let mut gdx = c.gpu.poisoned(g.x_len())?;
                c.gpu.conv_backward_data(g, &gdy, &gw, &mut gdx)?;
                let got = c.gpu.download(&gdx)?;
                c.check(
                    "conv_data_phases",
                    &format!("{name}{label}"),
                    &got,
                    &want,
                    tol,
                );
                for (d, x) in want.iter_mut().zip(&x) {
                    *d = if *x > 0.0 { *d } else { 0.0 };
                }
                let mut gdx = c.gpu.poisoned(g.x_len())?;
                let (mut gdw, mut gdb) = (c.gpu.zeros(g.w_len())?, c.gpu.zeros(g.c_out)?);
                c.gpu
                    .conv_backward(g, &gx, &gdy, &gw, &mut gdw, &mut gdb, Some(&mut gdx), true)?;
                let got = c.gpu.download(&gdx)?;
                let case = format!("{name} relu{label}");
                c.check("conv_data_phases", &case, &got, &want, tol);
            }
        }
        Ok(())
    })();
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

fn conv_backward(c: &mut Ctx) -> Result<()> {
    each_precision_engines(c, conv_backward_in)
}

/// The combined backward (one dy relayout shared by the data and weight
/// gradients where both take it) against the reference's three products,
/// with and without dx (a first layer has none).
fn conv_backward_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let x = c.randn(g.x_len(), 1.0);
        let (dy, w) = (c.randn(g.y_len(), 1.0), c.randn(g.w_len(), 0.1));
        let (mut dw, mut db, mut dx) = (
            vec![0.0; g.w_len()],
            vec![0.0; g.c_out],
            vec![0.0; g.x_len()],
        );
        c.cpu.conv_backward_filter(&g, &x, &dy, &mut dw)?;
        c.cpu.conv_backward_bias(&g, &dy, &mut db)?;
        c.cpu.conv_backward_data(&g, &dy, &w, &mut dx)?;
        // x as a ReLU output (about half zeros) for the masked variant.
        let relu_x: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
        let mut dw_relu = vec![0.0; g.w_len()];
        c.cpu.conv_backward_filter(&g, &relu_x, &dy, &mut dw_relu)?;
        let dx_relu: Vec<f32> = dx
            .iter()
            .zip(&relu_x)
            .map(|(d, x)| if *x > 0.0 { *d } else { 0.0 })
            .collect();
        let (gdy, gw) = (c.gpu.upload(&dy)?, c.gpu.upload(&w)?);
        for (with_dx, relu) in [(true, false), (false, false), (true, true)] {
            let (dw, dx) = if relu {
                (&dw_relu, &dx_relu)
            } else {
                (&dw, &dx)
            };
            let gx = c.gpu.upload(if relu { &relu_x } else { &x })?;
            let (mut gdw, mut gdb) = (c.gpu.poisoned(g.w_len())?, c.gpu.poisoned(g.c_out)?);
            let mut gdx = c.gpu.poisoned(g.x_len())?;
            let dx_arg = with_dx.then_some(&mut gdx);
            c.gpu
                .conv_backward(&g, &gx, &gdy, &gw, &mut gdw, &mut gdb, dx_arg, relu)?;
            let what = match (with_dx, relu) {
                (false, _) => " (no dx)",
                (true, true) => " +relu",
                (true, false) => "",
            };
            let case = format!("{case}{label}{what}");
            let got = c.gpu.download(&gdw)?;
            c.check("conv_backward", &format!("{case} dw"), &got, dw, tol);
            let got = c.gpu.download(&gdb)?;
            c.check("conv_backward", &format!("{case} db"), &got, &db, 1e-5);
            if with_dx {
                let got = c.gpu.download(&gdx)?;
                c.check("conv_backward", &format!("{case} dx"), &got, dx, tol);
            }
            if relu {
                let got = c.gpu.download(&gdx)?;
                c.check_relu_mask("conv_backward", &case, &got, &relu_x);
            }
        }
    }
    Ok(())
}

fn conv_kept(c: &mut Ctx) -> Result<()> {
    let before = c.checks;
    each_precision_engines(c, conv_kept_in)?;
    // Some shape must have kept a copy (TF32 and bf16 on the vector engine
    // do for every channels-last and row-patch case), or nothing was tested.
    let ran = c.checks > before;
    c.check_true("conv_kept", "some case kept a copy of x", ran);
    Ok(())
}

/// The forward that keeps x's operand copy (`conv_forward_keep`, the copy
/// poisoned first) and the backward that reads it (`conv_backward_kept`),
/// given a NaN x so that any read of x itself instead of the copy shows.
fn conv_kept_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let len = c.gpu.conv_kept_len(&g);
        if len == 0 {
            continue;
        }
        let x = c.randn(g.x_len(), 1.0);
        let (w, b) = (c.randn(g.w_len(), 0.1), c.randn(g.c_out, 1.0));
        let dy = c.randn(g.y_len(), 1.0);
        let (mut y, mut dw, mut db, mut dx) = (
            vec![0.0; g.y_len()],
            vec![0.0; g.w_len()],
            vec![0.0; g.c_out],
            vec![0.0; g.x_len()],
        );
        c.cpu.conv_forward(&g, &x, &w, &b, &mut y)?;
        c.cpu.conv_backward_filter(&g, &x, &dy, &mut dw)?;
        c.cpu.conv_backward_bias(&g, &dy, &mut db)?;
        c.cpu.conv_backward_data(&g, &dy, &w, &mut dx)?;
        let (gx, gw, gb) = (c.gpu.upload(&x)?, c.gpu.upload(&w)?, c.gpu.upload(&b)?);
        let (mut gy, mut kept) = (c.gpu.poisoned(g.y_len())?, c.gpu.poisoned(len)?);
        c.gpu
            .conv_forward_keep(&g, &gx, &gw, &gb, &mut gy, false, &mut kept)?;
        let case = format!("{case}{label}");
        let got = c.gpu.download(&gy)?;
        c.check("conv_kept", &format!("{case} y"), &got, &y, tol);
        let (gdy, nan_x) = (c.gpu.upload(&dy)?, c.gpu.poisoned(g.x_len())?);
        let (mut gdw, mut gdb) = (c.gpu.poisoned(g.w_len())?, c.gpu.poisoned(g.c_out)?);
        let mut gdx = c.gpu.poisoned(g.x_len())?;
        c.gpu.conv_backward_kept(
            &g,
            &nan_x,
            &kept,
            &gdy,
            &gw,
            &mut gdw,
            &mut gdb,
            Some(&mut gdx),
            false,
        )?;
        for (what, buf, want) in [(" dw", &gdw, &dw), (" db", &gdb, &db), (" dx", &gdx, &dx)] {
            let got = c.gpu.download(buf)?;
            c.check("conv_kept", &format!("{case}{what}"), &got, want, tol);
        }
        // A buffer sized under other settings (a precision changed after
        // the model was built): a longer one is used, a shorter one passed
        // over (the copy then made in scratch from x, here the real one).
        for (what, len, x_arg) in [
            (" longer copy", len + 7, &nan_x),
            (" short copy", len - 1, &gx),
        ] {
            let mut kept = c.gpu.poisoned(len)?;
            let mut gy = c.gpu.poisoned(g.y_len())?;
            c.gpu
                .conv_forward_keep(&g, &gx, &gw, &gb, &mut gy, false, &mut kept)?;
            let mut gdw = c.gpu.poisoned(g.w_len())?;
            let mut gdb = c.gpu.poisoned(g.c_out)?;
            c.gpu
                .conv_backward_kept(&g, x_arg, &kept, &gdy, &gw, &mut gdw, &mut gdb, None, false)?;
            let (got_y, got_dw) = (c.gpu.download(&gy)?, c.gpu.download(&gdw)?);
            c.check("conv_kept", &format!("{case}{what} y"), &got_y, &y, tol);
            c.check("conv_kept", &format!("{case}{what} dw"), &got_dw, &dw, tol);
        }
    }
    Ok(())
}

fn conv_backward_filter(c: &mut Ctx) -> Result<()> {
    each_precision_engines(c, conv_backward_filter_in)
}

/// Every kernel choice the autotune times for the forward and the data
/// gradient (`for_each_conv_candidate`: the built-in one, tiles with and
/// without their 128-column variants, the transposed products on, off, or
/// on any multiple of 64 channels) against the CPU reference, each output
/// poisoned first, in TF32 and bf16; and a product's candidates against
/// each other bit for bit, since the autotune's picks (timings) may differ
/// between runs and results must not. Then the autotune itself: on, it
/// times some shape's candidates and the products it chose still match the
/// reference; off, it does nothing.
fn conv_autotune(c: &mut Ctx) -> Result<()> {
    let mut several = 0;
    let mut result = Ok(());
    for p in [Precision::Tf32, Precision::Bf16] {
        c.gpu.set_precision(p)?;
        result = conv_candidates_in(c, p, &mut several);
        if result.is_err() {
            break;
        }
    }
    c.check_true(
        "conv_autotune",
        "some product had several candidates",
        several > 0,
    );
    if result.is_ok() {
        c.gpu.set_precision(Precision::Tf32)?;
        c.gpu.set_autotune(true);
        result = autotuned_in(c);
        c.gpu.set_autotune(false);
    }
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

/// Operands of one convolution case and the CPU reference's y, dx, dw.
struct ConvRef {
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    dy: Vec<f32>,
    y: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<f32>,
}

/// The channels-last forwards' 128×128 tiles on the swizzled warpgroup
/// kernels (`_wg_big`, Hopper) and on `mma.sync`, at AlexNet's conv2, conv3
/// and conv5 shapes at batch 128 (where the autotune offers 128×128 tiles;
/// at batch 8 it offers none, and the test would fail) and a shape with
/// partial tiles (also under `ALEXNET_TEST_SMALL`, for the sanitizers), TF32 and
/// bf16: every autotune candidate with the warpgroup kernels on, and the
/// `mma.sync` 128×128 kernel, must agree bit for bit — what lets the
/// autotune pick between them by speed alone (`conv_autotune`'s small cases
/// never offer 128×128 tiles). Off Hopper it says SKIPPED and checks
/// nothing.
fn conv_wg_big(c: &mut Ctx) -> Result<()> {
    let test = "conv_wg_big";
    if !c.gpu.has_wgmma() {
        println!("  SKIPPED (no warpgroup engine: not a Hopper GPU)");
        return Ok(());
    }
    let g = conv_geom;
    let cases = keep(vec![
        ("alexnet conv2 b128", g(128, 96, 27, 27, 256, 5, 1, 2, 2)),
        ("alexnet conv3 b128", g(128, 256, 13, 13, 384, 3, 1, 1, 1)),
        ("alexnet conv5 b128", g(128, 384, 13, 13, 256, 3, 1, 1, 2)),
        // Partial tiles: 200 filters (the second 128-row tile 72 rows, its
        // second warpgroup 8), 61 × 169 pixels (the last tile 69 columns).
        ("odd b61 f200", g(61, 256, 13, 13, 200, 3, 1, 1, 1)),
    ]);
    let (big, wg_big, tma) = (
        c.gpu.big_tiles(),
        c.gpu.wg_big_enabled(),
        c.gpu.tma_enabled(),
    );
    c.gpu.set_big_tiles(Some(true));
    c.gpu.set_tma(false);
    let mut result = Ok(());
    'all: for p in [Precision::Tf32, Precision::Bf16] {
        c.gpu.set_precision(p)?;
        for (case, g) in &cases {
            let (hx, hw, hb) = forward_operands(c, g);
            let outs = match outputs_by_kernel(
                c,
                g,
                "forward",
                (&hx, &hw, &hb),
                CudaBackend::set_wg_big,
                [true, false],
                |_| true,
            ) {
                Ok(outs) => outs,
                Err(e) => {
                    result = Err(e);
                    break 'all;
                }
            };
            let names: Vec<&str> = outs.iter().map(|(n, _)| n.as_str()).collect();
            println!("  {case} {p:?}: {}", names.join(", "));
            c.check_true(
                test,
                &format!("{case} {p:?}: a _wg_big and an mma.sync _big candidate"),
                names.iter().any(|n| n.ends_with("_wg_big"))
                    && names
                        .iter()
                        .any(|n| n.ends_with("_big") && !n.ends_with("_wg_big")),
            );
            let want = &outs[0].1;
            for (name, got) in &outs[1..] {
                c.check_true(
                    test,
                    &format!("{case} {p:?}: {name} bit-identical to {}", outs[0].0),
                    bits_equal(got, want),
                );
            }
            // The shape with partial tiles also against the CPU reference
            // (`conv_forward`'s cases never take 128×128 tiles).
            if !case.starts_with("alexnet") {
                let mut y = vec![0.0; g.y_len()];
                c.cpu.conv_forward(g, &hx, &hw, &hb, &mut y)?;
                let (label, tol) = label_tol(c, p);
                c.check(
                    test,
                    &format!("{case}{label} {} vs CPU", outs[0].0),
                    want,
                    &y,
                    tol,
                );
            }
        }
    }
    c.gpu.set_wg_big(wg_big);
    c.gpu.set_tma(tma);
    c.gpu.set_big_tiles(big);
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

/// The channels-last forwards' 128×128 warpgroup kernels with their
/// operands fetched by the tensor memory accelerator (`_wg_tma_big`, Hopper)
/// against their `cp.async` twins (`_wg_big`), which sum the same products
/// in the same order, so the two must agree bit for bit, and against the
/// CPU reference; TF32 and bf16. Shapes: AlexNet's conv3 and conv4 at
/// batch 128 (conv4: 192 filters a group, so a 128-row tile reads the next
/// group's filters, which must not show), a rectangular filter on a
/// rectangular image (the im2col map's corners per axis), stride 2, batch
/// 1, and partial tiles of filters and pixels; the small ones also under
/// `ALEXNET_TEST_SMALL` (for the sanitizers). Then the data gradients of
/// the stride-1 cases whose groups have whole 128-byte tiles of filters on
/// their TMA kernels (`ALEXNET_TMA_DATA`) against the warpgroup engine's
/// `cp.async` 128×128 kernels, bit for bit, and the CPU reference. Off
/// Hopper it says SKIPPED and checks nothing.
/// Whether the GPU has the tensor memory accelerator (Hopper); says
/// SKIPPED where it has not.
fn has_tma(c: &Ctx) -> bool {
    let has = c.gpu.has_wgmma();
    if !has {
        println!("  SKIPPED (no tensor memory accelerator: not a Hopper GPU)");
    }
    has
}

/// `g` with a 3×5 filter (rows × columns).
fn rect_3x5(g: ConvGeom) -> ConvGeom {
    ConvGeom {
        k_h: 3,
        k_w: 5,
        ..g
    }
}

/// The weight gradients on the TMA kernels (`ALEXNET_TMA_FILTER`) against
/// the CPU reference, dw poisoned first. bf16
/// (`conv_backward_filter_nhwc16_bf16_wg_tma_big`, MN-major `wgmma`
/// tiles): AlexNet conv3 (one slice and, at batch 16, split slices whose
/// pixel count is no multiple of 64), conv4 (two groups, 192 filters a
/// group: half tiles of filters and of columns), a batch-1 conv5, and a
/// 3×5 filter at stride 2 with pad 2 on an 11×9 image in two groups. TF32
/// (`conv_backward_filter_grid_tf32_wg_tma_big`, over the padded pixel
/// grid, stride 1): the same stride-1 cases, the 3×5 filter at stride 1,
/// conv2 (48 channels a group: boxes of 16) and 40 channels with no
/// padding and 72 filters. Each case also checks, from the launch record,
/// that the TMA kernel ran. Off Hopper it says SKIPPED and checks nothing.
fn conv_tma_filter(c: &mut Ctx) -> Result<()> {
    let test = "conv_tma_filter";
    if !has_tma(c) {
        return Ok(());
    }
    let g = conv_geom;
    let rect = rect_3x5(g(3, 128, 11, 9, 256, 3, 2, 2, 2));
    let cases = keep(vec![
        ("alexnet conv3 b4", g(4, 256, 13, 13, 384, 3, 1, 1, 1)),
        ("alexnet conv3 b16", g(16, 256, 13, 13, 384, 3, 1, 1, 1)),
        ("alexnet conv4 b2", g(2, 384, 13, 13, 384, 3, 1, 1, 2)),
        ("conv5 b1", g(1, 384, 13, 13, 256, 3, 1, 1, 2)),
        ("rect 3x5 s2 pad 2 g2 b3", rect),
        // bf16: a tap's 64 columns past a group's 48 (56) channels.
        (
            "conv2 b2 (48 channels a group)",
            g(2, 96, 27, 27, 256, 5, 1, 2, 2),
        ),
        ("56ch 7x9 k3 p1 f64 b3", g(3, 56, 7, 9, 64, 3, 1, 1, 1)),
    ]);
    // TF32 runs over the padded pixel grid, stride 1 only; any group's
    // channels in eights.
    let tf32_only = keep(vec![
        (
            "rect 3x5 s1 pad 2 g2 b3",
            rect_3x5(g(3, 128, 11, 9, 256, 3, 1, 2, 2)),
        ),
        ("odd 40ch 7x9 k3 p0 f72 b3", g(3, 40, 7, 9, 72, 3, 1, 0, 1)),
    ]);
    let on = c.gpu.tma_filter();
    c.gpu.set_tma_filter(TmaFilter::All);
    let mut result = Ok(());
    let runs = cases
        .iter()
        .map(|&(case, geom)| (Precision::Bf16, case, geom));
    let tf32 = cases
        .iter()
        .chain(&tf32_only)
        .filter(|(_, geom)| geom.stride == 1);
    let runs = runs.chain(tf32.map(|&(case, geom)| (Precision::Tf32, case, geom)));
    for (p, case, geom) in runs.collect::<Vec<_>>() {
        c.gpu.set_precision(p)?;
        let (label, tol) = label_tol(c, p);
        let (x, dy) = (c.randn(geom.x_len(), 1.0), c.randn(geom.y_len(), 1.0));
        let mut want = vec![0.0; geom.w_len()];
        c.cpu.conv_backward_filter(&geom, &x, &dy, &mut want)?;
        let run = |c: &mut Ctx| -> Result<(Vec<f32>, Vec<LaunchTime>)> {
            let (gx, gdy) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?);
            let mut gdw = c.gpu.poisoned(geom.w_len())?;
            c.gpu.start_launch_profile()?;
            let ran = c.gpu.conv_backward_filter(&geom, &gx, &gdy, &mut gdw);
            let launches = c.gpu.finish_launch_profile()?;
            ran?;
            Ok((c.gpu.download(&gdw)?, launches))
        };
        match run(c) {
            Ok((got, launches)) => {
                let fed = launches.iter().any(|l| {
                    l.kernel.starts_with("conv_backward_filter")
                        && l.kernel.ends_with("_wg_tma_big")
                });
                c.check_true(
                    test,
                    &format!("{case}{label}: the TMA weight gradient ran"),
                    fed,
                );
                c.check(test, &format!("{case}{label} dw vs CPU"), &got, &want, tol);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    c.gpu.set_tma_filter(on);
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

fn conv_tma(c: &mut Ctx) -> Result<()> {
    let test = "conv_tma";
    if !has_tma(c) {
        return Ok(());
    }
    let g = conv_geom;
    let rect = rect_3x5(g(3, 128, 11, 9, 200, 3, 1, 2, 2));
    let cases = keep(vec![
        ("alexnet conv3 b128", g(128, 256, 13, 13, 384, 3, 1, 1, 1)),
        ("alexnet conv4 b128", g(128, 384, 13, 13, 384, 3, 1, 1, 2)),
        ("rect 3x5 pad 2 g2 f200 b3", rect),
        (
            "rect 3x5 pad 1 g2 f256 b3",
            ConvGeom {
                pad: 1,
                c_out: 256,
                ..rect
            },
        ),
        ("stride 2 b5 f72", g(5, 64, 15, 15, 72, 3, 2, 1, 1)),
        ("b1 conv5", g(1, 384, 13, 13, 256, 3, 1, 1, 2)),
        // A tap's last K tile part zeros: 48 channels a group (conv2), 56,
        // and 72 filters (TF32 data gradient: 288 of 384 bytes).
        ("alexnet conv2 b2", g(2, 96, 27, 27, 256, 5, 1, 2, 2)),
        ("56ch k3 p1 f72 b3", g(3, 56, 7, 9, 72, 3, 1, 1, 1)),
        // 24 channels a group, two groups (the data gradient's swapped
        // tiles read the next group's weight rows past a group's 24), and
        // conv1's phases (48 channels, no padding).
        ("24ch g2 f128 b1", g(1, 48, 9, 7, 128, 3, 1, 1, 2)),
        ("conv1 phases b2", g(2, 48, 57, 57, 96, 3, 1, 0, 1)),
    ]);
    // Whether a group's `chans` a tap fill TMA K tiles as the host's rule
    // asks (whole 128-byte tiles, or three quarters of them), and whether
    // whole: only then does the TMA kernel sum k in the `cp.async` one's
    // order, bit for bit.
    let tiles = |chans: usize, p: Precision| {
        let bytes = chans * if p == Precision::Bf16 { 2 } else { 4 };
        let fit = bytes.is_multiple_of(16) && 4 * bytes >= 3 * bytes.next_multiple_of(128);
        (fit, bytes.is_multiple_of(128))
    };
    let (big, wg_big, tma) = (
        c.gpu.big_tiles(),
        c.gpu.wg_big_enabled(),
        c.gpu.tma_enabled(),
    );
    c.gpu.set_big_tiles(Some(true));
    // 128-row tiles also for conv4's 192 filters a group.
    c.gpu.set_gemm_tiles(GemmTiles::Wide);
    let (wgmma, tma_data) = (c.gpu.wgmma_enabled(), c.gpu.tma_data_enabled());
    let (stages, tma_grid) = (c.gpu.tma_stages(), c.gpu.tma_grid());
    let direct_store = c.gpu.tma_direct_store();
    let mut result = Ok(());
    'all: for product in ["forward", "data"] {
        let forward = product == "forward";
        // The data gradients' `cp.async` 128×128 kernels are the warpgroup
        // engine's (`ALEXNET_WGMMA`).
        c.gpu.set_wgmma(!forward);
        c.gpu.set_wg_big(true);
        let set: fn(&mut CudaBackend, bool) = if forward {
            CudaBackend::set_tma
        } else {
            CudaBackend::set_tma_data
        };
        for p in [Precision::Tf32, Precision::Bf16] {
            c.gpu.set_precision(p)?;
            for (case, g) in &cases {
                // The data gradient fits the TMA kernel at stride 1; both
                // need a group's channels (filters) to fill K tiles.
                let chans = if forward { g.c_in } else { g.c_out } / g.groups;
                let (fit, whole) = tiles(chans, p);
                if !fit || !forward && g.stride != 1 {
                    continue;
                }
                let (ops, want) = if forward {
                    let (hx, hw, hb) = forward_operands(c, g);
                    let mut y = vec![0.0; g.y_len()];
                    c.cpu.conv_forward(g, &hx, &hw, &hb, &mut y)?;
                    ((hx, hw, hb), y)
                } else {
                    let (hdy, hw) = (c.randn(g.y_len(), 1.0), c.randn(g.w_len(), 0.1));
                    let mut dx = vec![0.0; g.x_len()];
                    c.cpu.conv_backward_data(g, &hdy, &hw, &mut dx)?;
                    ((hdy, hw, vec![0.0]), dx)
                };
                let wg = |name: &str| name.ends_with("_wg_big") || name.ends_with("_wg_tma_big");
                let outs = match outputs_by_kernel(
                    c,
                    g,
                    product,
                    (&ops.0, &ops.1, &ops.2),
                    set,
                    [false, true],
                    wg,
                ) {
                    Ok(outs) => outs,
                    Err(e) => {
                        result = Err(e);
                        break 'all;
                    }
                };
                let case = format!("{product} {case}");
                let names: Vec<&str> = outs.iter().map(|(n, _)| n.as_str()).collect();
                println!("  {case} {p:?}: {}", names.join(", "));
                let plain = outs.iter().find(|(n, _)| n.ends_with("_wg_big"));
                let fed = outs.iter().find(|(n, _)| n.ends_with("_wg_tma_big"));
                c.check_true(
                    test,
                    &format!("{case} {p:?}: a _wg_big and a _wg_tma_big candidate"),
                    plain.is_some() && fed.is_some(),
                );
                let (Some((plain_name, same)), Some((fed_name, got))) = (plain, fed) else {
                    continue;
                };
                if whole {
                    c.check_true(
                        test,
                        &format!("{case} {p:?}: {fed_name} bit-identical to {plain_name}"),
                        bits_equal(got, same),
                    );
                }
                let (label, tol) = label_tol(c, p);
                let (fed_name, got) = (fed_name.clone(), got.clone());
                c.check(
                    test,
                    &format!("{case}{label} {fed_name} vs CPU"),
                    &got,
                    &want,
                    tol,
                );
                // The producer's ring at its shortest and longest, blocks
                // that loop over tiles (three blocks: the ring runs on from
                // tile to tile), and stores straight from the accumulators
                // (also what 2 stages and looping blocks use, where the
                // default stages its tiles in shared memory): the same
                // products, so the same bits.
                for (n, grid, direct) in [
                    (2, TmaGrid::PerTile, false),
                    (7, TmaGrid::PerTile, false),
                    (stages, TmaGrid::PerTile, true),
                    (stages, TmaGrid::Resident, false),
                    (2, TmaGrid::Blocks(3), false),
                    (7, TmaGrid::Blocks(3), false),
                ] {
                    c.gpu.set_tma_stages(n)?;
                    c.gpu.set_tma_grid(grid);
                    c.gpu.set_tma_direct_store(direct);
                    let only_fed = |name: &str| name.ends_with("_wg_tma_big");
                    let ops = (&ops.0[..], &ops.1[..], &ops.2[..]);
                    let outs = outputs_by_kernel(c, g, product, ops, set, [true, true], only_fed);
                    c.gpu.set_tma_stages(stages)?;
                    c.gpu.set_tma_grid(tma_grid);
                    c.gpu.set_tma_direct_store(direct_store);
                    let same = outs?
                        .iter()
                        .any(|(n, out)| *n == fed_name && bits_equal(out, &got));
                    c.check_true(
                        test,
                        &format!(
                            "{case} {p:?}: {fed_name} with {n} stages, {grid:?}, {} stores, bit-identical",
                            if direct { "direct" } else { "default" }
                        ),
                        same,
                    );
                }
                // Groups of at most 64 channels: the data gradient with the
                // roles swapped (128 pixels × 64 channels a tile), the same
                // K tiles in the same order as the 128×128 kernel's, so the
                // same bits, under the default ring and two others.
                if forward || g.c_in / g.groups > 64 {
                    continue;
                }
                let swapped = |name: &str| name.ends_with("_wg_tma_t");
                for (n, grid) in [
                    (stages, TmaGrid::PerTile),
                    (2, TmaGrid::Blocks(3)),
                    (7, TmaGrid::Resident),
                ] {
                    c.gpu.set_tma_stages(n)?;
                    c.gpu.set_tma_grid(grid);
                    let ops = (&ops.0[..], &ops.1[..], &ops.2[..]);
                    let outs = outputs_by_kernel(c, g, product, ops, set, [true, true], swapped);
                    c.gpu.set_tma_stages(stages)?;
                    c.gpu.set_tma_grid(tma_grid);
                    let outs = outs?;
                    let Some((t_name, t_got)) = outs.first() else {
                        c.check_true(test, &format!("{case} {p:?}: a _wg_tma_t candidate"), false);
                        break;
                    };
                    let (label, tol) = label_tol(c, p);
                    let ring = format!("{n} stages, {grid:?}");
                    let what = format!("{case}{label} {t_name} ({ring}) vs CPU");
                    c.check(test, &what, t_got, &want, tol);
                    c.check_true(
                        test,
                        &format!("{case} {p:?}: {t_name} ({ring}) bit-identical to {fed_name}"),
                        bits_equal(t_got, &got),
                    );
                }
            }
        }
    }
    c.gpu.set_tma_data(tma_data);
    c.gpu.set_wgmma(wgmma);
    c.gpu.set_wg_big(wg_big);
    c.gpu.set_tma(tma);
    c.gpu.set_gemm_tiles(GemmTiles::Auto);
    c.gpu.set_big_tiles(big);
    c.gpu.set_precision(Precision::Fp32)?;
    result
}

/// Random x, w and bias of a forward case (host copies).
fn forward_operands(c: &mut Ctx, g: &ConvGeom) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        c.randn(g.x_len(), 1.0),
        c.randn(g.w_len(), 0.1),
        c.randn(g.c_out, 0.1),
    )
}

/// A product of `g` (`"forward"` on `(x, w, bias)`, or `"data"`, the data
/// gradient, on `(dy, w, _)`) under every autotune candidate, once with each
/// value of a backend switch (`set`), into a poisoned output: the first
/// output of each kernel whose name `want` accepts, in order.
fn outputs_by_kernel(
    c: &mut Ctx,
    g: &ConvGeom,
    product: &str,
    (h0, hw, hb): (&[f32], &[f32], &[f32]),
    set: fn(&mut CudaBackend, bool),
    values: [bool; 2],
    want: fn(&str) -> bool,
) -> Result<Vec<(String, Vec<f32>)>> {
    let (a, w, b) = (c.gpu.upload(h0)?, c.gpu.upload(hw)?, c.gpu.upload(hb)?);
    let mut outs: Vec<(String, Vec<f32>)> = Vec::new();
    for on in values {
        set(&mut c.gpu, on);
        let gpu = &c.gpu;
        gpu.for_each_conv_candidate(g, product, |name| {
            if want(name) && !outs.iter().any(|(n, _)| n == name) {
                let out = if product == "forward" {
                    let mut y = gpu.poisoned(g.y_len())?;
                    gpu.conv_forward(g, &a, &w, &b, &mut y)?;
                    y
                } else {
                    let mut dx = gpu.poisoned(g.x_len())?;
                    gpu.conv_backward_data(g, &a, &w, &mut dx)?;
                    dx
                };
                outs.push((name.to_string(), gpu.download(&out)?));
            }
            Ok(())
        })?;
    }
    Ok(outs)
}

fn conv_ref(c: &mut Ctx, g: &ConvGeom) -> Result<ConvRef> {
    let x = c.randn(g.x_len(), 1.0);
    let (w, b) = (c.randn(g.w_len(), 0.1), c.randn(g.c_out, 1.0));
    let dy = c.randn(g.y_len(), 1.0);
    let (mut y, mut dx, mut dw) = (
        vec![0.0; g.y_len()],
        vec![0.0; g.x_len()],
        vec![0.0; g.w_len()],
    );
    c.cpu.conv_forward(g, &x, &w, &b, &mut y)?;
    c.cpu.conv_backward_data(g, &dy, &w, &mut dx)?;
    c.cpu.conv_backward_filter(g, &x, &dy, &mut dw)?;
    Ok(ConvRef {
        x,
        w,
        b,
        dy,
        y,
        dx,
        dw,
    })
}

/// One product of `g` on the GPU (`"forward"`, `"data"`, `"filter"`) from
/// `r`'s operands, into a poisoned buffer.
fn conv_product(c: &Ctx, g: &ConvGeom, r: &ConvRef, product: &str) -> Result<Vec<f32>> {
    let gpu = &c.gpu;
    let out = match product {
        "forward" => {
            let (x, w, b) = (gpu.upload(&r.x)?, gpu.upload(&r.w)?, gpu.upload(&r.b)?);
            let mut y = gpu.poisoned(g.y_len())?;
            gpu.conv_forward(g, &x, &w, &b, &mut y)?;
            y
        }
        "data" => {
            let (dy, w) = (gpu.upload(&r.dy)?, gpu.upload(&r.w)?);
            let mut dx = gpu.poisoned(g.x_len())?;
            gpu.conv_backward_data(g, &dy, &w, &mut dx)?;
            dx
        }
        _ => {
            let (x, dy) = (gpu.upload(&r.x)?, gpu.upload(&r.dy)?);
            let mut dw = gpu.poisoned(g.w_len())?;
            gpu.conv_backward_filter(g, &x, &dy, &mut dw)?;
            dw
        }
    };
    gpu.download(&out)
}

fn conv_candidates_in(c: &mut Ctx, p: Precision, several: &mut usize) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let r = conv_ref(c, &g)?;
        for (product, want) in [("forward", &r.y), ("data", &r.dx)] {
            let mut outs = Vec::new();
            let n = c.gpu.for_each_conv_candidate(&g, product, |name| {
                outs.push((name.to_string(), conv_product(c, &g, &r, product)?));
                Ok(())
            })?;
            *several += (n > 1) as usize;
            for (name, got) in &outs {
                let what = format!("{case}{label} {product} {name}");
                c.check("conv_autotune", &what, got, want, tol);
            }
            if n > 1 {
                let same = outs.iter().all(|(_, o)| {
                    o.iter()
                        .zip(&outs[0].1)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                });
                let what = format!("{case}{label} {product}: {n} candidates bit-identical");
                c.check_true("conv_autotune", &what, same);
            }
        }
    }
    Ok(())
}

fn autotuned_in(c: &mut Ctx) -> Result<()> {
    let (label, tol) = label_tol(c, Precision::Tf32);
    let mut tuned = 0;
    for (case, g) in conv_cases() {
        let picks = c.gpu.autotune_conv(&g, true)?;
        tuned += picks.len();
        let r = conv_ref(c, &g)?;
        for (product, want) in [("forward", &r.y), ("data", &r.dx), ("filter", &r.dw)] {
            let got = conv_product(c, &g, &r, product)?;
            let what = format!("{case}{label} {product} autotuned");
            c.check("conv_autotune", &what, &got, want, tol);
        }
    }
    c.check_true(
        "conv_autotune",
        "the autotune timed some product",
        tuned > 0,
    );
    c.gpu.set_autotune(false);
    let (_, g) = conv_cases()[0];
    let none = c.gpu.autotune_conv(&g, true)?.is_empty();
    c.check_true("conv_autotune", "off, the autotune does nothing", none);
    Ok(())
}

fn conv_backward_filter_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in conv_cases() {
        let (x, dy) = (c.randn(g.x_len(), 1.0), c.randn(g.y_len(), 1.0));
        let mut want = vec![0.0; g.w_len()];
        c.cpu.conv_backward_filter(&g, &x, &dy, &mut want)?;
        let (gx, gdy) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?);
        let mut gdw = c.gpu.poisoned(g.w_len())?;
        c.gpu.conv_backward_filter(&g, &gx, &gdy, &mut gdw)?;
        let got = c.gpu.download(&gdw)?;
        c.check(
            "conv_backward_filter",
            &format!("{case}{label}"),
            &got,
            &want,
            tol,
        );
    }
    // Large enough batch for the split-K path (AlexNet conv3 at batch 16).
    let g = all_conv_cases()
        .into_iter()
        .find(|(name, _)| name.starts_with("alexnet conv3"))
        .unwrap()
        .1;
    let g = ConvGeom {
        n: if small_only() { 5 } else { 16 },
        ..g
    };
    let (x, dy) = (c.randn(g.x_len(), 1.0), c.randn(g.y_len(), 1.0));
    let mut want = vec![0.0; g.w_len()];
    c.cpu.conv_backward_filter(&g, &x, &dy, &mut want)?;
    let (gx, gdy) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?);
    let mut gdw = c.gpu.poisoned(g.w_len())?;
    c.gpu.conv_backward_filter(&g, &gx, &gdy, &mut gdw)?;
    let got = c.gpu.download(&gdw)?;
    c.check(
        "conv_backward_filter",
        &format!("alexnet conv3 n16 or n5 (split-K){label}"),
        &got,
        &want,
        tol,
    );
    Ok(())
}

fn conv_backward_bias(c: &mut Ctx) -> Result<()> {
    let mut cases = conv_cases();
    // Enough images for the launcher to split them over blocks (partials
    // summed by splitk_reduce): 37 images of 8×15×15, and AlexNet's conv3 at
    // batch 16.
    let split = ConvGeom {
        n: 37,
        c_in: 2,
        h: 15,
        w: 15,
        c_out: 8,
        k_h: 1,
        k_w: 1,
        stride: 1,
        pad: 0,
        groups: 1,
    };
    cases.push(("split over images 37x8x15x15", split));
    if !small_only() {
        let conv3 = all_conv_cases()
            .into_iter()
            .find(|(name, _)| name.starts_with("alexnet conv3"))
            .unwrap()
            .1;
        cases.push(("alexnet conv3 n16 (split)", ConvGeom { n: 16, ..conv3 }));
    }
    for (case, g) in cases {
        let dy = c.randn(g.y_len(), 1.0);
        let mut want = vec![0.0; g.c_out];
        c.cpu.conv_backward_bias(&g, &dy, &mut want)?;
        let gdy = c.gpu.upload(&dy)?;
        let mut gdb = c.gpu.poisoned(g.c_out)?;
        c.gpu.conv_backward_bias(&g, &gdy, &mut gdb)?;
        let got = c.gpu.download(&gdb)?;
        c.check("conv_backward_bias", case, &got, &want, 1e-5);
    }
    Ok(())
}

/// Whether two float arrays hold the same bit patterns.
fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `transpose` against its CPU twin, on a destination poisoned first and
/// longer than needed (the tail must stay untouched).
fn transpose(c: &mut Ctx) -> Result<()> {
    let cases: Vec<(&'static str, (usize, usize, usize))> = keep(vec![
        ("odd 3x37x29", (3, 37, 29)),
        ("batches 9x33x40", (9, 33, 40)),
        ("single 1x1x1", (1, 1, 1)),
        ("tall 2x100x5", (2, 100, 5)),
        ("alexnet conv2 x n2 96x729", (2, 96, 729)),
    ]);
    for (case, (b, r, cols)) in cases {
        let src = c.randn(b * r * cols, 1.0);
        let want = host::backend::cpu::layout::transpose(&src, b, r, cols);
        let gsrc = c.gpu.upload(&src)?;
        let mut gdst = c.gpu.poisoned(want.len() + 33)?;
        let before = c.gpu.download(&gdst)?;
        c.gpu.transpose(&gsrc, &mut gdst, [b, r, cols], Elem::F32)?;
        let got = c.gpu.download(&gdst)?;
        c.check("transpose", case, &got[..want.len()], &want, 0.0);
        let tail_kept = got[want.len()..]
            .iter()
            .zip(&before[want.len()..])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        c.check_true("transpose", &format!("{case} tail untouched"), tail_kept);
        // TF32: the same values rounded, bit for bit.
        let want32 = host::backend::cpu::layout::transpose_tf32(&src, b, r, cols);
        let mut gdst = c.gpu.poisoned(want32.len())?;
        c.gpu
            .transpose(&gsrc, &mut gdst, [b, r, cols], Elem::Tf32)?;
        let got = c.gpu.download(&gdst)?;
        c.check_true(
            "transpose_tf32",
            &format!("{case} bitwise"),
            bits_equal(&got, &want32),
        );
        // bf16 storage: each float of the destination holds two bf16
        // values, the first in its low half; must match bit for bit.
        let want16 = host::backend::cpu::layout::transpose_bf16(&src, b, r, cols);
        let mut gdst = c.gpu.poisoned(want16.len().div_ceil(2))?;
        c.gpu
            .transpose(&gsrc, &mut gdst, [b, r, cols], Elem::Bf16)?;
        let words = c.gpu.download(&gdst)?;
        let got16: Vec<u16> = words
            .iter()
            .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16])
            .take(want16.len())
            .collect();
        let same = got16 == want16;
        c.check_true("transpose_bf16", &format!("{case} bitwise"), same);
        // The row sums over 64-column tiles (dy's partial sums for the bias
        // gradient), with each element type; the transposed copy unchanged.
        let want_sums = host::backend::cpu::layout::transpose_sums(&src, b, r, cols, 64);
        for elem in [Elem::F32, Elem::Tf32, Elem::Bf16] {
            let mut gsums = c.gpu.poisoned(want_sums.len())?;
            let mut gdst = c.gpu.poisoned(want.len())?;
            c.gpu
                .transpose_sums(&gsrc, &mut gdst, [b, r, cols], elem, &mut gsums)?;
            let got = c.gpu.download(&gsums)?;
            // Up to 64 fp32 terms against an f64 sum: ε·√64 ≈ 1e-6.
            c.check(
                "transpose",
                &format!("{case} sums {elem:?}"),
                &got,
                &want_sums,
                1e-5,
            );
            if elem == Elem::F32 {
                let got = c.gpu.download(&gdst)?;
                c.check("transpose", &format!("{case} with sums"), &got, &want, 0.0);
            }
        }
    }
    Ok(())
}

/// `conv_backward_filter_sum` (the TMA weight gradients' split-K sum from
/// GEMM order into dw's) against its CPU twin on a poisoned dw: one slice
/// and several, groups 2, a filter row in two chunks (96 channels × 11×11
/// taps, 64 a chunk), taps padded past a group's channels (48 of 64, as
/// the bf16 kernel's conv2) and AlexNet's conv3 at its 7 slices. Both sum
/// fp32 terms; the GPU in fp32 and a fixed order, the twin in f64, so 1e-6.
fn conv_backward_filter_sum(c: &mut Ctx) -> Result<()> {
    let g = conv_geom;
    let cases = keep(vec![
        (
            "odd 40ch 7x9 k3 f72 one slice",
            (g(3, 40, 7, 9, 72, 3, 1, 0, 1), 40, 1),
        ),
        (
            "5x5 48ch g2 f10 3 slices",
            (g(1, 96, 9, 9, 20, 5, 1, 2, 2), 48, 3),
        ),
        (
            "5x5 48ch of 64 g2 f10 2 slices",
            (g(1, 96, 9, 9, 20, 5, 1, 2, 2), 64, 2),
        ),
        (
            "11x11 96ch g2 two chunks 2 slices",
            (g(1, 192, 15, 15, 6, 11, 1, 0, 2), 96, 2),
        ),
        (
            "alexnet conv3 7 slices",
            (g(4, 256, 13, 13, 384, 3, 1, 1, 1), 256, 7),
        ),
    ]);
    for (case, (geom, cgp, splits)) in cases {
        let len = geom.c_out * geom.k_h * geom.k_w * cgp;
        let ws = c.randn(len * splits, 1.0);
        let mut want = vec![0.0; geom.w_len()];
        host::backend::cpu::conv::conv_backward_filter_sum(&geom, cgp, &ws, &mut want, splits);
        let gws = c.gpu.upload(&ws)?;
        let mut gdw = c.gpu.poisoned(geom.w_len())?;
        c.gpu
            .conv_backward_filter_sum(&geom, cgp, &gws, &mut gdw, splits as u32)?;
        let got = c.gpu.download(&gdw)?;
        c.check("conv_backward_filter_sum", case, &got, &want, 1e-6);
    }
    Ok(())
}

/// `pixel_grid_tf32` against its CPU twin bit for bit, on a destination
/// poisoned first (the padding must be written as zeros): x (KW copies,
/// shifted back past the start) and dy of odd, batch-1, two-group,
/// zero-pad and AlexNet shapes on their grids, one with more stores than
/// the launch has threads.
fn pixel_grid(c: &mut Ctx) -> Result<()> {
    let g = conv_geom;
    let cases = keep(vec![
        ("odd 3x5x7x9 k3 p1", g(3, 5, 7, 9, 6, 3, 1, 1, 1)),
        ("batch1 1x8x6x5 k5 p2 g2", g(1, 8, 6, 5, 4, 5, 1, 2, 2)),
        ("pad0 2x3x5x7 k3", g(2, 3, 5, 7, 2, 3, 1, 0, 1)),
        ("alexnet conv3 b4", g(4, 256, 13, 13, 384, 3, 1, 1, 1)),
        // More 16-byte stores than the launch has threads: each thread
        // loops, its divisors made once.
        ("alexnet conv4 b16 g2", g(16, 384, 13, 13, 384, 3, 1, 1, 2)),
    ]);
    for (case, geom) in cases {
        for (what, gg) in [("x", GridGeom::x(&geom)), ("dy", GridGeom::dy(&geom))] {
            let gg = gg.expect("stride 1");
            let src = c.randn(gg.src_len(), 1.0);
            let want = host::backend::cpu::layout::pixel_grid_tf32(&src, &gg);
            let gsrc = c.gpu.upload(&src)?;
            let mut gdst = c.gpu.poisoned(want.len())?;
            c.gpu.pixel_grid_tf32(&gsrc, &mut gdst, &gg)?;
            let got = c.gpu.download(&gdst)?;
            c.check_true(
                "pixel_grid",
                &format!("{case} {what} bitwise"),
                bits_equal(&got, &want),
            );
        }
    }
    Ok(())
}

/// `row_patches` (fp32, exact), `row_patches_tf32` and `row_patches_bf16`
/// (bit for bit) against their CPU twins, on poisoned destinations, for a convolution's
/// input and its filter bank.
fn row_patches(c: &mut Ctx) -> Result<()> {
    let conv =
        |n, c_in, h, w, c_out, k, stride, pad| conv_geom(n, c_in, h, w, c_out, k, stride, pad, 1);
    let cases = keep(vec![
        (
            "odd 3x3x19x15 k5 s2 p2 rw16",
            (conv(3, 3, 19, 15, 16, 5, 2, 2), 16),
        ),
        (
            "batch1 1x5x9x9 k3 s1 p0 rw24",
            (conv(1, 5, 9, 9, 8, 3, 1, 0), 24),
        ),
        (
            "alexnet conv1 n2 rw40",
            (conv(2, 3, 224, 224, 96, 11, 4, 2), 40),
        ),
    ]);
    for (case, (g, rw)) in cases {
        for (what, rg, src) in [
            ("x", RowGeom::patches(&g, rw), c.randn(g.x_len(), 1.0)),
            ("w", RowGeom::filters(&g, rw), c.randn(g.w_len(), 1.0)),
        ] {
            let want = host::backend::cpu::layout::row_patches(&src, &rg);
            let gsrc = c.gpu.upload(&src)?;
            let mut gdst = c.gpu.poisoned(want.len())?;
            c.gpu.row_patches(&gsrc, &mut gdst, &rg, Elem::F32)?;
            let got = c.gpu.download(&gdst)?;
            c.check("row_patches", &format!("{case} {what}"), &got, &want, 0.0);
            let want32 = host::backend::cpu::layout::row_patches_tf32(&src, &rg);
            let mut gdst = c.gpu.poisoned(want32.len())?;
            c.gpu.row_patches(&gsrc, &mut gdst, &rg, Elem::Tf32)?;
            let got = c.gpu.download(&gdst)?;
            c.check_true(
                "row_patches_tf32",
                &format!("{case} {what} bitwise"),
                bits_equal(&got, &want32),
            );
            let want16 = host::backend::cpu::layout::row_patches_bf16(&src, &rg);
            let mut gdst = c.gpu.poisoned(want16.len().div_ceil(2))?;
            c.gpu.row_patches(&gsrc, &mut gdst, &rg, Elem::Bf16)?;
            let got16: Vec<u16> = c
                .gpu
                .download(&gdst)?
                .iter()
                .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16])
                .take(want16.len())
                .collect();
            c.check_true(
                "row_patches_bf16",
                &format!("{case} {what} bitwise"),
                got16 == want16,
            );
        }
    }
    Ok(())
}

/// bf16 rounding of flat arrays (the fc operand copies): odd lengths (a
/// partial last group of 8), values of every magnitude and sign, ties;
/// bit-identical to the CPU twin.
fn convert_bf16(c: &mut Ctx) -> Result<()> {
    for len in [1usize, 7, 8, 13, 1003, 4096 * 37 + 5] {
        let mut src = c.randn(len, 3.0);
        for (i, v) in src.iter_mut().enumerate() {
            *v *= [1.0, 1e-30, 1e30, -7.5][i % 4];
        }
        // An exact tie (round to even) and its neighbour.
        src[0] = f32::from_bits(0x3f80_8000);
        let want = host::backend::cpu::layout::convert_bf16(&src);
        let gsrc = c.gpu.upload(&src)?;
        let mut gdst = c.gpu.poisoned(len.div_ceil(2))?;
        c.gpu.convert_bf16(&gsrc, &mut gdst)?;
        let got: Vec<u16> = c
            .gpu
            .download(&gdst)?
            .iter()
            .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16])
            .take(len)
            .collect();
        let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let case = format!("len {len} bitwise");
        c.check("convert_bf16", &case, &[wrong as f32], &[0.0], 0.0);
    }
    Ok(())
}

/// TF32 rounding of flat arrays (the fc operand copies in TF32 mode): the
/// same inputs as `convert_bf16` plus a TF32 tie (rounded away from zero);
/// bit-identical to the CPU twin.
fn convert_tf32(c: &mut Ctx) -> Result<()> {
    for len in [1usize, 7, 8, 13, 1003, 4096 * 37 + 5] {
        let mut src = c.randn(len, 3.0);
        for (i, v) in src.iter_mut().enumerate() {
            *v *= [1.0, 1e-30, 1e30, -7.5][i % 4];
        }
        src[0] = f32::from_bits(0x3f80_1000);
        if len > 1 {
            src[1] = f32::from_bits(0xbf80_3000);
        }
        let want = host::backend::cpu::layout::convert_tf32(&src);
        let gsrc = c.gpu.upload(&src)?;
        let mut gdst = c.gpu.poisoned(len)?;
        c.gpu.convert_tf32(&gsrc, &mut gdst)?;
        let got = c.gpu.download(&gdst)?;
        let wrong = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let case = format!("len {len} bitwise");
        c.check("convert_tf32", &case, &[wrong as f32], &[0.0], 0.0);
    }
    Ok(())
}

fn fc_cases() -> Vec<(&'static str, FcGeom)> {
    let g = |n, inputs, outputs| FcGeom { n, inputs, outputs };
    keep(vec![
        ("odd 3x37 -> 29", g(3, 37, 29)),
        ("batch1 1x100 -> 65", g(1, 100, 65)),
        ("odd 67x130 -> 131", g(67, 130, 131)),
        ("split-K forward 5x1100 -> 70", g(5, 1100, 70)),
        ("split-K data gradient 3x90 -> 700", g(3, 90, 700)),
        ("vec odd batch 7x36 -> 20", g(7, 36, 20)),
        ("vec split-K 3x1028 -> 700", g(3, 1028, 700)),
        // Odd rows and slices (5·71): the paired stores' unaligned fallback.
        ("vec split-K odd slices 5x1100 -> 71", g(5, 1100, 71)),
        // Multiples of 8: bf16 operand copies (`*_vec_h16`) in bf16.
        ("h16 odd batch 5x40 -> 24", g(5, 40, 24)),
        ("h16 split-K 3x2056 -> 712", g(3, 2056, 712)),
        ("alexnet fc6 n4 9216 -> 4096", g(4, 9216, 4096)),
        ("alexnet fc7 n128 4096 -> 4096", g(128, 4096, 4096)),
        ("alexnet fc8 n128 4096 -> 1000", g(128, 4096, 1000)),
    ])
}

/// `each_precision_engines` for an fc product.
fn fc_engines(c: &mut Ctx, test: fn(&mut Ctx, Precision) -> Result<()>) -> Result<()> {
    c.fc = true;
    let result = each_precision_engines(c, test);
    c.fc = false;
    result
}

fn fc_forward(c: &mut Ctx) -> Result<()> {
    fc_engines(c, fc_forward_in)
}

fn fc_forward_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in fc_cases() {
        let (x, w, b) = (
            c.randn(g.n * g.inputs, 1.0),
            c.randn(g.outputs * g.inputs, 0.05),
            c.randn(g.outputs, 1.0),
        );
        let mut want = vec![0.0; g.n * g.outputs];
        c.cpu.fc_forward(&g, &x, &w, &b, &mut want)?;
        let (gx, gw, gb) = (c.gpu.upload(&x)?, c.gpu.upload(&w)?, c.gpu.upload(&b)?);
        let mut gy = c.gpu.poisoned(want.len())?;
        c.gpu.fc_forward(&g, &gx, &gw, &gb, &mut gy)?;
        let got = c.gpu.download(&gy)?;
        c.check("fc_forward", &format!("{case}{label}"), &got, &want, tol);
    }
    Ok(())
}

fn fc_backward_data(c: &mut Ctx) -> Result<()> {
    fc_engines(c, fc_backward_data_in)
}

fn fc_backward_data_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in fc_cases() {
        let (dy, w) = (
            c.randn(g.n * g.outputs, 1.0),
            c.randn(g.outputs * g.inputs, 0.05),
        );
        let mut want = vec![0.0; g.n * g.inputs];
        c.cpu.fc_backward_data(&g, &dy, &w, &mut want)?;
        let (gdy, gw) = (c.gpu.upload(&dy)?, c.gpu.upload(&w)?);
        let mut gdx = c.gpu.poisoned(want.len())?;
        c.gpu.fc_backward_data(&g, &gdy, &gw, &mut gdx)?;
        let got = c.gpu.download(&gdx)?;
        c.check(
            "fc_backward_data",
            &format!("{case}{label}"),
            &got,
            &want,
            tol,
        );
    }
    Ok(())
}

fn fc_kept(c: &mut Ctx) -> Result<()> {
    let before = c.checks;
    fc_engines(c, fc_kept_in)?;
    // bf16 on the vector engine keeps w's copy for every h16 case, or
    // nothing was tested.
    let ran = c.checks > before;
    c.check_true("fc_kept", "some case kept a copy of w", ran);
    Ok(())
}

/// The forward that keeps w's bf16 copy (`fc_forward_keep`, the copy
/// poisoned first) and the data gradient that reads it
/// (`fc_backward_data_kept`), given a NaN w so that any read of w itself
/// instead of the copy shows; then a copy buffer one float short, which is
/// passed over (the copy made in scratch from the real w).
fn fc_kept_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in fc_cases() {
        let len = c.gpu.fc_kept_len(&g);
        if len == 0 {
            continue;
        }
        let (x, w, b) = (
            c.randn(g.n * g.inputs, 1.0),
            c.randn(g.outputs * g.inputs, 0.05),
            c.randn(g.outputs, 1.0),
        );
        let dy = c.randn(g.n * g.outputs, 1.0);
        let (mut y, mut dx) = (vec![0.0; g.n * g.outputs], vec![0.0; g.n * g.inputs]);
        c.cpu.fc_forward(&g, &x, &w, &b, &mut y)?;
        c.cpu.fc_backward_data(&g, &dy, &w, &mut dx)?;
        let (gx, gw, gb, gdy) = (
            c.gpu.upload(&x)?,
            c.gpu.upload(&w)?,
            c.gpu.upload(&b)?,
            c.gpu.upload(&dy)?,
        );
        let nan_w = c.gpu.poisoned(w.len())?;
        let case = format!("{case}{label}");
        // `fresh` on a short copy is passed over too (the copy made from w).
        for (what, len, w_arg, fresh) in [
            ("", len, &nan_w, false),
            (" short copy", len - 1, &gw, true),
        ] {
            let (mut gy, mut kept) = (c.gpu.poisoned(y.len())?, c.gpu.poisoned(len)?);
            c.gpu
                .fc_forward_keep(&g, &gx, &gw, &gb, &mut gy, &mut kept, fresh)?;
            let mut gdx = c.gpu.poisoned(dx.len())?;
            c.gpu
                .fc_backward_data_kept(&g, &gdy, w_arg, &kept, &mut gdx)?;
            let (got_y, got_dx) = (c.gpu.download(&gy)?, c.gpu.download(&gdx)?);
            c.check("fc_kept", &format!("{case}{what} y"), &got_y, &y, tol);
            c.check("fc_kept", &format!("{case}{what} dx"), &got_dx, &dx, tol);
            if fresh {
                continue;
            }
            // A fresh copy (as the SGD update leaves it) is read as it is:
            // w itself (NaN here) is not read.
            let mut gy = c.gpu.poisoned(y.len())?;
            c.gpu
                .fc_forward_keep(&g, &gx, w_arg, &gb, &mut gy, &mut kept, true)?;
            let got_y = c.gpu.download(&gy)?;
            c.check("fc_kept", &format!("{case} fresh copy y"), &got_y, &y, tol);
        }
    }
    Ok(())
}

fn fc_backward_filter(c: &mut Ctx) -> Result<()> {
    fc_engines(c, fc_backward_filter_in)
}

fn fc_backward_filter_in(c: &mut Ctx, p: Precision) -> Result<()> {
    let (label, tol) = label_tol(c, p);
    for (case, g) in fc_cases() {
        let (x, dy) = (c.randn(g.n * g.inputs, 1.0), c.randn(g.n * g.outputs, 1.0));
        let mut want = vec![0.0; g.outputs * g.inputs];
        c.cpu.fc_backward_filter(&g, &x, &dy, &mut want)?;
        let (gx, gdy) = (c.gpu.upload(&x)?, c.gpu.upload(&dy)?);
        let mut gdw = c.gpu.poisoned(want.len())?;
        c.gpu.fc_backward_filter(&g, &gx, &gdy, &mut gdw)?;
        let got = c.gpu.download(&gdw)?;
        c.check(
            "fc_backward_filter",
            &format!("{case}{label}"),
            &got,
            &want,
            tol,
        );
    }
    Ok(())
}

fn fc_backward_bias(c: &mut Ctx) -> Result<()> {
    for (case, g) in fc_cases() {
        let dy = c.randn(g.n * g.outputs, 1.0);
        let mut want = vec![0.0; g.outputs];
        c.cpu.fc_backward_bias(&g, &dy, &mut want)?;
        let gdy = c.gpu.upload(&dy)?;
        let mut gdb = c.gpu.poisoned(g.outputs)?;
        c.gpu.fc_backward_bias(&g, &gdy, &mut gdb)?;
        let got = c.gpu.download(&gdb)?;
        c.check("fc_backward_bias", case, &got, &want, 1e-5);
    }
    Ok(())
}

fn elementwise_lens() -> Vec<(&'static str, usize)> {
    keep(vec![
        ("n=1", 1),
        ("n=1001", 1001),
        ("alexnet conv1 out n128", 128 * 96 * 55 * 55),
    ])
}

fn relu_forward(c: &mut Ctx) -> Result<()> {
    for (case, n) in elementwise_lens() {
        let x = c.randn(n, 1.0);
        let mut want = x.clone();
        c.cpu.relu_forward(&mut want)?;
        let mut gy = c.gpu.upload(&x)?;
        c.gpu.relu_forward(&mut gy)?;
        let got = c.gpu.download(&gy)?;
        c.check("relu_forward", case, &got, &want, 0.0);
    }
    Ok(())
}

fn relu_backward(c: &mut Ctx) -> Result<()> {
    for (case, n) in elementwise_lens() {
        let (mut y, d) = (c.randn(n, 1.0), c.randn(n, 1.0));
        c.cpu.relu_forward(&mut y)?;
        let mut want = d.clone();
        c.cpu.relu_backward(&y, &mut want)?;
        let (gy, mut gd) = (c.gpu.upload(&y)?, c.gpu.upload(&d)?);
        c.gpu.relu_backward(&gy, &mut gd)?;
        let got = c.gpu.download(&gd)?;
        c.check("relu_backward", case, &got, &want, 0.0);
    }
    Ok(())
}

fn lrn_cases() -> Vec<(&'static str, LrnParams)> {
    let p = |n, c, h, w, size| LrnParams {
        n,
        c,
        h,
        w,
        size,
        alpha: 1e-4,
        beta: 0.75,
        k: 2.0,
    };
    keep(vec![
        ("odd 3x7x5x9 size5", p(3, 7, 5, 9, 5)),
        ("batch1 1x3x4x4 size5 (window > C)", p(1, 3, 4, 4, 5)),
        ("even size 2x6x3x3 size4", p(2, 6, 3, 3, 4)),
        ("size3 2x5x3x7", p(2, 5, 3, 7, 3)),
        ("size1 1x4x2x3", p(1, 4, 2, 3, 1)),
        (
            "size7 2x11x3x3 strong alpha",
            LrnParams {
                alpha: 0.3,
                ..p(2, 11, 3, 3, 7)
            },
        ),
        (
            "strong alpha 2x9x5x5",
            LrnParams {
                alpha: 0.5,
                ..p(2, 9, 5, 5, 5)
            },
        ),
        // Channel runs of 32 per thread: windows crossing run boundaries.
        (
            "runs 2x37x3x5 size5 strong alpha",
            LrnParams {
                alpha: 0.5,
                ..p(2, 37, 3, 5, 5)
            },
        ),
        ("runs 1x65x2x2 size3", p(1, 65, 2, 2, 3)),
        ("runs generic 2x40x3x3 size4", p(2, 40, 3, 3, 4)),
        ("alexnet lrn1 n8 96x55x55", p(8, 96, 55, 55, 5)),
        ("alexnet lrn2 n8 256x27x27", p(8, 256, 27, 27, 5)),
    ])
}

fn lrn_forward(c: &mut Ctx) -> Result<()> {
    for (case, p) in lrn_cases() {
        let x = c.randn(p.len(), 3.0);
        let (mut want_y, mut want_s) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        c.cpu.lrn_forward(&p, &x, &mut want_y, &mut want_s)?;
        let gx = c.gpu.upload(&x)?;
        let (mut gy, mut gs) = (c.gpu.poisoned(p.len())?, c.gpu.poisoned(p.len())?);
        c.gpu.lrn_forward(&p, &gx, &mut gy, &mut gs)?;
        let (got_y, got_s) = (c.gpu.download(&gy)?, c.gpu.download(&gs)?);
        c.check("lrn_forward", &format!("{case} y"), &got_y, &want_y, 1e-5);
        c.check(
            "lrn_forward",
            &format!("{case} scale"),
            &got_s,
            &want_s,
            1e-5,
        );
    }
    Ok(())
}

fn lrn_backward(c: &mut Ctx) -> Result<()> {
    // Plain, then with the preceding ReLU's backward fused: there x is a
    // ReLU output (about half zeros) and dx must be zero exactly there.
    for relu in [false, true] {
        for (case, p) in lrn_cases() {
            let mut x = c.randn(p.len(), 3.0);
            if relu {
                x.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            let dy = c.randn(p.len(), 1.0);
            let (mut y, mut s) = (vec![0.0; p.len()], vec![0.0; p.len()]);
            c.cpu.lrn_forward(&p, &x, &mut y, &mut s)?;
            let mut want = vec![0.0; p.len()];
            let (gx, gy, gs, gdy) = (
                c.gpu.upload(&x)?,
                c.gpu.upload(&y)?,
                c.gpu.upload(&s)?,
                c.gpu.upload(&dy)?,
            );
            let mut gdx = c.gpu.poisoned(p.len())?;
            if relu {
                c.cpu.lrn_backward_relu(&p, &x, &y, &s, &dy, &mut want)?;
                c.gpu.lrn_backward_relu(&p, &gx, &gy, &gs, &gdy, &mut gdx)?;
            } else {
                c.cpu.lrn_backward(&p, &x, &y, &s, &dy, &mut want)?;
                c.gpu.lrn_backward(&p, &gx, &gy, &gs, &gdy, &mut gdx)?;
            }
            let got = c.gpu.download(&gdx)?;
            let case = format!("{case}{}", if relu { " +relu" } else { "" });
            c.check("lrn_backward", &case, &got, &want, 1e-5);
            if relu {
                c.check_relu_mask("lrn_backward", &case, &got, &x);
            }
        }
    }
    Ok(())
}

/// LRN then max pool shapes for the fused pair: odd planes, batch 1,
/// channel runs of 32 crossed, runs not a multiple of the kernels' 4-channel
/// steps, uncovered bottom/right inputs, odd plane sizes (2×2 blocks cut at
/// the edge), several row tiles per plane (the last one shorter, owning the
/// uncovered rows; 64 columns fill the backward's 256-thread block
/// exactly), and AlexNet's norm1/pool1 and norm2/pool2.
fn lrn_pool_cases() -> Vec<(&'static str, (LrnParams, PoolGeom))> {
    let pair = |n, c, h, w, size, pool, alpha| {
        let p = LrnParams {
            n,
            c,
            h,
            w,
            size,
            alpha,
            beta: 0.75,
            k: 2.0,
        };
        let g = PoolGeom {
            n,
            c,
            h,
            w,
            size: pool,
            stride: 2,
        };
        (p, g)
    };
    let case = |name, pg: (LrnParams, PoolGeom)| (name, pg);
    keep(vec![
        case("odd 3x7x13x11 size5 3/2", pair(3, 7, 13, 11, 5, 3, 1e-4)),
        case("batch1 1x3x9x9 size5 3/2", pair(1, 3, 9, 9, 5, 3, 0.5)),
        case("size3 2x5x8x6 2/2", pair(2, 5, 8, 6, 3, 2, 0.5)),
        case("runs 2x37x7x9 size3 3/2", pair(2, 37, 7, 9, 3, 3, 0.5)),
        case("runs 1x65x6x5 size5 2/2", pair(1, 65, 6, 5, 5, 2, 0.5)),
        case("tail 2x4x10x12 size5 3/2", pair(2, 4, 10, 12, 5, 3, 0.5)),
        case("odd tail 1x6x13x7 size3 2/2", pair(1, 6, 13, 7, 3, 2, 0.5)),
        case(
            "single window 1x2x3x3 size5 3/2",
            pair(1, 2, 3, 3, 5, 3, 0.5),
        ),
        case("one channel 2x1x7x7 size5 3/2", pair(2, 1, 7, 7, 5, 3, 0.5)),
        case("tiles 2x9x41x37 size5 3/2", pair(2, 9, 41, 37, 5, 3, 0.5)),
        case(
            "tiles even 1x5x30x21 size3 3/2",
            pair(1, 5, 30, 21, 3, 3, 0.5),
        ),
        case(
            "tiles odd 1x6x33x17 size5 2/2",
            pair(1, 6, 33, 17, 5, 2, 0.5),
        ),
        case("widest 1x3x9x64 size5 3/2", pair(1, 3, 9, 64, 5, 3, 0.5)),
        case(
            "tiles+runs 2x41x23x29 size5 3/2",
            pair(2, 41, 23, 29, 5, 3, 1e-4),
        ),
        case(
            "alexnet norm1+pool1 n4 96x55x55",
            pair(4, 96, 55, 55, 5, 3, 1e-4),
        ),
        case(
            "alexnet norm2+pool2 n4 256x27x27",
            pair(4, 256, 27, 27, 5, 3, 1e-4),
        ),
    ])
}

fn lrn_pool_forward(c: &mut Ctx) -> Result<()> {
    for (case, (p, g)) in lrn_pool_cases() {
        if !c.gpu.lrn_pool_fusable(&p, &g) {
            c.failures
                .push(format!("lrn_pool_forward {case}: not fusable"));
            continue;
        }
        let x = c.randn(p.len(), 3.0);
        let (mut want, mut want_arg) = (vec![0.0; g.y_len()], vec![0.0; g.y_len()]);
        c.cpu
            .lrn_pool_forward(&p, &g, &x, &mut want, &mut want_arg)?;
        let gx = c.gpu.upload(&x)?;
        let (mut gz, mut garg) = (c.gpu.poisoned(g.y_len())?, c.gpu.poisoned(g.y_len())?);
        c.gpu.lrn_pool_forward(&p, &g, &gx, &mut gz, &mut garg)?;
        let (got, got_arg) = (c.gpu.download(&gz)?, c.gpu.download(&garg)?);
        c.check("lrn_pool_forward", &format!("{case} z"), &got, &want, 1e-5);
        // The argmax may differ from the reference's only where the two
        // picks' LRN outputs tie to within the LRN tolerance.
        let (mut y, mut s) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        c.cpu.lrn_forward(&p, &x, &mut y, &mut s)?;
        let (oh, ow) = (g.out_h(), g.out_w());
        let y_at = |o: usize, at: f32| {
            let (plane, q) = (o / (oh * ow), o % (oh * ow));
            let at = at as usize;
            let (r, col) = ((q / ow) * 2 + at / g.size, (q % ow) * 2 + at % g.size);
            y[(plane * g.h + r) * g.w + col]
        };
        let unexplained = (0..g.y_len())
            .filter(|&o| {
                let (a, b) = (got_arg[o], want_arg[o]);
                !(a == b
                    || a.fract() == 0.0
                        && (0.0..(g.size * g.size) as f32).contains(&a)
                        && (y_at(o, a) - y_at(o, b)).abs() <= 1e-5 * y_at(o, b).abs())
            })
            .count();
        let case = format!("{case} argmax (off only at ties)");
        c.check(
            "lrn_pool_forward",
            &case,
            &[unexplained as f32],
            &[0.0],
            0.0,
        );
    }
    // Shapes the fused kernels do not take are refused, not mis-run.
    let (p, g) = lrn_pool_cases()[0].1;
    let refused = [
        (LrnParams { size: 7, ..p }, g),
        (p, PoolGeom { stride: 1, ..g }),
        (p, PoolGeom { c: g.c + 1, ..g }),
        // Wider than the fused kernels' tiles.
        (LrnParams { w: 65, ..p }, PoolGeom { w: 65, ..g }),
    ]
    .iter()
    .filter(|(p, g)| !c.gpu.lrn_pool_fusable(p, g))
    .count();
    c.check(
        "lrn_pool_forward",
        "other shapes refused",
        &[refused as f32],
        &[4.0],
        0.0,
    );
    Ok(())
}

fn lrn_pool_backward(c: &mut Ctx) -> Result<()> {
    // As lrn_backward: plain, then with the preceding ReLU's backward (x a
    // ReLU output, dx exactly zero where x is). Both sides route by the
    // GPU forward's argmax, so ties cannot make them differ.
    for relu in [false, true] {
        for (case, (p, g)) in lrn_pool_cases() {
            let mut x = c.randn(p.len(), 3.0);
            if relu {
                x.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            let dz = c.randn(g.y_len(), 1.0);
            let gx = c.gpu.upload(&x)?;
            let (mut gz, mut garg) = (c.gpu.zeros(g.y_len())?, c.gpu.zeros(g.y_len())?);
            c.gpu.lrn_pool_forward(&p, &g, &gx, &mut gz, &mut garg)?;
            let arg = c.gpu.download(&garg)?;
            let mut want = vec![0.0; p.len()];
            c.cpu
                .lrn_pool_backward(&p, &g, &x, &arg, &dz, &mut want, relu)?;
            let gdz = c.gpu.upload(&dz)?;
            let mut gdx = c.gpu.poisoned(p.len())?;
            c.gpu
                .lrn_pool_backward(&p, &g, &gx, &garg, &gdz, &mut gdx, relu)?;
            let got = c.gpu.download(&gdx)?;
            let case = format!("{case}{}", if relu { " +relu" } else { "" });
            c.check("lrn_pool_backward", &case, &got, &want, 1e-5);
            if relu {
                c.check_relu_mask("lrn_pool_backward", &case, &got, &x);
            }
        }
    }
    Ok(())
}

fn pool_cases() -> Vec<(&'static str, PoolGeom)> {
    let g = |n, c, h, w, size, stride| PoolGeom {
        n,
        c,
        h,
        w,
        size,
        stride,
    };
    keep(vec![
        ("odd 3x5x13x11 3/2", g(3, 5, 13, 11, 3, 2)),
        ("batch1 1x1x9x9 3/2", g(1, 1, 9, 9, 3, 2)),
        ("non-overlapping 2x3x8x6 2/2", g(2, 3, 8, 6, 2, 2)),
        // Stride 2, windows 2 and 3 (unrolled kernels): uncovered last
        // row and column, small planes many to a block.
        ("2/2 odd tail 2x3x9x7", g(2, 3, 9, 7, 2, 2)),
        ("3/2 even 2x3x10x12", g(2, 3, 10, 12, 3, 2)),
        ("3/2 small planes 3x301x5x6", g(3, 301, 5, 6, 3, 2)),
        ("gapped 2x2x10x10 2/3", g(2, 2, 10, 10, 2, 3)),
        ("3 windows per row 2x3x7x9 3/1", g(2, 3, 7, 9, 3, 1)),
        ("5/2 1x2x11x12", g(1, 2, 11, 12, 5, 2)),
        // size ≤ 2·stride (one thread per stride×stride block): edges.
        ("size = 2·stride 2x3x10x9 4/2", g(2, 3, 10, 9, 4, 2)),
        ("5/3 batch1 1x4x17x16", g(1, 4, 17, 16, 5, 3)),
        ("gapped odd 1x3x11x8 2/3", g(1, 3, 11, 8, 2, 3)),
        (
            "gapped, uncovered tail 2x2x13x14 3/4",
            g(2, 2, 13, 14, 3, 4),
        ),
        ("subsample 1x2x7x6 1/2", g(1, 2, 7, 6, 1, 2)),
        ("single window 1x2x3x3 3/2", g(1, 2, 3, 3, 3, 2)),
        ("single window 1x1x5x4 4/3", g(1, 1, 5, 4, 4, 3)),
        (
            "planes beyond the grid 1x70000x3x3 2/1",
            g(1, 70_000, 3, 3, 2, 1),
        ),
        ("alexnet pool1 n8 96x55x55", g(8, 96, 55, 55, 3, 2)),
        ("alexnet pool2 n8 256x27x27", g(8, 256, 27, 27, 3, 2)),
        ("alexnet pool5 n8 256x13x13", g(8, 256, 13, 13, 3, 2)),
    ])
}

/// Random input with ties (values on a coarse grid) to exercise the tie rule.
fn pool_input(c: &mut Ctx, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| (c.rng.random_range(-8i32..8) as f32) * 0.25)
        .collect()
}

fn maxpool_forward(c: &mut Ctx) -> Result<()> {
    for (case, g) in pool_cases() {
        let x = pool_input(c, g.x_len());
        let (mut want, mut want_arg) = (vec![0.0; g.y_len()], vec![0.0; g.y_len()]);
        c.cpu.maxpool_forward(&g, &x, &mut want, &mut want_arg)?;
        let gx = c.gpu.upload(&x)?;
        let (mut gy, mut garg) = (c.gpu.poisoned(g.y_len())?, c.gpu.poisoned(g.y_len())?);
        c.gpu.maxpool_forward(&g, &gx, &mut gy, &mut garg)?;
        let got = c.gpu.download(&gy)?;
        c.check("maxpool_forward", case, &got, &want, 0.0);
        let got = c.gpu.download(&garg)?;
        c.check(
            "maxpool_forward",
            &format!("{case} argmax"),
            &got,
            &want_arg,
            0.0,
        );
    }
    Ok(())
}

fn maxpool_backward(c: &mut Ctx) -> Result<()> {
    for (case, g) in pool_cases() {
        let (x, dy) = (pool_input(c, g.x_len()), c.randn(g.y_len(), 1.0));
        let (mut y, mut arg) = (vec![0.0; g.y_len()], vec![0.0; g.y_len()]);
        c.cpu.maxpool_forward(&g, &x, &mut y, &mut arg)?;
        let mut want = vec![0.0; g.x_len()];
        c.cpu.maxpool_backward(&g, &arg, &dy, &mut want)?;
        let (garg, gdy) = (c.gpu.upload(&arg)?, c.gpu.upload(&dy)?);
        let mut gdx = c.gpu.poisoned(g.x_len())?;
        c.gpu.maxpool_backward(&g, &garg, &gdy, &mut gdx)?;
        let got = c.gpu.download(&gdx)?;
        c.check("maxpool_backward", case, &got, &want, 1e-6);
        // Through the ReLU before the pool (its output x: about half zeros,
        // so some windows are all zero and must pass nothing): against the
        // reference's pool backward followed by its ReLU backward.
        let xr: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
        c.cpu.maxpool_forward(&g, &xr, &mut y, &mut arg)?;
        c.cpu
            .maxpool_backward_relu(&g, &arg, &xr, &y, &dy, &mut want)?;
        let (garg, gx, gy) = (c.gpu.upload(&arg)?, c.gpu.upload(&xr)?, c.gpu.upload(&y)?);
        let mut gdx = c.gpu.poisoned(g.x_len())?;
        c.gpu
            .maxpool_backward_relu(&g, &garg, &gx, &gy, &gdy, &mut gdx)?;
        let got = c.gpu.download(&gdx)?;
        let case = format!("{case} +relu");
        c.check("maxpool_backward", &case, &got, &want, 1e-6);
        c.check_relu_mask("maxpool_backward", &case, &got, &xr);
    }
    Ok(())
}

fn dropout_cases(c: &mut Ctx) -> Vec<(String, DropoutParams, usize)> {
    let seed = c.rng.random::<u64>();
    vec![
        (
            "p=0.5 n=1".into(),
            DropoutParams {
                p: 0.5,
                seed,
                step: 3,
            },
            1,
        ),
        (
            "p=0.5 n=4099".into(),
            DropoutParams {
                p: 0.5,
                seed,
                step: 7,
            },
            4099,
        ),
        (
            "p=0 n=1000 (identity)".into(),
            DropoutParams {
                p: 0.0,
                seed,
                step: 1,
            },
            1000,
        ),
        (
            "p=0.3 step 2^33 n=10007".into(),
            DropoutParams {
                p: 0.3,
                seed,
                step: 1 << 33,
            },
            10007,
        ),
        (
            "alexnet fc6 n128 p=0.5".into(),
            DropoutParams {
                p: 0.5,
                seed,
                step: 12345,
            },
            128 * 4096,
        ),
    ]
}

fn dropout_forward(c: &mut Ctx) -> Result<()> {
    for (case, p, n) in dropout_cases(c) {
        let x = c.randn(n, 1.0);
        let mut want = x.clone();
        c.cpu.dropout_forward(&p, &mut want)?;
        let mut gy = c.gpu.upload(&x)?;
        c.gpu.dropout_forward(&p, &mut gy)?;
        let got = c.gpu.download(&gy)?;
        c.check("dropout_forward", &case, &got, &want, 0.0);
        if p.p > 0.0 && n > 1000 {
            let kept = got.iter().filter(|v| **v != 0.0).count() as f64 / n as f64;
            let ok = (kept - (1.0 - p.p as f64)).abs() < 5.0 / (n as f64).sqrt();
            c.check_true(
                "dropout_forward",
                &format!("{case} keep rate {kept:.3}"),
                ok,
            );
        }
    }
    Ok(())
}

fn dropout_backward(c: &mut Ctx) -> Result<()> {
    for (case, p, n) in dropout_cases(c) {
        let d = c.randn(n, 1.0);
        let mut want = d.clone();
        c.cpu.dropout_backward(&p, &mut want)?;
        let mut gd = c.gpu.upload(&d)?;
        c.gpu.dropout_backward(&p, &mut gd)?;
        let got = c.gpu.download(&gd)?;
        c.check("dropout_backward", &case, &got, &want, 0.0);
    }
    Ok(())
}

fn loss_cases() -> Vec<(&'static str, usize, usize)> {
    vec![
        ("batch1 classes 3", 1, 3),
        ("odd 37 x 333", 37, 333),
        ("alexnet n128 x 1000", 128, 1000),
        ("wide 5 x 4099", 5, 4099),
    ]
}

fn labels(c: &mut Ctx, n: usize, classes: usize) -> Vec<i32> {
    (0..n)
        .map(|_| c.rng.random_range(0..classes as i32))
        .collect()
}

fn softmax_xent_forward(c: &mut Ctx) -> Result<()> {
    for (case, n, k) in loss_cases() {
        let logits = c.randn(n * k, 20.0);
        let lab = labels(c, n, k);
        let (mut want_p, mut want_l) = (vec![0.0; n * k], vec![0.0; n]);
        c.cpu
            .softmax_xent_forward(n, k, &logits, &lab, &mut want_p, &mut want_l)?;
        let (gz, gl) = (c.gpu.upload(&logits)?, c.gpu.upload_labels(&lab)?);
        let (mut gp, mut gloss) = (c.gpu.poisoned(n * k)?, c.gpu.poisoned(n)?);
        c.gpu
            .softmax_xent_forward(n, k, &gz, &gl, &mut gp, &mut gloss)?;
        let (got_p, got_l) = (c.gpu.download(&gp)?, c.gpu.download(&gloss)?);
        c.check(
            "softmax_xent_forward",
            &format!("{case} probs"),
            &got_p,
            &want_p,
            1e-5,
        );
        // `ln` of the softmax denominator comes from PTX `lg2.approx`, whose
        // absolute error is ≤ 2^-22 (≈ 2.4e-7, ≈ 3.4e-7 was seen on one
        // sample): losses are held to 1e-5 relative, but never tighter than
        // 5e-7 absolute per sample (floor 0.05·√n).
        let floor = 0.05 * (n as f64).sqrt();
        c.check_floor(
            "softmax_xent_forward",
            &format!("{case} loss"),
            &got_l,
            &want_l,
            1e-5,
            floor,
        );
    }
    Ok(())
}

fn softmax_xent_backward(c: &mut Ctx) -> Result<()> {
    for (case, n, k) in loss_cases() {
        let logits = c.randn(n * k, 5.0);
        let lab = labels(c, n, k);
        let (mut p, mut l) = (vec![0.0; n * k], vec![0.0; n]);
        c.cpu
            .softmax_xent_forward(n, k, &logits, &lab, &mut p, &mut l)?;
        let mut want = vec![0.0; n * k];
        c.cpu.softmax_xent_backward(n, k, &p, &lab, &mut want)?;
        let (gp, gl) = (c.gpu.upload(&p)?, c.gpu.upload_labels(&lab)?);
        let mut gd = c.gpu.poisoned(n * k)?;
        c.gpu.softmax_xent_backward(n, k, &gp, &gl, &mut gd)?;
        let got = c.gpu.download(&gd)?;
        c.check("softmax_xent_backward", case, &got, &want, 1e-6);
    }
    Ok(())
}

fn label_rank(c: &mut Ctx) -> Result<()> {
    for (case, n, k) in loss_cases() {
        // Coarse values so that ties with the true class occur.
        let scores: Vec<f32> = (0..n * k)
            .map(|_| c.rng.random_range(0..20) as f32)
            .collect();
        let lab = labels(c, n, k);
        let mut want = vec![0.0; n];
        c.cpu.label_rank(n, k, &scores, &lab, &mut want)?;
        let (gs, gl) = (c.gpu.upload(&scores)?, c.gpu.upload_labels(&lab)?);
        let mut gr = c.gpu.poisoned(n)?;
        c.gpu.label_rank(n, k, &gs, &gl, &mut gr)?;
        let got = c.gpu.download(&gr)?;
        c.check("label_rank", case, &got, &want, 0.0);
    }
    Ok(())
}

/// `sgd_update_all` against its CPU twin, bit for bit (tolerance 0: the
/// same fp32 operations in the same order, `mul.rn`/`add.rn` in the PTX, no
/// fused multiply-add), for both rules: a list of odd lengths around the
/// kernel's 1024-element chunk (an empty tensor included) and AlexNet's 16
/// parameter tensors. Each list is updated twice with one table and a new
/// learning rate and momentum the second time (the per-step values must be
/// rewritten); then the table is reused for a shorter list (rebuilt), and
/// the tensors left out must stay untouched.
fn sgd_update_all(c: &mut Ctx) -> Result<()> {
    let alexnet = host::config::Config::from_str(
        include_str!("../configs/alexnet.json"),
        "configs/alexnet.json",
    )?;
    let alexnet_lens: Vec<usize> = alexnet
        .model
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product())
        .collect();
    let cases = keep(vec![
        (
            "odd lengths",
            vec![1usize, 0, 1023, 1024, 1025, 4099, 3, 77_777],
        ),
        ("alexnet 16 tensors", alexnet_lens),
    ]);
    // The copies are bf16, or TF32 (a float per weight) in TF32 mode.
    let modes = [
        (SgdRule::Pytorch, Precision::Bf16),
        (SgdRule::Paper, Precision::Bf16),
        (SgdRule::Pytorch, Precision::Tf32),
    ];
    for (rule, prec) in modes {
        c.gpu.set_precision(prec)?;
        let tf32 = prec == Precision::Tf32;
        let kind = if tf32 { "TF32" } else { "bf16" };
        for (case, lens) in &cases {
            let host: Vec<[Vec<f32>; 3]> = lens
                .iter()
                .map(|&n| [c.randn(n, 0.01), c.randn(n, 1.0), c.randn(n, 0.1)])
                .collect();
            let mut want: Vec<[Vec<f32>; 3]> = host.clone();
            let mut gpu = host
                .iter()
                .map(|[w, g, v]| Ok([c.gpu.upload(w)?, c.gpu.upload(g)?, c.gpu.upload(v)?]))
                .collect::<Result<Vec<_>>>()?;
            let mut table = host::backend::cuda::SgdTable::default();
            // Every other tensor refreshes a copy of its weights (an fc
            // layer's kept operand copy), poisoned first.
            let mut halves = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| match i % 2 == 1 && n > 0 {
                    true => c
                        .gpu
                        .poisoned(if tf32 { n } else { n.div_ceil(2) })
                        .map(Some),
                    false => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            let params = [(0.01, 0.9, 5e-4), (0.003, 0.8, 1e-3), (0.02, 0.9, 0.0)];
            for (call, &(lr, momentum, weight_decay)) in params.iter().enumerate() {
                let p = SgdParams {
                    lr,
                    momentum,
                    weight_decay,
                    rule,
                };
                // The third call updates only the first half of the list.
                let used = if call == 2 {
                    lens.len() / 2
                } else {
                    lens.len()
                };
                let mut cpu_t: Vec<_> = want[..used]
                    .iter_mut()
                    .map(|[w, g, v]| SgdTensor {
                        w,
                        g: &*g,
                        v,
                        copy: None,
                    })
                    .collect();
                c.cpu.sgd_update_all(&p, &mut cpu_t, &mut ())?;
                let mut gpu_t: Vec<_> = gpu[..used]
                    .iter_mut()
                    .zip(halves.iter_mut())
                    .map(|([w, g, v], h)| SgdTensor {
                        w,
                        g: &*g,
                        v,
                        copy: h.as_mut(),
                    })
                    .collect();
                c.gpu.sgd_update_all(&p, &mut gpu_t, &mut table)?;
                let what = match call {
                    0 => "first call",
                    1 => "second call, new lr",
                    _ => "shorter list",
                };
                let (mut got_w, mut got_v, mut ref_w, mut ref_v) = (vec![], vec![], vec![], vec![]);
                for ([w, _, v], [rw, _, rv]) in gpu.iter().zip(&want) {
                    got_w.extend(c.gpu.download(w)?);
                    got_v.extend(c.gpu.download(v)?);
                    ref_w.extend_from_slice(rw);
                    ref_v.extend_from_slice(rv);
                }
                c.check(
                    "sgd_update_all",
                    &format!("{rule:?} {kind} {case}, {what}: w"),
                    &got_w,
                    &ref_w,
                    0.0,
                );
                c.check(
                    "sgd_update_all",
                    &format!("{rule:?} {kind} {case}, {what}: v"),
                    &got_v,
                    &ref_v,
                    0.0,
                );
                let (mut copies, mut wrong) = (0, 0);
                for (h, [rw, _, _]) in halves.iter().zip(&want) {
                    let Some(h) = h else { continue };
                    let got = c.gpu.download(h)?;
                    wrong += if tf32 {
                        let want = rw.iter().map(|&w| host::backend::cpu::layout::to_tf32(w));
                        got.iter()
                            .zip(want)
                            .filter(|(a, b)| a.to_bits() != b.to_bits())
                            .count()
                    } else {
                        let got = got
                            .iter()
                            .flat_map(|w| [w.to_bits() as u16, (w.to_bits() >> 16) as u16]);
                        let want = host::backend::cpu::layout::convert_bf16(rw);
                        got.zip(&want).filter(|(a, b)| a != *b).count()
                    };
                    copies += 1;
                }
                c.check(
                    "sgd_update_all",
                    &format!("{rule:?} {case}, {what}: {copies} {kind} copies bitwise"),
                    &[wrong as f32],
                    &[0.0],
                    0.0,
                );
            }
        }
    }
    c.gpu.set_precision(Precision::Fp32)?;
    Ok(())
}

/// `configs/tiny.json` (grouped conv, LRN, pooling, fc, dropout) trained for
/// a few steps on both backends from the same initial weights and batches.
/// Dropout stays on: its masks are bit-identical on both backends. The
/// weights must stay within 1e-4 (fp32 rounding differences grow slowly
/// through the SGD steps).
fn train_steps(c: &mut Ctx) -> Result<()> {
    let cfg =
        host::config::Config::from_str(include_str!("../configs/tiny.json"), "configs/tiny.json")?;
    let batch = 6;
    let mut cpu_model = Model::new(&c.cpu, &cfg.model, batch, 7)?;
    let mut gpu_model = Model::new(&c.gpu, &cfg.model, batch, 7)?;
    let sgd = SgdParams {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
        rule: SgdRule::Pytorch,
    };
    let classes = cfg.model.classes;
    for step in 0..4u64 {
        let x = c.randn(batch * cfg.model.input_len(), 1.0);
        let y = labels(c, batch, classes);
        cpu_model.set_batch(&c.cpu, &x, &y)?;
        gpu_model.set_batch(&c.gpu, &x, &y)?;
        let dropout = Some((3u64, step));
        cpu_model.forward(&c.cpu, dropout)?;
        cpu_model.backward(&c.cpu, dropout)?;
        cpu_model.sgd_step(&c.cpu, &sgd)?;
        gpu_model.forward(&c.gpu, dropout)?;
        gpu_model.backward(&c.gpu, dropout)?;
        gpu_model.sgd_step(&c.gpu, &sgd)?;
        let (cl, _) = cpu_model.read_metrics(&c.cpu)?;
        let (gl, _) = gpu_model.read_metrics(&c.gpu)?;
        c.check("train_steps", &format!("step {step} loss"), &gl, &cl, 1e-4);
    }
    let want = cpu_model.download_params(&c.cpu, false)?;
    let got = gpu_model.download_params(&c.gpu, false)?;
    for (w, g) in want.iter().zip(&got) {
        c.check(
            "train_steps",
            &format!("after 4 steps {}", w.name),
            &g.data,
            &w.data,
            1e-4,
        );
    }
    Ok(())
}

/// Checks that two GPU models' weights and momentum buffers are
/// bit-identical (tolerance 0), one comparison per tensor.
fn same_params(
    c: &mut Ctx,
    test: &str,
    case: &str,
    want: &Model<CudaBackend>,
    got: &Model<CudaBackend>,
) -> Result<()> {
    for momentum in [false, true] {
        let what = if momentum { "momentum" } else { "weights" };
        let (w, g) = (
            want.download_params(&c.gpu, momentum)?,
            got.download_params(&c.gpu, momentum)?,
        );
        for (w, g) in w.iter().zip(&g) {
            c.check(
                test,
                &format!("{case} {} {what}", w.name),
                &g.data,
                &w.data,
                0.0,
            );
        }
    }
    Ok(())
}

/// Checks that two GPU models' last per-sample losses are bit-identical.
fn same_losses(
    c: &mut Ctx,
    test: &str,
    case: &str,
    want: &Model<CudaBackend>,
    got: &Model<CudaBackend>,
) -> Result<()> {
    let (w, _) = want.read_metrics(&c.gpu)?;
    let (g, _) = got.read_metrics(&c.gpu)?;
    c.check(test, &format!("{case} losses"), &g, &w, 0.0);
    Ok(())
}

/// `configs/tiny.json` and `configs/alexnet.json`, as the binary embeds them.
fn tiny_and_alexnet() -> Result<(host::config::Config, host::config::Config)> {
    let tiny = host::config::Config::from_str(include_str!("../configs/tiny.json"), "tiny.json")?;
    let alexnet =
        host::config::Config::from_str(include_str!("../configs/alexnet.json"), "alexnet.json")?;
    Ok((tiny, alexnet))
}

/// The training step captured as a CUDA graph and replayed
/// (`host::step_graph::StepRunner`) against the same steps run eagerly:
/// two GPU models from one initialisation, the same random batches, dropout
/// on and a learning rate that changes every step. The parameters, momentum
/// buffers and each step's losses must be bit-identical (tolerance 0). The
/// runner steps first, so its first eager step grows the backend's scratch
/// buffers (where the model needs more than it had), which makes it no
/// warm-up: one or two eager steps, then capture and replay (a capture
/// after a step that moved a buffer fails: the TMA data gradients' tensor
/// maps point at the scratch copies). Halfway a setting is re-applied
/// (`set_precision`), which makes the graph stale, so it must run one
/// eager step and capture again. Cases: `configs/tiny.json` at batch
/// 6 in fp32, TF32 and bf16, and `configs/alexnet.json` at batch 16 in TF32
/// and bf16 (split-K workspaces, channels-last scratch); the paper's SGD
/// rule in one of them.
fn train_steps_graph(c: &mut Ctx) -> Result<()> {
    use host::step_graph::StepRunner;
    let (tiny, alexnet) = tiny_and_alexnet()?;
    // The last field: TF32 fc products on rounded operand copies, the SGD
    // update refreshing the weights' copies between replays.
    let cases = keep(vec![
        (
            "tiny b6 fp32",
            (&tiny, 6, Precision::Fp32, SgdRule::Pytorch, false),
        ),
        (
            "tiny b6 tf32",
            (&tiny, 6, Precision::Tf32, SgdRule::Paper, false),
        ),
        (
            "tiny b6 bf16",
            (&tiny, 6, Precision::Bf16, SgdRule::Pytorch, false),
        ),
        (
            "alexnet b16 tf32",
            (&alexnet, 16, Precision::Tf32, SgdRule::Pytorch, false),
        ),
        (
            "alexnet b16 tf32 copies",
            (&alexnet, 16, Precision::Tf32, SgdRule::Pytorch, true),
        ),
        (
            "alexnet b16 bf16",
            (&alexnet, 16, Precision::Bf16, SgdRule::Pytorch, false),
        ),
    ]);
    const STEPS: u64 = 6;
    let test = "train_steps_graph";
    let tf32_copies = c.gpu.tf32_copies();
    for (case, (cfg, batch, precision, rule, copies)) in cases {
        c.gpu.set_precision(precision)?;
        c.gpu.set_tf32_copies(copies);
        let mut eager = Model::new(&c.gpu, &cfg.model, batch, 11)?;
        let mut graphed = Model::new(&c.gpu, &cfg.model, batch, 11)?;
        let mut runner = StepRunner::new(&c.gpu, true);
        println!(
            "  {case}: {STEPS} steps eager vs as a CUDA graph, dropout on, lr changing each step"
        );
        for step in 0..STEPS {
            if step == STEPS / 2 {
                // Same precision: only marks captured graphs stale.
                c.gpu.set_precision(precision)?;
            }
            let x = c.randn(batch * cfg.model.input_len(), 1.0);
            let y = labels(c, batch, cfg.model.classes);
            let sgd = SgdParams {
                lr: 0.02 * 0.8f32.powi(step as i32),
                momentum: 0.9,
                weight_decay: 5e-4,
                rule,
            };
            let dropout = (5u64, 100 + step);
            graphed.set_batch(&c.gpu, &x, &y)?;
            runner.step(&c.gpu, &mut graphed, dropout, &sgd)?;
            eager.set_batch(&c.gpu, &x, &y)?;
            eager.train_step(&c.gpu, dropout, &sgd)?;
            same_losses(c, test, &format!("{case} step {step}"), &eager, &graphed)?;
        }
        let s = runner.stats();
        println!("    runner: {}", runner.describe());
        c.check_true(
            test,
            &format!(
                "{case} runner: eager {} capture {} replay {} (want 2 or 3, 2, {} less the eager ones)",
                s.eager, s.captures, s.replays, STEPS
            ),
            runner.uses_graph()
                && (2..=3).contains(&s.eager)
                && s.captures == 2
                && s.replays == STEPS - s.eager,
        );
        same_params(c, test, case, &eager, &graphed)?;
    }
    c.gpu.set_tf32_copies(tf32_copies);
    c.gpu.set_precision(Precision::Fp32)?;
    Ok(())
}

/// Ranges of one arena (`Backend::arena`) as buffers: two that share bytes
/// read what either wrote, one beside them keeps its own, and a fourth,
/// live when none of them is, spans the whole arena and sees each where the
/// plan put it (the padding between them still zero).
fn arena_parts(c: &mut Ctx) -> Result<()> {
    use host::arena::{ALIGN, ArenaBuf, ArenaPlan};
    let test = "arena_parts";
    let (n, m) = (1000usize, 777usize);
    let span = n.next_multiple_of(ALIGN) + m.next_multiple_of(ALIGN);
    let plan = ArenaPlan::new(&[
        ArenaBuf { len: n, live: 0..2 },
        ArenaBuf { len: n, live: 2..4 },
        ArenaBuf { len: m, live: 0..4 },
        ArenaBuf {
            len: span,
            live: 4..5,
        },
    ]);
    let arena_on = c.gpu.arena_enabled();
    c.gpu.set_arena(true);
    let bufs = c.gpu.arena(&plan);
    c.gpu.set_arena(arena_on);
    let mut bufs = bufs?;
    c.check_true(
        test,
        "planned: 0 and 1 share, 2 after them, 3 over all",
        plan.offsets == [0, 0, n.next_multiple_of(ALIGN), 0] && plan.total == span,
    );
    let (a, b) = (c.randn(n, 1.0), c.randn(m, 1.0));
    c.gpu.write(&mut bufs[0], &a)?;
    c.gpu.write(&mut bufs[2], &b)?;
    let through_1 = c.gpu.download(&bufs[1])?;
    c.check(test, "1 reads what 0 wrote", &through_1, &a, 0.0);
    let own = c.gpu.download(&bufs[2])?;
    c.check(test, "2 keeps its own", &own, &b, 0.0);
    let mut want = vec![0.0f32; span];
    want[plan.range(0)].copy_from_slice(&a);
    want[plan.range(2)].copy_from_slice(&b);
    let whole = c.gpu.download(&bufs[3])?;
    c.check(test, "3 sees both at their offsets", &whole, &want, 0.0);
    Ok(())
}

/// The model's arena with buffers sharing bytes (`Model::new`) against
/// every buffer apart (`Model::new_apart`): the same training steps must
/// give bit-identical losses, weights and momentum (tolerance 0), since the
/// same kernels run on the same values; a buffer written over one still
/// needed (a read the memory plan missed) would show. AlexNet (fused
/// LRN+pool, ReLUs in the conv epilogues) at batch 8 in TF32 and bf16, and
/// `configs/tiny.json` in fp32.
fn arena_sharing(c: &mut Ctx) -> Result<()> {
    let (tiny, alexnet) = tiny_and_alexnet()?;
    let cases = keep(vec![
        ("tiny b6 fp32", (&tiny, 6, Precision::Fp32)),
        ("alexnet b8 tf32", (&alexnet, 8, Precision::Tf32)),
        ("alexnet b8 bf16", (&alexnet, 8, Precision::Bf16)),
    ]);
    let test = "arena_sharing";
    for (case, (cfg, batch, precision)) in cases {
        c.gpu.set_precision(precision)?;
        let mut shared = Model::new(&c.gpu, &cfg.model, batch, 13)?;
        let mut apart = Model::new_apart(&c.gpu, &cfg.model, batch, 13)?;
        let (s, a) = (shared.arena(), apart.arena());
        println!(
            "  {case}: arena {:.1} MiB shared, {:.1} MiB apart",
            s.total as f64 * 4.0 / (1 << 20) as f64,
            a.total as f64 * 4.0 / (1 << 20) as f64
        );
        c.check_true(
            test,
            &format!("{case} sharing saves bytes"),
            s.total < a.total,
        );
        let sgd = SgdParams {
            lr: 0.02,
            momentum: 0.9,
            weight_decay: 5e-4,
            rule: SgdRule::Pytorch,
        };
        for step in 0..3u64 {
            let x = c.randn(batch * cfg.model.input_len(), 1.0);
            let y = labels(c, batch, cfg.model.classes);
            for m in [&mut shared, &mut apart] {
                m.set_batch(&c.gpu, &x, &y)?;
                m.train_step(&c.gpu, (9, step), &sgd)?;
            }
            same_losses(c, test, &format!("{case} step {step}"), &apart, &shared)?;
        }
        same_params(c, test, case, &apart, &shared)?;
    }
    c.gpu.set_precision(Precision::Fp32)?;
    Ok(())
}

/// Large writes go through two pinned staging buffers used in turn, with
/// asynchronous copies: back-to-back writes (reusing a buffer while the copy
/// out of it may still be queued, and overwriting a device buffer) must land
/// exactly.
/// Large writes go through the staging slots and the upload stream while
/// the compute stream is kept busy (ReLUs over a 1 GB buffer queued first),
/// so a copy that did not wait for the compute stream's earlier read of its
/// slot, or a read that did not wait for its copy, shows as wrong data.
fn staged_writes(c: &mut Ctx) -> Result<()> {
    c.gpu.set_pinned_uploads(true);
    let mut busy = c.gpu.upload(&vec![1.0; 1 << 28])?;
    for len in [(1 << 18) + 17, 3 << 18] {
        let data: Vec<Vec<f32>> = (0..5).map(|_| c.randn(len, 1.0)).collect();
        let mut bufs: Vec<_> = (0..3).map(|_| c.gpu.poisoned(len)).collect::<Result<_>>()?;
        for _ in 0..8 {
            c.gpu.relu_forward(&mut busy)?;
        }
        // Five writes alternate over the two staging slots; buffer 2 is
        // written three times, the last write must win. Each buffer is
        // read by a kernel (ReLU in place) right after its first write.
        for (i, d) in data.iter().enumerate() {
            c.gpu.write(&mut bufs[i.min(2)], d)?;
            if i < 2 {
                c.gpu.relu_forward(&mut bufs[i])?;
            }
        }
        let relu = |v: &Vec<f32>| v.iter().map(|x| x.max(0.0)).collect::<Vec<f32>>();
        for (i, want) in [relu(&data[0]), relu(&data[1]), data[4].clone()]
            .iter()
            .enumerate()
        {
            let got = c.gpu.download(&bufs[i])?;
            c.check(
                "staged_writes",
                &format!("{len} floats, buffer {i}"),
                &got,
                want,
                0.0,
            );
        }
    }
    Ok(())
}
