//! CPU reference: optimizer (to be written).
