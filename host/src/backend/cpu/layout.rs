//! CPU twin of `gpu-kernels/src/layout.rs`.

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

/// `transpose` stored as bf16 bit patterns (round to nearest, ties to even;
/// finite inputs), the CPU twin of `transpose_bf16`.
pub fn transpose_bf16(src: &[f32], batches: usize, rows: usize, cols: usize) -> Vec<u16> {
    transpose(src, batches, rows, cols)
        .into_iter()
        .map(to_bf16)
        .collect()
}

/// fp32 → bf16 bits, round to nearest even (finite values).
pub fn to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::{to_bf16, transpose};

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
    fn transpose_moves_each_element_and_twice_is_identity() {
        let (b, r, c) = (3, 5, 7);
        let src: Vec<f32> = (0..b * r * c).map(|i| i as f32).collect();
        let t = transpose(&src, b, r, c);
        assert_eq!(t[(2 * c + 4) * r + 1], src[(2 * r + 1) * c + 4]);
        assert_eq!(transpose(&t, b, c, r), src);
    }
}
