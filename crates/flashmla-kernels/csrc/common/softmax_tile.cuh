// The online softmax of the MLA attention kernels, on 64 x 64 score tiles held by one warpgroup as wgmma
// accumulators (fragment layout: smem_layout.cuh), with the output kept as 64 x 256 halves (one per consumer
// warpgroup). Shared by the sparse prefill forward and the decode kernels.
//
// Logits are kept in base 2 (the host folds log2(e) into the scale). Lazy rescaling: see kRescaleThreshold.
#pragma once

#include <cstdint>

#include "common/mbarrier.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"

namespace flashmla {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kInf = __builtin_huge_valf();
// Lazy rescaling: the reference max that P is computed against is only raised when a row's running max exceeds
// it by more than this (base-2 logits), so P <= 2^8 (exact enough in bf16, far from overflow in f32) and O is
// rarely rescaled. lse and the output use the same reference, so the result does not depend on it.
inline constexpr float kRescaleThreshold = 8.0f;
inline constexpr uint32_t kFullMask = 0xffffffffu;

// Geometry of the tiles: M = 64 query rows (the wgmma M), N = 64 keys per tile, one warpgroup per tile, the output
// split into two 256-column halves.
inline constexpr int kTileM = 64;
inline constexpr int kTileN = 64;
inline constexpr int kTileThreads = 128;
inline constexpr int kOHalfCols = 256;

// Zeroes a register array (accumulators before their first use).
template <int N>
__device__ __forceinline__ void zero_regs(float (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = 0.f;
}

// Shapes of the consumers' register tiles.
inline constexpr int kSRegs = kTileM * kTileN / kTileThreads;       // 32: S, 64 x 64 f32
inline constexpr int kORegs = kTileM * kOHalfCols / kTileThreads;  // 128: O half, 64 x 256 f32
inline constexpr int kPvSteps = kTileN / 16;                                    // 4 k-steps of 16 kv rows
inline constexpr int kSBlocks = kSRegs / 4;                                        // 8 n8 blocks of S
inline constexpr uint32_t kUnusedLbo = 16;  // K-major SW128 operands ignore LBO

// One elected arrival per warp on an "empty" barrier, after the warp's last use of the guarded data. The
// __syncwarp orders every lane's earlier accesses before lane 0's (release) arrival.
__device__ __forceinline__ void release_by_warp(uint64_t* bar, int lane) {
    __syncwarp();
    if (lane == 0) MBarrier::arrive(bar);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
    return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(kFullMask, v, 1);
    return v + __shfl_xor_sync(kFullMask, v, 2);
}


// Validity of the 64 keys (score columns) of a tile as a bit mask (bit n = key n of the tile).
struct TileMask {
    uint32_t lo;  // rows 0..31
    uint32_t hi;  // rows 32..63
    // From one validity flag per lane for keys `lane` and `lane + 32` (warp-uniform result).
    static __device__ __forceinline__ TileMask of_lanes(bool lo_valid, bool hi_valid) {
        return {__ballot_sync(kFullMask, lo_valid), __ballot_sync(kFullMask, hi_valid)};
    }
};

// Column n of S is tile row n. Invalid rows (bad index, tail) -> -inf (a select, not an add, so an inf in Q cannot
// turn into NaN); their K and V rows were zero-filled by the producer. The mask is warp-uniform, so fully valid
// tiles (the common case) skip it.
__device__ __forceinline__ void mask_invalid_rows(float (&s)[kSRegs], const TileMask& mask, const AccFrag& f) {
    if (mask.lo != kFullMask || mask.hi != kFullMask) {
        const uint32_t v_lo = mask.lo >> (2 * f.quad);
        const uint32_t v_hi = mask.hi >> (2 * f.quad);
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) {
            const uint32_t v = j < kSBlocks / 2 ? v_lo : v_hi;
            const uint32_t bit = 1u << (8 * (j % (kSBlocks / 2)));
            const bool va = (v & bit) != 0;         // column 8 j + 2 q
            const bool vb = (v & (bit << 1)) != 0;  // column 8 j + 2 q + 1
            s[4 * j + 0] = va ? s[4 * j + 0] : -kInf;
            s[4 * j + 1] = vb ? s[4 * j + 1] : -kInf;
            s[4 * j + 2] = va ? s[4 * j + 2] : -kInf;
            s[4 * j + 3] = vb ? s[4 * j + 3] : -kInf;
        }
    }
}

// Online-softmax bookkeeping of one tile: the running max of the base-2 logits and the lazily raised reference
// (raised only when the running max exceeds it by kRescaleThreshold; also on the first valid entry, where m_ref is
// -inf and alpha = exp2(-inf) = 0). Row maxima as trees (short dependency chains). m_exp is the reference to
// subtract, 0 while a row has seen no valid entry (keeps exp2 away from NaN).
__device__ __forceinline__ void update_row_max(const float (&s)[kSRegs], float scale, float (&m_run)[2],
                                               float (&m_ref)[2], float (&alpha)[2], float (&m_exp)[2]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float t[kSBlocks];
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) t[j] = fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]);
#pragma unroll
        for (int w2 = kSBlocks / 2; w2 >= 1; w2 /= 2) {
#pragma unroll
            for (int j = 0; j < w2; ++j) t[j] = fmaxf(t[j], t[j + w2]);
        }
        m_run[rr] = fmaxf(m_run[rr], quad_max(t[0]) * scale);
        alpha[rr] = 1.f;
        if (m_run[rr] > m_ref[rr] + kRescaleThreshold) {
            alpha[rr] = exp2f(m_ref[rr] - m_run[rr]);
            m_ref[rr] = m_run[rr];
        }
        m_exp[rr] = m_ref[rr] == -kInf ? 0.f : m_ref[rr];
    }
}

// O *= alpha per row (the thread's two rows): brings an O half to a raised reference max.
__device__ __forceinline__ void scale_o_rows(float (&o)[kORegs], float a0, float a1) {
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
        o[4 * j + 0] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
    }
}

}  // namespace flashmla
