//! CPU reference: activation (to be written).
use crate::backend::*;
pub fn relu_forward(y: &mut [f32]) {
    todo!()
}
pub fn relu_backward(y: &[f32], d: &mut [f32]) {
    todo!()
}
