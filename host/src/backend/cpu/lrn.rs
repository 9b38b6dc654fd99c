//! CPU reference: lrn (to be written).
use crate::backend::*;
pub fn lrn_forward(p: &LrnParams, x: &[f32], y: &mut [f32], scale: &mut [f32]) {
    todo!()
}
pub fn lrn_backward(
    p: &LrnParams,
    x: &[f32],
    y: &[f32],
    scale: &[f32],
    dy: &[f32],
    dx: &mut [f32],
) {
    todo!()
}
