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

/// The split-K sum of the TMA weight gradients (twin of the GPU's
/// `conv_backward_filter_sum`): `dw[f, c, kh, kw] = Σ_slice ws[slice][f]
/// [(kh·KW + kw)·cgp + c]`, the partials in GEMM order with `cgp` ≥ Cg
/// columns a tap (those past Cg unread), `splits` of them.
pub fn conv_backward_filter_sum(
    g: &ConvGeom,
    cgp: usize,
    ws: &[f32],
    dw: &mut [f32],
    splits: usize,
) {
    check_geom(g);
    let (kk, cg) = (g.k_h * g.k_w, g.c_in / g.groups);
    assert!(
        cgp >= cg,
        "{cgp} columns a tap, fewer than the {cg} channels of a group"
    );
    let len = g.c_out * kk * cgp;
    check_len("dw", dw.len(), g.w_len());
    check_len("ws", ws.len(), len * splits);
    if dw.is_empty() {
        return;
    }
    dw.par_chunks_mut(cg * kk).enumerate().for_each(|(f, row)| {
        for (i, out) in row.iter_mut().enumerate() {
            let (c, tap) = (i / kk, i % kk);
            let at = f * cgp * kk + tap * cgp + c;
            let sum: f64 = (0..splits).map(|p| ws[p * len + at] as f64).sum();
            *out = sum as f32;
        }
    });
}

/// The column product of the data gradient by columns (twin of the GPU's
/// `conv_backward_data_cols`), for images `imgs` of dy: `cols[img][(c, kh,
/// kw)][oh·OW + ow] = Σ_f w[g·Fg+f, c, kh, kw] · dy[img, g·Fg+f, oh, ow]`,
/// c over all input channels (group g = c / Cg), img counted from
/// `imgs.start` (overwrites `cols`, `imgs.len()·C_in·KH·KW·OH·OW` floats).
pub fn conv_backward_data_cols(
    g: &ConvGeom,
    dy: &[f32],
    w: &[f32],
    cols: &mut [f32],
    imgs: Range<usize>,
) {
    check_geom(g);
    check_len("dy", dy.len(), g.y_len());
    check_len("w", w.len(), g.w_len());
    let (ohw, kk) = (g.out_h() * g.out_w(), g.k_h * g.k_w);
    check_len("cols", cols.len(), imgs.len() * g.c_in * kk * ohw);
    if cols.is_empty() {
        return;
    }
    let (cin_g, cout_g) = (g.c_in / g.groups, g.c_out / g.groups);
    cols.par_chunks_mut(ohw).enumerate().for_each(|(row, out)| {
        let (img, r) = (imgs.start + row / (g.c_in * kk), row % (g.c_in * kk));
        let (c, tap) = (r / kk, r % kk);
        let (group, c_local) = (c / cin_g, c % cin_g);
        let mut acc = vec![0.0f64; ohw];
        for oc in group * cout_g..(group + 1) * cout_g {
            let wv = w[(oc * cin_g + c_local) * kk + tap] as f64;
            let plane = &dy[(img * g.c_out + oc) * ohw..][..ohw];
            for (a, &d) in acc.iter_mut().zip(plane) {
                *a += wv * d as f64;
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = *a as f32;
        }
    });
}

/// The sum of the data gradient by columns (twin of the GPU's
/// `conv_cols_sum`): `dx[img, c, ih, iw]` for `img` in `imgs` = Σ over
/// the taps (kh, kw) and outputs (oh, ow) with `oh·s + kh − pad = ih`,
/// `ow·s + kw − pad = iw` of `cols[img − imgs.start][(c, kh, kw)][oh·OW +
/// ow]`; with `mask`, 0 where `mask` (x) ≤ 0. Writes only those images of
/// dx (NCHW, the whole batch).
pub fn conv_cols_sum(
    g: &ConvGeom,
    cols: &[f32],
    dx: &mut [f32],
    mask: Option<&[f32]>,
    imgs: Range<usize>,
) {
    check_geom(g);
    let (oh, ow, kk) = (g.out_h(), g.out_w(), g.k_h * g.k_w);
    check_len("cols", cols.len(), imgs.len() * g.c_in * kk * oh * ow);
    check_len("dx", dx.len(), g.x_len());
    if let Some(m) = mask {
        check_len("mask", m.len(), g.x_len());
    }
    let plane = g.h * g.w;
    let first = imgs.start * g.c_in * plane;
    dx[first..imgs.end * g.c_in * plane]
        .par_chunks_mut(plane)
        .enumerate()
        .for_each(|(p, out)| {
            let mut acc = vec![0.0f64; plane];
            for kh in 0..g.k_h {
                for kw in 0..g.k_w {
                    let col = &cols[(p * kk + kh * g.k_w + kw) * oh * ow..][..oh * ow];
                    for y in valid_outputs(kh, g.pad, g.stride, g.h, oh) {
                        let ih = y * g.stride + kh - g.pad;
                        for x in valid_outputs(kw, g.pad, g.stride, g.w, ow) {
                            acc[ih * g.w + x * g.stride + kw - g.pad] += col[y * ow + x] as f64;
                        }
                    }
                }
            }
            let at = first + p * plane;
            for (i, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
                let keep = mask.is_none_or(|m| m[at + i] > 0.0);
                *o = if keep { *a as f32 } else { 0.0 };
            }
        });
}

/// The filter bank of the data gradient by phases (twin of the GPU's
/// `conv_phase_filters`; see [`ConvGeom::phases`]): `wp[f, (c·s + r)·s +
/// r', j, l] = w[f, c, r + s·j, r' + s·l]`, 0 where that tap is past the
/// window. `wp` is the filter bank of `g.phases()`.
pub fn conv_phase_filters(g: &ConvGeom, w: &[f32], wp: &mut [f32]) {
    check_geom(g);
    let p = g.phases();
    check_len("w", w.len(), g.w_len());
    check_len("wp", wp.len(), p.w_len());
    let (s, cg, kk) = (g.stride, g.c_in / g.groups, g.k_h * g.k_w);
    let jj = p.k_h * p.k_w;
    for (i, out) in wp.iter_mut().enumerate() {
        let (f, e) = (i / (cg * s * s * jj), i % (cg * s * s * jj));
        let (crr, jl) = (e / jj, e % jj);
        let (c, r) = (crr / (s * s), crr % (s * s));
        let kh = r / s + s * (jl / p.k_w);
        let kw = r % s + s * (jl % p.k_w);
        let inside = kh < g.k_h && kw < g.k_w;
        *out = if inside {
            w[(f * cg + c) * kk + kh * g.k_w + kw]
        } else {
            0.0
        };
    }
}

/// dx from the data gradient by phases (twin of the GPU's
/// `conv_phase_scatter`; see [`ConvGeom::phases`]): with `ih + pad = s·a +
/// r` and `iw + pad = s·b + r'`, `dx[n, c, ih, iw] = yp[n, (c·s + r)·s +
/// r', a, b]`, 0 where (a, b) is past `yp`'s plane (no tap reaches that
/// input); with `mask`, 0 where `mask` (x) ≤ 0. `yp` is the data gradient
/// of `g.phases()` (`[N, C_in·s², Ah, Aw]`).
pub fn conv_phase_scatter(g: &ConvGeom, yp: &[f32], dx: &mut [f32], mask: Option<&[f32]>) {
    check_geom(g);
    let p = g.phases();
    check_len("yp", yp.len(), p.x_len());
    check_len("dx", dx.len(), g.x_len());
    if let Some(m) = mask {
        check_len("mask", m.len(), g.x_len());
    }
    let (s, hw) = (g.stride, g.h * g.w);
    for (i, out) in dx.iter_mut().enumerate() {
        let (plane, at) = (i / hw, i % hw);
        let (hp, wq) = (at / g.w + g.pad, at % g.w + g.pad);
        let (a, b) = (hp / s, wq / s);
        let keep = mask.is_none_or(|m| m[i] > 0.0);
        *out = if keep && a < p.h && b < p.w {
            let ch = (plane * s + hp % s) * s + wq % s;
            yp[(ch * p.h + a) * p.w + b]
        } else {
            0.0
        };
    }
}
