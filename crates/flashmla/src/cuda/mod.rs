//! GPU plumbing: one device, its stream, the embedded cubins, kernel launches (clusters included) and timing.
//!
//! Three layers, from the bottom:
//! * `cudarc::driver::sys`: raw CUDA driver bindings, loaded with `dlopen` at run time (the library builds and
//!   runs its CPU paths on machines without CUDA);
//! * a private `driver` module: driver start-up and the mapping of every `CUresult` to [`Error::Cuda`];
//! * the types here: [`Gpu`] (device, primary context, stream, module cache), [`DeviceTensor`] (owned memory),
//!   [`Kernel`] and [`LaunchConfig`] (one `#[repr(C)]` params struct per launch, through `cuLaunchKernelEx`).
//!
//! Nothing here panics on a machine without a GPU or driver: [`Gpu::new`] and [`Gpu::device_count`] return
//! [`Error::NoGpu`]. See `docs/gpu-plumbing.md` for error handling (sticky errors), clusters and external streams.
//!
//! [`Error::Cuda`]: crate::Error::Cuda
//! [`Error::NoGpu`]: crate::Error::NoGpu

mod cubin;
mod device;
mod driver;
mod event;
mod launch;
mod memory;
mod module;
pub mod params;
mod tensor_map;

pub use cubin::kernel_symbols;
pub use device::{DeviceInfo, Gpu, SYNC_LAUNCHES_ENV};
pub use launch::{LaunchConfig, MAX_PARAMS_BYTES, STATIC_SMEM_LIMIT_BYTES};
pub use memory::DeviceTensor;
pub use module::{Kernel, KernelAttributes};
pub(crate) use params::device_params;
pub use params::{DeviceParams, FieldLayout};
pub use tensor_map::TensorMapBytes;
pub(crate) use tensor_map::{encode_tiled_u16_sw128, encode_tiled_u16_sw128_uncached};

/// The nvcc release line that built the embedded cubins (empty when the build found no nvcc).
pub const NVCC_VERSION: &str = flashmla_kernels::NVCC_VERSION;

/// The GPU architecture the cubins target (`sm_90a`).
pub const KERNEL_ARCH: &str = flashmla_kernels::ARCH;

/// Every kernel family in the sources, with whether its cubin is embedded in this build.
pub fn kernel_families() -> Vec<(&'static str, bool)> {
    flashmla_kernels::FAMILIES
        .iter()
        .map(|&family| (family, flashmla_kernels::cubin(family).is_some()))
        .collect()
}

/// The same as [`kernel_families`] (the name the plumbing brief used).
pub fn kernels_built() -> Vec<(&'static str, bool)> {
    kernel_families()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// Runs everywhere (CI has no GPU): discovery must answer with a value or `NoGpu`, never panic.
    #[test]
    fn discovery_without_a_gpu_is_an_error_not_a_panic() {
        match Gpu::device_count() {
            Ok(n) => assert!(
                n > 0,
                "device_count returned Ok(0); expected NoGpu when there is no device"
            ),
            Err(Error::NoGpu(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("device_count: expected Ok or NoGpu, got {other:?}"),
        }
        match Gpu::new(0) {
            Ok(gpu) => {
                assert_eq!(gpu.ordinal(), 0);
                assert!(!gpu.info().name.is_empty());
            }
            Err(Error::NoGpu(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("Gpu::new(0): expected Ok or NoGpu, got {other:?}"),
        }
        // An ordinal past the last device is NoGpu too (or InvalidArgument naming the ordinal on a GPU machine).
        match Gpu::new(1 << 20) {
            Err(Error::NoGpu(_)) | Err(Error::InvalidArgument { .. }) => {}
            other => panic!(
                "Gpu::new(huge): expected NoGpu or InvalidArgument, got {:?}",
                other.map(|_| ())
            ),
        }
    }

    #[test]
    fn kernels_built_lists_every_family_once() {
        let built = kernels_built();
        assert_eq!(built.len(), flashmla_kernels::FAMILIES.len());
        for (family, ok) in &built {
            assert_eq!(*ok, flashmla_kernels::cubin(family).is_some(), "{family}");
        }
        assert!(
            built.iter().any(|(f, _)| *f == "kv_quant"),
            "kv_quant sources present: {built:?}"
        );
    }
}
