// cp.async completion groups (sm_80+): a thread closes the copies it issued so far into a group, and later waits
// until all but the N most recent of its groups have landed. Lets a producer publish a tile slab by slab with one
// proxy fence per slab on its own side, so that consumers of the tile need no fence of their own.
#pragma once

#include <cstdint>

#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"

namespace flashmla {

// Closes this thread's outstanding cp.async copies into one group.
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's most recent groups are still in flight (groups complete in order).
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
    static_assert(kPending >= 0 && kPending <= 16, "cp.async.wait_group immediate");
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The same with a count known only after unrolling (loops over slabs): the switch folds to one instruction.
__device__ __forceinline__ void cp_async_wait_group_n(int pending) {
    switch (pending) {
        case 0: cp_async_wait_group<0>(); break;
        case 1: cp_async_wait_group<1>(); break;
        case 2: cp_async_wait_group<2>(); break;
        case 3: cp_async_wait_group<3>(); break;
        case 4: cp_async_wait_group<4>(); break;
        case 5: cp_async_wait_group<5>(); break;
        case 6: cp_async_wait_group<6>(); break;
        case 7: cp_async_wait_group<7>(); break;
        case 8: cp_async_wait_group<8>(); break;
        case 9: cp_async_wait_group<9>(); break;
        default: cp_async_wait_group<0>(); break;  // waiting for everything is always correct
    }
}

// Publishes what the thread wrote to shared memory through the generic proxy (st.shared, or cp.async copies it has
// waited for) on mbarrier `full`: a proxy fence, then one arrival, so that readers through the async proxy (wgmma,
// bulk copies) need no fence of their own after waiting on `full`.
__device__ __forceinline__ void publish_generic_writes(uint64_t* full) {
    fence_proxy_async_shared();
    MBarrier::arrive(full);
}

// Waits until at most `pending` of the thread's most recent cp.async groups are in flight, then publishes the copies
// that landed (publish_generic_writes).
__device__ __forceinline__ void publish_landed_copies(uint64_t* full, int pending) {
    cp_async_wait_group_n(pending);
    publish_generic_writes(full);
}

}  // namespace flashmla
