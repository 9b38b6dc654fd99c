//! CPU reference: lrn (to be written).
