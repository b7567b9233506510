//! Sparse MLA prefill forward (docs/spec.md section 1): every query token attends to the `topk` latent KV rows
//! its index row names, with all query heads sharing each row (`h_kv = 1`) and V = the first
//! [`D_V`] columns of the row.
//!
//! | argument | shape | dtype |
//! | --- | --- | --- |
//! | `q` | `[s_q, h_q, d_qk]` | bf16 |
//! | `kv` | `[s_kv, 1, d_qk]` | bf16 |
//! | `indices` | `[s_q, 1, topk]` | i32 (values outside `0..s_kv` are ignored) |
//! | `attn_sink` (optional) | `[h_q]` | f32 |
//! | `topk_length` (optional) | `[s_q]` | i32 (entries at positions `>= topk_length[t]` are ignored; see below) |
//! | `out` | `[s_q, h_q, d_v]` | bf16 |
//! | `max_logits`, `lse` | `[s_q, h_q]` | f32 (natural log; `-inf` / `+inf` for tokens without entries) |
//!
//! `d_qk` is 512 or 576, `d_v` is 512, `h_q >= 1`, `topk >= 1`; `s_q` and `s_kv` may be 0. Every
//! tensor's last dimension must be contiguous; other strides are free. [`validate()`] checks all of
//! this once for both backends; limits of a particular GPU kernel (head counts, stride widths) are
//! checked by its launch code.
//!
//! `topk_length` values are data, never errors: token `t` uses its first `clamp(topk_length[t], 0, topk)`
//! entries, so a length above `topk` means all `topk` entries and a negative length none (the token then has no
//! valid entry: `out = 0`, `lse = +inf`). Both backends clamp the same way.
//!
//! CPU path: [`sparse_fwd_cpu`] runs [`crate::reference::sparse_fwd`] in f32 and rounds `out` to bf16. It reads
//! only the `kv` rows that a valid entry references (a broadcast or huge `kv` costs nothing more), allocates
//! the outputs plus f32 copies of `q` and of the referenced rows, reports an allocation that fails as
//! [`crate::Error::OutOfHostMemory`], and [`sparse_fwd_cpu_with`] stops with [`crate::Error::Interrupted`]
//! when its [`CancelToken`] is cancelled.
//! GPU path: [`sparse_fwd_cuda`] launches the sm_90a kernel ([`launch`]) into caller-provided outputs;
//! [`sparse_fwd_cuda_with`] takes launch choices ([`SparseFwdTuning`]) instead of the heuristics.

pub mod launch;
pub mod validate;

pub use launch::{SparseFwdPipeline, SparseFwdPrefetch, SparseFwdTuning};
pub use validate::{validate, validate_output};

use crate::alloc::try_with_capacity;
use crate::cancel::CancelToken;
use crate::cuda::Gpu;
use crate::error::Result;
use crate::fp8::KvFormat;
use crate::reference::sparse_fwd::{clamp_topk_length, sparse_fwd_with, SparseFwdProblem};
use crate::tensor::{DType, DeviceView, HostTensor, TensorMeta};

/// Value width: V is the first `D_V` columns of each latent KV row.
pub const D_V: usize = 512;
/// The query/key widths the op accepts: DeepSeek V4 "MODEL1" (448 NoPE + 64 RoPE) and DeepSeek V3.2
/// (512 NoPE + 64 RoPE), the same widths as the two FP8 cache formats.
pub const SUPPORTED_D_QK: [usize; 2] = [KvFormat::Model1.d_qk(), KvFormat::V32.d_qk()];

/// Dtype of `q`, `kv` and `out`.
pub const DATA_DTYPE: DType = DType::Bf16;
/// Dtype of `indices` and `topk_length`.
pub const INDEX_DTYPE: DType = DType::I32;
/// Dtype of `attn_sink`, `max_logits` and `lse`.
pub const STAT_DTYPE: DType = DType::F32;

/// Arguments of the sparse prefill forward, generic over the tensor type ([`HostTensor`] for the CPU
/// path, [`crate::DeviceView`] for the GPU path). Shapes are in the [module docs](self).
#[derive(Debug)]
pub struct SparseFwdArgs<'a, T> {
    /// Queries `[s_q, h_q, d_qk]` bf16.
    pub q: &'a T,
    /// Latent KV rows `[s_kv, 1, d_qk]` bf16.
    pub kv: &'a T,
    /// KV row per entry `[s_q, 1, topk]` i32.
    pub indices: &'a T,
    /// Scale applied to every `q . k` (finite, > 0; typically `d_qk^-0.5`).
    pub sm_scale: f32,
    /// Per-head sink logit `[h_q]` f32.
    pub attn_sink: Option<&'a T>,
    /// Per-token number of leading index entries to use `[s_q]` i32, clamped to `0..=topk` (a value above
    /// `topk` uses all entries, a negative one none).
    pub topk_length: Option<&'a T>,
}

impl<T> Clone for SparseFwdArgs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SparseFwdArgs<'_, T> {}

/// Dimensions of a validated forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseFwdDims {
    /// Query tokens.
    pub s_q: usize,
    /// Latent KV rows.
    pub s_kv: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width (512 or 576).
    pub d_qk: usize,
    /// Value width ([`D_V`]).
    pub d_v: usize,
    /// Index entries per token.
    pub topk: usize,
    /// Whether `attn_sink` is given.
    pub has_attn_sink: bool,
    /// Whether `topk_length` is given.
    pub has_topk_length: bool,
}

impl SparseFwdDims {
    /// Shape of `out`: `[s_q, h_q, d_v]`.
    pub fn out_shape(&self) -> [usize; 3] {
        [self.s_q, self.h_q, self.d_v]
    }

    /// Shape of `max_logits` and `lse`: `[s_q, h_q]`.
    pub fn stat_shape(&self) -> [usize; 2] {
        [self.s_q, self.h_q]
    }
}

/// Outputs of the sparse prefill forward.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseFwdOutput<T> {
    /// Attention output `[s_q, h_q, d_v]` bf16.
    pub out: T,
    /// Largest valid logit `[s_q, h_q]` f32.
    pub max_logits: T,
    /// Natural-log sum of exponentials of the valid logits (sink excluded) `[s_q, h_q]` f32.
    pub lse: T,
}

/// Runs the forward on the CPU: validates, gathers the (possibly strided) inputs, runs the f32
/// reference and returns contiguous outputs (`out` rounded to bf16). See [`sparse_fwd_cpu_with`].
pub fn sparse_fwd_cpu(args: &SparseFwdArgs<'_, HostTensor>) -> Result<SparseFwdOutput<HostTensor>> {
    sparse_fwd_cpu_with(args, CancelToken::never())
}

/// [`sparse_fwd_cpu`] that stops with [`crate::Error::Interrupted`] soon after `cancel` is cancelled (it is
/// polled before every query token).
pub fn sparse_fwd_cpu_with(
    args: &SparseFwdArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<SparseFwdOutput<HostTensor>> {
    let dims = validate(args)?;
    let inputs = HostInputs::gather(args, &dims)?;
    let res = sparse_fwd_with::<f32>(&inputs.problem(&dims, args.sm_scale), cancel)?;
    Ok(SparseFwdOutput {
        out: HostTensor::bf16_from_f32(&res.out, &dims.out_shape())?,
        max_logits: HostTensor::from_f32(res.max_logits, &dims.stat_shape())?,
        lse: HostTensor::from_f32(res.lse, &dims.stat_shape())?,
    })
}

/// Runs the forward on the GPU: validates the arguments and the caller-provided outputs (shapes and
/// dtypes per the [module docs](self), everything on `gpu`'s device), checks the kernel's own limits
/// (see [`launch`]) and enqueues the kernel on `gpu`'s stream, with the measured launch choices
/// ([`SparseFwdTuning::default`]). Asynchronous: the outputs are ready once the stream is
/// synchronised.
pub fn sparse_fwd_cuda(
    gpu: &Gpu,
    args: &SparseFwdArgs<'_, DeviceView>,
    out: &SparseFwdOutput<DeviceView>,
) -> Result<()> {
    sparse_fwd_cuda_with(gpu, args, out, &SparseFwdTuning::default())
}

/// [`sparse_fwd_cuda`] with launch choices of the caller's (pipeline, L2 prefetch, cluster launch):
/// each `None` field of `tuning` keeps the measured heuristic. The results are the same up to the
/// order of f32 additions; the speed is not.
pub fn sparse_fwd_cuda_with(
    gpu: &Gpu,
    args: &SparseFwdArgs<'_, DeviceView>,
    out: &SparseFwdOutput<DeviceView>,
    tuning: &SparseFwdTuning,
) -> Result<()> {
    let dims = validate(args)?;
    validate_output(&dims, args.q.location(), out)?;
    launch::launch(gpu, &dims, args, out, tuning)
}

/// The forward's inputs gathered into contiguous host vectors (shared with the backward's CPU path).
///
/// `kv` holds only the rows that a valid entry references (position below the token's clamped `topk_length`,
/// value in `0..s_kv`), in ascending row order, and `indices` point into it (`-1` for every ignored entry). The
/// reference computes the same values on this compacted problem (a KV row's contributions are summed in the
/// same order whatever its number), and a broadcast or huge `kv` costs only the rows used.
pub(crate) struct HostInputs {
    q: Vec<f32>,
    kv: Vec<f32>,
    /// `kv_rows[k]`: the row of the caller's `kv` that compacted row `k` holds (ascending).
    pub(crate) kv_rows: Vec<usize>,
    indices: Vec<i32>,
    attn_sink: Option<Vec<f32>>,
    topk_length: Option<Vec<i32>>,
}

impl HostInputs {
    /// Gathers validated arguments of dimensions `dims`.
    pub(crate) fn gather(
        args: &SparseFwdArgs<'_, HostTensor>,
        dims: &SparseFwdDims,
    ) -> Result<Self> {
        let (s_kv, topk) = (dims.s_kv, dims.topk);
        let mut indices = args.indices.to_i32_vec()?;
        let topk_length = args.topk_length.map(HostTensor::to_i32_vec).transpose()?;
        let row_len = |t: usize| {
            topk_length
                .as_ref()
                .map_or(topk, |len| clamp_topk_length(len[t], topk))
        };
        let valid = |value: i32| usize::try_from(value).ok().filter(|&r| r < s_kv);
        let mut kv_rows = try_with_capacity("sparse_fwd referenced kv rows", indices.len())?;
        for (t, row) in indices.chunks(topk).enumerate() {
            kv_rows.extend(row[..row_len(t)].iter().filter_map(|&v| valid(v)));
        }
        kv_rows.sort_unstable();
        kv_rows.dedup();
        for (t, row) in indices.chunks_mut(topk).enumerate() {
            let len = row_len(t);
            for (j, v) in row.iter_mut().enumerate() {
                let compact = valid(*v)
                    .filter(|_| j < len)
                    .and_then(|r| kv_rows.binary_search(&r).ok());
                // A compacted index is at most the row it stands for (the rows are distinct and ascending), so it
                // fits in i32 as the row did.
                *v = compact.and_then(|k| i32::try_from(k).ok()).unwrap_or(-1);
            }
        }
        Ok(HostInputs {
            q: args.q.to_f32_vec()?,
            kv: args.kv.rows_to_f32_vec(&kv_rows)?,
            kv_rows,
            indices,
            attn_sink: args.attn_sink.map(HostTensor::to_f32_vec).transpose()?,
            topk_length,
        })
    }

    /// The reference problem over these vectors (`s_kv` is the number of compacted rows).
    pub(crate) fn problem(&self, dims: &SparseFwdDims, sm_scale: f32) -> SparseFwdProblem<'_> {
        SparseFwdProblem {
            s_q: dims.s_q,
            s_kv: self.kv_rows.len(),
            h_q: dims.h_q,
            d_qk: dims.d_qk,
            d_v: dims.d_v,
            topk: dims.topk,
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale,
            attn_sink: self.attn_sink.as_deref(),
            topk_length: self.topk_length.as_deref(),
        }
    }
}
