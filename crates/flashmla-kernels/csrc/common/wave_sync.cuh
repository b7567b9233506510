// Keeping the CTAs of one launch ("wave") in step: a soft, time-bounded rendezvous on a global counter.
//
// The host launches a grid as a sequence of waves of CTAs that the GPU runs at once and gives each wave one zeroed
// u32 counter. Every CTA of the wave passes the same numbered sync points k = 1, 2, ..., K (K known to every CTA);
// at point k it adds 1 to the counter and waits until the counter reaches k * gridDim.x, i.e. until every CTA of the
// wave has passed point k. The arrivals of points a CTA will never reach (a shorter row) are added up front, so
// nobody waits for them. Nothing is communicated through the counter, so relaxed operations suffice.
//
// The wait is bounded: after kWaveSyncTimeoutCycles without the counter reaching its target (a wave that is not all
// resident, a GPU shared with other work) the CTA stops waiting for the rest of its life and only arrives. So the
// rendezvous can slow a CTA down by at most one timeout; it can never deadlock, and it never changes a result.
#pragma once

#include <cstdint>

namespace flashmla {

// ~20 us at 1.98 GHz: several tiles of the slowest kernel that uses it, far beyond the start skew of a wave.
inline constexpr long long kWaveSyncTimeoutCycles = 40000;

__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_add_relaxed_gpu(uint32_t* p, uint32_t v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One thread of the CTA: arrives at sync point k (>= 1) of the wave whose counter is `ctr` and, while `waiting`,
// waits until every CTA of the wave arrived there or the timeout passed. Returns whether to keep waiting at later
// points (false once a wait timed out).
__device__ __forceinline__ bool wave_sync_point(uint32_t* ctr, uint32_t k, bool waiting) {
    red_add_relaxed_gpu(ctr, 1);
    if (!waiting) return false;
    const uint32_t target = k * gridDim.x;
    const long long t0 = clock64();
    while (static_cast<int32_t>(ld_relaxed_gpu(ctr) - target) < 0) {
        if (clock64() - t0 > kWaveSyncTimeoutCycles) return false;
        __nanosleep(256);
    }
    return true;
}

}  // namespace flashmla
