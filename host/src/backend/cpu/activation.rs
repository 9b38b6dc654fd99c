//! CPU reference: ReLU, in place on a flat buffer of any layout.
//!
//! The backward pass needs only the forward's output `y` (`y > 0` exactly
//! where the input was positive), so the input need not be kept.

use rayon::prelude::*;

/// `y ← max(y, 0)` in place (NaN and −0 become +0).
pub fn relu_forward(y: &mut [f32]) {
    y.par_iter_mut()
        .for_each(|v| *v = if *v > 0.0 { *v } else { 0.0 });
}

/// `d ← d · [y > 0]` in place, where `y` is the ReLU's output.
pub fn relu_backward(y: &[f32], d: &mut [f32]) {
    assert_eq!(
        y.len(),
        d.len(),
        "relu_backward: y has length {}, gradient {}",
        y.len(),
        d.len()
    );
    d.par_iter_mut()
        .zip(y)
        .for_each(|(dv, &yv)| *dv = if yv > 0.0 { *dv } else { 0.0 });
}
