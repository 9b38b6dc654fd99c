//! The subcommands behind `host`'s command line.

use anyhow::Result;

use crate::backend::cuda;

/// `host devices`: the project's deviceQuery.
pub fn devices() -> Result<()> {
    let list = cuda::devices()?;
    let (major, minor) = cuda::driver_version()?;
    println!(
        "CUDA driver {major}.{minor}, {} device(s); kernels built for {}",
        list.len(),
        env!("ALEXNET_CUDA_ARCH")
    );
    for d in list {
        println!(
            "  [{}] {}  sm_{}{}  {:.1} GiB  {} SMs  {} MHz  L2 {} MiB  {} KiB shared/block",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_mem as f64 / (1u64 << 30) as f64,
            d.sm_count,
            d.clock_mhz,
            d.l2_bytes >> 20,
            d.max_shared_per_block >> 10
        );
    }
    Ok(())
}
