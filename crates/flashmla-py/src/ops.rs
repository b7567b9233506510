//! The entry points of `flashmla._native`, two per op:
//!
//! * `<op>(inputs...)`: one call does the whole op. It reads the torch tensors ([`crate::tensor`]), validates
//!   them, allocates the outputs (and any workspace) through torch, runs, and returns the outputs. Host tensors run
//!   the CPU reference (inputs copied in, results copied into the outputs); CUDA tensors run the kernels on torch's
//!   current stream of the tensors' device, with no copy and no synchronisation. The eager Python API calls this
//!   directly, and it is the body of the registered `torch.library` op.
//! * `<op>_check(inputs...)`: validates the inputs' metadata only (never reads data) and returns the dimensions
//!   of the outputs: the fake (meta) implementation under `torch.compile` runs it, so both raise the same errors.
//!
//! The GIL is released while a CPU op runs (it goes through [`run_cpu`], so that Ctrl-C stops it:
//! `KeyboardInterrupt`); a CUDA run, which only queues launches, keeps it (see [`run`]) and leaves the thread's
//! current CUDA context (torch's current device) as it found it. Every entry point goes through [`guard`]: library errors become the matching Python exceptions and no
//! panic crosses into Python.
//!
//! Wiring a new GPU kernel is its op's `cuda` closure below: call `flashmla::ops::<family>::<op>_cuda` with the
//! handle, the argument views and the output views.

use crate::errors::guard;
use crate::gpu::gpu_for;
use crate::interrupt::run_cpu;
use crate::tensor::{
    current_stream, desc, descs, new_output, new_outputs, stream_workspace, Desc, Read,
};
use flashmla::cuda::Gpu;
use flashmla::ops::decode::{self, DecodeOutput, DenseDecodeArgs, ExtraKvArgs, SparseDecodeArgs};
use flashmla::ops::dense_prefill;
use flashmla::ops::kv_quant::{
    self, DequantizeArgs, DequantizeOutput, QuantizeArgs, QuantizeOutput,
};
use flashmla::ops::sparse_bwd::{self as bwd_op, SparseBwdArgs, SparseBwdOutput};
use flashmla::ops::sparse_fwd::{self as fwd_op, SparseFwdArgs, SparseFwdOutput};
use flashmla::{CancelToken, DType, Location, Result, TensorMeta};
use pyo3::prelude::*;

type Tensor<'py> = Bound<'py, PyAny>;

/// Where a call runs: the host, or a CUDA device with the handle of torch's current stream there.
enum Place {
    Host,
    Cuda(Gpu),
}

impl Place {
    /// The place of a call whose first tensor is `first` (the library checks that every other tensor lives there
    /// too).
    fn of(py: Python<'_>, op: &'static str, first: &Desc) -> PyResult<Place> {
        Ok(match first.location() {
            Location::Host => Place::Host,
            Location::Cuda(device) => {
                let stream = current_stream(py, device)?;
                Place::Cuda(guard(op, || gpu_for(device, stream))?)
            }
        })
    }

    fn location(&self) -> Location {
        match self {
            Place::Host => Location::Host,
            Place::Cuda(gpu) => Location::Cuda(gpu.ordinal()),
        }
    }
}

/// Runs an op where its tensors live: `host` on a helper thread that Ctrl-C can cancel (the GIL released), or `cuda`
/// leaving the thread's current CUDA context as it was.
///
/// A CUDA run keeps the GIL (it only queues launches, as torch's own ops do): the decodes of one stream share that
/// stream's kept workspace, and holding the GIL from taking it to the last launch keeps two Python threads from
/// interleaving their launches on it.
fn run<T: Send>(
    py: Python<'_>,
    op: &'static str,
    place: &Place,
    host: impl FnOnce(&CancelToken) -> Result<T> + Send,
    cuda: impl FnOnce(&Gpu) -> Result<T>,
) -> PyResult<T> {
    match place {
        Place::Host => run_cpu(py, op, host),
        Place::Cuda(gpu) => guard(op, || gpu.restoring_context(|| cuda(gpu))),
    }
}

/// A required input's description ([`descs`] returns one for every tensor it was given).
fn required(d: Option<Desc>) -> PyResult<Desc> {
    d.ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err("internal: a required tensor was not described")
    })
}

/// `f` of an optional input.
fn opt<T, U>(t: &Option<T>, f: &impl Fn(&T) -> Result<U>) -> Result<Option<U>> {
    t.as_ref().map(f).transpose()
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse prefill forward

/// The sparse forward's inputs, as descriptions (`Desc`), host copies or device views.
struct FwdIn<T> {
    q: T,
    kv: T,
    indices: T,
    attn_sink: Option<T>,
    topk_length: Option<T>,
}

impl FwdIn<Desc> {
    fn read(
        q: &Tensor<'_>,
        kv: &Tensor<'_>,
        indices: &Tensor<'_>,
        attn_sink: Option<&Tensor<'_>>,
        topk_length: Option<&Tensor<'_>>,
        read: Read,
    ) -> PyResult<Self> {
        let [q, kv, indices, attn_sink, topk_length] = descs(
            [
                (Some(q), "q"),
                (Some(kv), "kv"),
                (Some(indices), "indices"),
                (attn_sink, "attn_sink"),
                (topk_length, "topk_length"),
            ],
            read,
        )?;
        Ok(FwdIn {
            q: required(q)?,
            kv: required(kv)?,
            indices: required(indices)?,
            attn_sink,
            topk_length,
        })
    }
}

impl<T> FwdIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<FwdIn<U>> {
        Ok(FwdIn {
            q: f(&self.q)?,
            kv: f(&self.kv)?,
            indices: f(&self.indices)?,
            attn_sink: opt(&self.attn_sink, f)?,
            topk_length: opt(&self.topk_length, f)?,
        })
    }

    fn args(&self, sm_scale: f32) -> SparseFwdArgs<'_, T> {
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

/// Validates a sparse forward's metadata and returns `(s_q, s_kv, h_q, d_qk, d_v, topk)`.
#[pyfunction]
#[pyo3(signature = (q, kv, indices, sm_scale, attn_sink=None, topk_length=None))]
pub fn sparse_fwd_check(
    q: &Tensor<'_>,
    kv: &Tensor<'_>,
    indices: &Tensor<'_>,
    sm_scale: f32,
    attn_sink: Option<&Tensor<'_>>,
    topk_length: Option<&Tensor<'_>>,
) -> PyResult<(usize, usize, usize, usize, usize, usize)> {
    let d = FwdIn::read(q, kv, indices, attn_sink, topk_length, Read::Meta)?;
    guard("sparse_fwd", || {
        let dims = fwd_op::validate(&d.args(sm_scale))?;
        Ok((
            dims.s_q, dims.s_kv, dims.h_q, dims.d_qk, dims.d_v, dims.topk,
        ))
    })
}

/// The sparse forward: `(out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] f32, lse [s_q, h_q] f32)`.
#[pyfunction]
#[pyo3(signature = (q, kv, indices, sm_scale, attn_sink=None, topk_length=None))]
pub fn sparse_fwd<'py>(
    q: &Tensor<'py>,
    kv: &Tensor<'py>,
    indices: &Tensor<'py>,
    sm_scale: f32,
    attn_sink: Option<&Tensor<'py>>,
    topk_length: Option<&Tensor<'py>>,
) -> PyResult<(Tensor<'py>, Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let d = FwdIn::read(q, kv, indices, attn_sink, topk_length, Read::Data)?;
    let place = Place::of(py, "sparse_fwd", &d.q)?;
    let loc = place.location();
    let dims = guard("sparse_fwd", || fwd_op::validate(&d.args(sm_scale)))?;
    let (s_q, h_q) = (dims.s_q, dims.h_q);
    let [(out, out_d), (max_logits, max_d), (lse, lse_d)] = new_outputs(
        q,
        [
            ("out", &[s_q, h_q, dims.d_v], DType::Bf16),
            ("max_logits", &[s_q, h_q], DType::F32),
            ("lse", &[s_q, h_q], DType::F32),
        ],
        loc,
    )?;
    let outs = SparseFwdOutput {
        out: out_d,
        max_logits: max_d,
        lse: lse_d,
    };
    run(
        py,
        "sparse_fwd",
        &place,
        |cancel| {
            let res = fwd_op::sparse_fwd_cpu_with(&d.map(&Desc::to_host)?.args(sm_scale), cancel)?;
            outs.out.write_host(&res.out)?;
            outs.max_logits.write_host(&res.max_logits)?;
            outs.lse.write_host(&res.lse)
        },
        |gpu| {
            let views = SparseFwdOutput {
                out: outs.out.to_device()?,
                max_logits: outs.max_logits.to_device()?,
                lse: outs.lse.to_device()?,
            };
            fwd_op::sparse_fwd_cuda(gpu, &d.map(&Desc::to_device)?.args(sm_scale), &views)
        },
    )?;
    Ok((out, max_logits, lse))
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse prefill backward

/// The sparse backward's inputs.
struct BwdIn<T> {
    fwd: FwdIn<T>,
    out: T,
    d_out: T,
    lse: T,
}

impl BwdIn<Desc> {
    #[allow(clippy::too_many_arguments)]
    fn read(
        q: &Tensor<'_>,
        kv: &Tensor<'_>,
        out: &Tensor<'_>,
        d_out: &Tensor<'_>,
        indices: &Tensor<'_>,
        lse: &Tensor<'_>,
        attn_sink: Option<&Tensor<'_>>,
        topk_length: Option<&Tensor<'_>>,
        read: Read,
    ) -> PyResult<Self> {
        Ok(BwdIn {
            fwd: FwdIn::read(q, kv, indices, attn_sink, topk_length, read)?,
            out: desc(out, "out", read)?,
            d_out: desc(d_out, "d_out", read)?,
            lse: desc(lse, "lse", read)?,
        })
    }
}

impl<T> BwdIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<BwdIn<U>> {
        Ok(BwdIn {
            fwd: self.fwd.map(f)?,
            out: f(&self.out)?,
            d_out: f(&self.d_out)?,
            lse: f(&self.lse)?,
        })
    }

    fn args(&self, sm_scale: f32, d_kv_dtype: DType) -> SparseBwdArgs<'_, T> {
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

fn d_kv_dtype(d_kv_f32: bool) -> DType {
    if d_kv_f32 {
        DType::F32
    } else {
        DType::Bf16
    }
}

/// Validates a sparse backward's metadata and returns `(s_q, s_kv, h_q, d_qk, d_v, topk)`.
#[pyfunction]
#[pyo3(signature = (q, kv, out, d_out, indices, lse, sm_scale, attn_sink=None, topk_length=None, d_kv_f32=false))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_bwd_check(
    q: &Tensor<'_>,
    kv: &Tensor<'_>,
    out: &Tensor<'_>,
    d_out: &Tensor<'_>,
    indices: &Tensor<'_>,
    lse: &Tensor<'_>,
    sm_scale: f32,
    attn_sink: Option<&Tensor<'_>>,
    topk_length: Option<&Tensor<'_>>,
    d_kv_f32: bool,
) -> PyResult<(usize, usize, usize, usize, usize, usize)> {
    let d = BwdIn::read(
        q,
        kv,
        out,
        d_out,
        indices,
        lse,
        attn_sink,
        topk_length,
        Read::Meta,
    )?;
    guard("sparse_bwd", || {
        let f = bwd_op::validate(&d.args(sm_scale, d_kv_dtype(d_kv_f32)))?.fwd;
        Ok((f.s_q, f.s_kv, f.h_q, f.d_qk, f.d_v, f.topk))
    })
}

/// The sparse backward: `(d_q [s_q, h_q, d_qk] bf16, d_kv [s_kv, 1, d_qk] bf16 (f32 with d_kv_f32),
/// delta [s_q, h_q] f32, d_attn_sink [h_q] f32 (shape [0] without a sink))`.
///
/// A bf16 `d_kv` is reduced in an f32 workspace on the GPU first, and with `deterministic` every `d_kv` in an
/// int64 fixed-point workspace twice that size (bitwise-reproducible `d_kv`); it is allocated through torch for the
/// call. On the CPU every mode is the reference, which is deterministic.
#[pyfunction]
#[pyo3(signature = (q, kv, out, d_out, indices, lse, sm_scale, attn_sink=None, topk_length=None, d_kv_f32=false, deterministic=false))]
#[allow(clippy::too_many_arguments)]
pub fn sparse_bwd<'py>(
    q: &Tensor<'py>,
    kv: &Tensor<'py>,
    out: &Tensor<'py>,
    d_out: &Tensor<'py>,
    indices: &Tensor<'py>,
    lse: &Tensor<'py>,
    sm_scale: f32,
    attn_sink: Option<&Tensor<'py>>,
    topk_length: Option<&Tensor<'py>>,
    d_kv_f32: bool,
    deterministic: bool,
) -> PyResult<(Tensor<'py>, Tensor<'py>, Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let d = BwdIn::read(
        q,
        kv,
        out,
        d_out,
        indices,
        lse,
        attn_sink,
        topk_length,
        Read::Data,
    )?;
    let place = Place::of(py, "sparse_bwd", &d.fwd.q)?;
    let loc = place.location();
    let dkv_dtype = d_kv_dtype(d_kv_f32);
    let dims = guard("sparse_bwd", || {
        bwd_op::validate(&d.args(sm_scale, dkv_dtype))
    })?;
    let f = dims.fwd;
    let sink_rows = if attn_sink.is_some() { f.h_q } else { 0 };
    let [(d_q, d_q_d), (d_kv, d_kv_d), (delta, delta_d), (d_sink, d_sink_d)] = new_outputs(
        q,
        [
            ("d_q", &[f.s_q, f.h_q, f.d_qk], DType::Bf16),
            ("d_kv", &[f.s_kv, 1, f.d_qk], dkv_dtype),
            ("delta", &[f.s_q, f.h_q], DType::F32),
            ("d_attn_sink", &[sink_rows], DType::F32),
        ],
        loc,
    )?;
    let outs = SparseBwdOutput {
        d_q: d_q_d,
        d_kv: d_kv_d,
        delta: delta_d,
        d_attn_sink: attn_sink.is_some().then_some(d_sink_d),
    };
    let options = bwd_op::SparseBwdOptions {
        deterministic,
        ..Default::default()
    };
    let [ws_rows, ws_cols] = bwd_op::workspace_shape(&dims, &options);
    let workspace = match loc {
        Location::Cuda(_)
            if bwd_op::reduces_in_workspace(dkv_dtype, &options) && ws_rows * ws_cols > 0 =>
        {
            Some(new_output(
                q,
                "workspace",
                &[ws_rows, ws_cols],
                DType::F32,
                loc,
            )?)
        }
        _ => None,
    };
    let ws = workspace.as_ref().map(|(_, d)| d);
    run(
        py,
        "sparse_bwd",
        &place,
        |cancel| {
            let h = d.map(&Desc::to_host)?;
            let res = bwd_op::sparse_bwd_cpu_with(&h.args(sm_scale, dkv_dtype), cancel)?;
            outs.d_q.write_host(&res.d_q)?;
            outs.d_kv.write_host(&res.d_kv)?;
            outs.delta.write_host(&res.delta)?;
            match (&outs.d_attn_sink, &res.d_attn_sink) {
                (Some(dst), Some(v)) => dst.write_host(v),
                _ => Ok(()),
            }
        },
        |gpu| {
            let views = SparseBwdOutput {
                d_q: outs.d_q.to_device()?,
                d_kv: outs.d_kv.to_device()?,
                delta: outs.delta.to_device()?,
                d_attn_sink: opt(&outs.d_attn_sink, &Desc::to_device)?,
            };
            let ws = ws.map(Desc::to_device).transpose()?;
            bwd_op::sparse_bwd_cuda_with(
                gpu,
                &d.map(&Desc::to_device)?.args(sm_scale, dkv_dtype),
                &views,
                &options,
                ws.as_ref(),
            )
        },
    )?;
    Ok((d_q, d_kv, delta, d_sink))
}

// ---------------------------------------------------------------------------------------------------------------
// Decode

/// Whether a CUDA `q`'s rows start on 16 bytes (the decode kernels load q rows in 16-byte chunks): its address
/// and every stride but the last (of a dimension with more than one entry) multiples of 16 bytes.
fn rows_16b(q: &Desc) -> bool {
    let elem = q.dtype().size_bytes();
    let layout = q.layout();
    let dims = layout.shape().len().saturating_sub(1);
    q.location() == Location::Host
        || (q.ptr() % 16 == 0
            && layout.shape()[..dims]
                .iter()
                .zip(layout.strides())
                .all(|(&n, &s)| n <= 1 || (s * elem) % 16 == 0))
}

/// `q` itself, or a contiguous copy when its rows are not 16-byte aligned ([`rows_16b`]); with its description.
fn q_rows_16b<'py>(q: &Tensor<'py>, d: Desc) -> PyResult<(Tensor<'py>, Desc)> {
    if rows_16b(&d) {
        return Ok((q.clone(), d));
    }
    let copy = q.call_method0(pyo3::intern!(q.py(), "contiguous"))?;
    let d = desc(&copy, "q", Read::Data)?;
    Ok((copy, d))
}

/// The GPU decode's options from the Python flags.
fn decode_options(batch_invariant: bool) -> decode::DecodeOptions {
    decode::DecodeOptions {
        batch_invariant,
        ..decode::DecodeOptions::default()
    }
}

/// An f32 workspace of at least `words` words for work queued on `gpu`'s stream: the stream's kept one, or a fresh
/// one while the stream is being captured into a CUDA graph (see [`stream_workspace`]).
fn gpu_workspace<'py>(
    like: &Tensor<'py>,
    op: &'static str,
    gpu: &Gpu,
    words: usize,
) -> PyResult<(Tensor<'py>, Desc)> {
    // is_capturing binds the device's context (a fresh thread has none current): put the caller's back.
    let capturing = guard(op, || gpu.restoring_context(|| gpu.is_capturing()))?;
    stream_workspace(like, gpu.ordinal(), gpu.stream(), capturing, words)
}

/// A decode's outputs `(out [b, s_q, h_q, d_v], lse [b, h_q, s_q] f32)` and, on CUDA, its workspace of
/// `words(sm_count)` f32 words (the schedule and the split partials; see [`stream_workspace`]).
#[allow(clippy::type_complexity)]
fn decode_outputs<'py>(
    q: &Tensor<'py>,
    op: &'static str,
    [b, s_q, h_q, d_v]: [usize; 4],
    dtype: DType,
    place: &Place,
    words: impl FnOnce(usize) -> Result<usize>,
) -> PyResult<(
    Tensor<'py>,
    Tensor<'py>,
    DecodeOutput<Desc>,
    Option<(Tensor<'py>, Desc)>,
)> {
    let loc = place.location();
    let [(out, out_d), (lse, lse_d)] = new_outputs(
        q,
        [
            ("out", &[b, s_q, h_q, d_v], dtype),
            ("lse", &[b, h_q, s_q], DType::F32),
        ],
        loc,
    )?;
    let workspace = match place {
        Place::Cuda(gpu) => {
            let words = guard(op, || words(gpu.info().sm_count as usize))?;
            Some(gpu_workspace(q, op, gpu, words)?)
        }
        Place::Host => None,
    };
    let outs = DecodeOutput {
        out: out_d,
        lse: lse_d,
    };
    Ok((out, lse, outs, workspace))
}

/// The dense decode's inputs.
struct DenseIn<T> {
    q: T,
    k_cache: T,
    block_table: T,
    cache_seqlens: T,
    attn_sink: Option<T>,
}

impl DenseIn<Desc> {
    fn read(
        q: &Tensor<'_>,
        k_cache: &Tensor<'_>,
        block_table: &Tensor<'_>,
        cache_seqlens: &Tensor<'_>,
        attn_sink: Option<&Tensor<'_>>,
        read: Read,
    ) -> PyResult<Self> {
        let [q, k_cache, block_table, cache_seqlens, attn_sink] = descs(
            [
                (Some(q), "q"),
                (Some(k_cache), "k_cache"),
                (Some(block_table), "block_table"),
                (Some(cache_seqlens), "cache_seqlens"),
                (attn_sink, "attn_sink"),
            ],
            read,
        )?;
        Ok(DenseIn {
            q: required(q)?,
            k_cache: required(k_cache)?,
            block_table: required(block_table)?,
            cache_seqlens: required(cache_seqlens)?,
            attn_sink,
        })
    }
}

impl<T> DenseIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<DenseIn<U>> {
        Ok(DenseIn {
            q: f(&self.q)?,
            k_cache: f(&self.k_cache)?,
            block_table: f(&self.block_table)?,
            cache_seqlens: f(&self.cache_seqlens)?,
            attn_sink: opt(&self.attn_sink, f)?,
        })
    }

    fn args(&self, softmax_scale: Option<f32>, causal: bool) -> DenseDecodeArgs<'_, T> {
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

/// Validates a dense decode's metadata and returns `(b, s_q, h_q, d_v)` (`out` has q's dtype).
#[pyfunction]
#[pyo3(signature = (q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=false, attn_sink=None))]
pub fn decode_dense_check(
    q: &Tensor<'_>,
    k_cache: &Tensor<'_>,
    block_table: &Tensor<'_>,
    cache_seqlens: &Tensor<'_>,
    softmax_scale: Option<f32>,
    causal: bool,
    attn_sink: Option<&Tensor<'_>>,
) -> PyResult<(usize, usize, usize, usize)> {
    let d = DenseIn::read(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        attn_sink,
        Read::Meta,
    )?;
    guard("decode_dense", || {
        let dims = decode::validate_dense(&d.args(softmax_scale, causal))?;
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v))
    })
}

/// The dense decode: `(out [b, s_q, h_q, d_v] (q's dtype), lse [b, h_q, s_q] f32)`. On CUDA the schedule, split
/// and combine are queued on torch's current stream, with a workspace allocated through torch for the call.
#[pyfunction]
#[pyo3(signature = (q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=false, attn_sink=None,
    batch_invariant=false))]
#[allow(clippy::too_many_arguments)]
pub fn decode_dense<'py>(
    q: &Tensor<'py>,
    k_cache: &Tensor<'py>,
    block_table: &Tensor<'py>,
    cache_seqlens: &Tensor<'py>,
    softmax_scale: Option<f32>,
    causal: bool,
    attn_sink: Option<&Tensor<'py>>,
    batch_invariant: bool,
) -> PyResult<(Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let mut d = DenseIn::read(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        attn_sink,
        Read::Data,
    )?;
    let (_q_alive, q_d) = q_rows_16b(q, d.q.clone())?;
    d.q = q_d;
    let place = Place::of(py, "decode_dense", &d.q)?;
    let dims = guard("decode_dense", || {
        decode::validate_dense(&d.args(softmax_scale, causal))
    })?;
    let options = decode_options(batch_invariant);
    let shape = [dims.batch, dims.s_q, dims.h_q, dims.d_v];
    let (out, lse, outs, workspace) =
        decode_outputs(q, "decode_dense", shape, dims.dtype, &place, |sms| {
            decode::launch::dense_workspace_words(&dims, &options, sms)
        })?;
    let ws = workspace.as_ref().map(|(_, d)| d);
    run(
        py,
        "decode_dense",
        &place,
        |cancel| {
            let res = decode::decode_dense_cpu_with(
                &d.map(&Desc::to_host)?.args(softmax_scale, causal),
                cancel,
            )?;
            outs.out.write_host(&res.out)?;
            outs.lse.write_host(&res.lse)
        },
        |gpu| {
            let views = DecodeOutput {
                out: outs.out.to_device()?,
                lse: outs.lse.to_device()?,
            };
            let ws = ws.map(Desc::to_device).transpose()?;
            decode::decode_dense_cuda(
                gpu,
                &d.map(&Desc::to_device)?.args(softmax_scale, causal),
                &views,
                &options,
                ws.as_ref(),
            )
        },
    )?;
    Ok((out, lse))
}

/// The sparse decode's inputs.
struct SparseIn<T> {
    q: T,
    k_cache: T,
    indices: T,
    topk_length: Option<T>,
    attn_sink: Option<T>,
    /// `(extra_k_cache, extra_indices, extra_topk_length)`.
    extra: Option<(T, T, Option<T>)>,
}

impl SparseIn<Desc> {
    #[allow(clippy::too_many_arguments)]
    fn read(
        q: &Tensor<'_>,
        k_cache: &Tensor<'_>,
        indices: &Tensor<'_>,
        topk_length: Option<&Tensor<'_>>,
        attn_sink: Option<&Tensor<'_>>,
        extra_k_cache: Option<&Tensor<'_>>,
        extra_indices: Option<&Tensor<'_>>,
        extra_topk_length: Option<&Tensor<'_>>,
        read: Read,
    ) -> PyResult<Self> {
        let [q, k_cache, indices, topk_length, attn_sink, extra_k_cache_d, extra_indices_d, extra_topk_length_d] =
            descs(
                [
                    (Some(q), "q"),
                    (Some(k_cache), "k_cache"),
                    (Some(indices), "indices"),
                    (topk_length, "topk_length"),
                    (attn_sink, "attn_sink"),
                    (extra_k_cache, "extra_k_cache"),
                    (extra_indices, "extra_indices"),
                    (extra_topk_length, "extra_topk_length"),
                ],
                read,
            )?;
        let extra = match (extra_k_cache_d, extra_indices_d) {
            (Some(c), Some(i)) => Some((c, i, extra_topk_length_d)),
            (None, None) if extra_topk_length.is_none() => None,
            _ => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "invalid argument `extra_k_cache`: expected extra_k_cache and extra_indices given together \
                     (extra_topk_length only with them), got only some of them",
                ))
            }
        };
        Ok(SparseIn {
            q: required(q)?,
            k_cache: required(k_cache)?,
            indices: required(indices)?,
            topk_length,
            attn_sink,
            extra,
        })
    }
}

impl<T> SparseIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<SparseIn<U>> {
        Ok(SparseIn {
            q: f(&self.q)?,
            k_cache: f(&self.k_cache)?,
            indices: f(&self.indices)?,
            topk_length: opt(&self.topk_length, f)?,
            attn_sink: opt(&self.attn_sink, f)?,
            extra: match &self.extra {
                Some((c, i, l)) => Some((f(c)?, f(i)?, opt(l, f)?)),
                None => None,
            },
        })
    }

    fn args(&self, softmax_scale: Option<f32>) -> SparseDecodeArgs<'_, T> {
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

/// Validates a sparse FP8 decode's metadata and returns `(b, s_q, h_q, d_v)` (`out` is bf16).
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None
))]
#[allow(clippy::too_many_arguments)]
pub fn decode_sparse_check(
    q: &Tensor<'_>,
    k_cache: &Tensor<'_>,
    indices: &Tensor<'_>,
    topk_length: Option<&Tensor<'_>>,
    softmax_scale: Option<f32>,
    attn_sink: Option<&Tensor<'_>>,
    extra_k_cache: Option<&Tensor<'_>>,
    extra_indices: Option<&Tensor<'_>>,
    extra_topk_length: Option<&Tensor<'_>>,
) -> PyResult<(usize, usize, usize, usize)> {
    let d = SparseIn::read(
        q,
        k_cache,
        indices,
        topk_length,
        attn_sink,
        extra_k_cache,
        extra_indices,
        extra_topk_length,
        Read::Meta,
    )?;
    guard("decode_sparse", || {
        let dims = decode::validate_sparse(&d.args(softmax_scale))?;
        Ok((dims.batch, dims.s_q, dims.h_q, dims.d_v))
    })
}

/// The sparse FP8 decode: `(out [b, s_q, h_q, d_v] bf16, lse [b, h_q, s_q] f32)`; on CUDA as for
/// [`decode_dense`].
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None, batch_invariant=false
))]
#[allow(clippy::too_many_arguments)]
pub fn decode_sparse<'py>(
    q: &Tensor<'py>,
    k_cache: &Tensor<'py>,
    indices: &Tensor<'py>,
    topk_length: Option<&Tensor<'py>>,
    softmax_scale: Option<f32>,
    attn_sink: Option<&Tensor<'py>>,
    extra_k_cache: Option<&Tensor<'py>>,
    extra_indices: Option<&Tensor<'py>>,
    extra_topk_length: Option<&Tensor<'py>>,
    batch_invariant: bool,
) -> PyResult<(Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let mut d = SparseIn::read(
        q,
        k_cache,
        indices,
        topk_length,
        attn_sink,
        extra_k_cache,
        extra_indices,
        extra_topk_length,
        Read::Data,
    )?;
    let (_q_alive, q_d) = q_rows_16b(q, d.q.clone())?;
    d.q = q_d;
    let place = Place::of(py, "decode_sparse", &d.q)?;
    let dims = guard("decode_sparse", || {
        decode::validate_sparse(&d.args(softmax_scale))
    })?;
    let options = decode_options(batch_invariant);
    let shape = [dims.batch, dims.s_q, dims.h_q, dims.d_v];
    let (out, lse, outs, workspace) =
        decode_outputs(q, "decode_sparse", shape, DType::Bf16, &place, |sms| {
            decode::launch::sparse_workspace_words(&dims, &options, sms)
        })?;
    let ws = workspace.as_ref().map(|(_, d)| d);
    run(
        py,
        "decode_sparse",
        &place,
        |cancel| {
            let res = decode::decode_sparse_cpu_with(
                &d.map(&Desc::to_host)?.args(softmax_scale),
                cancel,
            )?;
            outs.out.write_host(&res.out)?;
            outs.lse.write_host(&res.lse)
        },
        |gpu| {
            let views = DecodeOutput {
                out: outs.out.to_device()?,
                lse: outs.lse.to_device()?,
            };
            let ws = ws.map(Desc::to_device).transpose()?;
            decode::decode_sparse_cuda(
                gpu,
                &d.map(&Desc::to_device)?.args(softmax_scale),
                &views,
                &options,
                ws.as_ref(),
            )
        },
    )?;
    Ok((out, lse))
}

// ---------------------------------------------------------------------------------------------------------------
// Dense varlen prefill (CUDA or the CPU, both directions)

/// The dense prefill's inputs.
struct DenseFwdIn<T> {
    q: T,
    k: T,
    v: T,
    cu_q: T,
    cu_k: T,
}

impl DenseFwdIn<Desc> {
    fn read([q, k, v, cu_q, cu_k]: [&Tensor<'_>; 5], read: Read) -> PyResult<Self> {
        Ok(DenseFwdIn {
            q: desc(q, "q", read)?,
            k: desc(k, "k", read)?,
            v: desc(v, "v", read)?,
            cu_q: desc(cu_q, "cu_seqlens_q", read)?,
            cu_k: desc(cu_k, "cu_seqlens_k", read)?,
        })
    }
}

impl<T> DenseFwdIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<DenseFwdIn<U>> {
        Ok(DenseFwdIn {
            q: f(&self.q)?,
            k: f(&self.k)?,
            v: f(&self.v)?,
            cu_q: f(&self.cu_q)?,
            cu_k: f(&self.cu_k)?,
        })
    }

    fn args(
        &self,
        softmax_scale: Option<f32>,
        causal: bool,
    ) -> dense_prefill::DensePrefillArgs<'_, T> {
        dense_prefill::DensePrefillArgs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
            softmax_scale,
            causal,
        }
    }
}

/// The dense prefill backward's inputs: the forward's, its outputs and the incoming gradient.
struct DenseBwdIn<T> {
    fwd: DenseFwdIn<T>,
    out: T,
    d_out: T,
    lse: T,
}

impl DenseBwdIn<Desc> {
    fn read(
        fwd: [&Tensor<'_>; 5],
        [out, d_out, lse]: [&Tensor<'_>; 3],
        read: Read,
    ) -> PyResult<Self> {
        Ok(DenseBwdIn {
            fwd: DenseFwdIn::read(fwd, read)?,
            out: desc(out, "out", read)?,
            d_out: desc(d_out, "d_out", read)?,
            lse: desc(lse, "lse", read)?,
        })
    }
}

impl<T> DenseBwdIn<T> {
    /// The same inputs with `f` applied to each tensor (descriptions to host copies or device views).
    fn map<U>(&self, f: &impl Fn(&T) -> Result<U>) -> Result<DenseBwdIn<U>> {
        Ok(DenseBwdIn {
            fwd: self.fwd.map(f)?,
            out: f(&self.out)?,
            d_out: f(&self.d_out)?,
            lse: f(&self.lse)?,
        })
    }

    fn args(
        &self,
        softmax_scale: Option<f32>,
        causal: bool,
    ) -> dense_prefill::DensePrefillBwdArgs<'_, T> {
        dense_prefill::DensePrefillBwdArgs {
            fwd: self.fwd.args(softmax_scale, causal),
            out: &self.out,
            d_out: &self.d_out,
            lse: &self.lse,
        }
    }
}

/// Validates a dense prefill forward's metadata and returns `(total_q, h_q, d_v)` (`out` has q's dtype, `lse`
/// is `[h_q, total_q]` f32).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=false))]
pub fn dense_prefill_fwd_check(
    q: &Tensor<'_>,
    k: &Tensor<'_>,
    v: &Tensor<'_>,
    cu_seqlens_q: &Tensor<'_>,
    cu_seqlens_k: &Tensor<'_>,
    softmax_scale: Option<f32>,
    causal: bool,
) -> PyResult<(usize, usize, usize)> {
    let d = DenseFwdIn::read([q, k, v, cu_seqlens_q, cu_seqlens_k], Read::Meta)?;
    guard("dense_prefill_fwd", || {
        let dims = dense_prefill::validate(&d.args(softmax_scale, causal))?;
        Ok((dims.total_q, dims.h_q, dims.d_v))
    })
}

/// The dense varlen prefill forward: `(out [total_q, h_q, d_v] (q's dtype), lse [h_q, total_q] f32)`.
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=false))]
pub fn dense_prefill_fwd<'py>(
    q: &Tensor<'py>,
    k: &Tensor<'py>,
    v: &Tensor<'py>,
    cu_seqlens_q: &Tensor<'py>,
    cu_seqlens_k: &Tensor<'py>,
    softmax_scale: Option<f32>,
    causal: bool,
) -> PyResult<(Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let d = DenseFwdIn::read([q, k, v, cu_seqlens_q, cu_seqlens_k], Read::Data)?;
    let place = Place::of(py, "dense_prefill_fwd", &d.q)?;
    let loc = place.location();
    let dims = guard("dense_prefill_fwd", || {
        dense_prefill::validate(&d.args(softmax_scale, causal))
    })?;
    let [(out, out_d), (lse, lse_d)] = new_outputs(
        q,
        [
            ("out", &[dims.total_q, dims.h_q, dims.d_v], dims.dtype),
            ("lse", &[dims.h_q, dims.total_q], DType::F32),
        ],
        loc,
    )?;
    // On CUDA the persistent CTAs' work counter lives in the stream's kept workspace (zeroed by the call).
    let workspace = match &place {
        Place::Cuda(gpu) => Some(gpu_workspace(
            q,
            "dense_prefill_fwd",
            gpu,
            dense_prefill::launch::FWD_WORKSPACE_WORDS,
        )?),
        Place::Host => None,
    };
    run(
        py,
        "dense_prefill_fwd",
        &place,
        |cancel| {
            let res = dense_prefill::dense_prefill_fwd_cpu_with(
                &d.map(&Desc::to_host)?.args(softmax_scale, causal),
                cancel,
            )?;
            out_d.write_host(&res.out)?;
            lse_d.write_host(&res.lse)
        },
        |gpu| {
            let views = dense_prefill::DensePrefillOutput {
                out: out_d.to_device()?,
                lse: lse_d.to_device()?,
            };
            let ws = match &workspace {
                Some((_, ws)) => Some(ws.to_device()?),
                None => None,
            };
            dense_prefill::dense_prefill_fwd_cuda_with(
                gpu,
                &d.map(&Desc::to_device)?.args(softmax_scale, causal),
                &views,
                ws.as_ref(),
            )
        },
    )?;
    Ok((out, lse))
}

/// Validates a dense prefill backward's metadata and returns `(total_q, total_k, h_q, h_k, d, d_v)`.
#[pyfunction]
#[pyo3(signature = (q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=false))]
#[allow(clippy::too_many_arguments)]
pub fn dense_prefill_bwd_check(
    q: &Tensor<'_>,
    k: &Tensor<'_>,
    v: &Tensor<'_>,
    out: &Tensor<'_>,
    d_out: &Tensor<'_>,
    lse: &Tensor<'_>,
    cu_seqlens_q: &Tensor<'_>,
    cu_seqlens_k: &Tensor<'_>,
    softmax_scale: Option<f32>,
    causal: bool,
) -> PyResult<(usize, usize, usize, usize, usize, usize)> {
    let d = DenseBwdIn::read(
        [q, k, v, cu_seqlens_q, cu_seqlens_k],
        [out, d_out, lse],
        Read::Meta,
    )?;
    guard("dense_prefill_bwd", || {
        let dims = dense_prefill::validate_bwd(&d.args(softmax_scale, causal))?;
        Ok((
            dims.total_q,
            dims.total_k,
            dims.h_q,
            dims.h_k,
            dims.d,
            dims.d_v,
        ))
    })
}

/// The dense varlen prefill backward from the forward's `out` and `lse`: `(d_q, d_k, d_v)` in q's dtype.
/// `deterministic` picks the schedule without atomics (bitwise-reproducible, slower).
#[pyfunction]
#[pyo3(signature = (q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=false, deterministic=false))]
#[allow(clippy::too_many_arguments)]
pub fn dense_prefill_bwd<'py>(
    q: &Tensor<'py>,
    k: &Tensor<'py>,
    v: &Tensor<'py>,
    out: &Tensor<'py>,
    d_out: &Tensor<'py>,
    lse: &Tensor<'py>,
    cu_seqlens_q: &Tensor<'py>,
    cu_seqlens_k: &Tensor<'py>,
    softmax_scale: Option<f32>,
    causal: bool,
    deterministic: bool,
) -> PyResult<(Tensor<'py>, Tensor<'py>, Tensor<'py>)> {
    let py = q.py();
    let options = dense_prefill::DensePrefillBwdOptions {
        deterministic,
        fused: None,
    };
    let d = DenseBwdIn::read(
        [q, k, v, cu_seqlens_q, cu_seqlens_k],
        [out, d_out, lse],
        Read::Data,
    )?;
    let place = Place::of(py, "dense_prefill_bwd", &d.fwd.q)?;
    let loc = place.location();
    let dims = guard("dense_prefill_bwd", || {
        dense_prefill::validate_bwd(&d.args(softmax_scale, causal))
    })?;
    let [(dq, dq_d), (dk, dk_d), (dv, dv_d)] = new_outputs(
        q,
        [
            ("d_q", &[dims.total_q, dims.h_q, dims.d], dims.dtype),
            ("d_k", &[dims.total_k, dims.h_k, dims.d], dims.dtype),
            ("d_v", &[dims.total_k, dims.h_k, dims.d_v], dims.dtype),
        ],
        loc,
    )?;
    // The GPU backward's workspace, freed with the call: delta [h_q, total_q] f32 and, on the fused schedule (d 128
    // unless deterministic), the f32 dQ accumulator (about 4 (d + 1) bytes per query row and head).
    let workspace = match place {
        Place::Cuda(_) => Some(new_output(
            q,
            "workspace",
            &guard("dense_prefill_bwd", || {
                dense_prefill::bwd_workspace_shape(&dims, &options)
            })?,
            DType::F32,
            loc,
        )?),
        Place::Host => None,
    };
    run(
        py,
        "dense_prefill_bwd",
        &place,
        |cancel| {
            let res = dense_prefill::dense_prefill_bwd_cpu_with(
                &d.map(&Desc::to_host)?.args(softmax_scale, causal),
                cancel,
            )?;
            dq_d.write_host(&res.d_q)?;
            dk_d.write_host(&res.d_k)?;
            dv_d.write_host(&res.d_v)
        },
        |gpu| {
            let grads = dense_prefill::DensePrefillGrads {
                d_q: dq_d.to_device()?,
                d_k: dk_d.to_device()?,
                d_v: dv_d.to_device()?,
            };
            // Allocated above for every CUDA call.
            let Some((_, workspace)) = &workspace else {
                return Err(flashmla::Error::invalid("workspace", "a workspace", "none"));
            };
            let workspace = workspace.to_device()?;
            dense_prefill::dense_prefill_bwd_cuda_with(
                gpu,
                &d.map(&Desc::to_device)?.args(softmax_scale, causal),
                &grads,
                &workspace,
                &options,
            )
        },
    )?;
    Ok((dq, dk, dv))
}

// ---------------------------------------------------------------------------------------------------------------
// FP8 KV-cache quantise / dequantise

/// Validates a quantise input's metadata and returns the packed cache shape `(num_blocks, page_size, 1,
/// bytes_per_token)`.
#[pyfunction]
pub fn kv_quantize_check(kv: &Tensor<'_>) -> PyResult<(usize, usize, usize, usize)> {
    let kv = desc(kv, "kv", Read::Meta)?;
    guard("kv_quantize", || {
        let [a, b, c, d] = kv_quant::validate_quantize(&QuantizeArgs { kv: &kv })?.cache_shape();
        Ok((a, b, c, d))
    })
}

/// Quantises `kv` into `cache` and returns it: a new packed u8 cache when `cache` is `None`, else the given one
/// (u8 or f8e4m3, any valid block stride; the bytes between blocks keep their values).
#[pyfunction]
#[pyo3(signature = (kv, cache=None))]
pub fn kv_quantize<'py>(kv: &Tensor<'py>, cache: Option<&Tensor<'py>>) -> PyResult<Tensor<'py>> {
    let py = kv.py();
    let kv_d = desc(kv, "kv", Read::Data)?;
    let place = Place::of(py, "kv_quantize", &kv_d)?;
    let loc = place.location();
    let dims = guard("kv_quantize", || {
        kv_quant::validate_quantize(&QuantizeArgs { kv: &kv_d })
    })?;
    let (cache, cache_d) = match cache {
        Some(c) => (c.clone(), desc(c, "cache", Read::Data)?),
        None => new_output(kv, "cache", &dims.cache_shape(), DType::U8, loc)?,
    };
    guard("kv_quantize", || {
        kv_quant::validate_quantize_output(
            &dims,
            &QuantizeOutput {
                cache: cache_d.clone(),
            },
        )
    })?;
    run(
        py,
        "kv_quantize",
        &place,
        |_| {
            let host_kv = kv_d.to_host()?;
            let filled =
                kv_quant::quantize_cpu_into(&QuantizeArgs { kv: &host_kv }, cache_d.to_host()?)?;
            cache_d.write_host(&filled)
        },
        |gpu| {
            kv_quant::quantize_cuda(
                gpu,
                &QuantizeArgs {
                    kv: &kv_d.to_device()?,
                },
                &QuantizeOutput {
                    cache: cache_d.to_device()?,
                },
            )
        },
    )?;
    Ok(cache)
}

/// Validates a dequantise input's metadata and returns the values' shape `(num_blocks, page_size, 1, d_qk)`.
#[pyfunction]
pub fn kv_dequantize_check(cache: &Tensor<'_>) -> PyResult<(usize, usize, usize, usize)> {
    let cache = desc(cache, "cache", Read::Meta)?;
    guard("kv_dequantize", || {
        let [a, b, c, d] =
            kv_quant::validate_dequantize(&DequantizeArgs { cache: &cache })?.kv_shape();
        Ok((a, b, c, d))
    })
}

/// Dequantises `cache` into a new `kv [num_blocks, page_size, 1, d_qk]` bf16.
#[pyfunction]
pub fn kv_dequantize<'py>(cache: &Tensor<'py>) -> PyResult<Tensor<'py>> {
    let py = cache.py();
    let cache_d = desc(cache, "cache", Read::Data)?;
    let place = Place::of(py, "kv_dequantize", &cache_d)?;
    let loc = place.location();
    let dims = guard("kv_dequantize", || {
        kv_quant::validate_dequantize(&DequantizeArgs { cache: &cache_d })
    })?;
    let (kv, kv_d) = new_output(cache, "kv", &dims.kv_shape(), DType::Bf16, loc)?;
    run(
        py,
        "kv_dequantize",
        &place,
        |_| {
            let host_cache = cache_d.to_host()?;
            let res = kv_quant::dequantize_cpu(&DequantizeArgs { cache: &host_cache })?;
            kv_d.write_host(&res.kv)
        },
        |gpu| {
            kv_quant::dequantize_cuda(
                gpu,
                &DequantizeArgs {
                    cache: &cache_d.to_device()?,
                },
                &DequantizeOutput {
                    kv: kv_d.to_device()?,
                },
            )
        },
    )?;
    Ok(kv)
}

// ---------------------------------------------------------------------------------------------------------------
// Build information

/// Drops the workspaces kept per CUDA stream (decodes, dense prefill forward) and returns the bytes they held (see
/// `crate::tensor::stream_workspace`).
#[pyfunction]
pub fn release_workspaces() -> usize {
    crate::tensor::release_workspaces()
}

/// Whether outputs are allocated through torch's C shim (`crate::shim`), rather than one Python call each.
#[pyfunction]
pub fn torch_shim(py: Python<'_>) -> bool {
    crate::shim::Shim::get(py).is_some()
}

/// Every kernel family with whether its cubin is embedded in this build: `[(family, built), ...]`.
#[pyfunction]
pub fn kernels_built() -> Vec<(&'static str, bool)> {
    flashmla::cuda::kernels_built()
}
