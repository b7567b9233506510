// Parameters of the MLA decode family (docs/spec.md section 4), dense (bf16/f16 paged cache) and sparse (FP8 cache
// addressed by indices): the schedule, split and combine kernels share one struct. Mirrored field by field by
// `crates/flashmla/src/ops/decode/launch.rs` (`DecodeParams`, declared with `device_params!`, which build.rs checks
// against this header's layout as the compiler sees it).
//
// The schedule's unit is a "request": dense, one batch entry (its s_q query tokens share the keys); sparse, one query
// token (b, s) = (req / req_tokens, req % req_tokens), since every token has its own indices. A request's query rows
// are (token, head) pairs of one key head; tensors are addressed at request `req` by (req / req_tokens) * stride_b +
// (req % req_tokens) * stride_s (dense: req_tokens = 1).
//
// Strides are in elements, except the FP8 caches' block strides (bytes); last dimensions are contiguous (stride 1,
// not stored). The host checked that every reachable offset fits i64, that q and dense k_cache rows are 16-byte
// aligned (FP8 caches: base and block stride), and that the schedule's line fits i32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/tensor_map.h"

namespace flashmla::decode {

// `flags` bits.
inline constexpr uint32_t kFlagCausal = 1u << 0;     // bottom-right causal mask (only set when s_q > 1)
inline constexpr uint32_t kFlagOutVec4 = 1u << 1;    // out base and strides allow 4-byte (2-element) stores
inline constexpr uint32_t kFlagSparse = 1u << 2;     // sparse FP8 decode: keys come from indices, not the block table
inline constexpr uint32_t kFlagOutBulk = 1u << 4;    // out rows are 16-byte aligned: final halves go out as bulk stores
inline constexpr uint32_t kFlagKTma = 1u << 5;       // dense: k_tmap describes k_cache; whole key tiles load by TMA
inline constexpr uint32_t kFlagUniformLine = 1u << 6;  // sparse without length tensors: every request has the same
                                                       // segment, the line is b * segment (schedule.cuh)
inline constexpr uint32_t kFlagCopy8 = 1u << 3;      // sparse: a cache is only 8-byte aligned (base or block stride):
                                                     // copy its rows in 8-byte pieces
inline constexpr uint32_t kFlagInlineSchedule = 1u << 7;  // no schedule kernel: every split CTA derives the schedule
                                                          // (batch <= kInlineScheduleMaxBatch; schedule.cuh)
inline constexpr uint32_t kFlagCombineByPart = 1u << 8;  // the combine's grid x runs over part boundaries, not
                                                         // requests (kernel.cuh, decode_combine)

// Words of the schedule workspace after the `batch + 1` line starts: the budget (line units per part) and the
// number of parts the line is cut into.
inline constexpr int kScheduleTail = 2;

// kFlagInlineSchedule: at most four requests per lane of one warp, and the words of each split CTA's own copy of the
// schedule in shared memory (SmemPlan::sched): kInlineScheduleMaxBatch + 1 + kScheduleTail, padded to 16 bytes.
inline constexpr int kInlineScheduleMaxBatch = 128;
inline constexpr int kInlineScheduleWords = 132;
static_assert(kInlineScheduleMaxBatch % 32 == 0, "whole rounds of one request per lane");
// launch.rs decides when the schedule is inline with INLINE_SCHEDULE_MAX_BATCH; keep both in step.
static_assert(kInlineScheduleMaxBatch == 128, "update launch.rs INLINE_SCHEDULE_MAX_BATCH");
static_assert(kInlineScheduleWords >= kInlineScheduleMaxBatch + 1 + kScheduleTail && kInlineScheduleWords % 4 == 0,
              "a CTA's schedule copy holds the line starts, the end and the tail, 16-byte aligned");

struct DecodeParams {
    TensorMapBytes k_tmap;          // dense, kFlagKTma: rank-4 tiled map of k_cache, dims (d_qk, h_kv, page_size,
                                    // num_blocks), box 64 x 1 x 64 x 1 (one 64-column slab of 64 keys), 128B swizzle
    const uint16_t* q;              // [b, s_q, h_q, d_qk] bf16/f16; strides (q_stride_b, q_stride_s, q_stride_h, 1)
    const uint16_t* k_cache;        // dense: [num_blocks, page_size, h_kv, d_qk]; strides (k_stride_block,
                                    // k_stride_tok, k_stride_head, 1); V = the first 512 columns of a key row.
                                    // sparse: the FP8 cache's bytes (docs/spec.md section 3), block stride
                                    // k_stride_block in bytes
    const int32_t* block_table;     // dense: [b, max_blocks]; strides (block_table_stride_b, 1)
    const int32_t* cache_seqlens;   // dense: [b]; stride cache_seqlens_stride
    const int32_t* indices;         // sparse: [b, s_q, topk]; strides (indices_stride_b, indices_stride_s, 1)
    const int32_t* topk_length;     // sparse: [b]; stride topk_length_stride; nullptr: topk entries
    const uint8_t* extra_cache;     // sparse: the extra FP8 cache (same format), block stride extra_stride_block
                                    // bytes; nullptr: none
    const int32_t* extra_indices;   // sparse: [b, s_q, extra_topk]; strides (extra_indices_stride_b, _s, 1)
    const int32_t* extra_topk_length;  // sparse: [b]; stride extra_topk_length_stride; nullptr: extra_topk
    const float* attn_sink;         // [h_q]; stride attn_sink_stride; nullptr: no sink
    uint16_t* out;                  // [b, s_q, h_q, 512] (q's dtype); strides (out_stride_b, out_stride_s,
                                    // out_stride_h, 1)
    float* lse;                     // [b, h_q, s_q] f32, natural log; strides (lse_stride_b, lse_stride_h,
                                    // lse_stride_s)
    int32_t* schedule;              // workspace [batch + 1 + kScheduleTail]: line start of every request, the
                                    // line's end, then budget and number of parts (written by decode_schedule, or
                                    // with kFlagInlineSchedule by split CTA (0, 0), for the combine; every split
                                    // CTA then keeps its own copy in shared memory, SmemPlan::sched)
    float* part_o;                  // workspace [2 * max_parts][head_tiles][64][512] f32: normalised partial outputs
    float* part_lse;                // workspace [2 * max_parts][head_tiles][64] f32: their natural-log lse

    int64_t q_stride_b;
    int64_t q_stride_s;
    int64_t q_stride_h;
    int64_t k_stride_block;
    int64_t k_stride_tok;
    int64_t k_stride_head;
    int64_t block_table_stride_b;
    int64_t cache_seqlens_stride;
    int64_t attn_sink_stride;
    int64_t indices_stride_b;
    int64_t indices_stride_s;
    int64_t topk_length_stride;
    int64_t extra_stride_block;
    int64_t extra_indices_stride_b;
    int64_t extra_indices_stride_s;
    int64_t extra_topk_length_stride;
    int64_t out_stride_b;
    int64_t out_stride_s;
    int64_t out_stride_h;
    int64_t lse_stride_b;
    int64_t lse_stride_h;
    int64_t lse_stride_s;

    int32_t batch;                  // requests >= 1 (dense: b; sparse: b * s_q)
    int32_t s_q;                    // query tokens per request (sparse: 1)
    int32_t req_tokens;             // query tokens per batch entry a request stands for: dense 1, sparse s_q
    int32_t h_q;                    // query heads
    int32_t h_kv;                   // key heads; h_q % h_kv == 0
    int32_t heads_per_kv;           // h_q / h_kv
    int32_t rows;                   // query rows per (request, key head): s_q * heads_per_kv, row r = (r / hpk, r % hpk)
    int32_t row_tiles;              // ceil(rows / 64)
    int32_t head_tiles;             // h_kv * row_tiles = gridDim.x of the split kernel
    int32_t num_blocks;             // blocks in k_cache: a block id outside 0..num_blocks is a missing key
    int32_t page_size;              // tokens per block
    int32_t max_blocks;             // dense: columns of block_table; cache_seqlens are clamped to 0..max_blocks *
                                    // page_size
    int32_t topk;                   // sparse: entries per index row (topk_length is clamped to 0..topk)
    int32_t extra_topk;             // sparse: entries per extra index row (0: no extra cache)
    int32_t extra_num_blocks;       // sparse: blocks of the extra cache
    int32_t extra_page_size;        // sparse: tokens per extra block
    int32_t grid_parts;             // gridDim.y of the split kernel: the balanced schedule cuts the line into this many
    int32_t max_parts;              // bound on the schedule's number of parts (sizes part_o / part_lse)
    int32_t chunk_overhead;         // line units a request costs beyond its key tiles (>= 1)
    int32_t fixed_budget;           // 0: balanced schedule; > 0: batch-invariant schedule with this budget
    int32_t max_request_parts;      // balanced schedule: most parts one request is split over (0: no bound) ...
    int32_t max_budget_floor;       // ... while its parts hold at most this many units (0: always)
    uint32_t flags;                 // kFlag* bits
    float sm_scale_log2;            // softmax_scale * log2(e)
    // n / d by a multiply and a shift for 0 <= n < 2^31 (fast_div, schedule.cuh; the host's `divider`): of
    // req_tokens, heads_per_kv, row_tiles, page_size and extra_page_size. mul 0 stands for d = 1.
    uint32_t req_div_mul;
    uint32_t req_div_shr;
    uint32_t hpk_div_mul;
    uint32_t hpk_div_shr;
    uint32_t row_tiles_div_mul;
    uint32_t row_tiles_div_shr;
    uint32_t page_div_mul;
    uint32_t page_div_shr;
    uint32_t extra_page_div_mul;
    uint32_t extra_page_div_shr;
    int32_t tail[4];                // 0; pads the struct to its 64-byte alignment without implicit padding
};

}  // namespace flashmla::decode
