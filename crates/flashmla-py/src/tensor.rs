//! Tensor descriptors handed over by the Python layer, and their conversion to the library's tensor types.
//!
//! Python describes each torch tensor as a tuple `(data_ptr, dtype, shape, strides, device)`:
//! `data_ptr` is `tensor.data_ptr()` (the address of element `[0, 0, ...]`, storage offset included), `dtype` one
//! of `bf16`, `f16`, `f32`, `i32`, `u8`, `f8e4m3` (any other name, e.g. torch's `int64`, describes a dtype
//! flashmla does not compute on: validation then names it and lists what the argument accepts), `shape` and
//! `strides` in elements, `device` the CUDA ordinal or `-1` for the CPU.
//! The Python caller keeps every tensor alive for the duration of the call (the descriptors are built from
//! arguments it holds), which is what makes reading and writing through `data_ptr` sound.
//!
//! * CPU inputs are copied into a [`HostTensor`] (the storage span only, any strides kept); CPU outputs are
//!   allocated by torch and filled by [`Desc::write_host`].
//! * CUDA tensors become [`DeviceView`]s: no copy, the kernels read and write torch's memory.

use flashmla::alloc::try_filled;
use flashmla::{
    DType, DeviceView, Error, HostData, HostTensor, Layout, Location, Result, TensorMeta,
};
use half::{bf16, f16};
use pyo3::FromPyObject;

/// The tuple Python sends for one tensor: `(data_ptr, dtype, shape, strides, device)`.
#[derive(Debug, Clone, FromPyObject)]
pub struct RawDesc(pub u64, pub String, pub Vec<usize>, pub Vec<usize>, pub i64);

/// The dtype of a name the Python layer uses (`torch.bfloat16` -> `"bf16"`, ...), or `None` for any other name.
fn known_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "bf16" => DType::Bf16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "f8e4m3" => DType::F8E4M3,
        _ => return None,
    })
}

/// A dtype name that must be one of `allowed` (an option such as `d_kv`'s dtype); anything else is refused with
/// a `TypeError` naming the argument and listing `allowed`.
pub fn parse_dtype(arg: &str, name: &str, allowed: &[DType]) -> Result<DType> {
    match known_dtype(name) {
        Some(d) if allowed.contains(&d) => Ok(d),
        _ => {
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            Err(Error::invalid(
                format!("{arg}.dtype"),
                format!("one of [{}]", names.join(", ")),
                name,
            ))
        }
    }
}

/// One described tensor, checked: one stride per dimension, a known place. Its dtype may be one flashmla does not
/// know ([`TensorMeta::foreign_dtype`]): validation reports it, and its memory is never read or written.
#[derive(Debug, Clone)]
pub struct Desc {
    arg: &'static str,
    ptr: u64,
    /// The dtype, or a placeholder when `foreign` is set.
    dtype: DType,
    /// The name Python gave a dtype flashmla does not know.
    foreign: Option<String>,
    layout: Layout,
    location: Location,
}

impl TensorMeta for Desc {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn location(&self) -> Location {
        self.location
    }
    fn foreign_dtype(&self) -> Option<&str> {
        self.foreign.as_deref()
    }
}

impl Desc {
    /// Checks a raw descriptor of argument `arg`.
    pub fn new(arg: &'static str, raw: &RawDesc) -> Result<Desc> {
        let RawDesc(ptr, dtype_name, shape, strides, device) = raw;
        let (dtype, foreign) = match known_dtype(dtype_name) {
            Some(d) => (d, None),
            // A placeholder: every validation checks the dtype through `expect_dtype`, which sees `foreign`.
            None => (DType::U8, Some(dtype_name.clone())),
        };
        let layout = Layout::strided(shape, strides).map_err(|_| {
            Error::invalid(
                format!("{arg}.stride"),
                format!("{} strides", shape.len()),
                strides.len(),
            )
        })?;
        let location = match usize::try_from(*device) {
            Ok(ordinal) => Location::Cuda(ordinal),
            Err(_) => Location::Host,
        };
        Ok(Desc {
            arg,
            ptr: *ptr,
            dtype,
            foreign,
            layout,
            location,
        })
    }

    /// An optional descriptor.
    pub fn opt(arg: &'static str, raw: &Option<RawDesc>) -> Result<Option<Desc>> {
        raw.as_ref().map(|r| Desc::new(arg, r)).transpose()
    }

    /// Elements the storage must hold behind `ptr` (the layout's span), refusing a foreign dtype (its element
    /// size is unknown), a null pointer for a non-empty view and a span whose byte size overflows.
    fn span_bytes(&self) -> Result<usize> {
        if let Some(name) = &self.foreign {
            return Err(Error::invalid(
                format!("{}.dtype", self.arg),
                "a dtype flashmla computes on",
                name,
            ));
        }
        let span = self.layout.span().ok_or_else(|| {
            Error::invalid(
                format!("{}.stride", self.arg),
                "offsets that fit in usize",
                "overflow",
            )
        })?;
        let bytes = span.checked_mul(self.dtype.size_bytes()).ok_or_else(|| {
            Error::invalid(
                format!("{}.stride", self.arg),
                "a byte size that fits in usize",
                "overflow",
            )
        })?;
        if bytes > 0 && self.ptr == 0 {
            return Err(Error::invalid(
                format!("{}.data_ptr", self.arg),
                "a non-null address for a non-empty tensor",
                0,
            ));
        }
        Ok(bytes)
    }

    /// Refuses a tensor that is not on the host (its memory must not be read from here).
    fn expect_host(&self) -> Result<()> {
        flashmla::validate::expect_location(self.arg, self, Location::Host)
    }

    /// Copies the tensor's storage span into a [`HostTensor`] with the same shape and strides. An f8e4m3 tensor
    /// becomes a u8 one (the host backend reads FP8 caches as bytes).
    pub fn to_host(&self) -> Result<HostTensor> {
        self.expect_host()?;
        let bytes = self.span_bytes()?;
        let span = bytes / self.dtype.size_bytes();
        let what = format!("a host copy of `{}`", self.arg);
        let data = match self.dtype {
            DType::Bf16 => HostData::Bf16(self.read_span(try_filled(&what, span, bf16::ZERO)?)),
            DType::F16 => HostData::F16(self.read_span(try_filled(&what, span, f16::ZERO)?)),
            DType::F32 => HostData::F32(self.read_span(try_filled(&what, span, 0f32)?)),
            DType::I32 => HostData::I32(self.read_span(try_filled(&what, span, 0i32)?)),
            DType::U8 | DType::F8E4M3 => {
                HostData::U8(self.read_span(try_filled(&what, span, 0u8)?))
            }
        };
        HostTensor::with_layout(data, self.layout.clone())
    }

    /// Fills `dst` (exactly the span, of the tensor's element size) from the tensor's memory.
    fn read_span<T: Copy>(&self, mut dst: Vec<T>) -> Vec<T> {
        let bytes = std::mem::size_of_val(dst.as_slice());
        if bytes > 0 {
            // SAFETY: the Python caller keeps the tensor alive during the call and torch guarantees its storage
            // covers the layout's span from `data_ptr` (`span_bytes` checked the pointer is non-null). The copy is
            // bytewise, so the source needs no alignment; `dst` holds exactly `bytes` bytes of plain-old-data.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr as usize as *const u8,
                    dst.as_mut_ptr().cast::<u8>(),
                    bytes,
                );
            }
        }
        dst
    }

    /// Writes a host result into this (torch-allocated, host) output. `value` must have exactly this tensor's
    /// shape and strides and a compatible dtype (u8 results fill u8 or f8e4m3 outputs); the whole span is copied,
    /// so bytes between rows (a padded cache's block gaps) take `value`'s bytes there.
    pub fn write_host(&self, value: &HostTensor) -> Result<()> {
        self.expect_host()?;
        let compatible = value.dtype() == self.dtype
            || (value.dtype() == DType::U8 && self.dtype == DType::F8E4M3);
        if !compatible {
            return Err(Error::invalid(
                format!("{}.dtype", self.arg),
                value.dtype(),
                self.dtype,
            ));
        }
        if value.layout() != &self.layout {
            return Err(Error::invalid(
                self.arg,
                format!("shape {:?} strides {:?}", value.shape(), value.strides()),
                format!(
                    "shape {:?} strides {:?}",
                    self.layout.shape(),
                    self.layout.strides()
                ),
            ));
        }
        let bytes = self.span_bytes()?;
        let src = host_bytes(value.data());
        if src.len() < bytes {
            return Err(Error::invalid(
                self.arg,
                format!("at least {bytes} bytes of result"),
                src.len(),
            ));
        }
        if bytes > 0 {
            // SAFETY: the output tensor is alive for the call (held by the Python caller), on the host, and its
            // storage covers `bytes` bytes from `data_ptr` (same layout as `value`, whose storage holds at least
            // that many). Torch allocated it for this call, so it does not overlap the source vector.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr as usize as *mut u8, bytes);
            }
        }
        Ok(())
    }

    /// A view of the tensor's device memory (no copy). Refuses a host tensor.
    pub fn to_device(&self) -> Result<DeviceView> {
        let Location::Cuda(device) = self.location else {
            return Err(Error::invalid(
                format!("{}.device", self.arg),
                "a CUDA tensor",
                self.location,
            ));
        };
        self.span_bytes()?;
        // SAFETY: torch allocated the tensor on `device` with storage covering the layout's span, and the Python
        // caller keeps it alive until the launch is queued; torch's caching allocator does not reuse the memory
        // before work queued on the current stream (where we launch) has been ordered after the free.
        Ok(unsafe { DeviceView::from_raw(self.ptr, self.dtype, self.layout.clone(), device) })
    }
}

/// The storage bytes of host data (all element types are plain old data).
fn host_bytes(data: &HostData) -> &[u8] {
    fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
        // SAFETY: `T` is one of bf16, f16, f32, i32, u8: no padding, every byte initialised; u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    match data {
        HostData::Bf16(v) => as_bytes(v),
        HostData::F16(v) => as_bytes(v),
        HostData::F32(v) => as_bytes(v),
        HostData::I32(v) => as_bytes(v),
        HostData::U8(v) => as_bytes(v),
    }
}

/// Where a call runs: the location of its first tensor argument (the library checks that every other tensor
/// lives there too).
pub fn placement(first: &Desc) -> Location {
    first.location()
}
