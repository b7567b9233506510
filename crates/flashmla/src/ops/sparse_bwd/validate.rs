//! Shape, dtype, stride and placement checks of the sparse prefill backward, shared by both backends.

use super::{SparseBwdArgs, SparseBwdDims, SparseBwdOutput, D_KV_DTYPES};
use crate::error::{Error, Result};
use crate::ops::sparse_fwd::validate::expect_tensor;
use crate::ops::sparse_fwd::{validate as validate_fwd, DATA_DTYPE, STAT_DTYPE};
use crate::tensor::{Location, TensorMeta};
use crate::validate::expect_shape;

/// Checks the backward's arguments and returns their dimensions: the forward's arguments as
/// [`crate::ops::sparse_fwd::validate()`] checks them, then `out`, `d_out` `[s_q, h_q, d_v]` bf16,
/// `lse` `[s_q, h_q]` f32 (each with a contiguous last dimension, where `q` lives) and `d_kv_dtype`.
pub fn validate<T: TensorMeta>(args: &SparseBwdArgs<'_, T>) -> Result<SparseBwdDims> {
    let fwd = validate_fwd(&args.fwd_args())?;
    let loc = args.q.location();
    for (arg, t, dtype, shape) in [
        ("out", args.out, DATA_DTYPE, &fwd.out_shape()[..]),
        ("d_out", args.d_out, DATA_DTYPE, &fwd.out_shape()[..]),
        ("lse", args.lse, STAT_DTYPE, &fwd.stat_shape()[..]),
    ] {
        expect_tensor(arg, t, dtype, shape.len(), loc)?;
        expect_shape(arg, t, shape)?;
    }
    if !D_KV_DTYPES.contains(&args.d_kv_dtype) {
        return Err(Error::invalid("d_kv_dtype", "bf16 or f32", args.d_kv_dtype));
    }
    Ok(SparseBwdDims {
        fwd,
        d_kv_dtype: args.d_kv_dtype,
    })
}

/// Checks caller-provided output tensors (the GPU path writes into them) against validated `dims`:
/// shapes and dtypes per the [module docs](super) (`d_kv` of `dims.d_kv_dtype`), contiguous last
/// dimension, located at `loc`; `d_attn_sink` present exactly when the call has a sink.
pub fn validate_output<T: TensorMeta>(
    dims: &SparseBwdDims,
    loc: Location,
    out: &SparseBwdOutput<T>,
) -> Result<()> {
    for (arg, t, dtype, shape) in [
        ("d_q", &out.d_q, DATA_DTYPE, &dims.d_q_shape()[..]),
        ("d_kv", &out.d_kv, dims.d_kv_dtype, &dims.d_kv_shape()[..]),
        ("delta", &out.delta, STAT_DTYPE, &dims.delta_shape()[..]),
    ] {
        expect_tensor(arg, t, dtype, shape.len(), loc)?;
        expect_shape(arg, t, shape)?;
    }
    match (&out.d_attn_sink, dims.fwd.has_attn_sink) {
        (Some(d), true) => {
            expect_tensor("d_attn_sink", d, STAT_DTYPE, 1, loc)?;
            expect_shape("d_attn_sink", d, &dims.d_attn_sink_shape())
        }
        (None, false) => Ok(()),
        (Some(_), false) => Err(Error::invalid(
            "d_attn_sink",
            "no tensor (the call has no attn_sink)",
            "a tensor",
        )),
        (None, true) => Err(Error::invalid(
            "d_attn_sink",
            format!(
                "a tensor of shape {:?} (the call has an attn_sink)",
                dims.d_attn_sink_shape()
            ),
            "none",
        )),
    }
}
