// Shared-memory mbarriers (sm_90): typed wrappers of the PTX the kernels use.
//
// An mbarrier is a 64-bit word in shared memory that counts arrivals for the current phase; when the expected
// count is reached the phase completes and its parity flips. Waiters name the parity of the phase they wait for:
// `wait(bar, parity)` returns once the phase with that parity has completed. On a freshly initialised barrier
// (phase 0 running) waiting for parity 1 returns at once, which is how a producer treats every stage as "empty"
// on its first round (see pipeline.cuh).
#pragma once

#include <cstdint>

namespace flashmla {

// 32-bit shared-state-space address of a generic pointer into shared memory (what PTX `.shared` operands take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

struct MBarrier {
    // One thread initialises; make it visible with __syncthreads() before any other thread touches the barrier.
    static __device__ __forceinline__ void init(uint64_t* bar, uint32_t expected_arrivals) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(expected_arrivals)
                     : "memory");
    }

    // Plain arrival (release semantics at CTA scope): orders this thread's earlier shared-memory writes before
    // the phase completion that waiters observe.
    static __device__ __forceinline__ void arrive(uint64_t* bar) {
        asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
    }

    // Makes the barrier track every cp.async this thread issued so far, with .noinc: the pending count is not
    // raised, so the asynchronous arrival triggered when those copies have landed is one of the barrier's expected
    // arrivals (init the barrier with the number of threads that do this, and do not `arrive` on it as well).
    static __device__ __forceinline__ void arrive_on_cp_async_noinc(uint64_t* bar) {
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
    }

    // `count` arrivals at once (release semantics at CTA scope), e.g. one thread standing for a warpgroup.
    static __device__ __forceinline__ void arrive(uint64_t* bar, uint32_t count) {
        asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
                     : "memory");
    }

    // Raises the current phase's expected transaction count by `bytes`: the phase then also waits for that many
    // bytes of asynchronous copies (TMA) completing on this barrier. Call it before the arrival it belongs with.
    static __device__ __forceinline__ void expect_tx(uint64_t* bar, uint32_t bytes) {
        asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                     : "memory");
    }

    // Non-blocking probe: true when the phase with parity `parity` has completed (acquire at CTA scope).
    static __device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) {
        uint32_t done;
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
        return done != 0;
    }

    // Blocks until the phase with parity `parity` has completed.
    static __device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
        while (!try_wait(bar, parity)) {
        }
    }
};

}  // namespace flashmla
