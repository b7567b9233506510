//! GPU path of the decode, dense ([`lower`]) and sparse FP8 ([`lower_sparse`]): checks the limits of the sm_90a
//! kernels (`csrc/sm90/decode/`, design in `docs/decode.md`), lowers validated arguments to their [`DecodeParams`]
//! and queues three kernels on the stream, with no host synchronisation (a decode step can be captured in a CUDA
//! graph and replayed after `cache_seqlens` and `block_table`, or the indices and lengths, changed in place):
//! 1. `decode_schedule` (one CTA) computes the split-KV schedule from `cache_seqlens` into the workspace; for at
//!    most [`INLINE_SCHEDULE_MAX_BATCH`] requests it is not launched and every split CTA derives the schedule
//!    ([`FLAG_INLINE_SCHEDULE`]), so a small step costs the host two launches; a sparse batch without length
//!    tensors has a schedule that follows from its shape ([`FLAG_UNIFORM_LINE`]): never launched;
//! 2. `decode_split_*` (grid `head_tiles x grid_parts`, 384 threads; the narrow sparse kernels 512) attends each
//!    query-row tile to the key chunks of its parts, writing unsplit requests in final form and split ones as f32
//!    partials; after the schedule kernel it is a programmatic launch whose CTAs wait for the schedule after their
//!    setup;
//! 3. `decode_combine_*` (grid `batch x head_tiles x 8`, or `max_parts x head_tiles x 8` where the balanced schedule
//!    has fewer parts than requests: [`FLAG_COMBINE_BY_PART`]; a programmatic launch that waits for the split
//!    kernel at its start) merges the partials of split requests; not launched for a uniform line whose parts hold
//!    whole requests (nothing split).
//!
//! Kernel limits checked here (beyond [`super::validate_dense`]): `q` and `k_cache` rows 16-byte aligned (the
//! gather copies 16-byte chunks); `block_table`, `cache_seqlens`, `attn_sink`, `out` and `lse` aligned to their
//! element size; every reachable offset fits `i64`; sizes and the schedule's line fit the kernels' 32-bit
//! counters; `head_tiles <= 65535` (a grid dimension). Values are not checked (that would need a
//! synchronisation): `cache_seqlens` are clamped to `0..=max_blocks * page_size` and a block id outside
//! `0..num_blocks` is a missing key, as in the reference. Sparse: `q` rows 16-byte aligned, each FP8 cache starting
//! on 8 bytes with a block stride that is a multiple of 8 (16-byte copies when both are multiples of 16, else
//! 8-byte ones: `FLAG_COPY8`), the index and length tensors aligned to 4 bytes; an index outside `0..num_blocks *
//! page_size` of its cache is a missing key, lengths are clamped to `0..=topk`; every query token is a request of
//! the schedule.
//!
//! Memory: the workspace ([`dense_workspace_words`] / [`sparse_workspace_words`] f32 words) holds the schedule (`batch + 3` i32;
//! with an inline schedule each split CTA keeps its own copy in shared memory) and the
//! partials of split requests (`2 * max_parts * head_tiles * 64` rows of 512 f32 plus their lse; `max_parts` is
//! `sm_count / head_tiles` for the balanced schedule, about 34 MB on an H100, and grows with `batch * max_blocks *
//! page_size` in batch-invariant mode). Nothing else is allocated.

use super::{
    DecodeOptions, DecodeOutput, DenseDecodeArgs, DenseDecodeDims, ExtraKvArgs, SparseDecodeArgs,
    SparseDecodeDims,
};
use crate::cuda::{device_params, encode_tiled_u16_sw128, Gpu, LaunchConfig, TensorMapBytes};
use crate::error::{Error, Result};
use crate::ops::layout::{
    expect_element_aligned, expect_offsets_fit_i64, expect_rows_16b, rows_aligned, stride_param,
};
use crate::reference::decode::{
    aligned_budget, balanced_budget, ScheduleConfig, CHUNK_OVERHEAD_TILES, MAX_BUDGET_FLOOR,
    MAX_REQUEST_PARTS,
};
use crate::tensor::{DType, DeviceView, Location, TensorMeta};
use crate::validate::{expect_f32_workspace, expect_location, to_i32};

/// Kernel family (`csrc/sm90/decode/`).
pub const FAMILY: &str = "decode";
/// Query rows per CTA (`kRowsPerCta`, the wgmma M).
pub const ROWS_PER_CTA: usize = 64;
/// Keys per pipeline tile (`kKeysPerTile`), the unit of the schedule.
pub const KEYS_PER_TILE: usize = 64;
/// Threads of a split-kernel CTA (`kThreads`): a producer and two consumer warpgroups.
pub const THREADS_PER_CTA: u32 = 384;
/// Threads of a narrow sparse kernel's CTA (`kNarrowThreads`): two copy and two consumer warpgroups.
pub const THREADS_PER_CTA_NARROW: u32 = 512;
/// Threads of the schedule kernel's single CTA (`kScheduleThreads`).
pub const SCHEDULE_THREADS: u32 = 1024;
/// Threads of a combine CTA (`kCombineThreads`).
pub const COMBINE_THREADS: u32 = 256;
/// The one-warp combine's CTAs up to which a row gets four warps whatever its tile's rows (a small batch: its grid,
/// up to four times as many CTAs, then still fits the SMs of an H100 about twice).
pub const COMBINE4_MAX_CTAS: usize = 128;
/// Dynamic shared memory of the d_qk = 576 split kernels (`kSmemBytes<576>`, static_asserted in config.cuh).
pub const SMEM_BYTES_D576: u32 = 232_448;
/// Dynamic shared memory of the d_qk = 512 split kernels (`kSmemBytes<512>`).
pub const SMEM_BYTES_D512: u32 = 216_064;
/// Dynamic shared memory requested for the narrow sparse kernels (`*_n16`, `*_n32`): the 227 KB limit, which each of
/// their plans fits (`kNarrowSmemBytes`, static_asserted in narrow.cuh).
pub const SMEM_BYTES_NARROW: u32 = 232_448;
/// Value width.
pub const D_V: usize = 512;
/// `flags` bit: bottom-right causal mask (`kFlagCausal`).
pub const FLAG_CAUSAL: u32 = 1;
/// `flags` bit: `out` rows allow 4-byte stores (`kFlagOutVec4`).
pub const FLAG_OUT_VEC4: u32 = 2;
/// `flags` bit: sparse FP8 decode (`kFlagSparse`).
pub const FLAG_SPARSE: u32 = 4;
/// `flags` bit: an FP8 cache is only 8-byte aligned, rows are copied in 8-byte pieces (`kFlagCopy8`).
pub const FLAG_COPY8: u32 = 8;
/// `flags` bit: `out` rows are 16-byte aligned, final rows go out as bulk stores (`kFlagOutBulk`).
pub const FLAG_OUT_BULK: u32 = 16;
/// `flags` bit: `k_tmap` describes the dense cache; whole key tiles are loaded by TMA (`kFlagKTma`).
pub const FLAG_K_TMA: u32 = 32;
/// `flags` bit: no schedule kernel; every split CTA derives the schedule of the batch (`kFlagInlineSchedule`).
pub const FLAG_INLINE_SCHEDULE: u32 = 128;
/// `flags` bit: a sparse batch without length tensors, whose requests all have the same segment: every role derives
/// the schedule from the shape (`kFlagUniformLine`); no schedule kernel, and no combine where no request is split.
pub const FLAG_UNIFORM_LINE: u32 = 64;
/// `flags` bit: the combine's grid x runs over the boundaries between parts instead of over requests; the CTA of
/// boundary `i` merges the request that starts in part `i` and crosses into part `i + 1`, if any
/// (`kFlagCombineByPart`). Set where the balanced schedule has fewer parts than requests: a part boundary splits at
/// most one request, so the grid shrinks to the requests that can be split.
pub const FLAG_COMBINE_BY_PART: u32 = 256;
/// Words of the schedule after the `batch + 1` line starts (`kScheduleTail`).
pub const SCHEDULE_TAIL: usize = 2;
/// Most requests whose schedule the split kernel derives itself (`kInlineScheduleMaxBatch`: four per lane of one
/// warp; each split CTA keeps its copy in shared memory).
pub const INLINE_SCHEDULE_MAX_BATCH: usize = 128;
/// The gather moves 16-byte chunks.
const CHUNK_ALIGN_BYTES: u64 = 16;
/// Largest grid y / z dimension.
const MAX_GRID_YZ: usize = 65_535;
/// The schedule's line positions (and `parts * budget`) must stay below this (i32 arithmetic in the kernels).
const MAX_LINE: usize = (i32::MAX / 4) as usize;
/// log2(e): the kernel keeps logits in base 2.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

device_params! {
    family = "decode", cxx = "DecodeParams";
    /// Mirror of `flashmla::decode::DecodeParams` (params.h), checked against it at compile time
    /// ([`crate::cuda::params`]). Pointers are device addresses; strides are in elements (FP8 caches' block strides
    /// in bytes). `Default` is all zeros (absent pointers).
    #[derive(Debug, Clone, Copy, PartialEq, Default)]
    pub struct DecodeParams {
        /// Dense, [`FLAG_K_TMA`]: the TMA map of `k_cache` (dims `d_qk, h_kv, page_size, num_blocks`, boxes of
        /// 64 columns x 64 keys); zeros otherwise.
        pub k_tmap: TensorMapBytes,
        /// `[b, s_q, h_q, d_qk]`.
        pub q: u64,
        /// `[num_blocks, page_size, h_kv, d_qk]`.
        pub k_cache: u64,
        /// Dense: `[b, max_blocks]` i32.
        pub block_table: u64,
        /// Dense: `[b]` i32.
        pub cache_seqlens: u64,
        /// Sparse: `[b, s_q, topk]` i32.
        pub indices: u64,
        /// Sparse: `[b]` i32; 0 when absent.
        pub topk_length: u64,
        /// Sparse: the extra FP8 cache; 0 when absent.
        pub extra_cache: u64,
        /// Sparse: `[b, s_q, extra_topk]` i32.
        pub extra_indices: u64,
        /// Sparse: `[b]` i32; 0 when absent.
        pub extra_topk_length: u64,
        /// `[h_q]` f32; 0 when absent.
        pub attn_sink: u64,
        /// `[b, s_q, h_q, 512]`, q's dtype.
        pub out: u64,
        /// `[b, h_q, s_q]` f32.
        pub lse: u64,
        /// Workspace: `batch + 1 + SCHEDULE_TAIL` i32 (padded to 4).
        pub schedule: u64,
        /// Workspace: `[2 * max_parts][head_tiles][64][512]` f32.
        pub part_o: u64,
        /// Workspace: `[2 * max_parts][head_tiles][64]` f32.
        pub part_lse: u64,
        /// Elements between `q` requests.
        pub q_stride_b: i64,
        /// Elements between `q` tokens.
        pub q_stride_s: i64,
        /// Elements between `q` heads.
        pub q_stride_h: i64,
        /// Elements between cache blocks.
        pub k_stride_block: i64,
        /// Elements between tokens of a block.
        pub k_stride_tok: i64,
        /// Elements between key heads.
        pub k_stride_head: i64,
        /// Elements between block-table rows.
        pub block_table_stride_b: i64,
        /// Elements between `cache_seqlens` entries.
        pub cache_seqlens_stride: i64,
        /// Elements between `attn_sink` entries.
        pub attn_sink_stride: i64,
        /// Elements between index rows of consecutive requests.
        pub indices_stride_b: i64,
        /// Elements between index rows of consecutive query tokens.
        pub indices_stride_s: i64,
        /// Elements between `topk_length` entries.
        pub topk_length_stride: i64,
        /// Bytes between extra-cache blocks.
        pub extra_stride_block: i64,
        /// Elements between extra index rows of consecutive requests.
        pub extra_indices_stride_b: i64,
        /// Elements between extra index rows of consecutive query tokens.
        pub extra_indices_stride_s: i64,
        /// Elements between `extra_topk_length` entries.
        pub extra_topk_length_stride: i64,
        /// Elements between `out` requests.
        pub out_stride_b: i64,
        /// Elements between `out` tokens.
        pub out_stride_s: i64,
        /// Elements between `out` heads.
        pub out_stride_h: i64,
        /// Elements between `lse` requests.
        pub lse_stride_b: i64,
        /// Elements between `lse` heads.
        pub lse_stride_h: i64,
        /// Elements between `lse` tokens.
        pub lse_stride_s: i64,
        /// Schedule requests (dense: `b`; sparse: `b * s_q`).
        pub batch: i32,
        /// Query tokens per request (sparse: 1).
        pub s_q: i32,
        /// Query tokens per batch entry a request stands for (dense: 1; sparse: `s_q`).
        pub req_tokens: i32,
        /// Query heads.
        pub h_q: i32,
        /// Key heads.
        pub h_kv: i32,
        /// `h_q / h_kv`.
        pub heads_per_kv: i32,
        /// `s_q * heads_per_kv`: query rows per (request, key head).
        pub rows: i32,
        /// `ceil(rows / 64)`.
        pub row_tiles: i32,
        /// `h_kv * row_tiles`.
        pub head_tiles: i32,
        /// Blocks in the cache.
        pub num_blocks: i32,
        /// Tokens per block.
        pub page_size: i32,
        /// Columns of the block table (dense).
        pub max_blocks: i32,
        /// Entries per index row (sparse).
        pub topk: i32,
        /// Entries per extra index row (sparse; 0: no extra cache).
        pub extra_topk: i32,
        /// Blocks of the extra cache.
        pub extra_num_blocks: i32,
        /// Tokens per extra-cache block.
        pub extra_page_size: i32,
        /// Parts of the balanced schedule (grid y of the split kernel).
        pub grid_parts: i32,
        /// Bound on the schedule's parts (sizes the partials).
        pub max_parts: i32,
        /// Line units a request costs beyond its tiles.
        pub chunk_overhead: i32,
        /// 0: balanced schedule; > 0: batch-invariant with this budget.
        pub fixed_budget: i32,
        /// Balanced schedule: most parts one request is split over (0: no bound) ...
        pub max_request_parts: i32,
        /// ... while its parts hold at most this many line units (0: always).
        pub max_budget_floor: i32,
        /// `FLAG_*` bits.
        pub flags: u32,
        /// `softmax_scale * log2(e)`.
        pub sm_scale_log2: f32,
        /// `divider` of `req_tokens`: multiplier ...
        pub req_div_mul: u32,
        /// ... and shift.
        pub req_div_shr: u32,
        /// `divider` of `heads_per_kv`: multiplier ...
        pub hpk_div_mul: u32,
        /// ... and shift.
        pub hpk_div_shr: u32,
        /// `divider` of `row_tiles`: multiplier ...
        pub row_tiles_div_mul: u32,
        /// ... and shift.
        pub row_tiles_div_shr: u32,
        /// `divider` of `page_size`: multiplier ...
        pub page_div_mul: u32,
        /// ... and shift.
        pub page_div_shr: u32,
        /// `divider` of `extra_page_size`: multiplier ...
        pub extra_page_div_mul: u32,
        /// ... and shift.
        pub extra_page_div_shr: u32,
        /// Zeros: pad the struct to its 64-byte alignment (`k_tmap`) without implicit padding.
        pub tail: [i32; 4],
    }
}

/// The family's kernel symbols, spelled once (the launcher and the contract test use these).
pub mod kernels {
    /// The schedule.
    pub const SCHEDULE: &str = "decode_schedule";
    /// Split kernel, bf16, d_qk 576.
    pub const SPLIT_BF16_D576: &str = "decode_split_bf16_d576";
    /// Split kernel, bf16, d_qk 512.
    pub const SPLIT_BF16_D512: &str = "decode_split_bf16_d512";
    /// Split kernel, f16, d_qk 576.
    pub const SPLIT_F16_D576: &str = "decode_split_f16_d576";
    /// Split kernel, f16, d_qk 512.
    pub const SPLIT_F16_D512: &str = "decode_split_f16_d512";
    /// Split kernel, bf16, d_qk 576, for one row tile per key head: each key is read by one CTA, so its TMA loads
    /// carry an L2 evict-first hint.
    pub const SPLIT_BF16_D576_ONCE: &str = "decode_split_bf16_d576_once";
    /// The same, bf16, d_qk 512.
    pub const SPLIT_BF16_D512_ONCE: &str = "decode_split_bf16_d512_once";
    /// The same, f16, d_qk 576.
    pub const SPLIT_F16_D576_ONCE: &str = "decode_split_f16_d576_once";
    /// The same, f16, d_qk 512.
    pub const SPLIT_F16_D512_ONCE: &str = "decode_split_f16_d512_once";
    /// Sparse split kernel, V3.2 FP8 cache (656-byte tokens, d_qk 576), bf16.
    pub const SPLIT_FP8_V32: &str = "decode_split_fp8_v32";
    /// Sparse split kernel, MODEL1 FP8 cache (584-byte tokens, d_qk 512), bf16.
    pub const SPLIT_FP8_MODEL1: &str = "decode_split_fp8_model1";
    /// Sparse split kernel of two row tiles (h_q 65..128), V3.2 cache: a 2-CTA cluster whose producers each
    /// dequantise half of a tile's rows into both CTAs.
    pub const SPLIT_FP8_V32_PAIR: &str = "decode_split_fp8_v32_pair";
    /// The same for the MODEL1 cache.
    pub const SPLIT_FP8_MODEL1_PAIR: &str = "decode_split_fp8_model1_pair";
    /// Sparse split kernel for requests of at most 16 query rows, V3.2 cache (16-byte aligned): the narrow kernel
    /// (`S^T = K Q^T` with the query rows as the MMA's N, so a tile costs the MMAs of 16 rows, not 64; raw cache
    /// rows streamed by bulk copies and dequantised by the copy warps into two bf16 stages;
    /// [`super::SMEM_BYTES_NARROW`], [`super::THREADS_PER_CTA_NARROW`]). (V3.2 requests of 17..32 rows run the
    /// 64-row kernel: 32 rows of Q leave room for one bf16 stage only.)
    pub const SPLIT_FP8_V32_N16: &str = "decode_split_fp8_v32_n16";
    /// Narrow kernel, MODEL1 cache, up to 16 query rows.
    pub const SPLIT_FP8_MODEL1_N16: &str = "decode_split_fp8_model1_n16";
    /// Narrow kernel, MODEL1 cache, up to 32 query rows.
    pub const SPLIT_FP8_MODEL1_N32: &str = "decode_split_fp8_model1_n32";
    /// Combine, bf16 output.
    pub const COMBINE_BF16: &str = "decode_combine_bf16";
    /// Combine, f16 output.
    pub const COMBINE_F16: &str = "decode_combine_f16";
    /// Combine with two warps per row (up to 32 rows per tile), bf16 output.
    pub const COMBINE2_BF16: &str = "decode_combine2_bf16";
    /// Combine with two warps per row, f16 output.
    pub const COMBINE2_F16: &str = "decode_combine2_f16";
    /// Combine with four warps per row (up to 16 rows per tile, and small batches), bf16 output.
    pub const COMBINE4_BF16: &str = "decode_combine4_bf16";
    /// Combine with four warps per row, f16 output.
    pub const COMBINE4_F16: &str = "decode_combine4_f16";
    /// Every kernel of the family.
    pub const ALL: &[&str] = &[
        SCHEDULE,
        SPLIT_BF16_D576,
        SPLIT_BF16_D512,
        SPLIT_F16_D576,
        SPLIT_F16_D512,
        SPLIT_BF16_D576_ONCE,
        SPLIT_BF16_D512_ONCE,
        SPLIT_F16_D576_ONCE,
        SPLIT_F16_D512_ONCE,
        SPLIT_FP8_V32,
        SPLIT_FP8_MODEL1,
        SPLIT_FP8_V32_PAIR,
        SPLIT_FP8_MODEL1_PAIR,
        SPLIT_FP8_V32_N16,
        SPLIT_FP8_MODEL1_N16,
        SPLIT_FP8_MODEL1_N32,
        COMBINE_BF16,
        COMBINE_F16,
        COMBINE2_BF16,
        COMBINE2_F16,
        COMBINE4_BF16,
        COMBINE4_F16,
    ];
}

/// Split-kernel symbol and dynamic shared memory for a dtype and `d_qk`; `keys_read_once`: one row tile per key
/// head (each key tile is read by one CTA), which takes the `*_once` kernels (L2 evict-first key loads; with more
/// row tiles the other CTAs of a key head read the tile from L2 right after).
pub fn split_kernel_for(
    dtype: DType,
    d_qk: usize,
    keys_read_once: bool,
) -> Result<(&'static str, u32)> {
    use kernels::*;
    let pick = |many: &'static str, once: &'static str| if keys_read_once { once } else { many };
    match (dtype, d_qk) {
        (DType::Bf16, 576) => Ok((pick(SPLIT_BF16_D576, SPLIT_BF16_D576_ONCE), SMEM_BYTES_D576)),
        (DType::Bf16, 512) => Ok((pick(SPLIT_BF16_D512, SPLIT_BF16_D512_ONCE), SMEM_BYTES_D512)),
        (DType::F16, 576) => Ok((pick(SPLIT_F16_D576, SPLIT_F16_D576_ONCE), SMEM_BYTES_D576)),
        (DType::F16, 512) => Ok((pick(SPLIT_F16_D512, SPLIT_F16_D512_ONCE), SMEM_BYTES_D512)),
        _ => Err(Error::unsupported(
            format!("decode kernel for {dtype} with d_qk = {d_qk}"),
            "the sm_90a kernels are built for bf16 and f16 with d_qk 512 and 576",
        )),
    }
}

/// Combine-kernel symbol for a dtype.
pub fn combine_kernel_for(dtype: DType) -> &'static str {
    if dtype == DType::F16 {
        kernels::COMBINE_F16
    } else {
        kernels::COMBINE_BF16
    }
}

/// The combine launch for a one-warp combine kernel of [`combine_kernel_for`]: the kernel with as many warps per row
/// as keep a row tile's CTAs at most 8 (four warps for up to 16 rows per tile, two for up to 32; four whatever the
/// rows for a small batch, whose one-warp grid, 8 CTAs per row tile of `tiles = batch * head_tiles`, has at most
/// [`COMBINE4_MAX_CTAS`]), and its grid z, the CTAs of a row tile (`ceil(tile rows / rows per CTA)`). A row's warps
/// walk its parts side by side: a request split over many parts is merged in a fraction of the time (H100, one
/// request of 131072 keys among 127 of 1024, h_q 16: 136.8 -> 129.3 us for the whole step); a CTA of a request that
/// was not split returns at once, and fewer of those cost less. `batch_invariant`: the choice depends on the rows
/// alone, never on the batch, since the warps of a row add its parts in a different order.
fn combine_launch(
    kernel: &'static str,
    tiles: usize,
    rows: usize,
    batch_invariant: bool,
) -> (&'static str, u32) {
    let f16 = kernel == kernels::COMBINE_F16;
    let tile_rows = rows.min(ROWS_PER_CTA);
    // The one-warp combine's CTAs for this batch: 8 per row tile of 64 rows.
    let one_warp_ctas = tiles * (COMBINE_THREADS as usize / 32);
    let small_batch = !batch_invariant && one_warp_ctas <= COMBINE4_MAX_CTAS;
    let warps_per_row = if small_batch || tile_rows <= 16 {
        4
    } else if tile_rows <= 32 {
        2
    } else {
        1
    };
    let kernel = match (warps_per_row, f16) {
        (4, true) => kernels::COMBINE4_F16,
        (4, false) => kernels::COMBINE4_BF16,
        (2, true) => kernels::COMBINE2_F16,
        (2, false) => kernels::COMBINE2_BF16,
        _ => kernel,
    };
    let rows_per_cta = COMBINE_THREADS as usize / 32 / warps_per_row;
    (kernel, tile_rows.div_ceil(rows_per_cta) as u32)
}

/// What the schedule sees of a decode: its requests (dense: the batch; sparse: every query token, since each has
/// its own indices), the query rows of a request per key head, the key heads, and the most keys a request can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleShape {
    /// Requests on the schedule's line.
    pub requests: usize,
    /// Key heads (sparse: 1).
    pub h_kv: usize,
    /// Query rows per (request, key head): dense `s_q * h_q / h_kv`, sparse `h_q`.
    pub rows: usize,
    /// Most keys a request can have: dense `max_blocks * page_size`, sparse `topk + extra_topk`.
    pub key_cap: usize,
}

impl ScheduleShape {
    /// The shape of a dense decode.
    pub fn dense(dims: &DenseDecodeDims) -> Self {
        ScheduleShape {
            requests: dims.batch,
            h_kv: dims.h_kv,
            rows: dims.s_q * (dims.h_q / dims.h_kv),
            key_cap: dims.max_blocks.saturating_mul(dims.page_size),
        }
    }

    /// The shape of a sparse decode.
    pub fn sparse(dims: &SparseDecodeDims) -> Self {
        ScheduleShape {
            requests: dims.batch.saturating_mul(dims.s_q),
            h_kv: 1,
            rows: dims.h_q,
            key_cap: dims.kv.topk + dims.extra.map_or(0, |e| e.topk),
        }
    }
}

/// The schedule's shape-only parameters for a call: how the line is cut and how many partial slots it may need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleGeometry {
    /// `h_kv * ceil(s_q * h_q / h_kv / 64)`: CTAs per chunk (grid x).
    pub head_tiles: usize,
    /// Parts the grid has per head tile (grid y).
    pub grid_parts: usize,
    /// Bound on the parts of any schedule of this shape (partials are sized by it).
    pub max_parts: usize,
    /// 0 for the balanced schedule, else the batch-invariant budget in line units.
    pub fixed_budget: usize,
}

impl ScheduleGeometry {
    /// The geometry of a dense decode of `dims` on a device with `sm_count` SMs (see [`Self::for_shape`]).
    ///
    /// Worked example: `s_q = 1, h_q = 128, h_kv = 1` on 132 SMs: `head_tiles = 2`, `grid_parts = 66`.
    pub fn of(dims: &DenseDecodeDims, options: &DecodeOptions, sm_count: usize) -> Result<Self> {
        Self::for_shape(&ScheduleShape::dense(dims), options, sm_count)
    }

    /// The geometry of a decode of `shape` on a device with `sm_count` SMs.
    ///
    /// Balanced: `grid_parts = num_parts` or `max(1, sm_count / head_tiles)`, `max_parts = grid_parts`.
    /// Batch-invariant: budget `B = chunk_tiles` or `max(overhead + 64, ceil((overhead + t_cap) / 4))` line units
    /// (`t_cap = ceil(key_cap / 64)`: a request spans at most five parts), every request's segment rounded up to a
    /// multiple of `B`; `max_parts = requests * ceil((overhead + t_cap) / B)`.
    pub fn for_shape(
        shape: &ScheduleShape,
        options: &DecodeOptions,
        sm_count: usize,
    ) -> Result<Self> {
        let head_tiles = shape.h_kv * shape.rows.div_ceil(ROWS_PER_CTA);
        if head_tiles > MAX_GRID_YZ {
            return Err(Error::unsupported(
                format!("decode with {head_tiles} query-row tiles per request"),
                format!("at most {MAX_GRID_YZ} (a grid dimension of the combine kernel)"),
            ));
        }
        let grid_parts = match options.num_parts {
            Some(0) => return Err(Error::invalid("options.num_parts", ">= 1", 0)),
            Some(n) => n,
            None => (sm_count / head_tiles).max(1),
        }
        .min(MAX_GRID_YZ);
        let overhead = CHUNK_OVERHEAD_TILES;
        let t_cap = shape.key_cap.div_ceil(KEYS_PER_TILE);
        let seg_cap = overhead + t_cap;
        let (max_parts, fixed_budget, line) = if options.batch_invariant {
            let budget = match options.chunk_tiles {
                Some(n) if n > overhead => n,
                Some(n) => {
                    return Err(Error::invalid(
                        "options.chunk_tiles",
                        format!("more than the chunk overhead ({overhead} tiles)"),
                        n,
                    ))
                }
                None => (overhead + KEYS_PER_TILE).max(seg_cap.div_ceil(4)),
            };
            let per_request = seg_cap.div_ceil(budget);
            let parts = shape.requests.saturating_mul(per_request);
            (parts, budget, parts.saturating_mul(budget))
        } else {
            (grid_parts, 0, shape.requests.saturating_mul(seg_cap))
        };
        if line > MAX_LINE || max_parts > MAX_LINE {
            return Err(Error::unsupported(
                format!(
                    "decode with {} schedule requests of up to {} keys each",
                    shape.requests, shape.key_cap
                ),
                format!(
                    "the schedule's line (requests * (tiles + overhead)) must stay below {MAX_LINE}"
                ),
            ));
        }
        Ok(ScheduleGeometry {
            head_tiles,
            grid_parts,
            max_parts,
            fixed_budget,
        })
    }

    /// f32 words of the workspace: the schedule (`batch + 3` i32, padded to 16 bytes), the partial lse and the
    /// partial outputs.
    pub fn workspace_words(&self, batch: usize) -> usize {
        let (sched, lse, o) = self.workspace_split(batch);
        sched + lse + o
    }

    /// Whether the split kernel derives the schedule of `batch` requests itself, so that a step is two launches
    /// (at most [`INLINE_SCHEDULE_MAX_BATCH`] requests: one warp of every split CTA scans their lengths, which
    /// costs less than the schedule kernel and its launch; a larger batch keeps the kernel, whose CTA scans a
    /// thousand requests per round).
    pub fn inline_schedule(batch: usize) -> bool {
        (1..=INLINE_SCHEDULE_MAX_BATCH).contains(&batch)
    }

    /// The budget of a uniform line: `requests` requests of `tiles` key tiles each, cut by the rule of the kernels'
    /// `schedule_rule` (schedule.cuh; [`decode_schedule`](crate::reference::decode::decode_schedule) on the CPU).
    /// Returns the segment and the budget, both in line units.
    pub fn uniform_budget(&self, requests: usize, tiles: usize) -> (usize, usize) {
        let seg = CHUNK_OVERHEAD_TILES + tiles;
        if self.fixed_budget > 0 {
            return (seg.next_multiple_of(self.fixed_budget), self.fixed_budget);
        }
        let config = ScheduleConfig::default();
        let budget = balanced_budget(requests * seg, seg, self.grid_parts, &config);
        (seg, aligned_budget(budget, &[tiles], CHUNK_OVERHEAD_TILES))
    }

    /// Words of the three workspace regions, each a multiple of 4 (16-byte aligned starts).
    fn workspace_split(&self, batch: usize) -> (usize, usize, usize) {
        let sched = (batch + 1 + SCHEDULE_TAIL).next_multiple_of(4);
        let slots = 2 * self.max_parts * self.head_tiles;
        (sched, slots * ROWS_PER_CTA, slots * ROWS_PER_CTA * D_V)
    }
}

/// f32 words of workspace a dense decode of `dims` needs on a device with `sm_count` SMs (see
/// [`ScheduleGeometry::workspace_words`]).
pub fn dense_workspace_words(
    dims: &DenseDecodeDims,
    options: &DecodeOptions,
    sm_count: usize,
) -> Result<usize> {
    Ok(ScheduleGeometry::of(dims, options, sm_count)?.workspace_words(dims.batch))
}

/// f32 words of workspace a sparse decode of `dims` needs on a device with `sm_count` SMs (see
/// [`ScheduleGeometry::workspace_words`]; the schedule's requests are the `b * s_q` query tokens).
pub fn sparse_workspace_words(
    dims: &SparseDecodeDims,
    options: &DecodeOptions,
    sm_count: usize,
) -> Result<usize> {
    let shape = ScheduleShape::sparse(dims);
    Ok(ScheduleGeometry::for_shape(&shape, options, sm_count)?.workspace_words(shape.requests))
}

/// The launches of one decode, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// Parameters shared by the kernels (workspace pointers filled by [`DecodePlan::set_workspace`]).
    pub params: DecodeParams,
    /// Schedule geometry.
    pub geometry: ScheduleGeometry,
    /// `(kernel, config)` of the schedule (absent for an inline schedule,
    /// [`ScheduleGeometry::inline_schedule`]), split and combine launches.
    pub launches: Vec<(&'static str, LaunchConfig)>,
}

impl DecodePlan {
    /// Points the plan at a workspace of [`ScheduleGeometry::workspace_words`] f32 words (contiguous, 16-byte
    /// aligned).
    pub fn set_workspace(&mut self, ws: &DeviceView) -> Result<()> {
        let words = self.geometry.workspace_words(self.params.batch as usize);
        expect_f32_workspace(ws, words, CHUNK_ALIGN_BYTES)?;
        let (sched, lse, _) = self.geometry.workspace_split(self.params.batch as usize);
        self.params.schedule = ws.ptr();
        self.params.part_lse = ws.ptr() + 4 * sched as u64;
        self.params.part_o = ws.ptr() + 4 * (sched + lse) as u64;
        Ok(())
    }
}

/// The `flags` bits the kernels' output stores take from `out`'s alignment: 4-byte element-pair stores
/// ([`FLAG_OUT_VEC4`]) and 16-byte aligned rows for bulk stores ([`FLAG_OUT_BULK`]).
fn out_flags(out: &DeviceView) -> u32 {
    (if rows_aligned(out, 4) {
        FLAG_OUT_VEC4
    } else {
        0
    }) | (if rows_aligned(out, 16) {
        FLAG_OUT_BULK
    } else {
        0
    })
}

/// Lowers a validated dense decode to its launches (workspace pointers left 0).
pub fn lower(
    dims: &DenseDecodeDims,
    args: &DenseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    sm_count: usize,
) -> Result<DecodePlan> {
    // One row tile of 64 query rows per key head: every key tile is read by one CTA.
    let keys_read_once = dims.s_q * (dims.h_q / dims.h_kv.max(1)) <= ROWS_PER_CTA;
    let (split_kernel, smem) = split_kernel_for(dims.dtype, dims.d_qk, keys_read_once)?;
    expect_rows_16b("decode", &[("q", args.q), ("k_cache", args.k_cache)])?;
    expect_element_aligned(&[
        ("block_table", Some(args.block_table)),
        ("cache_seqlens", Some(args.cache_seqlens)),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("lse", Some(&out.lse)),
    ])?;
    expect_offsets_fit_i64(&[
        ("q", Some(args.q)),
        ("k_cache", Some(args.k_cache)),
        ("block_table", Some(args.block_table)),
        ("cache_seqlens", Some(args.cache_seqlens)),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("lse", Some(&out.lse)),
    ])?;
    let sm_scale_log2 = dims.softmax_scale * LOG2_E;
    if !sm_scale_log2.is_finite() {
        return Err(Error::invalid(
            "softmax_scale",
            "a value whose product with log2(e) is finite",
            dims.softmax_scale,
        ));
    }
    let cap = dims.max_blocks.checked_mul(dims.page_size);
    if cap.is_none_or(|c| c > i32::MAX as usize) {
        return Err(Error::invalid(
            "block_table.shape[1]",
            format!(
                "max_blocks * page_size <= {} (keys are counted in i32)",
                i32::MAX
            ),
            dims.max_blocks,
        ));
    }
    let geometry = ScheduleGeometry::of(dims, options, sm_count)?;
    let hpk = dims.h_q / dims.h_kv;
    let rows = dims.s_q * hpk;

    let opt_ptr = |t: Option<&DeviceView>| t.map_or(0, DeviceView::ptr);
    let opt_stride =
        |arg: &str, t: Option<&DeviceView>| t.map_or(Ok(0), |t| stride_param(arg, t, 0));
    let params = DecodeParams {
        q: args.q.ptr(),
        k_cache: args.k_cache.ptr(),
        block_table: args.block_table.ptr(),
        cache_seqlens: args.cache_seqlens.ptr(),
        attn_sink: opt_ptr(args.attn_sink),
        out: out.out.ptr(),
        lse: out.lse.ptr(),
        schedule: 0,
        part_o: 0,
        part_lse: 0,
        q_stride_b: stride_param("q", args.q, 0)?,
        q_stride_s: stride_param("q", args.q, 1)?,
        q_stride_h: stride_param("q", args.q, 2)?,
        k_stride_block: stride_param("k_cache", args.k_cache, 0)?,
        k_stride_tok: stride_param("k_cache", args.k_cache, 1)?,
        k_stride_head: stride_param("k_cache", args.k_cache, 2)?,
        block_table_stride_b: stride_param("block_table", args.block_table, 0)?,
        cache_seqlens_stride: stride_param("cache_seqlens", args.cache_seqlens, 0)?,
        attn_sink_stride: opt_stride("attn_sink", args.attn_sink)?,
        out_stride_b: stride_param("out", &out.out, 0)?,
        out_stride_s: stride_param("out", &out.out, 1)?,
        out_stride_h: stride_param("out", &out.out, 2)?,
        lse_stride_b: stride_param("lse", &out.lse, 0)?,
        lse_stride_h: stride_param("lse", &out.lse, 1)?,
        lse_stride_s: stride_param("lse", &out.lse, 2)?,
        batch: to_i32("q.shape[0]", dims.batch)?,
        s_q: to_i32("q.shape[1]", dims.s_q)?,
        h_q: to_i32("q.shape[2]", dims.h_q)?,
        h_kv: to_i32("k_cache.shape[2]", dims.h_kv)?,
        heads_per_kv: to_i32("h_q / h_kv", hpk)?,
        rows: to_i32("s_q * h_q / h_kv", rows)?,
        row_tiles: to_i32("ceil(s_q * h_q / h_kv / 64)", rows.div_ceil(ROWS_PER_CTA))?,
        head_tiles: to_i32("head tiles", geometry.head_tiles)?,
        num_blocks: i32::try_from(dims.num_blocks).unwrap_or(i32::MAX),
        page_size: to_i32("k_cache.shape[1]", dims.page_size)?,
        max_blocks: to_i32("block_table.shape[1]", dims.max_blocks)?,
        grid_parts: to_i32("options.num_parts", geometry.grid_parts)?,
        max_parts: to_i32("schedule parts", geometry.max_parts)?,
        chunk_overhead: CHUNK_OVERHEAD_TILES as i32,
        fixed_budget: to_i32("options.chunk_tiles", geometry.fixed_budget)?,
        max_request_parts: MAX_REQUEST_PARTS as i32,
        max_budget_floor: MAX_BUDGET_FLOOR as i32,
        req_tokens: 1,
        flags: (if dims.causal && dims.s_q > 1 {
            FLAG_CAUSAL
        } else {
            0
        }) | out_flags(&out.out),
        sm_scale_log2,
        ..DecodeParams::default()
    };
    if dims.batch > i32::MAX as usize {
        return Err(Error::invalid(
            "q.shape[0]",
            format!("b <= {}", i32::MAX),
            dims.batch,
        ));
    }
    Ok(DecodePlan::new(
        params,
        geometry,
        split_kernel,
        THREADS_PER_CTA,
        smem,
        combine_kernel_for(dims.dtype),
    ))
}

/// Multiplier and shift with which the kernels divide `0 <= n < 2^31` by `d` (`fast_div`, schedule.cuh):
/// `n / d = umulhi(n, mul) >> shr` with `mul = ceil(2^(32 + shr) / d)`, `shr = ceil(log2 d) - 1`; `(0, 0)` for
/// `d <= 1` (the kernels then take `n` itself). Exact: `mul = 2^(32 + shr) / d + e` with `0 <= e < 1` adds less than
/// `n / 2^(32 + shr) < 1 / d` to `n / d`, too little to reach the next integer.
pub(crate) fn divider(d: i32) -> (u32, u32) {
    if d <= 1 {
        return (0, 0);
    }
    let d = d as u64;
    let ceil_log2 = 64 - (d - 1).leading_zeros();
    let shift = 31 + ceil_log2; // = 32 + shr
    ((1u64 << shift).div_ceil(d) as u32, ceil_log2 - 1)
}

impl DecodeParams {
    /// Sets the dividers of the shapes the kernels divide by (`divider`).
    fn set_dividers(&mut self) {
        (self.req_div_mul, self.req_div_shr) = divider(self.req_tokens);
        (self.hpk_div_mul, self.hpk_div_shr) = divider(self.heads_per_kv);
        (self.row_tiles_div_mul, self.row_tiles_div_shr) = divider(self.row_tiles);
        (self.page_div_mul, self.page_div_shr) = divider(self.page_size);
        (self.extra_page_div_mul, self.extra_page_div_shr) = divider(self.extra_page_size);
    }
}

impl DecodePlan {
    /// The schedule, split and combine launches of `params` (requests `params.batch`); the split kernel derives the
    /// schedule of a small batch itself ([`ScheduleGeometry::inline_schedule`]).
    fn new(
        mut params: DecodeParams,
        geometry: ScheduleGeometry,
        split_kernel: &'static str,
        threads: u32,
        smem: u32,
        combine_kernel: &'static str,
    ) -> Self {
        params.set_dividers();
        let schedule = LaunchConfig::linear(1, SCHEDULE_THREADS);
        let mut split = LaunchConfig {
            grid: (geometry.head_tiles as u32, geometry.grid_parts as u32, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: smem,
            // The two row tiles of a 128-row problem read the same keys: co-scheduled as a cluster, the second
            // gather of a key finds it in L2.
            cluster: (geometry.head_tiles == 2).then_some((2, 1, 1)),
            programmatic: false,
        };
        // A small batch's split requests are merged by four warps per row (each walks a fourth of the parts), a
        // larger one's by one: there most combine CTAs find their request unsplit and return at once.
        // Where the balanced schedule has fewer parts than requests, one combine CTA per part boundary (each splits
        // at most one request) instead of one per request.
        let by_part =
            geometry.fixed_budget == 0 && geometry.max_parts < params.batch.max(0) as usize;
        let combine_x = if by_part {
            params.flags |= FLAG_COMBINE_BY_PART;
            geometry.max_parts
        } else {
            params.batch.max(0) as usize
        };
        let (combine_kernel, row_groups) = combine_launch(
            combine_kernel,
            combine_x * geometry.head_tiles,
            params.rows.max(1) as usize,
            geometry.fixed_budget > 0,
        );
        let combine = LaunchConfig {
            grid: (combine_x as u32, geometry.head_tiles as u32, row_groups),
            block: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
            cluster: None,
            programmatic: true,
        };
        let mut launches = Vec::with_capacity(3);
        let mut combine_needed = true;
        if params.flags & FLAG_UNIFORM_LINE != 0 {
            // Every role derives the line from the shape. Requests lie whole in parts when the budget is a multiple
            // of the segment (S_b = b * seg): then nothing is split and the combine would find nothing to merge.
            let tiles = (params.topk + params.extra_topk).max(0) as usize;
            let (seg, budget) =
                geometry.uniform_budget(params.batch as usize, tiles.div_ceil(KEYS_PER_TILE));
            combine_needed = budget % seg != 0;
        } else if ScheduleGeometry::inline_schedule(params.batch as usize) {
            params.flags |= FLAG_INLINE_SCHEDULE;
        } else {
            launches.push((kernels::SCHEDULE, schedule));
            // Its CTAs start while the schedule kernel runs (it lets them at once) and wait for the schedule
            // (`griddepcontrol.wait`) after their setup.
            split.programmatic = true;
        }
        launches.push((split_kernel, split));
        if combine_needed {
            launches.push((combine_kernel, combine));
        }
        DecodePlan {
            params,
            geometry,
            launches,
        }
    }
}

/// Checks an FP8 cache for the sparse kernels' copies: base address and block stride multiples of 8 bytes. Returns
/// whether they are multiples of 16 as well (16-byte copies; else `FLAG_COPY8`: 8-byte ones).
fn fp8_cache_copy16(arg: &str, cache: &DeviceView, block_stride: usize) -> Result<bool> {
    if cache.ptr() % 8 != 0 {
        return Err(Error::unsupported(
            format!("{arg} at address {:#x}", cache.ptr()),
            "the sparse decode kernels copy cache rows in 8- or 16-byte pieces: the cache must start on an 8-byte boundary",
        ));
    }
    if block_stride % 8 != 0 {
        return Err(Error::unsupported(
            format!("{arg} with a block stride of {block_stride} bytes"),
            "the sparse decode kernels need a block stride that is a multiple of 8 bytes",
        ));
    }
    Ok(cache.ptr() % CHUNK_ALIGN_BYTES == 0 && block_stride as u64 % CHUNK_ALIGN_BYTES == 0)
}

/// The device view of an element offset that may be absent.
fn opt_ptr(t: Option<&DeviceView>) -> u64 {
    t.map_or(0, DeviceView::ptr)
}

/// Query rows per request up to which the sparse decode takes the narrow kernels (`*_n16`).
pub const NARROW_ROWS_SMALL: usize = 16;
/// ... and, MODEL1 only, the `*_n32` kernel.
pub const NARROW_ROWS: usize = 32;

/// Lowers a validated sparse FP8 decode to its launches (workspace pointers left 0). Every query token is a
/// request of the schedule; `out` and `lse` are bf16 / f32 as in [`super::validate_sparse_output`].
pub fn lower_sparse(
    dims: &SparseDecodeDims,
    args: &SparseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    sm_count: usize,
) -> Result<DecodePlan> {
    let split_kernels = match dims.d_qk {
        576 => (
            kernels::SPLIT_FP8_V32,
            kernels::SPLIT_FP8_V32_PAIR,
            kernels::SPLIT_FP8_V32_N16,
            None,
        ),
        512 => (
            kernels::SPLIT_FP8_MODEL1,
            kernels::SPLIT_FP8_MODEL1_PAIR,
            kernels::SPLIT_FP8_MODEL1_N16,
            Some(kernels::SPLIT_FP8_MODEL1_N32),
        ),
        d => {
            return Err(Error::unsupported(
                format!("sparse decode with d_qk = {d}"),
                "d_qk 576 (V3.2 cache) or 512 (MODEL1 cache)",
            ))
        }
    };
    let smem = if dims.d_qk == 576 {
        SMEM_BYTES_D576
    } else {
        SMEM_BYTES_D512
    };
    expect_rows_16b("decode", &[("q", args.q)])?;
    let mut copy16 = fp8_cache_copy16("k_cache", args.k_cache, dims.kv.layout.block_stride)?;
    let extra: Option<(&ExtraKvArgs<'_, DeviceView>, _)> = args.extra.as_ref().zip(dims.extra);
    if let Some((e, d)) = &extra {
        copy16 &= fp8_cache_copy16("extra_k_cache", e.k_cache, d.layout.block_stride)?;
    }
    let extra_length = extra.and_then(|(e, _)| e.topk_length);
    expect_element_aligned(&[
        ("indices", Some(args.indices)),
        ("topk_length", args.topk_length),
        ("extra_indices", extra.map(|(e, _)| e.indices)),
        ("extra_topk_length", extra_length),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("lse", Some(&out.lse)),
    ])?;
    expect_offsets_fit_i64(&[
        ("q", Some(args.q)),
        ("indices", Some(args.indices)),
        ("topk_length", args.topk_length),
        ("extra_indices", extra.map(|(e, _)| e.indices)),
        ("extra_topk_length", extra_length),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("lse", Some(&out.lse)),
    ])?;
    let sm_scale_log2 = dims.softmax_scale * LOG2_E;
    if !sm_scale_log2.is_finite() {
        return Err(Error::invalid(
            "softmax_scale",
            "a value whose product with log2(e) is finite",
            dims.softmax_scale,
        ));
    }
    let key_cap = dims.kv.topk + dims.extra.map_or(0, |e| e.topk);
    if key_cap > i32::MAX as usize / 2 {
        return Err(Error::invalid(
            "indices.shape[2]",
            format!(
                "topk + extra_topk <= {} (keys are counted in i32)",
                i32::MAX / 2
            ),
            key_cap,
        ));
    }
    let shape = ScheduleShape::sparse(dims);
    let geometry = ScheduleGeometry::for_shape(&shape, options, sm_count)?;
    // Two row tiles run as a 2-CTA cluster (DecodePlan::new) whose producers each dequantise half of a tile's rows;
    // requests of at most 16 (MODEL1: 32) query rows (every query token is a request of h_q rows) take the narrow
    // kernels, whose bulk copies need 16-byte aligned rows (8-byte aligned caches take the 64-row tile).
    // The `*_n16` kernels store a final chunk's 16 rows straight from registers: staging them for bulk stores
    // holds the Q tile through the epilogue and measured 2% slower (the `*_n32` kernels' 32 rows 8% faster staged).
    let (split_kernel, threads, smem, staged_final) =
        match (geometry.head_tiles, dims.h_q, copy16, split_kernels.3) {
            (2, ..) => (split_kernels.1, THREADS_PER_CTA, smem, true),
            (_, 0..=NARROW_ROWS_SMALL, true, _) => (
                split_kernels.2,
                THREADS_PER_CTA_NARROW,
                SMEM_BYTES_NARROW,
                false,
            ),
            (_, 0..=NARROW_ROWS, true, Some(n32)) => {
                (n32, THREADS_PER_CTA_NARROW, SMEM_BYTES_NARROW, true)
            }
            _ => (split_kernels.0, THREADS_PER_CTA, smem, true),
        };
    let out_bits = if staged_final {
        out_flags(&out.out)
    } else {
        out_flags(&out.out) & !FLAG_OUT_BULK
    };
    let opt_stride =
        |arg: &str, t: Option<&DeviceView>| t.map_or(Ok(0), |t| stride_param(arg, t, 0));
    // Block counts beyond i32 are clamped: an index is an i32, so it can never name a block past i32::MAX.
    let blocks = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let (extra_params, extra_topk, extra_blocks, extra_page) = match &extra {
        Some((e, d)) => (
            (
                e.k_cache.ptr(),
                e.indices.ptr(),
                opt_ptr(e.topk_length),
                stride_param("extra_indices", e.indices, 0)?,
                stride_param("extra_indices", e.indices, 1)?,
                opt_stride("extra_topk_length", e.topk_length)?,
                to_i64("extra_k_cache.strides[0]", d.layout.block_stride)?,
            ),
            to_i32("extra_indices.shape[2]", d.topk)?,
            blocks(d.layout.num_blocks),
            to_i32("extra_k_cache.shape[1]", d.layout.page_size)?,
        ),
        None => ((0, 0, 0, 0, 0, 0, 0), 0, 0, 1),
    };
    // Without length tensors every request attends topk + extra_topk entries: the schedule follows from the shape.
    let uniform =
        args.topk_length.is_none() && args.extra.as_ref().is_none_or(|e| e.topk_length.is_none());
    let params = DecodeParams {
        q: args.q.ptr(),
        k_cache: args.k_cache.ptr(),
        indices: args.indices.ptr(),
        topk_length: opt_ptr(args.topk_length),
        extra_cache: extra_params.0,
        extra_indices: extra_params.1,
        extra_topk_length: extra_params.2,
        attn_sink: opt_ptr(args.attn_sink),
        out: out.out.ptr(),
        lse: out.lse.ptr(),
        q_stride_b: stride_param("q", args.q, 0)?,
        q_stride_s: stride_param("q", args.q, 1)?,
        q_stride_h: stride_param("q", args.q, 2)?,
        k_stride_block: to_i64("k_cache.strides[0]", dims.kv.layout.block_stride)?,
        attn_sink_stride: opt_stride("attn_sink", args.attn_sink)?,
        indices_stride_b: stride_param("indices", args.indices, 0)?,
        indices_stride_s: stride_param("indices", args.indices, 1)?,
        topk_length_stride: opt_stride("topk_length", args.topk_length)?,
        extra_stride_block: extra_params.6,
        extra_indices_stride_b: extra_params.3,
        extra_indices_stride_s: extra_params.4,
        extra_topk_length_stride: extra_params.5,
        out_stride_b: stride_param("out", &out.out, 0)?,
        out_stride_s: stride_param("out", &out.out, 1)?,
        out_stride_h: stride_param("out", &out.out, 2)?,
        lse_stride_b: stride_param("lse", &out.lse, 0)?,
        lse_stride_h: stride_param("lse", &out.lse, 1)?,
        lse_stride_s: stride_param("lse", &out.lse, 2)?,
        batch: to_i32("b * s_q", shape.requests)?,
        s_q: 1,
        req_tokens: to_i32("q.shape[1]", dims.s_q)?,
        h_q: to_i32("q.shape[2]", dims.h_q)?,
        h_kv: 1,
        heads_per_kv: to_i32("q.shape[2]", dims.h_q)?,
        rows: to_i32("q.shape[2]", dims.h_q)?,
        row_tiles: to_i32("ceil(h_q / 64)", dims.h_q.div_ceil(ROWS_PER_CTA))?,
        head_tiles: to_i32("head tiles", geometry.head_tiles)?,
        num_blocks: blocks(dims.kv.layout.num_blocks),
        page_size: to_i32("k_cache.shape[1]", dims.kv.layout.page_size)?,
        max_blocks: 0,
        topk: to_i32("indices.shape[2]", dims.kv.topk)?,
        extra_topk,
        extra_num_blocks: extra_blocks,
        extra_page_size: extra_page,
        grid_parts: to_i32("options.num_parts", geometry.grid_parts)?,
        max_parts: to_i32("schedule parts", geometry.max_parts)?,
        chunk_overhead: CHUNK_OVERHEAD_TILES as i32,
        fixed_budget: to_i32("options.chunk_tiles", geometry.fixed_budget)?,
        max_request_parts: MAX_REQUEST_PARTS as i32,
        max_budget_floor: MAX_BUDGET_FLOOR as i32,
        flags: FLAG_SPARSE
            | if copy16 { 0 } else { FLAG_COPY8 }
            | if uniform { FLAG_UNIFORM_LINE } else { 0 }
            | out_bits,
        sm_scale_log2,
        ..DecodeParams::default()
    };
    Ok(DecodePlan::new(
        params,
        geometry,
        split_kernel,
        threads,
        smem,
        kernels::COMBINE_BF16,
    ))
}

/// An i64 kernel parameter from a byte count.
fn to_i64(arg: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(arg, format!("at most {}", i64::MAX), v))
}

/// Queues a validated dense decode on `gpu`'s stream. `workspace`: `None` allocates one for the call
/// ([`Gpu::alloc`], released in stream order on return); a caller that captures CUDA graphs passes its own.
pub(crate) fn launch(
    gpu: &Gpu,
    dims: &DenseDecodeDims,
    args: &DenseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    expect_location("q", args.q, Location::Cuda(gpu.ordinal()))?;
    let mut plan = lower(dims, args, out, options, gpu.info().sm_count as usize)?;
    if let Some(map) = k_cache_tensor_map(dims, args.k_cache) {
        plan.params.k_tmap = map;
        plan.params.flags |= FLAG_K_TMA;
    }
    // SAFETY (of the kernels' accesses, for `run`): `validate_dense`/`validate_dense_output` established the
    // shapes and dtypes the params describe and that every tensor lives on this device; `lower` checked alignment
    // and that every offset fits i64. The kernels read q rows of their requests, block-table entries below each
    // request's clamped length, cache rows only at block ids in 0..num_blocks, and write out/lse rows of their
    // requests and the workspace regions sized by the geometry.
    run(gpu, plan, workspace)
}

/// The TMA map of a dense cache whose pages hold whole key tiles (`page_size % 64 == 0`), or `None` where the
/// kernels gather every tile with cp.async instead: other page sizes, strides the TMA unit cannot take (not
/// multiples of 16 bytes or beyond 2^40), or a map the driver refuses. Boxes are one 64-column slab of the 64 keys of
/// one key head in one page; a tile whose keys are not all in the request, or whose block id is missing, is still
/// gathered (zero rows must stay zero).
fn k_cache_tensor_map(dims: &DenseDecodeDims, k_cache: &DeviceView) -> Option<TensorMapBytes> {
    let (dims4, strides, box_dims) = k_cache_map_args(dims, k_cache)?;
    encode_tiled_u16_sw128(k_cache.ptr(), dims4, strides, box_dims).ok()
}

/// What [`k_cache_tensor_map`] encodes: dims `(d_qk, h_kv, page_size, num_blocks)`, byte strides of the head, token
/// and block dimensions, the box; `None` where the TMA path does not apply.
fn k_cache_map_args(
    dims: &DenseDecodeDims,
    k_cache: &DeviceView,
) -> Option<([u64; 4], [u64; 3], [u32; 4])> {
    if dims.page_size % KEYS_PER_TILE != 0 || dims.num_blocks == 0 {
        return None;
    }
    let strides = k_cache.strides();
    let stride_bytes = |i: usize| -> Option<u64> {
        let s = (*strides.get(i)? as u64).checked_mul(2)?;
        (s % 16 == 0 && s > 0 && s < (1u64 << 40)).then_some(s)
    };
    let (block, tok, head) = (stride_bytes(0)?, stride_bytes(1)?, stride_bytes(2)?);
    let dims4 = [
        dims.d_qk as u64,
        dims.h_kv as u64,
        dims.page_size as u64,
        dims.num_blocks as u64,
    ];
    if dims4.iter().any(|&d| d == 0 || d > u32::MAX as u64) {
        return None;
    }
    Some((dims4, [head, tok, block], [64, 1, KEYS_PER_TILE as u32, 1]))
}

/// Queues a validated sparse FP8 decode on `gpu`'s stream (`workspace` as for [`launch`]).
pub(crate) fn launch_sparse(
    gpu: &Gpu,
    dims: &SparseDecodeDims,
    args: &SparseDecodeArgs<'_, DeviceView>,
    out: &DecodeOutput<DeviceView>,
    options: &DecodeOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    expect_location("q", args.q, Location::Cuda(gpu.ordinal()))?;
    let plan = lower_sparse(dims, args, out, options, gpu.info().sm_count as usize)?;
    // SAFETY (for `run`): `validate_sparse`/`validate_sparse_output` established the shapes and dtypes and that
    // every tensor lives on this device; `lower_sparse` checked alignment and offsets. The kernels read index
    // entries below each request's clamped lengths, cache bytes only of tokens whose index lies in
    // 0..num_blocks * page_size of their cache (within the validated byte extent), and write out/lse rows of their
    // query tokens and the workspace regions sized by the geometry.
    run(gpu, plan, workspace)
}

/// Points `plan` at the caller's workspace (or one allocated for the call) and queues its launches.
fn run(gpu: &Gpu, mut plan: DecodePlan, workspace: Option<&DeviceView>) -> Result<()> {
    let device = Location::Cuda(gpu.ordinal());
    let mut _owned = None;
    let view = match workspace {
        Some(ws) => {
            expect_location("workspace", ws, device)?;
            ws.clone()
        }
        None => {
            let words = plan.geometry.workspace_words(plan.params.batch as usize);
            let t = gpu.alloc(DType::F32, &[words])?;
            let v = t.view();
            _owned = Some(t);
            v
        }
    };
    plan.set_workspace(&view)?;
    for (name, cfg) in &plan.launches {
        let kernel = gpu.kernel(FAMILY, name)?;
        // SAFETY: `DecodeParams` mirrors the kernels' parameter struct (asserted on both sides); the callers
        // (`launch`, `launch_sparse`) state what the params' tensors are and what the kernels touch.
        // `set_workspace` checked the workspace's size and alignment, and it lives until this function returns,
        // after the launches were queued (an owned one is released in stream order); by the DeviceView contract
        // outputs do not alias inputs.
        unsafe { gpu.launch(&kernel, cfg, &plan.params)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7f00_0000_0000;

    use crate::ops::layout::fake_view as view;

    fn dims(
        batch: usize,
        s_q: usize,
        h_q: usize,
        h_kv: usize,
        max_blocks: usize,
    ) -> DenseDecodeDims {
        DenseDecodeDims {
            batch,
            s_q,
            h_q,
            h_kv,
            d_qk: 576,
            d_v: 512,
            num_blocks: batch * max_blocks,
            page_size: 64,
            max_blocks,
            softmax_scale: 0.04,
            causal: true,
            dtype: DType::Bf16,
        }
    }

    /// The kernels' `fast_div` (schedule.cuh) with `divider`'s constants, against the division, over every `d`
    /// up to 4096, the largest ones and, for each, `n` at and around its multiples, the ends of the range and
    /// random values.
    #[test]
    fn the_kernels_division_by_multiply_is_exact_below_2_pow_31() {
        use rand::{Rng, SeedableRng};
        let fast_div = |n: u32, (mul, shr): (u32, u32)| {
            if mul == 0 {
                n
            } else {
                (((n as u64 * mul as u64) >> 32) as u32) >> shr
            }
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let top = i32::MAX as u32;
        let divisors = (1..=4096).chain([65_535, 65_536, 1 << 20, (1 << 30) + 1, top - 1, top]);
        for d in divisors {
            let dv = divider(d as i32);
            let mut ns = vec![
                0,
                1,
                top,
                top - 1,
                d - 1,
                d,
                d + 1,
                top - top % d,
                top - top % d - 1,
            ];
            ns.extend((0..64).map(|_| rng.random_range(0..=top)));
            ns.extend((1..=8u64).map(|k| (k * d as u64).min(top as u64) as u32));
            for n in ns.into_iter().filter(|&n| n <= top) {
                assert_eq!(fast_div(n, dv), n / d, "n {n} d {d} constants {dv:?}");
            }
        }
        assert_eq!(divider(0), (0, 0));
        assert_eq!(divider(1), (0, 0));
    }

    #[test]
    fn a_row_gets_more_combine_warps_where_its_tile_has_few_rows() {
        use kernels::*;
        // b 128: 16 rows per tile (h_q 16) take four warps a row, 32 rows (s_q 2) two, 64 one: 8 CTAs per tile.
        let launch = |kernel, tiles, rows| combine_launch(kernel, tiles, rows, false);
        assert_eq!(launch(COMBINE_BF16, 128, 16), (COMBINE4_BF16, 8));
        assert_eq!(launch(COMBINE_F16, 128, 32), (COMBINE2_F16, 8));
        assert_eq!(launch(COMBINE_BF16, 256, 128), (COMBINE_BF16, 8));
        assert_eq!(launch(COMBINE_F16, 128, 5), (COMBINE4_F16, 3));
        // A small batch: four warps a row at any row count.
        assert_eq!(launch(COMBINE_BF16, 16, 64), (COMBINE4_BF16, 32));
        assert_eq!(launch(COMBINE_BF16, 2, 128), (COMBINE4_BF16, 32));
        // Batch-invariant: the rows decide, whatever the batch (a row's warps sum its parts in another order).
        for tiles in [2, 16, 256] {
            assert_eq!(
                combine_launch(COMBINE_BF16, tiles, 128, true),
                (COMBINE_BF16, 8)
            );
            assert_eq!(
                combine_launch(COMBINE_F16, tiles, 16, true),
                (COMBINE4_F16, 8)
            );
        }
    }
    #[test]
    fn geometry_worked_example() {
        // s_q 1, h_q 128, h_kv 1 on 132 SMs: two row tiles per chunk, 66 parts (the doc comment's example).
        let g = ScheduleGeometry::of(&dims(128, 1, 128, 1, 64), &DecodeOptions::default(), 132)
            .unwrap();
        assert_eq!(
            (g.head_tiles, g.grid_parts, g.max_parts, g.fixed_budget),
            (2, 66, 66, 0)
        );
        // s_q 2, h_q 128: 256 rows, four tiles, 33 parts; h_q 16 with 2 key heads: 8 rows per head, one tile each.
        let g = ScheduleGeometry::of(&dims(128, 2, 128, 1, 64), &DecodeOptions::default(), 132)
            .unwrap();
        assert_eq!((g.head_tiles, g.grid_parts), (4, 33));
        let g =
            ScheduleGeometry::of(&dims(4, 1, 16, 2, 64), &DecodeOptions::default(), 132).unwrap();
        assert_eq!((g.head_tiles, g.grid_parts), (2, 66));
        // Workspace: the schedule (b + 3 words, padded to 4; an inline schedule's per-CTA copies live in shared
        // memory) and 2 * 66 * 2 slots of 64 rows x (512 + 1) f32.
        let g = ScheduleGeometry::of(&dims(128, 1, 128, 1, 64), &DecodeOptions::default(), 132)
            .unwrap();
        assert_eq!(g.workspace_words(128), 132 + 2 * 66 * 2 * 64 * 513);
        assert_eq!(g.workspace_words(129), 132 + 2 * 66 * 2 * 64 * 513);
    }

    #[test]
    fn batch_invariant_geometry_bounds_every_request() {
        let opts = DecodeOptions {
            batch_invariant: true,
            ..DecodeOptions::default()
        };
        // 64 blocks of 64 keys: t_cap = 64 tiles; budget max(4 + 64, ceil(68 / 4)) = 68: one part per request.
        let g = ScheduleGeometry::of(&dims(10, 1, 64, 1, 64), &opts, 132).unwrap();
        assert_eq!((g.fixed_budget, g.max_parts), (68, 10));
        // A budget no larger than the overhead is refused, naming the option.
        let bad = DecodeOptions {
            chunk_tiles: Some(CHUNK_OVERHEAD_TILES),
            ..opts
        };
        let e = ScheduleGeometry::of(&dims(10, 1, 64, 1, 64), &bad, 132).unwrap_err();
        assert!(e.to_string().contains("options.chunk_tiles"), "{e}");
        let zero = DecodeOptions {
            num_parts: Some(0),
            ..DecodeOptions::default()
        };
        assert!(ScheduleGeometry::of(&dims(10, 1, 64, 1, 64), &zero, 132).is_err());
    }

    #[test]
    fn a_line_beyond_the_kernels_counters_is_an_error() {
        let e = ScheduleGeometry::of(
            &dims(1 << 20, 1, 64, 1, 1 << 12),
            &DecodeOptions::default(),
            132,
        )
        .unwrap_err();
        assert!(e.to_string().contains("line"), "{e}");
    }

    struct Case {
        q: DeviceView,
        k: DeviceView,
        bt: DeviceView,
        sl: DeviceView,
        out: DecodeOutput<DeviceView>,
    }

    fn case(
        d: &DenseDecodeDims,
        q_strides: Option<&[usize]>,
        out_strides: Option<&[usize]>,
    ) -> Case {
        let [b, s_q, h_q] = [d.batch, d.s_q, d.h_q];
        Case {
            q: view(BASE, DType::Bf16, &[b, s_q, h_q, 576], q_strides),
            k: view(
                BASE + (1 << 36),
                DType::Bf16,
                &[d.num_blocks, 64, d.h_kv, 576],
                None,
            ),
            bt: view(BASE + (2 << 36), DType::I32, &[b, d.max_blocks], None),
            sl: view(BASE + (3 << 36), DType::I32, &[b], None),
            out: DecodeOutput {
                out: view(
                    BASE + (4 << 36),
                    DType::Bf16,
                    &[b, s_q, h_q, 512],
                    out_strides,
                ),
                lse: view(BASE + (5 << 36), DType::F32, &[b, h_q, s_q], None),
            },
        }
    }

    #[test]
    fn the_tma_map_covers_pages_of_whole_tiles_with_16_byte_strides_only() {
        let mut d = dims(4, 1, 128, 1, 8);
        let k = |page: usize, strides: Option<&[usize]>| {
            view(BASE, DType::Bf16, &[d.num_blocks, page, 1, 576], strides)
        };
        // Contiguous pages of 64 keys: dims (576, 1, 64, blocks), byte strides (head, token, block).
        let args = k_cache_map_args(&d, &k(64, None)).unwrap();
        assert_eq!(args.0, [576, 1, 64, 32]);
        assert_eq!(args.1, [1152, 1152, 64 * 1152]);
        assert_eq!(args.2, [64, 1, 64, 1]);
        // Pages of 128 keys: tiles start inside a page.
        d.page_size = 128;
        assert_eq!(k_cache_map_args(&d, &k(128, None)).unwrap().0[2], 128);
        // Pages that are not multiples of a tile, and a token stride that is not a multiple of 16 bytes: gathered.
        d.page_size = 48;
        assert!(k_cache_map_args(&d, &k(48, None)).is_none());
        d.page_size = 64;
        let odd = [64 * 580, 580, 580, 1];
        assert!(k_cache_map_args(&d, &k(64, Some(&odd))).is_none());
        let padded = [64 * 584, 584, 584, 1];
        assert_eq!(
            k_cache_map_args(&d, &k(64, Some(&padded))).unwrap().1,
            [1168, 1168, 64 * 1168]
        );
    }

    fn lower_case(d: &DenseDecodeDims, c: &Case) -> Result<DecodePlan> {
        let args = DenseDecodeArgs {
            q: &c.q,
            k_cache: &c.k,
            block_table: &c.bt,
            cache_seqlens: &c.sl,
            softmax_scale: Some(d.softmax_scale),
            causal: d.causal,
            attn_sink: None,
        };
        lower(d, &args, &c.out, &DecodeOptions::default(), 132)
    }

    #[test]
    fn one_row_tile_per_key_head_takes_the_once_kernels() {
        let split =
            |d: &DenseDecodeDims| lower_case(d, &case(d, None, None)).unwrap().launches[0].0;
        // s_q * h_q / h_kv query rows per key head: 64 or fewer fill one row tile, read by one CTA.
        assert_eq!(split(&dims(3, 1, 64, 1, 5)), kernels::SPLIT_BF16_D576_ONCE);
        assert_eq!(split(&dims(3, 2, 32, 1, 5)), kernels::SPLIT_BF16_D576_ONCE);
        assert_eq!(split(&dims(3, 1, 128, 2, 5)), kernels::SPLIT_BF16_D576_ONCE);
        assert_eq!(split(&dims(3, 2, 64, 1, 5)), kernels::SPLIT_BF16_D576);
        assert_eq!(split(&dims(3, 1, 128, 1, 5)), kernels::SPLIT_BF16_D576);
    }

    #[test]
    fn lowers_its_launches_with_flags() {
        let d = dims(3, 2, 64, 1, 5);
        let c = case(&d, None, None);
        let plan = lower_case(&d, &c).unwrap();
        // Three requests: the split kernel derives the schedule (two launches).
        let names: Vec<&str> = plan.launches.iter().map(|l| l.0).collect();
        assert_eq!(names, [kernels::SPLIT_BF16_D576, kernels::COMBINE4_BF16]);
        // 128 rows: two tiles, launched as 2-CTA clusters; 66 parts. 3 x 2 x 8 = 48 one-warp combine CTAs: the
        // four-warp combine runs.
        assert_eq!(plan.launches[0].1.grid, (2, 66, 1));
        assert_eq!(plan.launches[0].1.cluster, Some((2, 1, 1)));
        assert_eq!(plan.launches[1].1.grid, (3, 2, 32));
        assert_eq!(
            plan.params.flags,
            FLAG_CAUSAL | FLAG_OUT_VEC4 | FLAG_OUT_BULK | FLAG_INLINE_SCHEDULE
        );
        assert_eq!((plan.params.rows, plan.params.row_tiles), (128, 2));
        // The workspace holds a schedule copy per split CTA after the shared schedule (3 + 3 words, padded).
        let plain = ScheduleGeometry {
            head_tiles: 2,
            grid_parts: 66,
            max_parts: 66,
            fixed_budget: 0,
        };
        assert_eq!(plan.geometry, plain);
        assert_eq!(plain.workspace_words(3), 8 + 2 * 66 * 2 * 64 * (1 + D_V));
        // 129 requests: one more than the split kernel scans, so the schedule kernel runs first.
        let d129 = dims(129, 2, 64, 1, 5);
        let plan = lower_case(&d129, &case(&d129, None, None)).unwrap();
        let names: Vec<&str> = plan.launches.iter().map(|l| l.0).collect();
        assert_eq!(
            names,
            [
                kernels::SCHEDULE,
                kernels::SPLIT_BF16_D576,
                kernels::COMBINE_BF16
            ]
        );
        assert_eq!(plan.params.flags & FLAG_INLINE_SCHEDULE, 0);
        assert_eq!(
            plain.workspace_words(129),
            132 + 2 * 66 * 2 * 64 * (1 + D_V)
        );
        // One query token: the causal flag is dropped. Odd out strides: 2-byte stores.
        let d1 = DenseDecodeDims { s_q: 1, ..d };
        let odd = case(&d1, None, Some(&[64 * 513 + 1, 64 * 513 + 1, 513, 1]));
        assert_eq!(
            lower_case(&d1, &odd).unwrap().params.flags,
            FLAG_INLINE_SCHEDULE
        );
        // Rows 4-byte but not 16-byte aligned: pair stores from registers, no bulk stores.
        let even = case(&d1, None, Some(&[64 * 514, 64 * 514, 514, 1]));
        assert_eq!(
            lower_case(&d1, &even).unwrap().params.flags,
            FLAG_OUT_VEC4 | FLAG_INLINE_SCHEDULE
        );
    }

    #[test]
    fn misaligned_q_rows_are_refused() {
        let d = dims(2, 1, 16, 1, 4);
        let c = case(&d, Some(&[16 * 580 + 4, 16 * 580 + 4, 580, 1]), None);
        let e = lower_case(&d, &c).unwrap_err();
        assert!(e.to_string().contains("16-byte"), "{e}");
    }

    /// A sparse decode's views: q `[b, s_q, h_q, d_qk]`, a cache of `blocks x page` tokens with `stride` bytes
    /// between blocks, indices `[b, s_q, topk]`, outputs.
    fn sparse_case(
        (b, s_q, h_q): (usize, usize, usize),
        d_qk: usize,
        (blocks, page, stride): (usize, usize, usize),
        topk: usize,
    ) -> (DeviceView, DeviceView, DeviceView, DecodeOutput<DeviceView>) {
        let bpt = if d_qk == 576 { 656 } else { 584 };
        (
            view(BASE, DType::Bf16, &[b, s_q, h_q, d_qk], None),
            view(
                BASE + (1 << 36),
                DType::U8,
                &[blocks, page, 1, bpt],
                Some(&[stride, bpt, bpt, 1]),
            ),
            view(BASE + (2 << 36), DType::I32, &[b, s_q, topk], None),
            DecodeOutput {
                out: view(BASE + (4 << 36), DType::Bf16, &[b, s_q, h_q, 512], None),
                lse: view(BASE + (5 << 36), DType::F32, &[b, h_q, s_q], None),
            },
        )
    }

    fn lower_sparse_case(
        shape: (usize, usize, usize),
        d_qk: usize,
        cache: (usize, usize, usize),
        topk: usize,
    ) -> Result<DecodePlan> {
        lower_sparse_with(shape, d_qk, cache, topk, false, &DecodeOptions::default())
    }

    /// `with_length`: a `topk_length` tensor (the schedule then depends on its values).
    fn lower_sparse_with(
        shape: (usize, usize, usize),
        d_qk: usize,
        cache: (usize, usize, usize),
        topk: usize,
        with_length: bool,
        options: &DecodeOptions,
    ) -> Result<DecodePlan> {
        let (q, k, idx, out) = sparse_case(shape, d_qk, cache, topk);
        let length = view(BASE + (6 << 36), DType::I32, &[shape.0], None);
        let args = SparseDecodeArgs {
            q: &q,
            k_cache: &k,
            indices: &idx,
            topk_length: with_length.then_some(&length),
            softmax_scale: None,
            attn_sink: None,
            extra: None,
        };
        let dims = super::super::validate_sparse(&args)?;
        lower_sparse(&dims, &args, &out, options, 132)
    }

    #[test]
    fn a_uniform_sparse_batch_derives_its_schedule_and_skips_an_idle_combine() {
        let names = |plan: &DecodePlan| plan.launches.iter().map(|l| l.0).collect::<Vec<_>>();
        let cache = (8, 64, 64 * 656);
        // b 128, s_q 2, h_q 64, topk 2048: 256 requests of 36 units on 132 parts, two whole requests each.
        let plan = lower_sparse_case((128, 2, 64), 576, cache, 2048).unwrap();
        assert_eq!(names(&plan), [kernels::SPLIT_FP8_V32]);
        assert_eq!(
            plan.params.flags & (FLAG_UNIFORM_LINE | FLAG_INLINE_SCHEDULE),
            FLAG_UNIFORM_LINE
        );
        // With topk_length the line depends on its values: the schedule kernel (256 requests) and the combine.
        let opts = DecodeOptions::default();
        let plan = lower_sparse_with((128, 2, 64), 576, cache, 2048, true, &opts).unwrap();
        assert_eq!(
            names(&plan),
            [
                kernels::SCHEDULE,
                kernels::SPLIT_FP8_V32,
                kernels::COMBINE_BF16
            ]
        );
        assert_eq!(plan.params.flags & FLAG_UNIFORM_LINE, 0);
        // b 2, s_q 2: four requests of 36 units on 132 parts are split: the combine runs.
        let plan = lower_sparse_case((2, 2, 64), 576, cache, 2048).unwrap();
        assert_eq!(names(&plan)[0], kernels::SPLIT_FP8_V32);
        assert_eq!(names(&plan).len(), 2);
        // Batch-invariant: a request within one budget is never split; a longer one is.
        for (topk, combine) in [(64 * 60, false), (64 * 61, true)] {
            let opts = DecodeOptions {
                batch_invariant: true,
                chunk_tiles: Some(64),
                ..DecodeOptions::default()
            };
            let plan = lower_sparse_with((4, 1, 64), 576, cache, topk, false, &opts).unwrap();
            assert_eq!(names(&plan).len(), 1 + usize::from(combine), "topk {topk}");
        }
    }

    #[test]
    fn the_uniform_budget_is_the_reference_schedules() {
        use crate::reference::decode::{
            decode_schedule, ScheduleConfig, ScheduleShape as RefShape,
        };
        for h_q in [16usize, 64, 128] {
            for requests in [1usize, 2, 7, 64, 128, 256, 300, 1000] {
                for tiles in [1usize, 2, 10, 32, 256] {
                    let shape = ScheduleShape {
                        requests,
                        h_kv: 1,
                        rows: h_q,
                        key_cap: tiles * KEYS_PER_TILE,
                    };
                    let g = ScheduleGeometry::for_shape(&shape, &DecodeOptions::default(), 132)
                        .unwrap();
                    let (seg, budget) = g.uniform_budget(requests, tiles);
                    let reference = decode_schedule(
                        &RefShape {
                            s_q: 1,
                            h_q,
                            h_kv: 1,
                            num_sms: 132,
                        },
                        &ScheduleConfig::default(),
                        &vec![tiles * KEYS_PER_TILE; requests],
                    );
                    let case = format!("h_q {h_q}, {requests} x {tiles} tiles");
                    assert_eq!(budget, reference.tile_budget, "{case}");
                    assert_eq!(seg, CHUNK_OVERHEAD_TILES + tiles, "{case}");
                    // No combine launch only where the reference splits no request.
                    if budget % seg == 0 {
                        assert_eq!(reference.chunks.len(), requests, "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn sparse_decode_lowers_every_query_token_to_a_request() {
        // b 3, s_q 2, h_q 128: six requests of one token, two row tiles each (a 2-CTA cluster), 66 parts.
        let plan = lower_sparse_case((3, 2, 128), 576, (10, 64, 64 * 656), 300).unwrap();
        let names: Vec<&str> = plan.launches.iter().map(|l| l.0).collect();
        assert_eq!(names, [kernels::SPLIT_FP8_V32_PAIR, kernels::COMBINE4_BF16]);
        let p = &plan.params;
        assert_eq!((p.batch, p.s_q, p.req_tokens, p.rows), (6, 1, 2, 128));
        assert_eq!((p.topk, p.extra_topk, p.k_stride_block), (300, 0, 64 * 656));
        assert_eq!(
            p.flags & (FLAG_SPARSE | FLAG_UNIFORM_LINE),
            FLAG_SPARSE | FLAG_UNIFORM_LINE
        );
        assert_eq!(plan.launches[0].1.grid, (2, 66, 1));
        assert_eq!(plan.launches[1].1.grid, (6, 2, 32));
        // With topk_length, the split kernel scans up to 128 requests itself.
        let opts = DecodeOptions::default();
        let plan =
            lower_sparse_with((3, 2, 128), 576, (10, 64, 64 * 656), 300, true, &opts).unwrap();
        assert_eq!(
            plan.params.flags & (FLAG_UNIFORM_LINE | FLAG_INLINE_SCHEDULE),
            FLAG_INLINE_SCHEDULE
        );
        // h_q 16, MODEL1: one row tile per token, the narrow kernel; 80 x 2 tokens with lengths are more requests
        // than the split kernel scans.
        let plan = lower_sparse_with((80, 2, 16), 512, (8, 64, 64 * 584), 64, true, &opts).unwrap();
        assert_eq!(plan.launches[0].0, kernels::SCHEDULE);
        assert_eq!(plan.launches[1].0, kernels::SPLIT_FP8_MODEL1_N16);
        assert_eq!(plan.launches[1].1.grid, (1, 132, 1));
        // Up to 16 query rows (MODEL1: 32) the narrow kernels (512 threads), beyond them the 64-row tile.
        for (d_qk, h_q, kernel) in [
            (576, 1, kernels::SPLIT_FP8_V32_N16),
            (576, 16, kernels::SPLIT_FP8_V32_N16),
            (576, 17, kernels::SPLIT_FP8_V32),
            (576, 32, kernels::SPLIT_FP8_V32),
            (576, 64, kernels::SPLIT_FP8_V32),
            (512, 16, kernels::SPLIT_FP8_MODEL1_N16),
            (512, 17, kernels::SPLIT_FP8_MODEL1_N32),
            (512, 32, kernels::SPLIT_FP8_MODEL1_N32),
            (512, 33, kernels::SPLIT_FP8_MODEL1),
        ] {
            let cache = if d_qk == 576 {
                (8, 64, 64 * 656)
            } else {
                (8, 64, 64 * 584)
            };
            let plan = lower_sparse_case((2, 1, h_q), d_qk, cache, 64).unwrap();
            assert_eq!(plan.launches[0].0, kernel, "d_qk {d_qk} h_q {h_q}");
            let narrow = h_q <= NARROW_ROWS_SMALL || (d_qk == 512 && h_q <= NARROW_ROWS);
            let (threads, smem) = match (narrow, d_qk) {
                (true, _) => (THREADS_PER_CTA_NARROW, SMEM_BYTES_NARROW),
                (false, 576) => (THREADS_PER_CTA, SMEM_BYTES_D576),
                _ => (THREADS_PER_CTA, SMEM_BYTES_D512),
            };
            assert_eq!(
                plan.launches[0].1.shared_mem_bytes, smem,
                "d_qk {d_qk} h_q {h_q}"
            );
            assert_eq!(
                plan.launches[0].1.block,
                (threads, 1, 1),
                "d_qk {d_qk} h_q {h_q}"
            );
            // The n16 kernels store their final rows from registers; every other kernel stages them for bulk
            // stores when `out` allows (the test's rows are 16-byte aligned).
            let bulk = if kernel == kernels::SPLIT_FP8_V32_N16
                || kernel == kernels::SPLIT_FP8_MODEL1_N16
            {
                0
            } else {
                FLAG_OUT_BULK
            };
            assert_eq!(
                plan.params.flags & FLAG_OUT_BULK,
                bulk,
                "d_qk {d_qk} h_q {h_q}"
            );
        }
    }

    #[test]
    fn the_combine_runs_over_part_boundaries_where_parts_are_fewer_than_requests() {
        let opts = DecodeOptions::default();
        let combine = |plan: &DecodePlan| plan.launches.last().unwrap().1.grid;
        // b 128, s_q 2, h_q 128 with lengths: 256 requests on 66 parts, one combine CTA row per part boundary.
        let plan =
            lower_sparse_with((128, 2, 128), 512, (10, 64, 64 * 584), 64, true, &opts).unwrap();
        assert_eq!(plan.launches[0].0, kernels::SCHEDULE);
        assert_ne!(plan.params.flags & FLAG_COMBINE_BY_PART, 0);
        assert_eq!(combine(&plan), (66, 2, 8));
        // After the schedule kernel, the split kernel is a programmatic launch, and the combine after it.
        assert!(plan.launches[1].1.programmatic);
        assert!(plan.launches[2].1.programmatic);
        // h_q 16: 160 requests on 132 parts.
        let plan = lower_sparse_with((80, 2, 16), 512, (8, 64, 64 * 584), 64, true, &opts).unwrap();
        assert_ne!(plan.params.flags & FLAG_COMBINE_BY_PART, 0);
        assert_eq!(combine(&plan).0, 132);
        // Fewer requests than parts: one combine CTA row per request.
        let plan =
            lower_sparse_with((3, 2, 128), 576, (10, 64, 64 * 656), 300, true, &opts).unwrap();
        assert_eq!(plan.params.flags & FLAG_COMBINE_BY_PART, 0);
        assert_eq!(combine(&plan).0, 6);
        assert!(!plan.launches[0].1.programmatic);
        // Batch-invariant: the parts depend on the batch, the combine runs per request.
        let invariant = DecodeOptions {
            batch_invariant: true,
            ..DecodeOptions::default()
        };
        let plan = lower_sparse_with((128, 2, 128), 512, (10, 64, 64 * 584), 64, true, &invariant)
            .unwrap();
        assert_eq!(plan.params.flags & FLAG_COMBINE_BY_PART, 0);
        assert_eq!(combine(&plan).0, 256);
    }

    /// The combine's rule under `FLAG_COMBINE_BY_PART` (kernel.cuh, `decode_combine`), on the reference schedule:
    /// the CTA row of boundary `i` takes the request holding the last line position of part `i` and merges it if its
    /// tiles start in part `i` and end in a later one. Every request the schedule splits must be found exactly once.
    #[test]
    fn each_split_request_is_found_at_exactly_one_part_boundary() {
        use crate::reference::decode::{decode_schedule, ScheduleShape as RefShape};
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let config = ScheduleConfig::default();
        let overhead = CHUNK_OVERHEAD_TILES;
        let mut splits = 0;
        for case in 0..300 {
            let batch = rng.random_range(1..300usize);
            let h_q = [16usize, 64, 128][case % 3];
            let long = rng.random_bool(0.2);
            let keys: Vec<usize> = (0..batch)
                .map(|_| match rng.random_range(0..10) {
                    0 => 0,
                    1 if long => rng.random_range(0..200_000),
                    _ => rng.random_range(0..3000),
                })
                .collect();
            let shape = RefShape {
                s_q: 1,
                h_q,
                h_kv: 1,
                num_sms: 132,
            };
            let sched = decode_schedule(&shape, &config, &keys);
            let budget = sched.tile_budget;
            let tiles: Vec<usize> = keys.iter().map(|&n| n.div_ceil(KEYS_PER_TILE)).collect();
            let mut starts = vec![0usize];
            for &t in &tiles {
                starts.push(starts.last().unwrap() + overhead + t);
            }
            let line = *starts.last().unwrap();
            let mut found = vec![0usize; batch];
            for i in 0..sched.num_parts {
                let pos = (i + 1) * budget - 1;
                if i + 1 >= sched.num_parts || pos >= line {
                    continue;
                }
                let b = starts.partition_point(|&s| s <= pos) - 1; // largest b with S_b <= pos
                if tiles[b] == 0 {
                    continue;
                }
                let first = starts[b] + overhead;
                let (fp, lp) = (first / budget, (first + tiles[b] - 1) / budget);
                if fp == i && lp > i {
                    found[b] += 1;
                }
            }
            for (b, &times) in found.iter().enumerate() {
                let chunks = sched.request_chunks[b + 1] - sched.request_chunks[b];
                let split = usize::from(chunks > 1);
                assert_eq!(times, split, "case {case}, request {b}: {chunks} chunks");
                splits += split;
            }
        }
        assert!(splits > 1000, "the cases split only {splits} requests");
    }

    #[test]
    fn sparse_decode_copies_8_byte_aligned_caches_in_8_byte_pieces() {
        // Packed 16-byte aligned caches: 16-byte copies.
        let plan = lower_sparse_case((1, 1, 64), 576, (8, 64, 64 * 656), 64).unwrap();
        assert_eq!(plan.params.flags & FLAG_COPY8, 0);
        // MODEL1 with one token per block (584-byte blocks) and a V3.2 stride padded by 8: 8-byte copies.
        for (d_qk, cache) in [(512, (8, 1, 584)), (576, (8, 64, 64 * 656 + 8))] {
            let plan = lower_sparse_case((1, 1, 64), d_qk, cache, 64).unwrap();
            assert_eq!(plan.params.flags & FLAG_COPY8, FLAG_COPY8, "{cache:?}");
        }
        // ... which the narrow kernels do not take: h_q 16 over the 8-byte aligned cache runs the 64-row tile.
        let plan = lower_sparse_case((1, 1, 16), 576, (8, 64, 64 * 656 + 8), 64).unwrap();
        assert_eq!(plan.launches[0].0, kernels::SPLIT_FP8_V32);
        assert_eq!(plan.launches[0].1.shared_mem_bytes, SMEM_BYTES_D576);
        // A stride that is not a multiple of 8 is refused, naming the cache.
        let e = lower_sparse_case((1, 1, 64), 576, (8, 64, 64 * 656 + 4), 64).unwrap_err();
        assert!(
            e.to_string().contains("k_cache") && e.to_string().contains("multiple of 8"),
            "{e}"
        );
    }
}
