// Entry points of the dense decode family (docs/spec.md section 4), launched in this order on one stream by
// ops/decode/launch.rs:
//   decode_schedule                          grid (1), block (kScheduleThreads): the split-KV schedule
//   decode_split_{bf16,f16}_d{576,512}[_once] grid (head_tiles, grid_parts), block (kThreads = 384), dynamic shared
//   decode_split_fp8_{v32,model1}[_pair|_n16|_n32] memory kSmemBytes<d_qk> (config.cuh; mirrored in launch.rs)
//   decode_combine[2|4]_{bf16,f16}           grid (batch or parts, head_tiles,
//                                            ceil(rows of a tile / kCombineRowsPerCta)), block (kCombineThreads)
#include "common/grid_dep.cuh"
#include "sm90/decode/narrow.cuh"

using flashmla::Bf16;
using flashmla::F16;
using flashmla::decode::DecodeParams;
using flashmla::decode::kCombineThreads;
using flashmla::decode::kScheduleThreads;
using flashmla::decode::kThreads;

extern "C" __global__ void __launch_bounds__(kScheduleThreads, 1)
    decode_schedule(const __grid_constant__ DecodeParams p) {
    flashmla::grid_dep_launch_dependents();  // the split kernel's CTAs start now and wait for the schedule
    flashmla::decode::write_schedule(p);
}

#define FLASHMLA_DECODE_SPLIT(NAME, E, DQK, SPARSE, PAIR, ONCE)                               \
    extern "C" __global__ void __launch_bounds__(kThreads, 1)                                 \
        NAME(const __grid_constant__ DecodeParams p) {                                        \
        extern __shared__ __align__(1024) uint8_t smem[];                                     \
        flashmla::decode::decode_split<E, DQK, SPARSE, PAIR, ONCE>(p, smem);                  \
    }
FLASHMLA_DECODE_SPLIT(decode_split_bf16_d576, Bf16, 576, false, false, false)
FLASHMLA_DECODE_SPLIT(decode_split_bf16_d512, Bf16, 512, false, false, false)
FLASHMLA_DECODE_SPLIT(decode_split_f16_d576, F16, 576, false, false, false)
FLASHMLA_DECODE_SPLIT(decode_split_f16_d512, F16, 512, false, false, false)
// One row tile per key head (launch.rs picks): each key tile is read by one CTA, L2 evict-first.
FLASHMLA_DECODE_SPLIT(decode_split_bf16_d576_once, Bf16, 576, false, false, true)
FLASHMLA_DECODE_SPLIT(decode_split_bf16_d512_once, Bf16, 512, false, false, true)
FLASHMLA_DECODE_SPLIT(decode_split_f16_d576_once, F16, 576, false, false, true)
FLASHMLA_DECODE_SPLIT(decode_split_f16_d512_once, F16, 512, false, false, true)
// Sparse FP8 decode (bf16 q and out): V3.2 (656-byte tokens, d_qk 576) and MODEL1 (584-byte tokens, d_qk 512); one
// row tile per chunk, or (*_pair, two row tiles: h_q 65..128) a 2-CTA cluster whose producers each dequantise half
// of a tile's rows into both CTAs.
FLASHMLA_DECODE_SPLIT(decode_split_fp8_v32, Bf16, 576, true, false, false)
FLASHMLA_DECODE_SPLIT(decode_split_fp8_model1, Bf16, 512, true, false, false)
FLASHMLA_DECODE_SPLIT(decode_split_fp8_v32_pair, Bf16, 576, true, true, false)
FLASHMLA_DECODE_SPLIT(decode_split_fp8_model1_pair, Bf16, 512, true, true, false)
// Requests of at most 16 query rows (MODEL1: 32) over 16-byte aligned caches: the narrow decode (narrow.cuh:
// S^T = K Q^T with the query rows as N, raw rows streamed by bulk copies), block (kNarrowThreads = 512), dynamic
// shared memory kNarrowSmemBytes<d_qk, N> (launch.rs requests the 227 KB limit).
#define FLASHMLA_DECODE_NARROW(NAME, DQK, N)                                                  \
    extern "C" __global__ void __launch_bounds__(flashmla::decode::kNarrowThreads, 1)         \
        NAME(const __grid_constant__ DecodeParams p) {                                        \
        extern __shared__ __align__(1024) uint8_t smem[];                                     \
        flashmla::decode::decode_narrow<DQK, N>(p, smem);                                     \
    }
FLASHMLA_DECODE_NARROW(decode_split_fp8_v32_n16, 576, 16)
FLASHMLA_DECODE_NARROW(decode_split_fp8_model1_n16, 512, 16)
FLASHMLA_DECODE_NARROW(decode_split_fp8_model1_n32, 512, 32)

#define FLASHMLA_DECODE_COMBINE(NAME, E, WARPS_PER_ROW)                                      \
    extern "C" __global__ void __launch_bounds__(kCombineThreads)                            \
        NAME(const __grid_constant__ DecodeParams p) {                                       \
        flashmla::decode::decode_combine<E, WARPS_PER_ROW>(p);                               \
    }
// One, two or four warps per row (launch.rs picks from the rows of a tile and the batch).
FLASHMLA_DECODE_COMBINE(decode_combine_bf16, Bf16, 1)
FLASHMLA_DECODE_COMBINE(decode_combine_f16, F16, 1)
FLASHMLA_DECODE_COMBINE(decode_combine2_bf16, Bf16, 2)
FLASHMLA_DECODE_COMBINE(decode_combine2_f16, F16, 2)
FLASHMLA_DECODE_COMBINE(decode_combine4_bf16, Bf16, 4)
FLASHMLA_DECODE_COMBINE(decode_combine4_f16, F16, 4)
