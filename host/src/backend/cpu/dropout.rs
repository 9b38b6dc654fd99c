//! CPU reference: dropout (to be written).
