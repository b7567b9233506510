// Explicit shared-memory accesses by 32-bit shared-state-space address (the form the swizzled-layout arithmetic
// of smem_layout.cuh produces), so no generic-to-shared conversion sits in hot loops.
#pragma once

#include <cstdint>

namespace flashmla {

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

}  // namespace flashmla
