//! CPU twin of `gpu-kernels/src/layout.rs`.

use crate::backend::{GridGeom, RowGeom};

/// `dst[b][j][i] = src[b][i][j]` for `batches` row-major `rows × cols`
/// matrices; `src` holds exactly `batches·rows·cols` floats.
pub fn transpose(src: &[f32], batches: usize, rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(src.len(), batches * rows * cols, "transpose: src length");
    let mut dst = vec![0.0; src.len()];
    for b in 0..batches {
        let (s, d) = (&src[b * rows * cols..], &mut dst[b * rows * cols..]);
        for i in 0..rows {
            for j in 0..cols {
                d[j * rows + i] = s[i * cols + j];
            }
        }
    }
    dst
}

/// The row sums the `transpose` kernels write on the way (CPU twin of their
/// `sums` output): `sums[b][i][t] = Σ src[b][i][j]` over the columns `j` of
/// tile `t` (`tile` columns a tile, the last one partial), summed in f64.
pub fn transpose_sums(
    src: &[f32],
    batches: usize,
    rows: usize,
    cols: usize,
    tile: usize,
) -> Vec<f32> {
    assert_eq!(
        src.len(),
        batches * rows * cols,
        "transpose_sums: src length"
    );
    src.chunks(cols)
        .flat_map(|row| {
            row.chunks(tile)
                .map(|t| t.iter().map(|&v| v as f64).sum::<f64>() as f32)
        })
        .collect()
}

/// `transpose` stored as bf16 bit patterns (round to nearest, ties to even;
/// finite inputs), the CPU twin of `transpose_bf16`.
pub fn transpose_bf16(src: &[f32], batches: usize, rows: usize, cols: usize) -> Vec<u16> {
    transpose(src, batches, rows, cols)
        .into_iter()
        .map(to_bf16)
        .collect()
}

/// `transpose` rounded to TF32 (fp32 bit patterns), the CPU twin of
/// `transpose_tf32`.
pub fn transpose_tf32(src: &[f32], batches: usize, rows: usize, cols: usize) -> Vec<f32> {
    transpose(src, batches, rows, cols)
        .into_iter()
        .map(to_tf32)
        .collect()
}

/// The CPU twin of `row_patches`: `src` (NCHW, `g.src_len()` floats) cut into
/// window rows as [`RowGeom`] describes.
pub fn row_patches(src: &[f32], g: &RowGeom) -> Vec<f32> {
    assert_eq!(src.len(), g.src_len(), "row_patches: src length");
    assert!(g.rw >= g.kw * g.c, "row_patches: rw {} < kw·c", g.rw);
    let mut dst = vec![0.0; g.len()];
    let plane = g.h * g.w;
    for b in 0..g.batches {
        for r in 0..g.rows {
            for o in 0..g.ow {
                let out = &mut dst[((b * g.rows + r) * g.ow + o) * g.rw..][..g.rw];
                let ih = r as isize - g.pad as isize;
                for kw in 0..g.kw {
                    let iw = (g.stride * o + kw) as isize - g.pad as isize;
                    if ih < 0 || ih >= g.h as isize || iw < 0 || iw >= g.w as isize {
                        continue;
                    }
                    for c in 0..g.c {
                        out[kw * g.c + c] =
                            src[(b * g.c + c) * plane + ih as usize * g.w + iw as usize];
                    }
                }
            }
        }
    }
    dst
}

/// `row_patches` stored as bf16 bit patterns, the CPU twin of
/// `row_patches_bf16`.
pub fn row_patches_bf16(src: &[f32], g: &RowGeom) -> Vec<u16> {
    row_patches(src, g).into_iter().map(to_bf16).collect()
}

/// `row_patches` rounded to TF32, the CPU twin of `row_patches_tf32`.
pub fn row_patches_tf32(src: &[f32], g: &RowGeom) -> Vec<f32> {
    row_patches(src, g).into_iter().map(to_tf32).collect()
}

/// The CPU twin of `pixel_grid_tf32`: `src` (NCHW, `g.src_len()` floats)
/// rounded to TF32 on the padded pixel grid [`GridGeom`] describes.
pub fn pixel_grid_tf32(src: &[f32], g: &GridGeom) -> Vec<f32> {
    assert_eq!(src.len(), g.src_len(), "pixel_grid_tf32: src length");
    assert!(
        g.hp >= g.h && g.wp >= g.w,
        "pixel_grid_tf32: {g:?} does not hold the images"
    );
    let image = g.hp * g.wp;
    let mut dst = vec![0.0; g.grid_len()];
    for k in 0..g.copies {
        for c in 0..g.c {
            for q in 0..g.len {
                let at = q as isize + g.shift + k as isize;
                if at < 0 {
                    continue;
                }
                let (b, r) = (at as usize / image, at as usize % image);
                let (y, x) = (r / g.wp, r % g.wp);
                if b < g.batches && y < g.h && x < g.w {
                    let v = src[((b * g.c + c) * g.h + y) * g.w + x];
                    dst[(k * g.c + c) * g.len + q] = to_tf32(v);
                }
            }
        }
    }
    dst
}

/// Every value rounded to bf16, the CPU twin of `convert_bf16`.
pub fn convert_bf16(src: &[f32]) -> Vec<u16> {
    src.iter().copied().map(to_bf16).collect()
}

/// Every value rounded to TF32, the CPU twin of `convert_tf32`.
pub fn convert_tf32(src: &[f32]) -> Vec<f32> {
    src.iter().copied().map(to_tf32).collect()
}

/// fp32 → bf16 bits, round to nearest even (finite values).
pub fn to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// fp32 rounded to TF32 (10 mantissa bits; to nearest, ties away from
/// zero, like `cvt.rna.tf32.f32`), the low 13 bits zero. A NaN stays a NaN
/// (its bits are not matched).
pub fn to_tf32(v: f32) -> f32 {
    if v.is_nan() {
        return f32::NAN;
    }
    f32::from_bits(v.to_bits().wrapping_add(0x1000) & !0x1fff)
}

#[cfg(test)]
mod tests {
    use super::{pixel_grid_tf32, row_patches, to_bf16, to_tf32, transpose, transpose_sums};
    use crate::backend::{
        ConvGeom, GridGeom, RowGeom,
        cpu::conv::{conv_backward_filter, conv_forward},
    };

    /// The TF32 weight gradient's arithmetic over the padded pixel grid
    /// (what `conv_backward_filter_grid_tf32_wg_tma_big` computes, written
    /// out here): dw[f][c][kh][kw] = Σ_p dyg[f][p] · xg[kw][c][p + kh·wp]
    /// (zero past the row's end) equals the direct weight gradient, for odd
    /// sizes, rectangular filters, pads from 0 to above the filter's, and
    /// groups; every offset `kh·wp` is a whole number of 16-byte vectors.
    /// Values are small integers (exact in TF32 and in the sums).
    #[test]
    fn pixel_grid_taps_are_aligned_shifts_of_the_pixel_index() {
        let g = |n, c_in, h, w, c_out, (k_h, k_w), pad, groups| ConvGeom {
            n,
            c_in,
            h,
            w,
            c_out,
            k_h,
            k_w,
            stride: 1,
            pad,
            groups,
        };
        for geom in [
            g(2, 4, 13, 13, 6, (3, 3), 1, 1),
            g(3, 4, 7, 9, 4, (5, 5), 2, 2),
            g(1, 2, 6, 5, 2, (3, 5), 2, 1),
            g(2, 2, 5, 7, 2, (3, 3), 0, 1),
            g(2, 2, 4, 4, 2, (2, 3), 3, 2),
        ] {
            let x: Vec<f32> = (0..geom.x_len())
                .map(|i| (i * 7 % 11) as f32 - 5.0)
                .collect();
            let dy: Vec<f32> = (0..geom.y_len())
                .map(|i| (i * 5 % 9) as f32 - 4.0)
                .collect();
            let mut want = vec![f32::NAN; geom.w_len()];
            conv_backward_filter(&geom, &x, &dy, &mut want);
            let (gx, gdy) = (GridGeom::x(&geom).unwrap(), GridGeom::dy(&geom).unwrap());
            assert_eq!(
                (gx.hp, gx.wp, gx.len),
                (gdy.hp, gdy.wp, gdy.len),
                "{geom:?}"
            );
            assert!(gx.len.is_multiple_of(32) && gx.wp.is_multiple_of(4));
            assert_eq!((gx.copies, gdy.copies), (geom.k_w, 1));
            let (xg, dg) = (pixel_grid_tf32(&x, &gx), pixel_grid_tf32(&dy, &gdy));
            let (cg, fg) = (geom.c_in / geom.groups, geom.c_out / geom.groups);
            for f in 0..geom.c_out {
                let grp = f / fg;
                for c in 0..cg {
                    for kh in 0..geom.k_h {
                        for kw in 0..geom.k_w {
                            let row = &xg[(kw * geom.c_in + grp * cg + c) * gx.len..][..gx.len];
                            let got: f32 = (0..gx.len)
                                .map(|p| {
                                    dg[f * gx.len + p]
                                        * row.get(p + kh * gx.wp).copied().unwrap_or(0.0)
                                })
                                .sum();
                            let at = ((f * cg + c) * geom.k_h + kh) * geom.k_w + kw;
                            assert_eq!(got, want[at], "{geom:?} f{f} c{c} tap ({kh}, {kw})");
                        }
                    }
                }
            }
        }
    }

    /// The tile sums add up to each row's sum (what the bias gradient
    /// needs), and split at the tile boundaries: 2 matrices of 3 rows × 5
    /// columns in tiles of 2 → tiles [0, 1], [2, 3], [4].
    #[test]
    fn transpose_sums_tile_each_row() {
        let src: Vec<f32> = (0..30).map(|i| i as f32).collect();
        let sums = transpose_sums(&src, 2, 3, 5, 2);
        assert_eq!(sums.len(), 2 * 3 * 3);
        assert_eq!(&sums[..3], &[1.0, 5.0, 4.0]);
        assert_eq!(&sums[15..], &[51.0, 55.0, 29.0]);
        for (row, t) in src.chunks(5).zip(sums.chunks(3)) {
            assert_eq!(t.iter().sum::<f32>(), row.iter().sum::<f32>());
        }
    }

    /// The row-patch form of a convolution gives the same output as the
    /// direct one: `y[f][oh][ow] = Σ_kh Σ_j W[f][kh][j]·P[stride·oh + kh][ow][j]`.
    #[test]
    fn row_patches_reproduce_the_convolution() {
        let g = ConvGeom {
            n: 2,
            c_in: 3,
            h: 19,
            w: 15,
            c_out: 5,
            k_h: 5,
            k_w: 4,
            stride: 3,
            pad: 2,
            groups: 1,
        };
        let x: Vec<f32> = (0..g.x_len())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w: Vec<f32> = (0..g.w_len())
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 30.0)
            .collect();
        let bias = vec![0.0; g.c_out];
        let mut want = vec![f32::NAN; g.y_len()];
        conv_forward(&g, &x, &w, &bias, &mut want);
        let rw = 16;
        let (pg, wg) = (RowGeom::patches(&g, rw), RowGeom::filters(&g, rw));
        let (p, wr) = (row_patches(&x, &pg), row_patches(&w, &wg));
        let (oh, ow) = (g.out_h(), g.out_w());
        for n in 0..g.n {
            for f in 0..g.c_out {
                for y in 0..oh {
                    for x in 0..ow {
                        let mut s = 0.0f64;
                        for kh in 0..g.k_h {
                            let row = (n * pg.rows + g.stride * y + kh) * ow + x;
                            for j in 0..rw {
                                s += wr[(f * g.k_h + kh) * rw + j] as f64 * p[row * rw + j] as f64;
                            }
                        }
                        let got = want[((n * g.c_out + f) * oh + y) * ow + x] as f64;
                        assert!(
                            (s - got).abs() < 1e-4 * (1.0 + got.abs()),
                            "{n} {f} {y} {x}: {s} vs {got}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even.
        assert_eq!(to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(to_bf16(-2.5), 0xc020);
    }

    #[test]
    fn tf32_rounds_to_nearest_ties_away() {
        let ulp = 2f32.powi(-10);
        assert_eq!(to_tf32(1.0), 1.0);
        assert_eq!(to_tf32(1.0 + 0.49 * ulp), 1.0);
        assert_eq!(to_tf32(1.0 + 0.51 * ulp), 1.0 + ulp);
        // Halfway: away from zero, for either sign.
        assert_eq!(to_tf32(1.0 + 0.5 * ulp), 1.0 + ulp);
        assert_eq!(to_tf32(-(1.0 + 0.5 * ulp)), -(1.0 + ulp));
        // A carry into the exponent.
        assert_eq!(to_tf32(2.0 - 0.25 * ulp), 2.0);
        assert_eq!(to_tf32(3.3).to_bits() & 0x1fff, 0);
        // Past the largest finite TF32 value: infinity; NaN stays NaN.
        assert_eq!(to_tf32(f32::MAX), f32::INFINITY);
        assert!(to_tf32(f32::from_bits(0x7f80_0001)).is_nan());
    }

    #[test]
    fn transpose_moves_each_element_and_twice_is_identity() {
        let (b, r, c) = (3, 5, 7);
        let src: Vec<f32> = (0..b * r * c).map(|i| i as f32).collect();
        let t = transpose(&src, b, r, c);
        assert_eq!(t[(2 * c + 4) * r + 1], src[(2 * r + 1) * c + 4]);
        assert_eq!(transpose(&t, b, c, r), src);
    }
}
