/work/main/gpu-kernels/target/nvptx64-nvidia-cuda/release/deps/gpu_kernels-f7ce3be4e3241fae.d: src/lib.rs src/device.rs src/activation.rs src/conv.rs src/dropout.rs src/gemm.rs src/loss.rs src/lrn.rs src/optimizer.rs src/pool.rs Cargo.toml

/work/main/gpu-kernels/target/nvptx64-nvidia-cuda/release/deps/libgpu_kernels-f7ce3be4e3241fae.rmeta: src/lib.rs src/device.rs src/activation.rs src/conv.rs src/dropout.rs src/gemm.rs src/loss.rs src/lrn.rs src/optimizer.rs src/pool.rs Cargo.toml

src/lib.rs:
src/device.rs:
src/activation.rs:
src/conv.rs:
src/dropout.rs:
src/gemm.rs:
src/loss.rs:
src/lrn.rs:
src/optimizer.rs:
src/pool.rs:
Cargo.toml:

# env-dep:CLIPPY_ARGS=
# env-dep:CLIPPY_CONF_DIR
