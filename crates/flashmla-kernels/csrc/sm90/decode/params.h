// Parameters of the dense MLA decode family (docs/spec.md section 4): the schedule, split and combine kernels share
// one struct. Mirrored field by field by `crates/flashmla/src/ops/decode/launch.rs` (`DenseDecodeParams`, declared
// with `device_params!`, which build.rs checks against this header's layout as the compiler sees it).
//
// Strides are in elements (bytes for nothing here), last dimensions are contiguous (stride 1, not stored). The host
// checked that every reachable offset fits i64, that q and k_cache rows are 16-byte aligned, and that the schedule's
// line fits i32 (see `line_bound` in launch.rs).
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmla::decode {

// `flags` bits.
inline constexpr uint32_t kFlagCausal = 1u << 0;     // bottom-right causal mask (only set when s_q > 1)
inline constexpr uint32_t kFlagOutVec4 = 1u << 1;    // out base and strides allow 4-byte (2-element) stores

// Words of the schedule workspace after the `batch + 1` line starts: the budget (line units per part) and the
// number of parts the line is cut into.
inline constexpr int kScheduleTail = 2;

struct DenseDecodeParams {
    const uint16_t* q;              // [b, s_q, h_q, d_qk] bf16/f16; strides (q_stride_b, q_stride_s, q_stride_h, 1)
    const uint16_t* k_cache;        // [num_blocks, page_size, h_kv, d_qk]; strides (k_stride_block, k_stride_tok,
                                    // k_stride_head, 1); V = the first 512 columns of a key row
    const int32_t* block_table;     // [b, max_blocks]; strides (block_table_stride_b, 1)
    const int32_t* cache_seqlens;   // [b]; stride cache_seqlens_stride
    const float* attn_sink;         // [h_q]; stride attn_sink_stride; nullptr: no sink
    uint16_t* out;                  // [b, s_q, h_q, 512] (q's dtype); strides (out_stride_b, out_stride_s,
                                    // out_stride_h, 1)
    float* lse;                     // [b, h_q, s_q] f32, natural log; strides (lse_stride_b, lse_stride_h,
                                    // lse_stride_s)
    int32_t* schedule;              // workspace [batch + 1 + kScheduleTail]: line start of every request, the
                                    // line's end, then budget and number of parts (written by decode_schedule)
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
    int64_t out_stride_b;
    int64_t out_stride_s;
    int64_t out_stride_h;
    int64_t lse_stride_b;
    int64_t lse_stride_h;
    int64_t lse_stride_s;

    int32_t batch;                  // requests b >= 1
    int32_t s_q;                    // query tokens per request
    int32_t h_q;                    // query heads
    int32_t h_kv;                   // key heads; h_q % h_kv == 0
    int32_t heads_per_kv;           // h_q / h_kv
    int32_t rows;                   // query rows per (request, key head): s_q * heads_per_kv, row r = (r / hpk, r % hpk)
    int32_t row_tiles;              // ceil(rows / 64)
    int32_t head_tiles;             // h_kv * row_tiles = gridDim.x of the split kernel
    int32_t num_blocks;             // blocks in k_cache: a block id outside 0..num_blocks is a missing key
    int32_t page_size;              // tokens per block
    int32_t max_blocks;             // columns of block_table; cache_seqlens are clamped to 0..max_blocks * page_size
    int32_t grid_parts;             // gridDim.y of the split kernel: the balanced schedule cuts the line into this many
    int32_t max_parts;              // bound on the schedule's number of parts (sizes part_o / part_lse)
    int32_t chunk_overhead;         // line units a request costs beyond its key tiles (>= 1)
    int32_t fixed_budget;           // 0: balanced schedule; > 0: batch-invariant schedule with this budget
    uint32_t flags;                 // kFlag* bits
    float sm_scale_log2;            // softmax_scale * log2(e)
    int32_t reserved;               // keeps the size a multiple of 8; always 0
};

}  // namespace flashmla::decode
