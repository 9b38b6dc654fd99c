//! CPU reference: fully connected layer, `y[n, o] = Σ_i x[n, i]·w[o, i] + b[o]`.
//!
//! Layout (see [`FcGeom`]): `x [n, inputs]`, `w [outputs, inputs]` (PyTorch's
//! `Linear` layout), `b [outputs]`, `y [n, outputs]`, row-major. Sums are
//! accumulated in f64; every output is written once (never read). Rows of the
//! output are independent, so the outer loop runs on rayon.

use rayon::prelude::*;

use crate::backend::*;

fn check_len(what: &str, got: usize, want: usize) {
    assert_eq!(
        got, want,
        "fc: {what} has length {got}, geometry needs {want}"
    );
}

/// `y = x·wᵀ + b` (overwrites `y`). Parallel over samples.
pub fn fc_forward(g: &FcGeom, x: &[f32], w: &[f32], b: &[f32], y: &mut [f32]) {
    check_len("x", x.len(), g.n * g.inputs);
    check_len("w", w.len(), g.outputs * g.inputs);
    check_len("b", b.len(), g.outputs);
    check_len("y", y.len(), g.n * g.outputs);
    if y.is_empty() {
        return;
    }
    y.par_chunks_mut(g.outputs)
        .enumerate()
        .for_each(|(n, y_row)| {
            let x_row = &x[n * g.inputs..][..g.inputs];
            for (o, out) in y_row.iter_mut().enumerate() {
                let w_row = &w[o * g.inputs..][..g.inputs];
                let dot: f64 = x_row
                    .iter()
                    .zip(w_row)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                *out = (dot + b[o] as f64) as f32;
            }
        });
}

/// `dx[n, i] = Σ_o dy[n, o]·w[o, i]` (overwrites `dx`). Parallel over samples.
pub fn fc_backward_data(g: &FcGeom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    check_len("dy", dy.len(), g.n * g.outputs);
    check_len("w", w.len(), g.outputs * g.inputs);
    check_len("dx", dx.len(), g.n * g.inputs);
    if dx.is_empty() {
        return;
    }
    dx.par_chunks_mut(g.inputs)
        .enumerate()
        .for_each(|(n, dx_row)| {
            let mut acc = vec![0.0f64; g.inputs];
            for o in 0..g.outputs {
                let d = dy[n * g.outputs + o] as f64;
                let w_row = &w[o * g.inputs..][..g.inputs];
                for (a, &wv) in acc.iter_mut().zip(w_row) {
                    *a += d * wv as f64;
                }
            }
            for (out, a) in dx_row.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}

/// `dw[o, i] = Σ_n dy[n, o]·x[n, i]` (overwrites `dw`). Parallel over outputs.
pub fn fc_backward_filter(g: &FcGeom, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    check_len("x", x.len(), g.n * g.inputs);
    check_len("dy", dy.len(), g.n * g.outputs);
    check_len("dw", dw.len(), g.outputs * g.inputs);
    if dw.is_empty() {
        return;
    }
    dw.par_chunks_mut(g.inputs)
        .enumerate()
        .for_each(|(o, dw_row)| {
            let mut acc = vec![0.0f64; g.inputs];
            for n in 0..g.n {
                let d = dy[n * g.outputs + o] as f64;
                let x_row = &x[n * g.inputs..][..g.inputs];
                for (a, &xv) in acc.iter_mut().zip(x_row) {
                    *a += d * xv as f64;
                }
            }
            for (out, a) in dw_row.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}

/// `db[o] = Σ_n dy[n, o]` (overwrites `db`).
pub fn fc_backward_bias(g: &FcGeom, dy: &[f32], db: &mut [f32]) {
    check_len("dy", dy.len(), g.n * g.outputs);
    check_len("db", db.len(), g.outputs);
    for (o, out) in db.iter_mut().enumerate() {
        let sum: f64 = (0..g.n).map(|n| dy[n * g.outputs + o] as f64).sum();
        *out = sum as f32;
    }
}
