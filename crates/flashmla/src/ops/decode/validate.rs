//! Shape, dtype and stride checks of the decode ops (shared by every backend), plus the host-side value
//! checks the CPU path runs on `block_table` / `cache_seqlens`.

use super::{DenseDecodeArgs, ExtraKvArgs, SparseDecodeArgs, D_V};
use crate::error::{Error, Result};
use crate::fp8::KvFormat;
use crate::reference::decode::{DenseDecodeProblem, SparseDecodeProblem};
use crate::reference::kv_quant::CacheLayout;
use crate::tensor::{DType, TensorMeta};
use crate::validate::{
    expect_dim, expect_dtype, expect_last_dim_contiguous, expect_location, expect_offsets_fit,
    expect_positive_finite, expect_range, expect_rank, expect_shape, optional,
};

/// Key widths a dense decode accepts: the two MLA widths (V3.2 and MODEL1); `d_v` is always [`D_V`].
pub const DENSE_D_QK: [usize; 2] = [576, 512];

/// Largest element offset any tensor may reach: kernels index with 64-bit signed offsets.
const MAX_OFFSET: usize = i64::MAX as usize;

/// Validated dimensions of a dense decode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DenseDecodeDims {
    /// Requests `b`.
    pub batch: usize,
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key heads (`h_q % h_kv == 0`).
    pub h_kv: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Value width ([`D_V`]).
    pub d_v: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// The logit scale (given, or `d_qk^-0.5`).
    pub softmax_scale: f32,
    /// Bottom-right causal masking.
    pub causal: bool,
    /// Element type of `q`, `k_cache` and `out`.
    pub dtype: DType,
}

impl DenseDecodeDims {
    /// The reference problem of these dimensions.
    pub fn problem(&self) -> DenseDecodeProblem {
        DenseDecodeProblem {
            batch: self.batch,
            s_q: self.s_q,
            h_q: self.h_q,
            h_kv: self.h_kv,
            d_qk: self.d_qk,
            d_v: self.d_v,
            num_blocks: self.num_blocks,
            page_size: self.page_size,
            max_blocks: self.max_blocks,
            softmax_scale: self.softmax_scale,
            causal: self.causal,
        }
    }
}

/// Validated geometry of one FP8 cache and its indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseKvDims {
    /// Byte layout of the cache (block stride from `strides()[0]`).
    pub layout: CacheLayout,
    /// Entries per query row of the indices.
    pub topk: usize,
}

/// Validated dimensions of a sparse FP8 decode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseDecodeDims {
    /// Requests `b`.
    pub batch: usize,
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width, which picks the cache format (576: V3.2, 512: MODEL1).
    pub d_qk: usize,
    /// Value width ([`D_V`]).
    pub d_v: usize,
    /// The logit scale (given, or `d_qk^-0.5`).
    pub softmax_scale: f32,
    /// The main cache.
    pub kv: SparseKvDims,
    /// The extra cache, when given.
    pub extra: Option<SparseKvDims>,
}

impl SparseDecodeDims {
    /// The reference problem of these dimensions.
    pub fn problem(&self) -> SparseDecodeProblem {
        SparseDecodeProblem {
            batch: self.batch,
            s_q: self.s_q,
            h_q: self.h_q,
            d_v: self.d_v,
            softmax_scale: self.softmax_scale,
        }
    }
}

/// A size that must be at least 1.
fn expect_nonzero(arg: &str, value: usize, what: &str) -> Result<()> {
    if value > 0 {
        return Ok(());
    }
    Err(Error::invalid(arg, format!("{what} >= 1"), value))
}

/// `softmax_scale`, or the spec default `d_qk^-0.5`.
fn softmax_scale(given: Option<f32>, d_qk: usize) -> Result<f32> {
    let scale = given.unwrap_or_else(|| (d_qk as f32).sqrt().recip());
    expect_positive_finite("softmax_scale", scale)?;
    Ok(scale)
}

/// The query `[b, s_q, h_q, d_qk]`: dtype, rank, non-empty sizes, last dimension contiguous.
fn check_q(q: &impl TensorMeta, dtypes: &[DType]) -> Result<[usize; 4]> {
    expect_dtype("q", q, dtypes)?;
    expect_rank("q", q, 4)?;
    let s = q.shape();
    for (d, name) in ["b", "s_q", "h_q"].iter().enumerate() {
        expect_nonzero(&format!("q.shape[{d}]"), s[d], name)?;
    }
    expect_last_dim_contiguous("q", q)?;
    expect_offsets_fit("q", q, MAX_OFFSET, "i64")?;
    Ok([s[0], s[1], s[2], s[3]])
}

/// An i32 tensor of `shape` on `q`'s device whose last dimension is contiguous.
fn check_i32(arg: &str, t: &impl TensorMeta, q: &impl TensorMeta, shape: &[usize]) -> Result<()> {
    expect_location(arg, t, q.location())?;
    expect_dtype(arg, t, &[DType::I32])?;
    expect_shape(arg, t, shape)?;
    expect_last_dim_contiguous(arg, t)?;
    expect_offsets_fit(arg, t, MAX_OFFSET, "i64")
}

/// `attn_sink [h_q] f32` on `q`'s device.
fn check_sink(sink: Option<&impl TensorMeta>, q: &impl TensorMeta, h_q: usize) -> Result<()> {
    optional(sink, |s| {
        expect_location("attn_sink", s, q.location())?;
        expect_dtype("attn_sink", s, &[DType::F32])?;
        expect_shape("attn_sink", s, &[h_q])
    })
}

/// Checks a dense decode's tensors: `q [b, s_q, h_q, d_qk]` bf16 or f16 with `d_qk` in [`DENSE_D_QK`];
/// `k_cache [num_blocks, page_size, h_kv, d_qk]` of q's dtype, `h_q % h_kv == 0`; `block_table [b, max_blocks]`
/// and `cache_seqlens [b]` i32; `attn_sink [h_q]` f32. Every tensor on q's device with its last dimension
/// contiguous (other strides free). Values are not read: see [`check_dense_values`].
pub fn validate_dense<T: TensorMeta>(args: &DenseDecodeArgs<'_, T>) -> Result<DenseDecodeDims> {
    let q = args.q;
    let [batch, s_q, h_q, d_qk] = check_q(q, &[DType::Bf16, DType::F16])?;
    if !DENSE_D_QK.contains(&d_qk) {
        return Err(Error::invalid(
            "q.shape[3]",
            format!("d_qk in {DENSE_D_QK:?}"),
            d_qk,
        ));
    }

    let k = args.k_cache;
    expect_location("k_cache", k, q.location())?;
    expect_dtype("k_cache", k, &[q.dtype()])?;
    expect_rank("k_cache", k, 4)?;
    let [num_blocks, page_size, h_kv] = [k.shape()[0], k.shape()[1], k.shape()[2]];
    expect_nonzero("k_cache.shape[0]", num_blocks, "num_blocks")?;
    expect_nonzero("k_cache.shape[1]", page_size, "page_size")?;
    expect_range("k_cache.shape[2]", h_kv, 1, h_q)?;
    if h_q % h_kv != 0 {
        return Err(Error::invalid(
            "q.shape[2]",
            format!("h_q a multiple of h_kv = {h_kv} (k_cache.shape[2])"),
            h_q,
        ));
    }
    expect_dim("k_cache", k, 3, d_qk, "d_qk, as q")?;
    expect_last_dim_contiguous("k_cache", k)?;
    expect_offsets_fit("k_cache", k, MAX_OFFSET, "i64")?;

    expect_rank("block_table", args.block_table, 2)?;
    let max_blocks = args.block_table.shape()[1];
    check_i32("block_table", args.block_table, q, &[batch, max_blocks])?;
    check_i32("cache_seqlens", args.cache_seqlens, q, &[batch])?;
    check_sink(args.attn_sink, q, h_q)?;

    Ok(DenseDecodeDims {
        batch,
        s_q,
        h_q,
        h_kv,
        d_qk,
        d_v: D_V,
        num_blocks,
        page_size,
        max_blocks,
        softmax_scale: softmax_scale(args.softmax_scale, d_qk)?,
        causal: args.causal,
        dtype: q.dtype(),
    })
}

/// Host-side value checks of a dense decode (the CPU path runs them; a GPU path cannot read device memory
/// without a synchronisation, and its kernel instead treats an out-of-range block id as a missing key and
/// clamps `cache_seqlens` to `0..=max_blocks * page_size`, as the reference does):
/// `0 <= cache_seqlens[b] <= max_blocks * page_size`, and every block a request uses
/// (`block_table[b][j]` for `j < ceil(cache_seqlens[b] / page_size)`) is in `0..num_blocks`.
/// `block_table` and `cache_seqlens` are contiguous `[b, max_blocks]` and `[b]` values.
pub fn check_dense_values(
    dims: &DenseDecodeDims,
    block_table: &[i32],
    cache_seqlens: &[i32],
) -> Result<()> {
    let cap = dims.max_blocks * dims.page_size;
    for (b, &len) in cache_seqlens.iter().enumerate() {
        let n = usize::try_from(len)
            .ok()
            .filter(|&n| n <= cap)
            .ok_or_else(|| {
                Error::invalid(
                    format!("cache_seqlens[{b}]"),
                    format!(
                        "a value in 0..={cap} (max_blocks {} * page_size {})",
                        dims.max_blocks, dims.page_size
                    ),
                    len,
                )
            })?;
        let row = &block_table[b * dims.max_blocks..(b + 1) * dims.max_blocks];
        for (j, &block) in row.iter().enumerate().take(n.div_ceil(dims.page_size)) {
            if usize::try_from(block).map_or(true, |k| k >= dims.num_blocks) {
                return Err(Error::invalid(
                    format!("block_table[{b}][{j}]"),
                    format!(
                        "a block id in 0..{} (block {j} holds keys of cache_seqlens[{b}] = {len})",
                        dims.num_blocks
                    ),
                    block,
                ));
            }
        }
    }
    Ok(())
}

/// Checks one FP8 cache `[num_blocks, page_size, 1, bytes_per_token]` (u8 or f8e4m3; tokens packed inside a
/// block, block stride `strides()[0] >= page_size * bytes_per_token`) and its `indices [b, s_q, topk]` i32
/// and `topk_length [b]` i32.
fn check_sparse_kv<T: TensorMeta>(
    names: [&str; 3],
    (cache, indices, topk_length): (&T, &T, Option<&T>),
    q: &T,
    format: KvFormat,
) -> Result<SparseKvDims> {
    let [cache_name, indices_name, length_name] = names;
    let bpt = format.bytes_per_token();
    expect_location(cache_name, cache, q.location())?;
    expect_dtype(cache_name, cache, &[DType::U8, DType::F8E4M3])?;
    expect_rank(cache_name, cache, 4)?;
    let [num_blocks, page_size] = [cache.shape()[0], cache.shape()[1]];
    expect_nonzero(&format!("{cache_name}.shape[0]"), num_blocks, "num_blocks")?;
    expect_nonzero(&format!("{cache_name}.shape[1]"), page_size, "page_size")?;
    expect_dim(cache_name, cache, 2, 1, "h_kv = 1 for sparse decode")?;
    let what = format!(
        "bytes per token of the {} format (d_qk {})",
        format.name(),
        format.d_qk()
    );
    expect_dim(cache_name, cache, 3, bpt, &what)?;
    let strides = cache.strides();
    // Tokens must be packed inside a block (MODEL1 places a block's scales after all its values);
    // only the block stride may be padded. Strides of size-1 dimensions do not matter.
    let packed = [(1, page_size, bpt), (3, bpt, 1)];
    for (d, size, want) in packed {
        if size > 1 && strides[d] != want {
            return Err(Error::invalid(
                format!("{cache_name}.strides[{d}]"),
                format!("{want} (tokens packed inside a block)"),
                strides[d],
            ));
        }
    }
    let block_bytes = page_size * bpt;
    let block_stride = if num_blocks > 1 {
        strides[0]
    } else {
        block_bytes
    };
    if block_stride < block_bytes {
        return Err(Error::invalid(
            format!("{cache_name}.strides[0]"),
            format!("at least page_size * {bpt} = {block_bytes} bytes"),
            block_stride,
        ));
    }
    expect_offsets_fit(cache_name, cache, MAX_OFFSET, "i64")?;

    let [batch, s_q] = [q.shape()[0], q.shape()[1]];
    expect_rank(indices_name, indices, 3)?;
    let topk = indices.shape()[2];
    expect_nonzero(&format!("{indices_name}.shape[2]"), topk, "topk")?;
    check_i32(indices_name, indices, q, &[batch, s_q, topk])?;
    optional(topk_length, |t| check_i32(length_name, t, q, &[batch]))?;
    Ok(SparseKvDims {
        layout: CacheLayout {
            format,
            num_blocks,
            page_size,
            block_stride,
        },
        topk,
    })
}

/// Checks a sparse FP8 decode's tensors: `q [b, s_q, h_q, d_qk]` bf16 with `d_qk` 576 (V3.2 cache) or 512
/// (MODEL1 cache); each cache `[num_blocks, page_size, 1, bytes_per_token]` u8/f8e4m3 with packed tokens and
/// a possibly padded block stride; `indices [b, s_q, topk]`, `topk_length [b]` i32 (same for the extra
/// cache); `attn_sink [h_q]` f32. Index and length values are data, not errors (see
/// [`crate::reference::decode`] for how out-of-range values are treated).
pub fn validate_sparse<T: TensorMeta>(args: &SparseDecodeArgs<'_, T>) -> Result<SparseDecodeDims> {
    let q = args.q;
    let [batch, s_q, h_q, d_qk] = check_q(q, &[DType::Bf16])?;
    let format = KvFormat::for_d_qk(d_qk).map_err(|_| {
        Error::invalid(
            "q.shape[3]",
            "d_qk 576 (V3.2 cache) or 512 (MODEL1 cache)",
            d_qk,
        )
    })?;
    let kv = check_sparse_kv(
        ["k_cache", "indices", "topk_length"],
        (args.k_cache, args.indices, args.topk_length),
        q,
        format,
    )?;
    let extra = match &args.extra {
        None => None,
        Some(ExtraKvArgs {
            k_cache,
            indices,
            topk_length,
        }) => Some(check_sparse_kv(
            ["extra_k_cache", "extra_indices", "extra_topk_length"],
            (*k_cache, *indices, *topk_length),
            q,
            format,
        )?),
    };
    check_sink(args.attn_sink, q, h_q)?;
    Ok(SparseDecodeDims {
        batch,
        s_q,
        h_q,
        d_qk,
        d_v: D_V,
        softmax_scale: softmax_scale(args.softmax_scale, d_qk)?,
        kv,
        extra,
    })
}
