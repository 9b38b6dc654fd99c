//! CPU reference: gemm (to be written).
use crate::backend::*;
pub fn fc_forward(g: &FcGeom, x: &[f32], w: &[f32], b: &[f32], y: &mut [f32]) {
    todo!()
}
pub fn fc_backward_data(g: &FcGeom, dy: &[f32], w: &[f32], dx: &mut [f32]) {
    todo!()
}
pub fn fc_backward_filter(g: &FcGeom, x: &[f32], dy: &[f32], dw: &mut [f32]) {
    todo!()
}
pub fn fc_backward_bias(g: &FcGeom, dy: &[f32], db: &mut [f32]) {
    todo!()
}
