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

#[cfg(test)]
mod tests {
    use super::transpose;

    #[test]
    fn transpose_moves_each_element_and_twice_is_identity() {
        let (b, r, c) = (3, 5, 7);
        let src: Vec<f32> = (0..b * r * c).map(|i| i as f32).collect();
        let t = transpose(&src, b, r, c);
        assert_eq!(t[(2 * c + 4) * r + 1], src[(2 * r + 1) * c + 4]);
        assert_eq!(transpose(&t, b, c, r), src);
    }
}
