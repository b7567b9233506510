// FP8 building blocks shared by the KV-cache kernels: exact IEEE arithmetic that --use_fast_math cannot touch,
// e4m3 / e8m0 / bf16 conversions, and the reference quantiser's power-of-two scale.
//
// Every function here is bit-exact with crates/flashmla/src/fp8.rs (and the bf16 rounding of the `half` crate), which
// is the CPU truth the kernels are tested against. The build compiles with --use_fast_math, i.e. -ftz=true and
// approximate division: a plain `a / b` or `a * b` would flush subnormals (the scale 2^-127 is one) and round the
// division differently, so the few operations whose exact result matters are written as inline PTX without `.ftz`.
#pragma once

#include <cstdint>

namespace flashmla {

// Largest finite e4m3fn magnitude (fp8.rs E4M3_MAX).
constexpr float kE4m3Max = 448.0f;
// Smallest scale the reference quantiser picks (fp8.rs SCALE_FLOOR); the same decimal rounds to the same f32.
constexpr float kScaleFloor = 1e-4f;
// e4m3fn NaN code (sign bit clear); the sign of a NaN input is ORed in.
constexpr uint32_t kE4m3NanCode = 0x7Fu;
constexpr uint32_t kE4m3SignBit = 0x80u;
constexpr uint32_t kE4m3MagnitudeMask = 0x7Fu;

// IEEE single precision bit fields.
constexpr int kF32MantissaBits = 23;
constexpr int kF32ExponentBias = 127;
constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32MantissaMask = 0x007FFFFFu;
constexpr uint32_t kF32ExponentMask = 0xFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;
// 2^-127, the one subnormal power of two the scales reach (scale 2^127 for a tile holding +-inf).
constexpr uint32_t kF32TwoPowMinus127 = 0x00400000u;
// Largest scale exponent: 2^127 is the largest finite power of two.
constexpr int kMaxScaleExponent = 127;

// bfloat16 bit fields (the top half of an f32).
constexpr uint32_t kBf16AbsMask = 0x7FFFu;
constexpr uint32_t kBf16Inf = 0x7F80u;
constexpr uint32_t kBf16QuietBit = 0x0040u;
// The NaN every dequantised NoPE value that is NaN becomes (NaN payloads are not part of the contract).
constexpr uint32_t kBf16CanonicalNan = 0x7FC0u;

// e8m0 scale bytes (fp8.rs e8m0_to_f32): 2^(b - 127); 0 is the subnormal 2^-127; 255 is NaN.
constexpr uint32_t kE8m0Nan = 255u;
constexpr uint32_t kF32CanonicalNan = 0x7FC00000u;

// a * b in IEEE f32, round to nearest even, subnormal inputs and results kept (no .ftz).
__device__ __forceinline__ float mul_rn_ieee(float a, float b) {
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// a / b in IEEE f32, correctly rounded (fast-math would otherwise use an approximate division).
__device__ __forceinline__ float div_rn_ieee(float a, float b) {
    float d;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// True when the f32 bit pattern is a NaN.
__device__ __forceinline__ bool f32_bits_is_nan(uint32_t bits) { return (bits & kF32AbsMask) > kF32Inf; }

// |x| as bits, or 0 for NaN: an unsigned max over these is Rust's `fold(0.0, |m, v| m.max(v.abs()))`, which
// skips NaN (f32::max returns the non-NaN operand). Ordering non-NaN magnitudes by their bits is exact.
__device__ __forceinline__ uint32_t abs_bits_skip_nan(uint32_t bits) {
    return f32_bits_is_nan(bits) ? 0u : (bits & kF32AbsMask);
}

// The exponent e of the reference scale 2^e = 2^ceil(log2(max(amax / 448, 1e-4))), clamped to 127
// (fp8.rs pow2_scale). `amax` is never NaN here (see abs_bits_skip_nan); +inf gives 127. Result in [-13, 127].
__device__ __forceinline__ int pow2_scale_exponent(float amax) {
    float v = div_rn_ieee(amax, kE4m3Max);
    v = v > kScaleFloor ? v : kScaleFloor;
    const uint32_t bits = __float_as_uint(v);
    int e = int((bits >> kF32MantissaBits) & kF32ExponentMask) - kF32ExponentBias;
    if (bits & kF32MantissaMask) e += 1;
    return e < kMaxScaleExponent ? e : kMaxScaleExponent;
}

// 2^e as f32 for e in [-127, 127] (2^-127 is subnormal).
__device__ __forceinline__ float exp2_int(int e) {
    return e >= 1 - kF32ExponentBias ? __uint_as_float(uint32_t(e + kF32ExponentBias) << kF32MantissaBits)
                                     : __uint_as_float(kF32TwoPowMinus127);
}

// e8m0 byte -> f32 scale, as fp8.rs e8m0_to_f32.
__device__ __forceinline__ float e8m0_to_f32(uint32_t b) {
    if (b == kE8m0Nan) return __uint_as_float(kF32CanonicalNan);
    if (b == 0) return __uint_as_float(kF32TwoPowMinus127);
    return __uint_as_float(b << kF32MantissaBits);
}

// Two f32 -> two e4m3fn codes (lo in bits 0..8, hi in bits 8..16), round to nearest even, saturating to +-448
// (inf included). NaN inputs are patched by the caller (the hardware's NaN code is not specified to keep the sign).
__device__ __forceinline__ uint32_t e4m3x2_from_f32_satfinite(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// A code of magnitude zero carries the sign of the product it came from (fp8.rs e4m3_from_f32 takes the sign
// from the f32 bits): keeps -0 for negative products that round to zero whatever the conversion does with
// subnormal inputs.
__device__ __forceinline__ uint32_t patch_zero_sign(uint32_t code, uint32_t product_bits) {
    return (code & kE4m3MagnitudeMask) == 0 ? ((product_bits >> 24) & kE4m3SignBit) : code;
}

// e4m3 code of an already-NaN-free product, or 0x7F | sign when the *input* bits were NaN (fp8.rs e4m3_from_f32
// of `x * inv`: a NaN keeps its sign through the multiplication on the CPU, while the GPU's multiply returns the
// canonical NaN, so the sign is taken from the input).
__device__ __forceinline__ uint32_t patch_nan_code(uint32_t code, uint32_t input_bits) {
    return f32_bits_is_nan(input_bits) ? (kE4m3NanCode | ((input_bits >> 24) & kE4m3SignBit)) : code;
}

// Two e4m3fn codes (bits 0..8, 8..16) -> two f32 (exact; NaN codes give NaN).
__device__ __forceinline__ void e4m3x2_to_f32(uint32_t codes, float& lo, float& hi) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(codes)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(uint16_t(h2 & 0xFFFFu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(uint16_t(h2 >> 16)));
}

// f32 -> bf16 bits, round to nearest even (the `half` crate's bf16::from_f32 for every non-NaN input, subnormals
// included); any NaN becomes the canonical 0x7FC0.
__device__ __forceinline__ uint32_t bf16_bits_from_f32_rne(float f) {
    const uint32_t x = __float_as_uint(f);
    if (f32_bits_is_nan(x)) return kBf16CanonicalNan;
    const uint32_t lsb = (x >> 16) & 1u;
    return (x + 0x7FFFu + lsb) >> 16;
}

// Sets the quiet bit of every NaN among the two bf16 values of `w` (what a bf16 -> f32 -> bf16 round trip through
// the `half` crate does); other values pass unchanged.
__device__ __forceinline__ uint32_t bf16x2_quiet_nans(uint32_t w) {
    uint32_t lo = w & 0xFFFFu, hi = w >> 16;
    if ((lo & kBf16AbsMask) > kBf16Inf) lo |= kBf16QuietBit;
    if ((hi & kBf16AbsMask) > kBf16Inf) hi |= kBf16QuietBit;
    return lo | (hi << 16);
}

}  // namespace flashmla
