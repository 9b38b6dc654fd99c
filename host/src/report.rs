//! Metrics and plots (being written).
