//! Small, pure validation helpers. Each returns a typed [`Error::InvalidArgument`] naming the argument,
//! what was expected and what came. Ops call these before anything touches memory.

use crate::error::{Error, Result};
use crate::tensor::{DType, DeviceView, Location, TensorMeta};

/// The tensor's dtype is one of `allowed`. The error lists exactly the dtypes this argument accepts and names the
/// one that came, also when it is none of [`DType`] ([`TensorMeta::foreign_dtype`], e.g. a torch int64 tensor).
pub fn expect_dtype(arg: &str, t: &impl TensorMeta, allowed: &[DType]) -> Result<()> {
    let foreign = t.foreign_dtype();
    if foreign.is_none() && allowed.contains(&t.dtype()) {
        return Ok(());
    }
    let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
    Err(Error::invalid(
        format!("{arg}.dtype"),
        format!("one of [{}]", names.join(", ")),
        foreign.unwrap_or(t.dtype().name()),
    ))
}

/// The tensor has `rank` dimensions.
pub fn expect_rank(arg: &str, t: &impl TensorMeta, rank: usize) -> Result<()> {
    if t.shape().len() == rank {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{arg}.shape"),
        format!("{rank} dimensions"),
        format!("{} dimensions {:?}", t.shape().len(), t.shape()),
    ))
}

/// Dimension `dim` of the tensor equals `value` (`what` says where the value comes from, e.g. `"s_q"`).
pub fn expect_dim(
    arg: &str,
    t: &impl TensorMeta,
    dim: usize,
    value: usize,
    what: &str,
) -> Result<()> {
    let got = t.shape().get(dim).copied();
    if got == Some(value) {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{arg}.shape[{dim}]"),
        format!("{value} ({what})"),
        match got {
            Some(g) => format!("{g} (shape {:?})", t.shape()),
            None => format!("no such dimension (shape {:?})", t.shape()),
        },
    ))
}

/// Rank and full shape at once.
pub fn expect_shape(arg: &str, t: &impl TensorMeta, shape: &[usize]) -> Result<()> {
    if t.shape() == shape {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{arg}.shape"),
        format!("{shape:?}"),
        format!("{:?}", t.shape()),
    ))
}

/// The last dimension has stride 1 (or size 1), so rows can be read as vectors.
pub fn expect_last_dim_contiguous(arg: &str, t: &impl TensorMeta) -> Result<()> {
    match (t.shape().last(), t.strides().last()) {
        (Some(&n), Some(&s)) if n <= 1 || s == 1 => Ok(()),
        (None, None) => Ok(()),
        (_, s) => Err(Error::invalid(
            format!("{arg}.strides"),
            "last-dimension stride 1",
            format!("{:?}", s.map(|_| t.strides()).unwrap_or_default()),
        )),
    }
}

/// The tensor is row-major contiguous.
pub fn expect_contiguous(arg: &str, t: &impl TensorMeta) -> Result<()> {
    if t.layout().is_contiguous() {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{arg}.strides"),
        format!("contiguous strides for shape {:?}", t.shape()),
        format!("{:?}", t.strides()),
    ))
}

/// A kernel workspace a caller provides: a contiguous f32 vector of at least `words` elements whose address is a
/// multiple of `align` bytes.
pub fn expect_f32_workspace(ws: &DeviceView, words: usize, align: u64) -> Result<()> {
    if ws.dtype() != DType::F32 {
        return Err(Error::invalid("workspace.dtype", DType::F32, ws.dtype()));
    }
    if ws.shape().len() != 1 || ws.shape()[0] < words || !ws.layout().is_contiguous() {
        return Err(Error::invalid(
            "workspace",
            format!("a contiguous f32 vector of at least {words} elements"),
            format!("shape {:?}, strides {:?}", ws.shape(), ws.strides()),
        ));
    }
    if ws.ptr() % align != 0 {
        return Err(Error::invalid(
            "workspace.data_ptr",
            format!("a {align}-byte aligned address"),
            format!("{:#x}", ws.ptr()),
        ));
    }
    Ok(())
}

/// Every stride (and the span of reachable offsets) fits the index type a kernel uses, given as its
/// largest value (e.g. `i32::MAX as usize`). Kernels index with that type, so a larger value would wrap.
pub fn expect_offsets_fit(
    arg: &str,
    t: &impl TensorMeta,
    max: usize,
    type_name: &str,
) -> Result<()> {
    let span = t.layout().span();
    match span {
        Some(s) if s <= max.saturating_add(1) => Ok(()),
        _ => Err(Error::invalid(
            format!("{arg}.strides"),
            format!("element offsets that fit in {type_name} (at most {max})"),
            match span {
                Some(s) => format!("largest offset {}", s - 1),
                None => "offsets overflowing usize".to_string(),
            },
        )),
    }
}

/// Every tensor lives at `loc`.
pub fn expect_location(arg: &str, t: &impl TensorMeta, loc: Location) -> Result<()> {
    if t.location() == loc {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{arg}.device"),
        loc.to_string(),
        t.location(),
    ))
}

/// `value` is one of `allowed`.
pub fn expect_one_of(arg: &str, value: usize, allowed: &[usize]) -> Result<()> {
    if allowed.contains(&value) {
        return Ok(());
    }
    Err(Error::invalid(arg, format!("one of {allowed:?}"), value))
}

/// `lo <= value <= hi`.
pub fn expect_range(arg: &str, value: usize, lo: usize, hi: usize) -> Result<()> {
    if (lo..=hi).contains(&value) {
        return Ok(());
    }
    Err(Error::invalid(
        arg,
        format!("a value in {lo}..={hi}"),
        value,
    ))
}

/// A finite, positive scale.
pub fn expect_positive_finite(arg: &str, value: f32) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(Error::invalid(arg, "a finite value > 0", value))
}

/// Checks the optional tensor with `f` when present.
pub fn optional<T>(t: Option<&T>, f: impl FnOnce(&T) -> Result<()>) -> Result<()> {
    t.map_or(Ok(()), f)
}

/// Converts a size to `i32` for a kernel parameter, naming the argument when it does not fit.
pub fn to_i32(arg: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::invalid(arg, "a value that fits in i32", value))
}

/// Converts a size to `i64` for a kernel parameter, naming the argument when it does not fit.
pub fn to_i64(arg: &str, value: usize) -> Result<i64> {
    i64::try_from(value).map_err(|_| Error::invalid(arg, "a value that fits in i64", value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Layout;

    /// Metadata of a tensor whose element type flashmla does not know (e.g. torch's int64).
    struct Foreign(Layout);

    impl TensorMeta for Foreign {
        fn dtype(&self) -> DType {
            DType::I32
        }
        fn layout(&self) -> &Layout {
            &self.0
        }
        fn location(&self) -> Location {
            Location::Host
        }
        fn foreign_dtype(&self) -> Option<&str> {
            Some("int64")
        }
    }

    #[test]
    fn a_dtype_error_lists_what_the_argument_accepts_and_names_what_came() {
        let t = Foreign(Layout::contiguous(&[2, 1, 4]));
        // The placeholder dtype() of a foreign tensor is never taken for an accepted one.
        let err = expect_dtype("indices", &t, &[DType::I32]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid argument `indices.dtype`: expected one of [i32], got int64"
        );
        let host = crate::HostTensor::from_f32(vec![0.0; 2], &[2]).unwrap();
        let err = expect_dtype("attn_sink", &host, &[DType::F32]);
        assert_eq!(err, Ok(()));
        let err = expect_dtype("q", &host, &[DType::Bf16, DType::F16]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid argument `q.dtype`: expected one of [bf16, f16], got f32"
        );
    }
}
