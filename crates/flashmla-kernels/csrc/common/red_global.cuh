// Fire-and-forget global reductions (sm_90): the thread issues the add and moves on; the L2 performs it. Used to
// scatter f32 gradient rows (d_kv) that many CTAs add into concurrently.
#pragma once

#include <cstdint>

namespace flashmla {

// dst[0..3] += v (f32 adds at L2, relaxed, GPU scope). `dst` must be 16-byte aligned. One instruction moves 16 B,
// so a warp covering 32 distinct 16-byte pieces issues 512 B of adds at once (SASS: REDG.E.ADD.F32x4).
__device__ __forceinline__ void red_add_v4_f32(float* dst, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}

// red_add_v4_f32 predicated on `pred` inside one instruction (no branch, so a warp stays converged around it).
// `dst` must be a valid address even when `pred` is false (it is not accessed then).
__device__ __forceinline__ void red_add_v4_f32_if(bool pred, float* dst, float4 v) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t@p red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n\t}" ::"l"(
            dst),
        "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<uint32_t>(pred))
        : "memory");
}

// *dst += v as a 64-bit integer add at L2 (two's complement, so signed values add correctly). `dst` 8-byte aligned.
__device__ __forceinline__ void red_add_s64(int64_t* dst, int64_t v) {
    asm volatile("red.global.add.u64 [%0], %1;" ::"l"(dst), "l"(v) : "memory");
}

// Fixed-point reductions: a value in units of 2^-kFixedPointFracBits as a signed 64-bit integer. Integer adds are
// associative, so a sum of such values is bitwise the same in every order. Range +-2^31 with 2^-32 resolution;
// the conversion rounds to nearest and saturates (PTX cvt float -> integer clamps; NaN gives 0).
inline constexpr int kFixedPointFracBits = 32;
inline constexpr float kFixedPointOne = 4294967296.0f;  // 2^kFixedPointFracBits: scaling by it is exact
static_assert(static_cast<double>(kFixedPointOne) == static_cast<double>(1ull << kFixedPointFracBits), "2^32");
__device__ __forceinline__ int64_t to_fixed_point(float x) {
    int64_t r;
    asm("cvt.rni.s64.f32 %0, %1;" : "=l"(r) : "f"(x * kFixedPointOne));
    return r;
}
__device__ __forceinline__ double from_fixed_point(int64_t v) {
    return static_cast<double>(v) / static_cast<double>(kFixedPointOne);
}

}  // namespace flashmla
