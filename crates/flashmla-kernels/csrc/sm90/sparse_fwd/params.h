// Parameters of the sparse MLA prefill forward kernels. Mirrored field by field by
// `crates/flashmla/src/ops/sparse_fwd/launch.rs` (`SparseFwdParams`, #[repr(C)]). The layout is checked by machine:
// build.rs lays out every struct of this header with the host compiler, and the Rust mirror (`device_params!`) fails
// to compile unless every field has the same name, offset and size and the struct the same size
// (docs/gpu-plumbing.md, "Host/device contract").
//
// Shapes use spec names. Strides are in elements (not bytes), last dimensions are contiguous (stride 1, not
// stored). All strides are i64: the host checked that every reachable offset fits. q, kv rows and (when
// kFlagOutVec16 is set) out rows are 16-byte aligned; the host checked that too.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmla::sparse_fwd {

// `flags` bits.
inline constexpr uint32_t kFlagOutVec16 = 1u << 0;  // out base and strides allow 16-byte row-chunk stores
// Alternating pipeline: the producer prefetches the value columns (slabs 0..7) of every row of tile i into L2 about a
// tile before gathering it (set by the host for KV tensors beyond L2 reach); without the flag it prefetches nothing.
// The split pipeline ignores the flag and always prefetches its right column group.
inline constexpr uint32_t kFlagPrefetchRows = 1u << 1;

struct SparseFwdParams {
    const uint16_t* q;            // [s_q, h_q, d_qk] bf16; strides (q_stride_t, q_stride_h, 1)
    const uint16_t* kv;           // [s_kv, 1, d_qk] bf16; row stride kv_stride_t (V = first 512 columns)
    const int32_t* indices;       // [s_q, 1, topk] i32; stride indices_stride_t over tokens, last dim contiguous
    const int32_t* topk_length;   // [s_q] i32, stride topk_length_stride; nullptr: every row uses all topk entries
    const float* attn_sink;       // [h_q] f32, stride attn_sink_stride; nullptr: no sink
    uint16_t* out;                // [s_q, h_q, d_v] bf16; strides (out_stride_t, out_stride_h, 1)
    float* max_logits;            // [s_q, h_q] f32; strides (max_logits_stride_t, max_logits_stride_h)
    float* lse;                   // [s_q, h_q] f32 (natural log); strides (lse_stride_t, lse_stride_h)

    int64_t q_stride_t;
    int64_t q_stride_h;
    int64_t kv_stride_t;
    int64_t indices_stride_t;
    int64_t topk_length_stride;
    int64_t attn_sink_stride;
    int64_t out_stride_t;
    int64_t out_stride_h;
    int64_t max_logits_stride_t;
    int64_t max_logits_stride_h;
    int64_t lse_stride_t;
    int64_t lse_stride_h;

    int32_t s_q;
    int32_t s_kv;                 // an index i is valid iff 0 <= i < s_kv
    int32_t h_q;                  // 1..=128
    int32_t topk;                 // >= 1
    int32_t num_head_groups;      // ceil(h_q / 64); grid.x = s_q * num_head_groups
    uint32_t flags;               // kFlag* bits
    float sm_scale_log2;          // sm_scale * log2(e): logits are kept in base 2 inside the kernel
    int32_t reserved;             // keeps the size a multiple of 8; always 0
};

}  // namespace flashmla::sparse_fwd
