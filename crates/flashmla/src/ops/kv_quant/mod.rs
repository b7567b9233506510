//! FP8 KV-cache quantise and dequantise (docs/spec.md section 3): bf16 latent rows <-> the V3.2 (656 bytes/token) or
//! MODEL1 (584 bytes/token) cache layout, with the reference quantiser's power-of-two scales.
//!
//! | argument | shape | dtype |
//! | --- | --- | --- |
//! | `kv` | `[num_blocks, page_size, 1, d_qk]`, `d_qk` 576 (V3.2) or 512 (MODEL1) | bf16 (any strides, last dim contiguous) |
//! | `cache` | `[num_blocks, page_size, 1, bytes_per_token]`, 656 or 584 | u8 or f8e4m3 (tokens packed in a block; block stride may be padded) |
//!
//! Quantise writes every token's bytes (values, scales, MODEL1's pad byte) and nothing else: **bytes between
//! blocks (block-stride padding) are left untouched**, on both backends. Dequantise writes bf16 values
//! `e4m3 * scale` rounded to nearest even (RoPE values are copied); a NaN result is written as the canonical
//! bf16 NaN (NaN payloads are not part of the contract, NaN positions are).
//!
//! The GPU kernels are bit-exact with the CPU path ([`crate::reference::kv_quant`]): same scale (computed on the
//! exponent bits of `amax / 448` with IEEE division), same e4m3 rounding (nearest even, saturating to ±448; a
//! NaN input keeps its sign, `0x7F | sign`), NaN ignored by the tile maximum (as `f32::max` does), a tile holding
//! ±inf gets the scale 2^127.
//!
//! CPU: [`quantize_cpu`] (new packed cache), [`quantize_cpu_into`] (into a given cache, any block stride),
//! [`dequantize_cpu`]. GPU: [`quantize_cuda`], [`dequantize_cuda`] (kernels in `csrc/sm90/kv_quant/`).

pub mod launch;
pub mod validate;

pub use launch::{dequantize_cuda, quantize_cuda};
pub use validate::{
    validate_dequantize, validate_dequantize_output, validate_quantize, validate_quantize_output,
    KvQuantDims,
};

use crate::error::{Error, Result};
use crate::reference::kv_quant::{dequantize_cache, quantize_token, CacheLayout};
use crate::tensor::{HostData, HostTensor, Layout, TensorMeta};
use rayon::prelude::*;

/// Quantise input, generic over the tensor type ([`HostTensor`] or [`crate::DeviceView`]).
#[derive(Debug)]
pub struct QuantizeArgs<'a, T> {
    /// Values `[num_blocks, page_size, 1, d_qk]` bf16.
    pub kv: &'a T,
}

/// Quantise output.
#[derive(Debug)]
pub struct QuantizeOutput<T> {
    /// Cache `[num_blocks, page_size, 1, bytes_per_token]` u8 (or f8e4m3 on the GPU).
    pub cache: T,
}

/// Dequantise input.
#[derive(Debug)]
pub struct DequantizeArgs<'a, T> {
    /// Cache `[num_blocks, page_size, 1, bytes_per_token]` u8/f8e4m3; the last dimension picks the format.
    pub cache: &'a T,
}

/// Dequantise output.
#[derive(Debug)]
pub struct DequantizeOutput<T> {
    /// Values `[num_blocks, page_size, 1, d_qk]` bf16.
    pub kv: T,
}

/// Quantises `kv` into a new packed u8 cache (block stride `page_size * bytes_per_token`).
pub fn quantize_cpu(args: &QuantizeArgs<'_, HostTensor>) -> Result<QuantizeOutput<HostTensor>> {
    let dims = validate_quantize(args)?;
    let packed = CacheLayout::packed(dims.format, dims.num_blocks, dims.page_size);
    let bytes = crate::alloc::try_filled("kv_quantize cache", packed.total_bytes(), 0u8)?;
    let cache = HostTensor::from_u8(bytes, &dims.cache_shape())?;
    Ok(QuantizeOutput {
        cache: quantize_cpu_into(args, cache)?,
    })
}

/// Quantises `kv` into `cache` (u8, any valid block stride) and returns it: every token's bytes are rewritten,
/// the bytes between blocks keep their values.
pub fn quantize_cpu_into(
    args: &QuantizeArgs<'_, HostTensor>,
    cache: HostTensor,
) -> Result<HostTensor> {
    let dims = validate_quantize(args)?;
    let out = QuantizeOutput { cache };
    validate_quantize_output(&dims, &out)?;
    let layout = validate::cache_layout(&dims, &out.cache);
    let cache_layout: Layout = out.cache.layout().clone();
    let HostData::U8(mut storage) = out.cache.into_data() else {
        return Err(Error::invalid(
            "cache.dtype",
            "u8 (host caches are bytes)",
            "another dtype",
        ));
    };
    let values = args.kv.to_f32_vec()?;
    let d = dims.format.d_qk();
    let block_bytes = dims.page_size * dims.format.bytes_per_token();
    if dims.num_tokens() > 0 {
        // Block b owns bytes [b * block_stride, b * block_stride + block_bytes); the storage holds at least
        // (num_blocks - 1) * block_stride + block_bytes bytes (the layout's span), so the last chunk is long enough.
        let chunk = layout.block_stride.max(block_bytes);
        storage
            .par_chunks_mut(chunk)
            .take(dims.num_blocks)
            .enumerate()
            .for_each(|(b, block)| {
                let block = &mut block[..block_bytes];
                for t in 0..dims.page_size {
                    let tok = b * dims.page_size + t;
                    quantize_token(
                        dims.format,
                        block,
                        dims.page_size,
                        t,
                        &values[tok * d..(tok + 1) * d],
                    );
                }
            });
    }
    HostTensor::with_layout(HostData::U8(storage), cache_layout)
}

/// Dequantises `cache` into a new contiguous bf16 tensor `[num_blocks, page_size, 1, d_qk]`.
pub fn dequantize_cpu(
    args: &DequantizeArgs<'_, HostTensor>,
) -> Result<DequantizeOutput<HostTensor>> {
    let dims = validate_dequantize(args)?;
    // Gathering the bytes row-major packs the blocks (drops any padding): exactly the packed layout.
    let bytes = args.cache.to_u8_vec()?;
    let packed = CacheLayout::packed(dims.format, dims.num_blocks, dims.page_size);
    let values = dequantize_cache(&packed, &bytes)?;
    Ok(DequantizeOutput {
        kv: HostTensor::bf16_from_f32(&values, &dims.kv_shape())?,
    })
}
