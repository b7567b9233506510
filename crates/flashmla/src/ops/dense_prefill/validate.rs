//! Shape, dtype and placement checks of the dense varlen prefill (docs/spec.md section 5).

use super::{
    DensePrefillArgs, DensePrefillBwdArgs, DensePrefillBwdOptions, DensePrefillGrads,
    DensePrefillOutput,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Location, TensorMeta};
use crate::validate::{
    expect_dim, expect_dtype, expect_last_dim_contiguous, expect_location, expect_rank,
};

/// The `(d, d_v)` pairs of the op: DeepSeek's MHA form of MLA (128 NoPE + 64 RoPE for q/k, 128 for v) and plain
/// 128-wide heads.
pub const HEAD_DIMS: [(usize, usize); 2] = [(192, 128), (128, 128)];

/// Validated dimensions of a dense varlen prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DensePrefillDims {
    /// Sequences `b` (`cu_seqlens` hold `b + 1` offsets).
    pub batch: usize,
    /// Query rows of all sequences.
    pub total_q: usize,
    /// Key rows of all sequences.
    pub total_k: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads (`h_q % h_k == 0`).
    pub h_k: usize,
    /// Query/key width.
    pub d: usize,
    /// Value width.
    pub d_v: usize,
    /// The logit scale (given, or `d^-0.5`).
    pub softmax_scale: f32,
    /// Bottom-right causal masking.
    pub causal: bool,
    /// Element type of `q`, `k`, `v` and `out`.
    pub dtype: DType,
}

/// Checks a forward's arguments and returns its dimensions. The offsets' values are checked where they are read
/// (the CPU path checks them all: start 0, non-decreasing, ending at the row counts).
pub fn validate<T: TensorMeta>(args: &DensePrefillArgs<'_, T>) -> Result<DensePrefillDims> {
    let loc = args.q.location();
    for (name, t) in [
        ("q", args.q),
        ("k", args.k),
        ("v", args.v),
        ("cu_seqlens_q", args.cu_seqlens_q),
        ("cu_seqlens_k", args.cu_seqlens_k),
    ] {
        expect_location(name, t, loc)?;
    }
    expect_dtype("q", args.q, &[DType::Bf16, DType::F16])?;
    let dtype = args.q.dtype();
    expect_dtype("k", args.k, &[dtype])?;
    expect_dtype("v", args.v, &[dtype])?;
    expect_dtype("cu_seqlens_q", args.cu_seqlens_q, &[DType::I32])?;
    expect_dtype("cu_seqlens_k", args.cu_seqlens_k, &[DType::I32])?;
    for (name, t) in [("q", args.q), ("k", args.k), ("v", args.v)] {
        expect_rank(name, t, 3)?;
        expect_last_dim_contiguous(name, t)?;
    }
    expect_rank("cu_seqlens_q", args.cu_seqlens_q, 1)?;
    expect_rank("cu_seqlens_k", args.cu_seqlens_k, 1)?;
    let [total_q, h_q, d] = [0, 1, 2].map(|i| args.q.shape()[i]);
    let [total_k, h_k, _] = [0, 1, 2].map(|i| args.k.shape()[i]);
    let d_v = args.v.shape()[2];
    if !HEAD_DIMS.contains(&(d, d_v)) {
        return Err(Error::invalid(
            "q.shape[2]",
            format!("(d, d_v) one of {HEAD_DIMS:?}"),
            format!("({d}, {d_v})"),
        ));
    }
    expect_dim("k", args.k, 2, d, "d, from q")?;
    expect_dim("v", args.v, 0, total_k, "total_k, from k")?;
    expect_dim("v", args.v, 1, h_k, "h_k, from k")?;
    if h_k == 0 || h_q == 0 || h_q % h_k != 0 {
        return Err(Error::invalid(
            "q.shape[1]",
            format!("a positive multiple of h_k = {h_k}"),
            h_q,
        ));
    }
    let offsets = args.cu_seqlens_q.shape()[0];
    if offsets < 2 {
        return Err(Error::invalid(
            "cu_seqlens_q.shape[0]",
            "b + 1 >= 2 offsets",
            offsets,
        ));
    }
    expect_dim(
        "cu_seqlens_k",
        args.cu_seqlens_k,
        0,
        offsets,
        "b + 1, from cu_seqlens_q",
    )?;
    let softmax_scale = match args.softmax_scale {
        None => (d as f32).powf(-0.5),
        Some(s) if s.is_finite() && s > 0.0 => s,
        Some(s) => return Err(Error::invalid("softmax_scale", "a finite value > 0", s)),
    };
    Ok(DensePrefillDims {
        batch: offsets - 1,
        total_q,
        total_k,
        h_q,
        h_k,
        d,
        d_v,
        softmax_scale,
        causal: args.causal,
        dtype,
    })
}

/// Checks a backward's arguments (the forward's, plus `out`, `d_out` `[total_q, h_q, d_v]` of q's dtype and `lse`
/// `[h_q, total_q]` f32) and returns the dimensions.
pub fn validate_bwd<T: TensorMeta>(args: &DensePrefillBwdArgs<'_, T>) -> Result<DensePrefillDims> {
    let dims = validate(&args.fwd)?;
    let loc = args.fwd.q.location();
    let out_shape = [dims.total_q, dims.h_q, dims.d_v];
    for (name, t) in [("out", args.out), ("d_out", args.d_out)] {
        expect_location(name, t, loc)?;
        expect_dtype(name, t, &[dims.dtype])?;
        crate::validate::expect_shape(name, t, &out_shape)?;
        expect_last_dim_contiguous(name, t)?;
    }
    expect_location("lse", args.lse, loc)?;
    expect_dtype("lse", args.lse, &[DType::F32])?;
    crate::validate::expect_shape("lse", args.lse, &[dims.h_q, dims.total_q])?;
    Ok(dims)
}

/// Checks the outputs a caller provides for a forward of dimensions `dims` on `loc`: `out [total_q, h_q, d_v]` of
/// q's dtype with its last dimension contiguous, and `lse [h_q, total_q]` f32.
pub fn validate_output<T: TensorMeta>(
    dims: &DensePrefillDims,
    loc: Location,
    out: &DensePrefillOutput<T>,
) -> Result<()> {
    expect_location("out", &out.out, loc)?;
    expect_dtype("out", &out.out, &[dims.dtype])?;
    crate::validate::expect_shape("out", &out.out, &[dims.total_q, dims.h_q, dims.d_v])?;
    expect_last_dim_contiguous("out", &out.out)?;
    expect_location("lse", &out.lse, loc)?;
    expect_dtype("lse", &out.lse, &[DType::F32])?;
    crate::validate::expect_shape("lse", &out.lse, &[dims.h_q, dims.total_q])?;
    Ok(())
}

/// Checks the gradients and the workspace a caller provides for a backward of dimensions `dims` on `loc`: `d_q [total_q,
/// h_q, d]`, `d_k [total_k, h_k, d]`, `d_v [total_k, h_k, d_v]` of q's dtype (last dimensions contiguous), and
/// `workspace` f32 of [`bwd_workspace_shape`]`(dims, options)`.
pub fn validate_grads<T: TensorMeta>(
    dims: &DensePrefillDims,
    loc: Location,
    grads: &DensePrefillGrads<T>,
    workspace: &T,
    options: &DensePrefillBwdOptions,
) -> Result<()> {
    for (name, t, shape) in [
        ("d_q", &grads.d_q, [dims.total_q, dims.h_q, dims.d]),
        ("d_k", &grads.d_k, [dims.total_k, dims.h_k, dims.d]),
        ("d_v", &grads.d_v, [dims.total_k, dims.h_k, dims.d_v]),
    ] {
        expect_location(name, t, loc)?;
        expect_dtype(name, t, &[dims.dtype])?;
        crate::validate::expect_shape(name, t, &shape)?;
        expect_last_dim_contiguous(name, t)?;
    }
    expect_location("workspace", workspace, loc)?;
    expect_dtype("workspace", workspace, &[DType::F32])?;
    crate::validate::expect_shape("workspace", workspace, &bwd_workspace_shape(dims, options)?)?;
    Ok(())
}

/// The shape of the backward's f32 workspace (contiguous, 16-byte aligned): `[h_q, total_q]` (the per-row `delta`)
/// for the separate schedule; for the fused one (see [`DensePrefillBwdOptions::fused`]) one dimension of
/// [`bwd_accumulator_len`] + `h_q * total_q` floats, the f32 dQ accumulator followed by `delta` `[h_q, total_q]`:
/// about `4 d + 4` bytes per query row and head (the accumulator pads each sequence to whole 64-row tiles).
///
/// Errors: those of [`DensePrefillBwdOptions::fused_for`].
pub fn bwd_workspace_shape(
    dims: &DensePrefillDims,
    options: &DensePrefillBwdOptions,
) -> Result<Vec<usize>> {
    bwd_workspace_shape_for(dims.h_q, dims.total_q, dims.batch, dims.d, options)
}

/// [`bwd_workspace_shape`] from the dimensions it depends on.
pub fn bwd_workspace_shape_for(
    h_q: usize,
    total_q: usize,
    batch: usize,
    d: usize,
    options: &DensePrefillBwdOptions,
) -> Result<Vec<usize>> {
    Ok(if options.fused_for(d)? {
        vec![accumulator_len(h_q, total_q, batch, d).saturating_add(h_q.saturating_mul(total_q))]
    } else {
        vec![h_q, total_q]
    })
}

/// Floats of the f32 dQ accumulator of the default backward: per query head, `ceil(total_q / 64) + b` tiles of 64
/// rows (every sequence's rows padded to whole tiles) times `d` columns.
pub fn bwd_accumulator_len(dims: &DensePrefillDims) -> usize {
    accumulator_len(dims.h_q, dims.total_q, dims.batch, dims.d)
}

fn accumulator_len(h_q: usize, total_q: usize, batch: usize, d: usize) -> usize {
    (total_q.div_ceil(64) + batch)
        .saturating_mul(64 * d)
        .saturating_mul(h_q)
}
