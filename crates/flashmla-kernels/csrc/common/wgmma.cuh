// wgmma (sm_90a): shared-memory matrix descriptors, the fence/commit/wait protocol, and the MMA shapes the
// kernels issue (m64n32 / m64n64 / m64n128 with both operands K-major, m64n128 / m64n192 / m64n256 with B MN-major,
// m64n16 / m64n32 with A MN-major for the narrow decode). Layout conventions (SW128 slabs, fragment layouts) are in
// smem_layout.cuh.
//
// ## Matrix descriptor (64 bits, PTX ISA "matrix descriptor format")
//   bits  0-13: start address  >> 4 (shared-state-space byte address; < 256 KB so 14 bits suffice)
//   bits 16-29: leading-dimension byte offset (LBO) >> 4
//   bits 32-45: stride-dimension byte offset  (SBO) >> 4
//   bits 49-51: base offset (0: every slab base is 1024-byte aligned, so the swizzle phase starts at row 0)
//   bits 62-63: swizzle mode (1 = 128B, 2 = 64B, 3 = 32B, 0 = none)
// For 128B-swizzled operands, in units of bytes:
//   K-major  (16-wide k-step inside one 128-byte row): SBO = 1024 (next group of 8 M/N rows); LBO unused (set 16).
//            Advancing k by 16 inside a slab adds 32 bytes to the start address (the swizzle is applied to the
//            computed address, so the permutation of smem_layout.cuh is reproduced).
//   MN-major (rows are K, 64 N values per 128-byte row): LBO = bytes between N-adjacent slabs (next 64 columns),
//            SBO = 1024 (next group of 8 K rows). Advancing k by 16 adds 16 * 128 = 2048 bytes.
//
// ## Protocol
// wgmma_fence() before the first MMA of a batch whenever the accumulator or A-fragment registers were touched by
// ordinary instructions since the last MMA; MMAs of one batch chained on the same accumulator need no fence.
// wgmma_commit() closes a group; wgmma_wait<N>() waits until at most N groups are pending (groups retire in
// order). The accumulators must not be read before the wait: wgmma_fence_regs() pins them in place so the
// compiler cannot hoist their uses above the wait.
#pragma once

#include <cstdint>

namespace flashmla {

enum class WgmmaSwizzle : uint64_t { None = 0, B128 = 1, B64 = 2, B32 = 3 };

// Builds a descriptor for a 128B-swizzled operand at shared address `smem_byte_addr` (1024-byte aligned slab base,
// plus a k-step offset for K-major operands). `lbo` and `sbo` in bytes (multiples of 16).
__device__ __forceinline__ uint64_t make_wgmma_desc_sw128(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
    constexpr uint32_t kField = 0x3FFF;  // 14-bit fields
    uint64_t d = 0;
    d |= static_cast<uint64_t>((smem_byte_addr >> 4) & kField);
    d |= static_cast<uint64_t>((lbo >> 4) & kField) << 16;
    d |= static_cast<uint64_t>((sbo >> 4) & kField) << 32;
    d |= static_cast<uint64_t>(WgmmaSwizzle::B128) << 62;
    return d;
}

// A descriptor whose start address is `bytes` further (bytes a multiple of 16; the 14-bit address field cannot
// carry over because shared addresses stay below 256 KB).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    return desc + static_cast<uint64_t>(bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Compiler-only fence on accumulator registers (no instruction emitted).
template <int N>
__device__ __forceinline__ void wgmma_fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_fence_regs(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The MMAs. `accumulate == false` overwrites D (scale-d = 0), true adds to it. f32 accumulators; the inputs are
// bf16 (`E = Bf16`, the default) or fp16 (`E = F16`): the element type only changes the instruction's type suffix.

// Input element types of the MMAs.
struct Bf16 {};
struct F16 {};
template <class E>
inline constexpr bool kIsF16 = false;
template <>
inline constexpr bool kIsF16<F16> = true;

// Issues one wgmma whose PTX text is `FLASHMLA_WGMMA_TEXT(type)`, picking the type suffix from E at compile time.
#define FLASHMLA_WGMMA_ASM(E, TEXT, OUTS, ...)                           \
    do {                                                              \
        if constexpr (kIsF16<E>) {                                    \
            asm volatile(TEXT("f16") : OUTS : __VA_ARGS__);           \
        } else {                                                      \
            asm volatile(TEXT("bf16") : OUTS : __VA_ARGS__);          \
        }                                                             \
    } while (0)
#define FLASHMLA_WGMMA_D16 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define FLASHMLA_WGMMA_D32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FLASHMLA_WGMMA_D64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FLASHMLA_WGMMA_D96 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define FLASHMLA_WGMMA_D128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// PTX texts, by shape and operand source; T is the element type's suffix ("bf16" or "f16").
#define FLASHMLA_WGMMA_N32_SS_KK(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
#define FLASHMLA_WGMMA_N64_SS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
#define FLASHMLA_WGMMA_N64_RS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
#define FLASHMLA_WGMMA_N128_SS_KK(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
#define FLASHMLA_WGMMA_N128_SS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
#define FLASHMLA_WGMMA_N128_RS_MN(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
#define FLASHMLA_WGMMA_N192_RS_MN(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n192k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    "}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
#define FLASHMLA_WGMMA_N192_SS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n192k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    "}, %96, %97, p, 1, 1, %99, %100;\n}\n"
#define FLASHMLA_WGMMA_N256_SS_KMN(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
    "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
#define FLASHMLA_WGMMA_N256_RS_MN(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
    "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"

#define FLASHMLA_WGMMA_D8 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define FLASHMLA_WGMMA_N16_SS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n16k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7" \
    "}, %8, %9, p, 1, 1, %11, %12;\n}\n"
#define FLASHMLA_WGMMA_N32_SS(T) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    "}, %16, %17, p, 1, 1, %19, %20;\n}\n"

// D[64 x kN] (+)= A[64x16] B[16 x kN] for the narrow N of few query rows (kN 16 or 32), both operands in shared
// memory; kMnA / kMnB as for wgmma_m64n64k16_ss. The accumulator holds kN / 2 floats per thread.
template <int kN, int kMnA, int kMnB, class E = Bf16>
__device__ __forceinline__ void wgmma_m64nk16_ss(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                                 bool accumulate) {
    static_assert(kN == 16 || kN == 32, "narrow wgmma: N 16 or 32");
    static_assert((kMnA == 0 || kMnA == 1) && (kMnB == 0 || kMnB == 1), "transpose immediates are 0 or 1");
    if constexpr (kN == 16) {
        FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N16_SS, FLASHMLA_WGMMA_D8,
                           "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kMnA), "n"(kMnB));
    } else {
        FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N32_SS, FLASHMLA_WGMMA_D16,
                           "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kMnA), "n"(kMnB));
    }
}

// D[64x32] (+)= A[64x16] B[32x16]^T; A and B K-major in shared memory (descriptors).
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n32k16_ss_kk(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                      bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N32_SS_KK, FLASHMLA_WGMMA_D16,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64x64] (+)= A[64x16] B[16x64], both operands in shared memory (descriptors). kMnA / kMnB select each operand's
// major-ness (the instruction's transpose immediates): 0 = K-major (B then stored as [64 N][16 K], i.e. B^T), 1 =
// MN-major (M / N contiguous).
template <int kMnA, int kMnB, class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
    static_assert((kMnA == 0 || kMnA == 1) && (kMnB == 0 || kMnB == 1), "transpose immediates are 0 or 1");
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N64_SS, FLASHMLA_WGMMA_D32,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kMnA), "n"(kMnB));
}

// D[64x64] (+)= A[64x16] B[16x64]; A in registers (fragment layout: smem_layout.cuh), B in shared memory, K-major
// (kMnB = 0) or MN-major (kMnB = 1).
template <int kMnB, class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   bool accumulate) {
    static_assert(kMnB == 0 || kMnB == 1, "transpose immediate is 0 or 1");
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N64_RS, FLASHMLA_WGMMA_D32,
                       "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
                       "n"(kMnB));
}

// The forms the kernels issue, by operand major-ness (k = K-major, mn = MN-major; A first).
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss_kk(float (&d)[32], uint64_t a, uint64_t b, bool acc) {
    wgmma_m64n64k16_ss<0, 0, E>(d, a, b, acc);
}
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss_kmn(float (&d)[32], uint64_t a, uint64_t b, bool acc) {
    wgmma_m64n64k16_ss<0, 1, E>(d, a, b, acc);
}
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss_mnmn(float (&d)[32], uint64_t a, uint64_t b, bool acc) {
    wgmma_m64n64k16_ss<1, 1, E>(d, a, b, acc);
}
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n64k16_rs_kk(float (&d)[32], const uint32_t (&a)[4], uint64_t b, bool acc) {
    wgmma_m64n64k16_rs<0, E>(d, a, b, acc);
}

// D[64x128] (+)= A[64x16] B[128x16]^T; A and B K-major in shared memory (descriptors).
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n128k16_ss_kk(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                       bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N128_SS_KK, FLASHMLA_WGMMA_D64,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64x128] (+)= A[64x16] B[16x128], both operands in shared memory; kMnA / kMnB as for wgmma_m64n64k16_ss.
template <int kMnA, int kMnB, class E = Bf16>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                    bool accumulate) {
    static_assert((kMnA == 0 || kMnA == 1) && (kMnB == 0 || kMnB == 1), "transpose immediates are 0 or 1");
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N128_SS, FLASHMLA_WGMMA_D64,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kMnA), "n"(kMnB));
}

// D[64x128] (+)= A[64x16] B[16x128]; A in registers (fragment layout: smem_layout.cuh), B MN-major in shared
// memory.
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n128k16_rs_mn(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                       bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N128_RS_MN, FLASHMLA_WGMMA_D64,
                       "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64x192] (+)= A[64x16] B[16x192]; A in registers, B MN-major in shared memory.
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n192k16_rs_mn(float (&d)[96], const uint32_t (&a)[4], uint64_t desc_b,
                                                       bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N192_RS_MN, FLASHMLA_WGMMA_D96,
                       "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64x192] (+)= A[64x16] B[16x192], both operands in shared memory; kMnA / kMnB as for wgmma_m64n64k16_ss.
template <int kMnA, int kMnB, class E = Bf16>
__device__ __forceinline__ void wgmma_m64n192k16_ss(float (&d)[96], uint64_t desc_a, uint64_t desc_b,
                                                    bool accumulate) {
    static_assert((kMnA == 0 || kMnA == 1) && (kMnB == 0 || kMnB == 1), "transpose immediates are 0 or 1");
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N192_SS, FLASHMLA_WGMMA_D96,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kMnA), "n"(kMnB));
}

// D[64x256] (+)= A[64x16] B[16x256]; A K-major in shared memory, B MN-major (N contiguous) in shared memory.
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n256k16_ss_kmn(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                        bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N256_SS_KMN, FLASHMLA_WGMMA_D128,
                       "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// D[64x256] (+)= A[64x16] B[16x256]; A in registers (fragment layout: smem_layout.cuh), B MN-major in shared
// memory.
template <class E = Bf16>
__device__ __forceinline__ void wgmma_m64n256k16_rs_mn(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b,
                                                       bool accumulate) {
    FLASHMLA_WGMMA_ASM(E, FLASHMLA_WGMMA_N256_RS_MN, FLASHMLA_WGMMA_D128,
                       "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

// Two floats to a packed pair of E (bf16 or fp16), `lo` in the low half (the lower column), round to nearest even.
template <class E = Bf16>
__device__ __forceinline__ uint32_t pack_x2(float lo, float hi) {
    uint32_t r;
    if constexpr (kIsF16<E>) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

}  // namespace flashmla
