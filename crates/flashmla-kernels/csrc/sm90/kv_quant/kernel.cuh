// FP8 KV-cache quantise / dequantise: one warp per token.
//
// A token's d_qk bf16 values are cut into chunks of 8 (one 16-byte load); lane l handles chunk c = 32 * step + l.
// V3.2 (d_qk 576): 72 chunks in 3 steps (64 NoPE chunks, then 8 RoPE chunks on lanes 0..7 of step 2).
// MODEL1 (d_qk 512): 64 chunks in 2 steps (56 NoPE chunks, then 8 RoPE chunks on lanes 24..31 of step 1).
// A scale tile (128 or 64 values) is 16 or 8 consecutive chunks, i.e. an aligned group of 16 or 8 lanes of one step,
// so the tile's absolute maximum is a butterfly max over that lane group. Groups never mix NoPE and RoPE chunks
// (the NoPE chunk count is a multiple of the group size); RoPE and idle lanes contribute 0.
//
// The quantiser is bit-exact with crates/flashmla/src/reference/kv_quant.rs (see common/fp8.cuh for how).
#pragma once

#include "common/fp8.cuh"
#include "common/vec_access.cuh"
#include "sm90/kv_quant/format.cuh"
#include "sm90/kv_quant/params.h"

namespace flashmla::kv_quant {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerCta = 8;  // one token per warp
constexpr int kThreads = kWarpsPerCta * kWarpSize;
constexpr int kChunk = 8;  // bf16 values per lane and step: one 16-byte access
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

template <class F>
struct Geometry {
    static constexpr int kDQk = F::kDNope + kDRope;
    static constexpr int kNopeChunks = F::kDNope / kChunk;
    static constexpr int kChunks = kDQk / kChunk;
    static constexpr int kSteps = (kChunks + kWarpSize - 1) / kWarpSize;
    static constexpr int kTileChunks = F::kTile / kChunk;  // lanes sharing one scale
    static_assert(F::kDNope % kChunk == 0 && kDRope % kChunk == 0, "chunks never straddle NoPE and RoPE");
    static_assert(kWarpSize % kTileChunks == 0, "a tile is an aligned lane group within one step");
    static_assert(kNopeChunks % kTileChunks == 0, "no lane group mixes NoPE and RoPE chunks");
};

// Token index -> (block, token within block) and the warp's lane. Returns false for the warps past the end
// (the whole warp leaves together, so the full-warp shuffles below stay valid).
__device__ __forceinline__ bool locate_token(const Params& p, int64_t& block, int64_t& t, int& lane) {
    // num_tokens fits in int32 (host-checked), so 32-bit unsigned division suffices.
    const uint32_t token = blockIdx.x * uint32_t(kWarpsPerCta) + threadIdx.x / kWarpSize;
    if (token >= uint32_t(p.num_tokens)) return false;
    block = int64_t(token / uint32_t(p.page_size));
    t = int64_t(token % uint32_t(p.page_size));
    lane = int(threadIdx.x % kWarpSize);
    return true;
}

// Max over an aligned group of kGroup lanes.
template <int kGroup>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
#pragma unroll
    for (int offset = 1; offset < kGroup; offset *= 2) v = max(v, __shfl_xor_sync(kFullWarp, v, offset));
    return v;
}

// Largest |x| (as f32 bits) among 8 bf16 values, NaN skipped.
__device__ __forceinline__ uint32_t abs_max_bits8(uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m = max(m, abs_bits_skip_nan(w[i] << 16));
        m = max(m, abs_bits_skip_nan(w[i] & 0xFFFF0000u));
    }
    return m;
}

// 8 bf16 values -> 8 e4m3 codes of x * inv (little-endian bytes in element order).
__device__ __forceinline__ uint2 encode8(uint4 v, float inv) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t pairs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo_bits = w[i] << 16, hi_bits = w[i] & 0xFFFF0000u;
        const float lo = mul_rn_ieee(__uint_as_float(lo_bits), inv);
        const float hi = mul_rn_ieee(__uint_as_float(hi_bits), inv);
        const uint32_t codes = e4m3x2_from_f32_satfinite(lo, hi);
        const uint32_t lo_code = patch_nan_code(patch_zero_sign(codes & 0xFFu, __float_as_uint(lo)), lo_bits);
        const uint32_t hi_code = patch_nan_code(patch_zero_sign(codes >> 8, __float_as_uint(hi)), hi_bits);
        pairs[i] = lo_code | (hi_code << 8);
    }
    return make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
}

// 8 e4m3 codes -> 8 bf16 values of code * scale, rounded to nearest even.
__device__ __forceinline__ uint4 decode8(uint2 codes, float scale) {
    const uint32_t c[4] = {codes.x & 0xFFFFu, codes.x >> 16, codes.y & 0xFFFFu, codes.y >> 16};
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lo, hi;
        e4m3x2_to_f32(c[i], lo, hi);
        w[i] = bf16_bits_from_f32_rne(mul_rn_ieee(lo, scale)) | (bf16_bits_from_f32_rne(mul_rn_ieee(hi, scale)) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool kVec>
__device__ __forceinline__ void store_scale(FormatV32, uint8_t* record, int tile, int e) {
    store_u32<kVec>(record + tile * FormatV32::kScaleBytes, __float_as_uint(exp2_int(e)));
}
template <bool kVec>
__device__ __forceinline__ void store_scale(FormatModel1, uint8_t* record, int tile, int e) {
    record[tile] = uint8_t(e + kF32ExponentBias);
}
template <bool kVec>
__device__ __forceinline__ float load_scale(FormatV32, const uint8_t* record, int tile) {
    return __uint_as_float(load_u32<kVec>(record + tile * FormatV32::kScaleBytes));
}
template <bool kVec>
__device__ __forceinline__ float load_scale(FormatModel1, const uint8_t* record, int tile) {
    return e8m0_to_f32(__ldg(record + tile));
}

// Quantises one token per warp. kVec: kv rows 16-byte aligned and cache blocks 8-byte aligned (host-checked).
template <class F, bool kVec>
__device__ __forceinline__ void quantize_token(const Params& p) {
    using G = Geometry<F>;
    int64_t block, t;
    int lane;
    if (!locate_token(p, block, t, lane)) return;
    const uint16_t* src = p.kv + block * p.kv_block_stride + t * p.kv_token_stride;
    uint8_t* blk = p.cache + block * p.cache_block_stride;
    uint8_t* nope = blk + F::nope_offset(t);
    uint8_t* record = blk + F::scale_offset(t, p.page_size);
    uint8_t* rope = blk + F::rope_offset(t);
#pragma unroll
    for (int step = 0; step < G::kSteps; ++step) {
        const int c = step * kWarpSize + lane;
        const bool is_nope = c < G::kNopeChunks;
        const bool is_rope = !is_nope && c < G::kChunks;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (is_nope || is_rope) v = load_bf16x8<kVec>(src + c * kChunk);
        const uint32_t amax = group_max<G::kTileChunks>(is_nope ? abs_max_bits8(v) : 0u);
        if (is_nope) {
            const int e = pow2_scale_exponent(__uint_as_float(amax));
            // 1 / 2^e is exact; for e = 127 it is the subnormal 2^-127, which mul_rn_ieee keeps.
            store_bytes8<kVec>(nope + c * kChunk, encode8(v, exp2_int(-e)));
            if (c % G::kTileChunks == 0) store_scale<kVec>(F{}, record, c / G::kTileChunks, e);
        } else if (is_rope) {
            // 16 bytes of bf16 at an 8-byte-aligned address: two 8-byte stores.
            uint8_t* dst = rope + (c - G::kNopeChunks) * kChunk * kBf16Bytes;
            store_bytes8<kVec>(dst, make_uint2(bf16x2_quiet_nans(v.x), bf16x2_quiet_nans(v.y)));
            store_bytes8<kVec>(dst + 8, make_uint2(bf16x2_quiet_nans(v.z), bf16x2_quiet_nans(v.w)));
        }
    }
    if constexpr (F::kHasPadByte) {
        if (lane == 0) record[F::kNumScales] = 0;
    }
}

// Dequantises one token per warp. kVec: kv rows 16-byte aligned and cache blocks 8-byte aligned (host-checked).
template <class F, bool kVec>
__device__ __forceinline__ void dequantize_token(const Params& p) {
    using G = Geometry<F>;
    int64_t block, t;
    int lane;
    if (!locate_token(p, block, t, lane)) return;
    uint16_t* dst = p.kv + block * p.kv_block_stride + t * p.kv_token_stride;
    const uint8_t* blk = p.cache + block * p.cache_block_stride;
    const uint8_t* nope = blk + F::nope_offset(t);
    const uint8_t* record = blk + F::scale_offset(t, p.page_size);
    const uint8_t* rope = blk + F::rope_offset(t);
#pragma unroll
    for (int step = 0; step < G::kSteps; ++step) {
        const int c = step * kWarpSize + lane;
        if (c < G::kNopeChunks) {
            const float scale = load_scale<kVec>(F{}, record, c / G::kTileChunks);
            store_bf16x8<kVec>(dst + c * kChunk, decode8(load_bytes8<kVec>(nope + c * kChunk), scale));
        } else if (c < G::kChunks) {
            const uint8_t* src = rope + (c - G::kNopeChunks) * kChunk * kBf16Bytes;
            const uint2 a = load_bytes8<kVec>(src), b = load_bytes8<kVec>(src + 8);
            store_bf16x8<kVec>(dst + c * kChunk, make_uint4(bf16x2_quiet_nans(a.x), bf16x2_quiet_nans(a.y),
                                                            bf16x2_quiet_nans(b.x), bf16x2_quiet_nans(b.y)));
        }
    }
}

}  // namespace flashmla::kv_quant
