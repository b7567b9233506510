//! Host-side helpers the kernel launches share to turn a [`DeviceView`]'s layout into kernel parameters.

use crate::error::Result;
use crate::tensor::{DeviceView, TensorMeta};
use crate::validate::to_i64;

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

/// `i64` stride parameter for dimension `dim` of `t`.
pub(crate) fn stride_param(arg: &str, t: &DeviceView, dim: usize) -> Result<i64> {
    to_i64(&format!("{arg}.strides[{dim}]"), stride_of(t, dim))
}
