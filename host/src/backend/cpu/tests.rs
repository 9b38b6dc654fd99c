//! Tests of the CPU reference ops: finite-difference checks of every backward
//! pass, small hand-computed cases, a brute-force conv, the Philox
//! known-answer vectors, the SGD rules and the max-pool tie rule.
//!
//! Finite differences: for a random `r`, `L(in) = Σ r·op(in)` is evaluated in
//! f64 from the op's f32 outputs, and `(L(in + h) − L(in − h)) / (2h)` (with the
//! step actually representable in f32) is compared with the backward pass fed
//! `dy = r`. Each entry's error is measured against the largest gradient
//! entry. Tolerance `1e-3`: the outputs are rounded to f32 (relative 6e-8), a
//! perturbation moves at most a few dozen O(1) outputs, so with `h = 1e-2` the
//! rounding noise in the quotient is ≲ 1e-4; truncation is zero for the linear
//! ops and O(h²) ≈ 1e-4 for LRN and softmax. Observed worst cases are below
//! 2e-5; a wrong index, window bound or factor gives errors of order 0.1–1.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;

const FD_STEP: f32 = 1e-2;
const FD_TOL: f64 = 1e-3;

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

fn random_vec(rng: &mut StdRng, len: usize, range: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-range..range)).collect()
}

/// An output buffer poisoned with NaN, so a read-before-write shows up.
fn poisoned(len: usize) -> Vec<f32> {
    vec![f32::NAN; len]
}

fn dot(r: &[f32], out: &[f32]) -> f64 {
    assert_eq!(r.len(), out.len());
    r.iter().zip(out).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Compares `analytic` with central differences of `objective` around `input`.
fn check_gradient(name: &str, input: &[f32], analytic: &[f32], objective: impl Fn(&[f32]) -> f64) {
    assert_eq!(input.len(), analytic.len(), "{name}: gradient length");
    let numeric: Vec<f64> = (0..input.len())
        .map(|i| {
            let mut plus = input.to_vec();
            let mut minus = input.to_vec();
            plus[i] += FD_STEP;
            minus[i] -= FD_STEP;
            (objective(&plus) - objective(&minus)) / (plus[i] as f64 - minus[i] as f64)
        })
        .collect();
    let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(
        scale > 1e-3,
        "{name}: gradient is (numerically) zero, nothing tested"
    );
    for (i, (&num, &ana)) in numeric.iter().zip(analytic).enumerate() {
        let err = (num - ana as f64).abs() / scale;
        assert!(
            err <= FD_TOL,
            "{name}[{i}]: numeric {num}, analytic {ana}, relative error {err:e}"
        );
    }
}

fn assert_close(name: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * w.abs().max(1.0),
            "{name}[{i}]: got {g}, want {w}"
        );
    }
}

// ---------------------------------------------------------------- conv

/// Stride 2, pad 1, groups 2, odd and unequal kernel and input sizes.
const CONV: ConvGeom = ConvGeom {
    n: 2,
    c_in: 4,
    h: 7,
    w: 8,
    c_out: 6,
    k_h: 3,
    k_w: 5,
    stride: 2,
    pad: 1,
    groups: 2,
};

fn conv(g: &ConvGeom, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut y = poisoned(g.y_len());
    conv::conv_forward(g, x, w, b, &mut y);
    y
}

/// The definition, written independently: signed coordinates, explicit
/// bounds test per tap.
fn conv_brute_force(g: &ConvGeom, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f64> {
    let (oh, ow) = (g.out_h(), g.out_w());
    let (cin_g, cout_g) = (g.c_in / g.groups, g.c_out / g.groups);
    let mut y = Vec::new();
    for n in 0..g.n {
        for oc in 0..g.c_out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = b[oc] as f64;
                    for ci in 0..cin_g {
                        let c = (oc / cout_g) * cin_g + ci;
                        for ky in 0..g.k_h {
                            for kx in 0..g.k_w {
                                let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                                let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                                if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                    continue;
                                }
                                let xv =
                                    x[((n * g.c_in + c) * g.h + iy as usize) * g.w + ix as usize];
                                let wv = w[((oc * cin_g + ci) * g.k_h + ky) * g.k_w + kx];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    y.push(acc);
                }
            }
        }
    }
    y
}

#[test]
fn conv_forward_hand_computed() {
    // 3×3 input 1..9, 3×3 kernel of ones, pad 1, stride 2: each output is the
    // sum of one 2×2 corner of the input, plus the bias.
    let g = ConvGeom {
        n: 1,
        c_in: 1,
        h: 3,
        w: 3,
        c_out: 1,
        k_h: 3,
        k_w: 3,
        stride: 2,
        pad: 1,
        groups: 1,
    };
    let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
    let y = conv(&g, &x, &[1.0; 9], &[0.5]);
    assert_close("conv pad/stride", &y, &[12.5, 16.5, 24.5, 28.5], 0.0);

    // Two groups of one channel, 1×1 kernels: output c only sees input c.
    let g = ConvGeom {
        n: 1,
        c_in: 2,
        h: 1,
        w: 2,
        c_out: 2,
        k_h: 1,
        k_w: 1,
        stride: 1,
        pad: 0,
        groups: 2,
    };
    let y = conv(&g, &[1.0, 2.0, 3.0, 4.0], &[10.0, 100.0], &[0.0, 1.0]);
    assert_close("conv groups", &y, &[10.0, 20.0, 301.0, 401.0], 0.0);

    // 2×2 kernel, valid, stride 1 on a 2×3 input.
    let g = ConvGeom {
        n: 1,
        c_in: 1,
        h: 2,
        w: 3,
        c_out: 1,
        k_h: 2,
        k_w: 2,
        stride: 1,
        pad: 0,
        groups: 1,
    };
    let y = conv(
        &g,
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        &[1.0, -1.0, 2.0, 0.5],
        &[0.0],
    );
    // [1−2+8+2.5, 2−3+10+3]
    assert_close("conv valid", &y, &[9.5, 12.0], 0.0);
}

#[test]
fn conv_forward_matches_brute_force() {
    let mut r = rng(1);
    let g = CONV;
    let x = random_vec(&mut r, g.x_len(), 1.0);
    let w = random_vec(&mut r, g.w_len(), 1.0);
    let b = random_vec(&mut r, g.c_out, 1.0);
    assert_close(
        "conv",
        &conv(&g, &x, &w, &b),
        &conv_brute_force(&g, &x, &w, &b),
        1e-6,
    );
}

#[test]
fn conv_backward_finite_differences() {
    let mut r = rng(2);
    let g = CONV;
    let x = random_vec(&mut r, g.x_len(), 1.0);
    let w = random_vec(&mut r, g.w_len(), 1.0);
    let b = random_vec(&mut r, g.c_out, 1.0);
    let dy = random_vec(&mut r, g.y_len(), 1.0);

    let mut dx = poisoned(g.x_len());
    conv::conv_backward_data(&g, &dy, &w, &mut dx);
    check_gradient("conv dx", &x, &dx, |x| dot(&dy, &conv(&g, x, &w, &b)));

    let mut dw = poisoned(g.w_len());
    conv::conv_backward_filter(&g, &x, &dy, &mut dw);
    check_gradient("conv dw", &w, &dw, |w| dot(&dy, &conv(&g, &x, w, &b)));

    let mut db = poisoned(g.c_out);
    conv::conv_backward_bias(&g, &dy, &mut db);
    check_gradient("conv db", &b, &db, |b| dot(&dy, &conv(&g, &x, &w, b)));
}

/// `want` with the ReLU mask applied where `masked` (0 where `mask` ≤ 0).
fn masked_want(want: &[f32], mask: &[f32], masked: bool) -> Vec<f64> {
    want.iter()
        .zip(mask)
        .map(|(&d, m)| if !masked || *m > 0.0 { d as f64 } else { 0.0 })
        .collect()
}

/// Random dy, w and mask of `g`, and the direct data gradient from them.
fn data_grad_case(r: &mut StdRng, g: &ConvGeom) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (dy, w) = (random_vec(r, g.y_len(), 1.0), random_vec(r, g.w_len(), 1.0));
    let mask = random_vec(r, g.x_len(), 1.0);
    let mut want = poisoned(g.x_len());
    conv::conv_backward_data(g, &dy, &w, &mut want);
    (dy, w, mask, want)
}

/// The data gradient by columns (the GPU's path for strided layers with
/// few channels) equals the direct one, in two chunks of images, groups 2,
/// stride 3, with and without the ReLU mask.
#[test]
fn conv_data_by_columns_matches_direct() {
    let mut r = rng(7);
    let g = ConvGeom {
        n: 3,
        c_in: 4,
        h: 11,
        w: 9,
        c_out: 6,
        k_h: 5,
        k_w: 4,
        stride: 3,
        pad: 2,
        groups: 2,
    };
    let (dy, w, mask, want) = data_grad_case(&mut r, &g);
    let per_img = g.c_in * g.k_h * g.k_w * g.out_h() * g.out_w();
    for masked in [false, true] {
        let mut got = poisoned(g.x_len());
        for imgs in [0..2, 2..3] {
            let mut cols = poisoned(imgs.len() * per_img);
            conv::conv_backward_data_cols(&g, &dy, &w, &mut cols, imgs.clone());
            conv::conv_cols_sum(&g, &cols, &mut got, masked.then_some(&mask[..]), imgs);
        }
        let want = masked_want(&want, &mask, masked);
        assert_close("conv dx by columns", &got, &want, 1e-5);
    }
}

/// The data gradient by phases (the GPU's path for strided layers) equals
/// the direct one: the stride-1 data gradient of `ConvGeom::phases` over
/// the rearranged filters, put in place by `conv_phase_scatter`, with and
/// without the ReLU mask, on conv1's window and stride, groups 2 with a
/// 5×4 window at stride 3, a window smaller than the stride, and a shape
/// whose last input rows and columns no tap reaches (they must be 0).
#[test]
fn conv_data_by_phases_matches_direct() {
    let mut r = rng(9);
    for g in [
        [2, 3, 31, 27, 4, 11, 11, 4, 2, 1],
        [3, 4, 11, 9, 6, 5, 4, 3, 2, 2],
        [1, 2, 8, 7, 3, 2, 1, 3, 0, 1],
        [2, 2, 13, 14, 2, 3, 3, 4, 0, 1],
    ]
    .map(ConvGeom::of)
    {
        let p = g.phases();
        assert_eq!((p.out_h(), p.out_w()), (g.out_h(), g.out_w()), "{g:?}");
        let (dy, w, mask, want) = data_grad_case(&mut r, &g);
        let mut wp = poisoned(p.w_len());
        conv::conv_phase_filters(&g, &w, &mut wp);
        let mut yp = poisoned(p.x_len());
        conv::conv_backward_data(&p, &dy, &wp, &mut yp);
        for masked in [false, true] {
            let mut got = poisoned(g.x_len());
            conv::conv_phase_scatter(&g, &yp, &mut got, masked.then_some(&mask[..]));
            let want = masked_want(&want, &mask, masked);
            assert_close(&format!("conv dx by phases {g:?}"), &got, &want, 1e-5);
        }
    }
}

/// The weight gradient as the TMA kernels make it: per slice of images,
/// its partial in GEMM order `[f][(kh·KW + kw)·cgp + c]` (cgp = Cg, or
/// more with poisoned columns past Cg); the sum of the slices
/// (`conv_backward_filter_sum`) equals the direct weight gradient of the
/// whole batch (groups 2, a 3×4 window, one slice and three).
#[test]
fn conv_filter_sum_of_gemm_ordered_slices_matches_direct() {
    let mut r = rng(8);
    let g = ConvGeom {
        n: 3,
        c_in: 6,
        h: 7,
        w: 9,
        c_out: 4,
        k_h: 3,
        k_w: 4,
        stride: 1,
        pad: 1,
        groups: 2,
    };
    let (x, dy) = (
        random_vec(&mut r, g.x_len(), 1.0),
        random_vec(&mut r, g.y_len(), 1.0),
    );
    let mut want = poisoned(g.w_len());
    conv::conv_backward_filter(&g, &x, &dy, &mut want);
    let (kk, cg) = (g.k_h * g.k_w, g.c_in / g.groups);
    let one_slice: Vec<std::ops::Range<usize>> = std::iter::once(0..3).collect();
    for (slices, cgp) in [(one_slice, cg), (vec![0..1, 1..2, 2..3], cg + 5)] {
        let mut ws = Vec::new();
        for imgs in &slices {
            let gs = ConvGeom { n: imgs.len(), ..g };
            let xs = &x[imgs.start * g.c_in * g.h * g.w..imgs.end * g.c_in * g.h * g.w];
            let per = g.c_out * g.out_h() * g.out_w();
            let dys = &dy[imgs.start * per..imgs.end * per];
            let mut part = poisoned(g.w_len());
            conv::conv_backward_filter(&gs, xs, dys, &mut part);
            let mut gemm = poisoned(g.c_out * kk * cgp);
            for f in 0..g.c_out {
                for c in 0..cg {
                    for tap in 0..kk {
                        gemm[(f * kk + tap) * cgp + c] = part[(f * cg + c) * kk + tap];
                    }
                }
            }
            ws.extend(gemm);
        }
        let mut got = poisoned(g.w_len());
        conv::conv_backward_filter_sum(&g, cgp, &ws, &mut got, slices.len());
        let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        assert_close("conv dw from GEMM-ordered slices", &got, &want, 1e-5);
    }
}

// ---------------------------------------------------------------- fc

#[test]
fn fc_hand_computed() {
    let g = FcGeom {
        n: 1,
        inputs: 2,
        outputs: 2,
    };
    let mut y = poisoned(2);
    gemm::fc_forward(
        &g,
        &[1.0, 2.0],
        &[3.0, 4.0, -1.0, 0.5],
        &[0.25, 1.0],
        &mut y,
    );
    assert_close("fc", &y, &[11.25, 1.0], 0.0);
}

#[test]
fn fc_backward_finite_differences() {
    let mut r = rng(3);
    let g = FcGeom {
        n: 3,
        inputs: 5,
        outputs: 4,
    };
    let x = random_vec(&mut r, g.n * g.inputs, 1.0);
    let w = random_vec(&mut r, g.outputs * g.inputs, 1.0);
    let b = random_vec(&mut r, g.outputs, 1.0);
    let dy = random_vec(&mut r, g.n * g.outputs, 1.0);
    let fc = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut y = poisoned(g.n * g.outputs);
        gemm::fc_forward(&g, x, w, b, &mut y);
        dot(&dy, &y)
    };

    let mut dx = poisoned(x.len());
    gemm::fc_backward_data(&g, &dy, &w, &mut dx);
    check_gradient("fc dx", &x, &dx, |x| fc(x, &w, &b));

    let mut dw = poisoned(w.len());
    gemm::fc_backward_filter(&g, &x, &dy, &mut dw);
    check_gradient("fc dw", &w, &dw, |w| fc(&x, w, &b));

    let mut db = poisoned(b.len());
    gemm::fc_backward_bias(&g, &dy, &mut db);
    check_gradient("fc db", &b, &db, |b| fc(&x, &w, b));
}

// ---------------------------------------------------------------- relu

#[test]
fn relu_forward_and_backward() {
    let mut r = rng(4);
    // Values at least 0.1 away from the kink, so ±h never crosses it.
    let x: Vec<f32> = (0..40)
        .map(|i| r.random_range(0.1..1.0f32) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    let dy = random_vec(&mut r, x.len(), 1.0);
    let relu = |x: &[f32]| {
        let mut y = x.to_vec();
        activation::relu_forward(&mut y);
        y
    };
    let y = relu(&x);
    for (&xv, &yv) in x.iter().zip(&y) {
        assert_eq!(yv, xv.max(0.0));
    }
    let mut d = dy.clone();
    activation::relu_backward(&y, &mut d);
    check_gradient("relu", &x, &d, |x| dot(&dy, &relu(x)));
}

// ---------------------------------------------------------------- lrn

fn lrn(p: &LrnParams, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut y = poisoned(p.len());
    let mut scale = poisoned(p.len());
    lrn::lrn_forward(p, x, &mut y, &mut scale);
    (y, scale)
}

#[test]
fn lrn_hand_computed() {
    // One pixel, x = [1, 2, 3], k = 1, α = 1, β = 1/2: y = x / √scale.
    let x = [1.0f32, 2.0, 3.0];
    let p = LrnParams {
        n: 1,
        c: 3,
        h: 1,
        w: 1,
        size: 3,
        alpha: 1.0,
        beta: 0.5,
        k: 1.0,
    };
    let (y, scale) = lrn(&p, &x);
    // Windows {0,1}, {0,1,2}, {1,2}.
    let want_scale = [6.0, 15.0, 14.0];
    assert_close("lrn scale (size 3)", &scale, &want_scale, 1e-7);
    let want_y: Vec<f64> = x
        .iter()
        .zip(want_scale)
        .map(|(&x, s)| x as f64 / s.sqrt())
        .collect();
    assert_close("lrn y (size 3)", &y, &want_y, 1e-6);

    // Even size 2: window(c) = {c − 1, c}.
    let p = LrnParams { size: 2, ..p };
    let (_, scale) = lrn(&p, &x);
    assert_close("lrn scale (size 2)", &scale, &[2.0, 6.0, 14.0], 1e-7);

    // k and α enter as scale = k + α·Σ, β as the exponent.
    let p = LrnParams {
        size: 1,
        alpha: 0.5,
        beta: 2.0,
        k: 3.0,
        ..p
    };
    let (y, scale) = lrn(&p, &x);
    assert_close("lrn scale (size 1)", &scale, &[3.5, 5.0, 7.5], 1e-7);
    assert_close(
        "lrn y (size 1)",
        &y,
        &[1.0 / 12.25, 2.0 / 25.0, 3.0 / 56.25],
        1e-6,
    );
}

#[test]
fn lrn_backward_finite_differences() {
    for size in [5, 4, 1] {
        let mut r = rng(5 + size as u64);
        // α large enough that the cross-channel term matters.
        let p = LrnParams {
            n: 2,
            c: 7,
            h: 2,
            w: 3,
            size,
            alpha: 0.3,
            beta: 0.75,
            k: 2.0,
        };
        let x = random_vec(&mut r, p.len(), 2.0);
        let dy = random_vec(&mut r, p.len(), 1.0);
        let (y, scale) = lrn(&p, &x);
        let mut dx = poisoned(p.len());
        lrn::lrn_backward(&p, &x, &y, &scale, &dy, &mut dx);
        check_gradient(&format!("lrn dx (size {size})"), &x, &dx, |x| {
            dot(&dy, &lrn(&p, x).0)
        });
    }
}

#[test]
fn lrn_pool_backward_finite_differences() {
    // The fused LRN + max pool (the GPU's one-pass pair) on its own: the
    // composition's backward against finite differences of its forward.
    for (size, pool, relu) in [(5, 3, false), (3, 2, true)] {
        let mut r = rng(20 + size as u64);
        let p = LrnParams {
            n: 2,
            c: 6,
            h: 5,
            w: 6,
            size,
            alpha: 0.3,
            beta: 0.75,
            k: 2.0,
        };
        let g = PoolGeom {
            n: 2,
            c: 6,
            h: 5,
            w: 6,
            size: pool,
            stride: 2,
        };
        // Distinct positive values 0.05 apart (a ReLU's output where `relu`),
        // so ±h never changes a window's argmax.
        let mut x: Vec<f32> = (0..p.len()).map(|i| 0.1 + i as f32 * 0.05).collect();
        x.shuffle(&mut r);
        let dz = random_vec(&mut r, g.y_len(), 1.0);
        let fwd = |x: &[f32]| {
            let (mut z, mut arg) = (poisoned(g.y_len()), poisoned(g.y_len()));
            lrn::lrn_pool_forward(&p, &g, x, &mut z, &mut arg);
            (z, arg)
        };
        let (_, arg) = fwd(&x);
        let mut dx = poisoned(p.len());
        lrn::lrn_pool_backward(&p, &g, &x, &arg, &dz, &mut dx, relu);
        check_gradient(&format!("lrn_pool dx ({size}, {pool}/2)"), &x, &dx, |x| {
            dot(&dz, &fwd(x).0)
        });
    }
}

// ---------------------------------------------------------------- maxpool

fn maxpool(g: &PoolGeom, x: &[f32]) -> Vec<f32> {
    maxpool_arg(g, x).0
}

/// The forward pass's output and saved argmax offsets.
fn maxpool_arg(g: &PoolGeom, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut y, mut arg) = (poisoned(g.y_len()), poisoned(g.y_len()));
    pool::maxpool_forward(g, x, &mut y, &mut arg);
    (y, arg)
}

#[test]
fn maxpool_backward_finite_differences() {
    let mut r = rng(6);
    let g = PoolGeom {
        n: 2,
        c: 2,
        h: 7,
        w: 8,
        size: 3,
        stride: 2,
    };
    // Distinct values 0.1 apart, so ±h never changes a window's argmax.
    let mut x: Vec<f32> = (0..g.x_len()).map(|i| i as f32 * 0.1).collect();
    x.shuffle(&mut r);
    let dy = random_vec(&mut r, g.y_len(), 1.0);
    let (_, arg) = maxpool_arg(&g, &x);
    let mut dx = poisoned(g.x_len());
    pool::maxpool_backward(&g, &arg, &dy, &mut dx);
    check_gradient("maxpool dx", &x, &dx, |x| dot(&dy, &maxpool(&g, x)));
}

#[test]
fn maxpool_hand_computed_and_ties() {
    // 3×3 plane, 2×2 windows at stride 1.
    let g = PoolGeom {
        n: 1,
        c: 1,
        h: 3,
        w: 3,
        size: 2,
        stride: 1,
    };
    let x = [1.0, 5.0, 2.0, 5.0, 3.0, 5.0, 0.0, 4.0, 4.0];
    assert_close("maxpool y", &maxpool(&g, &x), &[5.0, 5.0, 5.0, 5.0], 0.0);

    // Window (0,0) has 5 at (0,1) and (1,0): first in row-major is (0,1).
    // Window (0,1) has 5 at (0,1) and (1,2): (0,1). Window (1,0): (1,0).
    // Window (1,1): 5 at (1,2) only.
    let (_, arg) = maxpool_arg(&g, &x);
    // Offsets a·2 + b in each 2×2 window.
    assert_close("maxpool arg", &arg, &[1.0, 0.0, 0.0, 1.0], 0.0);
    let mut dx = poisoned(9);
    pool::maxpool_backward(&g, &arg, &[1.0, 2.0, 4.0, 8.0], &mut dx);
    assert_close(
        "maxpool ties",
        &dx,
        &[0.0, 3.0, 0.0, 4.0, 0.0, 8.0, 0.0, 0.0, 0.0],
        0.0,
    );

    // A constant plane: every window routes to its top-left element.
    let (_, arg) = maxpool_arg(&g, &[7.0; 9]);
    assert_close("maxpool flat arg", &arg, &[0.0; 4], 0.0);
    let mut dx = poisoned(9);
    pool::maxpool_backward(&g, &arg, &[1.0, 2.0, 4.0, 8.0], &mut dx);
    assert_close(
        "maxpool flat",
        &dx,
        &[1.0, 2.0, 0.0, 4.0, 8.0, 0.0, 0.0, 0.0, 0.0],
        0.0,
    );
}

// ---------------------------------------------------------------- dropout

#[test]
fn philox_known_answers() {
    // Random123's kat_vectors for philox4x32_10.
    assert_eq!(
        dropout::philox4x32_10([0; 4], [0; 2]),
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    );
    assert_eq!(
        dropout::philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    );
    assert_eq!(
        dropout::philox4x32_10(
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0]
        ),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}

#[test]
fn dropout_mask_follows_the_counter_scheme() {
    let seed = 0x1234_5678_9abc_def0u64;
    let step = (7u64 << 32) | 3;
    let p = DropoutParams { p: 0.4, seed, step };
    let len = 4099; // not a multiple of 4
    let mut y = vec![1.0f32; len];
    dropout::dropout_forward(&p, &mut y);
    let scale = 1.0f32 / (1.0 - 0.4);
    let mut kept = 0;
    for (i, &v) in y.iter().enumerate() {
        let block = (i / 4) as u64;
        let words = dropout::philox4x32_10(
            [
                block as u32,
                (block >> 32) as u32,
                step as u32,
                (step >> 32) as u32,
            ],
            [seed as u32, (seed >> 32) as u32],
        );
        let u = (words[i % 4] >> 8) as f64 / (1u64 << 24) as f64;
        let want = if u >= 0.4 { scale } else { 0.0 };
        assert_eq!(v, want, "element {i} (u = {u})");
        kept += (v != 0.0) as usize;
    }
    // Binomial(4099, 0.6): mean 2459, sd 31.
    assert!((2300..2620).contains(&kept), "kept {kept} of {len}");

    // Another step gives another mask.
    let mut y2 = vec![1.0f32; len];
    dropout::dropout_forward(
        &DropoutParams {
            step: step + 1,
            ..p
        },
        &mut y2,
    );
    assert_ne!(y, y2);

    // p = 0 leaves values unchanged.
    let mut r = rng(7);
    let x = random_vec(&mut r, 37, 3.0);
    let mut y = x.clone();
    dropout::dropout_forward(&DropoutParams { p: 0.0, ..p }, &mut y);
    assert_eq!(x, y);
}

#[test]
fn dropout_backward_finite_differences() {
    let mut r = rng(8);
    let p = DropoutParams {
        p: 0.3,
        seed: 99,
        step: 5,
    };
    let x = random_vec(&mut r, 37, 1.0);
    let dy = random_vec(&mut r, x.len(), 1.0);
    let drop = |x: &[f32]| {
        let mut y = x.to_vec();
        dropout::dropout_forward(&p, &mut y);
        y
    };
    let mut d = dy.clone();
    dropout::dropout_backward(&p, &mut d);
    assert!(d.contains(&0.0), "no element dropped, mask untested");
    check_gradient("dropout", &x, &d, |x| dot(&dy, &drop(x)));
}

// ---------------------------------------------------------------- loss

fn softmax_xent(n: usize, classes: usize, logits: &[f32], labels: &[i32]) -> (Vec<f32>, Vec<f32>) {
    let mut probs = poisoned(n * classes);
    let mut loss = poisoned(n);
    loss::softmax_xent_forward(n, classes, logits, labels, &mut probs, &mut loss);
    (probs, loss)
}

#[test]
fn softmax_xent_hand_computed() {
    // Uniform logits: p = 1/4, loss = ln 4. Second row: logits ln 1, ln 2, ln 3, ln 4.
    let logits = [0.0, 0.0, 0.0, 0.0, 0.0, 2f32.ln(), 3f32.ln(), 4f32.ln()];
    let (probs, loss) = softmax_xent(2, 4, &logits, &[2, 1]);
    assert_close(
        "probs",
        &probs,
        &[0.25, 0.25, 0.25, 0.25, 0.1, 0.2, 0.3, 0.4],
        1e-6,
    );
    assert_close("loss", &loss, &[4f64.ln(), 5f64.ln()], 1e-6);

    // Huge logits: stable, and the loss stays exact although p underflows.
    let (probs, loss) = softmax_xent(1, 2, &[1000.0, 0.0], &[1]);
    assert_close("stable probs", &probs, &[1.0, 0.0], 0.0);
    assert_close("stable loss", &loss, &[1000.0], 1e-7);

    let mut d = poisoned(8);
    loss::softmax_xent_backward(
        2,
        4,
        &[0.25, 0.25, 0.25, 0.25, 0.1, 0.2, 0.3, 0.4],
        &[2, 1],
        &mut d,
    );
    assert_close(
        "dlogits",
        &d,
        &[0.125, 0.125, -0.375, 0.125, 0.05, -0.4, 0.15, 0.2],
        1e-7,
    );
}

#[test]
fn softmax_xent_backward_finite_differences() {
    let mut r = rng(9);
    let (n, classes) = (4, 6);
    let logits = random_vec(&mut r, n * classes, 3.0);
    let labels = [0, 5, 2, 2];
    let (probs, _) = softmax_xent(n, classes, &logits, &labels);
    let mut d = poisoned(n * classes);
    loss::softmax_xent_backward(n, classes, &probs, &labels, &mut d);
    // The backward is the gradient of the mean loss.
    check_gradient("softmax_xent", &logits, &d, |l| {
        softmax_xent(n, classes, l, &labels)
            .1
            .iter()
            .map(|&v| v as f64)
            .sum::<f64>()
            / n as f64
    });
}

#[test]
fn label_rank_counts_strictly_higher_scores() {
    let scores = [0.1, 0.5, 0.5, 0.2];
    let mut rank = poisoned(4);
    let labels = [1, 3, 0, 2];
    let rows: Vec<f32> = scores.iter().cycle().take(16).copied().collect();
    loss::label_rank(4, 4, &rows, &labels, &mut rank);
    // Ties with the true class do not count.
    assert_close("rank", &rank, &[0.0, 2.0, 3.0, 0.0], 0.0);
}

// ---------------------------------------------------------------- sgd

#[test]
fn sgd_rules_hand_computed() {
    let base = SgdParams {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
        rule: SgdRule::Pytorch,
    };
    // w = [1, −2], g = [0.5, 0.25], v = [0.2, 0].
    let (mut w, mut v) = (vec![1.0, -2.0], vec![0.2, 0.0]);
    optimizer::sgd_update(&base, &mut w, &[0.5, 0.25], &mut v);
    // v = 0.9·v + g + 0.01·w = [0.18 + 0.5 + 0.01, 0 + 0.25 − 0.02]; w −= 0.1·v.
    assert_close("pytorch v", &v, &[0.69, 0.23], 1e-6);
    assert_close("pytorch w", &w, &[0.931, -2.023], 1e-6);

    let paper = SgdParams {
        rule: SgdRule::Paper,
        ..base
    };
    let (mut w, mut v) = (vec![1.0, -2.0], vec![0.2, 0.0]);
    optimizer::sgd_update(&paper, &mut w, &[0.5, 0.25], &mut v);
    // v = 0.9·v − 0.01·0.1·w − 0.1·g = [0.18 − 0.001 − 0.05, 0.002 − 0.025]; w += v.
    assert_close("paper v", &v, &[0.129, -0.023], 1e-6);
    assert_close("paper w", &w, &[1.129, -2.023], 1e-6);
}

#[test]
fn sgd_refuses_a_bf16_weight_copy() {
    use crate::backend::{Backend, SgdTensor};
    let p = SgdParams {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
        rule: SgdRule::Pytorch,
    };
    let (mut w, g, mut v, mut half) = (vec![1.0; 4], vec![0.5; 4], vec![0.0; 4], vec![0.0; 2]);
    let t = SgdTensor {
        w: &mut w,
        g: &g,
        v: &mut v,
        copy: Some(&mut half),
    };
    let err = super::CpuBackend
        .sgd_update_all(&p, &mut [t], &mut ())
        .unwrap_err();
    assert!(err.to_string().contains("no weight copies"), "{err}");
    assert_eq!(
        w, [1.0; 4],
        "weights changed although the update was refused"
    );
}

#[test]
fn backend_rejects_wrong_lengths_and_bad_geometry_with_errors() {
    use crate::backend::Backend;
    let be = super::CpuBackend;
    let g = ConvGeom {
        n: 1,
        c_in: 2,
        h: 5,
        w: 5,
        c_out: 4,
        k_h: 3,
        k_w: 3,
        stride: 1,
        pad: 1,
        groups: 2,
    };
    let (x, w, b) = (
        vec![0.0; g.x_len()],
        vec![0.0; g.w_len()],
        vec![0.0; g.c_out],
    );
    let mut y = vec![0.0; g.y_len() - 1];
    let e = be
        .conv_forward(&g, &x, &w, &b, &mut y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("conv_forward") && e.contains("operand 3"), "{e}");
    let bad = ConvGeom { groups: 3, ..g };
    let mut y = vec![0.0; g.y_len()];
    assert!(
        be.conv_forward(&bad, &x, &w, &b, &mut y)
            .unwrap_err()
            .to_string()
            .contains("groups")
    );
}
