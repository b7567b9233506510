//! Torch tensors as the library sees them: their metadata read through the tensor protocol, and output allocation.
//!
//! Every entry point takes torch tensors as they are and reads, for each, what the library needs:
//! `data_ptr()` (the address of element `[0, 0, ...]`, storage offset included), `dtype` (one of bfloat16,
//! float16, float32, int32, uint8, float8_e4m3fn; any other, e.g. int64, describes a dtype flashmla does not
//! compute on: validation then names it and lists what the argument accepts), `shape` and `stride()` in elements,
//! and the device (`get_device()` of a CUDA tensor, or the host). The Python caller keeps every tensor alive for
//! the duration of the call (they are its arguments, or outputs this module allocated and returns), which is
//! what makes reading and writing through `data_ptr` sound. A call that reads data reads all its tensors at once
//! through torch's C shim ([`descs`], [`crate::shim`]); metadata-only checks and anything the shim does not
//! describe go through the Python attributes ([`desc`]).
//!
//! * CPU inputs are copied into a [`HostTensor`] (the storage span only, any strides kept); CPU outputs are
//!   allocated by torch and filled by [`Desc::write_host`].
//! * CUDA tensors become [`DeviceView`]s: no copy, the kernels read and write torch's memory.
//! * Outputs and workspaces are allocated by torch ([`new_outputs`]: `at::empty_strided` through the C shim, all of
//!   a call's outputs wrapped in one Python call; else `like.new_empty(shape, dtype=...)` each), so its caching
//!   allocator serves them in stream order and a CUDA graph capture takes them from the graph's pool.

use flashmla::alloc::try_filled;
use flashmla::{
    DType, DeviceView, Error, HostData, HostTensor, Layout, Location, Result, TensorMeta,
};
use half::{bf16, f16};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::shim::Shim;

/// What this module takes from torch, looked up once per process.
struct Torch {
    /// `torch.Tensor`.
    tensor: Py<PyType>,
    /// Each dtype flashmla computes on, its torch object and `{"dtype": object}` for `new_empty`.
    dtypes: Vec<(DType, Py<PyAny>, Py<PyDict>)>,
    /// `torch._C._cuda_getCurrentRawStream` (what torch's own generated code calls), where this torch has it.
    raw_stream: Option<Py<PyAny>>,
    /// `torch.cuda.current_stream`, the public fallback.
    current_stream: Py<PyAny>,
}

fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let mut dtypes = Vec::new();
        for (dtype, name) in [
            (DType::Bf16, "bfloat16"),
            (DType::F16, "float16"),
            (DType::F32, "float32"),
            (DType::I32, "int32"),
            (DType::U8, "uint8"),
            (DType::F8E4M3, "float8_e4m3fn"),
        ] {
            // float8_e4m3fn is missing from old torch builds: such a torch simply never passes one.
            if let Ok(obj) = torch.getattr(name) {
                let kwargs = PyDict::new(py);
                kwargs.set_item("dtype", &obj)?;
                dtypes.push((dtype, obj.unbind(), kwargs.unbind()));
            }
        }
        let raw_stream = torch
            .getattr("_C")
            .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
            .ok()
            .map(Bound::unbind);
        Ok::<_, PyErr>(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            dtypes,
            raw_stream,
            current_stream: torch.getattr("cuda")?.getattr("current_stream")?.unbind(),
        })
    })
}

/// The raw `CUstream` of torch's current stream on CUDA device `device`.
pub fn current_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    let t = torch(py)?;
    match &t.raw_stream {
        Some(f) => f.bind(py).call1((device,))?.extract(),
        None => t
            .current_stream
            .bind(py)
            .call1((device,))?
            .getattr(intern!(py, "cuda_stream"))?
            .extract(),
    }
}

/// How a tensor is read: the data of a real one, or only the metadata of a fake one (a fake or meta tensor under
/// `torch.compile` has no memory: its address is never read, and a `meta` device counts as the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// A real tensor: its memory is read or written by the call.
    Data,
    /// Metadata only, for validation.
    Meta,
}

/// One described tensor, checked: one stride per dimension, a known place. Its dtype may be one flashmla does not
/// know ([`TensorMeta::foreign_dtype`]): validation reports it, and its memory is never read or written.
#[derive(Debug, Clone)]
pub struct Desc {
    arg: &'static str,
    ptr: u64,
    /// The dtype, or a placeholder when `foreign` is set.
    dtype: DType,
    /// The name torch gives a dtype flashmla does not know.
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

/// `TypeError` naming `arg` when `obj` is not a torch tensor (a plain `torch.Tensor` is recognised by its type
/// alone; subclasses through `isinstance`).
fn expect_tensor(obj: &Bound<'_, PyAny>, arg: &str, torch: &Torch) -> PyResult<()> {
    let py = obj.py();
    let tensor = torch.tensor.bind(py);
    if obj.get_type().is(tensor) || obj.is_instance(tensor)? {
        return Ok(());
    }
    let got = obj.get_type().name()?;
    Err(PyTypeError::new_err(format!(
        "invalid argument `{arg}`: expected a torch.Tensor, got {got}"
    )))
}

/// The entries of a tuple of sizes (`torch.Size`, the tuple `stride()` returns).
fn sizes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    match obj.cast::<PyTuple>() {
        Ok(t) => t.iter().map(|v| v.extract::<usize>()).collect(),
        Err(_) => obj.extract(),
    }
}

/// Reads the description of tensor argument `arg` (`TypeError` when it is not a tensor).
pub fn desc(obj: &Bound<'_, PyAny>, arg: &'static str, read: Read) -> PyResult<Desc> {
    let py = obj.py();
    let torch = torch(py)?;
    expect_tensor(obj, arg, torch)?;
    let location = if obj.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
        Location::Cuda(obj.call_method0(intern!(py, "get_device"))?.extract()?)
    } else {
        let device = obj.getattr(intern!(py, "device"))?;
        let kind = device.getattr(intern!(py, "type"))?;
        match (kind.extract::<String>()?.as_str(), read) {
            ("cpu", _) | ("meta", Read::Meta) => Location::Host,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "invalid argument `{arg}.device`: expected a cpu or cuda tensor, got {}",
                    device.str()?
                )))
            }
        }
    };
    let shape = sizes(&obj.getattr(intern!(py, "shape"))?)?;
    let strides = sizes(&obj.call_method0(intern!(py, "stride"))?)?;
    let dtype_obj = obj.getattr(intern!(py, "dtype"))?;
    let known = torch
        .dtypes
        .iter()
        .find(|(_, o, _)| o.bind(py).is(&dtype_obj))
        .map(|(d, _, _)| *d);
    let (dtype, foreign) = match known {
        Some(d) => (d, None),
        // A placeholder: every validation checks the dtype through `expect_dtype`, which sees `foreign`.
        None => {
            let name = dtype_obj.str()?.to_string();
            let name = name.strip_prefix("torch.").unwrap_or(&name).to_string();
            (DType::U8, Some(name))
        }
    };
    let numel = shape.iter().try_fold(1usize, |n, &s| n.checked_mul(s));
    let ptr = match (read, numel) {
        (Read::Data, Some(n)) if n > 0 => obj.call_method0(intern!(py, "data_ptr"))?.extract()?,
        _ => 0,
    };
    let layout = Layout::strided(&shape, &strides).map_err(|_| {
        PyValueError::new_err(format!(
            "invalid argument `{arg}.stride`: expected {} strides, got {}",
            shape.len(),
            strides.len()
        ))
    })?;
    Ok(Desc {
        arg,
        ptr,
        dtype,
        foreign,
        layout,
        location,
    })
}

/// [`desc`] of several arguments at once (`None` stays `None`). The tensors of a call that reads data (not a metadata-only check)
/// are read through torch's C shim with one Python call where this torch has it ([`crate::shim`]); else, and for
/// anything the shim does not describe (a value that is not a tensor, a dtype flashmla does not know, a device
/// other than the host or CUDA), each is read by [`desc`], which names what is wrong.
pub fn descs<const N: usize>(
    items: [(Option<&Bound<'_, PyAny>>, &'static str); N],
    read: Read,
) -> PyResult<[Option<Desc>; N]> {
    let present: Vec<&Bound<'_, PyAny>> = items.iter().filter_map(|&(t, _)| t).collect();
    let raws = match (read, present.first()) {
        (Read::Data, Some(first)) => match Shim::get(first.py()) {
            Some(shim) => shim.describe(first.py(), &present)?,
            None => None,
        },
        _ => None,
    };
    let mut raws = raws.map(Vec::into_iter);
    let mut out: [Option<Desc>; N] = std::array::from_fn(|_| None);
    for (slot, (obj, arg)) in out.iter_mut().zip(items) {
        let Some(obj) = obj else { continue };
        let raw = raws.as_mut().and_then(Iterator::next);
        *slot = Some(match raw {
            Some(r) if r.dtype.is_some() => {
                let layout = Layout::strided(&r.shape, &r.strides).map_err(|_| {
                    PyValueError::new_err(format!(
                        "invalid argument `{arg}.stride`: expected {} strides, got {}",
                        r.shape.len(),
                        r.strides.len()
                    ))
                })?;
                Desc {
                    arg,
                    ptr: r.ptr,
                    dtype: r.dtype.unwrap_or(DType::U8),
                    foreign: None,
                    layout,
                    location: r.cuda.map_or(Location::Host, Location::Cuda),
                }
            }
            _ => desc(obj, arg, read)?,
        });
    }
    Ok(out)
}

/// New contiguous tensors, one per `(arg, shape, dtype)` of `specs`, uninitialised, on `location` (`like`'s
/// device), and their descriptions as outputs. Made through torch's C shim in one Python call where this torch
/// has it ([`crate::shim`]), else by `like.new_empty(shape, dtype=...)` each.
pub fn new_outputs<'py, const N: usize>(
    like: &Bound<'py, PyAny>,
    specs: [(&'static str, &[usize], DType); N],
    location: Location,
) -> PyResult<[(Bound<'py, PyAny>, Desc); N]> {
    let py = like.py();
    let device = match location {
        Location::Cuda(d) => Some(d),
        Location::Host => None,
    };
    let made = match Shim::get(py) {
        Some(shim) if specs.iter().all(|&(_, _, d)| shim.allocates(d)) => {
            let shapes: Vec<(&[usize], DType)> = specs.iter().map(|&(_, s, d)| (s, d)).collect();
            shim.empty(py, &shapes, device)?
        }
        _ => None,
    };
    let tensors = match made {
        Some(t) => t,
        None => specs
            .iter()
            .map(|&(_, shape, dtype)| python_empty(like, shape, dtype))
            .collect::<PyResult<Vec<_>>>()?,
    };
    let outputs: Vec<(Bound<'py, PyAny>, Desc)> = tensors
        .into_iter()
        .zip(specs)
        .map(|((t, ptr), (arg, shape, dtype))| {
            let desc = Desc {
                arg,
                ptr,
                dtype,
                foreign: None,
                layout: Layout::contiguous(shape),
                location,
            };
            (t, desc)
        })
        .collect();
    outputs
        .try_into()
        .map_err(|_| PyValueError::new_err("internal: output count"))
}

/// [`new_outputs`] of one tensor.
pub fn new_output<'py>(
    like: &Bound<'py, PyAny>,
    arg: &'static str,
    shape: &[usize],
    dtype: DType,
    location: Location,
) -> PyResult<(Bound<'py, PyAny>, Desc)> {
    let [out] = new_outputs(like, [(arg, shape, dtype)], location)?;
    Ok(out)
}

/// `like.new_empty(shape, dtype=dtype)` and its data address (0 when empty).
fn python_empty<'py>(
    like: &Bound<'py, PyAny>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<(Bound<'py, PyAny>, u64)> {
    let py = like.py();
    let kwargs = torch(py)?
        .dtypes
        .iter()
        .find(|(d, _, _)| *d == dtype)
        .map(|(_, _, k)| k.bind(py))
        .ok_or_else(|| PyTypeError::new_err(format!("this torch has no {} dtype", dtype.name())))?;
    let t = like.call_method(
        intern!(py, "new_empty"),
        (PyTuple::new(py, shape)?,),
        Some(kwargs),
    )?;
    let numel: usize = shape.iter().product();
    let ptr = if numel > 0 {
        t.call_method0(intern!(py, "data_ptr"))?.extract()?
    } else {
        0
    };
    Ok((t, ptr))
}

impl Desc {
    /// The address of element `[0, 0, ...]` (0 for an empty tensor or a metadata-only description).
    pub fn ptr(&self) -> u64 {
        self.ptr
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

/// One workspace kept for a `(device, stream)` (decodes, dense prefill forward): the torch tensor, its length in f32 words, its address.
struct Kept {
    tensor: Py<PyAny>,
    words: usize,
    ptr: u64,
}

fn kept() -> &'static std::sync::Mutex<std::collections::HashMap<(usize, u64), Kept>> {
    static KEPT: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<(usize, u64), Kept>>,
    > = std::sync::OnceLock::new();
    KEPT.get_or_init(Default::default)
}

/// An f32 workspace of at least `words` words for work queued on `stream` of CUDA `device`, described as
/// `workspace`.
///
/// Outside CUDA-graph capture it is the one kept for that stream (allocated through torch the first time, and
/// again, larger, when a call needs more): every call on a stream is ordered after the previous one there, so
/// they can share it, and the decode saves an allocation per call. While the stream is being captured the call
/// gets a fresh tensor instead, which torch takes from the graph's private pool, so replays never share memory
/// with eager calls. [`release_workspaces`] drops the kept ones.
pub fn stream_workspace<'py>(
    like: &Bound<'py, PyAny>,
    device: usize,
    stream: u64,
    capturing: bool,
    words: usize,
) -> PyResult<(Bound<'py, PyAny>, Desc)> {
    let py = like.py();
    let loc = Location::Cuda(device);
    if capturing {
        return new_output(like, "workspace", &[words], DType::F32, loc);
    }
    let found = {
        let map = kept().lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(device, stream))
            .filter(|k| k.words >= words)
            .map(|k| (k.tensor.clone_ref(py), k.words, k.ptr))
    };
    if let Some((tensor, words, ptr)) = found {
        let desc = Desc {
            arg: "workspace",
            ptr,
            dtype: DType::F32,
            foreign: None,
            layout: Layout::contiguous(&[words]),
            location: loc,
        };
        return Ok((tensor.into_bound(py), desc));
    }
    let (tensor, desc) = new_output(like, "workspace", &[words], DType::F32, loc)?;
    // The tensor this replaces is freed once the lock is released: torch reuses its memory only for later work on
    // the same stream, behind the calls already queued there.
    let replaced = kept().lock().unwrap_or_else(|p| p.into_inner()).insert(
        (device, stream),
        Kept {
            tensor: tensor.clone().unbind(),
            words,
            ptr: desc.ptr,
        },
    );
    drop(replaced);
    Ok((tensor, desc))
}

/// Drops the workspaces kept for every stream (their memory goes back to torch's caching allocator); returns how
/// many bytes they held.
pub fn release_workspaces() -> usize {
    let old = std::mem::take(&mut *kept().lock().unwrap_or_else(|p| p.into_inner()));
    old.values().map(|k| k.words * 4).sum()
}
