//! CPU reference of the FP8 KV-cache formats (docs/spec.md section 3): quantise and dequantise, token by token
//! and for whole paged caches.
//!
//! Values are f32 holding bf16 values (the cache's source dtype); the RoPE part is stored as bf16 unchanged,
//! the NoPE part as e4m3 with a power-of-two scale per tile (see [`crate::fp8::pow2_scale`]).

use crate::error::{Error, Result};
use crate::fp8::{e4m3_from_f32, e4m3_to_f32, e8m0_to_f32, pow2_scale, KvFormat};
use half::bf16;
use rayon::prelude::*;

/// Geometry of a paged FP8 cache `[num_blocks, page_size, 1, bytes_per_token]` whose blocks are
/// `block_stride` bytes apart (at least `page_size * bytes_per_token`; padding allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    /// Byte layout of each token.
    pub format: KvFormat,
    /// Number of blocks (pages).
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Bytes from one block to the next.
    pub block_stride: usize,
}

impl CacheLayout {
    /// A packed layout (no padding between blocks).
    pub fn packed(format: KvFormat, num_blocks: usize, page_size: usize) -> Self {
        CacheLayout {
            format,
            num_blocks,
            page_size,
            block_stride: page_size * format.bytes_per_token(),
        }
    }
    /// Bytes the cache occupies.
    pub fn total_bytes(&self) -> usize {
        self.num_blocks * self.block_stride
    }
    /// Tokens the cache holds.
    pub fn num_tokens(&self) -> usize {
        self.num_blocks * self.page_size
    }
    /// Checks that blocks do not overlap.
    pub fn check(&self) -> Result<()> {
        let need = self.page_size * self.format.bytes_per_token();
        if self.block_stride < need {
            return Err(Error::invalid(
                "k_cache.strides[0]",
                format!(
                    "at least page_size * {} = {need} bytes",
                    self.format.bytes_per_token()
                ),
                self.block_stride,
            ));
        }
        Ok(())
    }
}

/// Quantises token `t` of a block (`block` starts at the block's first byte) from `x` (`d_qk` values).
pub fn quantize_token(format: KvFormat, block: &mut [u8], page_size: usize, t: usize, x: &[f32]) {
    debug_assert_eq!(x.len(), format.d_qk());
    let tile = format.tile();
    let nope = format.nope_offset(t);
    let scales = format.scale_offset(t, page_size);
    for s in 0..format.num_scales() {
        let vals = &x[s * tile..(s + 1) * tile];
        let amax = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (scale, exp) = pow2_scale(amax);
        let inv = 1.0 / scale; // exact: a power of two
        for (i, &v) in vals.iter().enumerate() {
            block[nope + s * tile + i] = e4m3_from_f32(v * inv);
        }
        match format {
            KvFormat::V32 => {
                block[scales + 4 * s..scales + 4 * s + 4].copy_from_slice(&scale.to_le_bytes())
            }
            KvFormat::Model1 => block[scales + s] = (exp + 127) as u8,
        }
    }
    if format == KvFormat::Model1 {
        block[scales + format.num_scales()] = 0; // pad byte
    }
    let rope = format.rope_offset(t);
    for (i, &v) in x[format.d_nope()..].iter().enumerate() {
        block[rope + 2 * i..rope + 2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes());
    }
}

/// The scale of tile `s` of token `t`.
pub fn token_scale(format: KvFormat, block: &[u8], page_size: usize, t: usize, s: usize) -> f32 {
    let at = format.scale_offset(t, page_size);
    match format {
        KvFormat::V32 => {
            let b = &block[at + 4 * s..at + 4 * s + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        KvFormat::Model1 => e8m0_to_f32(block[at + s]),
    }
}

/// Dequantises token `t` of a block into `out` (`d_qk` values): `fp8 * scale` for NoPE, bf16 RoPE as is.
pub fn dequantize_token(
    format: KvFormat,
    block: &[u8],
    page_size: usize,
    t: usize,
    out: &mut [f32],
) {
    debug_assert_eq!(out.len(), format.d_qk());
    let tile = format.tile();
    let nope = format.nope_offset(t);
    for s in 0..format.num_scales() {
        let scale = token_scale(format, block, page_size, t, s);
        for i in 0..tile {
            out[s * tile + i] = e4m3_to_f32(block[nope + s * tile + i]) * scale;
        }
    }
    let rope = format.rope_offset(t);
    for i in 0..KvFormat::D_ROPE {
        let b = [block[rope + 2 * i], block[rope + 2 * i + 1]];
        out[format.d_nope() + i] = bf16::from_le_bytes(b).to_f32();
    }
}

/// Quantises a whole cache. `kv` holds `num_blocks * page_size` tokens of `d_qk` values, token-major;
/// padding bytes between blocks are zero.
pub fn quantize_cache(layout: &CacheLayout, kv: &[f32]) -> Result<Vec<u8>> {
    layout.check()?;
    let d = layout.format.d_qk();
    if kv.len() != layout.num_tokens() * d {
        return Err(Error::invalid(
            "kv",
            format!(
                "{} values ({} tokens x {d})",
                layout.num_tokens() * d,
                layout.num_tokens()
            ),
            kv.len(),
        ));
    }
    let mut cache = crate::alloc::try_filled("FP8 cache", layout.total_bytes(), 0u8)?;
    if layout.block_stride == 0 {
        return Ok(cache);
    }
    cache
        .par_chunks_mut(layout.block_stride)
        .enumerate()
        .for_each(|(b, block)| {
            for t in 0..layout.page_size {
                let tok = b * layout.page_size + t;
                quantize_token(
                    layout.format,
                    block,
                    layout.page_size,
                    t,
                    &kv[tok * d..(tok + 1) * d],
                );
            }
        });
    Ok(cache)
}

/// Dequantises a whole cache into `num_blocks * page_size` tokens of `d_qk` values.
pub fn dequantize_cache(layout: &CacheLayout, cache: &[u8]) -> Result<Vec<f32>> {
    layout.check()?;
    if cache.len() < layout.total_bytes() {
        return Err(Error::invalid(
            "k_cache",
            format!("at least {} bytes", layout.total_bytes()),
            cache.len(),
        ));
    }
    let d = layout.format.d_qk();
    let mut out = crate::alloc::try_filled("dequantised values", layout.num_tokens() * d, 0f32)?;
    if out.is_empty() {
        return Ok(out);
    }
    out.par_chunks_mut(layout.page_size * d)
        .enumerate()
        .for_each(|(b, dst)| {
            let block = &cache[b * layout.block_stride..];
            for t in 0..layout.page_size {
                dequantize_token(
                    layout.format,
                    block,
                    layout.page_size,
                    t,
                    &mut dst[t * d..(t + 1) * d],
                );
            }
        });
    Ok(out)
}
