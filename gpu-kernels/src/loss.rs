//! Softmax + cross-entropy, fused and numerically stable, and the rank of the
//! true class (for top-1/top-5 counts).
//!
//! Layout: logits/probs `[n, classes]` row-major, labels `[n]` i32.
//! Row kernels: one block per row (grid x = n, 256 threads), block reductions
//! in a fixed order (deterministic), 32 floats of dynamic shared memory.

use crate::device::{bdim_x, bid_x, block_max, block_sum, exp, grid_stride, ln, shared, tid_x};

/// `probs[i] = softmax(logits[i])`, `loss[i] = logsumexp(logits[i]) − logits[i, label]`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn softmax_xent_forward(
    logits: *const f32,
    labels: *const i32,
    probs: *mut f32,
    loss: *mut f32,
    classes: u32,
) {
    let row = bid_x() as usize;
    let z = unsafe { logits.add(row * classes as usize) };
    let p = unsafe { probs.add(row * classes as usize) };
    let scratch = shared::<f32>();
    let mut m = f32::NEG_INFINITY;
    let mut j = tid_x();
    while j < classes {
        m = m.max(unsafe { *z.add(j as usize) });
        j += bdim_x();
    }
    let m = unsafe { block_max(m, scratch) };
    let mut s = 0.0f32;
    let mut j = tid_x();
    while j < classes {
        let e = exp(unsafe { *z.add(j as usize) } - m);
        unsafe { *p.add(j as usize) = e };
        s += e;
        j += bdim_x();
    }
    let s = unsafe { block_sum(s, scratch) };
    let inv = 1.0 / s;
    let mut j = tid_x();
    while j < classes {
        unsafe { *p.add(j as usize) *= inv };
        j += bdim_x();
    }
    if tid_x() == 0 {
        let label = unsafe { *labels.add(row) } as usize;
        unsafe { *loss.add(row) = ln_sum(s) + m - *z.add(label) };
    }
}

/// `ln(s)` for a softmax denominator `s ≥ 1`. Near 1 (a confident, correct
/// prediction) `lg2.approx`'s absolute error (~2^-22) would swamp a loss of
/// 1e-6, so `ln(1 + d)` comes from its series there (error < d⁴/4).
#[inline(always)]
fn ln_sum(s: f32) -> f32 {
    let d = s - 1.0;
    if d < 1e-2 {
        d * (1.0 - d * (0.5 - d * (1.0 / 3.0)))
    } else {
        ln(s)
    }
}

/// `dlogits[i, j] = (probs[i, j] − [j == label_i]) / n`; 1-D grid-stride.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn softmax_xent_backward(
    probs: *const f32,
    labels: *const i32,
    dlogits: *mut f32,
    n: u32,
    classes: u32,
) {
    let (mut i, step) = grid_stride();
    let total = n as usize * classes as usize;
    let inv_n = 1.0 / n as f32;
    while i < total {
        let (row, j) = (i / classes as usize, i % classes as usize);
        let hot = if unsafe { *labels.add(row) } as usize == j {
            1.0
        } else {
            0.0
        };
        unsafe { *dlogits.add(i) = (*probs.add(i) - hot) * inv_n };
        i += step;
    }
}

/// `rank[i]` = number of classes scoring strictly higher than the true one.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn label_rank(
    scores: *const f32,
    labels: *const i32,
    rank: *mut f32,
    classes: u32,
) {
    let row = bid_x() as usize;
    let s = unsafe { scores.add(row * classes as usize) };
    let target = unsafe { *s.add(*labels.add(row) as usize) };
    let mut count = 0.0f32;
    let mut j = tid_x();
    while j < classes {
        if unsafe { *s.add(j as usize) } > target {
            count += 1.0;
        }
        j += bdim_x();
    }
    let total = unsafe { block_sum(count, shared::<f32>()) };
    if tid_x() == 0 {
        unsafe { *rank.add(row) = total };
    }
}
