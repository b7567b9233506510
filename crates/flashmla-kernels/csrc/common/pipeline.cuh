// Warp-specialised pipeline plumbing (sm_90): ring-buffer stage/phase arithmetic, named barriers, register
// reallocation between warpgroups, and the generic->async proxy fence.
#pragma once

#include <cstdint>

namespace flashmla {

// Position of work item `i` in a ring of kStages shared-memory stages, and the mbarrier parities that go with it.
// Item i lives in stage i % kStages; its "full" barrier completes once per round, so the consumer waits for
// parity (i / kStages) & 1. The producer waits on the stage's "empty" barrier for the previous round's release,
// i.e. the opposite parity: on round 0 that is parity 1 of a fresh barrier, which counts as already complete.
template <int kStages>
struct RingPos {
    static_assert(kStages >= 1, "a ring needs at least one stage");
    int stage;
    uint32_t full_parity;
    uint32_t empty_parity;

    static __device__ __forceinline__ RingPos of(int i) {
        RingPos r;
        r.stage = i % kStages;
        r.full_parity = static_cast<uint32_t>((i / kStages) & 1);
        r.empty_parity = r.full_parity ^ 1u;
        return r;
    }
};

// Named hardware barriers (barrier.sync id, count). Id 0 is __syncthreads(); kernels name the others with an enum
// (`enum class Bar : uint32_t { ... }`) so every use says what it waits for. This is the unaligned barrier.sync,
// for participants that reach a barrier from different static code paths (e.g. one call site per warpgroup role):
// bar.sync is barrier.sync.aligned, which promises that every blocking participant of a barrier generation executes
// the same instruction (compute-sanitizer synccheck reports a divergent barrier otherwise).
template <class Id>
__device__ __forceinline__ void named_barrier_sync_unaligned(Id id, uint32_t num_threads) {
    asm volatile("barrier.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
}

// Arrives at named barrier `id` (count `num_threads`) without waiting: the producer side of a hand-off whose
// consumer side is named_barrier_sync_unaligned.
template <class Id>
__device__ __forceinline__ void named_barrier_arrive(Id id, uint32_t num_threads) {
    asm volatile("barrier.arrive %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(num_threads) : "memory");
}

// Register reallocation between warpgroups (sm_90a). Takes effect only when the kernel has a register cap at
// entry (__launch_bounds__(threads, 1)); every warp of the warpgroup must execute it.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Orders shared-memory accesses of the generic proxy (st.shared, cp.async) against those of the async proxy
// (wgmma operand reads, TMA). Writers of a wgmma operand issue it after their stores and before the barrier that
// publishes them; readers of cp.async-filled tiles issue it after observing the tile's mbarrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Dynamic shared memory granted to this launch, in bytes (%dynamic_smem_size).
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

}  // namespace flashmla
