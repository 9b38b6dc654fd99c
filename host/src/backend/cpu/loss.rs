//! CPU reference: loss (to be written).
use crate::backend::*;
pub fn softmax_xent_forward(
    n: usize,
    classes: usize,
    logits: &[f32],
    labels: &[i32],
    probs: &mut [f32],
    loss: &mut [f32],
) {
    todo!()
}
pub fn softmax_xent_backward(
    n: usize,
    classes: usize,
    probs: &[f32],
    labels: &[i32],
    dlogits: &mut [f32],
) {
    todo!()
}
pub fn label_rank(n: usize, classes: usize, scores: &[f32], labels: &[i32], rank: &mut [f32]) {
    todo!()
}
