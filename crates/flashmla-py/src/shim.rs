//! Output allocation through torch's C shim: the stable C ABI that AOTInductor's compiled code uses
//! (`aoti_torch_empty_strided` in `libtorch_cpu`, and `torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs`,
//! which turns the handles into Python tensors).
//!
//! Allocating an output through the Python API (`like.new_empty(shape, dtype=...)`) costs a Python method call
//! with argument parsing and the dispatcher's Python binding per tensor, about 3-5 us on the hosts measured
//! (`bench/host_breakdown.py`); a decode allocates two outputs, a sparse forward three. Through the shim each
//! tensor is made by `at::empty_strided` in C++ (the same caching allocator, current stream and CUDA-graph pool as
//! `new_empty`, and the same thread-local inference and grad modes), and one Python call wraps all of a call's
//! outputs. The extension still links nothing of torch: the library torch has already loaded is opened with
//! `RTLD_NOLOAD` and the symbols are looked up once per process. Where any of it is missing (another torch) or
//! `FLASHMLA_TORCH_SHIM=0` is set, [`Shim::get`] gives `None` and the caller allocates through the Python API.

use flashmla::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyModule};
use std::ffi::c_void;

/// The environment variable that turns the shim off (`0`), for A/B timing and as an escape hatch.
pub const SHIM_ENV: &str = "FLASHMLA_TORCH_SHIM";

type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut *mut c_void) -> i32;
type GetDataPtr = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> i32;
type DeleteTensor = unsafe extern "C" fn(*mut c_void) -> i32;
type Code = unsafe extern "C" fn() -> i32;
type GetI32 = unsafe extern "C" fn(*mut c_void, *mut i32) -> i32;
type GetI64 = unsafe extern "C" fn(*mut c_void, *mut i64) -> i32;
type GetI64s = unsafe extern "C" fn(*mut c_void, *mut *const i64) -> i32;

/// What [`Shim::describe`] reads of one tensor.
pub struct Raw {
    /// `Some(ordinal)` on CUDA, `None` on the host; tensors elsewhere are not described here.
    pub cuda: Option<usize>,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    /// `None`: a dtype flashmla does not compute on.
    pub dtype: Option<DType>,
    /// Data address (storage offset included), 0 when the tensor has no elements.
    pub ptr: u64,
}

/// A new tensor and its data address (0 when it has no elements).
pub type Made<'py> = (Bound<'py, PyAny>, u64);

/// The shim's functions and codes this module uses.
pub struct Shim {
    /// Keeps `libtorch_cpu` referenced (it is torch's, loaded before us).
    _lib: libloading::Library,
    empty_strided: EmptyStrided,
    get_data_ptr: GetDataPtr,
    delete: DeleteTensor,
    get_dim: GetI64,
    get_sizes: GetI64s,
    get_strides: GetI64s,
    get_dtype: GetI32,
    get_device_type: GetI32,
    get_device_index: GetI32,
    /// The shim's dtype code of each dtype flashmla reads or allocates.
    dtypes: Vec<(DType, i32)>,
    device_cpu: i32,
    device_cuda: i32,
    /// `torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs`.
    steal: Py<PyAny>,
    /// `torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors`.
    handles_of: Py<PyAny>,
}

/// A tensor handle (`at::Tensor*`) owned until it is stolen or deleted.
struct Handle<'a> {
    shim: &'a Shim,
    raw: *mut c_void,
}

impl Drop for Handle<'_> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: a handle the shim made and nobody took: deleted once.
            unsafe { (self.shim.delete)(self.raw) };
        }
    }
}

impl Shim {
    /// The shim of the torch this process imported, or `None` where it is unavailable or turned off.
    pub fn get(py: Python<'_>) -> Option<&'static Shim> {
        static SHIM: PyOnceLock<Option<Shim>> = PyOnceLock::new();
        SHIM.get_or_init(py, || {
            if std::env::var(SHIM_ENV).as_deref() == Ok("0") {
                return None;
            }
            Shim::load(py).ok()
        })
        .as_ref()
    }

    #[cfg(not(unix))]
    fn load(_py: Python<'_>) -> Result<Shim, Box<dyn std::error::Error>> {
        Err("torch's C shim is looked up on unix hosts only".into())
    }

    #[cfg(unix)]
    fn load(py: Python<'_>) -> Result<Shim, Box<dyn std::error::Error>> {
        let torch = py.import("torch")?;
        let file: String = torch.getattr("__file__")?.extract()?;
        let dir = std::path::Path::new(&file)
            .parent()
            .ok_or("torch.__file__ has no directory")?;
        let path = dir.join("lib").join("libtorch_cpu.so");
        // SAFETY: RTLD_NOLOAD only references the library torch has loaded (no initialisers run); the symbols are
        // torch's C shim, whose signatures are part of its stable ABI and match the types above.
        unsafe {
            let lib: libloading::Library = libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libc::RTLD_NOLOAD,
            )?
            .into();
            let code =
                |name: &[u8]| -> Result<i32, libloading::Error> { Ok(lib.get::<Code>(name)?()) };
            let mut dtypes = Vec::new();
            for (dtype, name) in [
                (DType::Bf16, &b"aoti_torch_dtype_bfloat16"[..]),
                (DType::F16, b"aoti_torch_dtype_float16"),
                (DType::F32, b"aoti_torch_dtype_float32"),
                (DType::I32, b"aoti_torch_dtype_int32"),
                (DType::U8, b"aoti_torch_dtype_uint8"),
                (DType::F8E4M3, b"aoti_torch_dtype_float8_e4m3fn"),
            ] {
                dtypes.push((dtype, code(name)?));
            }
            let aoti = PyModule::import(py, "torch._C._aoti")?;
            let steal = aoti
                .getattr("alloc_tensors_by_stealing_from_void_ptrs")?
                .unbind();
            let handles_of = aoti
                .getattr("unsafe_alloc_void_ptrs_from_tensors")?
                .unbind();
            Ok(Shim {
                empty_strided: *lib.get::<EmptyStrided>(b"aoti_torch_empty_strided")?,
                get_data_ptr: *lib.get::<GetDataPtr>(b"aoti_torch_get_data_ptr")?,
                delete: *lib.get::<DeleteTensor>(b"aoti_torch_delete_tensor_object")?,
                get_dim: *lib.get::<GetI64>(b"aoti_torch_get_dim")?,
                get_sizes: *lib.get::<GetI64s>(b"aoti_torch_get_sizes")?,
                get_strides: *lib.get::<GetI64s>(b"aoti_torch_get_strides")?,
                get_dtype: *lib.get::<GetI32>(b"aoti_torch_get_dtype")?,
                get_device_type: *lib.get::<GetI32>(b"aoti_torch_get_device_type")?,
                get_device_index: *lib.get::<GetI32>(b"aoti_torch_get_device_index")?,
                device_cpu: code(b"aoti_torch_device_type_cpu")?,
                device_cuda: code(b"aoti_torch_device_type_cuda")?,
                dtypes,
                steal,
                handles_of,
                _lib: lib,
            })
        }
    }

    /// Whether the shim knows `dtype`.
    pub fn allocates(&self, dtype: DType) -> bool {
        self.dtypes.iter().any(|&(d, _)| d == dtype)
    }

    /// Reads the metadata and data address of each of `tensors` with one Python call (a handle per tensor, read
    /// in C). `Ok(None)` where a value is not a tensor, a tensor is neither on the host nor on CUDA, or the shim
    /// refuses a query: the caller then reads them through the Python API, which reports what is wrong.
    pub fn describe(
        &self,
        py: Python<'_>,
        tensors: &[&Bound<'_, PyAny>],
    ) -> PyResult<Option<Vec<Raw>>> {
        let list = PyList::new(py, tensors)?;
        let Ok(capsules) = self.handles_of.bind(py).call1((list,)) else {
            return Ok(None);
        };
        let capsules: Vec<Bound<'_, PyAny>> = capsules.extract()?;
        // Own every handle first, so that each is deleted whatever happens below.
        let mut handles = Vec::with_capacity(capsules.len());
        for c in &capsules {
            // SAFETY: the capsules the call returned hold new tensor handles (pybind11 capsules without a name).
            let raw = unsafe { ffi::PyCapsule_GetPointer(c.as_ptr(), std::ptr::null()) };
            if raw.is_null() {
                // SAFETY: PyCapsule_GetPointer set an exception; it is not ours to raise.
                unsafe { ffi::PyErr_Clear() };
            }
            handles.push(Handle { shim: self, raw });
        }
        if handles.len() != tensors.len() || handles.iter().any(|h| h.raw.is_null()) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(handles.len());
        for h in &handles {
            match self.read_one(h.raw) {
                Some(r) => out.push(r),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// One handle's description (`None` where the shim refuses a query or the tensor is neither on the host nor
    /// on CUDA, or has a negative stride).
    fn read_one(&self, h: *mut c_void) -> Option<Raw> {
        let (mut device_type, mut index, mut dtype, mut dim) = (0i32, 0i32, 0i32, 0i64);
        let (mut sizes, mut strides): (*const i64, *const i64) =
            (std::ptr::null(), std::ptr::null());
        // SAFETY: `h` is a live handle; each call writes one value (the sizes and strides arrays belong to the
        // tensor, which outlives the reads below, and hold `dim` values).
        unsafe {
            let ok = (self.get_device_type)(h, &mut device_type) == 0
                && (self.get_device_index)(h, &mut index) == 0
                && (self.get_dtype)(h, &mut dtype) == 0
                && (self.get_dim)(h, &mut dim) == 0
                && (self.get_sizes)(h, &mut sizes) == 0
                && (self.get_strides)(h, &mut strides) == 0;
            if !ok || dim < 0 || (dim > 0 && (sizes.is_null() || strides.is_null())) {
                return None;
            }
            let cuda = if device_type == self.device_cuda {
                Some(usize::try_from(index).ok()?)
            } else if device_type == self.device_cpu {
                None
            } else {
                return None;
            };
            let dim = dim as usize;
            let to_usize = |p: *const i64| -> Option<Vec<usize>> {
                if dim == 0 {
                    return Some(Vec::new());
                }
                std::slice::from_raw_parts(p, dim)
                    .iter()
                    .map(|&v| usize::try_from(v).ok())
                    .collect()
            };
            let shape = to_usize(sizes)?;
            let strides = to_usize(strides)?;
            let numel = shape.iter().try_fold(1usize, |n, &s| n.checked_mul(s));
            let ptr = match numel {
                Some(n) if n > 0 => {
                    let mut data: *mut c_void = std::ptr::null_mut();
                    if (self.get_data_ptr)(h, &mut data) != 0 {
                        return None;
                    }
                    data as u64
                }
                _ => 0,
            };
            Some(Raw {
                cuda,
                shape,
                strides,
                dtype: self
                    .dtypes
                    .iter()
                    .find(|&&(_, c)| c == dtype)
                    .map(|&(d, _)| d),
                ptr,
            })
        }
    }

    /// New uninitialised contiguous tensors, one per `(shape, dtype)`, on CUDA device `device` (`None`: the
    /// host), with their data addresses. `Ok(None)` where the shim refused one (e.g. out of memory): the caller
    /// then allocates through the Python API, which raises torch's own exception.
    pub fn empty<'py>(
        &self,
        py: Python<'py>,
        specs: &[(&[usize], DType)],
        device: Option<usize>,
    ) -> PyResult<Option<Vec<Made<'py>>>> {
        let (device_type, index) = match device {
            Some(d) => (self.device_cuda, i32::try_from(d).unwrap_or(i32::MAX)),
            None => (self.device_cpu, 0),
        };
        let mut handles = Vec::with_capacity(specs.len());
        let mut ptrs = Vec::with_capacity(specs.len());
        for &(shape, dtype) in specs {
            let Some(&(_, code)) = self.dtypes.iter().find(|(d, _)| *d == dtype) else {
                return Ok(None);
            };
            let sizes: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
            let mut strides = vec![1i64; sizes.len()];
            for i in (0..sizes.len().saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * sizes[i + 1].max(1);
            }
            let mut raw: *mut c_void = std::ptr::null_mut();
            // SAFETY: sizes and strides hold `ndim` values each and outlive the call; `raw` receives a new handle.
            let rc = unsafe {
                (self.empty_strided)(
                    sizes.len() as i64,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    code,
                    device_type,
                    index,
                    &mut raw,
                )
            };
            if rc != 0 || raw.is_null() {
                return Ok(None);
            }
            let handle = Handle { shim: self, raw };
            let mut data: *mut c_void = std::ptr::null_mut();
            // SAFETY: a live handle; writes one pointer.
            if unsafe { (self.get_data_ptr)(handle.raw, &mut data) } != 0 {
                return Ok(None);
            }
            let numel: usize = shape.iter().product();
            ptrs.push(if numel > 0 { data as u64 } else { 0 });
            handles.push(handle);
        }
        let mut capsules = Vec::with_capacity(handles.len());
        for h in &handles {
            // SAFETY: a capsule of a non-null pointer without a name or destructor (the handle stays owned by
            // `handles` until the steal below takes it).
            let cap = unsafe {
                Bound::from_owned_ptr_or_err(py, ffi::PyCapsule_New(h.raw, std::ptr::null(), None))?
            };
            capsules.push(cap);
        }
        let list = PyList::new(py, capsules)?;
        // The call takes (and deletes) every handle once it has converted its argument, a list of capsules, which
        // cannot fail; so the handles are no longer ours whatever it returns (an error before the conversion
        // would leak them rather than free them twice).
        let result = self.steal.bind(py).call1((list,));
        handles.into_iter().for_each(std::mem::forget);
        let tensors = result?;
        let tensors: Vec<Bound<'py, PyAny>> = tensors.extract()?;
        Ok(Some(tensors.into_iter().zip(ptrs).collect()))
    }
}
