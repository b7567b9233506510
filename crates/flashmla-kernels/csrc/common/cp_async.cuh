// cp.async (sm_80+): 16-byte global -> shared copies that complete asynchronously.
#pragma once

#include <cstdint>

namespace flashmla {

// Copies 16 bytes from `src` (global, 16-byte aligned) to shared address `dst` (16-byte aligned), bypassing L1
// (.cg: gathered rows are used once per CTA). When `valid` is false the source size is 0: nothing is read from
// `src` (callers still pass an in-bounds address) and the 16 destination bytes are zero-filled. This is how
// invalid KV indices, padded heads and the topk tail become zero rows without a single out-of-bounds read.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, bool valid) {
    const uint32_t src_bytes = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// cp_async_16_zfill whose L2 miss fetches the whole 256-byte block around `src` (`.L2::256B`): for rows that are
// gathered slab by slab, the next 128-byte slab of the row is then already in L2. The backward's KV gather uses it
// (1.3% faster at V3.2 s_kv 32K, docs/perf-log.md); the forward measured no consistent difference.
__device__ __forceinline__ void cp_async_16_zfill_l2_256(uint32_t dst, const void* src, bool valid) {
    const uint32_t src_bytes = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// L2 prefetch hint for the 128-byte line holding `src` (global, inside a mapped allocation): nothing comes back to
// the SM and nothing waits for it. (`cp.async.bulk.prefetch.L2` takes one uniform address per instruction, so with
// per-thread addresses it compiles to a loop over the distinct addresses; it measured no better in sparse_fwd.)
// 8-byte form (cp.async.ca: 8-byte copies may not use .cg), zero-filled without a read when `valid` is false.
__device__ __forceinline__ void cp_async_8_zfill(uint32_t dst, const void* src, bool valid) {
    const uint32_t src_bytes = valid ? 8u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 4-byte form (cp.async.ca), zero-filled without a read when `valid` is false: per-row scalars (the dense prefill
// backward's lse and delta rows, which have no alignment beyond their element).
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, bool valid) {
    const uint32_t src_bytes = valid ? 4u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Bulk (TMA-engine) store of `bytes` (a multiple of 16) from shared address `src` to global `dst` (both 16-byte
// aligned), in the thread's current bulk group, with an L2 evict_last hint: the decode's partials are read back by
// the combine kernel right after (without the hint that combine ran up to 1.3x longer). The shared bytes must have
// been made visible to the async proxy (fence.proxy.async.shared::cta after the writes). Stores issued this way do
// not occupy the SM's load/store path: a CTA's 128 KB decode partial took 8-10 us through st.global.
__device__ __forceinline__ void bulk_store_s2g_keep(void* dst, uint32_t src, uint32_t bytes) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst),
                 "r"(src), "r"(bytes), "l"(policy)
                 : "memory");
}
// Bulk (TMA-engine) reduction: dst[0 .. bytes / 4) += the f32 values at shared address `src` (relaxed adds at the
// L2, in the thread's current bulk group; both 16-byte aligned, `bytes` a multiple of 16). The adds take no issue
// slots of the SM's warps: f32 `red.global` issued by warps that also issue wgmma cost them 35-40% of their MMA rate
// (docs/perf-log.md). The shared bytes must have been made visible to the async proxy first.
__device__ __forceinline__ void bulk_reduce_add_f32_s2g(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until the thread's bulk groups have read their shared-memory sources (the area may be reused).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Waits until the thread's bulk groups are complete (their global writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void prefetch_l2(const void* src) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
}

}  // namespace flashmla
