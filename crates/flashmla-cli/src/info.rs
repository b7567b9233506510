//! `flashmla info`: the build, the GPU and the driver.

use crate::meta;
use flashmla::cuda::{self, Gpu};

/// Prints what this binary carries and what the machine has; never fails for lack of a GPU.
pub fn run(device: usize) -> Result<u8, String> {
    println!(
        "flashmla {} (commit {})",
        env!("CARGO_PKG_VERSION"),
        meta::COMMIT
    );
    let built = cuda::kernel_families();
    if built.iter().all(|(_, b)| !b) {
        println!("kernels: none built into this binary (nvcc was not found at build time)");
    } else {
        println!(
            "kernels: {} built with {}",
            cuda::KERNEL_ARCH,
            if cuda::NVCC_VERSION.is_empty() {
                "nvcc"
            } else {
                cuda::NVCC_VERSION
            }
        );
    }
    for (family, ok) in &built {
        println!("  {family:<12} {}", if *ok { "built" } else { "NOT built" });
    }
    match Gpu::device_count() {
        Err(e) => {
            println!("GPU: none ({e})");
            return Ok(0);
        }
        Ok(0) => {
            println!("GPU: none (the driver reports no CUDA device)");
            return Ok(0);
        }
        Ok(n) => println!("GPUs: {n}"),
    }
    match Gpu::new(device) {
        Err(e) => println!("GPU {device}: unusable: {e}"),
        Ok(gpu) => {
            let i = gpu.info();
            println!("GPU {device}: {}", i.name);
            println!("  compute capability  sm_{}{}", i.cc.0, i.cc.1);
            println!("  multiprocessors     {}", i.sm_count);
            println!("  L2 cache            {} MB", i.l2_bytes / 1_000_000);
            println!(
                "  smem per block      {} KB (opt-in)",
                i.max_smem_per_block_optin / 1024
            );
            println!(
                "  memory              {:.1} GB",
                i.total_mem_bytes as f64 / 1e9
            );
            println!("  driver              {}", i.driver_version);
            if let Some(mhz) = i.sm_clock_mhz {
                println!("  SM clock (max)      {mhz} MHz");
            }
            if let Some(bus) = &i.pci_bus_id {
                println!("  PCI bus id          {bus}");
            }
            match crate::clocks::Nvml::for_device(i) {
                Some(n) => {
                    let show = |v: Option<String>| v.unwrap_or_else(|| "?".into());
                    println!(
                        "  SM clock (now)      {} MHz",
                        show(n.sm_clock_mhz().map(|v| v.to_string()))
                    );
                    println!(
                        "  power               {} W of {} W (limit)",
                        show(n.power_w().map(|v| format!("{v:.0}"))),
                        show(n.power_limit_w().map(|v| format!("{v:.0}")))
                    );
                }
                None => println!("  SM clock (now)      unknown (NVML not available)"),
            }
            let ok = i.cc == (9, 0);
            println!(
                "  flashmla kernels    {}",
                if ok {
                    "supported (sm_90a)"
                } else {
                    "not supported on this architecture (need sm_90)"
                }
            );
        }
    }
    Ok(0)
}
