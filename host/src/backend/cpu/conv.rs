//! CPU reference: conv (to be written).
