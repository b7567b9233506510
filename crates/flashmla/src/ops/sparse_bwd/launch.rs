//! GPU path of the sparse prefill backward: checks the limits of the sm_90a kernels
//! (`csrc/sm90/sparse_bwd/`, design in `docs/sparse-bwd.md`), lowers validated arguments to their
//! one [`SparseBwdParams`] struct and the ordered list of launches, and runs them.
//!
//! Launches, in stream order (see [`Stage`]):
//! 1. `sparse_bwd_zero_acc`: zero the f32 `d_kv` accumulator (skipped when accumulating into an f32
//!    `d_kv` in place);
//! 2. `sparse_bwd_main[_pair][_det]_d{576,512}`: one CTA of 384 threads per (query token, group of
//!    64 heads): computes `delta = rowsum(d_out * out)` of its heads (written to the `delta`
//!    output), writes `d_q` once and adds each tile's `d_kv` rows into the accumulator with vector
//!    reductions. With two head groups (`64 < h_q <= 128`) the `_pair` kernel runs the two groups of
//!    a token as a 2-CTA cluster that sums their `d_kv` partials through distributed shared memory
//!    first, so each (token, selected row) is added once (`_pair_xb`: the partials travel as bf16,
//!    used when `d_kv` is bf16, not deterministic and not accumulated into);
//! 3. `sparse_bwd_finalize`: accumulator -> `d_kv` (bf16 cast, or f32 copy/add), only when the
//!    accumulator is the workspace;
//! 4. `sparse_bwd_sink_grad`: `d_attn_sink`, deterministic, only with `attn_sink`.
//!
//! **Memory.** The accumulator is the f32 `d_kv` itself when its rows are 16-byte aligned;
//! otherwise (bf16 `d_kv`, or an unaligned f32 one) an f32 workspace `[s_kv, d_qk]`, 16-byte aligned
//! rows: the caller's, or allocated here with [`Gpu::alloc`] and released in stream order when
//! `launch` returns. Nothing else is allocated (no `O(s_q * topk)` buffer; `delta` lives in its
//! output).
//!
//! Kernel limits checked here (beyond [`mod@super::validate`]): `h_q <= 128`; `q`, `kv` and `d_out`
//! rows 16-byte aligned (the main kernel gathers 16-byte chunks); every other tensor aligned to its
//! element size; every reachable offset fits `i64`; `topk`, `s_q * h_q` and the grid fit the
//! kernels' 32-bit counters. `out`, `d_q` and `d_kv` take 16-byte accesses when their rows are
//! 16-byte aligned and element accesses otherwise.
//!
//! `d_kv` is accumulated with f32 atomics, so its low bits depend on the order in which CTAs add
//! (not bitwise reproducible run to run); `d_q`, `delta` and `d_attn_sink` are deterministic.
//!
//! **Entry order and waves.** When the accumulator plus the KV rows do not fit L2 ([`kv_buckets`]),
//! the main kernel walks each token's entries in ascending KV-row buckets, and the host launches it
//! in waves of as many tokens as the GPU runs at once ([`SparseBwdPlan::split_main_in_waves`]): the
//! CTAs of a wave start together and keep in step, so at any moment they all add into (and gather
//! from) about the same `1 / nb` of the accumulator (and of `kv`), which L2 holds. Odd waves walk
//! the buckets backwards, starting where the previous wave ended. Every wave after the first is a
//! programmatic dependent launch. With two head groups the main kernel signals `launch_dependents`
//! on entry, so the next wave's CTAs take the SMs that this wave's first finishers free instead of
//! waiting for its last one; with one head group it signals just before it exits, which only hides
//! the launch gap (the entry signal measured slower there). Either way it waits for its
//! predecessor's completion just before it exits, so the waves complete in order and the launches
//! after them see every wave's reductions. [`SparseBwdTuning`] (a field of [`SparseBwdOptions`])
//! replaces any of these choices for a call: the number of buckets (1 = index order in one launch),
//! the bucket direction of the waves, the programmatic launches, [`FLAG_DRAIN_FIRST`] and
//! [`FLAG_DEFER_LAST_REDUCE`]. Results are the same up to the f32 reduction order.

use super::{SparseBwdArgs, SparseBwdDims, SparseBwdOutput};
use crate::cuda::{device_params, DeviceParams, Gpu, LaunchConfig};
use crate::error::{Error, Result};
use crate::ops::layout::{rows_aligned, stride_param};
use crate::tensor::{DType, DeviceView, Location, TensorMeta};
use crate::validate::{expect_location, expect_offsets_fit, expect_shape, to_i32, to_i64};

/// Kernel family (`csrc/sm90/sparse_bwd/`).
pub const FAMILY: &str = <SparseBwdParams as DeviceParams>::FAMILY;
/// Heads per CTA of the main kernel (`kHeadsPerCta`).
pub const HEADS_PER_CTA: usize = 64;
/// Largest `h_q` the kernels serve (`kMaxHeads`): two head groups per token.
pub const MAX_HEADS: usize = 128;
/// KV rows per tile of the main kernel (`kTileRows`).
pub const TILE_ROWS: usize = 64;
/// Threads per CTA of the main kernel (`kThreads`): one producer and two consumer warpgroups.
pub const THREADS_PER_CTA: u32 = 384;
/// Threads per CTA of every auxiliary kernel (`kSmallThreads`).
pub const SMALL_THREADS: u32 = 256;
/// Dynamic shared memory of the d_qk = 576 main kernel (`kSmemBytes<576>`, static_asserted in
/// config.cuh).
pub const SMEM_BYTES_D576: u32 = 232_448;
/// Dynamic shared memory of the d_qk = 512 main kernel (`kSmemBytes<512>`, with its own 16 KB of
/// pair-exchange slots).
pub const SMEM_BYTES_D512: u32 = 232_448;
/// CTAs per cluster of the pair kernels (`kPairCtas`): the two head groups of one token.
pub const PAIR_CTAS: u32 = 2;
/// Gathers, vector reductions and vector stores move 16-byte chunks.
pub const CHUNK_ALIGN_BYTES: u64 = 16;
/// `flags` bit: `out` rows are 16-byte aligned (`kFlagOutVec16`).
pub const FLAG_OUT_VEC16: u32 = 1 << 0;
/// `flags` bit: `d_q` rows are 16-byte aligned (`kFlagDqVec16`).
pub const FLAG_DQ_VEC16: u32 = 1 << 1;
/// `flags` bit: `d_kv` rows are 16-byte aligned (`kFlagDkvVec16`).
pub const FLAG_DKV_VEC16: u32 = 1 << 2;
/// `flags` bit: `d_kv` is f32 (`kFlagDkvF32`); otherwise bf16.
pub const FLAG_DKV_F32: u32 = 1 << 3;
/// `flags` bit: finalisation adds the accumulator into the f32 `d_kv` (`kFlagAccumulate`).
pub const FLAG_ACCUMULATE: u32 = 1 << 4;
/// `flags` bit: the accumulator holds int64 fixed point (`kFlagFixedPoint`, deterministic mode).
pub const FLAG_FIXED_POINT: u32 = 1 << 5;
/// `flags` bit (`kFlagDrainFirst`): in the bf16-exchange kernels at `d_qk` 576, the last `d_kv` chunk of a
/// tile frees the exchange slots (and so lets the next tile's late KV slabs be gathered) before its global
/// reductions instead of after them. Set when the accumulator and the KV rows do not fit L2: the late
/// gather then no longer waits behind those reductions' L2 misses (V3.2 h_q 128: +8 / +12 / +8% at s_kv
/// 32K / 64K / 128K); with an L2-resident accumulator the other order is 1.6% faster (s_kv 8K). Between
/// (s_kv 8K-16K at d_qk 576) the threshold is not measured. With the bucketed order and overlapped
/// waves (full clock, three rounds in one process): +3% at 64K, +0.8% at 128K, and 0.4% slower at
/// 32K, within the noise.
pub const FLAG_DRAIN_FIRST: u32 = 1 << 6;
/// `flags` bit: the bf16-exchange kernels issue a tile's last-chunk reductions (consumer 1's, and
/// consumer 0's at `d_qk` 512) during the next tile's dP instead of before it
/// (`kFlagDeferLastReduce`). Measured on H100 in one process, V3.2 h_q 128, full clock, 5 rounds
/// (every round faster): +1.2% at s_kv 8K, +0.9% at 32K, equal at 64K. Set unless
/// [`SparseBwdTuning::defer_last_reduce`] is `Some(false)`.
pub const FLAG_DEFER_LAST_REDUCE: u32 = 1 << 7;
/// Accumulator (f32) plus KV (bf16) bytes above which `FLAG_DRAIN_FIRST` is set: most of the H100's 50 MB L2.
const DRAIN_FIRST_MIN_BYTES: usize = 40 << 20;
/// Most KV-row buckets the main kernel takes (`kMaxKvBuckets`: 6-bit bucket ids, one value reserved).
pub const MAX_KV_BUCKETS: usize = 63;
/// Longest index row (`topk`) the main kernel buckets (`kMaxBucketedTopk`: the bucket ids of a row
/// live in the producer's registers); longer rows keep the index order.
pub const MAX_BUCKETED_TOPK: usize = 2560;
/// Shortest index row (`topk`) the host buckets with two head groups per token (pair mode): MODEL1's
/// topk 1024 at h_q 128 measured 6% slower with buckets at s_kv 32K (16 tiles per token: the waves'
/// tails weigh more).
pub const MIN_BUCKETED_TOPK_PAIR: usize = 2048;
/// Shortest index row two head groups bucket when the accumulator and the KV rows exceed
/// [`KV_BUCKETS_COARSE_BYTES`]: MODEL1 h_q 128 / topk 1024 at s_kv 64K (201 MB) ran 7.3% faster with
/// 7 buckets than in index order once the waves overlapped (programmatic launches), while at s_kv
/// 32K (100 MB) 12 and 6 buckets stayed 3% and 1.6% slower.
pub const MIN_BUCKETED_TOPK_PAIR_COARSE: usize = 1024;
/// Shortest index row (`topk`) the host buckets with one head group (solo mode, `h_q <= 64`), which
/// reduces twice the bytes per head and gains more (MODEL1 h_q 64, topk 512: +13% at s_kv 32K).
pub const MIN_BUCKETED_TOPK_SOLO: usize = 512;
/// Accumulator plus KV bytes up to which the index order is kept: that much stays L2-resident on an
/// H100 (50 MB L2) anyway (the same threshold as `FLAG_DRAIN_FIRST`).
pub const KV_BUCKETS_OFF_BYTES: usize = DRAIN_FIRST_MIN_BYTES;
/// Accumulator plus KV bytes beyond which one head group (solo mode) keeps the index order again:
/// measured at V3.2 s_kv 128K (453 MB) with sequential waves, 7 / 12 / 16 buckets ran as fast as the
/// index order and 32 buckets 8% slower. Solo mode still launches its waves one after the other.
pub const KV_BUCKETS_MAX_BYTES: usize = 256 << 20;
/// The same bound for two head groups, whose waves overlap (programmatic launches): V3.2 s_kv 128K
/// (453 MB) then ran 279 TFLOPS in index order, 319 with 7 buckets, 342 with 14 (the rule's count),
/// 336 with 21 and 271 with 28. Larger sizes are not measured and keep the index order.
pub const KV_BUCKETS_MAX_BYTES_PAIR: usize = 512 << 20;
/// Accumulator plus KV bytes per bucket: what the CTAs of a wave touch at a time, well inside L2.
/// Measured at full clock in one process (H100, V3.2 random): at s_kv 32K (108 MiB) 8 / 10 / 14
/// buckets ran 378.1 / 378.8 / 374.9 TFLOPS (another call: 10 / 14 / 20 at 379.7 / 373.9 / 368.6),
/// h_q 64 at 32K 10 / 14 buckets 285.3 / 281.8; at 24K (81 MiB) 8 / 11 buckets 378.3 / 377.1. So
/// 12 MiB (9 buckets at 32K) rather than the 8 MiB (14) chosen before the waves overlapped.
pub const KV_BUCKET_BYTES: usize = 12 << 20;
/// Accumulator plus KV bytes above which buckets are [`KV_BUCKET_BYTES_COARSE`] large: a wave then
/// touches each row only about twice (`wave tokens * topk / s_kv`), so there is less to gain per
/// bucket and fewer bucket boundaries measured faster. V3.2 s_kv
/// 64K (216 MiB), in one process: 7 buckets 319, 14 buckets 314, 27 buckets 306 TFLOPS (an earlier
/// machine: 7 buckets 309, 27 buckets 304); at 32K (108 MiB) 14 buckets beat 7 (344 against 330).
pub const KV_BUCKETS_COARSE_BYTES: usize = 128 << 20;
/// Bytes per bucket above [`KV_BUCKETS_COARSE_BYTES`]. Deterministic mode, whose int64 adds move
/// twice the bytes, keeps [`KV_BUCKET_BYTES`] at every size, up to [`KV_BUCKETS_MAX_BYTES_PAIR`]
/// with one head group and without an upper bound with two: measured in one process (H100, full
/// clock, random), buckets auto (the f32 rule's count) / 8 / 16 / 32: V3.2 32K 26.3 / 26.1 / 25.8 /
/// 26.1 ms, 64K 33.0 / 33.8 / 31.9 / 32.0, 128K (1 bucket) 38.0 / 36.8 / 36.1 / 36.1, h_q 64 32K
/// 19.3 / 17.9 / 16.0 / 16.0, MODEL1 h_q 64 64K (1 bucket) 8.29 / 7.30 / 7.28 / 7.28 (the kernel
/// takes at most one per tile: 8); MODEL1 h_q 128 (topk 1024) 32K 14 buckets against 6: 12.51
/// against 12.41 ms, 64K 16 against 10: 14.61 both.
pub const KV_BUCKET_BYTES_COARSE: usize = 32 << 20;
/// 4-byte words per accumulator value in deterministic mode (int64 fixed point).
const FIXED_POINT_WORDS: usize = 2;
/// Largest `blockIdx.x` + 1 the driver accepts.
const MAX_GRID_X: usize = i32::MAX as usize;
/// CTAs of the grid-stride kernels (zeroing, finalisation): enough to fill an H100 many times over.
const MAX_STREAM_CTAS: usize = 1 << 16;
/// f32 values one thread of the zeroing kernel writes per step (one float4).
const ZERO_VALUES_PER_ITEM: usize = 4;
/// Values one thread of the finalisation kernel converts per step (`kElemChunk`).
const FINALIZE_VALUES_PER_ITEM: usize = 8;
/// log2(e): the kernel keeps logits in base 2, so the host folds it into the scale.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

device_params! {
    family = "sparse_bwd", cxx = "SparseBwdParams";
    /// Mirror of `flashmla::sparse_bwd::SparseBwdParams` (params.h), checked against it at compile
    /// time ([`crate::cuda::params`]). Pointers are device addresses (0 when absent); strides are in
    /// elements; last dimensions are contiguous and have no stride field.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct SparseBwdParams {
        /// `[s_q, h_q, d_qk]` bf16.
        pub q: u64,
        /// `[s_kv, 1, d_qk]` bf16.
        pub kv: u64,
        /// `[s_q, 1, topk]` i32.
        pub indices: u64,
        /// `[s_q]` i32 or 0.
        pub topk_length: u64,
        /// `[h_q]` f32 or 0.
        pub attn_sink: u64,
        /// Forward output `[s_q, h_q, d_v]` bf16.
        pub out: u64,
        /// `[s_q, h_q, d_v]` bf16.
        pub d_out: u64,
        /// `[s_q, h_q]` f32.
        pub lse: u64,
        /// `[s_q, h_q, d_qk]` bf16 output.
        pub d_q: u64,
        /// `[s_q, h_q]` f32 output.
        pub delta: u64,
        /// `[h_q]` f32 output or 0.
        pub d_attn_sink: u64,
        /// f32 accumulator `[s_kv, d_qk]`, row stride `dkv_acc_stride` (the f32 `d_kv` or the workspace).
        pub dkv_acc: u64,
        /// `[s_kv, 1, d_qk]` bf16 or f32 output.
        pub d_kv: u64,
        /// Elements between `q` tokens.
        pub q_stride_t: i64,
        /// Elements between `q` heads.
        pub q_stride_h: i64,
        /// Elements between `kv` rows.
        pub kv_stride_t: i64,
        /// Elements between `indices` tokens.
        pub indices_stride_t: i64,
        /// Elements between `topk_length` entries.
        pub topk_length_stride: i64,
        /// Elements between `attn_sink` entries.
        pub attn_sink_stride: i64,
        /// Elements between `out` tokens.
        pub out_stride_t: i64,
        /// Elements between `out` heads.
        pub out_stride_h: i64,
        /// Elements between `d_out` tokens.
        pub d_out_stride_t: i64,
        /// Elements between `d_out` heads.
        pub d_out_stride_h: i64,
        /// Elements between `lse` tokens.
        pub lse_stride_t: i64,
        /// Elements between `lse` heads.
        pub lse_stride_h: i64,
        /// Elements between `d_q` tokens.
        pub d_q_stride_t: i64,
        /// Elements between `d_q` heads.
        pub d_q_stride_h: i64,
        /// Elements between `delta` tokens.
        pub delta_stride_t: i64,
        /// Elements between `delta` heads.
        pub delta_stride_h: i64,
        /// Elements between `d_attn_sink` entries.
        pub d_attn_sink_stride: i64,
        /// Elements between accumulator rows.
        pub dkv_acc_stride: i64,
        /// Elements between `d_kv` rows.
        pub d_kv_stride: i64,
        /// Query tokens.
        pub s_q: i32,
        /// KV rows, clamped to `i32::MAX` (every i32 index >= 0 is then below it, as it is below the
        /// true `s_kv`).
        pub s_kv: i32,
        /// Query heads, 1..=128.
        pub h_q: i32,
        /// Index entries per token.
        pub topk: i32,
        /// 512 or 576.
        pub d_qk: i32,
        /// `ceil(h_q / 64)`.
        pub num_head_groups: i32,
        /// `FLAG_*` bits.
        pub flags: u32,
        /// The forward's scale.
        pub sm_scale: f32,
        /// `sm_scale * log2(e)`.
        pub sm_scale_log2: f32,
        /// Entry order of the main kernel: 1 = index order, 2..=[`MAX_KV_BUCKETS`] = ascending KV-row
        /// buckets ([`kv_buckets`]).
        pub kv_buckets: i32,
        /// First token of a main-kernel launch (set per launch: [`Launch::token0`]).
        pub token0: i32,
        /// Bucketed order: 1 = the main kernel walks the buckets from the last one down (set per launch:
        /// [`Launch::descending`]); 0 = ascending.
        pub kv_buckets_descending: i32,
    }
}

/// Choices of a GPU backward call that the arguments do not carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseBwdOptions {
    /// Add this call's `d_kv` to the contents of an f32 `d_kv` instead of overwriting it (gradient
    /// accumulation across calls). Unsupported with a bf16 `d_kv`.
    pub accumulate_d_kv: bool,
    /// Bitwise-reproducible `d_kv`: contributions are reduced as 64-bit fixed point (2^-32 units,
    /// range +-2^31; integer adds commute) in a workspace twice the size of an f32 `d_kv`, then
    /// converted. Twice the reduction bytes (8 per value): 1.6-2.2x the default's time at the
    /// standard shapes (docs/sparse-bwd.md).
    /// Non-finite contributions are not propagated (NaN adds 0, +-inf saturates).
    pub deterministic: bool,
    /// Launch choices that change the speed, not the result (default: the measured heuristics).
    pub tuning: SparseBwdTuning,
}

/// The direction in which the waves of a bucketed launch walk their KV-row buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBucketOrder {
    /// Odd waves walk the buckets backwards, starting on those the previous wave ended on (the
    /// heuristic's choice).
    Alternating,
    /// Every wave walks them upwards.
    Ascending,
}

/// Launch choices of the backward that change its speed, not what it computes (up to the order of
/// the f32 reductions of `d_kv`). Each `None` takes the measured heuristic (module docs); the default
/// is all `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseBwdTuning {
    /// KV-row buckets of the main kernel's entry order, 1..=[`MAX_KV_BUCKETS`] (1: index order in one
    /// launch); `None`: [`kv_buckets`]. Rows longer than [`MAX_BUCKETED_TOPK`] keep the index order
    /// whatever the count.
    pub kv_buckets: Option<usize>,
    /// Bucket direction of the waves; `None`: [`KvBucketOrder::Alternating`].
    pub bucket_order: Option<KvBucketOrder>,
    /// `Some(false)` launches the waves one after the other instead of as programmatic dependent
    /// launches; `None` and `Some(true)`: programmatic after the first wave.
    pub pdl: Option<bool>,
    /// Whether [`FLAG_DRAIN_FIRST`] is set; `None`: when the accumulator and the KV rows exceed L2.
    pub drain_first: Option<bool>,
    /// `Some(false)` clears [`FLAG_DEFER_LAST_REDUCE`]; `None` and `Some(true)`: set for the kernels
    /// that read it.
    pub defer_last_reduce: Option<bool>,
}

/// The kernels of the family, in launch order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `sparse_bwd_zero_acc`: accumulator = 0.
    ZeroAcc,
    /// `sparse_bwd_main_d*`: `delta`, `d_q`, and `d_kv` into the accumulator.
    Main,
    /// `sparse_bwd_finalize`: accumulator -> `d_kv`.
    Finalize,
    /// `sparse_bwd_sink_grad`: `d_attn_sink`.
    SinkGrad,
}

/// One kernel launch of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// What it computes.
    pub stage: Stage,
    /// Kernel symbol in the family's cubin.
    pub kernel: &'static str,
    /// Geometry.
    pub cfg: LaunchConfig,
    /// First token ([`SparseBwdParams::token0`]) of a main-kernel launch; 0 for the others.
    pub token0: usize,
    /// Bucketed order: this wave walks the buckets in descending order
    /// ([`SparseBwdParams::kv_buckets_descending`]); false for every other launch.
    pub descending: bool,
}

/// Where the main kernel adds `d_kv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accumulator {
    /// Into the f32 `d_kv` output itself (its rows are 16-byte aligned).
    Output,
    /// Into a workspace ([`workspace_shape`]: f32 `[s_kv, d_qk]`, or int64 fixed point stored as
    /// f32 `[s_kv, 2 * d_qk]` in deterministic mode), then finalised into `d_kv`.
    Workspace,
}

/// Everything a backward call launches, computed without a GPU by [`lower`].
#[derive(Debug, Clone, PartialEq)]
pub struct SparseBwdPlan {
    /// The parameters every launch receives. With [`Accumulator::Workspace`], `dkv_acc` is 0 until
    /// [`SparseBwdPlan::set_workspace`].
    pub params: SparseBwdParams,
    /// The launches, in stream order.
    pub launches: Vec<Launch>,
    /// How [`SparseBwdPlan::split_main_in_waves`] orders the buckets of successive waves.
    pub bucket_order: KvBucketOrder,
    /// Whether waves after the first are programmatic dependent launches.
    pub programmatic_waves: bool,
    /// Where `d_kv` is accumulated.
    pub accumulator: Accumulator,
    /// Shape (as f32) the workspace must have ([`workspace_shape`]).
    pub workspace_shape: [usize; 2],
}

/// Whether a call reduces `d_kv` in a workspace ([`workspace_shape`]) whatever `d_kv`'s alignment: a
/// bf16 `d_kv`, or deterministic mode (int64 fixed point). Otherwise an f32 `d_kv` whose rows are
/// 16-byte aligned is the accumulator itself (a misaligned one takes a workspace too).
pub fn reduces_in_workspace(d_kv_dtype: DType, options: &SparseBwdOptions) -> bool {
    d_kv_dtype != DType::F32 || options.deterministic
}

/// Shape (as f32) of the workspace a call needs when its accumulator is not `d_kv` itself:
/// `[s_kv, d_qk]` (`s_kv * d_qk * 4` bytes: 75.5 MB at s_kv 32768, d_qk 576), or `[s_kv, 2 * d_qk]`
/// holding int64 fixed point in deterministic mode.
pub fn workspace_shape(dims: &SparseBwdDims, options: &SparseBwdOptions) -> [usize; 2] {
    let words = if options.deterministic {
        FIXED_POINT_WORDS
    } else {
        1
    };
    [dims.fwd.s_kv, words * dims.fwd.d_qk]
}

/// How many KV-row buckets the main kernel walks each token's entries in (1: index order, one
/// launch). The accumulator (f32, or int64 fixed point in deterministic mode) and the bf16 KV rows
/// together take `s_kv * d_qk * (4 or 8 + 2)` bytes; between [`KV_BUCKETS_OFF_BYTES`] and
/// [`KV_BUCKETS_MAX_BYTES`] ([`KV_BUCKETS_MAX_BYTES_PAIR`] with two head groups) the rows are split into `ceil(bytes / KV_BUCKET_BYTES)` buckets, at most
/// one per tile of a full index row, and `ceil(bytes / KV_BUCKET_BYTES_COARSE)` above
/// [`KV_BUCKETS_COARSE_BYTES`]. Example: V3.2 (s_kv 32768, d_qk 576, topk 2048, h_q 128): 113
/// MB -> 9 buckets of 3641 rows (14 buckets measured +11.5% against the index order, 9 another
/// +0.5%); s_kv
/// 65536: 226 MB -> 7 buckets. Rows
/// shorter than [`MIN_BUCKETED_TOPK_PAIR`] / [`MIN_BUCKETED_TOPK_SOLO`] or longer than
/// [`MAX_BUCKETED_TOPK`] keep the index order, except that two head groups bucket rows of at least
/// [`MIN_BUCKETED_TOPK_PAIR_COARSE`] entries in the coarse range. Deterministic mode: see
/// [`KV_BUCKET_BYTES_COARSE`].
pub fn kv_buckets(dims: &SparseBwdDims, options: &SparseBwdOptions) -> i32 {
    let f = &dims.fwd;
    let acc_bytes = if options.deterministic { 8 } else { 4 };
    let bytes = f.s_kv.saturating_mul(f.d_qk).saturating_mul(acc_bytes + 2);
    let min_topk = if f.h_q <= HEADS_PER_CTA {
        MIN_BUCKETED_TOPK_SOLO
    } else if bytes > KV_BUCKETS_COARSE_BYTES {
        MIN_BUCKETED_TOPK_PAIR_COARSE
    } else {
        MIN_BUCKETED_TOPK_PAIR
    };
    if !(min_topk..=MAX_BUCKETED_TOPK).contains(&f.topk) {
        return 1;
    }
    let max_bytes = match (f.h_q > HEADS_PER_CTA, options.deterministic) {
        (false, false) => KV_BUCKETS_MAX_BYTES,
        (false, true) | (true, false) => KV_BUCKETS_MAX_BYTES_PAIR,
        (true, true) => usize::MAX,
    };
    if bytes <= KV_BUCKETS_OFF_BYTES || bytes > max_bytes {
        return 1;
    }
    let cap = f.topk.div_ceil(TILE_ROWS).min(MAX_KV_BUCKETS);
    let per_bucket = if bytes > KV_BUCKETS_COARSE_BYTES && !options.deterministic {
        KV_BUCKET_BYTES_COARSE
    } else {
        KV_BUCKET_BYTES
    };
    // <= MAX_KV_BUCKETS: fits i32.
    bytes.div_ceil(per_bucket).clamp(2, cap.max(2)) as i32
}

/// The entry order a call uses: [`SparseBwdTuning::kv_buckets`] when set (checked against
/// 1..=[`MAX_KV_BUCKETS`]), else [`kv_buckets`].
pub fn kv_buckets_with(dims: &SparseBwdDims, options: &SparseBwdOptions) -> Result<i32> {
    match options.tuning.kv_buckets {
        None => Ok(kv_buckets(dims, options)),
        // <= MAX_KV_BUCKETS: fits i32.
        Some(n) if (1..=MAX_KV_BUCKETS).contains(&n) => Ok(n as i32),
        Some(n) => Err(Error::invalid(
            "tuning.kv_buckets",
            format!("1..={MAX_KV_BUCKETS} (the kernel's bucket ids are 6 bits wide)"),
            n,
        )),
    }
}

/// Whether [`FLAG_DRAIN_FIRST`] is set: [`SparseBwdTuning::drain_first`], else when the f32
/// accumulator plus the bf16 KV rows (`s_kv * d_qk * 6` bytes) exceed `DRAIN_FIRST_MIN_BYTES`.
pub fn drain_first_for(dims: &SparseBwdDims, tuning: &SparseBwdTuning) -> bool {
    let f = &dims.fwd;
    tuning
        .drain_first
        .unwrap_or_else(|| f.s_kv.saturating_mul(f.d_qk).saturating_mul(6) > DRAIN_FIRST_MIN_BYTES)
}

/// The family's kernel symbols (entry points in `csrc/sm90/sparse_bwd/sparse_bwd.cu`): the only place
/// they are spelled on the host; a CPU test checks each against the embedded cubin.
pub mod kernels {
    /// Zeroes the accumulator ([`super::Stage::ZeroAcc`]).
    pub const ZERO_ACC: &str = "sparse_bwd_zero_acc";
    /// Accumulator -> `d_kv` ([`super::Stage::Finalize`]).
    pub const FINALIZE: &str = "sparse_bwd_finalize";
    /// `d_attn_sink` ([`super::Stage::SinkGrad`]).
    pub const SINK_GRAD: &str = "sparse_bwd_sink_grad";
    /// Main kernel, one head group per token, f32 reduction, `d_qk` 576.
    pub const MAIN_D576: &str = "sparse_bwd_main_d576";
    /// The same at `d_qk` 512.
    pub const MAIN_D512: &str = "sparse_bwd_main_d512";
    /// One head group, fixed-point (deterministic) reduction, `d_qk` 576.
    pub const MAIN_DET_D576: &str = "sparse_bwd_main_det_d576";
    /// The same at `d_qk` 512.
    pub const MAIN_DET_D512: &str = "sparse_bwd_main_det_d512";
    /// Two head groups as a 2-CTA cluster, f32 reduction, `d_qk` 576.
    pub const MAIN_PAIR_D576: &str = "sparse_bwd_main_pair_d576";
    /// The same at `d_qk` 512.
    pub const MAIN_PAIR_D512: &str = "sparse_bwd_main_pair_d512";
    /// Two head groups exchanging the peer's half of `d_kv` as bf16, `d_qk` 576.
    pub const MAIN_PAIR_XB_D576: &str = "sparse_bwd_main_pair_xb_d576";
    /// The same at `d_qk` 512.
    pub const MAIN_PAIR_XB_D512: &str = "sparse_bwd_main_pair_xb_d512";
    /// Two head groups, fixed-point reduction, `d_qk` 576.
    pub const MAIN_PAIR_DET_D576: &str = "sparse_bwd_main_pair_det_d576";
    /// The same at `d_qk` 512.
    pub const MAIN_PAIR_DET_D512: &str = "sparse_bwd_main_pair_det_d512";
    /// Every kernel a plan can name.
    pub const ALL: &[&str] = &[
        ZERO_ACC,
        FINALIZE,
        SINK_GRAD,
        MAIN_D576,
        MAIN_D512,
        MAIN_DET_D576,
        MAIN_DET_D512,
        MAIN_PAIR_D576,
        MAIN_PAIR_D512,
        MAIN_PAIR_XB_D576,
        MAIN_PAIR_XB_D512,
        MAIN_PAIR_DET_D576,
        MAIN_PAIR_DET_D512,
    ];
}

/// Main kernel symbol and dynamic shared memory for a `d_qk` (f32 or fixed-point reduction; `pair`:
/// the 2-CTA cluster kernel for two head groups; `bf16_exchange`: its variant that passes the
/// peer's half of each `d_kv` chunk as bf16, used only for pair mode, f32 reduction, when
/// `d_kv` itself is bf16 and not accumulated into).
pub fn main_kernel_for(
    d_qk: usize,
    deterministic: bool,
    pair: bool,
    bf16_exchange: bool,
) -> Result<(&'static str, u32)> {
    use kernels::*;
    let xb = bf16_exchange && pair && !deterministic;
    let name = match (d_qk, deterministic, pair, xb) {
        (576, false, false, _) => MAIN_D576,
        (512, false, false, _) => MAIN_D512,
        (576, true, false, _) => MAIN_DET_D576,
        (512, true, false, _) => MAIN_DET_D512,
        (576, false, true, false) => MAIN_PAIR_D576,
        (512, false, true, false) => MAIN_PAIR_D512,
        (576, false, true, true) => MAIN_PAIR_XB_D576,
        (512, false, true, true) => MAIN_PAIR_XB_D512,
        (576, true, true, _) => MAIN_PAIR_DET_D576,
        (512, true, true, _) => MAIN_PAIR_DET_D512,
        _ => {
            return Err(Error::unsupported(
                format!("sparse_bwd kernel for d_qk = {d_qk}"),
                "the sm_90a kernel is built for d_qk 512 and 576",
            ))
        }
    };
    let smem = if d_qk == 576 {
        SMEM_BYTES_D576
    } else {
        SMEM_BYTES_D512
    };
    Ok((name, smem))
}

/// A 1-D launch of `ctas` CTAs of `threads` threads.
fn linear(ctas: usize, threads: u32) -> Result<LaunchConfig> {
    let grid = u32::try_from(ctas)
        .ok()
        .filter(|&g| g as usize <= MAX_GRID_X)
        .ok_or_else(|| Error::invalid("grid", format!("at most {MAX_GRID_X} CTAs"), ctas))?;
    Ok(LaunchConfig::linear(grid, threads))
}

/// CTAs of a grid-stride kernel over `items` work items of one thread each.
fn stream_ctas(items: usize) -> usize {
    items
        .div_ceil(SMALL_THREADS as usize)
        .clamp(1, MAX_STREAM_CTAS)
}

/// Checks the kernels' limits and builds the parameters and the launches (pure: no GPU needed).
pub fn lower(
    dims: &SparseBwdDims,
    args: &SparseBwdArgs<'_, DeviceView>,
    out: &SparseBwdOutput<DeviceView>,
    options: &SparseBwdOptions,
) -> Result<SparseBwdPlan> {
    let f = &dims.fwd;
    let pair = f.h_q.div_ceil(HEADS_PER_CTA) == PAIR_CTAS as usize;
    // The bf16 exchange rounds half of each 64-head partial to bf16 once; only where d_kv is itself
    // rounded to bf16 (and not accumulated into, nor bitwise reproducible).
    let bf16_exchange = dims.d_kv_dtype == DType::Bf16 && !options.accumulate_d_kv;
    let (main_kernel, smem) = main_kernel_for(f.d_qk, options.deterministic, pair, bf16_exchange)?;
    if f.h_q > MAX_HEADS {
        return Err(Error::unsupported(
            format!("sparse_bwd on the GPU with h_q = {}", f.h_q),
            format!("the sm_90a kernel serves h_q 1..={MAX_HEADS}"),
        ));
    }
    if f.topk > i32::MAX as usize - TILE_ROWS {
        return Err(Error::invalid(
            "indices.shape[2]",
            format!(
                "topk <= {} (the kernel counts entries in i32)",
                i32::MAX as usize - TILE_ROWS
            ),
            f.topk,
        ));
    }
    let d_kv_f32 = dims.d_kv_dtype == DType::F32;
    if options.accumulate_d_kv && !d_kv_f32 {
        return Err(Error::unsupported(
            "sparse_bwd accumulating into a bf16 d_kv",
            "accumulation is offered for an f32 d_kv only (bf16 would round every partial sum)",
        ));
    }
    for (arg, t) in [("q", args.q), ("kv", args.kv), ("d_out", args.d_out)] {
        if !rows_aligned(t, CHUNK_ALIGN_BYTES) {
            let (ptr, strides) = (t.ptr(), t.strides());
            return Err(Error::unsupported(
                format!("sparse_bwd on the GPU with `{arg}` at {ptr:#x}, strides {strides:?}"),
                "the kernel gathers rows in 16-byte chunks: the base address and strides must be \
                 multiples of 8 elements (pass a contiguous copy otherwise)",
            ));
        }
    }
    let all = [
        ("q", Some(args.q)),
        ("kv", Some(args.kv)),
        ("out", Some(args.out)),
        ("d_out", Some(args.d_out)),
        ("indices", Some(args.indices)),
        ("lse", Some(args.lse)),
        ("attn_sink", args.attn_sink),
        ("topk_length", args.topk_length),
        ("d_q", Some(&out.d_q)),
        ("d_kv", Some(&out.d_kv)),
        ("delta", Some(&out.delta)),
        ("d_attn_sink", out.d_attn_sink.as_ref()),
    ];
    for (arg, t) in all.iter().filter_map(|&(a, t)| t.map(|t| (a, t))) {
        let elem = t.dtype().size_bytes() as u64;
        if t.ptr() % elem != 0 {
            return Err(Error::invalid(
                format!("{arg}.data_ptr"),
                format!("an address aligned to the element size ({elem} bytes)"),
                format!("{:#x}", t.ptr()),
            ));
        }
        expect_offsets_fit(arg, t, i64::MAX as usize, "i64")?;
    }
    let sm_scale_log2 = args.sm_scale * LOG2_E;
    if !sm_scale_log2.is_finite() {
        return Err(Error::invalid(
            "sm_scale",
            "a value whose product with log2(e) is finite",
            args.sm_scale,
        ));
    }
    let rows = f.s_q.checked_mul(f.h_q).filter(|&n| n <= i64::MAX as usize);
    let Some(rows) = rows else {
        return Err(Error::invalid(
            "q.shape",
            "s_q * h_q that fits i64",
            format!("{} * {}", f.s_q, f.h_q),
        ));
    };
    let num_head_groups = f.h_q.div_ceil(HEADS_PER_CTA);

    // The accumulator: d_kv itself when it can be (f32, f32 reduction) and its rows are 16-byte
    // aligned (vector reductions).
    let accumulator = if !reduces_in_workspace(dims.d_kv_dtype, options)
        && rows_aligned(&out.d_kv, CHUNK_ALIGN_BYTES)
    {
        Accumulator::Output
    } else {
        Accumulator::Workspace
    };
    let (dkv_acc, dkv_acc_stride) = match accumulator {
        Accumulator::Output => (out.d_kv.ptr(), stride_param("d_kv", &out.d_kv, 0)?),
        Accumulator::Workspace => (0, to_i64("d_qk", f.d_qk)?),
    };

    let mut flags = 0;
    for (bit, on) in [
        (FLAG_OUT_VEC16, rows_aligned(args.out, CHUNK_ALIGN_BYTES)),
        (FLAG_DQ_VEC16, rows_aligned(&out.d_q, CHUNK_ALIGN_BYTES)),
        (FLAG_DKV_VEC16, rows_aligned(&out.d_kv, CHUNK_ALIGN_BYTES)),
        (FLAG_DKV_F32, d_kv_f32),
        (FLAG_ACCUMULATE, options.accumulate_d_kv),
        (FLAG_FIXED_POINT, options.deterministic),
        (FLAG_DRAIN_FIRST, drain_first_for(dims, &options.tuning)),
        (
            FLAG_DEFER_LAST_REDUCE,
            // Only the `_pair_xb` kernels read it.
            pair && bf16_exchange
                && !options.deterministic
                && options.tuning.defer_last_reduce != Some(false),
        ),
    ] {
        if on {
            flags |= bit;
        }
    }

    let opt_ptr = |t: Option<&DeviceView>| t.map_or(0, DeviceView::ptr);
    let opt_stride =
        |arg: &str, t: Option<&DeviceView>| t.map_or(Ok(0), |t| stride_param(arg, t, 0));
    let params = SparseBwdParams {
        q: args.q.ptr(),
        kv: args.kv.ptr(),
        indices: args.indices.ptr(),
        topk_length: opt_ptr(args.topk_length),
        attn_sink: opt_ptr(args.attn_sink),
        out: args.out.ptr(),
        d_out: args.d_out.ptr(),
        lse: args.lse.ptr(),
        d_q: out.d_q.ptr(),
        delta: out.delta.ptr(),
        d_attn_sink: opt_ptr(out.d_attn_sink.as_ref()),
        dkv_acc,
        d_kv: out.d_kv.ptr(),
        q_stride_t: stride_param("q", args.q, 0)?,
        q_stride_h: stride_param("q", args.q, 1)?,
        kv_stride_t: stride_param("kv", args.kv, 0)?,
        indices_stride_t: stride_param("indices", args.indices, 0)?,
        topk_length_stride: opt_stride("topk_length", args.topk_length)?,
        attn_sink_stride: opt_stride("attn_sink", args.attn_sink)?,
        out_stride_t: stride_param("out", args.out, 0)?,
        out_stride_h: stride_param("out", args.out, 1)?,
        d_out_stride_t: stride_param("d_out", args.d_out, 0)?,
        d_out_stride_h: stride_param("d_out", args.d_out, 1)?,
        lse_stride_t: stride_param("lse", args.lse, 0)?,
        lse_stride_h: stride_param("lse", args.lse, 1)?,
        d_q_stride_t: stride_param("d_q", &out.d_q, 0)?,
        d_q_stride_h: stride_param("d_q", &out.d_q, 1)?,
        delta_stride_t: stride_param("delta", &out.delta, 0)?,
        delta_stride_h: stride_param("delta", &out.delta, 1)?,
        d_attn_sink_stride: opt_stride("d_attn_sink", out.d_attn_sink.as_ref())?,
        dkv_acc_stride,
        d_kv_stride: stride_param("d_kv", &out.d_kv, 0)?,
        s_q: to_i32("q.shape[0]", f.s_q)?,
        s_kv: i32::try_from(f.s_kv).unwrap_or(i32::MAX),
        h_q: to_i32("q.shape[1]", f.h_q)?,
        topk: to_i32("indices.shape[2]", f.topk)?,
        d_qk: to_i32("q.shape[2]", f.d_qk)?,
        num_head_groups: to_i32("ceil(h_q / 64)", num_head_groups)?,
        flags,
        sm_scale: args.sm_scale,
        sm_scale_log2,
        kv_buckets: kv_buckets_with(dims, options)?,
        token0: 0,
        kv_buckets_descending: 0,
    };

    // The accumulator's values: s_kv * d_qk (an empty d_kv needs no zeroing and no finalisation;
    // an s_kv beyond i32 still works, the kernels index rows in i64).
    let acc_values = f
        .s_kv
        .checked_mul(f.d_qk)
        .ok_or_else(|| Error::invalid("kv.shape[0]", "s_kv * d_qk that fits usize", f.s_kv))?;
    let mut launches = Vec::with_capacity(5);
    let zero_needed = !(accumulator == Accumulator::Output && options.accumulate_d_kv);
    if acc_values > 0 && zero_needed {
        launches.push(Launch {
            stage: Stage::ZeroAcc,
            kernel: kernels::ZERO_ACC,
            cfg: linear(
                stream_ctas(acc_values / ZERO_VALUES_PER_ITEM),
                SMALL_THREADS,
            )?,
            token0: 0,
            descending: false,
        });
    }
    if rows > 0 {
        let ctas = f
            .s_q
            .checked_mul(num_head_groups)
            .filter(|&n| n <= MAX_GRID_X)
            .ok_or_else(|| {
                Error::invalid(
                    "q.shape[0]",
                    format!(
                        "s_q * ceil(h_q / 64) <= {MAX_GRID_X} (one CTA per token and head group)"
                    ),
                    f.s_q,
                )
            })?;
        let cluster = pair.then_some((PAIR_CTAS, 1, 1));
        launches.push(Launch {
            stage: Stage::Main,
            kernel: main_kernel,
            cfg: LaunchConfig {
                grid: (ctas as u32, 1, 1),
                block: (THREADS_PER_CTA, 1, 1),
                shared_mem_bytes: smem,
                cluster,
                programmatic: false,
            },
            token0: 0,
            descending: false,
        });
    }
    if acc_values > 0 && accumulator == Accumulator::Workspace {
        launches.push(Launch {
            stage: Stage::Finalize,
            kernel: kernels::FINALIZE,
            cfg: linear(
                stream_ctas(acc_values / FINALIZE_VALUES_PER_ITEM),
                SMALL_THREADS,
            )?,
            token0: 0,
            descending: false,
        });
    }
    if args.attn_sink.is_some() {
        launches.push(Launch {
            stage: Stage::SinkGrad,
            kernel: kernels::SINK_GRAD,
            cfg: linear(f.h_q, SMALL_THREADS)?,
            token0: 0,
            descending: false,
        });
    }
    Ok(SparseBwdPlan {
        params,
        launches,
        bucket_order: options
            .tuning
            .bucket_order
            .unwrap_or(KvBucketOrder::Alternating),
        programmatic_waves: options.tuning.pdl != Some(false),
        accumulator,
        workspace_shape: workspace_shape(dims, options),
    })
}

impl SparseBwdPlan {
    /// With a bucketed entry order (`params.kv_buckets > 1`), replaces the main-kernel launch by
    /// launches of at most `sm_count / num_head_groups` tokens each (one CTA per SM: the tokens the
    /// GPU runs at once), in token order, so that the CTAs of each launch start together and walk
    /// their buckets in step: odd waves backwards unless [`Self::bucket_order`] is ascending, every
    /// wave after the first programmatic if [`Self::programmatic_waves`]. Does nothing in index
    /// order.
    pub fn split_main_in_waves(&mut self, sm_count: usize) {
        if self.params.kv_buckets <= 1 {
            return;
        }
        let Some(at) = self.launches.iter().position(|l| l.stage == Stage::Main) else {
            return;
        };
        let main = self.launches[at];
        let groups = self.params.num_head_groups.max(1) as usize;
        let s_q = self.params.s_q.max(0) as usize;
        let wave = (sm_count / groups).max(1);
        let waves: Vec<Launch> = (0..s_q.div_ceil(wave))
            .map(|k| {
                let token0 = k * wave;
                let tokens = wave.min(s_q - token0);
                let mut cfg = main.cfg;
                // <= the single launch's grid, which fits u32.
                cfg.grid.0 = (tokens * groups) as u32;
                // Waves after the first are programmatic launches (module docs).
                cfg.programmatic = k > 0 && self.programmatic_waves;
                Launch {
                    token0,
                    cfg,
                    // Odd waves walk the buckets backwards: they start on the buckets the previous wave
                    // ended on, which L2 still holds.
                    descending: k % 2 == 1 && self.bucket_order == KvBucketOrder::Alternating,
                    ..main
                }
            })
            .collect();
        self.launches.splice(at..=at, waves);
    }

    /// Whether the plan accumulates into a workspace that [`Self::set_workspace`] must provide
    /// (false when the accumulator is `d_kv` itself or `d_kv` is empty).
    pub fn needs_workspace(&self) -> bool {
        self.accumulator == Accumulator::Workspace
            && self.launches.iter().any(|l| l.stage == Stage::Finalize)
    }

    /// Points the plan's accumulator at `ws`: f32 of shape [`Self::workspace_shape`], contiguous last
    /// dimension, rows 16-byte aligned (the reductions are 16 bytes wide), every offset within i64.
    pub fn set_workspace(&mut self, ws: &DeviceView) -> Result<()> {
        if ws.dtype() != DType::F32 {
            return Err(Error::invalid("workspace.dtype", DType::F32, ws.dtype()));
        }
        expect_shape("workspace", ws, &self.workspace_shape)?;
        if ws.shape()[1] > 1 && ws.strides()[1] != 1 {
            return Err(Error::invalid(
                "workspace.strides[1]",
                "1 (contiguous rows)",
                ws.strides()[1],
            ));
        }
        if !rows_aligned(ws, CHUNK_ALIGN_BYTES) {
            return Err(Error::invalid(
                "workspace",
                "16-byte aligned rows (base address and row stride multiples of 4 floats)",
                format!("{:#x}, strides {:?}", ws.ptr(), ws.strides()),
            ));
        }
        expect_offsets_fit("workspace", ws, i64::MAX as usize, "i64")?;
        // The kernels count the stride in accumulator values (int64 in fixed-point mode); 16-byte
        // aligned rows make it a whole number of them.
        let words = if self.params.flags & FLAG_FIXED_POINT != 0 {
            FIXED_POINT_WORDS as i64
        } else {
            1
        };
        self.params.dkv_acc = ws.ptr();
        self.params.dkv_acc_stride = stride_param("workspace", ws, 0)? / words;
        Ok(())
    }
}

/// Runs the backward on `gpu`'s stream for arguments that passed [`super::validate`] and outputs
/// that passed [`super::validate_output`] (`dims` is what `validate` returned): the launches of
/// [`lower`], in order. `workspace`: an f32 `[s_kv, d_qk]` buffer with 16-byte aligned rows for the
/// accumulator when it cannot be `d_kv` itself (shape [`workspace_shape`]); `None` allocates one for
/// this call ([`Gpu::alloc`], freed in stream order on return). Asynchronous: synchronise or download to wait.
///
/// Errors: [`Error::Unsupported`] / [`Error::InvalidArgument`] for the kernel limits in the
/// [module docs](self) and a bad workspace; [`Error::Cuda`] (with the driver call and code) from an
/// allocation or any launch, never a panic.
pub(crate) fn launch(
    gpu: &Gpu,
    dims: &SparseBwdDims,
    args: &SparseBwdArgs<'_, DeviceView>,
    out: &SparseBwdOutput<DeviceView>,
    options: &SparseBwdOptions,
    workspace: Option<&DeviceView>,
) -> Result<()> {
    let device = Location::Cuda(gpu.ordinal());
    expect_location("q", args.q, device)?;
    let mut plan = lower(dims, args, out, options)?;
    plan.split_main_in_waves(gpu.info().sm_count as usize);
    // Owned workspace, if any: dropped (freed in stream order, after the launches) on return.
    let mut _owned = None;
    if plan.needs_workspace() {
        let view = match workspace {
            Some(ws) => {
                expect_location("workspace", ws, device)?;
                ws.clone()
            }
            None => {
                let t = gpu.alloc(DType::F32, &plan.workspace_shape)?;
                let v = t.view();
                _owned = Some(t);
                v
            }
        };
        plan.set_workspace(&view)?;
    }
    for l in &plan.launches {
        let kernel = gpu.kernel(FAMILY, l.kernel)?;
        // SAFETY: `SparseBwdParams` is the kernels' parameter struct (its layout checked at
        // compile time). `validate`/`validate_output` established the shapes and dtypes the params
        // describe and that every tensor lives on this device; `lower` checked alignment and that
        // every offset fits i64; the accumulator is d_kv itself (f32, rows 16-byte aligned) or a
        // checked workspace that lives until this function returns, after the launches were queued
        // (its release is stream-ordered). The kernels read q/kv/out/d_out/lse/indices inside their
        // views (kv only at indices in 0..s_kv), write d_q, delta, d_attn_sink and the accumulator /
        // d_kv rows inside theirs; by the DeviceView contract outputs do not alias inputs.
        let mut params = plan.params;
        // < s_q, which fits i32 (lower checked).
        params.token0 = l.token0 as i32;
        params.kv_buckets_descending = i32::from(l.descending);
        unsafe { gpu.launch(&kernel, &l.cfg, &params)? };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::sparse_fwd::SparseFwdDims;

    const BASE: u64 = 0x7f00_0000_0000;

    use crate::ops::layout::fake_view as view;

    fn at(slot: u64) -> u64 {
        BASE + (slot << 34)
    }

    struct Case {
        q: DeviceView,
        kv: DeviceView,
        out: DeviceView,
        d_out: DeviceView,
        indices: DeviceView,
        lse: DeviceView,
        sink: Option<DeviceView>,
        grads: SparseBwdOutput<DeviceView>,
        dims: SparseBwdDims,
    }

    fn case(s_q: usize, h_q: usize, d_qk: usize, s_kv: usize, topk: usize, d_kv: DType) -> Case {
        let fwd = SparseFwdDims {
            s_q,
            s_kv,
            h_q,
            d_qk,
            d_v: 512,
            topk,
            has_attn_sink: false,
            has_topk_length: false,
        };
        Case {
            q: view(at(0), DType::Bf16, &[s_q, h_q, d_qk], None),
            kv: view(at(1), DType::Bf16, &[s_kv, 1, d_qk], None),
            out: view(at(2), DType::Bf16, &[s_q, h_q, 512], None),
            d_out: view(at(3), DType::Bf16, &[s_q, h_q, 512], None),
            indices: view(at(4), DType::I32, &[s_q, 1, topk], None),
            lse: view(at(5), DType::F32, &[s_q, h_q], None),
            sink: None,
            grads: SparseBwdOutput {
                d_q: view(at(6), DType::Bf16, &[s_q, h_q, d_qk], None),
                d_kv: view(at(7), d_kv, &[s_kv, 1, d_qk], None),
                delta: view(at(8), DType::F32, &[s_q, h_q], None),
                d_attn_sink: None,
            },
            dims: SparseBwdDims {
                fwd,
                d_kv_dtype: d_kv,
            },
        }
    }

    fn args(c: &Case) -> SparseBwdArgs<'_, DeviceView> {
        SparseBwdArgs {
            q: &c.q,
            kv: &c.kv,
            out: &c.out,
            d_out: &c.d_out,
            indices: &c.indices,
            lse: &c.lse,
            sm_scale: 0.1,
            attn_sink: c.sink.as_ref(),
            topk_length: None,
            d_kv_dtype: c.dims.d_kv_dtype,
        }
    }

    fn plan(c: &Case, o: &SparseBwdOptions) -> Result<SparseBwdPlan> {
        lower(&c.dims, &args(c), &c.grads, o)
    }

    fn stages(p: &SparseBwdPlan) -> Vec<Stage> {
        p.launches.iter().map(|l| l.stage).collect()
    }

    fn launch_of(p: &SparseBwdPlan, stage: Stage) -> Launch {
        *p.launches.iter().find(|l| l.stage == stage).unwrap()
    }

    #[test]
    fn lowers_the_v32_shape_with_a_bf16_d_kv_through_the_workspace() {
        let c = case(4096, 128, 576, 32768, 2048, DType::Bf16);
        let p = plan(&c, &SparseBwdOptions::default()).unwrap();
        use Stage::*;
        assert_eq!(stages(&p), [ZeroAcc, Main, Finalize]);
        assert_eq!(p.accumulator, Accumulator::Workspace);
        assert!(p.needs_workspace());
        let main = launch_of(&p, Main);
        assert_eq!(main.kernel, "sparse_bwd_main_pair_xb_d576");
        assert_eq!(main.cfg.grid, (8192, 1, 1));
        assert_eq!(main.cfg.block, (384, 1, 1));
        assert_eq!(main.cfg.shared_mem_bytes, SMEM_BYTES_D576);
        assert_eq!(main.cfg.cluster, Some((2, 1, 1)));
        // 32768 * 576 / 4 float4 stores, one per thread.
        assert_eq!(launch_of(&p, ZeroAcc).cfg.grid, (18432, 1, 1));
        assert_eq!(launch_of(&p, Finalize).cfg.grid, (9216, 1, 1));
        let q = &p.params;
        assert_eq!(
            (q.q_stride_t, q.q_stride_h, q.kv_stride_t),
            (128 * 576, 576, 576)
        );
        assert_eq!((q.d_out_stride_t, q.d_out_stride_h), (128 * 512, 512));
        assert_eq!((q.d_q_stride_t, q.d_q_stride_h), (128 * 576, 576));
        assert_eq!((q.delta_stride_t, q.delta_stride_h), (128, 1));
        assert_eq!(
            (q.dkv_acc, q.dkv_acc_stride, q.d_kv, q.d_kv_stride),
            (0, 576, at(7), 576)
        );
        assert_eq!(
            (q.num_head_groups, q.d_qk, q.s_kv, q.topk),
            (2, 576, 32768, 2048)
        );
        // 75.5 MB of accumulator + 37.7 MB of KV: beyond L2, so the drain goes first.
        assert_eq!(
            q.flags,
            FLAG_OUT_VEC16
                | FLAG_DQ_VEC16
                | FLAG_DKV_VEC16
                | FLAG_DRAIN_FIRST
                | FLAG_DEFER_LAST_REDUCE,
            "bf16 d_kv, everything aligned"
        );
        assert!((q.sm_scale_log2 - 0.1 * LOG2_E).abs() < 1e-7);
        assert_eq!(q.sm_scale, 0.1);
    }

    #[test]
    fn workspace_is_checked_and_wired_in() {
        let c = case(8, 64, 512, 1000, 64, DType::Bf16);
        let mut p = plan(&c, &SparseBwdOptions::default()).unwrap();
        let good = view(at(9), DType::F32, &[1000, 512], None);
        p.set_workspace(&good).unwrap();
        assert_eq!((p.params.dkv_acc, p.params.dkv_acc_stride), (at(9), 512));
        let padded = view(at(9), DType::F32, &[1000, 512], Some(&[516, 1]));
        p.set_workspace(&padded).unwrap();
        assert_eq!(p.params.dkv_acc_stride, 516);
        for (bad, arg) in [
            (
                view(at(9), DType::Bf16, &[1000, 512], None),
                "workspace.dtype",
            ),
            (
                view(at(9), DType::F32, &[999, 512], None),
                "workspace.shape",
            ),
            (view(at(9) + 4, DType::F32, &[1000, 512], None), "workspace"),
            (
                view(at(9), DType::F32, &[1000, 512], Some(&[514, 1])),
                "workspace",
            ),
        ] {
            assert_eq!(
                p.set_workspace(&bad).unwrap_err().arg(),
                Some(arg),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn f32_d_kv_with_aligned_rows_is_the_accumulator() {
        let c = case(8, 128, 576, 1000, 100, DType::F32);
        let p = plan(&c, &SparseBwdOptions::default()).unwrap();
        use Stage::*;
        assert_eq!(stages(&p), [ZeroAcc, Main]);
        assert_eq!(p.accumulator, Accumulator::Output);
        assert!(!p.needs_workspace());
        assert_eq!((p.params.dkv_acc, p.params.dkv_acc_stride), (at(7), 576));
        // Accumulating in place: nothing is zeroed.
        let acc = SparseBwdOptions {
            accumulate_d_kv: true,
            ..Default::default()
        };
        let p = plan(&c, &acc).unwrap();
        assert_eq!(stages(&p), [Main]);
        assert_ne!(p.params.flags & FLAG_ACCUMULATE, 0);
    }

    #[test]
    fn unaligned_f32_d_kv_goes_through_the_workspace() {
        let mut c = case(8, 128, 576, 1000, 100, DType::F32);
        c.grads.d_kv = view(at(7), DType::F32, &[1000, 1, 576], Some(&[577, 577, 1]));
        let acc = SparseBwdOptions {
            accumulate_d_kv: true,
            ..Default::default()
        };
        let p = plan(&c, &acc).unwrap();
        use Stage::*;
        // The workspace is zeroed, then added into d_kv by the finalisation.
        assert_eq!(stages(&p), [ZeroAcc, Main, Finalize]);
        assert_eq!(p.accumulator, Accumulator::Workspace);
        let f = p.params.flags;
        assert_eq!(
            f & (FLAG_DKV_F32 | FLAG_ACCUMULATE | FLAG_DKV_VEC16),
            FLAG_DKV_F32 | FLAG_ACCUMULATE
        );
        assert_eq!(p.params.d_kv_stride, 577);
    }

    #[test]
    fn deterministic_mode_reduces_fixed_point_in_a_double_width_workspace() {
        let c = case(8, 128, 576, 1000, 100, DType::F32);
        let det = SparseBwdOptions {
            deterministic: true,
            accumulate_d_kv: true,
            ..Default::default()
        };
        let mut p = plan(&c, &det).unwrap();
        use Stage::*;
        // Even an aligned f32 d_kv goes through the (int64) workspace, zeroed, then added into d_kv.
        assert_eq!(stages(&p), [ZeroAcc, Main, Finalize]);
        assert_eq!(launch_of(&p, Main).kernel, "sparse_bwd_main_pair_det_d576");
        assert_eq!(p.workspace_shape, [1000, 2 * 576]);
        assert_eq!(workspace_shape(&c.dims, &det), [1000, 1152]);
        let f = p.params.flags;
        assert_eq!(
            f & (FLAG_FIXED_POINT | FLAG_ACCUMULATE),
            FLAG_FIXED_POINT | FLAG_ACCUMULATE
        );
        // Strides count int64 values.
        assert_eq!(p.params.dkv_acc_stride, 576);
        let ws = view(at(9), DType::F32, &[1000, 1152], Some(&[1160, 1]));
        p.set_workspace(&ws).unwrap();
        assert_eq!((p.params.dkv_acc, p.params.dkv_acc_stride), (at(9), 580));
        let small = view(at(9), DType::F32, &[1000, 576], None);
        assert_eq!(
            p.set_workspace(&small).unwrap_err().arg(),
            Some("workspace.shape")
        );
        let c = case(8, 64, 512, 10, 64, DType::Bf16);
        let o = SparseBwdOptions {
            deterministic: true,
            ..Default::default()
        };
        assert_eq!(
            launch_of(&plan(&c, &o).unwrap(), Main).kernel,
            "sparse_bwd_main_det_d512"
        );
    }

    #[test]
    fn the_bf16_exchange_serves_only_a_bf16_d_kv_without_determinism() {
        let bf16 = case(8, 128, 576, 10, 64, DType::Bf16);
        let f32 = case(8, 128, 576, 10, 64, DType::F32);
        let det = SparseBwdOptions {
            deterministic: true,
            ..Default::default()
        };
        let kernel =
            |c: &Case, o: &SparseBwdOptions| launch_of(&plan(c, o).unwrap(), Stage::Main).kernel;
        let default = SparseBwdOptions::default();
        assert_eq!(kernel(&bf16, &default), "sparse_bwd_main_pair_xb_d576");
        assert_eq!(kernel(&f32, &default), "sparse_bwd_main_pair_d576");
        assert_eq!(kernel(&bf16, &det), "sparse_bwd_main_pair_det_d576");
    }

    #[test]
    fn only_the_bf16_exchange_kernels_defer_their_last_reductions() {
        let defer = |h_q, dtype, o: &SparseBwdOptions| {
            let c = case(8, h_q, 576, 8192, 64, dtype);
            plan(&c, o).unwrap().params.flags & FLAG_DEFER_LAST_REDUCE != 0
        };
        let default = SparseBwdOptions::default();
        let det = SparseBwdOptions {
            deterministic: true,
            ..Default::default()
        };
        assert!(defer(128, DType::Bf16, &default));
        assert!(!defer(128, DType::F32, &default));
        assert!(!defer(128, DType::Bf16, &det));
        assert!(!defer(64, DType::Bf16, &default));
    }

    #[test]
    fn the_drain_goes_first_only_when_d_kv_and_kv_exceed_l2() {
        let flags = |s_kv| {
            let c = case(8, 128, 576, s_kv, 64, DType::Bf16);
            plan(&c, &SparseBwdOptions::default()).unwrap().params.flags & FLAG_DRAIN_FIRST
        };
        assert_eq!(flags(8192), 0); // 28 MB: L2-resident
        assert_eq!(flags(16384), FLAG_DRAIN_FIRST); // 57 MB
        assert_eq!(flags(131072), FLAG_DRAIN_FIRST);
    }

    #[test]
    fn kv_buckets_follow_the_l2_budget() {
        let nb = |h_q, s_kv, d_qk, topk, det| {
            let c = case(1, h_q, d_qk, s_kv, topk, DType::Bf16);
            let o = SparseBwdOptions {
                deterministic: det,
                ..Default::default()
            };
            kv_buckets(&c.dims, &o)
        };
        // V3.2 (d_qk 576, topk 2048): 8K fits L2 (28 MB); then 12 MiB per bucket up to 128 MiB, 32 MiB
        // beyond, up to 512 MiB with two head groups (128K: 453 MB) and 256 MiB with one.
        assert_eq!(nb(128, 8192, 576, 2048, false), 1);
        assert_eq!(nb(128, 16384, 576, 2048, false), 5);
        assert_eq!(nb(128, 32768, 576, 2048, false), 9);
        assert_eq!(nb(128, 65536, 576, 2048, false), 7);
        assert_eq!(nb(128, 131072, 576, 2048, false), 14);
        assert_eq!(nb(128, 262144, 576, 2048, false), 1);
        assert_eq!(nb(64, 131072, 576, 2048, false), 1);
        assert_eq!(nb(128, usize::MAX / 2, 576, 2048, false), 1);
        // The fixed-point accumulator (8 bytes per value): 12 MiB per bucket at every size (180 MiB
        // at 32K -> 15), no upper bound with two head groups (128K: one per tile, 32), 512 MiB with
        // one (720 MiB at 128K: index order; MODEL1 64K, 320 MiB: one per tile, 8).
        assert_eq!(nb(128, 8192, 576, 2048, true), 4);
        assert_eq!(nb(128, 32768, 576, 2048, true), 15);
        assert_eq!(nb(128, 131072, 576, 2048, true), 32);
        assert_eq!(nb(128, 1 << 20, 576, 2048, true), 32);
        assert_eq!(nb(64, 32768, 576, 2048, true), 15);
        assert_eq!(nb(64, 131072, 576, 2048, true), 1);
        assert_eq!(nb(64, 65536, 512, 512, true), 8);
        // MODEL1: h_q 128 / topk 1024 keeps the index order up to 128 MiB and takes coarse buckets
        // beyond (64K: 201 MB -> 6); h_q 64 / topk 512 (solo) buckets, one per tile.
        assert_eq!(nb(128, 32768, 512, 1024, false), 1);
        assert_eq!(nb(128, 65536, 512, 1024, false), 6);
        assert_eq!(
            nb(128, 65536, 512, MIN_BUCKETED_TOPK_PAIR_COARSE - 1, false),
            1
        );
        assert_eq!(nb(64, 32768, 512, 512, false), 8);
        assert_eq!(nb(64, 65536, 512, 512, false), 6); // 192 MiB
        assert_eq!(nb(64, 32768, 576, 2048, false), 9);
        assert_eq!(nb(64, 32768, 512, MIN_BUCKETED_TOPK_SOLO - 1, false), 1);
        // Rows outside the kernel's range; tiny shapes.
        assert_eq!(nb(128, 32768, 576, MAX_BUCKETED_TOPK, false), 9);
        assert_eq!(nb(128, 32768, 576, MAX_BUCKETED_TOPK + 1, false), 1);
        assert_eq!(nb(128, 95, 576, 128, false), 1);
        assert_eq!(nb(128, 0, 576, 2048, false), 1);
    }

    #[test]
    fn bucketed_plans_launch_the_main_kernel_in_waves_of_resident_tokens() {
        let c = case(200, 128, 576, 32768, 2048, DType::Bf16);
        let mut p = plan(&c, &SparseBwdOptions::default()).unwrap();
        assert_eq!(p.params.kv_buckets, 9);
        let before = p.launches.len();
        p.split_main_in_waves(132);
        let mains: Vec<Launch> = p
            .launches
            .iter()
            .copied()
            .filter(|l| l.stage == Stage::Main)
            .collect();
        // 66 two-CTA clusters per wave: tokens 0..66, 66..132, 132..198, 198..200.
        assert_eq!(
            mains
                .iter()
                .map(|l| (l.token0, l.cfg.grid.0, l.descending))
                .collect::<Vec<_>>(),
            // Odd waves walk the buckets backwards.
            vec![
                (0, 132, false),
                (66, 132, true),
                (132, 132, false),
                (198, 4, true)
            ]
        );
        assert!(p
            .launches
            .iter()
            .all(|l| l.stage == Stage::Main || !l.descending));
        assert!(mains.iter().all(|l| l.cfg.cluster == Some((2, 1, 1))));
        // Only the waves after the first may overlap their predecessor; nothing else does.
        assert_eq!(
            p.launches
                .iter()
                .map(|l| l.cfg.programmatic)
                .collect::<Vec<_>>(),
            [false, false, true, true, true, false]
        );
        assert_eq!(p.launches.len(), before + 3);
        // Stream order is kept: zeroing before the waves, finalisation after.
        assert_eq!(
            stages(&p),
            [
                vec![Stage::ZeroAcc],
                vec![Stage::Main; 4],
                vec![Stage::Finalize]
            ]
            .concat()
        );
        // One head group: waves of 132 tokens, programmatic after the first as well.
        let solo = case(300, 64, 576, 32768, 2048, DType::Bf16);
        let mut p = plan(&solo, &SparseBwdOptions::default()).unwrap();
        p.split_main_in_waves(132);
        let mains: Vec<&Launch> = p
            .launches
            .iter()
            .filter(|l| l.stage == Stage::Main)
            .collect();
        assert_eq!(
            mains.iter().map(|l| l.cfg.programmatic).collect::<Vec<_>>(),
            [false, true, true]
        );
        // Index order: one launch, whatever the GPU.
        let small = case(200, 128, 576, 4096, 2048, DType::Bf16);
        let mut p = plan(&small, &SparseBwdOptions::default()).unwrap();
        assert_eq!(p.params.kv_buckets, 1);
        let one = p.clone();
        p.split_main_in_waves(132);
        assert_eq!(p, one);
    }

    #[test]
    fn plans_name_exactly_the_listed_kernels() {
        let mut named = vec![kernels::ZERO_ACC, kernels::FINALIZE, kernels::SINK_GRAD];
        for d_qk in [512, 576] {
            for det in [false, true] {
                for pair in [false, true] {
                    for xb in [false, true] {
                        named.push(main_kernel_for(d_qk, det, pair, xb).unwrap().0);
                    }
                }
            }
        }
        named.sort();
        named.dedup();
        let mut all = kernels::ALL.to_vec();
        all.sort();
        assert_eq!(named, all);
        assert!(main_kernel_for(448, false, false, false).is_err());
    }

    fn tuned(t: SparseBwdTuning) -> SparseBwdOptions {
        SparseBwdOptions {
            tuning: t,
            ..Default::default()
        }
    }

    #[test]
    fn each_tuning_field_replaces_its_heuristic_alone() {
        // V3.2 at s_kv 32K, h_q 128, bf16 d_kv: 9 buckets, drain first, deferred last reductions.
        let c = case(200, 128, 576, 32768, 2048, DType::Bf16);
        let with = |t: SparseBwdTuning| plan(&c, &tuned(t)).unwrap();
        let auto = with(SparseBwdTuning::default());
        let both = FLAG_DRAIN_FIRST | FLAG_DEFER_LAST_REDUCE;
        assert_eq!(auto.params.kv_buckets, 9);
        assert_eq!(auto.params.flags & both, both);
        assert_eq!(
            (auto.bucket_order, auto.programmatic_waves),
            (KvBucketOrder::Alternating, true)
        );
        for (n, want) in [(1, 1), (4, 4), (MAX_KV_BUCKETS, MAX_KV_BUCKETS as i32)] {
            let p = with(SparseBwdTuning {
                kv_buckets: Some(n),
                ..Default::default()
            });
            assert_eq!(p.params.kv_buckets, want);
            assert_eq!(p.params.flags, auto.params.flags);
        }
        for bad in [0, MAX_KV_BUCKETS + 1] {
            let o = tuned(SparseBwdTuning {
                kv_buckets: Some(bad),
                ..Default::default()
            });
            assert_eq!(
                plan(&c, &o).unwrap_err().arg(),
                Some("tuning.kv_buckets"),
                "{bad}"
            );
        }
        let no_drain = with(SparseBwdTuning {
            drain_first: Some(false),
            ..Default::default()
        });
        assert_eq!(no_drain.params.flags, auto.params.flags & !FLAG_DRAIN_FIRST);
        assert_eq!(no_drain.params.kv_buckets, 9);
        let no_defer = with(SparseBwdTuning {
            defer_last_reduce: Some(false),
            ..Default::default()
        });
        assert_eq!(
            no_defer.params.flags,
            auto.params.flags & !FLAG_DEFER_LAST_REDUCE
        );
        let order = with(SparseBwdTuning {
            bucket_order: Some(KvBucketOrder::Ascending),
            pdl: Some(false),
            ..Default::default()
        });
        assert_eq!(order.params, auto.params);
        assert_eq!(
            (order.bucket_order, order.programmatic_waves),
            (KvBucketOrder::Ascending, false)
        );
        // At s_kv 4K (14 MB) the drain goes last unless asked; the defer flag is only ever set for
        // the kernels that read it (not with an f32 d_kv).
        let small = case(8, 128, 576, 4096, 64, DType::Bf16);
        let drain = tuned(SparseBwdTuning {
            drain_first: Some(true),
            ..Default::default()
        });
        assert_eq!(
            plan(&small, &Default::default()).unwrap().params.flags & FLAG_DRAIN_FIRST,
            0
        );
        assert_ne!(
            plan(&small, &drain).unwrap().params.flags & FLAG_DRAIN_FIRST,
            0
        );
        let f32 = case(8, 128, 576, 4096, 64, DType::F32);
        let defer = tuned(SparseBwdTuning {
            defer_last_reduce: Some(true),
            ..Default::default()
        });
        assert_eq!(
            plan(&f32, &defer).unwrap().params.flags & FLAG_DEFER_LAST_REDUCE,
            0
        );
    }

    #[test]
    fn wave_direction_and_overlap_follow_the_tuning() {
        let c = case(200, 128, 576, 32768, 2048, DType::Bf16);
        let waves = |t: SparseBwdTuning| {
            let mut p = plan(&c, &tuned(t)).unwrap();
            p.split_main_in_waves(132);
            p.launches
                .iter()
                .filter(|l| l.stage == Stage::Main)
                .map(|l| (l.descending, l.cfg.programmatic))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            waves(SparseBwdTuning::default()),
            [(false, false), (true, true), (false, true), (true, true)]
        );
        let ascending = SparseBwdTuning {
            bucket_order: Some(KvBucketOrder::Ascending),
            ..Default::default()
        };
        assert_eq!(
            waves(ascending),
            [(false, false), (false, true), (false, true), (false, true)]
        );
        let sequential = SparseBwdTuning {
            pdl: Some(false),
            ..Default::default()
        };
        assert_eq!(
            waves(sequential),
            [(false, false), (true, false), (false, false), (true, false)]
        );
        // One bucket is the index order: one launch whatever else is asked.
        let one = SparseBwdTuning {
            kv_buckets: Some(1),
            bucket_order: Some(KvBucketOrder::Alternating),
            pdl: Some(true),
            ..Default::default()
        };
        assert_eq!(waves(one), [(false, false)]);
        // Buckets forced onto an L2-resident shape split it in waves like the heuristic's would.
        let small = case(200, 128, 576, 4096, 2048, DType::Bf16);
        let mut p = plan(
            &small,
            &tuned(SparseBwdTuning {
                kv_buckets: Some(4),
                ..Default::default()
            }),
        )
        .unwrap();
        p.split_main_in_waves(132);
        assert_eq!(p.params.kv_buckets, 4);
        assert_eq!(
            p.launches.iter().filter(|l| l.stage == Stage::Main).count(),
            4
        );
    }

    #[test]
    fn bf16_d_kv_cannot_accumulate() {
        let c = case(8, 64, 576, 10, 64, DType::Bf16);
        let acc = SparseBwdOptions {
            accumulate_d_kv: true,
            ..Default::default()
        };
        assert!(matches!(plan(&c, &acc), Err(Error::Unsupported { .. })));
    }

    #[test]
    fn head_counts_round_up_to_groups_and_clusters_pair_them() {
        for (h_q, groups) in [(1, 1), (64, 1), (65, 2), (100, 2), (128, 2)] {
            let c = case(3, h_q, 512, 10, 7, DType::Bf16);
            let p = plan(&c, &SparseBwdOptions::default()).unwrap();
            let main = launch_of(&p, Stage::Main);
            let want = if groups == 2 {
                "sparse_bwd_main_pair_xb_d512"
            } else {
                "sparse_bwd_main_d512"
            };
            assert_eq!(main.kernel, want, "h_q {h_q}");
            assert_eq!(main.cfg.shared_mem_bytes, SMEM_BYTES_D512);
            assert_eq!(
                (main.cfg.grid.0, p.params.num_head_groups),
                (3 * groups, groups as i32)
            );
            assert_eq!(
                main.cfg.cluster,
                (groups == 2).then_some((2, 1, 1)),
                "h_q {h_q}"
            );
        }
        let c = case(3, 129, 576, 10, 7, DType::Bf16);
        assert!(matches!(
            plan(&c, &SparseBwdOptions::default()),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn empty_dimensions_launch_only_what_has_output() {
        use Stage::*;
        // No tokens: d_kv must still come out as zeros.
        let c = case(0, 128, 576, 10, 7, DType::Bf16);
        assert_eq!(
            stages(&plan(&c, &Default::default()).unwrap()),
            [ZeroAcc, Finalize]
        );
        // No KV rows: every index is invalid, d_q = 0 still has to be written.
        let c = case(5, 128, 576, 0, 7, DType::Bf16);
        let p = plan(&c, &Default::default()).unwrap();
        assert_eq!(stages(&p), [Main]);
        assert!(!p.needs_workspace());
        // A sink gradient is written even with no tokens (an empty sum).
        let mut c = case(0, 64, 576, 10, 7, DType::F32);
        c.sink = Some(view(at(10), DType::F32, &[64], None));
        c.grads.d_attn_sink = Some(view(at(11), DType::F32, &[64], None));
        let p = plan(&c, &Default::default()).unwrap();
        assert_eq!(stages(&p), [ZeroAcc, SinkGrad]);
        assert_eq!(launch_of(&p, SinkGrad).cfg.grid, (64, 1, 1));
        assert_eq!((p.params.attn_sink, p.params.d_attn_sink), (at(10), at(11)));
    }

    #[test]
    fn long_sequences_stay_on_grid_x_and_huge_s_kv_is_clamped() {
        let c = case(200_000, 128, 576, 3_000_000_000, 64, DType::F32);
        let p = plan(&c, &Default::default()).unwrap();
        assert_eq!(launch_of(&p, Stage::Main).cfg.grid, (400_000, 1, 1));
        assert_eq!(p.params.s_kv, i32::MAX);
        let mut big = case(2, 64, 512, 10, 64, DType::Bf16);
        big.dims.fwd.topk = i32::MAX as usize;
        assert_eq!(
            plan(&big, &Default::default()).unwrap_err().arg(),
            Some("indices.shape[2]")
        );
    }

    #[test]
    fn gathered_tensors_need_16_byte_rows_others_fall_back() {
        // The spec's adversarial layout (every dim padded, last by 128) keeps 16-byte rows.
        let mut c = case(5, 64, 576, 100, 64, DType::Bf16);
        c.q = view(at(0), DType::Bf16, &[5, 64, 576], Some(&[65 * 704, 704, 1]));
        c.kv = view(at(1), DType::Bf16, &[100, 1, 576], Some(&[1408, 704, 1]));
        c.d_out = view(at(3), DType::Bf16, &[5, 64, 512], Some(&[65 * 640, 640, 1]));
        let p = plan(&c, &Default::default()).unwrap();
        assert_eq!(
            (p.params.q_stride_t, p.params.kv_stride_t),
            (65 * 704, 1408)
        );
        assert_eq!(
            (p.params.d_out_stride_t, p.params.d_out_stride_h),
            (65 * 640, 640)
        );
        for (arg, bad) in [
            ("`q`", view(at(0) + 2, DType::Bf16, &[5, 64, 576], None)),
            (
                "`kv`",
                view(at(1), DType::Bf16, &[100, 1, 576], Some(&[577, 577, 1])),
            ),
            (
                "`d_out`",
                view(at(3), DType::Bf16, &[5, 64, 512], Some(&[64 * 513, 513, 1])),
            ),
        ] {
            let mut b = case(5, 64, 576, 100, 64, DType::Bf16);
            match arg {
                "`q`" => b.q = bad,
                "`kv`" => b.kv = bad,
                _ => b.d_out = bad,
            }
            let err = plan(&b, &Default::default()).unwrap_err();
            assert!(
                matches!(err, Error::Unsupported { ref what, .. } if what.contains(arg)),
                "{err:?}"
            );
        }
        // Odd strides of out, d_q and d_kv only disable their vector accesses.
        let mut odd = case(5, 64, 576, 100, 64, DType::Bf16);
        odd.out = view(at(2), DType::Bf16, &[5, 64, 512], Some(&[64 * 513, 513, 1]));
        odd.grads.d_q = view(at(6), DType::Bf16, &[5, 64, 576], Some(&[64 * 577, 577, 1]));
        odd.grads.d_kv = view(at(7), DType::Bf16, &[100, 1, 576], Some(&[577, 577, 1]));
        let p = plan(&odd, &Default::default()).unwrap();
        assert_eq!(p.params.flags, 0);
        // Misaligned element pointers are rejected by name.
        let mut mis = case(5, 64, 576, 100, 64, DType::Bf16);
        mis.lse = view(at(5) + 2, DType::F32, &[5, 64], None);
        assert_eq!(
            plan(&mis, &Default::default()).unwrap_err().arg(),
            Some("lse.data_ptr")
        );
    }

    #[test]
    fn optional_tensors_are_passed_with_their_strides() {
        let mut c = case(6, 128, 576, 100, 64, DType::Bf16);
        c.sink = Some(view(at(10), DType::F32, &[128], Some(&[2])));
        c.grads.d_attn_sink = Some(view(at(11), DType::F32, &[128], Some(&[3])));
        let len = view(at(12), DType::I32, &[6], Some(&[5]));
        let mut a = args(&c);
        a.topk_length = Some(&len);
        let p = lower(&c.dims, &a, &c.grads, &Default::default()).unwrap();
        assert_eq!((p.params.attn_sink, p.params.attn_sink_stride), (at(10), 2));
        assert_eq!(
            (p.params.d_attn_sink, p.params.d_attn_sink_stride),
            (at(11), 3)
        );
        assert_eq!(
            (p.params.topk_length, p.params.topk_length_stride),
            (at(12), 5)
        );
        assert_eq!(p.launches.last().unwrap().stage, Stage::SinkGrad);
    }
}
