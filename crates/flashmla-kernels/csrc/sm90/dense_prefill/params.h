// Parameters of the dense varlen prefill forward kernels (docs/spec.md section 5). Mirrored field by field by
// `crates/flashmla/src/ops/dense_prefill/launch.rs` (`DensePrefillFwdParams`, #[repr(C)]); the layout is checked by
// machine (build.rs lays out this header with the host compiler; docs/gpu-plumbing.md, "Host/device contract").
//
// Strides are in elements; last dimensions are contiguous. q, k, v and out rows are 16-byte aligned (host-checked).
// The offsets are read as they are: every sequence is clamped into [0, total) and made non-decreasing on the
// device, so offsets that break the contract give unspecified values but never an access outside a tensor.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/tensor_map.h"

namespace flashmla::dense_prefill {

// `flags` bits.
inline constexpr uint32_t kFlagCausal = 1u << 0;  // bottom-right causal mask
inline constexpr uint32_t kFlagTma = 1u << 1;     // the tensor maps describe their tensors (q, k, v; d_out)

struct DensePrefillFwdParams {
    // kFlagTma: rank-4 tiled maps (128B swizzle) of q, k and v, dims (d or d_v, heads, total rows, 1), boxes of one
    // 64-column slab of 128 rows of one head; the tiles that lie wholly inside their sequence load by TMA.
    TensorMapBytes q_tmap;
    TensorMapBytes k_tmap;
    TensorMapBytes v_tmap;
    const uint16_t* q;             // [total_q, h_q, d] bf16/f16; strides (q_stride_t, q_stride_h, 1)
    const uint16_t* k;             // [total_k, h_k, d]; strides (k_stride_t, k_stride_h, 1)
    const uint16_t* v;             // [total_k, h_k, d_v]; strides (v_stride_t, v_stride_h, 1)
    const int32_t* cu_seqlens_q;   // [batch + 1] i32, contiguous
    const int32_t* cu_seqlens_k;   // [batch + 1] i32, contiguous
    uint16_t* out;                 // [total_q, h_q, d_v]; strides (out_stride_t, out_stride_h, 1)
    float* lse;                    // [h_q, total_q] f32 (natural log); strides (lse_stride_h, 1)
    uint32_t* tile_counter;        // the call's work counter, zero at launch: each CTA takes the items it serves

    int64_t q_stride_t;
    int64_t q_stride_h;
    int64_t k_stride_t;
    int64_t k_stride_h;
    int64_t v_stride_t;
    int64_t v_stride_h;
    int64_t out_stride_t;
    int64_t out_stride_h;
    int64_t lse_stride_h;

    int32_t batch;                 // >= 1
    int32_t total_q;
    int32_t total_k;
    int32_t h_q;
    int32_t h_per_k;               // h_q / h_k (query heads per key/value head)
    int32_t m_tiles;               // upper bound on the 128-row query tiles of all sequences: ceil(total_q / 128) + batch
    uint32_t flags;                // kFlag* bits
    float sm_scale_log2;           // softmax_scale * log2(e)
    int32_t tail[6];               // 0; pads the struct to its 64-byte alignment without implicit padding
};

// The backward (bwd.cuh). Same conventions as the forward; `lse` and `delta` are [h_q, total_q] f32 with rows
// contiguous. Two schedules: the default (delta, which also zeroes `dq_accum`; one fused dK / dV / dQ pass adding dQ
// into `dq_accum` with bulk f32 reductions; a conversion of dQ) and the deterministic one (dQ, which also writes
// delta, then dK / dV: no atomics, each kernel owns the rows it writes; `dq_accum` is null).
struct DensePrefillBwdParams {
    // kFlagTma: maps of q, k, v and d_out as the forward's, with boxes of 64 rows (the backward's tiles).
    TensorMapBytes q_tmap;
    TensorMapBytes k_tmap;
    TensorMapBytes v_tmap;
    TensorMapBytes d_out_tmap;
    const uint16_t* q;             // [total_q, h_q, d]
    const uint16_t* k;             // [total_k, h_k, d]
    const uint16_t* v;             // [total_k, h_k, d_v]
    const uint16_t* out;           // [total_q, h_q, d_v] (the forward's)
    const uint16_t* d_out;         // [total_q, h_q, d_v]
    const float* lse;              // [h_q, total_q] (the forward's, natural log)
    const int32_t* cu_seqlens_q;   // [batch + 1]
    const int32_t* cu_seqlens_k;   // [batch + 1]
    uint16_t* d_q;                 // [total_q, h_q, d]
    uint16_t* d_k;                 // [total_k, h_k, d]
    uint16_t* d_v;                 // [total_k, h_k, d_v]
    float* delta;                  // [h_q, total_q] workspace: rowsum(d_out * out), written by the delta kernel
                                   // (fused) or the dQ kernel (separate)
    float* dq_accum;               // [h_q, total_q, d] f32 workspace of the fused schedule (rows contiguous), or null

    int64_t q_stride_t;
    int64_t q_stride_h;
    int64_t k_stride_t;
    int64_t k_stride_h;
    int64_t v_stride_t;
    int64_t v_stride_h;
    int64_t out_stride_t;
    int64_t out_stride_h;
    int64_t d_out_stride_t;
    int64_t d_out_stride_h;
    int64_t d_q_stride_t;
    int64_t d_q_stride_h;
    int64_t d_k_stride_t;
    int64_t d_k_stride_h;
    int64_t d_v_stride_t;
    int64_t d_v_stride_h;
    int64_t lse_stride_h;
    int64_t delta_stride_h;

    int32_t batch;
    int32_t total_q;
    int32_t total_k;
    int32_t h_q;
    int32_t h_k;
    int32_t h_per_k;
    int32_t q_tiles;               // ceil(total_q / 128) + batch: the dQ grid's 128-row tiles per query head
    int32_t k_tiles;               // the dK / dV grid's tiles per key head: ceil(total_k / 64) + batch (fused: / 128)
    uint32_t flags;                // kFlagCausal, kFlagTma
    float sm_scale_log2;           // softmax_scale * log2(e)
    float sm_scale;                // softmax_scale
    int32_t d_qk;                  // d (192 or 128): the row width of dq_accum
    int32_t tail[6];               // 0; pads the struct to its 64-byte alignment without implicit padding
};

}  // namespace flashmla::dense_prefill
