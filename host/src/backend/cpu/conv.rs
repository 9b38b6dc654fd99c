//! CPU reference: conv (to be written).
use crate::backend::*;
pub fn conv_forward(g: &ConvGeom, x: &[f32], w: &[f32], bias: &[f32], y: &mut [f32]) {
    todo!()
}
pub fn conv_backward_data(g: &ConvGeom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    todo!()
}
pub fn conv_backward_filter(g: &ConvGeom, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    todo!()
}
pub fn conv_backward_bias(g: &ConvGeom, dy: &[f32], db: &mut [f32]) {
    todo!()
}
