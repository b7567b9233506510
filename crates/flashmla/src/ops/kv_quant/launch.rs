//! GPU path of the FP8 KV-cache ops: lowers validated arguments to the kernel's [`KvQuantParams`], picks the
//! vector or scalar variant by alignment, and launches one warp per token
//! (`csrc/sm90/kv_quant/kv_quant.cu`).

use super::validate::{
    validate_dequantize, validate_dequantize_output, validate_quantize, validate_quantize_output,
    KvQuantDims,
};
use super::{DequantizeArgs, DequantizeOutput, QuantizeArgs, QuantizeOutput};
use crate::cuda::{device_params, DeviceParams, Gpu, LaunchConfig};
use crate::error::{Error, Result};
use crate::fp8::KvFormat;
use crate::tensor::{DType, DeviceView, Location, TensorMeta};
use crate::validate::{expect_location, to_i32, to_i64};

/// Kernel family (`csrc/sm90/kv_quant/`).
pub const FAMILY: &str = <KvQuantParams as DeviceParams>::FAMILY;
/// Tokens per CTA: one warp per token (`kWarpsPerCta` in kernel.cuh).
pub const WARPS_PER_CTA: u32 = 8;
/// Threads per warp.
const WARP_SIZE: u32 = 32;
/// Threads per CTA (`kThreads` in kernel.cuh).
pub const THREADS_PER_CTA: u32 = WARPS_PER_CTA * WARP_SIZE;
/// The vector variant reads/writes bf16 rows in 16-byte pieces (8 values): rows must start 16-byte aligned.
pub const VEC_KV_ALIGN_BYTES: u64 = 16;
/// The vector variant accesses the cache in 8-byte pieces: blocks must start 8-byte aligned (every per-token
/// offset inside a block is a multiple of 8 in both formats).
pub const VEC_CACHE_ALIGN_BYTES: u64 = 8;

device_params! {
    family = "kv_quant", cxx = "Params";
    /// Mirror of `flashmla::kv_quant::Params` (params.h), checked against it at compile time
    /// ([`crate::cuda::params`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct KvQuantParams {
        /// bf16 `[num_blocks, page_size, 1, d_qk]`, element `(b, t, 0, i)` at `kv + 2 * (b * kv_block_stride +
        /// t * kv_token_stride + i)` bytes. Read by quantise, written by dequantise.
        pub kv: u64,
        /// u8 `[num_blocks, page_size, 1, bytes_per_token]`, block `b` at `cache + b * cache_block_stride`.
        pub cache: u64,
        /// Elements between `kv` blocks.
        pub kv_block_stride: i64,
        /// Elements between `kv` tokens.
        pub kv_token_stride: i64,
        /// Bytes between cache blocks.
        pub cache_block_stride: i64,
        /// Blocks.
        pub num_blocks: i32,
        /// Tokens per block.
        pub page_size: i32,
        /// `num_blocks * page_size`.
        pub num_tokens: i32,
        /// Always 0 (keeps the size a multiple of 8 on both sides).
        pub reserved: i32,
    }
}

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Quantize,
    Dequantize,
}

/// The family's kernel symbols (entry points in `csrc/sm90/kv_quant/kv_quant.cu`): the only place they
/// are spelled on the host; a CPU test checks each against the embedded cubin.
pub mod kernels {
    /// Quantise, V3.2 format, vector accesses.
    pub const QUANTIZE_V32_VEC: &str = "kv_quant_quantize_v32_vec";
    /// Quantise, V3.2 format, scalar accesses.
    pub const QUANTIZE_V32_SCALAR: &str = "kv_quant_quantize_v32_scalar";
    /// Quantise, MODEL1 format, vector accesses.
    pub const QUANTIZE_MODEL1_VEC: &str = "kv_quant_quantize_model1_vec";
    /// Quantise, MODEL1 format, scalar accesses.
    pub const QUANTIZE_MODEL1_SCALAR: &str = "kv_quant_quantize_model1_scalar";
    /// Dequantise, V3.2 format, vector accesses.
    pub const DEQUANTIZE_V32_VEC: &str = "kv_quant_dequantize_v32_vec";
    /// Dequantise, V3.2 format, scalar accesses.
    pub const DEQUANTIZE_V32_SCALAR: &str = "kv_quant_dequantize_v32_scalar";
    /// Dequantise, MODEL1 format, vector accesses.
    pub const DEQUANTIZE_MODEL1_VEC: &str = "kv_quant_dequantize_model1_vec";
    /// Dequantise, MODEL1 format, scalar accesses.
    pub const DEQUANTIZE_MODEL1_SCALAR: &str = "kv_quant_dequantize_model1_scalar";
    /// Every kernel of the family.
    pub const ALL: &[&str] = &[
        QUANTIZE_V32_VEC,
        QUANTIZE_V32_SCALAR,
        QUANTIZE_MODEL1_VEC,
        QUANTIZE_MODEL1_SCALAR,
        DEQUANTIZE_V32_VEC,
        DEQUANTIZE_V32_SCALAR,
        DEQUANTIZE_MODEL1_VEC,
        DEQUANTIZE_MODEL1_SCALAR,
    ];
}

/// The kernel symbol for a direction, format and access path.
fn kernel_name(direction: Direction, format: KvFormat, vec: bool) -> &'static str {
    use kernels::*;
    use Direction::*;
    use KvFormat::*;
    match (direction, format, vec) {
        (Quantize, V32, true) => QUANTIZE_V32_VEC,
        (Quantize, V32, false) => QUANTIZE_V32_SCALAR,
        (Quantize, Model1, true) => QUANTIZE_MODEL1_VEC,
        (Quantize, Model1, false) => QUANTIZE_MODEL1_SCALAR,
        (Dequantize, V32, true) => DEQUANTIZE_V32_VEC,
        (Dequantize, V32, false) => DEQUANTIZE_V32_SCALAR,
        (Dequantize, Model1, true) => DEQUANTIZE_MODEL1_VEC,
        (Dequantize, Model1, false) => DEQUANTIZE_MODEL1_SCALAR,
    }
}

/// Whether the vector variant may run: bf16 rows 16-byte aligned (base and every used stride), cache blocks
/// 8-byte aligned. Strides of size-1 dimensions never move the pointer, so they do not count.
pub fn vector_path_ok(
    dims: &KvQuantDims,
    kv_ptr: u64,
    cache_ptr: u64,
    cache_block_stride: usize,
) -> bool {
    let bf16_bytes = DType::Bf16.size_bytes() as u64;
    let kv_stride_ok = |size: usize, stride: usize| {
        size <= 1 || (stride as u64 * bf16_bytes) % VEC_KV_ALIGN_BYTES == 0
    };
    kv_ptr % VEC_KV_ALIGN_BYTES == 0
        && kv_stride_ok(dims.num_blocks, dims.kv_block_stride)
        && kv_stride_ok(dims.page_size, dims.kv_token_stride)
        && cache_ptr % VEC_CACHE_ALIGN_BYTES == 0
        && (dims.num_blocks <= 1 || cache_block_stride as u64 % VEC_CACHE_ALIGN_BYTES == 0)
}

/// Device checks, then the launch.
fn launch(
    gpu: &Gpu,
    direction: Direction,
    dims: &KvQuantDims,
    kv: &DeviceView,
    cache: &DeviceView,
) -> Result<()> {
    let device = Location::Cuda(gpu.ordinal());
    expect_location("kv", kv, device)?;
    expect_location("cache", cache, device)?;
    let bf16_bytes = DType::Bf16.size_bytes() as u64;
    if kv.ptr() % bf16_bytes != 0 {
        return Err(Error::invalid(
            "kv.data_ptr",
            "an address aligned to the bf16 element size (2 bytes)",
            format!("{:#x}", kv.ptr()),
        ));
    }
    let num_tokens = to_i32("num_blocks * page_size", dims.num_tokens())?;
    if num_tokens == 0 {
        return Ok(());
    }
    let cache_block_stride = if dims.num_blocks > 1 {
        cache.strides()[0]
    } else {
        dims.page_size * dims.format.bytes_per_token()
    };
    let params = KvQuantParams {
        kv: kv.ptr(),
        cache: cache.ptr(),
        kv_block_stride: to_i64("kv.strides[0]", dims.kv_block_stride)?,
        kv_token_stride: to_i64("kv.strides[1]", dims.kv_token_stride)?,
        cache_block_stride: to_i64("cache.strides[0]", cache_block_stride)?,
        num_blocks: to_i32("num_blocks", dims.num_blocks)?,
        page_size: to_i32("page_size", dims.page_size)?,
        num_tokens,
        reserved: 0,
    };
    let vec = vector_path_ok(dims, kv.ptr(), cache.ptr(), cache_block_stride);
    let kernel = gpu.kernel(FAMILY, kernel_name(direction, dims.format, vec))?;
    let ctas = (num_tokens as u32).div_ceil(WARPS_PER_CTA);
    let cfg = LaunchConfig::linear(ctas, THREADS_PER_CTA);
    // SAFETY: `KvQuantParams` mirrors the kernel's Params (checked at compile time). Validation established that
    // `kv` and `cache` have the shapes and strides the params describe; the DeviceView contract makes every
    // element they reach valid device memory that outputs do not alias inputs. Each warp touches only its token's
    // row and bytes.
    unsafe { gpu.launch(&kernel, &cfg, &params) }
}

/// Quantises `args.kv` (bf16 on the GPU) into `out.cache` (u8/f8e4m3, any valid block stride) on `gpu`'s stream.
/// Bytes between cache blocks are not written. Asynchronous: call [`Gpu::synchronize`] (or download) to wait.
pub fn quantize_cuda(
    gpu: &Gpu,
    args: &QuantizeArgs<'_, DeviceView>,
    out: &QuantizeOutput<DeviceView>,
) -> Result<()> {
    let dims = validate_quantize(args)?;
    validate_quantize_output(&dims, out)?;
    launch(gpu, Direction::Quantize, &dims, args.kv, &out.cache)
}

/// Dequantises `args.cache` into `out.kv` (bf16, any non-overlapping row strides) on `gpu`'s stream.
/// Asynchronous: call [`Gpu::synchronize`] (or download) to wait.
pub fn dequantize_cuda(
    gpu: &Gpu,
    args: &DequantizeArgs<'_, DeviceView>,
    out: &DequantizeOutput<DeviceView>,
) -> Result<()> {
    let dims = validate_dequantize(args)?;
    let dims = validate_dequantize_output(&dims, out)?;
    launch(gpu, Direction::Dequantize, &dims, &out.kv, args.cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(
        num_blocks: usize,
        page_size: usize,
        kv_block_stride: usize,
        kv_token_stride: usize,
    ) -> KvQuantDims {
        KvQuantDims {
            format: KvFormat::Model1,
            num_blocks,
            page_size,
            kv_block_stride,
            kv_token_stride,
            location: Location::Cuda(0),
        }
    }

    #[test]
    fn vector_path_needs_aligned_rows_and_blocks() {
        let d = 512;
        let base = 0x7f00_0000_0000u64;
        let packed = 61 * KvFormat::Model1.bytes_per_token(); // 35624 = 8 * 4453: 8-byte aligned
        assert!(vector_path_ok(&dims(3, 61, 61 * d, d), base, base, packed));
        // Odd element strides move rows off 16-byte boundaries.
        assert!(!vector_path_ok(
            &dims(3, 61, 61 * d, d + 1),
            base,
            base,
            packed
        ));
        assert!(!vector_path_ok(
            &dims(3, 61, 61 * d + 4, d),
            base,
            base,
            packed
        ));
        // ... unless the dimension has one entry.
        assert!(vector_path_ok(&dims(1, 61, 3, d), base, base, packed));
        assert!(vector_path_ok(&dims(3, 1, 61 * d, 7), base, base, packed));
        // Misaligned bases.
        assert!(!vector_path_ok(
            &dims(3, 61, 61 * d, d),
            base + 2,
            base,
            packed
        ));
        assert!(!vector_path_ok(
            &dims(3, 61, 61 * d, d),
            base,
            base + 4,
            packed
        ));
        // A padded block stride that is not a multiple of 8.
        assert!(!vector_path_ok(
            &dims(3, 61, 61 * d, d),
            base,
            base,
            packed + 3
        ));
        assert!(vector_path_ok(
            &dims(3, 61, 61 * d, d),
            base,
            base,
            packed + 40
        ));
    }

    #[test]
    fn every_variant_has_a_distinct_kernel() {
        let mut names = Vec::new();
        for dir in [Direction::Quantize, Direction::Dequantize] {
            for f in KvFormat::ALL {
                for vec in [true, false] {
                    names.push(kernel_name(dir, f, vec));
                }
            }
        }
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
        // ... and `kernels::ALL` (what the cubin test checks) lists exactly these.
        let mut all = kernels::ALL.to_vec();
        all.sort();
        assert_eq!(names, all);
    }
}
