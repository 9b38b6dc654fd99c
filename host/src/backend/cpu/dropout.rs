//! CPU reference: dropout (to be written).
use crate::backend::*;
pub fn dropout_forward(p: &DropoutParams, y: &mut [f32]) {
    todo!()
}
pub fn dropout_backward(p: &DropoutParams, d: &mut [f32]) {
    todo!()
}
