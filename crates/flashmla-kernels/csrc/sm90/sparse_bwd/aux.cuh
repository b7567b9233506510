// The small kernels of the sparse backward family (all memory-bound, kSmallThreads threads per CTA):
//   zero_acc         dkv_acc[:, :] = 0                                              (before the main kernel)
//   finalize_dkv     d_kv = bf16(dkv_acc) or f32 copy / add (f32 or fixed-point acc)  (after it)
//   sink_grad        d_attn_sink[h] = -sum_t sigmoid(sink[h] - lse[t, h]) * delta[t, h] over non-empty rows
// The sink gradient is deterministic: a fixed thread -> token assignment and a fixed reduction tree in f64.
#pragma once

#include <cstdint>

#include "common/red_global.cuh"
#include "common/smem_layout.cuh"
#include "common/vec_access.cuh"
#include "sm90/sparse_bwd/config.cuh"
#include "sm90/sparse_bwd/params.h"

namespace flashmla::sparse_bwd {

// dkv_acc rows [0, s_kv) x columns [0, d_qk) = 0, float4 stores (rows 16-byte aligned, d_qk a multiple of 4).
// Fixed-point accumulators have 8-byte values: twice the floats per row and per stride.
__device__ __forceinline__ void zero_acc(const SparseBwdParams& p) {
    const int64_t words = (p.flags & kFlagFixedPoint) != 0 ? 2 : 1;  // 4-byte words per value
    const int64_t per_row = words * p.d_qk / 4;
    const int64_t row_stride = words * p.dkv_acc_stride;
    const int64_t n = static_cast<int64_t>(p.s_kv) * per_row;
    const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
        const int64_t r = i / per_row;
        const int64_t c = (i % per_row) * 4;
        *reinterpret_cast<float4*>(p.dkv_acc + r * row_stride + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// Eight accumulator values of row r from column c, as floats.
__device__ __forceinline__ void load_acc8(const SparseBwdParams& p, int64_t r, int64_t c, float (&v)[kElemChunk]) {
    if ((p.flags & kFlagFixedPoint) != 0) {
        const longlong2* src = reinterpret_cast<const longlong2*>(reinterpret_cast<const int64_t*>(p.dkv_acc) +
                                                                  r * p.dkv_acc_stride + c);
#pragma unroll
        for (int k = 0; k < kElemChunk / 2; ++k) {
            const longlong2 w = src[k];
            v[2 * k] = static_cast<float>(from_fixed_point(w.x));
            v[2 * k + 1] = static_cast<float>(from_fixed_point(w.y));
        }
    } else {
        const float* src = p.dkv_acc + r * p.dkv_acc_stride + c;
        const float4 lo = *reinterpret_cast<const float4*>(src);
        const float4 hi = *reinterpret_cast<const float4*>(src + 4);
        v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
        v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
}

// d_kv[r, c..c+7] from dkv_acc: bf16 (round to nearest even) or f32 (copy, or add with kFlagAccumulate).
__device__ __forceinline__ void finalize_dkv(const SparseBwdParams& p) {
    const int64_t per_row = p.d_qk / kElemChunk;
    const int64_t n = static_cast<int64_t>(p.s_kv) * per_row;
    const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const bool vec = (p.flags & kFlagDkvVec16) != 0;
    const bool f32 = (p.flags & kFlagDkvF32) != 0;
    const bool add = (p.flags & kFlagAccumulate) != 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
        const int64_t r = i / per_row;
        const int64_t c = (i % per_row) * kElemChunk;
        float v[kElemChunk];
        load_acc8(p, r, c, v);
        if (f32) {
            float* dst = static_cast<float*>(p.d_kv) + r * p.d_kv_stride + c;
            if (vec) {
                float4* d4 = reinterpret_cast<float4*>(dst);
                if (add) {
                    const float4 a = d4[0];
                    const float4 b = d4[1];
                    v[0] += a.x, v[1] += a.y, v[2] += a.z, v[3] += a.w;
                    v[4] += b.x, v[5] += b.y, v[6] += b.z, v[7] += b.w;
                }
                d4[0] = make_float4(v[0], v[1], v[2], v[3]);
                d4[1] = make_float4(v[4], v[5], v[6], v[7]);
            } else {
#pragma unroll
                for (int k = 0; k < kElemChunk; ++k) dst[k] = add ? dst[k] + v[k] : v[k];
            }
        } else {
            uint16_t* dst = static_cast<uint16_t*>(p.d_kv) + r * p.d_kv_stride + c;
            uint32_t w[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) w[k] = pack_bf16x2(v[2 * k], v[2 * k + 1]);
            const uint4 packed = make_uint4(w[0], w[1], w[2], w[3]);
            if (vec) {
                store_bf16x8<true>(dst, packed);
            } else {
                store_bf16x8<false>(dst, packed);
            }
        }
    }
}

// One CTA per head h (grid.x = h_q). Thread k sums tokens k, k + 256, ... in order (f64), then a fixed tree.
__device__ __forceinline__ void sink_grad(const SparseBwdParams& p) {
    __shared__ double partial[kSmallThreads];
    const int h = static_cast<int>(blockIdx.x);
    const float sink = __ldg(p.attn_sink + static_cast<int64_t>(h) * p.attn_sink_stride);
    double acc = 0.0;
    for (int t = static_cast<int>(threadIdx.x); t < p.s_q; t += kSmallThreads) {
        const float lse = __ldg(p.lse + static_cast<int64_t>(t) * p.lse_stride_t + static_cast<int64_t>(h) * p.lse_stride_h);
        if (lse == __builtin_huge_valf()) continue;  // empty row: contributes nothing (docs/spec.md section 2, reference)
        const float delta = p.delta[static_cast<int64_t>(t) * p.delta_stride_t + static_cast<int64_t>(h) * p.delta_stride_h];
        // exp(sink - lse') = sigmoid(sink - lse), evaluated without overflow; exact 1 / 0 at +inf / -inf sinks.
        const double x = static_cast<double>(sink) - static_cast<double>(lse);
        const double sig = x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
        acc += sig * static_cast<double>(delta);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (int width = kSmallThreads / 2; width >= 1; width /= 2) {
        if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
        __syncthreads();
    }
    if (threadIdx.x == 0) p.d_attn_sink[static_cast<int64_t>(h) * p.d_attn_sink_stride] = static_cast<float>(-partial[0]);
}

}  // namespace flashmla::sparse_bwd
