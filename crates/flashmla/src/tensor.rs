//! Tensor descriptions shared by every backend: element type, shape and strides, and where the data lives.
//!
//! * [`HostTensor`] owns host memory (any strides) and is what the CPU backend computes on.
//! * [`DeviceView`] is a raw, caller-owned view of device memory (e.g. a PyTorch tensor's storage).
//!
//! Both implement [`TensorMeta`], so validation is written once for both backends.

use crate::alloc::try_with_capacity;
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::fmt;

/// Element types that appear in flashmla's APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// 32-bit signed integer (indices, lengths).
    I32,
    /// Raw bytes (FP8 KV caches).
    U8,
    /// float8 e4m3fn, one byte (accepted wherever a byte cache is).
    F8E4M3,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::U8 | DType::F8E4M3 => 1,
        }
    }

    /// Lower-case name, as in error messages (`bf16`, `f32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Shape and strides, both counted in elements. Strides are non-negative.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl Layout {
    /// A row-major contiguous layout.
    pub fn contiguous(shape: &[usize]) -> Self {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1usize;
        for d in (0..shape.len()).rev() {
            strides[d] = acc;
            acc = acc.saturating_mul(shape[d].max(1));
        }
        Layout {
            shape: shape.to_vec(),
            strides,
        }
    }

    /// A layout with explicit strides (in elements).
    pub fn strided(shape: &[usize], strides: &[usize]) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(Error::invalid(
                "strides",
                format!("{} strides (one per dimension)", shape.len()),
                strides.len(),
            ));
        }
        Ok(Layout {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (product of the shape; saturating).
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// True when the layout is row-major contiguous (size-1 dimensions may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1usize;
        for d in (0..self.shape.len()).rev() {
            if self.shape[d] != 1 && self.strides[d] != acc {
                return false;
            }
            acc = acc.saturating_mul(self.shape[d]);
        }
        true
    }

    /// One past the largest element offset any index can reach (0 for an empty tensor),
    /// or `None` on overflow. Memory backing the view must hold at least this many elements.
    pub fn span(&self) -> Option<usize> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        let mut last = 0usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            last = last.checked_add((n - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }

    /// Element offset of a multi-index (no bounds check beyond debug assertions).
    #[inline]
    pub fn offset(&self, index: &[usize]) -> usize {
        debug_assert_eq!(index.len(), self.shape.len());
        index.iter().zip(&self.strides).map(|(&i, &s)| i * s).sum()
    }
}

/// Where a tensor's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// Host memory.
    Host,
    /// Memory of the CUDA device with this ordinal.
    Cuda(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("cpu"),
            Location::Cuda(d) => write!(f, "cuda:{d}"),
        }
    }
}

/// What validation needs to know about a tensor, whatever backend holds it.
pub trait TensorMeta {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Shape and strides.
    fn layout(&self) -> &Layout;
    /// Where the data lives.
    fn location(&self) -> Location;
    /// The shape.
    fn shape(&self) -> &[usize] {
        self.layout().shape()
    }
    /// The strides, in elements.
    fn strides(&self) -> &[usize] {
        self.layout().strides()
    }
    /// The name of the tensor's element type when it is none of [`DType`] (a foreign tensor, e.g. a torch int64
    /// tensor described by the Python bindings); `None` for every tensor flashmla can compute on.
    /// [`crate::validate::expect_dtype`] reports this name, and `dtype()` must then not be relied on.
    fn foreign_dtype(&self) -> Option<&str> {
        None
    }
}

/// Typed host storage.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum HostData {
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    I32(Vec<i32>),
    U8(Vec<u8>),
}

impl HostData {
    /// Element type of the storage.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::Bf16(_) => DType::Bf16,
            HostData::F16(_) => DType::F16,
            HostData::F32(_) => DType::F32,
            HostData::I32(_) => DType::I32,
            HostData::U8(_) => DType::U8,
        }
    }

    /// Number of stored elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::Bf16(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::U8(v) => v.len(),
        }
    }

    /// True when no element is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor in host memory with any (non-negative) strides.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    data: HostData,
    layout: Layout,
}

impl TensorMeta for HostTensor {
    fn dtype(&self) -> DType {
        self.data.dtype()
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn location(&self) -> Location {
        Location::Host
    }
}

impl HostTensor {
    /// A contiguous tensor; `data` must hold exactly `shape.product()` elements.
    pub fn new(data: HostData, shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape);
        if data.len() != layout.numel() {
            return Err(Error::invalid(
                "data",
                format!("{} elements for shape {:?}", layout.numel(), shape),
                data.len(),
            ));
        }
        Ok(HostTensor { data, layout })
    }

    /// A strided view over `data`; every reachable offset must be inside `data`.
    pub fn with_layout(data: HostData, layout: Layout) -> Result<Self> {
        let span = layout
            .span()
            .ok_or_else(|| Error::invalid("strides", "offsets that fit in usize", "overflow"))?;
        if span > data.len() {
            return Err(Error::invalid(
                "data",
                format!("at least {span} elements for the given shape and strides"),
                data.len(),
            ));
        }
        Ok(HostTensor { data, layout })
    }

    /// Contiguous bf16 tensor from f32 values (rounded to nearest even).
    pub fn bf16_from_f32(values: &[f32], shape: &[usize]) -> Result<Self> {
        let data = crate::alloc::try_collect(
            "a bf16 tensor",
            values.len(),
            values.iter().map(|&v| bf16::from_f32(v)),
        )?;
        Self::new(HostData::Bf16(data), shape)
    }

    /// Contiguous f32 tensor.
    pub fn from_f32(values: Vec<f32>, shape: &[usize]) -> Result<Self> {
        Self::new(HostData::F32(values), shape)
    }

    /// Contiguous i32 tensor.
    pub fn from_i32(values: Vec<i32>, shape: &[usize]) -> Result<Self> {
        Self::new(HostData::I32(values), shape)
    }

    /// Contiguous byte tensor.
    pub fn from_u8(values: Vec<u8>, shape: &[usize]) -> Result<Self> {
        Self::new(HostData::U8(values), shape)
    }

    /// The storage.
    pub fn data(&self) -> &HostData {
        &self.data
    }

    /// Consumes the tensor, returning its storage.
    pub fn into_data(self) -> HostData {
        self.data
    }

    /// Visits the storage offset of every element in row-major index order.
    fn for_each_offset(&self, f: impl FnMut(usize)) {
        for_each_offset(self.layout.shape(), self.layout.strides(), 0, f);
    }

    /// The values as contiguous f32, in row-major order (bf16/f16/f32 only; exact widening). The copy has the
    /// tensor's logical size, whatever its strides: see [`HostTensor::rows_to_f32_vec`] for a broadcast view.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let mut out = try_with_capacity("a contiguous f32 copy of a tensor", self.layout.numel())?;
        if self.layout.is_contiguous() {
            // Element i at offset i: widen on all cores (the benchmarks copy tensors of hundreds of millions).
            use rayon::prelude::*;
            let n = self.layout.numel();
            out.resize(n, 0.0);
            match &self.data {
                HostData::Bf16(v) => out
                    .par_iter_mut()
                    .zip(&v[..n])
                    .for_each(|(o, x)| *o = x.to_f32()),
                HostData::F16(v) => out
                    .par_iter_mut()
                    .zip(&v[..n])
                    .for_each(|(o, x)| *o = x.to_f32()),
                HostData::F32(v) => out.copy_from_slice(&v[..n]),
                other => {
                    return Err(Error::invalid(
                        "tensor",
                        "a floating-point dtype",
                        other.dtype(),
                    ))
                }
            }
            return Ok(out);
        }
        match &self.data {
            HostData::Bf16(v) => self.for_each_offset(|o| out.push(v[o].to_f32())),
            HostData::F16(v) => self.for_each_offset(|o| out.push(v[o].to_f32())),
            HostData::F32(v) => self.for_each_offset(|o| out.push(v[o])),
            other => {
                return Err(Error::invalid(
                    "tensor",
                    "a floating-point dtype",
                    other.dtype(),
                ))
            }
        }
        Ok(out)
    }

    /// The values of the sub-tensors `self[r]` for each `r` of `rows`, in that order, as contiguous f32
    /// (`rows.len()` times the product of the other dimensions; bf16/f16/f32 only). Reads in place with the
    /// tensor's strides, so only the listed rows are copied: the way to read a few rows of a large or broadcast
    /// (stride-0) tensor. Every row must be below `shape[0]`.
    pub fn rows_to_f32_vec(&self, rows: &[usize]) -> Result<Vec<f32>> {
        let (shape, strides) = (self.layout.shape(), self.layout.strides());
        let (Some(&n), Some(&stride)) = (shape.first(), strides.first()) else {
            return Err(Error::invalid(
                "tensor.shape",
                "at least 1 dimension",
                "a scalar",
            ));
        };
        if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
            return Err(Error::invalid(
                "rows",
                format!("row indices below {n}"),
                bad,
            ));
        }
        let per_row: usize = shape[1..].iter().product();
        let total = rows.len().checked_mul(per_row).ok_or_else(|| {
            Error::invalid("rows", "a selection whose size fits in usize", rows.len())
        })?;
        let mut out = try_with_capacity("a copy of the referenced rows of a tensor", total)?;
        for &r in rows {
            let base = r * stride;
            match &self.data {
                HostData::Bf16(v) => for_each_offset(&shape[1..], &strides[1..], base, |o| {
                    out.push(v[o].to_f32())
                }),
                HostData::F16(v) => for_each_offset(&shape[1..], &strides[1..], base, |o| {
                    out.push(v[o].to_f32())
                }),
                HostData::F32(v) => {
                    for_each_offset(&shape[1..], &strides[1..], base, |o| out.push(v[o]))
                }
                other => {
                    return Err(Error::invalid(
                        "tensor",
                        "a floating-point dtype",
                        other.dtype(),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// The values as contiguous i32, in row-major order (i32 only).
    pub fn to_i32_vec(&self) -> Result<Vec<i32>> {
        match &self.data {
            HostData::I32(v) => {
                let mut out =
                    try_with_capacity("a contiguous i32 copy of a tensor", self.layout.numel())?;
                self.for_each_offset(|o| out.push(v[o]));
                Ok(out)
            }
            other => Err(Error::invalid("tensor", "dtype i32", other.dtype())),
        }
    }

    /// The values as contiguous bytes, in row-major order (u8 only).
    pub fn to_u8_vec(&self) -> Result<Vec<u8>> {
        match &self.data {
            HostData::U8(v) => {
                let mut out =
                    try_with_capacity("a contiguous byte copy of a tensor", self.layout.numel())?;
                self.for_each_offset(|o| out.push(v[o]));
                Ok(out)
            }
            other => Err(Error::invalid("tensor", "dtype u8", other.dtype())),
        }
    }

    /// A copy with every dimension padded by `pad[d]` elements of `fill` in storage and then sliced back,
    /// so the returned tensor has the same values but a non-contiguous layout. Used to test stride handling.
    pub fn to_padded(&self, pad: &[usize]) -> Result<Self> {
        let shape = self.layout.shape().to_vec();
        if pad.len() != shape.len() {
            return Err(Error::invalid(
                "pad",
                format!("{} entries", shape.len()),
                pad.len(),
            ));
        }
        let padded: Vec<usize> = shape.iter().zip(pad).map(|(&n, &p)| n + p).collect();
        let big = Layout::contiguous(&padded);
        let layout = Layout::strided(&shape, big.strides())?;
        let n = big.numel();
        let mut offsets = Vec::with_capacity(self.layout.numel());
        let view = HostTensor {
            data: HostData::U8(Vec::new()),
            layout: layout.clone(),
        };
        view.for_each_offset(|o| offsets.push(o));
        macro_rules! scatter {
            ($v:expr, $variant:ident, $fill:expr) => {{
                let src: Vec<_> = {
                    let mut s = Vec::with_capacity(offsets.len());
                    self.for_each_offset(|o| s.push($v[o]));
                    s
                };
                let mut dst = vec![$fill; n];
                for (o, x) in offsets.iter().zip(src) {
                    dst[*o] = x;
                }
                HostData::$variant(dst)
            }};
        }
        let data = match &self.data {
            HostData::Bf16(v) => scatter!(v, Bf16, bf16::NAN),
            HostData::F16(v) => scatter!(v, F16, f16::NAN),
            HostData::F32(v) => scatter!(v, F32, f32::NAN),
            HostData::I32(v) => scatter!(v, I32, i32::MIN),
            HostData::U8(v) => scatter!(v, U8, 0xFFu8),
        };
        HostTensor::with_layout(data, layout)
    }
}

/// Visits `base` plus the storage offset of every element of a `shape` / `strides` view, in row-major index
/// order (nothing for an empty shape's zero-sized dimension; once for a rank-0 view).
fn for_each_offset(shape: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize)) {
    if shape.contains(&0) {
        return;
    }
    let mut idx = vec![0usize; shape.len()];
    loop {
        f(base + idx.iter().zip(strides).map(|(&i, &s)| i * s).sum::<usize>());
        let mut d = shape.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// A raw view of device memory owned by someone else (a PyTorch tensor, a [`crate::cuda::DeviceTensor`]).
///
/// `ptr` is the device address of element `[0, 0, ...]`; strides are in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceView {
    ptr: u64,
    dtype: DType,
    layout: Layout,
    device: usize,
}

impl TensorMeta for DeviceView {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn location(&self) -> Location {
        Location::Cuda(self.device)
    }
}

impl DeviceView {
    /// Wraps a raw device pointer.
    ///
    /// # Safety
    /// `ptr` must be a valid allocation on CUDA device `device` covering every element the layout can reach
    /// ([`Layout::span`] elements of `dtype` from `ptr`), live and not accessed concurrently by other
    /// work for as long as any kernel launched with this view runs. Views used as outputs must not alias inputs.
    pub unsafe fn from_raw(ptr: u64, dtype: DType, layout: Layout, device: usize) -> Self {
        DeviceView {
            ptr,
            dtype,
            layout,
            device,
        }
    }

    /// Device address of element `[0, 0, ...]`.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_strided_tensor_are_read_in_place() {
        // [3, 2, 2] over a padded storage (row stride 6, middle stride 3).
        let data: Vec<f32> = (0..18).map(|x| x as f32).collect();
        let t = HostTensor::with_layout(
            HostData::F32(data),
            Layout::strided(&[3, 2, 2], &[6, 3, 1]).unwrap(),
        )
        .unwrap();
        assert_eq!(
            t.rows_to_f32_vec(&[2, 0, 2]).unwrap(),
            vec![12., 13., 15., 16., 0., 1., 3., 4., 12., 13., 15., 16.]
        );
        assert_eq!(t.rows_to_f32_vec(&[]).unwrap(), Vec::<f32>::new());
        let err = t.rows_to_f32_vec(&[3]).unwrap_err();
        assert_eq!(err.arg(), Some("rows"));
    }

    #[test]
    fn rows_of_a_broadcast_view_cost_only_the_rows_read() {
        // 2^50 rows of stride 0 over one bf16 row: reading two of them copies two rows.
        let row = [1.5f32, -2.0, 0.25];
        let t = HostTensor::with_layout(
            HostData::Bf16(row.iter().map(|&v| bf16::from_f32(v)).collect()),
            Layout::strided(&[1 << 50, 1, 3], &[0, 3, 1]).unwrap(),
        )
        .unwrap();
        let got = t.rows_to_f32_vec(&[0, (1 << 50) - 1]).unwrap();
        assert_eq!(got, [row, row].concat());
        // Copying the whole view instead is an allocation error, not an abort.
        assert!(matches!(t.to_f32_vec(), Err(Error::OutOfHostMemory { .. })));
    }
}
