//! Dense MHA prefill over packed variable-length sequences (docs/spec.md section 5): the MHA form of MLA
//! (`(d, d_v) = (192, 128)`) and plain 128-wide heads, GQA, bottom-right causal.
//!
//! Both directions run on the GPU ([`dense_prefill_fwd_cuda`], [`dense_prefill_bwd_cuda`]: the sm_90a kernels of
//! [`launch`]) and on the CPU (the reference, f32 accumulation; [`crate::reference::dense_prefill`]).

pub mod launch;
mod validate;

pub use validate::{
    bwd_accumulator_len, bwd_workspace_shape, bwd_workspace_shape_for, validate, validate_bwd,
    validate_grads, validate_output, DensePrefillDims, HEAD_DIMS,
};

use crate::alloc::try_collect;
use crate::cancel::CancelToken;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::reference::dense_prefill::{self as reference, DensePrefillProblem};
use crate::tensor::{DType, DeviceView, HostData, HostTensor, Location, TensorMeta};
use half::{bf16, f16};

/// Forward arguments.
#[derive(Debug)]
pub struct DensePrefillArgs<'a, T> {
    /// Queries `[total_q, h_q, d]`, bf16 or f16.
    pub q: &'a T,
    /// Keys `[total_k, h_k, d]`, q's dtype.
    pub k: &'a T,
    /// Values `[total_k, h_k, d_v]`, q's dtype.
    pub v: &'a T,
    /// Query row offsets `[b + 1]` i32: 0, non-decreasing, ending at `total_q`.
    pub cu_seqlens_q: &'a T,
    /// Key row offsets `[b + 1]` i32: 0, non-decreasing, ending at `total_k`.
    pub cu_seqlens_k: &'a T,
    /// Logit scale; `None`: `d^-0.5`.
    pub softmax_scale: Option<f32>,
    /// Bottom-right causal mask (query row `r` of a sequence sees key rows `c <= r + s_k - s_q`).
    pub causal: bool,
}

/// Forward outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct DensePrefillOutput<T> {
    /// `[total_q, h_q, d_v]`, q's dtype; 0 for a row that attends to no key.
    pub out: T,
    /// `[h_q, total_q]` f32, natural log; `+inf` for a row that attends to no key.
    pub lse: T,
}

/// Backward arguments: the forward's, its outputs and the incoming gradient.
#[derive(Debug)]
pub struct DensePrefillBwdArgs<'a, T> {
    /// The forward's arguments.
    pub fwd: DensePrefillArgs<'a, T>,
    /// The forward's `out`.
    pub out: &'a T,
    /// Gradient of `out`.
    pub d_out: &'a T,
    /// The forward's `lse`.
    pub lse: &'a T,
}

/// Backward outputs, in the dtype of q.
#[derive(Debug, Clone, PartialEq)]
pub struct DensePrefillGrads<T> {
    /// `[total_q, h_q, d]`.
    pub d_q: T,
    /// `[total_k, h_k, d]`.
    pub d_k: T,
    /// `[total_k, h_k, d_v]`.
    pub d_v: T,
}

/// Options of the GPU backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DensePrefillBwdOptions {
    /// Bitwise-reproducible gradients: the separate schedule only (see `fused`).
    pub deterministic: bool,
    /// The schedule (docs/dense-prefill.md, "Backward"). Fused: one pass computes dK, dV and dQ, adding dQ into an
    /// f32 accumulator in the workspace with bulk reductions whose order varies from run to run (five MMAs per pair
    /// of tiles). Separate: dQ and dK / dV by two kernels that each write their rows once (seven MMAs per pair, no
    /// atomics, deterministic). `None`: the measured choice, fused at `d` 128 and separate at `d` 192 (where the fused
    /// kernel is still 4% slower); `Some(true)` with `deterministic` is refused.
    pub fused: Option<bool>,
}

impl DensePrefillBwdOptions {
    /// Whether the backward of head dimension `d` runs the fused schedule under these options.
    ///
    /// Errors: [`Error::InvalidArgument`] for `fused: Some(true)` with `deterministic`.
    pub fn fused_for(&self, d: usize) -> Result<bool> {
        match (self.deterministic, self.fused) {
            (true, Some(true)) => Err(Error::invalid(
                "options.fused",
                "None or Some(false) with deterministic (the fused schedule adds with atomics)",
                "Some(true)",
            )),
            (true, _) => Ok(false),
            (false, Some(f)) => Ok(f),
            (false, None) => Ok(d == 128),
        }
    }
}

/// Refuses device tensors on a CPU path.
fn expect_host(dims_loc: Location, what: &str) -> Result<()> {
    match dims_loc {
        Location::Host => Ok(()),
        loc => Err(Error::unsupported(
            format!("dense prefill {what} on {loc}"),
            format!("the {what} of this function runs on the CPU"),
        )),
    }
}

/// The backward on the GPU with default options. See [`dense_prefill_bwd_cuda_with`].
pub fn dense_prefill_bwd_cuda(
    gpu: &Gpu,
    args: &DensePrefillBwdArgs<'_, DeviceView>,
    grads: &DensePrefillGrads<DeviceView>,
    workspace: &DeviceView,
) -> Result<()> {
    dense_prefill_bwd_cuda_with(
        gpu,
        args,
        grads,
        workspace,
        &DensePrefillBwdOptions::default(),
    )
}

/// The backward on the GPU: writes `grads` (caller-allocated, see [`validate_grads`]) on `gpu`'s stream, using
/// `workspace` (f32 of [`bwd_workspace_shape`], caller-allocated, contiguous) for `delta` and, unless
/// `options.deterministic`, the f32 dQ accumulator. Asynchronous; allocates nothing and reads no tensor on the host
/// (CUDA-graph safe).
///
/// Errors: those of [`validate_bwd`] and [`validate_grads`], and the kernels' limits ([`launch::lower_bwd`]).
pub fn dense_prefill_bwd_cuda_with(
    gpu: &Gpu,
    args: &DensePrefillBwdArgs<'_, DeviceView>,
    grads: &DensePrefillGrads<DeviceView>,
    workspace: &DeviceView,
    options: &DensePrefillBwdOptions,
) -> Result<()> {
    let dims = validate_bwd(args)?;
    validate_grads(&dims, args.fwd.q.location(), grads, workspace, options)?;
    launch::launch_bwd(gpu, &dims, args, grads, workspace, options)
}

/// The forward on the GPU: writes `out` and `lse` (caller-allocated, see [`validate_output`]) on `gpu`'s stream.
/// Asynchronous (synchronise or download to wait); reads no tensor on the host, so it can be captured into a CUDA
/// graph. Its only allocation is the 4-byte work counter of the persistent CTAs, in stream order (see
/// [`dense_prefill_fwd_cuda_with`] to pass one instead).
///
/// Errors: those of [`validate`] and [`validate_output`], and [`Error::Unsupported`] / [`Error::InvalidArgument`] for
/// the kernel's limits ([`launch`]: 16-byte aligned rows, contiguous offsets and lse rows).
pub fn dense_prefill_fwd_cuda(
    gpu: &Gpu,
    args: &DensePrefillArgs<'_, DeviceView>,
    out: &DensePrefillOutput<DeviceView>,
) -> Result<()> {
    dense_prefill_fwd_cuda_with(gpu, args, out, None)
}

/// [`dense_prefill_fwd_cuda`] with the caller's `workspace` for the work counter: at least
/// [`launch::FWD_WORKSPACE_WORDS`] elements of a contiguous f32 vector on `gpu`'s device (the decodes' workspaces
/// qualify); its first words are zeroed on the stream before the kernel and must not be used by other work running at
/// the same time (a workspace kept per stream serves every call queued on that stream). `None` allocates one for the
/// call.
pub fn dense_prefill_fwd_cuda_with(
    gpu: &Gpu,
    args: &DensePrefillArgs<'_, DeviceView>,
    out: &DensePrefillOutput<DeviceView>,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    let dims = validate(args)?;
    validate_output(&dims, args.q.location(), out)?;
    launch::launch(gpu, &dims, args, out, workspace)
}

/// The reference problem of host arguments, with their values as f32 vectors (kept alive by the caller).
struct HostInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
}

impl HostInputs {
    fn read(args: &DensePrefillArgs<'_, HostTensor>) -> Result<Self> {
        Ok(HostInputs {
            q: args.q.to_f32_vec()?,
            k: args.k.to_f32_vec()?,
            v: args.v.to_f32_vec()?,
            cu_q: args.cu_seqlens_q.to_i32_vec()?,
            cu_k: args.cu_seqlens_k.to_i32_vec()?,
        })
    }

    fn problem(&self, dims: &DensePrefillDims) -> DensePrefillProblem<'_> {
        DensePrefillProblem {
            h_q: dims.h_q,
            h_k: dims.h_k,
            d: dims.d,
            d_v: dims.d_v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            scale: dims.softmax_scale,
            causal: dims.causal,
        }
    }
}

/// f32 values as a host tensor of `dtype` (bf16 or f16).
fn pack(what: &str, values: &[f32], dtype: DType, shape: &[usize]) -> Result<HostTensor> {
    let n = values.len();
    let data = match dtype {
        DType::F16 => HostData::F16(try_collect(
            what,
            n,
            values.iter().map(|&v| f16::from_f32(v)),
        )?),
        _ => HostData::Bf16(try_collect(
            what,
            n,
            values.iter().map(|&v| bf16::from_f32(v)),
        )?),
    };
    HostTensor::new(data, shape)
}

/// The forward on the CPU. See [`dense_prefill_fwd_cpu_with`].
pub fn dense_prefill_fwd_cpu(
    args: &DensePrefillArgs<'_, HostTensor>,
) -> Result<DensePrefillOutput<HostTensor>> {
    dense_prefill_fwd_cpu_with(args, CancelToken::never())
}

/// The forward on the CPU (f32 accumulation), stopping with [`Error::Interrupted`] soon after `cancel` is cancelled.
///
/// Allocates f32 copies of q, k and v, the reference's results (see
/// [`reference::dense_prefill_fwd`]) and the returned `out` (q's dtype) and `lse` (f32).
pub fn dense_prefill_fwd_cpu_with(
    args: &DensePrefillArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<DensePrefillOutput<HostTensor>> {
    let dims = validate(args)?;
    expect_host(args.q.location(), "forward")?;
    let inputs = HostInputs::read(args)?;
    let res = reference::dense_prefill_fwd::<f32>(&inputs.problem(&dims), cancel)?;
    Ok(DensePrefillOutput {
        out: pack(
            "dense prefill out",
            &res.out,
            dims.dtype,
            &[dims.total_q, dims.h_q, dims.d_v],
        )?,
        lse: HostTensor::from_f32(res.lse, &[dims.h_q, dims.total_q])?,
    })
}

/// The backward on the CPU. See [`dense_prefill_bwd_cpu_with`].
pub fn dense_prefill_bwd_cpu(
    args: &DensePrefillBwdArgs<'_, HostTensor>,
) -> Result<DensePrefillGrads<HostTensor>> {
    dense_prefill_bwd_cpu_with(args, CancelToken::never())
}

/// The backward on the CPU (f32 accumulation) from the forward's `out` and `lse`, stopping with
/// [`Error::Interrupted`] soon after `cancel` is cancelled.
///
/// Allocates f32 copies of every input, the reference's gradients (see [`reference::dense_prefill_bwd`]) and
/// the returned gradients in q's dtype.
pub fn dense_prefill_bwd_cpu_with(
    args: &DensePrefillBwdArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<DensePrefillGrads<HostTensor>> {
    let dims = validate_bwd(args)?;
    expect_host(args.fwd.q.location(), "backward")?;
    let inputs = HostInputs::read(&args.fwd)?;
    let (out, d_out, lse) = (
        args.out.to_f32_vec()?,
        args.d_out.to_f32_vec()?,
        args.lse.to_f32_vec()?,
    );
    let g =
        reference::dense_prefill_bwd::<f32>(&inputs.problem(&dims), &out, &lse, &d_out, cancel)?;
    let t = dims.dtype;
    Ok(DensePrefillGrads {
        d_q: pack(
            "dense prefill d_q",
            &g.d_q,
            t,
            &[dims.total_q, dims.h_q, dims.d],
        )?,
        d_k: pack(
            "dense prefill d_k",
            &g.d_k,
            t,
            &[dims.total_k, dims.h_k, dims.d],
        )?,
        d_v: pack(
            "dense prefill d_v",
            &g.d_v,
            t,
            &[dims.total_k, dims.h_k, dims.d_v],
        )?,
    })
}
