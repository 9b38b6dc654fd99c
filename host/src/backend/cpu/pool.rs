//! CPU reference: max pooling over `size × size` windows at `stride`, no
//! padding, NCHW (see [`PoolGeom`]). Windows may overlap (AlexNet: 3/2).
//!
//! The maximum of a window is found by scanning it row-major and replacing the
//! running maximum only on a strict `>`, so the backward pass routes each `dy`
//! to the *first* maximal element (lowest row, then column) — the rule the GPU
//! kernels must reproduce. Where windows overlap the routed gradients add up.
//! Each `(n, c)` plane is independent, so the outer loop runs on rayon.

use rayon::prelude::*;

use crate::backend::*;

fn check(g: &PoolGeom, bufs: &[(&str, usize, usize)]) {
    assert!(
        g.size > 0 && g.stride > 0 && g.h >= g.size && g.w >= g.size,
        "maxpool: window {} stride {} does not fit a {}x{} input",
        g.size,
        g.stride,
        g.h,
        g.w
    );
    for &(what, got, want) in bufs {
        assert_eq!(
            got, want,
            "maxpool: {what} has length {got}, geometry needs {want}"
        );
    }
}

/// Index in `plane` (row-major, width `w`) of the first maximum of the window
/// at output `(oy, ox)`.
fn argmax(g: &PoolGeom, plane: &[f32], oy: usize, ox: usize) -> usize {
    let (y0, x0) = (oy * g.stride, ox * g.stride);
    let mut best = y0 * g.w + x0;
    for iy in y0..y0 + g.size {
        for ix in x0..x0 + g.size {
            let i = iy * g.w + ix;
            if plane[i] > plane[best] {
                best = i;
            }
        }
    }
    best
}

/// `y[n,c,oy,ox] = max` of the window at `(oy·stride, ox·stride)` (overwrites `y`).
pub fn maxpool_forward(g: &PoolGeom, x: &[f32], y: &mut [f32]) {
    check(g, &[("x", x.len(), g.x_len()), ("y", y.len(), g.y_len())]);
    let (oh, ow) = (g.out_h(), g.out_w());
    if y.is_empty() {
        return;
    }
    y.par_chunks_mut(oh * ow)
        .enumerate()
        .for_each(|(plane, y_plane)| {
            let x_plane = &x[plane * g.h * g.w..][..g.h * g.w];
            for oy in 0..oh {
                for ox in 0..ow {
                    y_plane[oy * ow + ox] = x_plane[argmax(g, x_plane, oy, ox)];
                }
            }
        });
}

/// Routes each `dy` to its window's first maximum in `x`; zeros elsewhere
/// (overwrites `dx`). `y` is accepted for the trait's sake and only
/// length-checked: the argmax is recomputed from `x`.
pub fn maxpool_backward(g: &PoolGeom, x: &[f32], y: &[f32], dy: &[f32], dx: &mut [f32]) {
    check(
        g,
        &[
            ("x", x.len(), g.x_len()),
            ("y", y.len(), g.y_len()),
            ("dy", dy.len(), g.y_len()),
            ("dx", dx.len(), g.x_len()),
        ],
    );
    let (oh, ow) = (g.out_h(), g.out_w());
    if dx.is_empty() {
        return;
    }
    dx.par_chunks_mut(g.h * g.w)
        .enumerate()
        .for_each(|(plane, dx_plane)| {
            let x_plane = &x[plane * g.h * g.w..][..g.h * g.w];
            let dy_plane = &dy[plane * oh * ow..][..oh * ow];
            let mut acc = vec![0.0f64; g.h * g.w];
            for oy in 0..oh {
                for ox in 0..ow {
                    acc[argmax(g, x_plane, oy, ox)] += dy_plane[oy * ow + ox] as f64;
                }
            }
            for (out, a) in dx_plane.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}
