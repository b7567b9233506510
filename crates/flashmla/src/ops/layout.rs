//! Host-side helpers the kernel launches share to turn a [`DeviceView`]'s layout into kernel parameters.

use crate::error::{Error, Result};
use crate::tensor::{DeviceView, TensorMeta};
use crate::validate::{expect_offsets_fit, to_i64};

/// Stride of dimension `dim`, or 0 when the dimension has one entry (its stride never moves a
/// pointer, and may be anything, e.g. from a sliced framework tensor).
pub(crate) fn stride_of(t: &DeviceView, dim: usize) -> usize {
    if t.shape()[dim] <= 1 {
        0
    } else {
        t.strides()[dim]
    }
}

/// `t`'s base address and every used stride (all but the last dimension's) are multiples of
/// `align` bytes.
pub(crate) fn rows_aligned(t: &DeviceView, align: u64) -> bool {
    let elem = t.dtype().size_bytes() as u64;
    let rank = t.shape().len();
    t.ptr() % align == 0
        && (0..rank.saturating_sub(1)).all(|d| (stride_of(t, d) as u64 * elem) % align == 0)
}

/// `i64` stride parameter for dimension `dim` of `t` (the argument's name is formatted only for an error: this
/// runs for every stride of every launch).
pub(crate) fn stride_param(arg: &str, t: &DeviceView, dim: usize) -> Result<i64> {
    let stride = stride_of(t, dim);
    i64::try_from(stride).or_else(|_| to_i64(&format!("{arg}.strides[{dim}]"), stride))
}

/// Bytes of one `cp.async` chunk: the unit in which the kernels gather rows.
pub(crate) const GATHER_CHUNK_BYTES: u64 = 16;

/// The gathered operands (`tensors`: argument name and view) of `op`'s kernel have 16-byte aligned rows (base
/// address and every used stride a multiple of 8 elements of 2 bytes): the kernels copy rows in 16-byte chunks.
pub(crate) fn expect_rows_16b(op: &str, tensors: &[(&str, &DeviceView)]) -> Result<()> {
    for &(arg, t) in tensors {
        if !rows_aligned(t, GATHER_CHUNK_BYTES) {
            let (ptr, strides) = (t.ptr(), t.strides());
            return Err(Error::unsupported(
                format!("{op} on the GPU with `{arg}` at {ptr:#x}, strides {strides:?}"),
                "the kernel gathers rows in 16-byte chunks: the base address and strides must be \
                 multiples of 8 elements (pass a contiguous copy otherwise)",
            ));
        }
    }
    Ok(())
}

/// Every given tensor's base address is aligned to its element size (the kernels' scalar accesses).
pub(crate) fn expect_element_aligned(tensors: &[(&str, Option<&DeviceView>)]) -> Result<()> {
    for &(arg, t) in tensors {
        if let Some(t) = t {
            let elem = t.dtype().size_bytes() as u64;
            if t.ptr() % elem != 0 {
                return Err(Error::invalid(
                    format!("{arg}.data_ptr"),
                    format!("an address aligned to the element size ({elem} bytes)"),
                    format!("{:#x}", t.ptr()),
                ));
            }
        }
    }
    Ok(())
}

/// Every reachable element offset of every given tensor fits the kernels' `i64` arithmetic.
pub(crate) fn expect_offsets_fit_i64(tensors: &[(&str, Option<&DeviceView>)]) -> Result<()> {
    for &(arg, t) in tensors {
        if let Some(t) = t {
            expect_offsets_fit(arg, t, i64::MAX as usize, "i64")?;
        }
    }
    Ok(())
}

/// A view of `shape` (contiguous, or with `strides`) at a made-up device address, for the launchers' CPU tests of
/// their parameter lowering. Never dereferenced.
#[cfg(test)]
pub(crate) fn fake_view(
    ptr: u64,
    dtype: crate::tensor::DType,
    shape: &[usize],
    strides: Option<&[usize]>,
) -> DeviceView {
    use crate::tensor::Layout;
    let layout = match strides {
        Some(s) => Layout::strided(shape, s).unwrap(),
        None => Layout::contiguous(shape),
    };
    // SAFETY: never dereferenced; the tests only lower parameters.
    unsafe { DeviceView::from_raw(ptr, dtype, layout, 0) }
}
