// The two FP8 KV-cache byte layouts of docs/spec.md section 3, as compile-time traits. Mirrors fp8.rs `KvFormat`
// (same names, same derived constants, same offset formulas); the static_asserts pin the spec numbers.
#pragma once

#include <cstdint>

namespace flashmla::kv_quant {

constexpr int kDRope = 64;      // bf16 RoPE values per token, stored unquantised
constexpr int kBf16Bytes = 2;

// DeepSeek V3.2: per token, 512 e4m3 NoPE values, four f32 scales (one per 128 values), 64 bf16 RoPE values;
// tokens contiguous (656 bytes each).
struct FormatV32 {
    static constexpr int kDNope = 512;
    static constexpr int kTile = 128;
    static constexpr int kScaleBytes = 4;  // f32
    static constexpr int kNumScales = kDNope / kTile;
    static constexpr int kScaleRecordBytes = kNumScales * kScaleBytes;
    static constexpr int kValueBytes = kDNope + kBf16Bytes * kDRope;
    static constexpr int kBytesPerToken = kValueBytes + kScaleRecordBytes;
    static constexpr bool kHasPadByte = false;

    __device__ static int64_t nope_offset(int64_t t) { return t * kBytesPerToken; }
    __device__ static int64_t scale_offset(int64_t t, int64_t /*page_size*/) { return t * kBytesPerToken + kDNope; }
    __device__ static int64_t rope_offset(int64_t t) { return t * kBytesPerToken + kDNope + kScaleRecordBytes; }
};

// DeepSeek V4 "MODEL1": per page of B tokens, first B * 576 bytes of values (448 e4m3 NoPE + 64 bf16 RoPE per
// token), then B * 8 bytes of scales (seven e8m0 bytes, one per 64 NoPE values, and a zero pad byte per token).
struct FormatModel1 {
    static constexpr int kDNope = 448;
    static constexpr int kTile = 64;
    static constexpr int kScaleBytes = 1;  // e8m0
    static constexpr int kNumScales = kDNope / kTile;
    static constexpr int kScaleRecordBytes = kNumScales * kScaleBytes + 1;  // + pad byte
    static constexpr int kValueBytes = kDNope + kBf16Bytes * kDRope;
    static constexpr int kBytesPerToken = kValueBytes + kScaleRecordBytes;
    static constexpr bool kHasPadByte = true;

    __device__ static int64_t nope_offset(int64_t t) { return t * kValueBytes; }
    __device__ static int64_t scale_offset(int64_t t, int64_t page_size) {
        return page_size * kValueBytes + t * kScaleRecordBytes;
    }
    __device__ static int64_t rope_offset(int64_t t) { return t * kValueBytes + kDNope; }
};

static_assert(FormatV32::kBytesPerToken == 656, "spec: V3.2 is 656 bytes/token (512 + 4*4 + 64*2)");
static_assert(FormatModel1::kBytesPerToken == 584, "spec: MODEL1 is 584 bytes/token (448 + 64*2 + 8)");
static_assert(FormatV32::kNumScales == 4 && FormatModel1::kNumScales == 7, "spec scale counts");

}  // namespace flashmla::kv_quant
