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
__device__ __forceinline__ void prefetch_l2(const void* src) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
}

}  // namespace flashmla
