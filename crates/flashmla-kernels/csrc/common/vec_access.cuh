// Global-memory accesses of 8 values (8 bf16 = 16 bytes, or 8 bytes) either as one vector access (when the host
// proved the alignment) or element by element (any alignment). `kVec` is a compile-time choice so each kernel has
// one straight-line path.
#pragma once

#include <cstdint>

namespace flashmla {

// Eight bf16 values (as bits) from `p`: one 16-byte read-only load when kVec (p 16-byte aligned), else 8 loads.
template <bool kVec>
__device__ __forceinline__ uint4 load_bf16x8(const uint16_t* p) {
    if constexpr (kVec) {
        return __ldg(reinterpret_cast<const uint4*>(p));
    } else {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = uint32_t(__ldg(p + 2 * i)) | (uint32_t(__ldg(p + 2 * i + 1)) << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Eight bf16 values (as bits) to `p`: one 16-byte store when kVec (p 16-byte aligned), else 8 stores.
template <bool kVec>
__device__ __forceinline__ void store_bf16x8(uint16_t* p, uint4 v) {
    if constexpr (kVec) {
        *reinterpret_cast<uint4*>(p) = v;
    } else {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[2 * i] = uint16_t(w[i] & 0xFFFFu);
            p[2 * i + 1] = uint16_t(w[i] >> 16);
        }
    }
}

// Eight bytes from `p`: one 8-byte load when kVec (p 8-byte aligned), else 8 byte loads. Little-endian packing.
template <bool kVec>
__device__ __forceinline__ uint2 load_bytes8(const uint8_t* p) {
    if constexpr (kVec) {
        return __ldg(reinterpret_cast<const uint2*>(p));
    } else {
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i / 4] |= uint32_t(__ldg(p + i)) << (8 * (i % 4));
        return make_uint2(w[0], w[1]);
    }
}

// Eight bytes to `p`: one 8-byte store when kVec (p 8-byte aligned), else 8 byte stores.
template <bool kVec>
__device__ __forceinline__ void store_bytes8(uint8_t* p, uint2 v) {
    if constexpr (kVec) {
        *reinterpret_cast<uint2*>(p) = v;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = uint8_t(((i < 4 ? v.x : v.y) >> (8 * (i % 4))) & 0xFFu);
    }
}

// A little-endian u32 from `p`: one 4-byte load when kVec (p 4-byte aligned), else 4 byte loads.
template <bool kVec>
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
    if constexpr (kVec) {
        return __ldg(reinterpret_cast<const uint32_t*>(p));
    } else {
        uint32_t w = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) w |= uint32_t(__ldg(p + i)) << (8 * i);
        return w;
    }
}

// A little-endian u32 to `p`: one 4-byte store when kVec (p 4-byte aligned), else 4 byte stores.
template <bool kVec>
__device__ __forceinline__ void store_u32(uint8_t* p, uint32_t v) {
    if constexpr (kVec) {
        *reinterpret_cast<uint32_t*>(p) = v;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = uint8_t((v >> (8 * i)) & 0xFFu);
    }
}

}  // namespace flashmla
