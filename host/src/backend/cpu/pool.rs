//! CPU reference: pool (to be written).
