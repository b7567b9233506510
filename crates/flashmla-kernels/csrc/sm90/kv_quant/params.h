// Parameters of the FP8 KV-cache quantise / dequantise kernels (docs/spec.md section 3).
// Mirrors `KvQuantParams` in crates/flashmla/src/ops/kv_quant/launch.rs (#[repr(C)]): same fields, order and types.
// The layout is checked by machine: build.rs lays out every struct of this header with the host compiler, and the
// Rust mirror (`device_params!`) fails to compile unless every field has the same name, offset and size and the
// struct the same size (docs/gpu-plumbing.md, "Host/device contract").
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

}  // namespace flashmla::kv_quant
