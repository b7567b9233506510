//! GPU path of the sparse prefill forward: checks the limits of the sm_90a kernel
//! (`csrc/sm90/sparse_fwd/`, design in `docs/sparse-fwd.md`), lowers validated arguments to its
//! [`SparseFwdParams`] and launches one CTA of 384 threads per (query token, group of 64 heads;
//! the two groups of a token as one 2-CTA cluster, [`token_cluster_for`]):
//! a producer warpgroup gathering KV tiles and two consumer warpgroups, each owning half of the
//! output columns. Two pipelines ([`SparseFwdPipeline`], chosen per call by [`choose`]: the
//! [`SparseFwdTuning`] the caller passes, else [`pipeline_for`]):
//! "split" (a score warpgroup runs Q K^T and the softmax for every tile, a value warpgroup the other
//! half of P V) for long contexts, and "alternating" (the consumers take alternate tiles, each
//! running Q K^T, the softmax and its P V half, and exchange P) where the gathered KV fits in L2.
//!
//! Kernel limits checked here (beyond [`mod@super::validate`]): `h_q <= 128`; `q` and `kv` rows 16-byte
//! aligned (the gather copies 16-byte chunks); `indices`, `topk_length`, `attn_sink`, `max_logits`
//! and `lse` aligned to their element size; every reachable offset fits `i64`; `topk` and the grid
//! fit the kernel's 32-bit counters. `out` takes 16-byte stores when its rows are 16-byte aligned
//! and 2-byte stores otherwise.

use super::{SparseFwdArgs, SparseFwdDims, SparseFwdOutput};
use crate::cuda::{device_params, DeviceParams, Gpu, LaunchConfig};
use crate::error::{Error, Result};
use crate::ops::layout::{
    expect_element_aligned, expect_offsets_fit_i64, expect_rows_16b, rows_aligned, stride_param,
};
use crate::tensor::{DType, DeviceView, Location, TensorMeta};
use crate::validate::{expect_location, to_i32};

/// Kernel family (`csrc/sm90/sparse_fwd/`).
pub const FAMILY: &str = <SparseFwdParams as DeviceParams>::FAMILY;
/// Heads per CTA (`kHeadsPerCta`, the wgmma M).
pub const HEADS_PER_CTA: usize = 64;
/// Largest `h_q` the kernel serves (`kMaxHeads`): two head groups per token.
pub const MAX_HEADS: usize = 128;
/// KV rows per pipeline tile (`kTileRows`).
pub const TILE_ROWS: usize = 64;
/// Threads per CTA (`kThreads`): a producer and two consumer warpgroups.
pub const THREADS_PER_CTA: u32 = 384;
/// Dynamic shared memory of the d_qk = 576 kernels (`kSmemBytes<576>`, static_asserted in
/// config.cuh; both pipelines share the plan).
pub const SMEM_BYTES_D576: u32 = 232_448;
/// Dynamic shared memory of the d_qk = 512 kernels (`kSmemBytes<512>`).
pub const SMEM_BYTES_D512: u32 = 216_064;
/// The gather and the vector output path move 16-byte chunks (8 bf16).
pub const CHUNK_ALIGN_BYTES: u64 = 16;
/// `flags` bit: `out` rows are 16-byte aligned (`kFlagOutVec16` in params.h).
pub const FLAG_OUT_VEC16: u32 = 1;
/// `flags` bit: the alternating pipeline prefetches whole rows into L2 (`kFlagPrefetchRows`).
pub const FLAG_PREFETCH_ROWS: u32 = 2;
/// Largest `blockIdx.x` + 1 the driver accepts.
const MAX_GRID_X: usize = i32::MAX as usize;
/// log2(e): the kernel keeps logits in base 2, so the host folds it into the scale.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

device_params! {
    family = "sparse_fwd", cxx = "SparseFwdParams";
    /// Mirror of `flashmla::sparse_fwd::SparseFwdParams` (params.h), checked against it at compile
    /// time ([`crate::cuda::params`]). Pointers are device addresses; strides are in elements; last
    /// dimensions are contiguous and have no stride field.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct SparseFwdParams {
        /// `[s_q, h_q, d_qk]` bf16, strides `(q_stride_t, q_stride_h, 1)`.
        pub q: u64,
        /// `[s_kv, 1, d_qk]` bf16, row stride `kv_stride_t`.
        pub kv: u64,
        /// `[s_q, 1, topk]` i32, token stride `indices_stride_t`.
        pub indices: u64,
        /// `[s_q]` i32, stride `topk_length_stride`; 0 when absent.
        pub topk_length: u64,
        /// `[h_q]` f32, stride `attn_sink_stride`; 0 when absent.
        pub attn_sink: u64,
        /// `[s_q, h_q, d_v]` bf16, strides `(out_stride_t, out_stride_h, 1)`.
        pub out: u64,
        /// `[s_q, h_q]` f32, strides `(max_logits_stride_t, max_logits_stride_h)`.
        pub max_logits: u64,
        /// `[s_q, h_q]` f32, strides `(lse_stride_t, lse_stride_h)`.
        pub lse: u64,
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
        /// Elements between `max_logits` tokens.
        pub max_logits_stride_t: i64,
        /// Elements between `max_logits` heads.
        pub max_logits_stride_h: i64,
        /// Elements between `lse` tokens.
        pub lse_stride_t: i64,
        /// Elements between `lse` heads.
        pub lse_stride_h: i64,
        /// Query tokens.
        pub s_q: i32,
        /// KV rows, clamped to `i32::MAX` (every i32 index >= 0 is then below it, as it is below the
        /// true `s_kv`).
        pub s_kv: i32,
        /// Query heads, 1..=128.
        pub h_q: i32,
        /// Index entries per token.
        pub topk: i32,
        /// `ceil(h_q / 64)`.
        pub num_head_groups: i32,
        /// `FLAG_*` bits.
        pub flags: u32,
        /// `sm_scale * log2(e)`.
        pub sm_scale_log2: f32,
        /// Always 0.
        pub reserved: i32,
    }
}

/// The family's kernel symbols (entry points in `csrc/sm90/sparse_fwd/sparse_fwd.cu`): the only place
/// they are spelled on the host; a CPU test checks each against the embedded cubin.
pub mod kernels {
    /// Split pipeline, `d_qk` 576.
    pub const SPLIT_D576: &str = "sparse_fwd_d576";
    /// Split pipeline, `d_qk` 512.
    pub const SPLIT_D512: &str = "sparse_fwd_d512";
    /// Alternating pipeline, `d_qk` 576.
    pub const ALT_D576: &str = "sparse_fwd_alt_d576";
    /// Alternating pipeline, `d_qk` 512.
    pub const ALT_D512: &str = "sparse_fwd_alt_d512";
    /// Every kernel [`super::kernel_for`] can name.
    pub const ALL: &[&str] = &[SPLIT_D576, SPLIT_D512, ALT_D576, ALT_D512];
}

/// Kernel symbol and dynamic shared memory for a `d_qk` and a pipeline.
pub fn kernel_for(d_qk: usize, pipeline: SparseFwdPipeline) -> Result<(&'static str, u32)> {
    let alt = pipeline == SparseFwdPipeline::Alternating;
    match (d_qk, alt) {
        (576, false) => Ok((kernels::SPLIT_D576, SMEM_BYTES_D576)),
        (576, true) => Ok((kernels::ALT_D576, SMEM_BYTES_D576)),
        (512, false) => Ok((kernels::SPLIT_D512, SMEM_BYTES_D512)),
        (512, true) => Ok((kernels::ALT_D512, SMEM_BYTES_D512)),
        _ => Err(Error::unsupported(
            format!("sparse_fwd kernel for d_qk = {d_qk}"),
            "the sm_90a kernel is built for d_qk 512 and 576",
        )),
    }
}

/// The two forward kernel designs (`docs/sparse-fwd.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparseFwdPipeline {
    /// Score + value warpgroups: tolerant of gather latency (long contexts).
    Split,
    /// Consumers alternate tiles: more overlap, needs fast (L2-resident) gathers.
    Alternating,
}

/// What the alternating pipeline's producer prefetches into L2 ahead of its gathers (the split pipeline
/// ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparseFwdPrefetch {
    /// Nothing.
    Off,
    /// The value columns of every row of the next tile ([`FLAG_PREFETCH_ROWS`]).
    Rows,
}

/// Launch choices of the forward that change its speed, not what it computes (up to the order of the
/// online softmax's f32 additions). Each `None` takes the measured heuristic ([`choose`]); the default
/// is all `None`, which is what [`super::sparse_fwd_cuda`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SparseFwdTuning {
    /// The kernel pipeline; `None`: [`pipeline_for`] (by KV size and head count).
    pub pipeline: Option<SparseFwdPipeline>,
    /// The alternating pipeline's L2 prefetch; `None`: [`prefetch_rows_for`] (by KV size).
    pub prefetch: Option<SparseFwdPrefetch>,
    /// `Some(false)` launches the CTAs of a token's two head groups independently instead of as a 2-CTA
    /// cluster; `None` and `Some(true)`: [`token_cluster_for`] (a cluster exactly when there are two head
    /// groups: with one, a cluster would not pair the CTAs of a token).
    pub cluster: Option<bool>,
}

/// The launch choices of one call ([`choose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseFwdChoice {
    /// The kernel pipeline.
    pub pipeline: SparseFwdPipeline,
    /// Whether [`FLAG_PREFETCH_ROWS`] is set.
    pub prefetch_rows: bool,
    /// Cluster dimensions of the launch, if any.
    pub cluster: Option<(u32, u32, u32)>,
}

/// Largest KV tensor (`s_kv * d_qk * 2` bytes) for which [`pipeline_for`] picks the alternating
/// pipeline (with `h_q > 64`) at `d_qk` 512. Measured on H100 against the split pipeline in one
/// process, MODEL1 `h_q` 128 (`topk` 1024): +4% at s_kv 8K, -0.6 / -1.2% at 32K, -1.5 / -2.9% at 64K
/// (two machines). With one head group per token (`h_q <= 64`) it measured 2% slower at 8K.
pub const ALTERNATING_MAX_KV_BYTES: u64 = 16 << 20;

/// The same limit at `d_qk` 576, where the RoPE column group, read first by QK, gives the stage's
/// refill more cover. V3.2 shape (`topk` 2048), two machines: +5% at s_kv 8K, +5 / +1.5% at 32K,
/// +3 / +1% at 48K (54 MiB), +2.2 / -0.6% at 64K (72 MiB), 0 / -2.2% at 128K.
pub const ALTERNATING_MAX_KV_BYTES_D576: u64 = 64 << 20;

/// KV tensors larger than this make the alternating pipeline prefetch whole rows into L2 a tile
/// ahead ([`FLAG_PREFETCH_ROWS`]); smaller ones make it prefetch nothing. Measured on H100 in one
/// process, V3.2 shape, no prefetch against whole rows: +4.4% at s_kv 8K, +0.6% at 12K, equal at
/// 16K (18 MiB at `d_qk` 576), -1.5% at 20K / 24K, -2.7% at 32K.
pub const PREFETCH_ROWS_MIN_KV_BYTES: u64 = 16 << 20;

/// Cluster dimensions of the launch: with two head groups per token (`h_q > 64`), the token's two
/// CTAs (adjacent block indices) form a 2-CTA cluster, so the hardware starts them together on one
/// GPC and the second gather of each KV row finds the line the first one brought into L2 nearby.
/// The kernel does not use the cluster otherwise (no distributed shared memory, no cluster
/// barrier). Measured on H100 in one process, V3.2 random, full clock: +0.2% at s_kv 8K, +1.0% at
/// 32K, +1.1% at 64K, +1.6% at 128K (`docs/perf-log.md`, 2026-11-25).
pub fn token_cluster_for(num_head_groups: usize) -> Option<(u32, u32, u32)> {
    (num_head_groups == 2).then_some((2, 1, 1))
}

fn kv_bytes(s_kv: usize, d_qk: usize) -> u64 {
    (s_kv as u64).saturating_mul(d_qk as u64 * 2)
}

/// The pipeline the heuristic picks (see [`ALTERNATING_MAX_KV_BYTES`],
/// [`ALTERNATING_MAX_KV_BYTES_D576`]). Example: V3.2 (`d_qk` 576, `h_q` 128) at s_kv 32768: 36 MiB of
/// KV, at most 64 MiB, so alternating; at s_kv 65536 (72 MiB) split.
pub fn pipeline_for(s_kv: usize, d_qk: usize, h_q: usize) -> SparseFwdPipeline {
    let max = if d_qk == 576 {
        ALTERNATING_MAX_KV_BYTES_D576
    } else {
        ALTERNATING_MAX_KV_BYTES
    };
    if kv_bytes(s_kv, d_qk) <= max && h_q > HEADS_PER_CTA {
        SparseFwdPipeline::Alternating
    } else {
        SparseFwdPipeline::Split
    }
}

/// Whether the heuristic makes the alternating pipeline prefetch whole rows (see
/// [`PREFETCH_ROWS_MIN_KV_BYTES`]); the split pipeline ignores the flag.
pub fn prefetch_rows_for(s_kv: usize, d_qk: usize) -> bool {
    kv_bytes(s_kv, d_qk) > PREFETCH_ROWS_MIN_KV_BYTES
}

/// The launch choices for a call (pure): each field of `tuning` that is set, else the heuristic.
pub fn choose(dims: &SparseFwdDims, tuning: &SparseFwdTuning) -> SparseFwdChoice {
    let num_head_groups = dims.h_q.div_ceil(HEADS_PER_CTA);
    SparseFwdChoice {
        pipeline: tuning
            .pipeline
            .unwrap_or_else(|| pipeline_for(dims.s_kv, dims.d_qk, dims.h_q)),
        prefetch_rows: match tuning.prefetch {
            Some(SparseFwdPrefetch::Rows) => true,
            Some(SparseFwdPrefetch::Off) => false,
            None => prefetch_rows_for(dims.s_kv, dims.d_qk),
        },
        cluster: match tuning.cluster {
            Some(false) => None,
            Some(true) | None => token_cluster_for(num_head_groups),
        },
    }
}

/// Checks the kernel's limits and builds its parameters and launch geometry with the choices of
/// [`choose`] (pure: no GPU needed). Returns `None` when there is nothing to launch (`s_q = 0`).
pub fn lower(
    dims: &SparseFwdDims,
    args: &SparseFwdArgs<'_, DeviceView>,
    out: &SparseFwdOutput<DeviceView>,
    tuning: &SparseFwdTuning,
) -> Result<Option<(&'static str, LaunchConfig, SparseFwdParams)>> {
    let choice = choose(dims, tuning);
    let (kernel, smem) = kernel_for(dims.d_qk, choice.pipeline)?;
    if dims.h_q > MAX_HEADS {
        return Err(Error::unsupported(
            format!("sparse_fwd on the GPU with h_q = {}", dims.h_q),
            format!("the sm_90a kernel serves h_q 1..={MAX_HEADS}"),
        ));
    }
    if dims.topk > i32::MAX as usize - TILE_ROWS {
        return Err(Error::invalid(
            "indices.shape[2]",
            format!(
                "topk <= {} (the kernel counts entries in i32)",
                i32::MAX as usize - TILE_ROWS
            ),
            dims.topk,
        ));
    }
    expect_rows_16b("sparse_fwd", &[("q", args.q), ("kv", args.kv)])?;
    expect_element_aligned(&[
        ("indices", Some(args.indices)),
        ("topk_length", args.topk_length),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("max_logits", Some(&out.max_logits)),
        ("lse", Some(&out.lse)),
    ])?;
    expect_offsets_fit_i64(&[
        ("q", Some(args.q)),
        ("kv", Some(args.kv)),
        ("indices", Some(args.indices)),
        ("topk_length", args.topk_length),
        ("attn_sink", args.attn_sink),
        ("out", Some(&out.out)),
        ("max_logits", Some(&out.max_logits)),
        ("lse", Some(&out.lse)),
    ])?;
    let sm_scale_log2 = args.sm_scale * LOG2_E;
    if !sm_scale_log2.is_finite() {
        return Err(Error::invalid(
            "sm_scale",
            "a value whose product with log2(e) is finite",
            args.sm_scale,
        ));
    }
    if dims.s_q == 0 {
        return Ok(None);
    }
    let num_head_groups = dims.h_q.div_ceil(HEADS_PER_CTA);
    let ctas = dims
        .s_q
        .checked_mul(num_head_groups)
        .filter(|&n| n <= MAX_GRID_X)
        .ok_or_else(|| {
            Error::invalid(
                "q.shape[0]",
                format!("s_q * ceil(h_q / 64) <= {MAX_GRID_X} (one CTA per token and head group)"),
                dims.s_q,
            )
        })?;

    let opt_ptr = |t: Option<&DeviceView>| t.map_or(0, DeviceView::ptr);
    let opt_stride =
        |arg: &str, t: Option<&DeviceView>| t.map_or(Ok(0), |t| stride_param(arg, t, 0));
    let params = SparseFwdParams {
        q: args.q.ptr(),
        kv: args.kv.ptr(),
        indices: args.indices.ptr(),
        topk_length: opt_ptr(args.topk_length),
        attn_sink: opt_ptr(args.attn_sink),
        out: out.out.ptr(),
        max_logits: out.max_logits.ptr(),
        lse: out.lse.ptr(),
        q_stride_t: stride_param("q", args.q, 0)?,
        q_stride_h: stride_param("q", args.q, 1)?,
        kv_stride_t: stride_param("kv", args.kv, 0)?,
        indices_stride_t: stride_param("indices", args.indices, 0)?,
        topk_length_stride: opt_stride("topk_length", args.topk_length)?,
        attn_sink_stride: opt_stride("attn_sink", args.attn_sink)?,
        out_stride_t: stride_param("out", &out.out, 0)?,
        out_stride_h: stride_param("out", &out.out, 1)?,
        max_logits_stride_t: stride_param("max_logits", &out.max_logits, 0)?,
        max_logits_stride_h: stride_param("max_logits", &out.max_logits, 1)?,
        lse_stride_t: stride_param("lse", &out.lse, 0)?,
        lse_stride_h: stride_param("lse", &out.lse, 1)?,
        s_q: to_i32("q.shape[0]", dims.s_q)?,
        s_kv: i32::try_from(dims.s_kv).unwrap_or(i32::MAX),
        h_q: to_i32("q.shape[1]", dims.h_q)?,
        topk: to_i32("indices.shape[2]", dims.topk)?,
        num_head_groups: to_i32("ceil(h_q / 64)", num_head_groups)?,
        flags: (if rows_aligned(&out.out, CHUNK_ALIGN_BYTES) {
            FLAG_OUT_VEC16
        } else {
            0
        }) | if choice.prefetch_rows {
            FLAG_PREFETCH_ROWS
        } else {
            0
        },
        sm_scale_log2,
        reserved: 0,
    };
    let cfg = LaunchConfig {
        grid: (ctas as u32, 1, 1),
        block: (THREADS_PER_CTA, 1, 1),
        shared_mem_bytes: smem,
        cluster: choice.cluster,
        programmatic: false,
    };
    Ok(Some((kernel, cfg, params)))
}

/// Launches the forward on `gpu`'s stream for arguments that passed [`super::validate`] and outputs
/// that passed [`super::validate_output`] (`dims` is what `validate` returned). Asynchronous:
/// synchronise or download to wait. Errors: [`Error::Unsupported`] / [`Error::InvalidArgument`] for
/// the kernel limits in the [module docs](self), a tensor on another device, and [`Error::Cuda`]
/// from the launch.
pub(crate) fn launch(
    gpu: &Gpu,
    dims: &SparseFwdDims,
    args: &SparseFwdArgs<'_, DeviceView>,
    out: &SparseFwdOutput<DeviceView>,
    tuning: &SparseFwdTuning,
) -> Result<()> {
    let device = Location::Cuda(gpu.ordinal());
    expect_location("q", args.q, device)?;
    let Some((name, cfg, params)) = lower(dims, args, out, tuning)? else {
        return Ok(());
    };
    debug_assert_eq!(args.q.dtype(), DType::Bf16);
    let kernel = gpu.kernel(FAMILY, name)?;
    // SAFETY: `SparseFwdParams` mirrors the kernel's parameter struct (checked at compile time).
    // `validate`/`validate_output` established the shapes and dtypes the params describe and that
    // every tensor lives on this device; `lower` checked alignment and that every offset fits i64.
    // The kernel reads q rows of its token and head group, kv rows only at indices in 0..s_kv,
    // index entries below topk (or topk_length), and writes out/max_logits/lse rows of its token
    // and heads < h_q: all inside the views, which by the DeviceView contract are valid, live and
    // do not alias outputs with inputs.
    unsafe { gpu.launch(&kernel, &cfg, &params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7f00_0000_0000;
    const DEFAULT: SparseFwdTuning = SparseFwdTuning {
        pipeline: None,
        prefetch: None,
        cluster: None,
    };

    use crate::ops::layout::fake_view as view;

    struct Case {
        q: DeviceView,
        kv: DeviceView,
        indices: DeviceView,
        out: SparseFwdOutput<DeviceView>,
        dims: SparseFwdDims,
    }

    fn case(s_q: usize, h_q: usize, d_qk: usize, s_kv: usize, topk: usize) -> Case {
        let dims = SparseFwdDims {
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
            q: view(BASE, DType::Bf16, &[s_q, h_q, d_qk], None),
            kv: view(BASE + (1 << 32), DType::Bf16, &[s_kv, 1, d_qk], None),
            indices: view(BASE + (2 << 32), DType::I32, &[s_q, 1, topk], None),
            out: SparseFwdOutput {
                out: view(BASE + (3 << 32), DType::Bf16, &[s_q, h_q, 512], None),
                max_logits: view(BASE + (4 << 32), DType::F32, &[s_q, h_q], None),
                lse: view(BASE + (5 << 32), DType::F32, &[s_q, h_q], None),
            },
            dims,
        }
    }

    fn args(c: &Case) -> SparseFwdArgs<'_, DeviceView> {
        SparseFwdArgs {
            q: &c.q,
            kv: &c.kv,
            indices: &c.indices,
            sm_scale: 0.1,
            attn_sink: None,
            topk_length: None,
        }
    }

    #[test]
    fn lowers_the_v32_shape() {
        let c = case(4096, 128, 576, 32768, 2048);
        let (name, cfg, p) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(name, "sparse_fwd_alt_d576");
        assert_eq!(cfg.grid, (8192, 1, 1));
        assert_eq!(cfg.cluster, Some((2, 1, 1)));
        assert_eq!(cfg.block, (384, 1, 1));
        assert_eq!(cfg.shared_mem_bytes, SMEM_BYTES_D576);
        assert_eq!(
            (p.q_stride_t, p.q_stride_h, p.kv_stride_t),
            (128 * 576, 576, 576)
        );
        assert_eq!((p.out_stride_t, p.out_stride_h), (128 * 512, 512));
        assert_eq!(
            (p.num_head_groups, p.flags, p.topk_length, p.attn_sink),
            (2, FLAG_OUT_VEC16 | FLAG_PREFETCH_ROWS, 0, 0)
        );
        assert!((p.sm_scale_log2 - 0.1 * LOG2_E).abs() < 1e-7);
    }

    #[test]
    fn only_two_head_groups_launch_as_clusters() {
        assert_eq!(token_cluster_for(1), None);
        assert_eq!(token_cluster_for(2), Some((2, 1, 1)));
        for h_q in [1, 64, 65, 100, 128] {
            let c = case(3, h_q, 512, 300, 100);
            let (_, cfg, _) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
                .unwrap()
                .unwrap();
            let groups = h_q.div_ceil(HEADS_PER_CTA) as u32;
            assert_eq!(cfg.grid, (3 * groups, 1, 1), "h_q {h_q}");
            // A cluster must divide the grid: two head groups make every grid even.
            assert_eq!(cfg.cluster.is_some(), groups == 2, "h_q {h_q}");
        }
    }

    #[test]
    fn row_prefetch_starts_beyond_16_mib_of_kv() {
        assert!(!prefetch_rows_for(14563, 576));
        assert!(prefetch_rows_for(14564, 576));
        assert!(!prefetch_rows_for(16384, 512));
        assert!(prefetch_rows_for(16385, 512));
        assert!(prefetch_rows_for(usize::MAX, 576));
    }

    #[test]
    fn short_contexts_take_the_alternating_pipeline() {
        use SparseFwdPipeline::{Alternating, Split};
        assert_eq!(pipeline_for(8192, 576, 128), Alternating);
        assert_eq!(pipeline_for(49152, 576, 65), Alternating);
        assert_eq!(pipeline_for(58254, 576, 128), Alternating);
        assert_eq!(pipeline_for(58255, 576, 128), Split);
        assert_eq!(pipeline_for(65536, 576, 128), Split);
        assert_eq!(pipeline_for(16384, 512, 128), Alternating);
        assert_eq!(pipeline_for(16385, 512, 128), Split);
        assert_eq!(pipeline_for(8192, 512, 64), Split);
        assert_eq!(pipeline_for(usize::MAX, 512, 128), Split);
        let c = case(4096, 128, 576, 8192, 2048);
        let (name, cfg, _) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(
            (name, cfg.shared_mem_bytes),
            ("sparse_fwd_alt_d576", SMEM_BYTES_D576)
        );
        assert_eq!(
            kernel_for(512, SparseFwdPipeline::Split).unwrap(),
            ("sparse_fwd_d512", SMEM_BYTES_D512)
        );
    }

    #[test]
    fn each_tuning_field_replaces_its_heuristic_alone() {
        use SparseFwdPipeline::{Alternating, Split};
        // V3.2 at s_kv 32K: the heuristic takes the alternating pipeline, prefetches rows (36 MiB of KV)
        // and clusters the two head groups.
        let d = case(4, 128, 576, 32768, 64).dims;
        let auto = choose(&d, &DEFAULT);
        assert_eq!(
            auto,
            SparseFwdChoice {
                pipeline: Alternating,
                prefetch_rows: true,
                cluster: Some((2, 1, 1)),
            }
        );
        let with = |t: SparseFwdTuning| choose(&d, &t);
        let split = with(SparseFwdTuning {
            pipeline: Some(Split),
            ..DEFAULT
        });
        assert_eq!(
            split,
            SparseFwdChoice {
                pipeline: Split,
                ..auto
            }
        );
        let no_prefetch = with(SparseFwdTuning {
            prefetch: Some(SparseFwdPrefetch::Off),
            ..DEFAULT
        });
        assert_eq!(
            no_prefetch,
            SparseFwdChoice {
                prefetch_rows: false,
                ..auto
            }
        );
        let no_cluster = with(SparseFwdTuning {
            cluster: Some(false),
            ..DEFAULT
        });
        assert_eq!(
            no_cluster,
            SparseFwdChoice {
                cluster: None,
                ..auto
            }
        );
        // Settings equal to the heuristic's choice change nothing.
        let same = SparseFwdTuning {
            pipeline: Some(Alternating),
            prefetch: Some(SparseFwdPrefetch::Rows),
            cluster: Some(true),
        };
        assert_eq!(with(same), auto);
        // One head group at s_kv 8K: the heuristic takes split, no prefetch, no cluster; forcing the
        // alternating pipeline and row prefetch works, a cluster cannot be forced.
        let d = case(4, 64, 576, 8192, 64).dims;
        assert_eq!(
            choose(&d, &DEFAULT),
            SparseFwdChoice {
                pipeline: Split,
                prefetch_rows: false,
                cluster: None,
            }
        );
        let forced = SparseFwdTuning {
            pipeline: Some(Alternating),
            prefetch: Some(SparseFwdPrefetch::Rows),
            cluster: Some(true),
        };
        assert_eq!(
            choose(&d, &forced),
            SparseFwdChoice {
                pipeline: Alternating,
                prefetch_rows: true,
                cluster: None,
            }
        );
    }

    #[test]
    fn lower_applies_the_tuning() {
        let c = case(4096, 128, 576, 131072, 2048);
        let (name, cfg, p) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(name, kernels::SPLIT_D576);
        assert_eq!(cfg.cluster, Some((2, 1, 1)));
        assert_eq!(p.flags, FLAG_OUT_VEC16 | FLAG_PREFETCH_ROWS);
        let tuning = SparseFwdTuning {
            pipeline: Some(SparseFwdPipeline::Alternating),
            prefetch: Some(SparseFwdPrefetch::Off),
            cluster: Some(false),
        };
        let (name, cfg, p) = lower(&c.dims, &args(&c), &c.out, &tuning).unwrap().unwrap();
        assert_eq!(name, kernels::ALT_D576);
        assert_eq!(cfg.cluster, None);
        assert_eq!(p.flags, FLAG_OUT_VEC16);
        // The grid and the shared memory do not depend on the choices.
        assert_eq!(cfg.grid, (8192, 1, 1));
        assert_eq!(cfg.shared_mem_bytes, SMEM_BYTES_D576);
    }

    #[test]
    fn kernel_for_names_exactly_the_listed_kernels() {
        let mut named = Vec::new();
        for d_qk in [512, 576] {
            for pipeline in [SparseFwdPipeline::Split, SparseFwdPipeline::Alternating] {
                named.push(kernel_for(d_qk, pipeline).unwrap().0);
            }
        }
        named.sort();
        let mut all = kernels::ALL.to_vec();
        all.sort();
        assert_eq!(named, all);
        assert!(kernel_for(448, SparseFwdPipeline::Split).is_err());
    }

    #[test]
    fn odd_head_counts_round_up_to_groups_of_64() {
        for (h_q, groups) in [(1, 1), (64, 1), (65, 2), (100, 2), (128, 2)] {
            let c = case(3, h_q, 512, 10, 7);
            let (name, cfg, p) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
                .unwrap()
                .unwrap();
            let want = if h_q > 64 {
                "sparse_fwd_alt_d512"
            } else {
                "sparse_fwd_d512"
            };
            assert_eq!(name, want);
            assert_eq!(
                (cfg.grid.0, p.num_head_groups),
                (3 * groups, groups as i32),
                "h_q {h_q}"
            );
        }
        let c = case(3, 129, 576, 10, 7);
        assert!(matches!(
            lower(&c.dims, &args(&c), &c.out, &DEFAULT),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn empty_query_launches_nothing_and_long_sequences_stay_on_grid_x() {
        let c = case(0, 128, 576, 10, 7);
        assert!(lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .is_none());
        let c = case(200_000, 128, 576, 10, 7);
        let (_, cfg, _) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(cfg.grid, (400_000, 1, 1));
    }

    #[test]
    fn gather_needs_16_byte_rows_and_output_falls_back_to_scalar_stores() {
        let mut c = case(5, 64, 576, 100, 64);
        // Padded strides that stay multiples of 8 elements (the spec's adversarial layout) are
        // fine.
        c.q = view(BASE, DType::Bf16, &[5, 64, 576], Some(&[65 * 704, 704, 1]));
        c.kv = view(
            BASE + (1 << 32),
            DType::Bf16,
            &[100, 1, 576],
            Some(&[1408, 704, 1]),
        );
        c.out.out = view(
            BASE + (3 << 32),
            DType::Bf16,
            &[5, 64, 512],
            Some(&[65 * 640, 640, 1]),
        );
        let (_, _, p) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(
            (p.q_stride_t, p.q_stride_h, p.kv_stride_t),
            (65 * 704, 704, 1408)
        );
        assert_eq!(p.flags, FLAG_OUT_VEC16);
        // A row stride that is not a multiple of 8 elements cannot be gathered in 16-byte chunks.
        let mut bad = case(5, 64, 576, 100, 64);
        bad.kv = view(
            BASE + (1 << 32),
            DType::Bf16,
            &[100, 1, 576],
            Some(&[577, 577, 1]),
        );
        let err = lower(&bad.dims, &args(&bad), &bad.out, &DEFAULT).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { ref what, .. } if what.contains("`kv`")),
            "{err:?}"
        );
        let mut bad = case(5, 64, 576, 100, 64);
        bad.q = view(BASE + 2, DType::Bf16, &[5, 64, 576], None);
        assert!(matches!(
            lower(&bad.dims, &args(&bad), &bad.out, &DEFAULT),
            Err(Error::Unsupported { .. })
        ));
        // An odd output stride only disables the vector stores.
        let mut odd = case(5, 64, 576, 100, 64);
        odd.out.out = view(
            BASE + (3 << 32),
            DType::Bf16,
            &[5, 64, 512],
            Some(&[64 * 513, 513, 1]),
        );
        let (_, _, p) = lower(&odd.dims, &args(&odd), &odd.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(p.flags, 0);
        // Size-1 dimensions may carry any stride.
        let mut one = case(1, 64, 576, 1, 64);
        one.kv = view(
            BASE + (1 << 32),
            DType::Bf16,
            &[1, 1, 576],
            Some(&[3, 5, 1]),
        );
        assert!(lower(&one.dims, &args(&one), &one.out, &DEFAULT).is_ok());
    }

    #[test]
    fn optional_tensors_are_passed_with_their_strides() {
        let c = case(6, 128, 576, 100, 64);
        let sink = view(BASE + (6 << 32), DType::F32, &[128], Some(&[2]));
        let len = view(BASE + (7 << 32), DType::I32, &[6], Some(&[3]));
        let mut a = args(&c);
        a.attn_sink = Some(&sink);
        a.topk_length = Some(&len);
        let (_, _, p) = lower(&c.dims, &a, &c.out, &DEFAULT).unwrap().unwrap();
        assert_eq!((p.attn_sink, p.attn_sink_stride), (BASE + (6 << 32), 2));
        assert_eq!((p.topk_length, p.topk_length_stride), (BASE + (7 << 32), 3));
        let misaligned = view(BASE + (6 << 32) + 2, DType::F32, &[128], None);
        a.attn_sink = Some(&misaligned);
        assert_eq!(
            lower(&c.dims, &a, &c.out, &DEFAULT).unwrap_err().arg(),
            Some("attn_sink.data_ptr")
        );
    }

    #[test]
    fn huge_s_kv_is_clamped_and_huge_topk_rejected() {
        let c = case(2, 64, 512, 3_000_000_000, 64);
        let (_, _, p) = lower(&c.dims, &args(&c), &c.out, &DEFAULT)
            .unwrap()
            .unwrap();
        assert_eq!(p.s_kv, i32::MAX);
        let mut big = case(2, 64, 512, 10, 64);
        big.dims.topk = i32::MAX as usize;
        assert_eq!(
            lower(&big.dims, &args(&big), &big.out, &DEFAULT)
                .unwrap_err()
                .arg(),
            Some("indices.shape[2]")
        );
    }
}
