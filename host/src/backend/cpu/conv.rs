//! CPU reference: 2-D convolution with zero padding, stride and groups.
//!
//! Layout (see [`ConvGeom`]): `x [n, c_in, h, w]`, `w [c_out, c_in/groups,
//! k_h, k_w]`, `bias [c_out]`, `y [n, c_out, out_h, out_w]`, all NCHW and
//! contiguous. Output channel `oc` belongs to group `oc / (c_out/groups)` and
//! reads input channels `g·(c_in/groups) .. (g+1)·(c_in/groups)`.
//!
//! Each function fills one output plane (or one filter) at a time from an f64
//! accumulator and writes it once, so outputs are fully overwritten and never
//! read. Planes are independent, so the outer loop runs on rayon.

use std::ops::Range;

use rayon::prelude::*;

use crate::backend::*;

/// The output positions `o` (of `out_len`) whose input coordinate
/// `o·stride + k − pad` lies inside `[0, in_len)`, for kernel offset `k`.
fn valid_outputs(
    k: usize,
    pad: usize,
    stride: usize,
    in_len: usize,
    out_len: usize,
) -> Range<usize> {
    // o·stride + k ≥ pad  ⇔  o ≥ ⌈(pad − k) / stride⌉
    let lo = pad.saturating_sub(k).div_ceil(stride);
    // o·stride + k − pad < in_len  ⇔  o < ⌈(in_len + pad − k) / stride⌉
    let hi = (in_len + pad).saturating_sub(k).div_ceil(stride);
    lo.min(out_len)..hi.min(out_len)
}

fn check_geom(g: &ConvGeom) {
    assert!(
        g.groups > 0 && g.c_in.is_multiple_of(g.groups) && g.c_out.is_multiple_of(g.groups),
        "conv: groups {} must divide c_in {} and c_out {}",
        g.groups,
        g.c_in,
        g.c_out
    );
    assert!(g.stride > 0, "conv: stride must be positive");
    assert!(
        g.h + 2 * g.pad >= g.k_h && g.w + 2 * g.pad >= g.k_w,
        "conv: kernel {}x{} larger than padded input {}x{} (pad {})",
        g.k_h,
        g.k_w,
        g.h,
        g.w,
        g.pad
    );
}

fn check_len(what: &str, got: usize, want: usize) {
    assert_eq!(
        got, want,
        "conv: {what} has length {got}, geometry needs {want}"
    );
}

/// `y = conv(x, w) + bias` (overwrites `y`). Parallel over `(n, c_out)` planes.
pub fn conv_forward(g: &ConvGeom, x: &[f32], w: &[f32], bias: &[f32], y: &mut [f32]) {
    check_geom(g);
    check_len("x", x.len(), g.x_len());
    check_len("w", w.len(), g.w_len());
    check_len("bias", bias.len(), g.c_out);
    check_len("y", y.len(), g.y_len());
    let (oh, ow) = (g.out_h(), g.out_w());
    let cin_g = g.c_in / g.groups;
    let cout_g = g.c_out / g.groups;
    if y.is_empty() {
        return;
    }
    y.par_chunks_mut(oh * ow)
        .enumerate()
        .for_each(|(plane, y_plane)| {
            let (n, oc) = (plane / g.c_out, plane % g.c_out);
            let group = oc / cout_g;
            let mut acc = vec![bias[oc] as f64; oh * ow];
            for ci in 0..cin_g {
                let x_plane = &x[(n * g.c_in + group * cin_g + ci) * g.h * g.w..][..g.h * g.w];
                let w_filter = &w[(oc * cin_g + ci) * g.k_h * g.k_w..][..g.k_h * g.k_w];
                for ky in 0..g.k_h {
                    let oys = valid_outputs(ky, g.pad, g.stride, g.h, oh);
                    for kx in 0..g.k_w {
                        let wv = w_filter[ky * g.k_w + kx] as f64;
                        let oxs = valid_outputs(kx, g.pad, g.stride, g.w, ow);
                        for oy in oys.clone() {
                            let iy = oy * g.stride + ky - g.pad;
                            for ox in oxs.clone() {
                                let ix = ox * g.stride + kx - g.pad;
                                acc[oy * ow + ox] += wv * x_plane[iy * g.w + ix] as f64;
                            }
                        }
                    }
                }
            }
            for (out, a) in y_plane.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}

/// `dx = ∂L/∂x` from `dy` (overwrites `dx`). Parallel over `(n, c_in)` planes;
/// each input plane gathers from the `c_out/groups` outputs of its group.
pub fn conv_backward_data(g: &ConvGeom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    check_geom(g);
    check_len("dy", dy.len(), g.y_len());
    check_len("w", w.len(), g.w_len());
    check_len("dx", dx.len(), g.x_len());
    let (oh, ow) = (g.out_h(), g.out_w());
    let cin_g = g.c_in / g.groups;
    let cout_g = g.c_out / g.groups;
    if dx.is_empty() {
        return;
    }
    dx.par_chunks_mut(g.h * g.w)
        .enumerate()
        .for_each(|(plane, dx_plane)| {
            let (n, ci) = (plane / g.c_in, plane % g.c_in);
            let (group, ci_local) = (ci / cin_g, ci % cin_g);
            let mut acc = vec![0.0f64; g.h * g.w];
            for oc in group * cout_g..(group + 1) * cout_g {
                let dy_plane = &dy[(n * g.c_out + oc) * oh * ow..][..oh * ow];
                let w_filter = &w[(oc * cin_g + ci_local) * g.k_h * g.k_w..][..g.k_h * g.k_w];
                for ky in 0..g.k_h {
                    let oys = valid_outputs(ky, g.pad, g.stride, g.h, oh);
                    for kx in 0..g.k_w {
                        let wv = w_filter[ky * g.k_w + kx] as f64;
                        let oxs = valid_outputs(kx, g.pad, g.stride, g.w, ow);
                        for oy in oys.clone() {
                            let iy = oy * g.stride + ky - g.pad;
                            for ox in oxs.clone() {
                                let ix = ox * g.stride + kx - g.pad;
                                acc[iy * g.w + ix] += wv * dy_plane[oy * ow + ox] as f64;
                            }
                        }
                    }
                }
            }
            for (out, a) in dx_plane.iter_mut().zip(&acc) {
                *out = *a as f32;
            }
        });
}

/// `dw = ∂L/∂w` (overwrites `dw`): `dw[oc, ci, ky, kx] = Σ_{n, oy, ox}
/// dy[n, oc, oy, ox] · x[n, group·cin_g + ci, oy·s + ky − pad, ox·s + kx − pad]`.
/// Parallel over output channels (one filter each).
pub fn conv_backward_filter(g: &ConvGeom, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    check_geom(g);
    check_len("x", x.len(), g.x_len());
    check_len("dy", dy.len(), g.y_len());
    check_len("dw", dw.len(), g.w_len());
    let (oh, ow) = (g.out_h(), g.out_w());
    let cin_g = g.c_in / g.groups;
    let cout_g = g.c_out / g.groups;
    let filter_len = cin_g * g.k_h * g.k_w;
    if dw.is_empty() {
        return;
    }
    dw.par_chunks_mut(filter_len)
        .enumerate()
        .for_each(|(oc, dw_filter)| {
            let group = oc / cout_g;
            for ci in 0..cin_g {
                for ky in 0..g.k_h {
                    let oys = valid_outputs(ky, g.pad, g.stride, g.h, oh);
                    for kx in 0..g.k_w {
                        let oxs = valid_outputs(kx, g.pad, g.stride, g.w, ow);
                        let mut acc = 0.0f64;
                        for n in 0..g.n {
                            let x_plane =
                                &x[(n * g.c_in + group * cin_g + ci) * g.h * g.w..][..g.h * g.w];
                            let dy_plane = &dy[(n * g.c_out + oc) * oh * ow..][..oh * ow];
                            for oy in oys.clone() {
                                let iy = oy * g.stride + ky - g.pad;
                                for ox in oxs.clone() {
                                    let ix = ox * g.stride + kx - g.pad;
                                    acc += dy_plane[oy * ow + ox] as f64
                                        * x_plane[iy * g.w + ix] as f64;
                                }
                            }
                        }
                        dw_filter[(ci * g.k_h + ky) * g.k_w + kx] = acc as f32;
                    }
                }
            }
        });
}

/// `db[c] = Σ_{n,h,w} dy[n,c,h,w]` (overwrites `db`). Parallel over channels.
pub fn conv_backward_bias(g: &ConvGeom, dy: &[f32], db: &mut [f32]) {
    check_geom(g);
    check_len("dy", dy.len(), g.y_len());
    check_len("db", db.len(), g.c_out);
    let plane = g.out_h() * g.out_w();
    db.par_iter_mut().enumerate().for_each(|(oc, out)| {
        let sum: f64 = (0..g.n)
            .flat_map(|n| &dy[(n * g.c_out + oc) * plane..][..plane])
            .map(|&v| v as f64)
            .sum();
        *out = sum as f32;
    });
}
