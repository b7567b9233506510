//! One [`Gpu`] handle per (device, torch stream), created on first use and kept for the life of the process.
//!
//! Opening a device queries its properties and retains its primary context (the one torch uses), which is too
//! slow to repeat on every call; so each device gets one base handle, and every stream a cheap
//! [`Gpu::with_stream`] handle that shares the base's context and loaded kernel modules. A first call on a new
//! stream therefore loads no module, which matters when that stream is being captured into a CUDA graph. Torch's
//! streams come from fixed per-device pools (and the default stream is 0), so the cache stays small.

use flashmla::cuda::Gpu;
use flashmla::Result;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

#[derive(Default)]
struct Handles {
    /// One per device ordinal: owns the module cache.
    base: HashMap<usize, Gpu>,
    /// One per (device ordinal, raw `CUstream`).
    stream: HashMap<(usize, u64), Gpu>,
}

fn cache() -> &'static Mutex<Handles> {
    static CACHE: OnceLock<Mutex<Handles>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// The handle that launches on `stream` of device `device` (`stream` is
/// `torch.cuda.current_stream(device).cuda_stream`, given by the Python layer).
pub fn gpu_for(device: usize, stream: u64) -> Result<Gpu> {
    // A panic elsewhere cannot leave the maps half-updated (single inserts), so a poisoned lock is still usable.
    let mut h = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(gpu) = h.stream.get(&(device, stream)) {
        return Ok(gpu.clone());
    }
    // SAFETY: torch's streams (pool streams and the default stream) are never destroyed while the process runs,
    // and the handle constructors reject a stream of another device's context. A user stream wrapped with
    // `torch.cuda.ExternalStream` must outlive its use, as torch itself requires; these handles do not own it.
    let gpu = match h.base.get(&device) {
        Some(base) => unsafe { base.with_stream(stream)? },
        None => {
            let base = unsafe { Gpu::with_external_stream(device, stream)? };
            h.base.insert(device, base.clone());
            base
        }
    };
    h.stream.insert((device, stream), gpu.clone());
    Ok(gpu)
}
