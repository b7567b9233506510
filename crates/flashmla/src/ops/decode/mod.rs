//! MLA decode over a paged KV cache (docs/spec.md section 4).
//!
//! * **Dense**: `q [b, s_q, h_q, d_qk]` bf16/f16, `k_cache [num_blocks, page_size, h_kv, d_qk]` of the same
//!   dtype, `block_table [b, max_blocks]` and `cache_seqlens [b]` i32, optional bottom-right causal mask and
//!   `attn_sink [h_q]` f32. Request `b` attends to its first `cache_seqlens[b]` tokens, token `p` in block
//!   `block_table[b][p / page_size]`.
//! * **Sparse**: `q` bf16, an FP8 cache (`[num_blocks, page_size, 1, bytes_per_token]`, V3.2 or MODEL1 format
//!   picked by `d_qk`), `indices [b, s_q, topk]` i32 selecting tokens `block * page_size + offset` (any value
//!   outside `0..num_blocks * page_size` is ignored), optional `topk_length [b]`, and an optional extra cache
//!   with its own indices attended in the same softmax.
//!
//! Outputs: `out [b, s_q, h_q, 512]` in q's dtype and `lse [b, h_q, s_q]` f32 (natural log; `+inf` and
//! `out = 0` for a row without keys). `softmax_scale` defaults to `d_qk^-0.5`.
//!
//! The CPU path runs [`crate::reference::decode`] in f32 (without a split; the split-KV schedule and combine
//! equal the unsplit result up to rounding). The GPU path of the dense decode ([`decode_dense_cuda`]) runs the
//! sm_90a kernels of [`launch`]: an on-device schedule, the split kernel and an f32 combine, with no host
//! synchronisation.
//! The CPU path reads only the cache blocks (dense) or tokens (sparse) that a request uses, so a broadcast or huge
//! cache costs nothing more; an allocation that fails is [`crate::Error::OutOfHostMemory`], and the `*_cpu_with`
//! entry points stop with [`crate::Error::Interrupted`] when their [`CancelToken`] is cancelled.
//!
//! `topk_length` values (sparse) are data, never errors: request `b` uses the first
//! `clamp(topk_length[b], 0, topk)` entries of each index row, so a length above `topk` means all `topk` entries
//! and a negative length none. The same holds for `extra_topk_length`.

pub mod launch;
pub mod validate;

pub use validate::{
    check_dense_values, validate_dense, validate_sparse, DenseDecodeDims, SparseDecodeDims,
};

use crate::alloc::{try_collect, try_with_capacity};
use crate::cancel::CancelToken;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::reference::decode::{
    self as reference, DecodeResult, DenseDecodeInputs, DenseDecodeProblem, SparseDecodeInputs,
    SparseKv,
};
use crate::tensor::{DType, DeviceView, HostData, HostTensor, Location, TensorMeta};
use crate::validate::{expect_dtype, expect_location, expect_rank, expect_shape};
use half::{bf16, f16};

/// Value width of every decode: V is the first 512 columns of a key row.
pub const D_V: usize = 512;

/// Arguments of a dense decode (see the module documentation for shapes).
#[derive(Debug)]
pub struct DenseDecodeArgs<'a, T> {
    /// `[b, s_q, h_q, d_qk]` bf16 or f16, last dimension contiguous.
    pub q: &'a T,
    /// `[num_blocks, page_size, h_kv, d_qk]`, q's dtype, last dimension contiguous.
    pub k_cache: &'a T,
    /// `[b, max_blocks]` i32 block ids.
    pub block_table: &'a T,
    /// `[b]` i32 tokens per request, `0..=max_blocks * page_size`.
    pub cache_seqlens: &'a T,
    /// Logit scale; `None` means `d_qk^-0.5`.
    pub softmax_scale: Option<f32>,
    /// Bottom-right causal mask: query `i` sees keys `< s_k - s_q + i + 1` (no effect when `s_q == 1`).
    pub causal: bool,
    /// `[h_q]` f32 sink logits, optional.
    pub attn_sink: Option<&'a T>,
}

/// The extra cache of a sparse decode, attended in the same softmax as the main one.
#[derive(Debug)]
pub struct ExtraKvArgs<'a, T> {
    /// `[num_blocks, page_size, 1, bytes_per_token]`, same format as the main cache.
    pub k_cache: &'a T,
    /// `[b, s_q, extra_topk]` i32.
    pub indices: &'a T,
    /// `[b]` i32, optional.
    pub topk_length: Option<&'a T>,
}

/// Arguments of a sparse FP8 decode (see the module documentation for shapes).
#[derive(Debug)]
pub struct SparseDecodeArgs<'a, T> {
    /// `[b, s_q, h_q, d_qk]` bf16; `d_qk` 576 selects the V3.2 format, 512 MODEL1.
    pub q: &'a T,
    /// `[num_blocks, page_size, 1, bytes_per_token]` u8 (or f8e4m3); only the block stride may be padded.
    pub k_cache: &'a T,
    /// `[b, s_q, topk]` i32 token indices.
    pub indices: &'a T,
    /// `[b]` i32: entries at positions `>= topk_length[b]` are ignored (a value above `topk` uses all
    /// entries, a negative one none). Optional.
    pub topk_length: Option<&'a T>,
    /// Logit scale; `None` means `d_qk^-0.5`.
    pub softmax_scale: Option<f32>,
    /// `[h_q]` f32 sink logits, optional.
    pub attn_sink: Option<&'a T>,
    /// A second cache attended in the same softmax, optional.
    pub extra: Option<ExtraKvArgs<'a, T>>,
}

// Argument structs hold only references and scalars: copyable whatever the tensor type (a derive would
// demand `T: Copy`).
macro_rules! copy_without_bounds {
    ($($name:ident),*) => {$(
        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $name<'_, T> {}
    )*};
}
copy_without_bounds!(DenseDecodeArgs, ExtraKvArgs, SparseDecodeArgs);

/// Outputs of a decode.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOutput<T> {
    /// `[b, s_q, h_q, 512]`, q's dtype.
    pub out: T,
    /// `[b, h_q, s_q]` f32, natural log.
    pub lse: T,
}

/// Packs an f32 reference result into output tensors of `dtype` (bf16 or f16) and f32.
fn pack(
    res: DecodeResult<f32>,
    dtype: DType,
    [b, s_q, h_q, d_v]: [usize; 4],
) -> Result<DecodeOutput<HostTensor>> {
    let out_shape = [b, s_q, h_q, d_v];
    let n = res.out.len();
    let out = match dtype {
        DType::F16 => HostTensor::new(
            HostData::F16(try_collect(
                "decode out",
                n,
                res.out.iter().map(|&v| f16::from_f32(v)),
            )?),
            &out_shape,
        )?,
        _ => HostTensor::new(
            HostData::Bf16(try_collect(
                "decode out",
                n,
                res.out.iter().map(|&v| bf16::from_f32(v)),
            )?),
            &out_shape,
        )?,
    };
    Ok(DecodeOutput {
        out,
        lse: HostTensor::from_f32(res.lse, &[b, h_q, s_q])?,
    })
}

/// Dense decode on the CPU (f32 accumulation). See [`decode_dense_cpu_with`].
pub fn decode_dense_cpu(
    args: &DenseDecodeArgs<'_, HostTensor>,
) -> Result<DecodeOutput<HostTensor>> {
    decode_dense_cpu_with(args, CancelToken::never())
}

/// Dense decode on the CPU (f32 accumulation), stopping with [`Error::Interrupted`] soon after `cancel` is
/// cancelled (it is polled before every query row).
///
/// Validates ([`validate_dense`], then [`check_dense_values`] on the host values), then allocates f32 copies
/// of `q` and of the cache blocks the requests use (each once, however many requests share it), contiguous
/// copies of `block_table`, `cache_seqlens` and `attn_sink`, the f32 results, and the returned `out` (q's
/// dtype) and `lse` (f32) tensors.
pub fn decode_dense_cpu_with(
    args: &DenseDecodeArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<DecodeOutput<HostTensor>> {
    let dims = validate_dense(args)?;
    let mut block_table = args.block_table.to_i32_vec()?;
    let cache_seqlens = args.cache_seqlens.to_i32_vec()?;
    check_dense_values(&dims, &block_table, &cache_seqlens)?;
    let blocks = compact_blocks(&dims, &mut block_table, &cache_seqlens)?;
    let q = args.q.to_f32_vec()?;
    let k_cache = args.k_cache.rows_to_f32_vec(&blocks)?;
    let sink = args.attn_sink.map(HostTensor::to_f32_vec).transpose()?;
    let inputs = DenseDecodeInputs {
        q: &q,
        k_cache: &k_cache,
        block_table: &block_table,
        cache_seqlens: &cache_seqlens,
        attn_sink: sink.as_deref(),
    };
    let problem = DenseDecodeProblem {
        num_blocks: blocks.len(),
        ..dims.problem()
    };
    let res = reference::decode_dense_with::<f32>(&problem, &inputs, cancel)?;
    pack(res, dims.dtype, [dims.batch, dims.s_q, dims.h_q, dims.d_v])
}

/// The cache blocks a dense decode reads, ascending: `block_table[b][j]` for `j < ceil(cache_seqlens[b] /
/// page_size)` (values checked by [`check_dense_values`]). Rewrites `block_table` to index that list, with -1 in
/// the columns no key uses (the reference never reads them).
fn compact_blocks(
    dims: &DenseDecodeDims,
    block_table: &mut [i32],
    cache_seqlens: &[i32],
) -> Result<Vec<usize>> {
    let used =
        |b: usize| usize::try_from(cache_seqlens[b]).map_or(0, |n| n.div_ceil(dims.page_size));
    let mut blocks = try_with_capacity("decode referenced cache blocks", block_table.len())?;
    for (b, row) in block_table.chunks(dims.max_blocks.max(1)).enumerate() {
        let n = used(b).min(row.len());
        blocks.extend(row[..n].iter().filter_map(|&k| usize::try_from(k).ok()));
    }
    blocks.sort_unstable();
    blocks.dedup();
    for (b, row) in block_table.chunks_mut(dims.max_blocks.max(1)).enumerate() {
        let n = used(b).min(row.len());
        for (j, k) in row.iter_mut().enumerate() {
            let compact = usize::try_from(*k)
                .ok()
                .filter(|_| j < n)
                .and_then(|block| blocks.binary_search(&block).ok());
            // A compacted id is at most the block id it stands for (distinct, ascending ids), so it fits in i32.
            *k = compact.and_then(|c| i32::try_from(c).ok()).unwrap_or(-1);
        }
    }
    Ok(blocks)
}

/// The raw bytes behind a host FP8 cache (read in place, with its strides).
fn cache_bytes<'a>(arg: &str, t: &'a HostTensor) -> Result<&'a [u8]> {
    match t.data() {
        HostData::U8(v) => Ok(v),
        other => Err(Error::invalid(
            format!("{arg}.dtype"),
            "u8 storage on the host",
            other.dtype(),
        )),
    }
}

/// Sparse FP8 decode on the CPU (f32 accumulation; tokens dequantised as they are attended). See
/// [`decode_sparse_cpu_with`].
pub fn decode_sparse_cpu(
    args: &SparseDecodeArgs<'_, HostTensor>,
) -> Result<DecodeOutput<HostTensor>> {
    decode_sparse_cpu_with(args, CancelToken::never())
}

/// Sparse FP8 decode on the CPU, stopping with [`Error::Interrupted`] soon after `cancel` is cancelled (it is
/// polled before every query row).
///
/// Validates ([`validate_sparse`]; index and length values need no check), reads the caches in place
/// (padded block strides included), and allocates f32 copies of `q` and `attn_sink`, contiguous copies of
/// the indices and lengths, one row's dequantised tokens per worker thread, the f32 results, and the
/// returned `out` (bf16) and `lse` (f32) tensors.
pub fn decode_sparse_cpu_with(
    args: &SparseDecodeArgs<'_, HostTensor>,
    cancel: &CancelToken,
) -> Result<DecodeOutput<HostTensor>> {
    let dims = validate_sparse(args)?;
    let q = args.q.to_f32_vec()?;
    let sink = args.attn_sink.map(HostTensor::to_f32_vec).transpose()?;
    let indices = args.indices.to_i32_vec()?;
    let topk_length = args.topk_length.map(HostTensor::to_i32_vec).transpose()?;
    let extra_vals = match (&args.extra, &dims.extra) {
        (Some(e), Some(d)) => Some((
            cache_bytes("extra_k_cache", e.k_cache)?,
            e.indices.to_i32_vec()?,
            e.topk_length.map(HostTensor::to_i32_vec).transpose()?,
            *d,
        )),
        _ => None,
    };
    let inputs = SparseDecodeInputs {
        q: &q,
        kv: SparseKv {
            layout: dims.kv.layout,
            cache: cache_bytes("k_cache", args.k_cache)?,
            indices: &indices,
            topk: dims.kv.topk,
            topk_length: topk_length.as_deref(),
        },
        extra: extra_vals
            .as_ref()
            .map(|(cache, indices, lengths, d)| SparseKv {
                layout: d.layout,
                cache,
                indices,
                topk: d.topk,
                topk_length: lengths.as_deref(),
            }),
        attn_sink: sink.as_deref(),
    };
    let res = reference::decode_sparse_with::<f32>(&dims.problem(), &inputs, cancel)?;
    pack(res, DType::Bf16, [dims.batch, dims.s_q, dims.h_q, dims.d_v])
}

/// Options of the GPU decode. `Default` is the measured heuristic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Batch-invariant mode: every request's keys are cut into chunks that depend only on its own length (a fixed
    /// chunk budget), so its output and lse are bitwise the same whatever else is in the batch. Costs the balance
    /// of the default schedule on skewed batches and more workspace (see [`launch`]).
    pub batch_invariant: bool,
    /// Parts the balanced schedule cuts the work into (the split kernel's grid y); `None`: `sm_count /
    /// head_tiles`. Also the grid y of the batch-invariant mode, whose CTAs loop over its parts.
    pub num_parts: Option<usize>,
    /// Batch-invariant mode only: the chunk budget in line units (key tiles of 64 plus the per-chunk overhead of
    /// 4); `None`: the heuristic of [`launch::ScheduleGeometry::of`].
    pub chunk_tiles: Option<usize>,
}

/// Checks the caller-provided outputs of a dense decode: `out [b, s_q, h_q, 512]` in q's dtype and
/// `lse [b, h_q, s_q]` f32, on `loc`, last dimensions contiguous.
pub fn validate_dense_output<T: TensorMeta>(
    dims: &DenseDecodeDims,
    loc: Location,
    out: &DecodeOutput<T>,
) -> Result<()> {
    validate_output(
        [dims.batch, dims.s_q, dims.h_q, dims.d_v],
        dims.dtype,
        loc,
        out,
    )
}

/// Checks the caller-provided outputs of a sparse decode: `out [b, s_q, h_q, 512]` bf16 and `lse [b, h_q, s_q]`
/// f32, on `loc`, last dimensions contiguous.
pub fn validate_sparse_output<T: TensorMeta>(
    dims: &SparseDecodeDims,
    loc: Location,
    out: &DecodeOutput<T>,
) -> Result<()> {
    validate_output(
        [dims.batch, dims.s_q, dims.h_q, dims.d_v],
        DType::Bf16,
        loc,
        out,
    )
}

fn validate_output<T: TensorMeta>(
    [b, s_q, h_q, d_v]: [usize; 4],
    dtype: DType,
    loc: Location,
    out: &DecodeOutput<T>,
) -> Result<()> {
    for (arg, t, dtype, shape) in [
        ("out", &out.out, dtype, vec![b, s_q, h_q, d_v]),
        ("lse", &out.lse, DType::F32, vec![b, h_q, s_q]),
    ] {
        expect_location(arg, t, loc)?;
        expect_dtype(arg, t, &[dtype])?;
        expect_rank(arg, t, shape.len())?;
        expect_shape(arg, t, &shape)?;
        crate::validate::expect_last_dim_contiguous(arg, t)?;
    }
    Ok(())
}

/// Dense decode on the GPU: validates the arguments and the caller-provided outputs, checks the kernels' limits
/// (see [`launch`]) and queues the schedule, split and combine kernels on `gpu`'s stream. Asynchronous.
/// `workspace`: a contiguous f32 buffer of at least [`launch::dense_workspace_words`] elements, or `None` to
/// allocate one for the call. `cache_seqlens` values are clamped to `0..=max_blocks * page_size` and a block id
/// outside `0..num_blocks` is a missing key (no value is read on the host).
pub fn decode_dense_cuda(
    gpu: &Gpu,
    args: &DenseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    let dims = validate_dense(args)?;
    validate_dense_output(&dims, args.q.location(), out)?;
    launch::launch(gpu, &dims, args, out, options, workspace)
}

/// Sparse FP8 decode on the GPU: validates the arguments and the caller-provided outputs, checks the kernels' limits
/// (see [`launch`]: 16-byte aligned q rows, caches starting on 8 bytes with block strides that are multiples of 8)
/// and queues the schedule, split and combine kernels on `gpu`'s stream. Asynchronous. `workspace`: a contiguous f32
/// buffer of at least [`launch::sparse_workspace_words`] elements, or `None` to allocate one for the call. Index
/// and length values are data (no value is read on the host): an index outside `0..num_blocks * page_size` of its
/// cache is a missing key, lengths are clamped to `0..=topk`.
///
/// Numerics: each cache value is dequantised to bf16 as `e4m3 * scale` rounded once (exact for the power-of-two
/// scales the quantiser writes), then attended like the dense decode (bf16 tensor-core products, f32 softmax and
/// accumulation).
pub fn decode_sparse_cuda(
    gpu: &Gpu,
    args: &SparseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    let dims = validate_sparse(args)?;
    validate_sparse_output(&dims, args.q.location(), out)?;
    launch::launch_sparse(gpu, &dims, args, out, options, workspace)
}
