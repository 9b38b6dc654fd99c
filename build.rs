//! Compiles `gpu-kernels` into the two PTX modules that `host` embeds: the
//! portable one (`kernels.ptx`) and the Hopper one (`kernels_sm90a.ptx`:
//! every kernel of the first plus the `wgmma` products of the crate's
//! `wgmma` feature, which only the architecture-specific `sm_90a` target
//! accepts; `host` loads it on compute capability 9.0).
//!
//! rustc's own NVPTX backend does the work: an inner `cargo rustc` builds the
//! kernel crate for `nvptx64-nvidia-cuda` with `-Zbuild-std=core` and fat LTO and
//! asks for `--emit=asm`, which is a complete PTX module. No CUDA toolkit is
//! involved, so this runs on machines without a GPU. The link step cargo still
//! requests would need `llvm-bitcode-linker` (not installable here); it is made a
//! no-op with `-Clinker=true` because the PTX is already complete.
//!
//! `ALEXNET_CUDA_ARCH` (default `sm_90`) picks the portable module's target;
//! any `sm_70`+ works.
//! `ALEXNET_PTX_VERSION` (default `80`, i.e. PTX ISA 8.0) picks `+ptxNN` (the
//! Hopper module takes at least 8.3, for its TMA kernels).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    let kernels = root.join("gpu-kernels");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        kernels.join("Cargo.toml").display()
    );
    println!("cargo:rerun-if-env-changed=ALEXNET_CUDA_ARCH");
    println!("cargo:rerun-if-env-changed=ALEXNET_PTX_VERSION");

    let arch = env::var("ALEXNET_CUDA_ARCH").unwrap_or_else(|_| "sm_90".into());
    let ptx_version = env::var("ALEXNET_PTX_VERSION").unwrap_or_else(|_| "80".into());
    let sm: u32 = arch
        .strip_prefix("sm_")
        .and_then(|s| s.trim_end_matches('a').parse().ok())
        .unwrap_or_else(|| panic!("ALEXNET_CUDA_ARCH must look like sm_90, got {arch:?}"));
    assert!(
        sm >= 70,
        "ALEXNET_CUDA_ARCH: rustc's NVPTX backend needs sm_70 or newer, got {arch}"
    );

    // The Hopper module's TMA kernels acquire their tensor maps with
    // `fence.proxy.tensormap` (PTX ISA 8.3).
    let hopper_ptx = ptx_version
        .parse::<u32>()
        .map_or(ptx_version.clone(), |v| v.max(83).to_string());
    // The portable module and the Hopper one (its `wgmma` kernels need the
    // architecture-specific `sm_90a` target), built side by side.
    let mut base = kernel_build(
        &kernels,
        &out.join("gpu-kernels-target"),
        &arch,
        &ptx_version,
        false,
    );
    let mut hopper = kernel_build(
        &kernels,
        &out.join("gpu-kernels-target-sm90a"),
        "sm_90a",
        &hopper_ptx,
        true,
    );
    let (base_ok, hopper_ok) = (base.wait(), hopper.wait());
    for (status, what) in [(base_ok, arch.as_str()), (hopper_ok, "sm_90a")] {
        let ok = status.is_ok_and(|s| s.success());
        assert!(
            ok,
            "build.rs: building gpu-kernels for nvptx64-nvidia-cuda ({what}) failed"
        );
    }
    for (dir, file) in [
        ("gpu-kernels-target", "kernels.ptx"),
        ("gpu-kernels-target-sm90a", "kernels_sm90a.ptx"),
    ] {
        let asm = out
            .join(dir)
            .join("nvptx64-nvidia-cuda/release/deps/gpu_kernels.s");
        let ptx = std::fs::read_to_string(&asm)
            .unwrap_or_else(|e| panic!("build.rs: no PTX at {}: {e}", asm.display()));
        assert!(
            ptx.contains(".entry"),
            "build.rs: {} holds no kernel entry points",
            asm.display()
        );
        write_if_changed(&out.join(file), &cap_registers(&ptx));
    }
    println!("cargo:rustc-env=ALEXNET_CUDA_ARCH={arch}");
}

/// Register caps (PTX `.maxnreg`) for kernels whose occupancy ptxas's own
/// choice cuts: `lrn_pool_forward` took 72 registers, which fits 3 blocks of
/// 256 threads on an SM (37.5% occupancy, ncu in
/// `benches/results/2026-12-04-h200-v20/`); at 64, 4 blocks fit.
const REGISTER_CAPS: &[(&str, u32)] = &[("lrn_pool_forward", 64)];

/// Threads per block of the TMA-fed kernels (`*_wg_tma_big`, launched with
/// `gpu_kernels::gemm::TMA_THREADS`: two consumer warpgroups and a producer
/// warp), declared to ptxas as `.maxntid` so that it keeps them within the
/// 65,536 registers of an SM (224 a thread) rather than the launch failing
/// with too many resources requested, as an epilogue holding 64 more
/// values once did.
const TMA_THREADS: u32 = 288;

/// `ptx` with a `.maxnreg` directive after the parameter list of each kernel
/// in [`REGISTER_CAPS`] and a `.maxntid` after that of each TMA-fed kernel.
fn cap_registers(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut tma = false;
    for line in ptx.lines() {
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            tma = rest
                .split('(')
                .next()
                .is_some_and(|n| n.ends_with("_wg_tma_big"));
        }
        out.push_str(line);
        out.push('\n');
        if tma && line == ")" {
            out.push_str(&format!(".maxntid {TMA_THREADS}, 1, 1\n"));
            tma = false;
        }
    }
    for (name, regs) in REGISTER_CAPS {
        let head = format!(".entry {name}(");
        let at = out
            .find(&head)
            .unwrap_or_else(|| panic!("build.rs: REGISTER_CAPS names {name}, which the PTX lacks"));
        let body = at
            + out[at..]
                .find("\n)\n{")
                .unwrap_or_else(|| panic!("build.rs: no body after .entry {name}"));
        out.insert_str(body + 3, &format!(".maxnreg {regs}\n"));
    }
    out
}

/// Starts `cargo rustc` on `gpu-kernels` for `arch` (with the `wgmma`
/// feature when `wgmma`) into `target_dir`, emitting the PTX (`.s`).
fn kernel_build(
    kernels: &Path,
    target_dir: &Path,
    arch: &str,
    ptx_version: &str,
    wgmma: bool,
) -> std::process::Child {
    let rustflags = [
        format!("-Ctarget-cpu={arch}"),
        format!("-Ctarget-feature=+ptx{ptx_version}"),
        "-Clinker=true".to_string(),
    ]
    .join("\x1f");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(kernels)
        .args([
            "rustc",
            "--release",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
        ])
        .arg("--target-dir")
        .arg(target_dir);
    if wgmma {
        cmd.args(["--features", "wgmma"]);
    }
    cmd.args(["--", "--emit=asm"]);
    // The outer build's settings must not leak into the kernel build.
    for var in [
        "RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_MAKEFLAGS",
        "CARGO_PROFILE_RELEASE_DEBUG",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    for (k, _) in env::vars() {
        if k.starts_with("CARGO_FEATURE_") || k.starts_with("CARGO_CFG_") || k.starts_with("DEP_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", rustflags);
    cmd.spawn()
        .expect("build.rs: could not run cargo for gpu-kernels")
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}
