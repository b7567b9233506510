// Tensor-memory-accelerator (TMA) tile loads: `cp.async.bulk.tensor` of a box described by a tensor map the host
// encoded with cuTensorMapEncodeTiled (the driver's 128-byte CUtensorMap, opaque here). One thread issues a whole
// box; the copy engine writes it into shared memory in the map's swizzle and completes `bytes` of transaction count
// on an mbarrier, so the waiting side needs no proxy fence and the issuing warps spend a few instructions per box.
#pragma once

#include <cstdint>

#include "common/tensor_map.h"

namespace flashmla {

// Brings the descriptor into the SM's cache ahead of the first copy that uses it.
__device__ __forceinline__ void tma_prefetch_map(const TensorMapBytes* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at coordinates (c0, c1, c2, c3) (innermost first, in elements) of a rank-4 map into shared address
// `dst` (aligned as the map's swizzle needs: 1024 bytes for 128B), completing its bytes on mbarrier `bar`. The
// caller announced them with MBarrier::expect_tx. Coordinates outside the tensor read zeros, never memory.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMapBytes* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// The same with an L2 cache policy for the bytes read (a createpolicy value, e.g. l2_policy_evict_first()).
__device__ __forceinline__ void tma_load_4d_hint(uint32_t dst, const TensorMapBytes* map, int c0, int c1, int c2,
                                                 int c3, uint32_t bar, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%2, %3, %4, %5}], [%6], %7;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
        : "memory");
}

// An L2 policy for cache hints: the bytes read are evicted first.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

}  // namespace flashmla
