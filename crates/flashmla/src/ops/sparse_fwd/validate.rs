//! Shape, dtype, stride and placement checks of the sparse prefill forward, shared by both backends.

use super::{
    SparseFwdArgs, SparseFwdDims, SparseFwdOutput, DATA_DTYPE, D_V, INDEX_DTYPE, STAT_DTYPE,
    SUPPORTED_D_QK,
};
use crate::error::{Error, Result};
use crate::tensor::{Location, TensorMeta};
use crate::validate::{
    expect_dim, expect_dtype, expect_last_dim_contiguous, expect_location, expect_one_of,
    expect_positive_finite, expect_rank, expect_shape, optional,
};

/// Dtype, rank, last-dimension stride and location of one tensor.
pub(crate) fn expect_tensor(
    arg: &str,
    t: &impl TensorMeta,
    dtype: crate::tensor::DType,
    rank: usize,
    loc: Location,
) -> Result<()> {
    expect_dtype(arg, t, &[dtype])?;
    expect_rank(arg, t, rank)?;
    expect_last_dim_contiguous(arg, t)?;
    expect_location(arg, t, loc)
}

/// A dimension that must be at least 1.
fn expect_nonzero(arg: &str, value: usize, what: &str) -> Result<()> {
    if value == 0 {
        return Err(Error::invalid(arg, format!("at least 1 ({what})"), 0));
    }
    Ok(())
}

/// Checks the forward's arguments and returns their dimensions. The dimensions come from `q`
/// (`s_q, h_q, d_qk`), `kv` (`s_kv`) and `indices` (`topk`); every other tensor must agree, live where
/// `q` lives and have a contiguous last dimension.
pub fn validate<T: TensorMeta>(args: &SparseFwdArgs<'_, T>) -> Result<SparseFwdDims> {
    let loc = args.q.location();

    expect_tensor("q", args.q, DATA_DTYPE, 3, loc)?;
    let [s_q, h_q, d_qk] = [args.q.shape()[0], args.q.shape()[1], args.q.shape()[2]];
    expect_nonzero("q.shape[1]", h_q, "h_q, query heads")?;
    expect_one_of("q.shape[2]", d_qk, &SUPPORTED_D_QK)?;

    expect_tensor("kv", args.kv, DATA_DTYPE, 3, loc)?;
    let s_kv = args.kv.shape()[0];
    expect_dim("kv", args.kv, 1, 1, "h_kv, one latent head")?;
    expect_dim("kv", args.kv, 2, d_qk, "d_qk, from q")?;

    expect_tensor("indices", args.indices, INDEX_DTYPE, 3, loc)?;
    expect_dim("indices", args.indices, 0, s_q, "s_q, from q")?;
    expect_dim("indices", args.indices, 1, 1, "h_kv, one latent head")?;
    let topk = args.indices.shape()[2];
    expect_nonzero("indices.shape[2]", topk, "topk")?;

    expect_positive_finite("sm_scale", args.sm_scale)?;

    optional(args.attn_sink, |sink| {
        expect_tensor("attn_sink", sink, STAT_DTYPE, 1, loc)?;
        expect_dim("attn_sink", sink, 0, h_q, "h_q, from q")
    })?;
    optional(args.topk_length, |len| {
        expect_tensor("topk_length", len, INDEX_DTYPE, 1, loc)?;
        expect_dim("topk_length", len, 0, s_q, "s_q, from q")
    })?;

    Ok(SparseFwdDims {
        s_q,
        s_kv,
        h_q,
        d_qk,
        d_v: D_V,
        topk,
        has_attn_sink: args.attn_sink.is_some(),
        has_topk_length: args.topk_length.is_some(),
    })
}

/// Checks caller-provided output tensors (the GPU path writes into them) against validated `dims`:
/// shapes and dtypes per the [module docs](super), contiguous last dimension, located at `loc` (the
/// inputs' location).
pub fn validate_output<T: TensorMeta>(
    dims: &SparseFwdDims,
    loc: Location,
    out: &SparseFwdOutput<T>,
) -> Result<()> {
    for (arg, t, dtype, shape) in [
        ("out", &out.out, DATA_DTYPE, &dims.out_shape()[..]),
        (
            "max_logits",
            &out.max_logits,
            STAT_DTYPE,
            &dims.stat_shape()[..],
        ),
        ("lse", &out.lse, STAT_DTYPE, &dims.stat_shape()[..]),
    ] {
        expect_tensor(arg, t, dtype, shape.len(), loc)?;
        expect_shape(arg, t, shape)?;
    }
    Ok(())
}
