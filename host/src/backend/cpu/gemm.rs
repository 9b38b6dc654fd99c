//! CPU reference: gemm (to be written).
