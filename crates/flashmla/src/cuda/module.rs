//! Loading the embedded cubins (one module per kernel family, loaded on first use) and looking kernels up.

use super::device::{Context, Gpu, SUPPORTED_CC};
use super::driver::check;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// One process-wide counter so a [`Kernel`] can tell which module cache (and so which context) it came from.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// The loaded modules and looked-up kernels of one device context, shared by the [`Gpu`] handles opened on it
/// (`Gpu::new` makes one; `Gpu::with_stream` shares it). Unloads the modules when the last handle is gone.
pub(crate) struct ModuleCache {
    pub(crate) id: u64,
    ctx: Arc<Context>,
    state: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    modules: HashMap<&'static str, sys::CUmodule>,
    kernels: HashMap<(String, String), Kernel>,
}

// SAFETY: module handles are plain identifiers used under the Mutex, with the context bound first.
unsafe impl Send for ModuleCache {}
// SAFETY: as above.
unsafe impl Sync for ModuleCache {}

impl ModuleCache {
    pub(crate) fn new(ctx: Arc<Context>) -> Self {
        ModuleCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            ctx,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        // A panic while holding the lock cannot leave the maps inconsistent (each insert is one step).
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for ModuleCache {
    /// Kernels looked up earlier become unusable: `launch` refuses them, as no handle has this cache's id any more.
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.kernels.clear();
        for (_, module) in state.modules.drain() {
            // SAFETY: each module was loaded once by `Gpu::kernel` and is unloaded once, in its context.
            unsafe {
                sys::cuModuleUnload(module);
            }
        }
    }
}

/// A kernel of one embedded family, ready to launch on the [`Gpu`] that looked it up (or any handle sharing its
/// context through [`Gpu::with_stream`]). Cheap to clone.
#[derive(Clone)]
pub struct Kernel {
    pub(crate) inner: Arc<KernelInner>,
}

pub(crate) struct KernelInner {
    pub(crate) func: sys::CUfunction,
    /// The module cache the kernel came from.
    pub(crate) cache_id: u64,
    /// Its context (bound before querying the function).
    ctx: Arc<Context>,
    pub(crate) family: &'static str,
    pub(crate) name: String,
    /// The dynamic shared memory limit already raised on the function (48 KiB, the default, until raised).
    pub(crate) smem_limit: AtomicU32,
    /// Whether cluster sizes above the portable 8 are already allowed on the function.
    pub(crate) non_portable_cluster: AtomicBool,
}

// SAFETY: a CUfunction is an identifier usable from any thread once its context is current (launch binds it);
// the mutable launch state is atomic.
unsafe impl Send for KernelInner {}
// SAFETY: as above.
unsafe impl Sync for KernelInner {}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Kernel({}::{})", self.inner.family, self.inner.name)
    }
}

/// Static properties of a compiled kernel, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelAttributes {
    /// Registers per thread.
    pub num_regs: u32,
    /// Local memory per thread in bytes (non-zero means spills or stack arrays: look at the SASS).
    pub local_bytes: u32,
    /// Static shared memory per block in bytes.
    pub static_smem_bytes: u32,
    /// Largest block the kernel can be launched with, in threads.
    pub max_threads_per_block: u32,
}

impl Kernel {
    /// The kernel family (the cubin it came from).
    pub fn family(&self) -> &'static str {
        self.inner.family
    }

    /// The kernel's symbol name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Registers, local memory and static shared memory of the compiled kernel.
    pub fn attributes(&self) -> Result<KernelAttributes> {
        use sys::CUfunction_attribute as A;
        self.inner.ctx.bind()?;
        let get = |attr: A| -> Result<u32> {
            let mut v = 0i32;
            // SAFETY: `func` is a live function handle; writes one int.
            check("cuFuncGetAttribute", unsafe {
                sys::cuFuncGetAttribute(&mut v, attr, self.inner.func)
            })?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        Ok(KernelAttributes {
            num_regs: get(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            local_bytes: get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            static_smem_bytes: get(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
            max_threads_per_block: get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        })
    }
}

/// Default dynamic shared memory limit of a function before it is raised (48 KiB).
pub(crate) const DEFAULT_DYNAMIC_SMEM_BYTES: u32 = 48 * 1024;

/// Bytes of `cubin` copied into 8-byte-aligned storage: `include_bytes!` data has no alignment guarantee and the
/// driver parses the ELF image in place.
fn aligned_image(cubin: &[u8]) -> Vec<u64> {
    const WORD: usize = std::mem::size_of::<u64>();
    let mut words = vec![0u64; cubin.len().div_ceil(WORD) + 1]; // + 1: room for a terminating zero
    for (w, chunk) in words.iter_mut().zip(cubin.chunks(WORD)) {
        let mut b = [0u8; WORD];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
    words
}

impl Gpu {
    /// Looks up kernel `name` in the embedded cubin of `family`, loading the module on first use (cached).
    /// [`Error::KernelsNotBuilt`] when the family's cubin is not in this build; [`Error::UnsupportedDevice`]
    /// unless the device is compute capability 9.0.
    pub fn kernel(&self, family: &str, name: &str) -> Result<Kernel> {
        let key = (family.to_string(), name.to_string());
        if let Some(k) = self.inner.modules.lock().kernels.get(&key) {
            return Ok(k.clone());
        }
        let Some(&family) = flashmla_kernels::FAMILIES.iter().find(|&&f| f == family) else {
            return Err(Error::KernelsNotBuilt(format!(
                "there is no kernel family `{family}` (families: {:?})",
                flashmla_kernels::FAMILIES
            )));
        };
        let Some(cubin) = flashmla_kernels::cubin(family) else {
            return Err(Error::KernelsNotBuilt(format!(
                "the `{family}` cubin is missing (nvcc {})",
                if flashmla_kernels::NVCC_VERSION.is_empty() {
                    "not found at build time".to_string()
                } else {
                    format!("`{}` failed on it", flashmla_kernels::NVCC_VERSION)
                }
            )));
        };
        let info = self.info();
        if info.cc != SUPPORTED_CC {
            return Err(Error::UnsupportedDevice {
                device: info.name.clone(),
                major: info.cc.0,
                minor: info.cc.1,
            });
        }
        let symbol = CString::new(name).map_err(|_| {
            Error::invalid(
                "kernel name",
                "a name without NUL bytes",
                format!("{name:?}"),
            )
        })?;
        self.inner.bind()?;
        let mut state = self.inner.modules.lock();
        if let Some(k) = state.kernels.get(&key) {
            return Ok(k.clone());
        }
        let module = match state.modules.get(family) {
            Some(&m) => m,
            None => {
                let image = aligned_image(cubin);
                let mut m: sys::CUmodule = std::ptr::null_mut();
                // SAFETY: `image` is a complete sm_90a cubin, 8-byte aligned, alive for the call (the driver copies it).
                check(&format!("cuModuleLoadData({family})"), unsafe {
                    sys::cuModuleLoadData(&mut m, image.as_ptr().cast())
                })?;
                state.modules.insert(family, m);
                m
            }
        };
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` is loaded; `symbol` is NUL-terminated; writes one handle.
        check(&format!("cuModuleGetFunction({family}::{name})"), unsafe {
            sys::cuModuleGetFunction(&mut func, module, symbol.as_ptr())
        })?;
        let kernel = Kernel {
            inner: Arc::new(KernelInner {
                func,
                cache_id: self.inner.modules.id,
                ctx: self.inner.ctx.clone(),
                family,
                name: name.to_string(),
                smem_limit: AtomicU32::new(DEFAULT_DYNAMIC_SMEM_BYTES),
                non_portable_cluster: AtomicBool::new(false),
            }),
        };
        state.kernels.insert(key, kernel.clone());
        Ok(kernel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_image_keeps_every_byte() {
        let bytes: Vec<u8> = (0..37u8).collect();
        let words = aligned_image(&bytes);
        assert_eq!(words.as_ptr() as usize % std::mem::align_of::<u64>(), 0);
        // SAFETY: reading the words' own bytes.
        let back = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), bytes.len()) };
        assert_eq!(back, &bytes[..]);
    }
}
