//! Datasets and loaders (being written).
