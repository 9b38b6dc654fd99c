//! ReLU: `y = max(x, 0)` and its gradient `dx = dy · [y > 0]`.
//!
//! Layout: any contiguous fp32 tensor of `n` elements. Mapping: a 1-D
//! grid-stride loop, one element per thread per iteration.

use crate::device::grid_stride;

/// `y[i] = max(x[i], 0)` for `i < n`; `y` may alias `x` (in place).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn relu_forward(x: *const f32, y: *mut f32, n: usize) {
    let (mut i, step) = grid_stride();
    while i < n {
        unsafe { *y.add(i) = (*x.add(i)).max(0.0) };
        i += step;
    }
}

/// `dx[i] = dy[i]` where `y[i] > 0`, else 0; `dx` may alias `dy`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn relu_backward(
    y: *const f32,
    dy: *const f32,
    dx: *mut f32,
    n: usize,
) {
    let (mut i, step) = grid_stride();
    while i < n {
        unsafe { *dx.add(i) = if *y.add(i) > 0.0 { *dy.add(i) } else { 0.0 } };
        i += step;
    }
}
