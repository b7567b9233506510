// Parameters of the sparse MLA prefill backward family (docs/spec.md section 2). ONE struct for every kernel of the family
// (accumulator zeroing, main kernel, d_kv finalisation, sink gradient); each kernel reads the
// fields it needs. Mirrored field by field by `crates/flashmla/src/ops/sparse_bwd/launch.rs` (`SparseBwdParams`,
// #[repr(C)]). The layout is checked by machine: build.rs lays out every struct of this header with the host
// compiler, and the Rust mirror (`device_params!`) fails to compile unless every field has the same name, offset and
// size and the struct the same size (docs/gpu-plumbing.md, "Host/device contract").
//
// Shapes use spec names. Strides are in elements, last dimensions are contiguous (stride 1, not stored). All
// strides are i64: the host checked that every reachable offset fits. q, kv and d_out rows are 16-byte aligned
// (the main kernel gathers them in 16-byte chunks); dkv_acc rows are 16-byte aligned (vector reductions); the
// host checked both.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmla::sparse_bwd {

// `flags` bits.
inline constexpr uint32_t kFlagOutVec16 = 1u << 0;    // `out` rows 16-byte aligned: the main kernel's delta loads 16 B
inline constexpr uint32_t kFlagDqVec16 = 1u << 1;     // `d_q` rows 16-byte aligned: 16-byte stores
inline constexpr uint32_t kFlagDkvVec16 = 1u << 2;    // `d_kv` rows 16-byte aligned: finalisation stores 16 B
inline constexpr uint32_t kFlagDkvF32 = 1u << 3;      // `d_kv` is f32 (finalisation copies); else bf16 (casts)
inline constexpr uint32_t kFlagAccumulate = 1u << 4;  // finalisation adds into the existing f32 `d_kv`
inline constexpr uint32_t kFlagFixedPoint = 1u << 5;  // dkv_acc holds int64 fixed point (deterministic mode)
inline constexpr uint32_t kFlagDrainFirst = 1u << 6;  // d_qk 576 bf16 exchange: a tile's last chunk reports the drain
                                                      // before its reductions (set when d_kv and KV exceed L2)
inline constexpr uint32_t kFlagDeferLastReduce = 1u << 7;  // bf16 exchange: a tile's last-chunk reductions are
                                                           // issued during the next tile's S / dP

struct SparseBwdParams {
    const uint16_t* q;            // [s_q, h_q, d_qk] bf16; strides (q_stride_t, q_stride_h, 1)
    const uint16_t* kv;           // [s_kv, 1, d_qk] bf16; row stride kv_stride_t (V = first 512 columns)
    const int32_t* indices;       // [s_q, 1, topk] i32; token stride indices_stride_t
    const int32_t* topk_length;   // [s_q] i32, stride topk_length_stride; nullptr: every row uses all topk entries
    const float* attn_sink;       // [h_q] f32, stride attn_sink_stride; nullptr: no sink
    const uint16_t* out;          // [s_q, h_q, d_v] bf16 forward output; strides (out_stride_t, out_stride_h, 1)
    const uint16_t* d_out;        // [s_q, h_q, d_v] bf16; strides (d_out_stride_t, d_out_stride_h, 1)
    const float* lse;             // [s_q, h_q] f32 natural log, +inf for empty rows; strides (lse_stride_t, _h)
    uint16_t* d_q;                // [s_q, h_q, d_qk] bf16; strides (d_q_stride_t, d_q_stride_h, 1)
    float* delta;                 // [s_q, h_q] f32; written by the main kernel (consumer 1), read by sink grad
    float* d_attn_sink;           // [h_q] f32, stride d_attn_sink_stride; nullptr when there is no sink
    float* dkv_acc;               // [s_kv, d_qk] f32 accumulator, row stride dkv_acc_stride (the f32 d_kv itself
                                  // when its rows are 16-byte aligned, else the workspace); with kFlagFixedPoint
                                  // int64 values (2^-32 units) and the stride counts int64 elements
    void* d_kv;                   // [s_kv, 1, d_qk] bf16 or f32 (kFlagDkvF32), row stride d_kv_stride: written by
                                  // the finalisation kernel from dkv_acc (unused when dkv_acc is d_kv itself)

    int64_t q_stride_t;
    int64_t q_stride_h;
    int64_t kv_stride_t;
    int64_t indices_stride_t;
    int64_t topk_length_stride;
    int64_t attn_sink_stride;
    int64_t out_stride_t;
    int64_t out_stride_h;
    int64_t d_out_stride_t;
    int64_t d_out_stride_h;
    int64_t lse_stride_t;
    int64_t lse_stride_h;
    int64_t d_q_stride_t;
    int64_t d_q_stride_h;
    int64_t delta_stride_t;
    int64_t delta_stride_h;
    int64_t d_attn_sink_stride;
    int64_t dkv_acc_stride;
    int64_t d_kv_stride;

    int32_t s_q;
    int32_t s_kv;                 // an index i is valid iff 0 <= i < s_kv (clamped to i32::MAX by the host)
    int32_t h_q;                  // 1..=128
    int32_t topk;                 // >= 1
    int32_t d_qk;                 // 512 or 576 (the small kernels need it; the main kernel is templated on it)
    int32_t num_head_groups;      // ceil(h_q / 64); the main kernel's grid.x = s_q * num_head_groups
    uint32_t flags;               // kFlag* bits
    float sm_scale;               // folded into dS, so d_q and d_kv need no extra scaling
    float sm_scale_log2;          // sm_scale * log2(e): logits are kept in base 2 inside the kernel
    int32_t kv_buckets;           // main kernel's entry order: 1 = index order; 2..=kMaxKvBuckets = ascending KV-row
                                  // buckets (kernel.cuh, "Bucketed order"), picked by the host when the accumulator
                                  // and the KV rows do not fit L2
    int32_t token0;               // main kernel: first token of this launch (the host may split the grid in waves)
    int32_t kv_buckets_descending;  // main kernel, bucketed order: 1 = walk the buckets from the last one (the host
                                    // alternates the direction between waves); 0 = ascending
};

}  // namespace flashmla::sparse_bwd
