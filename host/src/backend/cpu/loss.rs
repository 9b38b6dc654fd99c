//! CPU reference: loss (to be written).
