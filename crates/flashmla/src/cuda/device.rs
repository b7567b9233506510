//! Device discovery, [`DeviceInfo`], and [`Gpu`]: one device's primary context, one stream, a module cache.

use super::driver::{self, check, cuda_error};
use super::module::ModuleCache;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_char;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the CLI's `info` command and the dispatchers need to know about a device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability `(major, minor)`; the kernels need `(9, 0)`.
    pub cc: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// L2 cache size in bytes.
    pub l2_bytes: usize,
    /// Largest dynamic + static shared memory one block may opt in to, in bytes (227 KiB on Hopper).
    pub max_smem_per_block_optin: usize,
    /// Shared memory per SM, in bytes.
    pub max_smem_per_sm: usize,
    /// Largest block, in threads.
    pub max_threads_per_block: u32,
    /// Device memory, in bytes.
    pub total_mem_bytes: usize,
    /// CUDA version of the driver, e.g. `"13.0"`.
    pub driver_version: String,
    /// The same as the driver reports it (`13000` for 13.0), for comparisons.
    pub driver_version_code: i32,
    /// Peak SM clock in MHz, when the driver reports it (not the clock a kernel runs at: under load the card may
    /// run slower, e.g. at its power cap).
    pub sm_clock_mhz: Option<u32>,
    /// PCI bus id (`0000:19:00.0`), when the driver reports it: the key that names this device to other tools
    /// (NVML, nvidia-smi), whose device order may differ from CUDA's.
    pub pci_bus_id: Option<String>,
    /// Peak memory clock in MHz, when the driver reports it.
    pub mem_clock_mhz: Option<u32>,
    /// Memory bus width in bits, when the driver reports it.
    pub mem_bus_width_bits: Option<u32>,
    /// Whether stream-ordered allocation (`cuMemAllocAsync`) is available; [`Gpu::alloc`] uses it when it is.
    pub memory_pools: bool,
    /// Whether thread-block cluster launches are supported.
    pub cluster_launch: bool,
}

impl DeviceInfo {
    /// True for compute capability 9.0 (Hopper), the architecture the kernels are built for.
    pub fn is_sm90(&self) -> bool {
        self.cc == SUPPORTED_CC
    }

    /// Theoretical DRAM bandwidth in bytes/s (memory clock x 2 for double data rate x bus width), when the clocks
    /// are readable. A ceiling to compare measured bandwidth with (the copy ceiling measured on H100 is lower).
    pub fn peak_dram_bytes_per_s(&self) -> Option<f64> {
        const DOUBLE_DATA_RATE: f64 = 2.0;
        const BITS_PER_BYTE: f64 = 8.0;
        const HZ_PER_MHZ: f64 = 1e6;
        let clock = self.mem_clock_mhz? as f64 * HZ_PER_MHZ;
        let width = self.mem_bus_width_bits? as f64 / BITS_PER_BYTE;
        Some(clock * DOUBLE_DATA_RATE * width)
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const KIB: usize = 1 << 10;
        const MIB: usize = 1 << 20;
        const GIB: f64 = (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} (sm_{}{}), {} SMs, {:.1} GiB, L2 {} MiB, smem/block {} KiB, driver {}",
            self.ordinal,
            self.name,
            self.cc.0,
            self.cc.1,
            self.sm_count,
            self.total_mem_bytes as f64 / GIB,
            self.l2_bytes / MIB,
            self.max_smem_per_block_optin / KIB,
            self.driver_version
        )?;
        if let Some(mhz) = self.sm_clock_mhz {
            write!(f, ", SM clock {mhz} MHz")?;
        }
        if let Some(mhz) = self.mem_clock_mhz {
            write!(f, ", memory clock {mhz} MHz")?;
        }
        Ok(())
    }
}

/// The compute capability the cubins are built for (sm_90a).
pub(crate) const SUPPORTED_CC: (i32, i32) = (9, 0);

/// Environment variable that forces (`1`) or disables (`0`) a stream synchronisation after every launch;
/// unset, it is on in debug builds and off in release builds. See [`Gpu::set_sync_launches`].
pub const SYNC_LAUNCHES_ENV: &str = "FLASHMLA_SYNC_LAUNCHES";

/// A retained primary context of one device and the device's properties; released when its last user drops
/// (the `Gpu` handles, their module cache, the tensors they allocated).
pub(crate) struct Context {
    dev: sys::CUdevice,
    raw: sys::CUcontext,
    pub(crate) info: DeviceInfo,
}

// SAFETY: the handles are plain identifiers of driver objects; the CUDA driver API is thread-safe, and every use
// binds the context to the calling thread first (`bind`).
unsafe impl Send for Context {}
// SAFETY: as above; nothing in a Context is mutated after creation.
unsafe impl Sync for Context {}

impl Context {
    /// Makes the primary context current on the calling thread (cheap; every entry point calls it, because the
    /// driver's current context is per thread).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is the retained primary context, alive until `self` drops.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.info.ordinal
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Gpu::open`; errors cannot be reported from drop.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// The state shared by a [`Gpu`], its clones, and every [`super::DeviceTensor`] it allocated. Handles made with
/// [`Gpu::with_stream`] share the context and the module cache but have their own `GpuInner`.
pub(crate) struct GpuInner {
    pub(crate) ctx: Arc<Context>,
    pub(crate) modules: Arc<ModuleCache>,
    pub(crate) stream: sys::CUstream,
    owns_stream: bool,
    pub(crate) sync_launches: AtomicBool,
}

// SAFETY: the stream handle is a plain identifier; the driver API is thread-safe and every entry point binds the
// context first. Mutable state is atomic (sync_launches) or behind the module cache's Mutex.
unsafe impl Send for GpuInner {}
// SAFETY: as above.
unsafe impl Sync for GpuInner {}

impl GpuInner {
    /// See [`Context::bind`].
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind()
    }
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.ctx.info
    }
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        // The module cache and the context are released by their own Drop once their last user is gone.
        if self.owns_stream && self.bind().is_ok() {
            // SAFETY: the stream was created by `Gpu::new` and is destroyed once; pending work still completes.
            unsafe {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

fn sync_launches_default() -> bool {
    match std::env::var(SYNC_LAUNCHES_ENV).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => cfg!(debug_assertions),
    }
}

/// One CUDA device: its primary context (shared with the CUDA runtime and PyTorch), one stream every operation of
/// this handle is ordered on, and the cache of loaded kernel modules. Cheap to clone (shared state).
///
/// Thread-safe: each call binds the context to the calling thread (opening a handle puts the thread's previous
/// context back; [`Gpu::restoring_context`] does the same around any other calls). Work from clones of one `Gpu`
/// goes to the same stream, so it is ordered.
#[derive(Clone)]
pub struct Gpu {
    pub(crate) inner: Arc<GpuInner>,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal())
            .field("name", &self.info().name)
            .field("stream", &self.inner.stream)
            .field("owns_stream", &self.inner.owns_stream)
            .finish()
    }
}

/// How the stream of a new [`Gpu`] is obtained.
enum StreamChoice {
    /// Create a non-blocking stream owned by the `Gpu`.
    Own,
    /// Use the caller's stream (a raw `CUstream`; 0 is the legacy default stream).
    External(u64),
}

impl Gpu {
    /// Number of CUDA devices. [`Error::NoGpu`] when no driver or no device is present; never panics.
    pub fn device_count() -> Result<usize> {
        driver::init()?;
        let mut n = 0i32;
        // SAFETY: writes one int; the driver is initialised.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        match usize::try_from(n) {
            Ok(0) | Err(_) => Err(Error::NoGpu(
                "the CUDA driver reports no device".to_string(),
            )),
            Ok(n) => Ok(n),
        }
    }

    /// Opens device `ordinal` with a stream of its own (non-blocking with respect to the legacy default stream).
    /// [`Error::NoGpu`] without a driver or device, [`Error::InvalidArgument`] for an ordinal past the last
    /// device. Works on any architecture; [`Gpu::kernel`] is where a non-Hopper device is refused.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        Self::open(ordinal, StreamChoice::Own)
    }

    /// Opens device `ordinal` and runs everything on the caller's stream `stream` (a raw `CUstream`, e.g.
    /// `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream). The stream must belong to the
    /// device's primary context (PyTorch's streams do); that is checked.
    ///
    /// # Safety
    /// `stream` must be a valid stream handle (or 0, or one of the driver's special handles) and must stay alive
    /// for as long as this `Gpu`, its clones, and every [`super::DeviceTensor`] it allocates (device memory is
    /// freed in stream order on it) are alive.
    pub unsafe fn with_external_stream(ordinal: usize, stream: u64) -> Result<Gpu> {
        Self::open(ordinal, StreamChoice::External(stream))
    }

    fn open(ordinal: usize, stream: StreamChoice) -> Result<Gpu> {
        let version = driver::init()?;
        // Opening binds the device's primary context; the thread's current context (a host application's current
        // device) is put back afterwards, as every entry point run through `restoring_context` does.
        let _restore = ContextRestore::save()?;
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(
                "ordinal",
                format!("a device ordinal below {count}"),
                ordinal,
            ));
        }
        let ord = i32::try_from(ordinal)
            .map_err(|_| Error::invalid("ordinal", "a value that fits in i32", ordinal))?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle; the ordinal is in range.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ord) })?;
        let info = query_info(ordinal, dev, version)?;
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; the retain is balanced by Context::drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
        })?;
        let ctx = Arc::new(Context { dev, raw, info });
        ctx.bind()?;
        let modules = Arc::new(ModuleCache::new(ctx.clone()));
        let (raw_stream, owns_stream) = match stream {
            StreamChoice::Own => {
                let mut s: sys::CUstream = std::ptr::null_mut();
                let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
                // SAFETY: creates a stream in the current (primary) context.
                check("cuStreamCreate", unsafe {
                    sys::cuStreamCreate(&mut s, flags)
                })?;
                (s, true)
            }
            StreamChoice::External(handle) => {
                let s = handle as usize as sys::CUstream;
                check_stream_context(s, &ctx)?;
                (s, false)
            }
        };
        Ok(Gpu {
            inner: Arc::new(GpuInner {
                ctx,
                modules,
                stream: raw_stream,
                owns_stream,
                sync_launches: AtomicBool::new(sync_launches_default()),
            }),
        })
    }

    /// A handle on the same device that runs on the caller's stream `stream`, sharing this handle's context and
    /// loaded kernels (cheap: no module is reloaded). For per-call streams, e.g. PyTorch's current stream: keep
    /// one `Gpu` per device and call this for each operation. The stream must belong to the device's primary
    /// context; that is checked.
    ///
    /// # Safety
    /// As [`Gpu::with_external_stream`]: `stream` must be valid and outlive the returned handle, its clones and
    /// the tensors it allocates.
    pub unsafe fn with_stream(&self, stream: u64) -> Result<Gpu> {
        let _restore = ContextRestore::save()?;
        self.inner.bind()?;
        let s = stream as usize as sys::CUstream;
        check_stream_context(s, &self.inner.ctx)?;
        Ok(Gpu {
            inner: Arc::new(GpuInner {
                ctx: self.inner.ctx.clone(),
                modules: self.inner.modules.clone(),
                stream: s,
                owns_stream: false,
                sync_launches: AtomicBool::new(self.sync_launches()),
            }),
        })
    }

    /// The device's properties.
    pub fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }

    /// The raw `CUstream` every operation of this handle runs on (for interop, e.g. to hand to PyTorch).
    pub fn stream(&self) -> u64 {
        self.inner.stream as usize as u64
    }

    /// Waits until all work queued on this handle's stream has finished; reports any error a kernel raised
    /// (including a sticky error from an earlier fault, see `docs/gpu-plumbing.md`).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.bind()?;
        // SAFETY: the stream is alive as long as `self`.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.inner.stream)
        })
    }

    /// Whether every launch is followed by a stream synchronisation that attributes an asynchronous fault to the
    /// kernel that caused it. Default: the `FLASHMLA_SYNC_LAUNCHES` environment variable (`1`/`0`), else on in
    /// debug builds and off in release builds. Skipped while the stream is being captured into a CUDA graph.
    pub fn sync_launches(&self) -> bool {
        self.inner.sync_launches.load(Ordering::Relaxed)
    }

    /// Turns the synchronisation after every launch on or off (see [`Gpu::sync_launches`]); affects clones too.
    pub fn set_sync_launches(&self, on: bool) {
        self.inner.sync_launches.store(on, Ordering::Relaxed)
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.inner.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes for the current context's device.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// Runs `f` (which uses this handle) and then makes the context that was current on the calling thread before
    /// current again, when `f` changed it.
    ///
    /// Every entry point binds this device's primary context to the thread; the CUDA runtime (and so PyTorch)
    /// reads its current device from that binding. A host application that drives several devices calls through
    /// this to keep its own current device: one `cuCtxGetCurrent` before, and a rebind only when it differs.
    pub fn restoring_context<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let restore = ContextRestore::save()?;
        let res = f();
        let r = restore.restore();
        res.and_then(|v| r.map(|()| v))
    }

    /// Whether the stream is being captured into a CUDA graph (synchronising it would then be an error).
    pub fn is_capturing(&self) -> Result<bool> {
        // The legacy default stream (0) names the current context's, so bind it first like every entry point.
        self.inner.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is alive as long as `self`; writes one enum.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(self.inner.stream, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
}

/// The context current on the calling thread when it was saved, made current again by [`ContextRestore::restore`]
/// or on drop (after an early return), when it changed meanwhile.
struct ContextRestore {
    prev: sys::CUcontext,
    done: bool,
}

impl ContextRestore {
    /// Saves the current context (the driver must be initialised).
    fn save() -> Result<Self> {
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut prev)
        })?;
        Ok(ContextRestore { prev, done: false })
    }

    fn rebind(&self) -> Result<()> {
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut now) })?;
        if now == self.prev {
            return Ok(());
        }
        // SAFETY: `prev` was current on this thread a moment ago (or null, which unbinds): a context the
        // application keeps alive, as it did before this call.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.prev)
        })
    }

    fn restore(mut self) -> Result<()> {
        self.done = true;
        self.rebind()
    }
}

impl Drop for ContextRestore {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.rebind();
        }
    }
}

/// An external stream must belong to the primary context (the one this library binds); a stream of another
/// context would make every launch fail with `CUDA_ERROR_INVALID_HANDLE` or, worse, run in the wrong context.
fn check_stream_context(stream: sys::CUstream, primary: &Context) -> Result<()> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller vouches for the handle (with_external_stream's contract); writes one handle. For the
    // special handles (0, legacy, per-thread) the driver answers with the current context, the primary one.
    check("cuStreamGetCtx", unsafe {
        sys::cuStreamGetCtx(stream, &mut ctx)
    })?;
    if ctx != primary.raw {
        return Err(Error::invalid(
            "stream",
            format!("a stream of cuda:{}'s primary context", primary.ordinal()),
            format!("a stream of another context ({ctx:?})"),
        ));
    }
    Ok(())
}

/// Reads one integer attribute.
fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0i32;
    // SAFETY: `dev` is a valid device; writes one int.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr, dev)
    })
    .map_err(|e| match e {
        Error::Cuda { call, code } => Error::Cuda {
            call: format!("{call}({attr:?})"),
            code,
        },
        other => other,
    })?;
    Ok(v)
}

/// An attribute that must be a non-negative count.
fn attribute_usize(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<usize> {
    let v = attribute(dev, attr)?;
    usize::try_from(v).map_err(|_| Error::Cuda {
        call: format!("cuDeviceGetAttribute({attr:?})"),
        code: format!("negative value {v}"),
    })
}

/// An attribute some drivers no longer report (clocks): `None` when unreadable or not positive.
fn attribute_opt(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Option<u32> {
    attribute(dev, attr)
        .ok()
        .and_then(|v| u32::try_from(v).ok())
        .filter(|&v| v > 0)
}

/// The device's PCI bus id string, or `None` if the driver does not give one.
fn pci_bus_id(dev: sys::CUdevice) -> Option<String> {
    const BUS_ID_BYTES: usize = 64;
    let mut buf = [0 as c_char; BUS_ID_BYTES];
    // SAFETY: the buffer holds BUS_ID_BYTES chars; the driver writes a NUL-terminated string into it.
    let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), BUS_ID_BYTES as i32, dev) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    buf[BUS_ID_BYTES - 1] = 0;
    // SAFETY: NUL-terminated within the buffer (forced above).
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    (!id.is_empty()).then_some(id)
}

/// A clock attribute (reported in kHz) in MHz.
fn clock_mhz(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Option<u32> {
    const KHZ_PER_MHZ: u32 = 1000;
    attribute_opt(dev, attr).map(|khz| khz / KHZ_PER_MHZ)
}

fn query_info(ordinal: usize, dev: sys::CUdevice, driver_version: i32) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    const NAME_BYTES: usize = 256;
    let mut name = [0 as c_char; NAME_BYTES];
    // SAFETY: the buffer holds NAME_BYTES chars; the driver writes a NUL-terminated string into it.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), NAME_BYTES as i32, dev)
    })?;
    // SAFETY: NUL-terminated within the buffer (the driver truncates); the last byte is forced to NUL anyway.
    name[NAME_BYTES - 1] = 0;
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total = 0usize;
    // SAFETY: writes one size.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let u32_attr = |a| -> Result<u32> {
        let v = attribute_usize(dev, a)?;
        u32::try_from(v).map_err(|_| {
            cuda_error(
                "cuDeviceGetAttribute",
                sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            )
        })
    };
    Ok(DeviceInfo {
        ordinal,
        name,
        cc: (
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        sm_count: u32_attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        l2_bytes: attribute_usize(dev, A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        max_smem_per_block_optin: attribute_usize(
            dev,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        max_smem_per_sm: attribute_usize(
            dev,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )?,
        max_threads_per_block: u32_attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        total_mem_bytes: total,
        driver_version: driver::version_string(driver_version),
        driver_version_code: driver_version,
        sm_clock_mhz: clock_mhz(dev, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
        pci_bus_id: pci_bus_id(dev),
        mem_clock_mhz: clock_mhz(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
        mem_bus_width_bits: attribute_opt(dev, A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
        memory_pools: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).unwrap_or(0)
            != 0,
        cluster_launch: attribute(dev, A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH).unwrap_or(0) != 0,
    })
}
