//! Checks of the FP8 KV-cache quantise / dequantise arguments, written once for both backends
//! (generic over [`TensorMeta`]). Device-only conditions (pointer alignment, the device ordinal) are checked by
//! [`super::launch`].

use super::{DequantizeArgs, DequantizeOutput, QuantizeArgs, QuantizeOutput};
use crate::error::{Error, Result};
use crate::fp8::KvFormat;
use crate::reference::kv_quant::CacheLayout;
use crate::tensor::{DType, Location, TensorMeta};
use crate::validate::{
    expect_dim, expect_dtype, expect_last_dim_contiguous, expect_location, expect_offsets_fit,
    expect_rank,
};

/// Largest element offset a kernel computes (it indexes with `int64_t`).
pub const MAX_OFFSET: usize = i64::MAX as usize;

/// Dtype of the values side (`kv`).
pub const KV_DTYPE: DType = DType::Bf16;
/// Dtypes accepted for the cache (raw bytes; PyTorch callers often hold it as float8_e4m3fn).
pub const CACHE_DTYPES: [DType; 2] = [DType::U8, DType::F8E4M3];

/// Validated geometry shared by quantise and dequantise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuantDims {
    /// Cache format, picked by `d_qk` (576: V3.2, 512: MODEL1) or by the cache's bytes per token.
    pub format: KvFormat,
    /// Blocks (pages).
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Elements from one `kv` block to the next (as given; irrelevant when `num_blocks <= 1`).
    pub kv_block_stride: usize,
    /// Elements from one `kv` token to the next (as given; irrelevant when `page_size <= 1`).
    pub kv_token_stride: usize,
    /// Where the cache lives.
    pub location: Location,
}

impl KvQuantDims {
    /// Tokens in the cache.
    pub fn num_tokens(&self) -> usize {
        self.num_blocks * self.page_size
    }
    /// `[num_blocks, page_size, 1, d_qk]`, the shape of the values side.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.num_blocks, self.page_size, 1, self.format.d_qk()]
    }
    /// `[num_blocks, page_size, 1, bytes_per_token]`, the shape of the cache.
    pub fn cache_shape(&self) -> [usize; 4] {
        [
            self.num_blocks,
            self.page_size,
            1,
            self.format.bytes_per_token(),
        ]
    }
}

/// The values side: `[num_blocks, page_size, 1, d_qk]` bf16, `d_qk` 576 or 512, last dimension contiguous.
/// As an output (`written`), no two elements may share memory.
fn check_kv<T: TensorMeta>(arg: &str, kv: &T, written: bool) -> Result<KvFormat> {
    expect_dtype(arg, kv, &[KV_DTYPE])?;
    expect_rank(arg, kv, 4)?;
    expect_dim(arg, kv, 2, 1, "one latent head")?;
    let d_qk = kv.shape()[3];
    let format = KvFormat::for_d_qk(d_qk).map_err(|_| {
        Error::invalid(
            format!("{arg}.shape[3]"),
            "d_qk 576 (V3.2 format) or 512 (MODEL1 format)",
            d_qk,
        )
    })?;
    expect_last_dim_contiguous(arg, kv)?;
    expect_offsets_fit(arg, kv, MAX_OFFSET, "i64")?;
    if written {
        expect_rows_disjoint(arg, kv.shape(), kv.strides(), d_qk)?;
    }
    Ok(format)
}

/// Rows of `width` contiguous elements indexed by dims 0 and 1 do not overlap: ordering the two (non-trivial)
/// dimensions by stride, the inner stride is at least `width` and the outer at least the inner's whole extent.
fn expect_rows_disjoint(arg: &str, shape: &[usize], strides: &[usize], width: usize) -> Result<()> {
    let mut dims: Vec<usize> = (0..2).filter(|&d| shape[d] > 1).collect();
    dims.sort_by_key(|&d| strides[d]);
    let mut extent = width;
    for d in dims {
        if strides[d] < extent {
            return Err(Error::invalid(
                format!("{arg}.strides[{d}]"),
                format!("at least {extent} elements (rows of an output must not overlap)"),
                strides[d],
            ));
        }
        extent += (shape[d] - 1) * strides[d];
    }
    Ok(())
}

/// The cache: `[num_blocks, page_size, 1, bytes_per_token]` u8/f8e4m3 in `format` (when known; else picked by
/// the last dimension), tokens packed inside a block (token stride = bytes per token, as MODEL1 places a block's
/// scales after all its values), block stride at least `page_size * bytes_per_token`.
fn check_cache<T: TensorMeta>(
    arg: &str,
    cache: &T,
    format: Option<KvFormat>,
) -> Result<(KvFormat, usize)> {
    expect_dtype(arg, cache, &CACHE_DTYPES)?;
    expect_rank(arg, cache, 4)?;
    expect_dim(arg, cache, 2, 1, "one latent head")?;
    let bpt = cache.shape()[3];
    let format = match format {
        Some(f) => {
            let what = format!(
                "bytes per token of the {} format (d_qk {})",
                f.name(),
                f.d_qk()
            );
            expect_dim(arg, cache, 3, f.bytes_per_token(), &what)?;
            f
        }
        None => KvFormat::ALL
            .into_iter()
            .find(|f| f.bytes_per_token() == bpt)
            .ok_or_else(|| {
                Error::invalid(
                    format!("{arg}.shape[3]"),
                    format!(
                        "{} (V3.2 format) or {} (MODEL1 format) bytes per token",
                        KvFormat::V32.bytes_per_token(),
                        KvFormat::Model1.bytes_per_token()
                    ),
                    bpt,
                )
            })?,
    };
    let (num_blocks, page_size) = (cache.shape()[0], cache.shape()[1]);
    let strides = cache.strides();
    for (d, size, want) in [(1, page_size, bpt), (3, bpt, 1)] {
        if size > 1 && strides[d] != want {
            return Err(Error::invalid(
                format!("{arg}.strides[{d}]"),
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
            format!("{arg}.strides[0]"),
            format!("at least page_size * {bpt} = {block_bytes} bytes (blocks must not overlap)"),
            block_stride,
        ));
    }
    expect_offsets_fit(arg, cache, MAX_OFFSET, "i64")?;
    Ok((format, block_stride))
}

/// The cache geometry as the reference sees it (packed when `num_blocks <= 1`).
pub fn cache_layout<T: TensorMeta>(dims: &KvQuantDims, cache: &T) -> CacheLayout {
    let packed = CacheLayout::packed(dims.format, dims.num_blocks, dims.page_size);
    CacheLayout {
        block_stride: if dims.num_blocks > 1 {
            cache.strides()[0]
        } else {
            packed.block_stride
        },
        ..packed
    }
}

fn dims_of<T: TensorMeta>(format: KvFormat, kv: &T, location: Location) -> KvQuantDims {
    KvQuantDims {
        format,
        num_blocks: kv.shape()[0],
        page_size: kv.shape()[1],
        kv_block_stride: kv.strides()[0],
        kv_token_stride: kv.strides()[1],
        location,
    }
}

/// Checks a quantise input: `kv [num_blocks, page_size, 1, d_qk]` bf16 (any strides, last dimension contiguous).
pub fn validate_quantize<T: TensorMeta>(args: &QuantizeArgs<'_, T>) -> Result<KvQuantDims> {
    let format = check_kv("kv", args.kv, false)?;
    Ok(dims_of(format, args.kv, args.kv.location()))
}

/// Checks a quantise output against the validated input: `cache [num_blocks, page_size, 1, bytes_per_token]`
/// u8/f8e4m3 in the format `d_qk` picks, on the input's device.
pub fn validate_quantize_output<T: TensorMeta>(
    dims: &KvQuantDims,
    out: &QuantizeOutput<T>,
) -> Result<()> {
    expect_location("cache", &out.cache, dims.location)?;
    check_cache("cache", &out.cache, Some(dims.format))?;
    for d in 0..2 {
        expect_dim(
            "cache",
            &out.cache,
            d,
            dims.kv_shape()[d],
            ["num_blocks, as kv", "page_size, as kv"][d],
        )?;
    }
    Ok(())
}

/// Checks a dequantise input: `cache [num_blocks, page_size, 1, 656 | 584]` u8/f8e4m3 (the last dimension picks
/// the format), tokens packed inside a block, block stride possibly padded.
pub fn validate_dequantize<T: TensorMeta>(args: &DequantizeArgs<'_, T>) -> Result<KvQuantDims> {
    let (format, _) = check_cache("cache", args.cache, None)?;
    let c = args.cache;
    Ok(KvQuantDims {
        format,
        num_blocks: c.shape()[0],
        page_size: c.shape()[1],
        kv_block_stride: format.d_qk() * c.shape()[1],
        kv_token_stride: format.d_qk(),
        location: c.location(),
    })
}

/// Checks a dequantise output against the validated input: `kv [num_blocks, page_size, 1, d_qk]` bf16 on the
/// cache's device, last dimension contiguous, rows not overlapping (other strides free). Returns the dims with
/// the output's strides.
pub fn validate_dequantize_output<T: TensorMeta>(
    dims: &KvQuantDims,
    out: &DequantizeOutput<T>,
) -> Result<KvQuantDims> {
    expect_location("kv", &out.kv, dims.location)?;
    let format = check_kv("kv", &out.kv, true)?;
    if format != dims.format {
        return Err(Error::invalid(
            "kv.shape[3]",
            format!(
                "{} (d_qk of the cache's {} format)",
                dims.format.d_qk(),
                dims.format.name()
            ),
            out.kv.shape()[3],
        ));
    }
    for d in 0..2 {
        expect_dim(
            "kv",
            &out.kv,
            d,
            dims.cache_shape()[d],
            ["num_blocks, as cache", "page_size, as cache"][d],
        )?;
    }
    Ok(dims_of(format, &out.kv, dims.location))
}
