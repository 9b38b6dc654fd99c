//! CPU reference: optimizer (to be written).
use crate::backend::*;
pub fn sgd_update(p: &SgdParams, w: &mut [f32], g: &[f32], v: &mut [f32]) {
    todo!()
}
