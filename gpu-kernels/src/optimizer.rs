//! Momentum SGD with weight decay, in place over one parameter tensor.
//! `rule == 0` (PyTorch): `v ← μv + (g + λw)`, `w ← w − lr·v`.
//! `rule == 1` (the paper): `v ← μv − λ·lr·w − lr·g`, `w ← w + v`.
//! Mapping: 1-D grid-stride, one element per thread per iteration.

use crate::device::grid_stride;

#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sgd_update(
    w: *mut f32,
    g: *const f32,
    v: *mut f32,
    n: usize,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    rule: u32,
) {
    let (mut i, step) = grid_stride();
    while i < n {
        unsafe {
            let (wi, gi, vi) = (*w.add(i), *g.add(i), *v.add(i));
            if rule == 0 {
                let nv = momentum * vi + (gi + weight_decay * wi);
                *v.add(i) = nv;
                *w.add(i) = wi - lr * nv;
            } else {
                let nv = momentum * vi - weight_decay * lr * wi - lr * gi;
                *v.add(i) = nv;
                *w.add(i) = wi + nv;
            }
        }
        i += step;
    }
}
