//! Kernel launches through `cuLaunchKernelEx`: grid, block, dynamic shared memory, optional thread-block
//! cluster, and one `#[repr(C)]` parameter struct passed by value.

use super::device::Gpu;
use super::driver::{check, cuda_error};
use super::module::{Kernel, DEFAULT_DYNAMIC_SMEM_BYTES};
use super::params::DeviceParams;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// Largest kernel parameter block accepted (the classic `__grid_constant__` limit, valid on every driver).
pub const MAX_PARAMS_BYTES: usize = 4096;

/// Dynamic shared memory a function may use without opting in (48 KiB); above it `launch` raises the function's
/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
pub const STATIC_SMEM_LIMIT_BYTES: u32 = DEFAULT_DYNAMIC_SMEM_BYTES;

/// Cluster sizes up to this many blocks are portable; larger ones need an opt-in attribute on the function.
const PORTABLE_CLUSTER_BLOCKS: u32 = 8;

/// Geometry of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid dimension (x, y, z); every entry at least 1.
    pub grid: (u32, u32, u32),
    /// Threads per block dimension (x, y, z); every entry at least 1.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
    /// Thread-block cluster dimensions; each must divide the grid's. `None`: no cluster attribute.
    pub cluster: Option<(u32, u32, u32)>,
    /// Programmatic dependent launch (sm_90+): the grid may start before the previous kernel of the
    /// stream has finished, once every CTA of that kernel ran `griddepcontrol.launch_dependents` or
    /// exited. Only for kernels that need nothing from their predecessor, or that wait for it with
    /// `griddepcontrol.wait` before they do.
    pub programmatic: bool,
}

impl LaunchConfig {
    /// A 1-D launch with no dynamic shared memory and no cluster.
    pub fn linear(grid_x: u32, block_x: u32) -> Self {
        LaunchConfig {
            grid: (grid_x, 1, 1),
            block: (block_x, 1, 1),
            shared_mem_bytes: 0,
            cluster: None,
            programmatic: false,
        }
    }

    /// Threads per block.
    pub fn threads_per_block(&self) -> u64 {
        self.block.0 as u64 * self.block.1 as u64 * self.block.2 as u64
    }

    /// Checks what the driver would reject with a less helpful message: empty dimensions, a block larger than
    /// `max_threads`, shared memory above `max_smem` (the device's opt-in limit), clusters that do not divide the
    /// grid. Pure; `launch` calls it.
    pub fn validate(&self, max_threads: u32, max_smem: usize) -> Result<()> {
        let dims = |(x, y, z): (u32, u32, u32)| [x, y, z];
        if dims(self.grid).contains(&0) {
            return Err(Error::invalid(
                "cfg.grid",
                "every dimension >= 1",
                format!("{:?}", self.grid),
            ));
        }
        if dims(self.block).contains(&0) || self.threads_per_block() > max_threads as u64 {
            return Err(Error::invalid(
                "cfg.block",
                format!("every dimension >= 1 and at most {max_threads} threads in all"),
                format!("{:?}", self.block),
            ));
        }
        if self.shared_mem_bytes as usize > max_smem {
            return Err(Error::invalid(
                "cfg.shared_mem_bytes",
                format!("at most {max_smem} bytes (the device's opt-in limit per block)"),
                self.shared_mem_bytes,
            ));
        }
        if let Some(c) = self.cluster {
            let divides = dims(c)
                .iter()
                .zip(dims(self.grid))
                .all(|(&c, g)| c >= 1 && g % c == 0);
            if !divides {
                return Err(Error::invalid(
                    "cfg.cluster",
                    format!("dimensions >= 1 that divide the grid {:?}", self.grid),
                    format!("{c:?}"),
                ));
            }
        }
        Ok(())
    }
}

impl Gpu {
    /// Launches `k` on this handle's stream with `params` as its single by-value argument
    /// (`const __grid_constant__ Params p` on the device side).
    ///
    /// Raises the function's dynamic shared memory limit when `cfg.shared_mem_bytes` exceeds 48 KiB, adds the
    /// cluster-dimension launch attribute when `cfg.cluster` is set (and the non-portable-size opt-in above 8
    /// blocks). Errors: [`Error::InvalidArgument`] for a bad configuration or a kernel of another `Gpu`;
    /// [`Error::Cuda`] when the driver refuses the launch, which includes a *sticky* error left by an earlier
    /// kernel that faulted (the context is then unusable; see `docs/gpu-plumbing.md`). When
    /// [`Gpu::sync_launches`] is on, the stream is synchronised after the launch so that a fault of this kernel
    /// is reported here, naming it.
    ///
    /// `P`'s layout is checked against its C++ struct at compile time ([`DeviceParams`]), and its family
    /// against the kernel's here ([`Error::InvalidArgument`] naming `params`).
    ///
    /// # Safety
    /// `P` must be the parameter struct this kernel takes (one of its family's `params.h`), and every device
    /// pointer in `params` must be valid for every access the kernel makes with the given geometry, for as long
    /// as the kernel runs (until the stream passes it), without aliasing the kernel does not expect.
    pub unsafe fn launch<P: DeviceParams>(
        &self,
        k: &Kernel,
        cfg: &LaunchConfig,
        params: &P,
    ) -> Result<()> {
        let kernel = &k.inner;
        if kernel.cache_id != self.inner.modules.id {
            return Err(Error::invalid(
                "kernel",
                "a kernel looked up through this Gpu or one sharing its context (Gpu::kernel)",
                format!("{}::{} from another Gpu handle", kernel.family, kernel.name),
            ));
        }
        if kernel.family != P::FAMILY {
            return Err(Error::invalid(
                "params",
                format!("the parameter struct of family `{}`", kernel.family),
                format!("{} of family `{}`", P::RUST_NAME, P::FAMILY),
            ));
        }
        let params_bytes = std::mem::size_of::<P>();
        if params_bytes > MAX_PARAMS_BYTES {
            return Err(Error::invalid(
                "params",
                format!("a parameter struct of at most {MAX_PARAMS_BYTES} bytes"),
                params_bytes,
            ));
        }
        let info = self.info();
        cfg.validate(info.max_threads_per_block, info.max_smem_per_block_optin)?;
        if cfg.cluster.is_some() && !info.cluster_launch {
            return Err(Error::unsupported(
                "thread-block cluster launch",
                format!("{} does not support clusters", info.name),
            ));
        }
        self.inner.bind()?;
        let what = || format!("{}::{}", kernel.family, kernel.name);

        if cfg.shared_mem_bytes > STATIC_SMEM_LIMIT_BYTES
            && cfg.shared_mem_bytes > kernel.smem_limit.load(Ordering::Acquire)
        {
            let bytes = i32::try_from(cfg.shared_mem_bytes).map_err(|_| {
                Error::invalid(
                    "cfg.shared_mem_bytes",
                    "a value that fits in i32",
                    cfg.shared_mem_bytes,
                )
            })?;
            check(
                &format!(
                    "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {})",
                    what()
                ),
                sys::cuFuncSetAttribute(
                    kernel.func,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes,
                ),
            )?;
            kernel
                .smem_limit
                .fetch_max(cfg.shared_mem_bytes, Ordering::AcqRel);
        }

        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if let Some((x, y, z)) = cfg.cluster {
            if x as u64 * y as u64 * z as u64 > PORTABLE_CLUSTER_BLOCKS as u64
                && !kernel.non_portable_cluster.load(Ordering::Acquire)
            {
                check(
                    &format!("cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED, {})", what()),
                    sys::cuFuncSetAttribute(
                        kernel.func,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                        1,
                    ),
                )?;
                kernel.non_portable_cluster.store(true, Ordering::Release);
            }
            // SAFETY (zeroed): the attribute is plain data; all-zero is a valid bit pattern for it.
            let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attr.value.clusterDim.x = x;
            attr.value.clusterDim.y = y;
            attr.value.clusterDim.z = z;
            attrs.push(attr);
        }
        if cfg.programmatic {
            // SAFETY (zeroed): as above.
            let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(attr);
        }

        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: cfg.block.0,
            blockDimY: cfg.block.1,
            blockDimZ: cfg.block.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.inner.stream,
            attrs: if attrs.is_empty() {
                std::ptr::null_mut()
            } else {
                attrs.as_mut_ptr()
            },
            numAttrs: attrs.len() as u32,
        };
        // One kernel argument: the address of the params struct, which the driver copies before returning.
        let mut args: [*mut c_void; 1] = [params as *const P as *mut c_void];
        let r = sys::cuLaunchKernelEx(
            &config,
            kernel.func,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        );
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(cuda_error(&format!("cuLaunchKernelEx({})", what()), r));
        }
        if self.sync_launches() && !self.is_capturing()? {
            let r = sys::cuStreamSynchronize(self.inner.stream);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(cuda_error(
                    &format!("kernel {} (stream synchronised after launch)", what()),
                    r,
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_THREADS: u32 = 1024;
    const MAX_SMEM: usize = 227 * 1024;

    #[test]
    fn launch_config_validation() {
        let ok = LaunchConfig {
            grid: (132, 2, 1),
            block: (384, 1, 1),
            shared_mem_bytes: 200 * 1024,
            cluster: Some((2, 1, 1)),
            programmatic: false,
        };
        assert!(ok.validate(MAX_THREADS, MAX_SMEM).is_ok());
        assert!(LaunchConfig::linear(1, 1)
            .validate(MAX_THREADS, MAX_SMEM)
            .is_ok());

        let bad = [
            (
                LaunchConfig {
                    grid: (0, 1, 1),
                    ..ok
                },
                "cfg.grid",
            ),
            (
                LaunchConfig {
                    block: (1, 0, 1),
                    ..ok
                },
                "cfg.block",
            ),
            (
                LaunchConfig {
                    block: (1025, 1, 1),
                    ..ok
                },
                "cfg.block",
            ),
            (
                LaunchConfig {
                    block: (32, 32, 2),
                    ..ok
                },
                "cfg.block",
            ),
            (
                LaunchConfig {
                    shared_mem_bytes: 228 * 1024,
                    ..ok
                },
                "cfg.shared_mem_bytes",
            ),
            (
                LaunchConfig {
                    cluster: Some((5, 1, 1)),
                    programmatic: false,
                    ..ok
                },
                "cfg.cluster",
            ),
            (
                LaunchConfig {
                    cluster: Some((0, 1, 1)),
                    programmatic: false,
                    ..ok
                },
                "cfg.cluster",
            ),
            (
                LaunchConfig {
                    cluster: Some((1, 4, 1)),
                    programmatic: false,
                    ..ok
                },
                "cfg.cluster",
            ),
        ];
        for (cfg, arg) in bad {
            let err = cfg.validate(MAX_THREADS, MAX_SMEM).unwrap_err();
            assert_eq!(err.arg(), Some(arg), "{cfg:?}: {err}");
        }
    }

    #[test]
    fn launch_attribute_layout_matches_the_driver_abi() {
        // CUlaunchAttribute: 4-byte id, 4 bytes pad, 64-byte value union (CUDA 12/13 headers).
        assert_eq!(std::mem::size_of::<sys::CUlaunchAttribute>(), 72);
    }
}
