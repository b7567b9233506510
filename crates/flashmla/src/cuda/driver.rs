//! Driver start-up and error mapping: the only place that decides whether a CUDA driver is usable, and the one
//! translation of a `CUresult` into [`Error::Cuda`].

use crate::error::{Error, Result};
use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use std::sync::OnceLock;

/// The oldest driver accepted: the CUDA version the cubins and the `cudarc` bindings (`cuda-13000`) target.
/// Older drivers lack symbols the bindings resolve lazily (which would panic) and cannot load the cubins.
pub(crate) const MIN_DRIVER_VERSION: i32 = 13000;

/// Loads and initialises the driver once per process; returns the driver version (e.g. 13000 for 13.0).
///
/// Never panics: the library is probed with `is_culib_present` before any symbol is resolved (resolving one
/// from a missing library panics inside `cudarc`), and the version is checked before any call that a
/// too-old driver might not export.
pub(crate) fn init() -> Result<i32> {
    static INIT: OnceLock<Result<i32>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the driver library under its usual names; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoGpu(
                "the CUDA driver library (libcuda.so) was not found".to_string(),
            ));
        }
        // SAFETY: cuInit has no preconditions; flags must be 0.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::NoGpu(format!("cuInit failed: {}", describe(r))));
        }
        let mut version = 0i32;
        // SAFETY: writes one int.
        check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })
            .map_err(|e| Error::NoGpu(e.to_string()))?;
        if version < MIN_DRIVER_VERSION {
            return Err(Error::NoGpu(format!(
                "CUDA driver {} is older than {} (this build's kernels need a CUDA 13 driver, R580 or newer)",
                version_string(version),
                version_string(MIN_DRIVER_VERSION)
            )));
        }
        Ok(version)
    })
    .clone()
}

/// `13000` -> `"13.0"`.
pub(crate) fn version_string(v: i32) -> String {
    const MAJOR: i32 = 1000;
    const MINOR: i32 = 10;
    format!("{}.{}", v / MAJOR, (v % MAJOR) / MINOR)
}

/// The driver's name and description of a result code, e.g.
/// `CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)`.
pub(crate) fn describe(r: sys::CUresult) -> String {
    let e = DriverError(r);
    let name = e
        .error_name()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{r:?}"));
    match e.error_string() {
        Ok(desc) => format!("{name} ({})", desc.to_string_lossy()),
        Err(_) => name,
    }
}

/// `Ok(())` on `CUDA_SUCCESS`, else [`Error::Cuda`] naming `call` and the driver's error.
pub(crate) fn check(call: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(call, r))
    }
}

/// [`Error::Cuda`] for a failed call.
pub(crate) fn cuda_error(call: &str, r: sys::CUresult) -> Error {
    Error::Cuda {
        call: call.to_string(),
        code: describe(r),
    }
}
