//! CPU reference: max pooling over `size × size` windows at `stride`, no
//! padding, NCHW (see [`PoolGeom`]). Windows may overlap (AlexNet: 3/2).
//!
//! The maximum of a window is found by scanning it row-major and replacing the
//! running maximum only on a strict `>`, so the backward pass routes each `dy`
//! to the *first* maximal element (lowest row, then column) — the rule the GPU
//! kernels must reproduce. The forward pass saves where that element lies
//! (its offset in the window) for the backward pass, which routes by it alone.
//! Where windows overlap the routed gradients add up.
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

/// `y[n,c,oy,ox] = max` of the window at `(oy·stride, ox·stride)`, and
/// `arg[n,c,oy,ox]` = where its first maximum lies, as the offset `a·size + b`
/// inside the window (an f32, exact) (overwrites both).
pub fn maxpool_forward(g: &PoolGeom, x: &[f32], y: &mut [f32], arg: &mut [f32]) {
    check(
        g,
        &[
            ("x", x.len(), g.x_len()),
            ("y", y.len(), g.y_len()),
            ("arg", arg.len(), g.y_len()),
        ],
    );
    let (oh, ow) = (g.out_h(), g.out_w());
    if y.is_empty() {
        return;
    }
    y.par_chunks_mut(oh * ow)
        .zip(arg.par_chunks_mut(oh * ow))
        .enumerate()
        .for_each(|(plane, (y_plane, arg_plane))| {
            let x_plane = &x[plane * g.h * g.w..][..g.h * g.w];
            for oy in 0..oh {
                for ox in 0..ow {
                    let best = argmax(g, x_plane, oy, ox);
                    let (a, b) = (best / g.w - oy * g.stride, best % g.w - ox * g.stride);
                    y_plane[oy * ow + ox] = x_plane[best];
                    arg_plane[oy * ow + ox] = (a * g.size + b) as f32;
                }
            }
        });
}

/// Routes each `dy` to the element its window's `arg` (from
/// [`maxpool_forward`]) names; zeros elsewhere (overwrites `dx`).
pub fn maxpool_backward(g: &PoolGeom, arg: &[f32], dy: &[f32], dx: &mut [f32]) {
    check(
        g,
        &[
            ("arg", arg.len(), g.y_len()),
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
            let arg_plane = &arg[plane * oh * ow..][..oh * ow];
            let dy_plane = &dy[plane * oh * ow..][..oh * ow];
            let mut acc = vec![0.0f64; g.h * g.w];
            for oy in 0..oh {
                for ox in 0..ow {
                    let at = arg_plane[oy * ow + ox] as usize;
                    let (a, b) = (at / g.size, at % g.size);
                    let i = (oy * g.stride + a) * g.w + ox * g.stride + b;
                    acc[i] += dy_plane[oy * ow + ox] as f64;
                }
            }
            for (out, a) in dx_plane.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}
