//! CPU reference: activation (to be written).
