// Parameters of the FP8 KV-cache quantise / dequantise kernels (docs/spec.md section 3).
// Mirrors `KvQuantParams` in crates/flashmla/src/ops/kv_quant/launch.rs (#[repr(C)]): same fields, order and types;
// both sides assert the size and offsets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmla::kv_quant {

struct Params {
    // bf16 values (as bits) [num_blocks, page_size, 1, d_qk], last dimension contiguous: element (b, t, 0, i) is
    // kv[b * kv_block_stride + t * kv_token_stride + i]. Read by quantise, written by dequantise.
    uint16_t* kv;
    // u8 cache [num_blocks, page_size, 1, bytes_per_token]: block b starts at cache + b * cache_block_stride and holds
    // page_size tokens in the format's layout (fp8.rs KvFormat). Bytes between blocks are never touched.
    uint8_t* cache;
    int64_t kv_block_stride;     // elements
    int64_t kv_token_stride;     // elements
    int64_t cache_block_stride;  // bytes
    int32_t num_blocks;
    int32_t page_size;
    int32_t num_tokens;  // num_blocks * page_size
    int32_t reserved;    // keeps the size a multiple of 8 on both sides; 0
};

static_assert(sizeof(Params) == 56, "Params must match the Rust KvQuantParams");
static_assert(offsetof(Params, kv_block_stride) == 16, "Params layout");
static_assert(offsetof(Params, cache_block_stride) == 32, "Params layout");
static_assert(offsetof(Params, num_blocks) == 40, "Params layout");
static_assert(offsetof(Params, num_tokens) == 48, "Params layout");
static_assert(offsetof(Params, reserved) == 52, "Params layout");

}  // namespace flashmla::kv_quant
