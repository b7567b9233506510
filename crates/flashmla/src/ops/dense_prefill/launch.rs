//! GPU path of the dense varlen prefill forward: checks the limits of the sm_90a kernel
//! (`csrc/sm90/dense_prefill/`, design in `docs/dense-prefill.md`), lowers validated arguments to its
//! [`DensePrefillFwdParams`] and launches persistent CTAs of 384 threads, one per SM, that take work items
//! (128-row query tile, query head) from a counter: a producer warpgroup streaming K and V tiles of 128 keys and two
//! consumer warpgroups of 64 query rows each.
//!
//! The items are counted from `total_q` and `b` alone (`ceil(total_q / 128) + b` tiles per head, an upper bound on
//! the tiles of any sequences that partition `total_q` rows), so the launch needs no host copy of the offsets and no
//! `max_seqlen`; the CTAs find each item's sequence on the device. Offsets that break the contract (not non-decreasing
//! from 0 to the row counts) give unspecified values in the rows they misdescribe, never an access outside a tensor.
//!
//! Kernel limits checked here (beyond [`super::validate`]): `q`, `k`, `v` and `out` rows 16-byte aligned (rows move
//! in 16-byte chunks); offsets contiguous; `lse` contiguous over tokens; every reachable offset fits `i64`; the row
//! counts and the grid fit the kernel's 32-bit counters.

use super::{DensePrefillArgs, DensePrefillDims, DensePrefillOutput};
use crate::cuda::{
    device_params, encode_tiled_u16_sw128_uncached, DeviceParams, Gpu, LaunchConfig, TensorMapBytes,
};
use crate::error::{Error, Result};
use crate::ops::layout::{
    expect_element_aligned, expect_offsets_fit_i64, expect_rows_16b, stride_param,
};
use crate::tensor::{DType, DeviceView, Location, TensorMeta};
use crate::validate::{expect_contiguous, expect_f32_workspace, expect_location, to_i32};

/// Kernel family (`csrc/sm90/dense_prefill/`).
pub const FAMILY: &str = <DensePrefillFwdParams as DeviceParams>::FAMILY;
/// Query rows per work item of the forward (`kTileM`).
pub const TILE_M: usize = 128;
/// Threads per CTA (`kThreads`): a producer and two consumer warpgroups.
pub const THREADS_PER_CTA: u32 = 384;
/// Dynamic shared memory of the `d` 192 kernels (`kSmemBytes<192>`, static_asserted in config.cuh).
pub const SMEM_BYTES_D192: u32 = 215_040;
/// Dynamic shared memory of the `d` 128 kernels (`kSmemBytes<128>`).
pub const SMEM_BYTES_D128: u32 = 165_888;
/// `flags` bit: bottom-right causal mask (`kFlagCausal` in params.h).
pub const FLAG_CAUSAL: u32 = 1;
/// `flags` bit: the parameters' TMA maps describe q, k and v (and d_out in the backward); whole tiles load by TMA
/// (`kFlagTma`).
pub const FLAG_TMA: u32 = 2;
/// Rows of one TMA box of the forward (`kTileM` = `kTileN`): a query or key tile.
const TMA_BOX_ROWS: u32 = 128;
/// Rows of one TMA box of the backward: its streamed tiles and its CTAs' own rows come in 64-row pieces.
const BWD_TMA_BOX_ROWS: u32 = 64;
/// Columns of one TMA box: a 128-byte slab of 16-bit values (the 128B swizzle's width).
const TMA_BOX_COLS: u32 = 64;
/// Largest `blockIdx.x` + 1 the driver accepts (the backward's grids).
const MAX_GRID_X: usize = i32::MAX as usize;
/// Most work items of the forward (its counter and indices are 32-bit; the kernel takes at most one index past
/// the last per CTA).
const MAX_ITEMS: usize = i32::MAX as usize;
/// f32 words of the forward's workspace (its work counter, a u32 in the first word).
pub const FWD_WORKSPACE_WORDS: usize = 1;
/// log2(e): the kernel keeps logits in base 2, so the host folds it into the scale.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

device_params! {
    family = "dense_prefill", cxx = "DensePrefillFwdParams";
    /// Mirror of `flashmla::dense_prefill::DensePrefillFwdParams` (params.h), checked against it at compile time
    /// ([`crate::cuda::params`]). Pointers are device addresses; strides are in elements; last dimensions are
    /// contiguous and have no stride field.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct DensePrefillFwdParams {
        /// [`FLAG_TMA`]: the TMA map of `q` (dims `d, h_q, total_q, 1`, boxes of 64 columns x 128 rows of one
        /// head); zeros otherwise.
        pub q_tmap: TensorMapBytes,
        /// [`FLAG_TMA`]: the TMA map of `k` (as `q_tmap`).
        pub k_tmap: TensorMapBytes,
        /// [`FLAG_TMA`]: the TMA map of `v` (as `q_tmap`, `d_v` columns).
        pub v_tmap: TensorMapBytes,
        /// `[total_q, h_q, d]`, strides `(q_stride_t, q_stride_h, 1)`.
        pub q: u64,
        /// `[total_k, h_k, d]`, strides `(k_stride_t, k_stride_h, 1)`.
        pub k: u64,
        /// `[total_k, h_k, d_v]`, strides `(v_stride_t, v_stride_h, 1)`.
        pub v: u64,
        /// `[b + 1]` i32, contiguous.
        pub cu_seqlens_q: u64,
        /// `[b + 1]` i32, contiguous.
        pub cu_seqlens_k: u64,
        /// `[total_q, h_q, d_v]`, strides `(out_stride_t, out_stride_h, 1)`.
        pub out: u64,
        /// `[h_q, total_q]` f32, strides `(lse_stride_h, 1)`.
        pub lse: u64,
        /// The call's work counter (the first of [`FWD_WORKSPACE_WORDS`] workspace words, read as u32), zeroed
        /// before the launch.
        pub tile_counter: u64,
        /// Elements between `q` rows.
        pub q_stride_t: i64,
        /// Elements between `q` heads.
        pub q_stride_h: i64,
        /// Elements between `k` rows.
        pub k_stride_t: i64,
        /// Elements between `k` heads.
        pub k_stride_h: i64,
        /// Elements between `v` rows.
        pub v_stride_t: i64,
        /// Elements between `v` heads.
        pub v_stride_h: i64,
        /// Elements between `out` rows.
        pub out_stride_t: i64,
        /// Elements between `out` heads.
        pub out_stride_h: i64,
        /// Elements between `lse` heads.
        pub lse_stride_h: i64,
        /// Sequences.
        pub batch: i32,
        /// Query rows of all sequences.
        pub total_q: i32,
        /// Key rows of all sequences.
        pub total_k: i32,
        /// Query heads.
        pub h_q: i32,
        /// Query heads per key/value head.
        pub h_per_k: i32,
        /// `ceil(total_q / 128) + b`: the work items per head (a bound on the query tiles of any sequences).
        pub m_tiles: i32,
        /// `FLAG_*` bits.
        pub flags: u32,
        /// `softmax_scale * log2(e)`.
        pub sm_scale_log2: f32,
        /// Zeros: pad the struct to its 64-byte alignment (the maps) without implicit padding.
        pub tail: [i32; 6],
    }
}

device_params! {
    family = "dense_prefill", cxx = "DensePrefillBwdParams";
    /// Mirror of `flashmla::dense_prefill::DensePrefillBwdParams` (params.h): every backward kernel.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct DensePrefillBwdParams {
        /// [`FLAG_TMA`]: the TMA map of `q` (as the forward's, boxes of 64 rows); zeros otherwise.
        pub q_tmap: TensorMapBytes,
        /// [`FLAG_TMA`]: the TMA map of `k`.
        pub k_tmap: TensorMapBytes,
        /// [`FLAG_TMA`]: the TMA map of `v`.
        pub v_tmap: TensorMapBytes,
        /// [`FLAG_TMA`]: the TMA map of `d_out`.
        pub d_out_tmap: TensorMapBytes,
        /// `[total_q, h_q, d]`.
        pub q: u64,
        /// `[total_k, h_k, d]`.
        pub k: u64,
        /// `[total_k, h_k, d_v]`.
        pub v: u64,
        /// The forward's `out`, `[total_q, h_q, d_v]`.
        pub out: u64,
        /// `[total_q, h_q, d_v]`.
        pub d_out: u64,
        /// The forward's `lse`, `[h_q, total_q]` f32.
        pub lse: u64,
        /// `[b + 1]` i32, contiguous.
        pub cu_seqlens_q: u64,
        /// `[b + 1]` i32, contiguous.
        pub cu_seqlens_k: u64,
        /// `[total_q, h_q, d]`.
        pub d_q: u64,
        /// `[total_k, h_k, d]`.
        pub d_k: u64,
        /// `[total_k, h_k, d_v]`.
        pub d_v: u64,
        /// Workspace `[h_q, total_q]` f32.
        pub delta: u64,
        /// The fused schedule's f32 dQ accumulator `[h_q, total_q, d]`, or 0 (deterministic schedule).
        pub dq_accum: u64,
        /// Elements between `q` rows.
        pub q_stride_t: i64,
        /// Elements between `q` heads.
        pub q_stride_h: i64,
        /// Elements between `k` rows.
        pub k_stride_t: i64,
        /// Elements between `k` heads.
        pub k_stride_h: i64,
        /// Elements between `v` rows.
        pub v_stride_t: i64,
        /// Elements between `v` heads.
        pub v_stride_h: i64,
        /// Elements between `out` rows.
        pub out_stride_t: i64,
        /// Elements between `out` heads.
        pub out_stride_h: i64,
        /// Elements between `d_out` rows.
        pub d_out_stride_t: i64,
        /// Elements between `d_out` heads.
        pub d_out_stride_h: i64,
        /// Elements between `d_q` rows.
        pub d_q_stride_t: i64,
        /// Elements between `d_q` heads.
        pub d_q_stride_h: i64,
        /// Elements between `d_k` rows.
        pub d_k_stride_t: i64,
        /// Elements between `d_k` heads.
        pub d_k_stride_h: i64,
        /// Elements between `d_v` rows.
        pub d_v_stride_t: i64,
        /// Elements between `d_v` heads.
        pub d_v_stride_h: i64,
        /// Elements between `lse` heads.
        pub lse_stride_h: i64,
        /// Elements between `delta` heads.
        pub delta_stride_h: i64,
        /// Sequences.
        pub batch: i32,
        /// Query rows.
        pub total_q: i32,
        /// Key rows.
        pub total_k: i32,
        /// Query heads.
        pub h_q: i32,
        /// Key/value heads.
        pub h_k: i32,
        /// `h_q / h_k`.
        pub h_per_k: i32,
        /// `ceil(total_q / 128) + b`.
        pub q_tiles: i32,
        /// `ceil(total_k / 64) + b`; the fused kernel: `ceil(total_k / 128) + b`.
        pub k_tiles: i32,
        /// `FLAG_*` bits.
        pub flags: u32,
        /// `softmax_scale * log2(e)`.
        pub sm_scale_log2: f32,
        /// `softmax_scale`.
        pub sm_scale: f32,
        /// `d`: the row width of `dq_accum`.
        pub d_qk: i32,
        /// Zeros: pad the struct to its 64-byte alignment (the maps) without implicit padding.
        pub tail: [i32; 6],
    }
}

/// The family's kernel symbols (entry points in `csrc/sm90/dense_prefill/dense_prefill.cu`): the only place they
/// are spelled on the host; a CPU test checks each against the embedded cubin.
pub mod kernels {
    /// Forward, `d` 192 (`d_v` 128), bf16.
    pub const FWD_D192_BF16: &str = "dense_prefill_fwd_d192_bf16";
    /// Forward, `d` 192, fp16.
    pub const FWD_D192_F16: &str = "dense_prefill_fwd_d192_f16";
    /// Forward, `d` 128 (`d_v` 128), bf16.
    pub const FWD_D128_BF16: &str = "dense_prefill_fwd_d128_bf16";
    /// Forward, `d` 128, fp16.
    pub const FWD_D128_F16: &str = "dense_prefill_fwd_d128_f16";
    /// Backward: `delta = rowsum(d_out * out)`, bf16.
    pub const BWD_DELTA_BF16: &str = "dense_prefill_bwd_delta_bf16";
    /// Backward: delta, fp16.
    pub const BWD_DELTA_F16: &str = "dense_prefill_bwd_delta_f16";
    /// Backward: dQ, `d` 192, bf16.
    pub const BWD_DQ_D192_BF16: &str = "dense_prefill_bwd_dq_d192_bf16";
    /// Backward: dQ, `d` 192, fp16.
    pub const BWD_DQ_D192_F16: &str = "dense_prefill_bwd_dq_d192_f16";
    /// Backward: dQ, `d` 128, bf16.
    pub const BWD_DQ_D128_BF16: &str = "dense_prefill_bwd_dq_d128_bf16";
    /// Backward: dQ, `d` 128, fp16.
    pub const BWD_DQ_D128_F16: &str = "dense_prefill_bwd_dq_d128_f16";
    /// Backward: dK and dV, `d` 192, bf16.
    pub const BWD_DKV_D192_BF16: &str = "dense_prefill_bwd_dkv_d192_bf16";
    /// Backward: dK and dV, `d` 192, fp16.
    pub const BWD_DKV_D192_F16: &str = "dense_prefill_bwd_dkv_d192_f16";
    /// Backward: dK and dV, `d` 128, bf16.
    pub const BWD_DKV_D128_BF16: &str = "dense_prefill_bwd_dkv_d128_bf16";
    /// Backward: dK and dV, `d` 128, fp16.
    pub const BWD_DKV_D128_F16: &str = "dense_prefill_bwd_dkv_d128_f16";
    /// Backward, fused dK / dV / dQ, `d` 192, bf16.
    pub const BWD_FUSED_D192_BF16: &str = "dense_prefill_bwd_fused_d192_bf16";
    /// Backward, fused, `d` 192, fp16.
    pub const BWD_FUSED_D192_F16: &str = "dense_prefill_bwd_fused_d192_f16";
    /// Backward, fused, `d` 128, bf16.
    pub const BWD_FUSED_D128_BF16: &str = "dense_prefill_bwd_fused_d128_bf16";
    /// Backward, fused, `d` 128, fp16.
    pub const BWD_FUSED_D128_F16: &str = "dense_prefill_bwd_fused_d128_f16";
    /// Backward, dQ conversion of the fused schedule, `d` 192, bf16.
    pub const BWD_DQ_CONVERT_D192_BF16: &str = "dense_prefill_bwd_dq_convert_d192_bf16";
    /// Backward, dQ conversion, `d` 192, fp16.
    pub const BWD_DQ_CONVERT_D192_F16: &str = "dense_prefill_bwd_dq_convert_d192_f16";
    /// Backward, dQ conversion, `d` 128, bf16.
    pub const BWD_DQ_CONVERT_D128_BF16: &str = "dense_prefill_bwd_dq_convert_d128_bf16";
    /// Backward, dQ conversion, `d` 128, fp16.
    pub const BWD_DQ_CONVERT_D128_F16: &str = "dense_prefill_bwd_dq_convert_d128_f16";
    /// Every kernel [`super::kernel_for`] and [`super::bwd_kernels_for`] can name.
    pub const ALL: &[&str] = &[
        FWD_D192_BF16,
        FWD_D192_F16,
        FWD_D128_BF16,
        FWD_D128_F16,
        BWD_DELTA_BF16,
        BWD_DELTA_F16,
        BWD_DQ_D192_BF16,
        BWD_DQ_D192_F16,
        BWD_DQ_D128_BF16,
        BWD_DQ_D128_F16,
        BWD_DKV_D192_BF16,
        BWD_DKV_D192_F16,
        BWD_DKV_D128_BF16,
        BWD_DKV_D128_F16,
        BWD_FUSED_D192_BF16,
        BWD_FUSED_D192_F16,
        BWD_FUSED_D128_BF16,
        BWD_FUSED_D128_F16,
        BWD_DQ_CONVERT_D192_BF16,
        BWD_DQ_CONVERT_D192_F16,
        BWD_DQ_CONVERT_D128_BF16,
        BWD_DQ_CONVERT_D128_F16,
    ];
}

/// Keys per CTA of the backward's dK / dV kernel (two consumers of `bwd::kRows` = 64 keys).
pub const BWD_TILE: usize = 128;
/// Query rows per CTA of the backward's dQ kernel (`bwd::kDqRows`: two consumers of 64 rows).
pub const BWD_DQ_TILE: usize = 128;
/// Threads per CTA of the backward's dK / dV kernel (`bwd::kThreads`: a producer and two consumer warpgroups).
pub const BWD_THREADS: u32 = 384;
/// Threads per CTA of the backward's dQ kernel (`bwd::kDqThreads`: a producer and two consumer warpgroups).
pub const BWD_DQ_THREADS: u32 = 384;
/// Threads per CTA of the delta kernel (one warp per (row, head)).
pub const BWD_DELTA_THREADS: u32 = 256;
/// Dynamic shared memory of the dQ kernel, `d` 192 (`bwd::kDqSmemBytes<192>`, static_asserted in bwd.cuh).
pub const BWD_DQ_SMEM_D192: u32 = 165_888;
/// The same, `d` 128.
pub const BWD_DQ_SMEM_D128: u32 = 133_120;
/// Dynamic shared memory of the dK / dV kernel, `d` 192 (`bwd::kDkvSmemBytes<192>`).
pub const BWD_DKV_SMEM_D192: u32 = 166_912;
/// The same, `d` 128.
pub const BWD_DKV_SMEM_D128: u32 = 134_144;

/// Keys per CTA of the fused backward kernel (`bwd::kFusedKeys`: two consumers of 64 keys).
pub const BWD_FUSED_TILE: usize = 128;
/// Threads per CTA of the fused kernel (`bwd::kFusedThreads`: a producer and two consumer warpgroups).
pub const BWD_FUSED_THREADS: u32 = 384;
/// Threads per CTA of the dQ conversion (one CTA per 64-row query tile and head).
pub const BWD_CONVERT_THREADS: u32 = 128;
/// Query rows per accumulator tile of the default backward (`bwd::kRows`).
pub const BWD_ACC_TILE: usize = 64;
/// Dynamic shared memory of the fused kernel, `d` 192 (`bwd::kFusedSmemBytes<192>`, static_asserted in bwd.cuh).
pub const BWD_FUSED_SMEM_D192: u32 = 232_448;
/// The same, `d` 128.
pub const BWD_FUSED_SMEM_D128: u32 = 199_680;

/// The backward's kernels for one `d` and element type, with their dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdKernels {
    /// `delta` (and the zeroing of the dQ accumulator).
    pub delta: &'static str,
    /// Deterministic schedule: dQ.
    pub dq: (&'static str, u32),
    /// Deterministic schedule: dK / dV.
    pub dkv: (&'static str, u32),
    /// Default schedule: dK / dV / dQ in one pass.
    pub fused: (&'static str, u32),
    /// Default schedule: the dQ conversion.
    pub dq_convert: &'static str,
}

/// The backward's kernels for `d` and an element type.
pub fn bwd_kernels_for(d: usize, dtype: DType) -> Result<BwdKernels> {
    use kernels::*;
    let f16 = match dtype {
        DType::F16 => true,
        DType::Bf16 => false,
        _ => {
            return Err(Error::unsupported(
                format!("dense_prefill backward kernels for {dtype:?}"),
                "the sm_90a kernels are built for bf16 and fp16",
            ))
        }
    };
    let delta = if f16 { BWD_DELTA_F16 } else { BWD_DELTA_BF16 };
    let pick = |bf: &'static str, h: &'static str| if f16 { h } else { bf };
    match d {
        192 => Ok(BwdKernels {
            delta,
            dq: (pick(BWD_DQ_D192_BF16, BWD_DQ_D192_F16), BWD_DQ_SMEM_D192),
            dkv: (pick(BWD_DKV_D192_BF16, BWD_DKV_D192_F16), BWD_DKV_SMEM_D192),
            fused: (
                pick(BWD_FUSED_D192_BF16, BWD_FUSED_D192_F16),
                BWD_FUSED_SMEM_D192,
            ),
            dq_convert: pick(BWD_DQ_CONVERT_D192_BF16, BWD_DQ_CONVERT_D192_F16),
        }),
        128 => Ok(BwdKernels {
            delta,
            dq: (pick(BWD_DQ_D128_BF16, BWD_DQ_D128_F16), BWD_DQ_SMEM_D128),
            dkv: (pick(BWD_DKV_D128_BF16, BWD_DKV_D128_F16), BWD_DKV_SMEM_D128),
            fused: (
                pick(BWD_FUSED_D128_BF16, BWD_FUSED_D128_F16),
                BWD_FUSED_SMEM_D128,
            ),
            dq_convert: pick(BWD_DQ_CONVERT_D128_BF16, BWD_DQ_CONVERT_D128_F16),
        }),
        _ => Err(Error::unsupported(
            format!("dense_prefill backward kernels for d = {d}, {dtype:?}"),
            "the sm_90a kernels are built for d 128 and 192 in bf16 and fp16",
        )),
    }
}

/// The offsets are contiguous (the kernels index them directly) and every `[h_q, total_q]` f32 tensor of `rows` has
/// the rows of a head contiguous.
fn expect_offsets_and_rows(
    args: &DensePrefillArgs<'_, DeviceView>,
    rows: &[(&str, &DeviceView)],
) -> Result<()> {
    expect_contiguous("cu_seqlens_q", args.cu_seqlens_q)?;
    expect_contiguous("cu_seqlens_k", args.cu_seqlens_k)?;
    for &(name, t) in rows {
        if t.shape()[1] > 1 && t.strides()[1] != 1 {
            return Err(Error::invalid(
                format!("{name}.strides[1]"),
                "1 (rows of a head contiguous)",
                t.strides()[1],
            ));
        }
    }
    Ok(())
}

/// The kernels' base-2 logit scale, `softmax_scale * log2(e)`, which must be finite.
fn scale_log2(dims: &DensePrefillDims) -> Result<f32> {
    let s = dims.softmax_scale * LOG2_E;
    if s.is_finite() {
        Ok(s)
    } else {
        Err(Error::invalid(
            "softmax_scale",
            "a value whose product with log2(e) is finite",
            dims.softmax_scale,
        ))
    }
}

/// Kernel symbol and dynamic shared memory of the forward for `d` and an element type.
pub fn kernel_for(d: usize, dtype: DType) -> Result<(&'static str, u32)> {
    match (d, dtype) {
        (192, DType::Bf16) => Ok((kernels::FWD_D192_BF16, SMEM_BYTES_D192)),
        (192, DType::F16) => Ok((kernels::FWD_D192_F16, SMEM_BYTES_D192)),
        (128, DType::Bf16) => Ok((kernels::FWD_D128_BF16, SMEM_BYTES_D128)),
        (128, DType::F16) => Ok((kernels::FWD_D128_F16, SMEM_BYTES_D128)),
        _ => Err(Error::unsupported(
            format!("dense_prefill kernel for d = {d}, {dtype:?}"),
            "the sm_90a kernels are built for d 128 and 192 in bf16 and fp16",
        )),
    }
}

/// Checks the kernel's limits and builds its parameters and launch geometry for a device of `sm_count` SMs (pure:
/// no GPU needed; `tile_counter` is left 0 for `launch` to point at the workspace). Returns `None` when there is
/// nothing to launch (no query rows).
pub fn lower(
    dims: &DensePrefillDims,
    args: &DensePrefillArgs<'_, DeviceView>,
    out: &DensePrefillOutput<DeviceView>,
    sm_count: usize,
) -> Result<Option<(&'static str, LaunchConfig, DensePrefillFwdParams)>> {
    let (kernel, smem) = kernel_for(dims.d, dims.dtype)?;
    expect_rows_16b(
        "dense_prefill",
        &[
            ("q", args.q),
            ("k", args.k),
            ("v", args.v),
            ("out", &out.out),
        ],
    )?;
    expect_offsets_and_rows(args, &[("lse", &out.lse)])?;
    expect_element_aligned(&[
        ("cu_seqlens_q", Some(args.cu_seqlens_q)),
        ("cu_seqlens_k", Some(args.cu_seqlens_k)),
        ("lse", Some(&out.lse)),
    ])?;
    expect_offsets_fit_i64(&[
        ("q", Some(args.q)),
        ("k", Some(args.k)),
        ("v", Some(args.v)),
        ("out", Some(&out.out)),
        ("lse", Some(&out.lse)),
    ])?;
    let sm_scale_log2 = scale_log2(dims)?;
    if dims.total_q == 0 {
        return Ok(None);
    }
    let m_tiles = dims.total_q.div_ceil(TILE_M) + dims.batch;
    let items = m_tiles
        .checked_mul(dims.h_q)
        .filter(|&n| n <= MAX_ITEMS)
        .ok_or_else(|| {
            Error::invalid(
                "q.shape",
                format!(
                    "(ceil(total_q / {TILE_M}) + b) * h_q <= {MAX_ITEMS} (work items: query tiles times heads)"
                ),
                format!("total_q {}, b {}, h_q {}", dims.total_q, dims.batch, dims.h_q),
            )
        })?;
    // One persistent CTA per SM (its shared memory allows no second), never more than there are items.
    let ctas = items.min(sm_count.max(1));
    let params = DensePrefillFwdParams {
        q_tmap: TensorMapBytes::default(),
        k_tmap: TensorMapBytes::default(),
        v_tmap: TensorMapBytes::default(),
        q: args.q.ptr(),
        k: args.k.ptr(),
        v: args.v.ptr(),
        cu_seqlens_q: args.cu_seqlens_q.ptr(),
        cu_seqlens_k: args.cu_seqlens_k.ptr(),
        out: out.out.ptr(),
        lse: out.lse.ptr(),
        tile_counter: 0,
        q_stride_t: stride_param("q", args.q, 0)?,
        q_stride_h: stride_param("q", args.q, 1)?,
        k_stride_t: stride_param("k", args.k, 0)?,
        k_stride_h: stride_param("k", args.k, 1)?,
        v_stride_t: stride_param("v", args.v, 0)?,
        v_stride_h: stride_param("v", args.v, 1)?,
        out_stride_t: stride_param("out", &out.out, 0)?,
        out_stride_h: stride_param("out", &out.out, 1)?,
        lse_stride_h: stride_param("lse", &out.lse, 0)?,
        batch: to_i32("cu_seqlens_q.shape[0] - 1", dims.batch)?,
        total_q: to_i32("q.shape[0]", dims.total_q)?,
        total_k: to_i32("k.shape[0]", dims.total_k)?,
        h_q: to_i32("q.shape[1]", dims.h_q)?,
        h_per_k: to_i32("h_q / h_k", dims.h_q / dims.h_k)?,
        m_tiles: to_i32("ceil(total_q / 128) + b", m_tiles)?,
        flags: if dims.causal { FLAG_CAUSAL } else { 0 },
        sm_scale_log2,
        tail: [0; 6],
    };
    let cfg = LaunchConfig {
        grid: (ctas as u32, 1, 1),
        block: (THREADS_PER_CTA, 1, 1),
        shared_mem_bytes: smem,
        cluster: None,
        programmatic: false,
    };
    Ok(Some((kernel, cfg, params)))
}

/// Launches the forward on `gpu`'s stream for arguments that passed [`super::validate`] and outputs that passed
/// [`super::validate_output`]: zeros the work counter (the first [`FWD_WORKSPACE_WORDS`] words of `workspace`, or
/// of 4 bytes allocated for the call when it is `None`), then the kernel. Asynchronous: synchronise or download to
/// wait.
pub(crate) fn launch(
    gpu: &Gpu,
    dims: &DensePrefillDims,
    args: &DensePrefillArgs<'_, DeviceView>,
    out: &DensePrefillOutput<DeviceView>,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    expect_location("q", args.q, Location::Cuda(gpu.ordinal()))?;
    let Some((name, cfg, mut params)) = lower(dims, args, out, gpu.info().sm_count as usize)?
    else {
        return Ok(());
    };
    let mut _owned = None;
    params.tile_counter = match workspace {
        Some(ws) => {
            expect_location("workspace", ws, Location::Cuda(gpu.ordinal()))?;
            expect_f32_workspace(ws, FWD_WORKSPACE_WORDS, 4)?;
            ws.ptr()
        }
        None => {
            let t = gpu.alloc(DType::F32, &[FWD_WORKSPACE_WORDS])?;
            let ptr = t.view().ptr();
            _owned = Some(t);
            ptr
        }
    };
    // SAFETY: the counter's words lie in a workspace of this device that the caller gave to this call (checked:
    // size and alignment), or in the allocation above; ordered before the kernel on the same stream.
    unsafe { gpu.zero_words_async(params.tile_counter, FWD_WORKSPACE_WORDS)? };
    if let (Some(q), Some(k), Some(v)) = (
        tile_tensor_map(args.q, TMA_BOX_ROWS),
        tile_tensor_map(args.k, TMA_BOX_ROWS),
        tile_tensor_map(args.v, TMA_BOX_ROWS),
    ) {
        (params.q_tmap, params.k_tmap, params.v_tmap) = (q, k, v);
        params.flags |= FLAG_TMA;
    }
    let kernel = gpu.kernel(FAMILY, name)?;
    // SAFETY: `DensePrefillFwdParams` mirrors the kernel's parameter struct (checked at compile time). `validate` /
    // `validate_output` established the shapes and dtypes the params describe and that every tensor lives on this
    // device; `lower` checked alignment, contiguity of the offsets and that every offset fits i64. The kernel
    // clamps every offset it reads into [0, total_q] / [0, total_k], so it reads q / k / v rows and writes out /
    // lse rows inside the views (heads < h_q, h_k), which by the DeviceView contract are valid, live and do not
    // alias outputs with inputs. The TMA maps' dims are the views' shapes and their strides the views' strides; the
    // TMA unit reads nothing outside those dims (it fills zeros there). The kernel adds to the zeroed counter only,
    // which lives until this function returns, after the launch was queued (an owned one is freed in stream order).
    unsafe { gpu.launch(&kernel, &cfg, &params) }
}

/// The TMA map of a `[rows, heads, cols]` tensor for tiles of `box_rows` rows, or `None` where every tile is copied with
/// cp.async instead: strides the TMA unit cannot take (zero, as in a view broadcast over heads, not multiples of 16
/// bytes, or beyond 2^40 bytes) or a map the driver refuses.
fn tile_tensor_map(t: &DeviceView, box_rows: u32) -> Option<TensorMapBytes> {
    let (dims, strides, box_dims) = tile_map_args(t, box_rows)?;
    // Prefill inputs are activations, new every call: their maps skip the cache of recent maps.
    encode_tiled_u16_sw128_uncached(t.ptr(), dims, strides, box_dims).ok()
}

/// What [`tile_tensor_map`] encodes: dims `(cols, heads, rows, 1)`, byte strides of the head, row and (unit) outer
/// dimension, boxes of one 64-column slab of `box_rows` rows of one head; `None` where the TMA path does not apply.
fn tile_map_args(t: &DeviceView, box_rows: u32) -> Option<([u64; 4], [u64; 3], [u32; 4])> {
    const MAX_STRIDE_BYTES: u64 = 1 << 40;
    let (shape, strides) = (t.shape(), t.strides());
    if shape.len() != 3 || strides.len() != 3 {
        return None;
    }
    let elem = t.dtype().size_bytes() as u64;
    let stride_bytes = |i: usize| -> Option<u64> {
        let s = u64::try_from(strides[i]).ok()?.checked_mul(elem)?;
        (s > 0 && s % 16 == 0 && s < MAX_STRIDE_BYTES).then_some(s)
    };
    let row = stride_bytes(0)?;
    // A single head's stride is never followed: any valid value will do.
    let head = if shape[1] == 1 {
        stride_bytes(1).unwrap_or(row)
    } else {
        stride_bytes(1)?
    };
    let outer = row
        .checked_mul(shape[0] as u64)
        .filter(|&b| b > 0 && b < MAX_STRIDE_BYTES)?;
    let dims = [shape[2] as u64, shape[1] as u64, shape[0] as u64, 1];
    if dims.iter().any(|&d| d == 0 || d > u32::MAX as u64) {
        return None;
    }
    Some((dims, [head, row, outer], [TMA_BOX_COLS, 1, box_rows, 1]))
}

/// One launch of the backward: kernel, geometry, parameters.
pub type BwdLaunch = (&'static str, LaunchConfig, DensePrefillBwdParams);

/// Checks the backward kernels' limits and builds their launches, in order (pure: no GPU needed): for the fused
/// schedule ([`super::DensePrefillBwdOptions::fused_for`]) delta (which also zeroes the dQ accumulator), the fused
/// dK / dV / dQ pass and the dQ conversion; for the separate one dQ (which also computes delta) and dK / dV.
/// `workspace` is f32 of [`super::bwd_workspace_shape`], contiguous. Empty when there is nothing to compute.
pub fn lower_bwd(
    dims: &DensePrefillDims,
    args: &super::DensePrefillBwdArgs<'_, DeviceView>,
    grads: &super::DensePrefillGrads<DeviceView>,
    workspace: &DeviceView,
    options: &super::DensePrefillBwdOptions,
) -> Result<Vec<BwdLaunch>> {
    let fwd = &args.fwd;
    let kernels = bwd_kernels_for(dims.d, dims.dtype)?;
    expect_contiguous("workspace", workspace)?;
    // The default schedule's workspace: the dQ accumulator (super::bwd_accumulator_len floats), then delta
    // [h_q, total_q].
    let fused = options.fused_for(dims.d)?;
    let (dq_accum, delta_ptr) = if !fused {
        (0, workspace.ptr())
    } else {
        let accum_bytes = super::bwd_accumulator_len(dims) as u64 * 4;
        (workspace.ptr(), workspace.ptr() + accum_bytes)
    };
    let delta = workspace;
    expect_rows_16b(
        "dense_prefill backward",
        &[
            ("q", fwd.q),
            ("k", fwd.k),
            ("v", fwd.v),
            ("out", args.out),
            ("d_out", args.d_out),
            ("d_q", &grads.d_q),
            ("d_k", &grads.d_k),
            ("d_v", &grads.d_v),
        ],
    )?;
    expect_offsets_and_rows(fwd, &[("lse", args.lse)])?;
    expect_element_aligned(&[
        ("cu_seqlens_q", Some(fwd.cu_seqlens_q)),
        ("cu_seqlens_k", Some(fwd.cu_seqlens_k)),
        ("lse", Some(args.lse)),
    ])?;
    if workspace.ptr() % 16 != 0 {
        return Err(Error::invalid(
            "workspace.data_ptr",
            "a 16-byte aligned address",
            format!("{:#x}", workspace.ptr()),
        ));
    }
    expect_offsets_fit_i64(&[
        ("q", Some(fwd.q)),
        ("k", Some(fwd.k)),
        ("v", Some(fwd.v)),
        ("out", Some(args.out)),
        ("d_out", Some(args.d_out)),
        ("lse", Some(args.lse)),
        ("d_q", Some(&grads.d_q)),
        ("d_k", Some(&grads.d_k)),
        ("d_v", Some(&grads.d_v)),
        ("workspace", Some(delta)),
    ])?;
    let sm_scale_log2 = scale_log2(dims)?;
    // The dQ kernel's 128-row tiles; the default schedule's 64-row accumulator tiles.
    let q_tiles = if !fused {
        dims.total_q.div_ceil(BWD_DQ_TILE) + dims.batch
    } else {
        dims.total_q.div_ceil(BWD_ACC_TILE) + dims.batch
    };
    let k_tile = if !fused { BWD_TILE } else { BWD_FUSED_TILE };
    let k_tiles = dims.total_k.div_ceil(k_tile) + dims.batch;
    let grid = |tiles: usize, heads: usize, what: &str| -> Result<u32> {
        tiles
            .checked_mul(heads)
            .filter(|&n| n <= MAX_GRID_X)
            .map(|n| n as u32)
            .ok_or_else(|| {
                Error::invalid(
                    "q.shape",
                    format!("the {what} grid within {MAX_GRID_X} CTAs"),
                    format!(
                        "total_q {}, total_k {}, b {}",
                        dims.total_q, dims.total_k, dims.batch
                    ),
                )
            })
    };
    // The delta launch (one warp per (row, head)) exists on the fused schedule only: the separate schedule's dQ
    // kernel computes delta, so its grid limit does not apply there.
    let delta_blocks = if fused {
        let rows_heads = dims.total_q.saturating_mul(dims.h_q);
        grid(
            rows_heads.div_ceil(BWD_DELTA_THREADS as usize / 32),
            1,
            "delta",
        )?
    } else {
        0
    };
    let (dq_grid, dkv_grid) = (
        grid(q_tiles, dims.h_q, "dQ")?,
        grid(k_tiles, dims.h_k, "dK / dV")?,
    );
    let convert_blocks = grid(q_tiles, dims.h_q, "dQ conversion")?;
    let params = DensePrefillBwdParams {
        q_tmap: TensorMapBytes::default(),
        k_tmap: TensorMapBytes::default(),
        v_tmap: TensorMapBytes::default(),
        d_out_tmap: TensorMapBytes::default(),
        q: fwd.q.ptr(),
        k: fwd.k.ptr(),
        v: fwd.v.ptr(),
        out: args.out.ptr(),
        d_out: args.d_out.ptr(),
        lse: args.lse.ptr(),
        cu_seqlens_q: fwd.cu_seqlens_q.ptr(),
        cu_seqlens_k: fwd.cu_seqlens_k.ptr(),
        d_q: grads.d_q.ptr(),
        d_k: grads.d_k.ptr(),
        d_v: grads.d_v.ptr(),
        delta: delta_ptr,
        dq_accum,
        q_stride_t: stride_param("q", fwd.q, 0)?,
        q_stride_h: stride_param("q", fwd.q, 1)?,
        k_stride_t: stride_param("k", fwd.k, 0)?,
        k_stride_h: stride_param("k", fwd.k, 1)?,
        v_stride_t: stride_param("v", fwd.v, 0)?,
        v_stride_h: stride_param("v", fwd.v, 1)?,
        out_stride_t: stride_param("out", args.out, 0)?,
        out_stride_h: stride_param("out", args.out, 1)?,
        d_out_stride_t: stride_param("d_out", args.d_out, 0)?,
        d_out_stride_h: stride_param("d_out", args.d_out, 1)?,
        d_q_stride_t: stride_param("d_q", &grads.d_q, 0)?,
        d_q_stride_h: stride_param("d_q", &grads.d_q, 1)?,
        d_k_stride_t: stride_param("d_k", &grads.d_k, 0)?,
        d_k_stride_h: stride_param("d_k", &grads.d_k, 1)?,
        d_v_stride_t: stride_param("d_v", &grads.d_v, 0)?,
        d_v_stride_h: stride_param("d_v", &grads.d_v, 1)?,
        lse_stride_h: stride_param("lse", args.lse, 0)?,
        delta_stride_h: i64::from(to_i32("q.shape[0]", dims.total_q)?),
        batch: to_i32("cu_seqlens_q.shape[0] - 1", dims.batch)?,
        total_q: to_i32("q.shape[0]", dims.total_q)?,
        total_k: to_i32("k.shape[0]", dims.total_k)?,
        h_q: to_i32("q.shape[1]", dims.h_q)?,
        h_k: to_i32("k.shape[1]", dims.h_k)?,
        h_per_k: to_i32("h_q / h_k", dims.h_q / dims.h_k)?,
        q_tiles: to_i32("ceil(total_q / tile) + b", q_tiles)?,
        k_tiles: to_i32("ceil(total_k / tile) + b", k_tiles)?,
        flags: if dims.causal { FLAG_CAUSAL } else { 0 },
        sm_scale_log2,
        sm_scale: dims.softmax_scale,
        d_qk: to_i32("d", dims.d)?,
        tail: [0; 6],
    };
    let cfg = |grid: u32, block: u32, smem: u32| LaunchConfig {
        grid: (grid, 1, 1),
        block: (block, 1, 1),
        shared_mem_bytes: smem,
        cluster: None,
        programmatic: false,
    };
    let mut launches = Vec::new();
    // The separate schedule's dQ kernel computes delta for its rows (and writes it for the dK / dV kernel after it).
    if fused && dims.total_q > 0 {
        launches.push((
            kernels.delta,
            cfg(delta_blocks, BWD_DELTA_THREADS, 0),
            params,
        ));
    }
    if !fused {
        if dims.total_q > 0 {
            let (name, smem) = kernels.dq;
            launches.push((name, cfg(dq_grid, BWD_DQ_THREADS, smem), params));
        }
        if dims.total_k > 0 {
            let (name, smem) = kernels.dkv;
            launches.push((name, cfg(dkv_grid, BWD_THREADS, smem), params));
        }
    } else {
        if dims.total_k > 0 {
            let (name, smem) = kernels.fused;
            launches.push((name, cfg(dkv_grid, BWD_FUSED_THREADS, smem), params));
        }
        if dims.total_q > 0 {
            launches.push((
                kernels.dq_convert,
                cfg(convert_blocks, BWD_CONVERT_THREADS, 0),
                params,
            ));
        }
    }
    Ok(launches)
}

/// Launches the backward's kernels on `gpu`'s stream (asynchronous) for arguments that passed
/// [`super::validate_bwd`] and gradients / workspace that passed [`super::validate_grads`].
pub(crate) fn launch_bwd(
    gpu: &Gpu,
    dims: &DensePrefillDims,
    args: &super::DensePrefillBwdArgs<'_, DeviceView>,
    grads: &super::DensePrefillGrads<DeviceView>,
    workspace: &DeviceView,
    options: &super::DensePrefillBwdOptions,
) -> Result<()> {
    expect_location("q", args.fwd.q, Location::Cuda(gpu.ordinal()))?;
    let maps = (
        tile_tensor_map(args.fwd.q, BWD_TMA_BOX_ROWS),
        tile_tensor_map(args.fwd.k, BWD_TMA_BOX_ROWS),
        tile_tensor_map(args.fwd.v, BWD_TMA_BOX_ROWS),
        tile_tensor_map(args.d_out, BWD_TMA_BOX_ROWS),
    );
    for (name, cfg, mut params) in lower_bwd(dims, args, grads, workspace, options)? {
        if let (Some(q), Some(k), Some(v), Some(d_out)) = maps {
            (
                params.q_tmap,
                params.k_tmap,
                params.v_tmap,
                params.d_out_tmap,
            ) = (q, k, v, d_out);
            params.flags |= FLAG_TMA;
        }
        let kernel = gpu.kernel(FAMILY, name)?;
        // SAFETY: `DensePrefillBwdParams` mirrors the kernels' parameter struct (checked at compile time).
        // `validate_bwd` / `validate_grads` established the shapes and dtypes and that every tensor lives on this
        // device; `lower_bwd` checked alignment, contiguity and that every offset fits i64. The kernels clamp every
        // offset they read (work.cuh), read q / k / v / out / d_out / lse rows and write d_q / d_k / d_v rows inside
        // the views (heads < h_q, h_k), which by the DeviceView contract are valid, live and do not alias outputs
        // with inputs; delta and the dQ accumulator lie inside the contiguous workspace of bwd_workspace_shape
        // (validate_grads), written by the first launch before the next ones read them (one stream). The TMA maps
        // describe the views' shapes and strides; the TMA unit reads nothing outside them.
        unsafe { gpu.launch(&kernel, &cfg, &params)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::layout::fake_view;

    const BASE: u64 = 0x7f00_0000_0000;

    fn views(
        total_q: usize,
        total_k: usize,
        h_q: usize,
        h_k: usize,
        d: usize,
        b: usize,
    ) -> [DeviceView; 7] {
        let t = DType::Bf16;
        [
            fake_view(BASE, t, &[total_q, h_q, d], None),
            fake_view(BASE + (1 << 32), t, &[total_k, h_k, d], None),
            fake_view(BASE + (2 << 32), t, &[total_k, h_k, 128], None),
            fake_view(BASE + (3 << 32), DType::I32, &[b + 1], None),
            fake_view(BASE + (4 << 32), DType::I32, &[b + 1], None),
            fake_view(BASE + (5 << 32), t, &[total_q, h_q, 128], None),
            fake_view(BASE + (6 << 32), DType::F32, &[h_q, total_q], None),
        ]
    }

    fn lower_for(
        v: &[DeviceView; 7],
        causal: bool,
    ) -> Result<Option<(&'static str, LaunchConfig, DensePrefillFwdParams)>> {
        let args = DensePrefillArgs {
            q: &v[0],
            k: &v[1],
            v: &v[2],
            cu_seqlens_q: &v[3],
            cu_seqlens_k: &v[4],
            softmax_scale: None,
            causal,
        };
        let out = DensePrefillOutput {
            out: v[5].clone(),
            lse: v[6].clone(),
        };
        let dims = super::super::validate(&args)?;
        lower(&dims, &args, &out, 132)
    }

    #[test]
    fn lowers_the_grid_from_row_counts_and_heads() {
        let v = views(1000, 3000, 16, 4, 192, 3);
        let (name, cfg, p) = lower_for(&v, true).unwrap().unwrap();
        assert_eq!(name, kernels::FWD_D192_BF16);
        assert_eq!(p.m_tiles, 8 + 3);
        // 11 * 16 items on at most one CTA per SM.
        assert_eq!(cfg.grid, (132, 1, 1));
        let (_, cfg, _) = lower_for(&views(100, 300, 1, 1, 192, 1), false)
            .unwrap()
            .unwrap();
        assert_eq!(cfg.grid, (2, 1, 1));
        assert_eq!(cfg.shared_mem_bytes, SMEM_BYTES_D192);
        assert_eq!((p.h_per_k, p.flags), (4, FLAG_CAUSAL));
        assert_eq!(
            (p.q_stride_t, p.q_stride_h, p.lse_stride_h),
            (16 * 192, 192, 1000)
        );
        assert_eq!(
            (p.k_stride_t, p.v_stride_t, p.v_stride_h),
            (4 * 192, 4 * 128, 128)
        );
        assert!((p.sm_scale_log2 - 192f32.powf(-0.5) * LOG2_E).abs() < 1e-6);
    }

    #[test]
    fn forward_workspace_is_one_aligned_f32_word_or_more() {
        let check = |v: &DeviceView| expect_f32_workspace(v, FWD_WORKSPACE_WORDS, 4);
        assert!(check(&fake_view(BASE, DType::F32, &[1], None)).is_ok());
        assert!(check(&fake_view(BASE, DType::F32, &[4096], None)).is_ok());
        for bad in [
            fake_view(BASE, DType::F32, &[0], None),
            fake_view(BASE, DType::I32, &[2], None),
            fake_view(BASE + 2, DType::F32, &[1], None),
            fake_view(BASE, DType::F32, &[2, 2], None),
        ] {
            let err = check(&bad).unwrap_err().to_string();
            assert!(err.contains("workspace"), "{err}");
        }
    }

    #[test]
    fn nothing_to_launch_without_query_rows() {
        let v = views(0, 10, 2, 2, 128, 1);
        assert!(lower_for(&v, false).unwrap().is_none());
    }

    #[test]
    fn refuses_rows_that_are_not_16_byte_aligned() {
        let mut v = views(10, 10, 2, 2, 128, 1);
        v[0] = fake_view(BASE + 2, DType::Bf16, &[10, 2, 128], None);
        let err = lower_for(&v, false).unwrap_err().to_string();
        assert!(err.contains("`q`"), "{err}");
    }

    #[test]
    fn tma_maps_cover_strided_rows_and_skip_broadcast_heads() {
        // Packed [rows, heads, cols]: head stride 384 bytes, row stride 4 heads.
        let (dims, strides, boxes) =
            tile_map_args(&fake_view(BASE, DType::Bf16, &[1000, 4, 192], None), 128).unwrap();
        assert_eq!(dims, [192, 4, 1000, 1]);
        assert_eq!(strides, [384, 1536, 1_536_000]);
        assert_eq!(boxes, [64, 1, 128, 1]);
        // Rows padded by 128 columns, one head.
        let padded = fake_view(BASE, DType::Bf16, &[7, 1, 128], Some(&[256, 256, 1]));
        let (_, strides, boxes) = tile_map_args(&padded, 64).unwrap();
        assert_eq!((strides, boxes), ([512, 512, 3584], [64, 1, 64, 1]));
        // A single head with a head stride of 0: never followed, so the row stride stands in for it.
        let single = fake_view(BASE, DType::Bf16, &[7, 1, 128], Some(&[128, 0, 1]));
        assert_eq!(tile_map_args(&single, 64).unwrap().1, [256, 256, 1792]);
        // K broadcast over its heads (stride 0) is copied with cp.async.
        let broadcast = fake_view(BASE, DType::Bf16, &[7, 4, 128], Some(&[128, 0, 1]));
        assert_eq!(tile_map_args(&broadcast, 128), None);
    }

    /// The backward's launches for views `v` (the forward's), with gradients and a workspace of their shapes.
    fn lower_bwd_for(
        v: &[DeviceView; 7],
        workspace: &DeviceView,
        options: super::super::DensePrefillBwdOptions,
    ) -> Result<Vec<BwdLaunch>> {
        let (total_q, h_q, d) = (v[0].shape()[0], v[0].shape()[1], v[0].shape()[2]);
        let (total_k, h_k) = (v[1].shape()[0], v[1].shape()[1]);
        let t = DType::Bf16;
        let grads = super::super::DensePrefillGrads {
            d_q: fake_view(BASE + (7 << 32), t, &[total_q, h_q, d], None),
            d_k: fake_view(BASE + (8 << 32), t, &[total_k, h_k, d], None),
            d_v: fake_view(BASE + (9 << 32), t, &[total_k, h_k, 128], None),
        };
        let args = super::super::DensePrefillBwdArgs {
            fwd: DensePrefillArgs {
                q: &v[0],
                k: &v[1],
                v: &v[2],
                cu_seqlens_q: &v[3],
                cu_seqlens_k: &v[4],
                softmax_scale: Some(0.1),
                causal: true,
            },
            out: &v[5],
            d_out: &v[5],
            lse: &v[6],
        };
        let dims = super::super::validate_bwd(&args)?;
        super::super::validate_grads(&dims, v[0].location(), &grads, workspace, &options)?;
        lower_bwd(&dims, &args, &grads, workspace, &options)
    }

    const DETERMINISTIC: super::super::DensePrefillBwdOptions =
        super::super::DensePrefillBwdOptions {
            deterministic: true,
            fused: None,
        };
    const FUSED: super::super::DensePrefillBwdOptions = super::super::DensePrefillBwdOptions {
        deterministic: false,
        fused: Some(true),
    };

    #[test]
    fn the_measured_schedule_is_fused_at_d128_only_and_never_deterministic() {
        let auto = super::super::DensePrefillBwdOptions::default();
        assert_eq!(
            (auto.fused_for(128).unwrap(), auto.fused_for(192).unwrap()),
            (true, false)
        );
        assert!(!DETERMINISTIC.fused_for(128).unwrap());
        assert!(FUSED.fused_for(192).unwrap());
        let both = super::super::DensePrefillBwdOptions {
            deterministic: true,
            fused: Some(true),
        };
        assert!(both
            .fused_for(128)
            .unwrap_err()
            .to_string()
            .contains("options.fused"));
    }

    #[test]
    fn the_delta_grid_limit_binds_only_the_schedule_that_launches_delta() {
        // 2^27 rows of 128 heads: one warp per (row, head) is 2^31 delta CTAs, past the grid's limit; the separate
        // schedule launches no delta kernel (its dQ kernel computes delta), so it still lowers.
        let total_q = 1usize << 27;
        let v = views(total_q, 4096, 128, 128, 192, 1);
        let delta = fake_view(BASE + (10 << 32), DType::F32, &[128, total_q], None);
        let launches = lower_bwd_for(&v, &delta, DETERMINISTIC).unwrap();
        let names: Vec<&str> = launches.iter().map(|l| l.0).collect();
        assert_eq!(
            names,
            [kernels::BWD_DQ_D192_BF16, kernels::BWD_DKV_D192_BF16]
        );
    }

    #[test]
    fn lowers_the_separate_backward_to_dq_and_dkv_launches() {
        let v = views(1000, 3000, 16, 4, 192, 3);
        let delta = fake_view(BASE + (10 << 32), DType::F32, &[16, 1000], None);
        let launches = lower_bwd_for(&v, &delta, DETERMINISTIC).unwrap();
        let names: Vec<&str> = launches.iter().map(|l| l.0).collect();
        // No delta launch: the dQ kernel computes delta and writes it for the dK / dV kernel, which runs after it.
        assert_eq!(
            names,
            [kernels::BWD_DQ_D192_BF16, kernels::BWD_DKV_D192_BF16]
        );
        let p = &launches[0].2;
        assert_eq!((p.q_tiles, p.k_tiles), (8 + 3, 24 + 3));
        assert_eq!(launches[0].1.grid.0, 11 * 16);
        assert_eq!(launches[0].1.block.0, BWD_DQ_THREADS);
        assert_eq!(launches[1].1.grid.0, 27 * 4);
        assert_eq!(launches[1].1.block.0, BWD_THREADS);
        assert_eq!(
            (
                launches[0].1.shared_mem_bytes,
                launches[1].1.shared_mem_bytes
            ),
            (BWD_DQ_SMEM_D192, BWD_DKV_SMEM_D192)
        );
        assert_eq!((p.h_per_k, p.flags, p.sm_scale), (4, FLAG_CAUSAL, 0.1));
        assert_eq!((p.lse_stride_h, p.delta_stride_h), (1000, 1000));
        assert_eq!((p.dq_accum, p.delta), (0, BASE + (10 << 32)));
    }

    /// The shared-memory sizes requested here are the ones bwd.cuh static_asserts (a launch with less traps).
    #[test]
    fn backward_smem_sizes_match_the_kernels_static_asserts() {
        let src = include_str!("../../../../flashmla-kernels/csrc/sm90/dense_prefill/bwd.cuh");
        let asserted = |name: &str| -> u32 {
            let at = src
                .find(&format!("static_assert({name} == "))
                .unwrap_or_else(|| panic!("no static_assert of {name}"));
            let rest = &src[at + name.len() + "static_assert( == ".len()..];
            rest[..rest.find(',').unwrap()].trim().parse().unwrap()
        };
        assert_eq!(asserted("kDqSmemBytes<192>"), BWD_DQ_SMEM_D192);
        assert_eq!(asserted("kDqSmemBytes<128>"), BWD_DQ_SMEM_D128);
        assert_eq!(asserted("kDkvSmemBytes<192>"), BWD_DKV_SMEM_D192);
        assert_eq!(asserted("kDkvSmemBytes<128>"), BWD_DKV_SMEM_D128);
        assert_eq!(asserted("kFusedSmemBytes<192>"), BWD_FUSED_SMEM_D192);
        assert_eq!(asserted("kFusedSmemBytes<128>"), BWD_FUSED_SMEM_D128);
    }

    #[test]
    fn lowers_the_default_backward_to_delta_fused_and_convert_launches() {
        let v = views(1000, 3000, 16, 4, 192, 3);
        let ws = BASE + (10 << 32);
        // A deterministic-size workspace is refused, naming the expected shape.
        let small = fake_view(ws, DType::F32, &[16, 1000], None);
        let err = lower_bwd_for(&v, &small, FUSED).unwrap_err().to_string();
        assert!(
            err.contains("workspace") && err.contains("3751552"),
            "{err}"
        );
        // 16 heads x (ceil(1000 / 64) + 3) tiles x 64 x 192 accumulator floats, then delta.
        let acc = 16 * 19 * 64 * 192;
        let workspace = fake_view(ws, DType::F32, &[acc + 16 * 1000], None);
        let launches = lower_bwd_for(&v, &workspace, FUSED).unwrap();
        let names: Vec<&str> = launches.iter().map(|l| l.0).collect();
        assert_eq!(
            names,
            [
                kernels::BWD_DELTA_BF16,
                kernels::BWD_FUSED_D192_BF16,
                kernels::BWD_DQ_CONVERT_D192_BF16
            ]
        );
        let p = &launches[1].2;
        // 128 keys per CTA: ceil(3000 / 128) + 3 tiles per key head.
        assert_eq!(p.k_tiles, 24 + 3);
        assert_eq!(launches[1].1.grid.0, 27 * 4);
        assert_eq!(
            (launches[1].1.block.0, launches[1].1.shared_mem_bytes),
            (BWD_FUSED_THREADS, BWD_FUSED_SMEM_D192)
        );
        // The accumulator first, then delta.
        assert_eq!(
            (p.dq_accum, p.delta, p.delta_stride_h, p.d_qk, p.q_tiles),
            (ws, ws + acc as u64 * 4, 1000, 192, 19)
        );
        // One conversion CTA per accumulator tile and head.
        assert_eq!(launches[2].1.grid.0, 19 * 16);
    }

    #[test]
    fn backward_refuses_a_strided_workspace_and_misaligned_gradients() {
        let v = views(10, 10, 2, 2, 128, 1);
        let strided = fake_view(BASE + (10 << 32), DType::F32, &[2, 10], Some(&[1, 2]));
        let err = lower_bwd_for(&v, &strided, DETERMINISTIC)
            .unwrap_err()
            .to_string();
        assert!(err.contains("workspace"), "{err}");
        let mut v = views(10, 10, 2, 2, 128, 1);
        v[5] = fake_view(BASE + 6, DType::Bf16, &[10, 2, 128], None);
        let delta = fake_view(BASE + (10 << 32), DType::F32, &[2, 10], None);
        let err = lower_bwd_for(&v, &delta, DETERMINISTIC)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`out`"), "{err}");
    }
}
