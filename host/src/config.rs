//! Validated JSON configs (being written).
