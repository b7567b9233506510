//! The entry points of `flashmla._native`, two per op:
//!
//! * `<op>_check(inputs...)`: validates the inputs' metadata (never reads data) and returns the dimensions the
//!   Python layer needs to allocate outputs. Used by the real implementation and by the fake (meta)
//!   implementation under `torch.compile`, so both raise the same errors.
//! * `<op>(inputs..., outputs..., stream)`: runs the op into torch-allocated outputs. Host tensors run the CPU
//!   reference (inputs copied in, results copied into the outputs); CUDA tensors run the kernel on `stream`
//!   (torch's current stream of the tensors' device) with no copy and no synchronisation.
//!
//! The GIL is released while an op runs; a CPU run goes through [`run_cpu`], so that Ctrl-C stops it
//! (`KeyboardInterrupt`). Every entry point goes through [`guard`]: library errors become the matching Python
//! exceptions and no panic crosses into Python.
//!
//! Wiring a new GPU kernel is one function below (`<op>_gpu`): call `flashmla::ops::<family>::<op>_cuda` with the
//! handle, the argument views and the output views.

use crate::errors::guard;
use crate::gpu::gpu_for;
use crate::interrupt::run_cpu;
use crate::tensor::{parse_dtype, placement, Desc, RawDesc};
use flashmla::cuda::Gpu;
use flashmla::ops::decode::{self, DecodeOutput, DenseDecodeArgs, ExtraKvArgs, SparseDecodeArgs};
use flashmla::ops::kv_quant::{
    self, DequantizeArgs, DequantizeOutput, QuantizeArgs, QuantizeOutput,
};
use flashmla::ops::sparse_bwd::{self as bwd_op, SparseBwdArgs, SparseBwdOutput};
use flashmla::ops::sparse_fwd::{self as fwd_op, SparseFwdArgs, SparseFwdOutput};
use flashmla::{DeviceView, Error, HostTensor, Location, Result};
use pyo3::prelude::*;

/// Host copies of optional inputs.
fn host_opt(d: &Option<Desc>) -> Result<Option<HostTensor>> {
    d.as_ref().map(Desc::to_host).transpose()
}

/// Device views of optional inputs.
fn device_opt(d: &Option<Desc>) -> Result<Option<DeviceView>> {
    d.as_ref().map(Desc::to_device).transpose()
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse prefill forward

/// The sparse forward's input descriptors.
struct FwdDescs {
    q: Desc,
    kv: Desc,
    indices: Desc,
    attn_sink: Option<Desc>,
    topk_length: Option<Desc>,
}

impl FwdDescs {
    fn new(
        q: &RawDesc,
        kv: &RawDesc,
        indices: &RawDesc,
        attn_sink: &Option<RawDesc>,
        topk_length: &Option<RawDesc>,
    ) -> Result<Self> {
        Ok(FwdDescs {
            q: Desc::new("q", q)?,
            kv: Desc::new("kv", kv)?,
            indices: Desc::new("indices", indices)?,
            attn_sink: Desc::opt("attn_sink", attn_sink)?,
            topk_length: Desc::opt("topk_length", topk_length)?,
        })
    }

    fn args(&self, sm_scale: f32) -> SparseFwdArgs<'_, Desc> {
        SparseFwdArgs {
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale,
            attn_sink: self.attn_sink.as_ref(),
            topk_length: self.topk_length.as_ref(),
        }
    }
}

/// Validates a sparse forward and returns `(s_q, s_kv, h_q, d_qk, d_v, topk)`.
#[pyfunction]
#[pyo3(signature = (q, kv, indices, sm_scale, attn_sink=None, topk_length=None))]
pub fn sparse_fwd_check(
    q: RawDesc,
    kv: RawDesc,
    indices: RawDesc,
    sm_scale: f32,
    attn_sink: Option<RawDesc>,
    topk_length: Option<RawDesc>,
) -> PyResult<(usize, usize, usize, usize, usize, usize)> {
    guard("sparse_fwd", || {
        let d = FwdDescs::new(&q, &kv, &indices, &attn_sink, &topk_length)?;
        let dims = fwd_op::validate(&d.args(sm_scale))?;
        Ok((
            dims.s_q, dims.s_kv, dims.h_q, dims.d_qk, dims.d_v, dims.topk,
        ))
    })
}

/// Runs the sparse forward into `out [s_q, h_q, d_v]` bf16, `max_logits` and `lse [s_q, h_q]` f32.
#[pyfunction]
#[pyo3(signature = (q, kv, indices, sm_scale, attn_sink, topk_length, out, max_logits, lse, stream=0))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_fwd(
    py: Python<'_>,
    q: RawDesc,
    kv: RawDesc,
    indices: RawDesc,
    sm_scale: f32,
    attn_sink: Option<RawDesc>,
    topk_length: Option<RawDesc>,
    out: RawDesc,
    max_logits: RawDesc,
    lse: RawDesc,
    stream: u64,
) -> PyResult<()> {
    let (d, outs) = guard("sparse_fwd", || {
        let d = FwdDescs::new(&q, &kv, &indices, &attn_sink, &topk_length)?;
        let outs = SparseFwdOutput {
            out: Desc::new("out", &out)?,
            max_logits: Desc::new("max_logits", &max_logits)?,
            lse: Desc::new("lse", &lse)?,
        };
        let dims = fwd_op::validate(&d.args(sm_scale))?;
        fwd_op::validate_output(&dims, placement(&d.q), &outs)?;
        Ok((d, outs))
    })?;
    match placement(&d.q) {
        Location::Host => run_cpu(py, "sparse_fwd", |cancel| {
            let (q, kv, idx) = (d.q.to_host()?, d.kv.to_host()?, d.indices.to_host()?);
            let (sink, len) = (host_opt(&d.attn_sink)?, host_opt(&d.topk_length)?);
            let args = SparseFwdArgs {
                q: &q,
                kv: &kv,
                indices: &idx,
                sm_scale,
                attn_sink: sink.as_ref(),
                topk_length: len.as_ref(),
            };
            let res = fwd_op::sparse_fwd_cpu_with(&args, cancel)?;
            outs.out.write_host(&res.out)?;
            outs.max_logits.write_host(&res.max_logits)?;
            outs.lse.write_host(&res.lse)
        }),
        Location::Cuda(device) => py.detach(|| {
            guard("sparse_fwd", || {
                let (q, kv, idx) = (d.q.to_device()?, d.kv.to_device()?, d.indices.to_device()?);
                let (sink, len) = (device_opt(&d.attn_sink)?, device_opt(&d.topk_length)?);
                let views = SparseFwdOutput {
                    out: outs.out.to_device()?,
                    max_logits: outs.max_logits.to_device()?,
                    lse: outs.lse.to_device()?,
                };
                let args = SparseFwdArgs {
                    q: &q,
                    kv: &kv,
                    indices: &idx,
                    sm_scale,
                    attn_sink: sink.as_ref(),
                    topk_length: len.as_ref(),
                };
                sparse_fwd_gpu(&gpu_for(device, stream)?, &args, &views)
            })
        }),
    }
}

/// GPU path of the sparse forward (shapes the kernel does not cover come back as `Unsupported`).
fn sparse_fwd_gpu(
    gpu: &Gpu,
    args: &SparseFwdArgs<'_, DeviceView>,
    out: &SparseFwdOutput<DeviceView>,
) -> Result<()> {
    fwd_op::sparse_fwd_cuda(gpu, args, out)
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse prefill backward

/// The sparse backward's input descriptors.
struct BwdDescs {
    fwd: FwdDescs,
    out: Desc,
    d_out: Desc,
    lse: Desc,
}

impl BwdDescs {
    fn args(&self, sm_scale: f32, d_kv_dtype: flashmla::DType) -> SparseBwdArgs<'_, Desc> {
        SparseBwdArgs {
            q: &self.fwd.q,
            kv: &self.fwd.kv,
            out: &self.out,
            d_out: &self.d_out,
            indices: &self.fwd.indices,
            lse: &self.lse,
            sm_scale,
            attn_sink: self.fwd.attn_sink.as_ref(),
            topk_length: self.fwd.topk_length.as_ref(),
            d_kv_dtype,
        }
    }
}

/// Parses the sparse backward's inputs.
#[allow(clippy::too_many_arguments)]
fn bwd_descs(
    q: &RawDesc,
    kv: &RawDesc,
    out: &RawDesc,
    d_out: &RawDesc,
    indices: &RawDesc,
    lse: &RawDesc,
    attn_sink: &Option<RawDesc>,
    topk_length: &Option<RawDesc>,
) -> Result<BwdDescs> {
    Ok(BwdDescs {
        fwd: FwdDescs::new(q, kv, indices, attn_sink, topk_length)?,
        out: Desc::new("out", out)?,
        d_out: Desc::new("d_out", d_out)?,
        lse: Desc::new("lse", lse)?,
    })
}

/// `(s_q, s_kv, h_q, d_qk, d_v, topk, ws_rows, ws_cols)` of [`sparse_bwd_check`].
type BwdCheck = (usize, usize, usize, usize, usize, usize, usize, usize);

/// Validates a sparse backward and returns `(s_q, s_kv, h_q, d_qk, d_v, topk, ws_rows, ws_cols)`: the dims and
/// the shape of the f32 workspace a GPU run needs when `d_kv` is bf16 (the caller allocates it so that torch's
/// allocator owns it); `d_kv_dtype` is `"bf16"` or `"f32"`.
#[pyfunction]
#[pyo3(signature = (q, kv, out, d_out, indices, lse, sm_scale, attn_sink=None, topk_length=None, d_kv_dtype="bf16"))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_bwd_check(
    q: RawDesc,
    kv: RawDesc,
    out: RawDesc,
    d_out: RawDesc,
    indices: RawDesc,
    lse: RawDesc,
    sm_scale: f32,
    attn_sink: Option<RawDesc>,
    topk_length: Option<RawDesc>,
    d_kv_dtype: &str,
) -> PyResult<BwdCheck> {
    guard("sparse_bwd", || {
        let d = bwd_descs(
            &q,
            &kv,
            &out,
            &d_out,
            &indices,
            &lse,
            &attn_sink,
            &topk_length,
        )?;
        let d_kv_dtype = parse_dtype("d_kv", d_kv_dtype, &bwd_op::D_KV_DTYPES)?;
        let dims = bwd_op::validate(&d.args(sm_scale, d_kv_dtype))?;
        let f = dims.fwd;
        let [ws_rows, ws_cols] =
            bwd_op::workspace_shape(&dims, &bwd_op::SparseBwdOptions::default());
        Ok((
            f.s_q, f.s_kv, f.h_q, f.d_qk, f.d_v, f.topk, ws_rows, ws_cols,
        ))
    })
}

/// Runs the sparse backward into `d_q [s_q, h_q, d_qk]` bf16, `d_kv [s_kv, 1, d_qk]` (bf16 or f32: its dtype
/// picks the variant), `delta [s_q, h_q]` f32 and, with a sink, `d_attn_sink [h_q]` f32.
#[pyfunction]
#[pyo3(signature = (
    q, kv, out, d_out, indices, lse, sm_scale, attn_sink, topk_length, d_q, d_kv, delta, d_attn_sink, stream=0,
    workspace=None
))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_bwd(
    py: Python<'_>,
    q: RawDesc,
    kv: RawDesc,
    out: RawDesc,
    d_out: RawDesc,
    indices: RawDesc,
    lse: RawDesc,
    sm_scale: f32,
    attn_sink: Option<RawDesc>,
    topk_length: Option<RawDesc>,
    d_q: RawDesc,
    d_kv: RawDesc,
    delta: RawDesc,
    d_attn_sink: Option<RawDesc>,
    stream: u64,
    workspace: Option<RawDesc>,
) -> PyResult<()> {
    let (d, outs, d_kv_dtype) = guard("sparse_bwd", || {
        let d = bwd_descs(
            &q,
            &kv,
            &out,
            &d_out,
            &indices,
            &lse,
            &attn_sink,
            &topk_length,
        )?;
        let outs = SparseBwdOutput {
            d_q: Desc::new("d_q", &d_q)?,
            d_kv: Desc::new("d_kv", &d_kv)?,
            delta: Desc::new("delta", &delta)?,
            d_attn_sink: Desc::opt("d_attn_sink", &d_attn_sink)?,
        };
        let d_kv_dtype = flashmla::TensorMeta::dtype(&outs.d_kv);
        let dims = bwd_op::validate(&d.args(sm_scale, d_kv_dtype))?;
        bwd_op::validate_output(&dims, placement(&d.fwd.q), &outs)?;
        Ok((d, outs, d_kv_dtype))
    })?;
    match placement(&d.fwd.q) {
        Location::Host => run_cpu(py, "sparse_bwd", |cancel| {
            let f = &d.fwd;
            let (q, kv, idx) = (f.q.to_host()?, f.kv.to_host()?, f.indices.to_host()?);
            let (sink, len) = (host_opt(&f.attn_sink)?, host_opt(&f.topk_length)?);
            let (out, d_out, lse) = (d.out.to_host()?, d.d_out.to_host()?, d.lse.to_host()?);
            let res = bwd_op::sparse_bwd_cpu_with(
                &SparseBwdArgs {
                    q: &q,
                    kv: &kv,
                    out: &out,
                    d_out: &d_out,
                    indices: &idx,
                    lse: &lse,
                    sm_scale,
                    attn_sink: sink.as_ref(),
                    topk_length: len.as_ref(),
                    d_kv_dtype,
                },
                cancel,
            )?;
            outs.d_q.write_host(&res.d_q)?;
            outs.d_kv.write_host(&res.d_kv)?;
            outs.delta.write_host(&res.delta)?;
            match (&outs.d_attn_sink, &res.d_attn_sink) {
                (Some(dst), Some(v)) => dst.write_host(v),
                _ => Ok(()),
            }
        }),
        Location::Cuda(device) => py.detach(|| {
            guard("sparse_bwd", || {
                let f = &d.fwd;
                let (q, kv, idx) = (f.q.to_device()?, f.kv.to_device()?, f.indices.to_device()?);
                let (sink, len) = (device_opt(&f.attn_sink)?, device_opt(&f.topk_length)?);
                let (out, d_out, lse) =
                    (d.out.to_device()?, d.d_out.to_device()?, d.lse.to_device()?);
                let views = SparseBwdOutput {
                    d_q: outs.d_q.to_device()?,
                    d_kv: outs.d_kv.to_device()?,
                    delta: outs.delta.to_device()?,
                    d_attn_sink: device_opt(&outs.d_attn_sink)?,
                };
                let args = SparseBwdArgs {
                    q: &q,
                    kv: &kv,
                    out: &out,
                    d_out: &d_out,
                    indices: &idx,
                    lse: &lse,
                    sm_scale,
                    attn_sink: sink.as_ref(),
                    topk_length: len.as_ref(),
                    d_kv_dtype,
                };
                let ws = device_opt(&Desc::opt("workspace", &workspace)?)?;
                bwd_op::sparse_bwd_cuda_with(
                    &gpu_for(device, stream)?,
                    &args,
                    &views,
                    &bwd_op::SparseBwdOptions::default(),
                    ws.as_ref(),
                )
            })
        }),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode

/// The dense decode's input descriptors.
struct DenseDescs {
    q: Desc,
    k_cache: Desc,
    block_table: Desc,
    cache_seqlens: Desc,
    attn_sink: Option<Desc>,
}

impl DenseDescs {
    fn new(
        q: &RawDesc,
        k_cache: &RawDesc,
        block_table: &RawDesc,
        cache_seqlens: &RawDesc,
        attn_sink: &Option<RawDesc>,
    ) -> Result<Self> {
        Ok(DenseDescs {
            q: Desc::new("q", q)?,
            k_cache: Desc::new("k_cache", k_cache)?,
            block_table: Desc::new("block_table", block_table)?,
            cache_seqlens: Desc::new("cache_seqlens", cache_seqlens)?,
            attn_sink: Desc::opt("attn_sink", attn_sink)?,
        })
    }

    fn args(&self, softmax_scale: Option<f32>, causal: bool) -> DenseDecodeArgs<'_, Desc> {
        DenseDecodeArgs {
            q: &self.q,
            k_cache: &self.k_cache,
            block_table: &self.block_table,
            cache_seqlens: &self.cache_seqlens,
            softmax_scale,
            causal,
            attn_sink: self.attn_sink.as_ref(),
        }
    }
}

/// Validates a dense decode and returns `(b, s_q, h_q, d_v)` (`out` has q's dtype).
#[pyfunction]
#[pyo3(signature = (q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=false, attn_sink=None))]
pub fn decode_dense_check(
    q: RawDesc,
    k_cache: RawDesc,
    block_table: RawDesc,
    cache_seqlens: RawDesc,
    softmax_scale: Option<f32>,
    causal: bool,
    attn_sink: Option<RawDesc>,
) -> PyResult<(usize, usize, usize, usize)> {
    guard("decode_dense", || {
        let d = DenseDescs::new(&q, &k_cache, &block_table, &cache_seqlens, &attn_sink)?;
        let dims = decode::validate_dense(&d.args(softmax_scale, causal))?;
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v))
    })
}

/// Validates a dense decode and returns `(b, s_q, h_q, d_v, workspace_words)`: the f32 words of workspace a GPU
/// run needs (the caller allocates it, so that torch's caching allocator and CUDA-graph pools serve it), 0 on the
/// host.
#[pyfunction]
#[pyo3(signature = (q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=false, attn_sink=None,
    batch_invariant=false))]
#[allow(clippy::too_many_arguments)]
pub fn decode_dense_plan(
    q: RawDesc,
    k_cache: RawDesc,
    block_table: RawDesc,
    cache_seqlens: RawDesc,
    softmax_scale: Option<f32>,
    causal: bool,
    attn_sink: Option<RawDesc>,
    batch_invariant: bool,
) -> PyResult<(usize, usize, usize, usize, usize)> {
    guard("decode_dense", || {
        let d = DenseDescs::new(&q, &k_cache, &block_table, &cache_seqlens, &attn_sink)?;
        let dims = decode::validate_dense(&d.args(softmax_scale, causal))?;
        let words = match placement(&d.q) {
            Location::Cuda(device) => {
                let sms = gpu_for(device, 0)?.info().sm_count as usize;
                decode::launch::dense_workspace_words(&dims, &decode_options(batch_invariant), sms)?
            }
            _ => 0,
        };
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v, words))
    })
}

/// The GPU decode's options from the Python flags.
fn decode_options(batch_invariant: bool) -> decode::DecodeOptions {
    decode::DecodeOptions {
        batch_invariant,
        ..decode::DecodeOptions::default()
    }
}

/// Runs a dense decode into `out [b, s_q, h_q, d_v]` (q's dtype) and `lse [b, h_q, s_q]` f32. On CUDA,
/// `workspace` is an f32 vector of the words [`decode_dense_plan`] returned.
#[pyfunction]
#[pyo3(signature = (q, k_cache, block_table, cache_seqlens, softmax_scale, causal, attn_sink, out, lse, stream=0,
    workspace=None, batch_invariant=false))]
#[allow(clippy::too_many_arguments)]
pub fn decode_dense(
    py: Python<'_>,
    q: RawDesc,
    k_cache: RawDesc,
    block_table: RawDesc,
    cache_seqlens: RawDesc,
    softmax_scale: Option<f32>,
    causal: bool,
    attn_sink: Option<RawDesc>,
    out: RawDesc,
    lse: RawDesc,
    stream: u64,
    workspace: Option<RawDesc>,
    batch_invariant: bool,
) -> PyResult<()> {
    let (d, outs) = guard("decode_dense", || {
        let d = DenseDescs::new(&q, &k_cache, &block_table, &cache_seqlens, &attn_sink)?;
        let outs = DecodeOutput {
            out: Desc::new("out", &out)?,
            lse: Desc::new("lse", &lse)?,
        };
        decode::validate_dense(&d.args(softmax_scale, causal))?;
        Ok((d, outs))
    })?;
    match placement(&d.q) {
        Location::Host => run_cpu(py, "decode_dense", |cancel| {
            let (q, k, bt, sl) = (
                d.q.to_host()?,
                d.k_cache.to_host()?,
                d.block_table.to_host()?,
                d.cache_seqlens.to_host()?,
            );
            let sink = host_opt(&d.attn_sink)?;
            let res = decode::decode_dense_cpu_with(
                &DenseDecodeArgs {
                    q: &q,
                    k_cache: &k,
                    block_table: &bt,
                    cache_seqlens: &sl,
                    softmax_scale,
                    causal,
                    attn_sink: sink.as_ref(),
                },
                cancel,
            )?;
            outs.out.write_host(&res.out)?;
            outs.lse.write_host(&res.lse)
        }),
        Location::Cuda(device) => py.detach(|| {
            guard("decode_dense", || {
                let (q, k, bt, sl) = (
                    d.q.to_device()?,
                    d.k_cache.to_device()?,
                    d.block_table.to_device()?,
                    d.cache_seqlens.to_device()?,
                );
                let sink = device_opt(&d.attn_sink)?;
                let args = DenseDecodeArgs {
                    q: &q,
                    k_cache: &k,
                    block_table: &bt,
                    cache_seqlens: &sl,
                    softmax_scale,
                    causal,
                    attn_sink: sink.as_ref(),
                };
                let views = DecodeOutput {
                    out: outs.out.to_device()?,
                    lse: outs.lse.to_device()?,
                };
                let ws = device_opt(&Desc::opt("workspace", &workspace)?)?;
                decode::decode_dense_cuda(
                    &gpu_for(device, stream)?,
                    &args,
                    &views,
                    &decode_options(batch_invariant),
                    ws.as_ref(),
                )
            })
        }),
    }
}

/// The sparse decode's input descriptors.
struct SparseDecodeDescs {
    q: Desc,
    k_cache: Desc,
    indices: Desc,
    topk_length: Option<Desc>,
    attn_sink: Option<Desc>,
    extra: Option<(Desc, Desc, Option<Desc>)>,
}

impl SparseDecodeDescs {
    #[allow(clippy::too_many_arguments)]
    fn new(
        q: &RawDesc,
        k_cache: &RawDesc,
        indices: &RawDesc,
        topk_length: &Option<RawDesc>,
        attn_sink: &Option<RawDesc>,
        extra_k_cache: &Option<RawDesc>,
        extra_indices: &Option<RawDesc>,
        extra_topk_length: &Option<RawDesc>,
    ) -> Result<Self> {
        let extra = match (extra_k_cache, extra_indices) {
            (Some(c), Some(i)) => Some((
                Desc::new("extra_k_cache", c)?,
                Desc::new("extra_indices", i)?,
                Desc::opt("extra_topk_length", extra_topk_length)?,
            )),
            (None, None) if extra_topk_length.is_none() => None,
            _ => return Err(Error::invalid(
                "extra_k_cache",
                "extra_k_cache and extra_indices given together (extra_topk_length only with them)",
                "only some of them",
            )),
        };
        Ok(SparseDecodeDescs {
            q: Desc::new("q", q)?,
            k_cache: Desc::new("k_cache", k_cache)?,
            indices: Desc::new("indices", indices)?,
            topk_length: Desc::opt("topk_length", topk_length)?,
            attn_sink: Desc::opt("attn_sink", attn_sink)?,
            extra,
        })
    }

    fn args(&self, softmax_scale: Option<f32>) -> SparseDecodeArgs<'_, Desc> {
        SparseDecodeArgs {
            q: &self.q,
            k_cache: &self.k_cache,
            indices: &self.indices,
            topk_length: self.topk_length.as_ref(),
            softmax_scale,
            attn_sink: self.attn_sink.as_ref(),
            extra: self
                .extra
                .as_ref()
                .map(|(k_cache, indices, topk_length)| ExtraKvArgs {
                    k_cache,
                    indices,
                    topk_length: topk_length.as_ref(),
                }),
        }
    }
}

/// Validates a sparse FP8 decode and returns `(b, s_q, h_q, d_v)` (`out` is bf16).
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None
))]
#[allow(clippy::too_many_arguments)]
pub fn decode_sparse_check(
    q: RawDesc,
    k_cache: RawDesc,
    indices: RawDesc,
    topk_length: Option<RawDesc>,
    softmax_scale: Option<f32>,
    attn_sink: Option<RawDesc>,
    extra_k_cache: Option<RawDesc>,
    extra_indices: Option<RawDesc>,
    extra_topk_length: Option<RawDesc>,
) -> PyResult<(usize, usize, usize, usize)> {
    guard("decode_sparse", || {
        let d = SparseDecodeDescs::new(
            &q,
            &k_cache,
            &indices,
            &topk_length,
            &attn_sink,
            &extra_k_cache,
            &extra_indices,
            &extra_topk_length,
        )?;
        let dims = decode::validate_sparse(&d.args(softmax_scale))?;
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v))
    })
}

/// Validates a sparse FP8 decode and returns `(b, s_q, h_q, d_v, workspace_words)`: the f32 words of workspace a
/// GPU run needs (allocated by the caller, as for the dense decode), 0 on the host.
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None, batch_invariant=false
))]
#[allow(clippy::too_many_arguments)]
pub fn decode_sparse_plan(
    q: RawDesc,
    k_cache: RawDesc,
    indices: RawDesc,
    topk_length: Option<RawDesc>,
    softmax_scale: Option<f32>,
    attn_sink: Option<RawDesc>,
    extra_k_cache: Option<RawDesc>,
    extra_indices: Option<RawDesc>,
    extra_topk_length: Option<RawDesc>,
    batch_invariant: bool,
) -> PyResult<(usize, usize, usize, usize, usize)> {
    guard("decode_sparse", || {
        let d = SparseDecodeDescs::new(
            &q,
            &k_cache,
            &indices,
            &topk_length,
            &attn_sink,
            &extra_k_cache,
            &extra_indices,
            &extra_topk_length,
        )?;
        let dims = decode::validate_sparse(&d.args(softmax_scale))?;
        let words = match placement(&d.q) {
            Location::Cuda(device) => {
                let sms = gpu_for(device, 0)?.info().sm_count as usize;
                decode::launch::sparse_workspace_words(
                    &dims,
                    &decode_options(batch_invariant),
                    sms,
                )?
            }
            _ => 0,
        };
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v, words))
    })
}

/// Runs a sparse FP8 decode into `out [b, s_q, h_q, d_v]` bf16 and `lse [b, h_q, s_q]` f32. On CUDA,
/// `workspace` is an f32 vector of the words [`decode_sparse_plan`] returned.
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
    out, lse, stream=0, workspace=None, batch_invariant=false
))]
#[allow(clippy::too_many_arguments)]
pub fn decode_sparse(
    py: Python<'_>,
    q: RawDesc,
    k_cache: RawDesc,
    indices: RawDesc,
    topk_length: Option<RawDesc>,
    softmax_scale: Option<f32>,
    attn_sink: Option<RawDesc>,
    extra_k_cache: Option<RawDesc>,
    extra_indices: Option<RawDesc>,
    extra_topk_length: Option<RawDesc>,
    out: RawDesc,
    lse: RawDesc,
    stream: u64,
    workspace: Option<RawDesc>,
    batch_invariant: bool,
) -> PyResult<()> {
    let (d, outs) = guard("decode_sparse", || {
        let d = SparseDecodeDescs::new(
            &q,
            &k_cache,
            &indices,
            &topk_length,
            &attn_sink,
            &extra_k_cache,
            &extra_indices,
            &extra_topk_length,
        )?;
        let outs = DecodeOutput {
            out: Desc::new("out", &out)?,
            lse: Desc::new("lse", &lse)?,
        };
        decode::validate_sparse(&d.args(softmax_scale))?;
        Ok((d, outs))
    })?;
    match placement(&d.q) {
        Location::Host => run_cpu(py, "decode_sparse", |cancel| {
            let (q, k, idx) = (d.q.to_host()?, d.k_cache.to_host()?, d.indices.to_host()?);
            let (len, sink) = (host_opt(&d.topk_length)?, host_opt(&d.attn_sink)?);
            let extra = match &d.extra {
                Some((c, i, l)) => Some((c.to_host()?, i.to_host()?, host_opt(l)?)),
                None => None,
            };
            let res = decode::decode_sparse_cpu_with(
                &SparseDecodeArgs {
                    q: &q,
                    k_cache: &k,
                    indices: &idx,
                    topk_length: len.as_ref(),
                    softmax_scale,
                    attn_sink: sink.as_ref(),
                    extra: extra
                        .as_ref()
                        .map(|(k_cache, indices, topk_length)| ExtraKvArgs {
                            k_cache,
                            indices,
                            topk_length: topk_length.as_ref(),
                        }),
                },
                cancel,
            )?;
            outs.out.write_host(&res.out)?;
            outs.lse.write_host(&res.lse)
        }),
        Location::Cuda(device) => py.detach(|| {
            guard("decode_sparse", || {
                let (q, k, idx) = (
                    d.q.to_device()?,
                    d.k_cache.to_device()?,
                    d.indices.to_device()?,
                );
                let (len, sink) = (device_opt(&d.topk_length)?, device_opt(&d.attn_sink)?);
                let extra = match &d.extra {
                    Some((c, i, l)) => Some((c.to_device()?, i.to_device()?, device_opt(l)?)),
                    None => None,
                };
                let args = SparseDecodeArgs {
                    q: &q,
                    k_cache: &k,
                    indices: &idx,
                    topk_length: len.as_ref(),
                    softmax_scale,
                    attn_sink: sink.as_ref(),
                    extra: extra
                        .as_ref()
                        .map(|(k_cache, indices, topk_length)| ExtraKvArgs {
                            k_cache,
                            indices,
                            topk_length: topk_length.as_ref(),
                        }),
                };
                let views = DecodeOutput {
                    out: outs.out.to_device()?,
                    lse: outs.lse.to_device()?,
                };
                let ws = device_opt(&Desc::opt("workspace", &workspace)?)?;
                decode::decode_sparse_cuda(
                    &gpu_for(device, stream)?,
                    &args,
                    &views,
                    &decode_options(batch_invariant),
                    ws.as_ref(),
                )
            })
        }),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// FP8 KV-cache quantise / dequantise

/// Validates a quantise input and returns the packed cache shape `(num_blocks, page_size, 1, bytes_per_token)`.
#[pyfunction]
pub fn kv_quantize_check(kv: RawDesc) -> PyResult<(usize, usize, usize, usize)> {
    guard("kv_quantize", || {
        let kv = Desc::new("kv", &kv)?;
        let [a, b, c, d] = kv_quant::validate_quantize(&QuantizeArgs { kv: &kv })?.cache_shape();
        Ok((a, b, c, d))
    })
}

/// Quantises `kv` into `cache` (u8 or f8e4m3, any valid block stride; the bytes between blocks keep their
/// values).
#[pyfunction]
#[pyo3(signature = (kv, cache, stream=0))]
pub fn kv_quantize(py: Python<'_>, kv: RawDesc, cache: RawDesc, stream: u64) -> PyResult<()> {
    py.detach(|| {
        guard("kv_quantize", || {
            let (kv, cache) = (Desc::new("kv", &kv)?, Desc::new("cache", &cache)?);
            let dims = kv_quant::validate_quantize(&QuantizeArgs { kv: &kv })?;
            kv_quant::validate_quantize_output(
                &dims,
                &QuantizeOutput {
                    cache: cache.clone(),
                },
            )?;
            match placement(&kv) {
                Location::Host => {
                    let host_kv = kv.to_host()?;
                    let filled = kv_quant::quantize_cpu_into(
                        &QuantizeArgs { kv: &host_kv },
                        cache.to_host()?,
                    )?;
                    cache.write_host(&filled)
                }
                Location::Cuda(device) => kv_quant::quantize_cuda(
                    &gpu_for(device, stream)?,
                    &QuantizeArgs {
                        kv: &kv.to_device()?,
                    },
                    &QuantizeOutput {
                        cache: cache.to_device()?,
                    },
                ),
            }
        })
    })
}

/// Validates a dequantise input and returns the values' shape `(num_blocks, page_size, 1, d_qk)`.
#[pyfunction]
pub fn kv_dequantize_check(cache: RawDesc) -> PyResult<(usize, usize, usize, usize)> {
    guard("kv_dequantize", || {
        let cache = Desc::new("cache", &cache)?;
        let [a, b, c, d] =
            kv_quant::validate_dequantize(&DequantizeArgs { cache: &cache })?.kv_shape();
        Ok((a, b, c, d))
    })
}

/// Dequantises `cache` into `kv [num_blocks, page_size, 1, d_qk]` bf16.
#[pyfunction]
#[pyo3(signature = (cache, kv, stream=0))]
pub fn kv_dequantize(py: Python<'_>, cache: RawDesc, kv: RawDesc, stream: u64) -> PyResult<()> {
    py.detach(|| {
        guard("kv_dequantize", || {
            let (cache, kv) = (Desc::new("cache", &cache)?, Desc::new("kv", &kv)?);
            let dims = kv_quant::validate_dequantize(&DequantizeArgs { cache: &cache })?;
            kv_quant::validate_dequantize_output(&dims, &DequantizeOutput { kv: kv.clone() })?;
            match placement(&cache) {
                Location::Host => {
                    let host_cache = cache.to_host()?;
                    let res = kv_quant::dequantize_cpu(&DequantizeArgs { cache: &host_cache })?;
                    kv.write_host(&res.kv)
                }
                Location::Cuda(device) => kv_quant::dequantize_cuda(
                    &gpu_for(device, stream)?,
                    &DequantizeArgs {
                        cache: &cache.to_device()?,
                    },
                    &DequantizeOutput {
                        kv: kv.to_device()?,
                    },
                ),
            }
        })
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Build information

/// Every kernel family with whether its cubin is embedded in this build: `[(family, built), ...]`.
#[pyfunction]
pub fn kernels_built() -> Vec<(&'static str, bool)> {
    flashmla::cuda::kernels_built()
}
