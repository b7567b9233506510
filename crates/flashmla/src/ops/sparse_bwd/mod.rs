//! Sparse MLA prefill backward (docs/spec.md section 2): gradients of the sparse prefill forward
//! ([`crate::ops::sparse_fwd`]) with respect to `q`, `kv` and `attn_sink`, given the forward's `out`
//! and `lse` and the incoming gradient `d_out`.
//!
//! | argument | shape | dtype |
//! | --- | --- | --- |
//! | `q`, `kv`, `indices`, `attn_sink`, `topk_length` | as in the forward | |
//! | `out`, `d_out` | `[s_q, h_q, d_v]` | bf16 |
//! | `lse` | `[s_q, h_q]` | f32, exactly as the forward returned it (natural log, `+inf` for empty rows) |
//! | `d_q` | `[s_q, h_q, d_qk]` | bf16 |
//! | `d_kv` | `[s_kv, 1, d_qk]` | bf16, or f32 for callers that accumulate ([`SparseBwdArgs::d_kv_dtype`]) |
//! | `delta` | `[s_q, h_q]` | f32, `sum_c d_out * out` |
//! | `d_attn_sink` | `[h_q]` | f32, only when `attn_sink` is given |
//!
//! Rows of `d_kv` that no valid index references are exactly 0. `topk_length` is clamped to `0..=topk` as in the
//! forward. [`validate()`] checks everything once for both backends. CPU path: [`sparse_bwd_cpu`] runs
//! [`crate::reference::sparse_bwd`] in f32 on the referenced `kv` rows only (like the forward's CPU path), reports
//! an allocation that fails as [`crate::Error::OutOfHostMemory`], and [`sparse_bwd_cpu_with`] stops with
//! [`crate::Error::Interrupted`] when its [`CancelToken`] is cancelled.

pub mod launch;
pub mod validate;

pub use launch::{
    reduces_in_workspace, workspace_shape, KvBucketOrder, SparseBwdOptions, SparseBwdTuning,
};
pub use validate::{validate, validate_output};

use crate::alloc::try_filled;
use crate::cancel::CancelToken;
use crate::cuda::Gpu;
use crate::error::Result;
use crate::ops::sparse_fwd::{HostInputs, SparseFwdArgs, SparseFwdDims};
use crate::reference::sparse_bwd::{sparse_bwd_with, SparseBwdProblem};
use crate::tensor::{DType, DeviceView, HostData, HostTensor, TensorMeta};
use half::bf16;

/// The dtypes `d_kv` may have.
pub const D_KV_DTYPES: [DType; 2] = [DType::Bf16, DType::F32];

/// Arguments of the sparse prefill backward, generic over the tensor type. Shapes are in the
/// [module docs](self).
#[derive(Debug)]
pub struct SparseBwdArgs<'a, T> {
    /// Queries `[s_q, h_q, d_qk]` bf16.
    pub q: &'a T,
    /// Latent KV rows `[s_kv, 1, d_qk]` bf16.
    pub kv: &'a T,
    /// Forward output `[s_q, h_q, d_v]` bf16.
    pub out: &'a T,
    /// Gradient of the loss with respect to `out`, `[s_q, h_q, d_v]` bf16.
    pub d_out: &'a T,
    /// KV row per entry `[s_q, 1, topk]` i32.
    pub indices: &'a T,
    /// Forward log-sum-exp `[s_q, h_q]` f32.
    pub lse: &'a T,
    /// The forward's scale (finite, > 0).
    pub sm_scale: f32,
    /// The forward's per-head sink logit `[h_q]` f32.
    pub attn_sink: Option<&'a T>,
    /// The forward's per-token entry counts `[s_q]` i32.
    pub topk_length: Option<&'a T>,
    /// Dtype of `d_kv`: bf16 (default) or f32 (one of [`D_KV_DTYPES`]).
    pub d_kv_dtype: DType,
}

impl<T> Clone for SparseBwdArgs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SparseBwdArgs<'_, T> {}

impl<'a, T> SparseBwdArgs<'a, T> {
    /// The forward's arguments contained in these.
    pub fn fwd_args(&self) -> SparseFwdArgs<'a, T> {
        SparseFwdArgs {
            q: self.q,
            kv: self.kv,
            indices: self.indices,
            sm_scale: self.sm_scale,
            attn_sink: self.attn_sink,
            topk_length: self.topk_length,
        }
    }
}

/// Dimensions of a validated backward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseBwdDims {
    /// The forward's dimensions.
    pub fwd: SparseFwdDims,
    /// Dtype of `d_kv`.
    pub d_kv_dtype: DType,
}

impl SparseBwdDims {
    /// Shape of `d_q`: `[s_q, h_q, d_qk]`.
    pub fn d_q_shape(&self) -> [usize; 3] {
        [self.fwd.s_q, self.fwd.h_q, self.fwd.d_qk]
    }

    /// Shape of `d_kv`: `[s_kv, 1, d_qk]`.
    pub fn d_kv_shape(&self) -> [usize; 3] {
        [self.fwd.s_kv, 1, self.fwd.d_qk]
    }

    /// Shape of `delta`: `[s_q, h_q]`.
    pub fn delta_shape(&self) -> [usize; 2] {
        self.fwd.stat_shape()
    }

    /// Shape of `d_attn_sink`: `[h_q]`.
    pub fn d_attn_sink_shape(&self) -> [usize; 1] {
        [self.fwd.h_q]
    }
}

/// Outputs of the sparse prefill backward.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseBwdOutput<T> {
    /// Gradient of `q`, `[s_q, h_q, d_qk]` bf16.
    pub d_q: T,
    /// Gradient of `kv`, `[s_kv, 1, d_qk]` bf16 or f32.
    pub d_kv: T,
    /// `sum_c d_out * out`, `[s_q, h_q]` f32.
    pub delta: T,
    /// Gradient of `attn_sink`, `[h_q]` f32, when a sink is given.
    pub d_attn_sink: Option<T>,
}

/// Runs the backward on the CPU: validates, gathers the (possibly strided) inputs, runs the f32
/// reference and returns contiguous outputs (`d_q` rounded to bf16, `d_kv` to `d_kv_dtype`). See
/// [`sparse_bwd_cpu_with`].
pub fn sparse_bwd_cpu(args: &SparseBwdArgs<'_, HostTensor>) -> Result<SparseBwdOutput<HostTensor>> {
    sparse_bwd_cpu_with(args, CancelToken::never())
}

/// [`sparse_bwd_cpu`] that stops with [`crate::Error::Interrupted`] soon after `cancel` is cancelled (it is
/// polled before every token and every referenced KV row).
pub fn sparse_bwd_cpu_with(
    args: &SparseBwdArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<SparseBwdOutput<HostTensor>> {
    let dims = validate(args)?;
    let inputs = HostInputs::gather(&args.fwd_args(), &dims.fwd)?;
    let (out, d_out, lse) = (
        args.out.to_f32_vec()?,
        args.d_out.to_f32_vec()?,
        args.lse.to_f32_vec()?,
    );
    let res = sparse_bwd_with::<f32>(
        &SparseBwdProblem {
            fwd: inputs.problem(&dims.fwd, args.sm_scale),
            out: &out,
            d_out: &d_out,
            lse: &lse,
        },
        cancel,
    )?;
    let d_kv = scatter_rows(
        &res.d_kv,
        &inputs.kv_rows,
        dims.d_kv_dtype,
        &dims.d_kv_shape(),
    )?;
    Ok(SparseBwdOutput {
        d_q: HostTensor::bf16_from_f32(&res.d_q, &dims.d_q_shape())?,
        d_kv,
        delta: HostTensor::from_f32(res.delta, &dims.delta_shape())?,
        d_attn_sink: res
            .d_attn_sink
            .map(|d| HostTensor::from_f32(d, &dims.d_attn_sink_shape()))
            .transpose()?,
    })
}

/// The full `d_kv [s_kv, 1, d_qk]` of `dtype` (f32 or bf16) from the gradients of the referenced rows:
/// `compact[k]` (`d_qk` values) goes to row `rows[k]`, every other row is 0.
fn scatter_rows(
    compact: &[f32],
    rows: &[usize],
    dtype: DType,
    shape: &[usize; 3],
) -> Result<HostTensor> {
    let [s_kv, _, d_qk] = *shape;
    let n = s_kv.saturating_mul(d_qk);
    macro_rules! scatter {
        ($zero:expr, $convert:expr, $variant:ident) => {{
            let mut full = try_filled("sparse_bwd d_kv", n, $zero)?;
            for (src, &r) in compact.chunks(d_qk).zip(rows) {
                for (d, &x) in full[r * d_qk..(r + 1) * d_qk].iter_mut().zip(src) {
                    *d = $convert(x);
                }
            }
            HostData::$variant(full)
        }};
    }
    let data = match dtype {
        DType::F32 => scatter!(0f32, |x: f32| x, F32),
        _ => scatter!(bf16::ZERO, bf16::from_f32, Bf16),
    };
    HostTensor::new(data, shape)
}

/// Runs the backward on the GPU with default options (atomic f32 accumulation of `d_kv`, workspace allocated
/// and freed in stream order when `d_kv` is bf16). See [`sparse_bwd_cuda_with`].
pub fn sparse_bwd_cuda(
    gpu: &Gpu,
    args: &SparseBwdArgs<'_, DeviceView>,
    out: &SparseBwdOutput<DeviceView>,
) -> Result<()> {
    sparse_bwd_cuda_with(gpu, args, out, &SparseBwdOptions::default(), None)
}

/// Runs the backward on the GPU. `options` selects accumulation into an existing f32 `d_kv` and the
/// deterministic (fixed-point) reduction, and may replace the measured launch choices
/// ([`SparseBwdTuning`]); `workspace` is an optional caller-owned f32 buffer of
/// [`workspace_shape`] (otherwise the op allocates it when needed: `s_kv * d_qk` f32, or twice that in
/// deterministic mode, and nothing of size `s_q * topk`).
pub fn sparse_bwd_cuda_with(
    gpu: &Gpu,
    args: &SparseBwdArgs<'_, DeviceView>,
    out: &SparseBwdOutput<DeviceView>,
    options: &SparseBwdOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    let dims = validate(args)?;
    validate_output(&dims, args.q.location(), out)?;
    launch::launch(gpu, &dims, args, out, options, workspace)
}
