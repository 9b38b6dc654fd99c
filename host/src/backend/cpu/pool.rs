//! CPU reference: pool (to be written).
use crate::backend::*;
pub fn maxpool_forward(g: &PoolGeom, x: &[f32], y: &mut [f32]) {
    todo!()
}
pub fn maxpool_backward(g: &PoolGeom, x: &[f32], y: &[f32], dy: &[f32], dx: &mut [f32]) {
    todo!()
}
