//! CPU reference: one momentum-SGD step over parameter tensors, in place:
//! `sgd_update` for one tensor, `sgd_update_all` (the GPU kernel's twin) for
//! a list of them.
//!
//! `w` (weights), `g` (gradient) and `v` (momentum) have the same length and
//! layout. The rule is chosen by [`SgdRule`]:
//! - PyTorch: `v ← μ·v + (g + λ·w)`, `w ← w − lr·v`;
//! - paper (Krizhevsky et al. 2012, §5): `v ← μ·v − λ·lr·w − lr·g`, `w ← w + v`.
//!
//! Plain f32 arithmetic, in the order written above.

use rayon::prelude::*;

use crate::backend::*;

/// One step of `p.rule` on `(w, v)` with gradient `g`, in place.
pub fn sgd_update(p: &SgdParams, w: &mut [f32], g: &[f32], v: &mut [f32]) {
    assert!(
        w.len() == g.len() && w.len() == v.len(),
        "sgd_update: w, g, v lengths {}, {}, {} differ",
        w.len(),
        g.len(),
        v.len()
    );
    let SgdParams {
        lr,
        momentum: mu,
        weight_decay: wd,
        rule,
    } = *p;
    w.par_iter_mut()
        .zip(v.par_iter_mut())
        .zip(g.par_iter())
        .for_each(|((w, v), &g)| match rule {
            SgdRule::Pytorch => {
                *v = mu * *v + (g + wd * *w);
                *w -= lr * *v;
            }
            SgdRule::Paper => {
                *v = mu * *v - wd * lr * *w - lr * g;
                *w += *v;
            }
        });
}

/// [`sgd_update`] on every tensor of `tensors` (each one's `w`, `g`, `v` of
/// equal lengths).
pub fn sgd_update_all(p: &SgdParams, tensors: &mut [SgdTensor<'_, Vec<f32>>]) {
    for t in tensors {
        sgd_update(p, t.w, t.g, t.v);
    }
}
