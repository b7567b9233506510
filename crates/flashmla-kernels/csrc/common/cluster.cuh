// Thread-block clusters and distributed shared memory (sm_90): the PTX a pair of CTAs uses to hand data to each
// other through their shared memories, with mbarriers as the only synchronisation on the critical path.
//
// Addresses: `local` arguments are 32-bit shared::cta addresses of this CTA (smem_addr() of mbarrier.cuh); mapa
// turns one into the shared::cluster address of the same byte in CTA `rank` of the cluster. Every remote operation
// below takes such a shared::cluster address.
//
// Ordering model used by the kernels:
// * data: st.async stores complete their bytes on an mbarrier of the receiving CTA (complete_tx, which has release
//   semantics at cluster scope); the receiver arms the barrier with arrive_expect_tx and waits on it like on a TMA
//   load (the ordinary CTA-scope acquire of MBarrier::wait), after which ld.shared see the bytes. st.async is a weak
//   generic-proxy store: no proxy fence is involved.
// * credit: the receiver, done with the buffer, arrives remotely on an mbarrier of the sender, which waits for it
//   before overwriting the buffer. That arrival is RELAXED on purpose: the receiver's reads of the buffer have
//   returned (their values were consumed) before it arrives, so nothing needs ordering, while a release at cluster
//   scope would compile to MEMBAR.ALL.GPU and wait for every global reduction the thread has in flight.
// * lifetime: a CTA may only be accessed while it runs: cluster_sync() after mbarrier initialisation (with
//   fence_mbarrier_init_cluster()) and again before exit.
#pragma once

#include <cstdint>

namespace flashmla {

// Rank of this CTA in its cluster (a constant of the CTA: not volatile, so the compiler may read it once).
__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The same, re-read at every use (asm volatile): for code that must not keep it in a register across a loop.
__device__ __forceinline__ uint32_t cluster_ctarank_volatile() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// shared::cluster address of `local` (shared::cta address) in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t mapa_shared(uint32_t local, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}

// Makes this thread's mbarrier.init visible to the other CTAs of the cluster (before cluster_sync()).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Every thread of every CTA of the cluster arrives (release) and waits (acquire). All threads of each warp must
// execute it together (.aligned).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Two f32 (8 bytes, `remote` 8-byte aligned) into another CTA's shared memory; the 8 bytes complete on that CTA's
// mbarrier `remote_bar` (both shared::cluster addresses).
__device__ __forceinline__ void st_async_v2_f32(uint32_t remote, float a, float b, uint32_t remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(remote),
                 "f"(a), "f"(b), "r"(remote_bar)
                 : "memory");
}

// Four 32-bit words (16 bytes, `remote` 16-byte aligned) into another CTA's shared memory, completing on its
// mbarrier `remote_bar` (both shared::cluster addresses).
__device__ __forceinline__ void st_async_v4_b32(uint32_t remote, uint4 v, uint32_t remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                     remote),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
                 : "memory");
}

// Relaxed arrival on an mbarrier of another CTA (shared::cluster address): a credit that orders no memory access
// (see the header comment for when that is enough).
__device__ __forceinline__ void mbarrier_arrive_remote_relaxed(uint32_t remote_bar) {
    asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
}

// Arrival on a local mbarrier that also raises the bytes the current phase waits for by `bytes` (the bytes another
// CTA's st.async will complete on it; they may land before or after this call).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Blocks until the phase with parity `parity` of a local mbarrier (shared::cta address) completed; CTA-scope
// acquire, as for TMA completions.
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

}  // namespace flashmla
