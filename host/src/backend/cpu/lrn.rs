//! CPU reference: cross-map local response normalisation (paper, §3.3).
//!
//! `scale[n,c,h,w] = k + α·Σ_{c'∈window(c)} x[n,c',h,w]²` and
//! `y = x · scale^(−β)`, NCHW. `window(c)` is the `size` maps from
//! `c − size/2` to `c − size/2 + size − 1` (centred for odd `size`), clipped to
//! `[0, C)`. The forward writes `scale` so the backward need not recompute it.
//!
//! Backward, with `c ∈ window(c')` ⇔ `c' ∈ [c + size/2 + 1 − size, c + size/2]`:
//! `dx[c] = dy[c]·scale[c]^(−β) − 2αβ·x[c]·Σ_{c' : c∈window(c')} dy[c']·y[c']/scale[c']`.
//!
//! Window sums are taken in f64 per pixel column; each sample is independent,
//! so the outer loop runs on rayon over the batch.
//!
//! `lrn_pool_forward` / `lrn_pool_backward` (the GPU fuses LRN with the max
//! pool after it) are defined here as that composition: LRN, then
//! [`pool::maxpool_forward`]; backward recomputes `y` and `scale` from `x`,
//! routes `dz` with [`pool::maxpool_backward`], then runs [`lrn_backward`].

use std::ops::Range;

use rayon::prelude::*;

use super::{activation, pool};
use crate::backend::*;

/// The channels `c'` in `window(c)`: `c − size/2 ..= c − size/2 + size − 1`,
/// clipped to `[0, channels)`.
fn window(c: usize, size: usize, channels: usize) -> Range<usize> {
    let lo = c.saturating_sub(size / 2);
    let hi = (c + size - size / 2).min(channels);
    lo..hi
}

/// The channels `c'` whose window contains `c`: `c + size/2 + 1 − size ..=
/// c + size/2`, clipped to `[0, channels)`.
fn windows_containing(c: usize, size: usize, channels: usize) -> Range<usize> {
    let lo = (c + size / 2 + 1).saturating_sub(size);
    let hi = (c + size / 2 + 1).min(channels);
    lo..hi
}

fn check(p: &LrnParams, bufs: &[(&str, usize)]) {
    assert!(p.size > 0, "lrn: size must be positive");
    for &(what, len) in bufs {
        assert_eq!(
            len,
            p.len(),
            "lrn: {what} has length {len}, parameters need {}",
            p.len()
        );
    }
}

/// `y = lrn(x)` and `scale = k + α·Σx²` (overwrites both). Parallel over samples.
pub fn lrn_forward(p: &LrnParams, x: &[f32], y: &mut [f32], scale: &mut [f32]) {
    check(p, &[("x", x.len()), ("y", y.len()), ("scale", scale.len())]);
    let hw = p.h * p.w;
    let sample = p.c * hw;
    if sample == 0 {
        return;
    }
    let (alpha, beta, k) = (p.alpha as f64, p.beta as f64, p.k as f64);
    y.par_chunks_mut(sample)
        .zip(scale.par_chunks_mut(sample))
        .enumerate()
        .for_each(|(n, (y_s, scale_s))| {
            let x_s = &x[n * sample..][..sample];
            for pix in 0..hw {
                for c in 0..p.c {
                    let sum_sq: f64 = window(c, p.size, p.c)
                        .map(|c2| {
                            let v = x_s[c2 * hw + pix] as f64;
                            v * v
                        })
                        .sum();
                    let s = k + alpha * sum_sq;
                    let i = c * hw + pix;
                    scale_s[i] = s as f32;
                    y_s[i] = (x_s[i] as f64 * s.powf(-beta)) as f32;
                }
            }
        });
}

/// `dx` from `dy`, given the forward's `x`, `y` and `scale` (overwrites `dx`).
/// Parallel over samples.
pub fn lrn_backward(
    p: &LrnParams,
    x: &[f32],
    y: &[f32],
    scale: &[f32],
    dy: &[f32],
    dx: &mut [f32],
) {
    check(
        p,
        &[
            ("x", x.len()),
            ("y", y.len()),
            ("scale", scale.len()),
            ("dy", dy.len()),
            ("dx", dx.len()),
        ],
    );
    let hw = p.h * p.w;
    let sample = p.c * hw;
    if sample == 0 {
        return;
    }
    let (alpha, beta) = (p.alpha as f64, p.beta as f64);
    dx.par_chunks_mut(sample).enumerate().for_each(|(n, dx_s)| {
        let base = n * sample;
        let at = |buf: &[f32], c: usize, pix: usize| buf[base + c * hw + pix] as f64;
        let mut ratio = vec![0.0f64; p.c];
        for pix in 0..hw {
            for (c, r) in ratio.iter_mut().enumerate() {
                *r = at(dy, c, pix) * at(y, c, pix) / at(scale, c, pix);
            }
            for c in 0..p.c {
                let cross: f64 = ratio[windows_containing(c, p.size, p.c)].iter().sum();
                let direct = at(dy, c, pix) * at(scale, c, pix).powf(-beta);
                dx_s[c * hw + pix] = (direct - 2.0 * alpha * beta * at(x, c, pix) * cross) as f32;
            }
        }
    });
}

fn check_pair(p: &LrnParams, g: &PoolGeom) {
    assert!(
        (p.n, p.c, p.h, p.w) == (g.n, g.c, g.h, g.w),
        "lrn_pool: LRN shape {:?} and pool input {:?} differ",
        (p.n, p.c, p.h, p.w),
        (g.n, g.c, g.h, g.w)
    );
}

/// `maxpool_forward(lrn_forward(x))`: the pool's `z` and `arg` (overwrites
/// both; `y` and `scale` are temporaries).
pub fn lrn_pool_forward(p: &LrnParams, g: &PoolGeom, x: &[f32], z: &mut [f32], arg: &mut [f32]) {
    check_pair(p, g);
    let (mut y, mut scale) = (vec![0.0; p.len()], vec![0.0; p.len()]);
    lrn_forward(p, x, &mut y, &mut scale);
    pool::maxpool_forward(g, &y, z, arg);
}

/// The backward of [`lrn_pool_forward`] given its `arg`, and with `relu`
/// that of the ReLU whose output `x` is (overwrites `dx`).
pub fn lrn_pool_backward(
    p: &LrnParams,
    g: &PoolGeom,
    x: &[f32],
    arg: &[f32],
    dz: &[f32],
    dx: &mut [f32],
    relu: bool,
) {
    check_pair(p, g);
    let (mut y, mut scale, mut dy) = (vec![0.0; p.len()], vec![0.0; p.len()], vec![0.0; p.len()]);
    lrn_forward(p, x, &mut y, &mut scale);
    pool::maxpool_backward(g, arg, dz, &mut dy);
    lrn_backward(p, x, &y, &scale, &dy, dx);
    if relu {
        activation::relu_backward(x, dx);
    }
}
