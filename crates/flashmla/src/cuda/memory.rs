//! [`DeviceTensor`]: device memory owned by the library, with a dtype and a (possibly strided) layout; and the
//! host <-> device copies, which copy the whole storage span so strides survive the trip.

use super::device::{Gpu, GpuInner};
use super::driver::check;
use crate::error::{Error, Result};
use crate::tensor::{DType, DeviceView, HostData, HostTensor, Layout, Location, TensorMeta};
use cudarc::driver::sys;
use half::{bf16, f16};
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

/// Device memory owned by this library: `bytes()` bytes holding a tensor of `dtype` laid out by `layout`
/// (element `[0, 0, ...]` at `ptr()`). Freed when dropped, in stream order on the owning [`Gpu`]'s stream.
pub struct DeviceTensor {
    gpu: Arc<GpuInner>,
    ptr: u64,
    bytes: usize,
    dtype: DType,
    layout: Layout,
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("device", &self.gpu.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .finish()
    }
}

impl TensorMeta for DeviceTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn location(&self) -> Location {
        Location::Cuda(self.gpu.ordinal())
    }
}

impl DeviceTensor {
    /// A raw view for the ops' GPU paths. The view does not keep the memory alive: use it while `self` lives.
    pub fn view(&self) -> DeviceView {
        // SAFETY: `ptr` is this tensor's allocation on its device and covers `layout.span()` elements; the
        // lifetime and aliasing duties of `DeviceView::from_raw` pass to the user of the view, as documented.
        unsafe {
            DeviceView::from_raw(
                self.ptr,
                self.dtype,
                self.layout.clone(),
                self.gpu.ordinal(),
            )
        }
    }

    /// Device address of element `[0, 0, ...]` (0 for an empty tensor).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes of storage (the layout's span times the element size).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        if self.ptr == 0 || self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` was allocated by the matching call in `Gpu::alloc_layout` and is freed once. The async
        // free is ordered after all work already queued on the stream that may still use the memory.
        unsafe {
            if self.gpu.info().memory_pools {
                sys::cuMemFreeAsync(self.ptr, self.gpu.stream);
            } else {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Bytes of storage behind `layout` (its span times the element size), or an error naming `arg`.
fn storage_bytes(arg: &str, dtype: DType, layout: &Layout) -> Result<usize> {
    layout
        .span()
        .and_then(|span| span.checked_mul(dtype.size_bytes()))
        .ok_or_else(|| {
            Error::invalid(
                arg,
                "a size that fits in usize bytes",
                format!("{:?}", layout.shape()),
            )
        })
}

/// The first `bytes` bytes of a host storage (every element type is plain old data).
fn host_bytes(data: &HostData, bytes: usize) -> &[u8] {
    fn as_bytes<T>(v: &[T], bytes: usize) -> &[u8] {
        debug_assert!(bytes <= std::mem::size_of_val(v));
        // SAFETY: bf16/f16/f32/i32/u8 have no padding and every bit pattern is a valid byte; `bytes` is within
        // the vector (checked by the caller against the layout span, which `HostTensor` guarantees fits).
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), bytes) }
    }
    match data {
        HostData::Bf16(v) => as_bytes(v, bytes),
        HostData::F16(v) => as_bytes(v, bytes),
        HostData::F32(v) => as_bytes(v, bytes),
        HostData::I32(v) => as_bytes(v, bytes),
        HostData::U8(v) => as_bytes(v, bytes),
    }
}

/// Zeroed host storage of `elements` elements of `dtype` (f8 bytes come back as `u8`).
fn host_storage(dtype: DType, elements: usize) -> HostData {
    match dtype {
        DType::Bf16 => HostData::Bf16(vec![bf16::ZERO; elements]),
        DType::F16 => HostData::F16(vec![f16::ZERO; elements]),
        DType::F32 => HostData::F32(vec![0.0; elements]),
        DType::I32 => HostData::I32(vec![0; elements]),
        DType::U8 | DType::F8E4M3 => HostData::U8(vec![0; elements]),
    }
}

fn host_ptr_mut(data: &mut HostData) -> *mut c_void {
    match data {
        HostData::Bf16(v) => v.as_mut_ptr().cast(),
        HostData::F16(v) => v.as_mut_ptr().cast(),
        HostData::F32(v) => v.as_mut_ptr().cast(),
        HostData::I32(v) => v.as_mut_ptr().cast(),
        HostData::U8(v) => v.as_mut_ptr().cast(),
    }
}

impl Gpu {
    /// A contiguous, uninitialised tensor.
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<DeviceTensor> {
        self.alloc_layout(dtype, Layout::contiguous(shape))
    }

    /// A contiguous tensor with every byte set to `byte` (e.g. `0xFF`, which reads as NaN in bf16/f16/f32, to
    /// catch elements a kernel forgot to write).
    pub fn alloc_filled(&self, dtype: DType, shape: &[usize], byte: u8) -> Result<DeviceTensor> {
        let t = self.alloc(dtype, shape)?;
        self.fill_bytes(&t, byte)?;
        Ok(t)
    }

    /// An uninitialised tensor with any layout: storage of `layout.span()` elements.
    pub fn alloc_layout(&self, dtype: DType, layout: Layout) -> Result<DeviceTensor> {
        let bytes = storage_bytes("shape", dtype, &layout)?;
        self.inner.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        if bytes > 0 {
            // SAFETY: writes one device pointer; the size is non-zero.
            unsafe {
                if self.inner.info().memory_pools {
                    check(
                        "cuMemAllocAsync",
                        sys::cuMemAllocAsync(&mut ptr, bytes, self.inner.stream),
                    )?;
                } else {
                    check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, bytes))?;
                }
            }
        }
        Ok(DeviceTensor {
            gpu: self.inner.clone(),
            ptr,
            bytes,
            dtype,
            layout,
        })
    }

    /// Sets every byte of `t`'s storage to `byte`, in order on the stream of the `Gpu` that allocated `t`.
    pub fn fill_bytes(&self, t: &DeviceTensor, byte: u8) -> Result<()> {
        self.check_owner(t)?;
        if t.bytes == 0 {
            return Ok(());
        }
        t.gpu.bind()?;
        // SAFETY: `t` owns `t.bytes` bytes at `t.ptr` on this device; ordered on the stream of its allocator.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(t.ptr, byte, t.bytes, t.gpu.stream)
        })
    }

    /// Copies a host tensor to the device, storage and all: the result has the same shape, strides and dtype,
    /// and the bytes between strided elements are copied too (so padding patterns survive the round trip).
    pub fn upload(&self, t: &HostTensor) -> Result<DeviceTensor> {
        let d = self.alloc_layout(t.dtype(), t.layout().clone())?;
        if d.bytes > 0 {
            let src = host_bytes(t.data(), d.bytes);
            // SAFETY: `d` owns `d.bytes` bytes; `src` holds as many. The copy reads pageable memory, so the driver
            // stages it before returning: `src` may be dropped after the call.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(d.ptr, src.as_ptr().cast(), d.bytes, self.inner.stream)
            })?;
        }
        Ok(d)
    }

    /// Copies a device tensor back, storage and all, with the same layout. An `f8e4m3` tensor comes back as `u8`
    /// (the host storage has no f8 type; the bytes are the same). Runs on the stream of the `Gpu` that allocated
    /// `t` (so it follows the work queued there) and waits for it.
    pub fn download(&self, t: &DeviceTensor) -> Result<HostTensor> {
        self.check_owner(t)?;
        copy_to_host(&t.gpu, &t.view())
    }

    /// Copies the storage behind any view on this device (e.g. a kernel output given as a [`DeviceView`]) on this
    /// handle's stream, and waits for it.
    pub fn download_view(&self, v: &DeviceView) -> Result<HostTensor> {
        if v.device() != self.ordinal() {
            return Err(Error::invalid(
                "view.device",
                format!("cuda:{}", self.ordinal()),
                format!("cuda:{}", v.device()),
            ));
        }
        copy_to_host(&self.inner, v)
    }

    /// Queues zeros into the first `words` 4-byte words at `ptr` on this device's stream (a kernel's counters in a
    /// workspace; capturable into a CUDA graph).
    ///
    /// # Safety
    /// `ptr .. ptr + 4 * words` must be device memory of this device that nothing reads or writes concurrently
    /// with the stream's work, and `ptr` 4-byte aligned.
    pub(crate) unsafe fn zero_words_async(&self, ptr: u64, words: usize) -> Result<()> {
        if words == 0 {
            return Ok(());
        }
        self.inner.bind()?;
        // SAFETY: the caller owns the range (above); ordered on this stream.
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(ptr, 0, words, self.inner.stream)
        })
    }

    /// `t` was allocated by this device.
    fn check_owner(&self, t: &DeviceTensor) -> Result<()> {
        if t.gpu.ordinal() != self.ordinal() {
            return Err(Error::invalid(
                "tensor.device",
                format!("cuda:{}", self.ordinal()),
                format!("cuda:{}", t.gpu.ordinal()),
            ));
        }
        Ok(())
    }
}

/// Copies the storage behind `v` to a new host tensor on `gpu`'s stream and waits for it.
fn copy_to_host(gpu: &GpuInner, v: &DeviceView) -> Result<HostTensor> {
    let span = v
        .layout()
        .span()
        .ok_or_else(|| Error::invalid("view.strides", "offsets that fit in usize", "overflow"))?;
    let bytes = storage_bytes("view.shape", v.dtype(), v.layout())?;
    let mut data = host_storage(v.dtype(), span);
    if bytes > 0 {
        gpu.bind()?;
        // SAFETY: the view's contract (DeviceView::from_raw) says `bytes` bytes at `ptr` are valid device memory;
        // the host buffer holds `span` elements = `bytes` bytes and is only read after the synchronisation.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(host_ptr_mut(&mut data), v.ptr(), bytes, gpu.stream),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(gpu.stream))?;
        }
    }
    HostTensor::with_layout(data, v.layout().clone())
}
