// Keys of the sparse FP8 decode (docs/decode.md, "Sparse FP8 decode"): key position `key` of request `req` is entry
// `key` of its main index row, or entry `key - main` of its extra index row past the main entries. An index names a
// token `block * page_size + offset` of its cache; any value outside 0..num_blocks * page_size is a missing key whose
// bytes are never read. The producer dequantises each key row into the same SW128 bf16 slabs the dense decode
// gathers, so the consumers are the dense decode's.
//
// Producer scheme per 64-key tile (docs/decode.md, "Sparse FP8 decode"): thread t of the producer warpgroup owns
// row r = t / 2 of the tile and half h = t % 2 of every 64-column slab (bf16 columns 32 h .. 32 h + 31 of the slab,
// i.e. logical 16-byte chunks 4 h .. 4 h + 3 of row r). It copies its 32 raw e4m3 bytes of each NoPE slab with
// cp.async into the first two of those chunks (no registers held while the bytes travel), the RoPE bf16 bytes
// straight to their place, and loads its row's scales into registers. Once its copies landed it dequantises each
// slab in place: both raw chunks are read before any of its four output chunks is written, and no other thread
// touches them, so no barrier is needed inside the warpgroup.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/cp_async.cuh"
#include "common/cluster.cuh"
#include "common/cp_async_group.cuh"
#include "common/fp8.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"
#include "common/wgmma.cuh"
#include "sm90/decode/config.cuh"
#include "sm90/decode/params.h"
#include "sm90/decode/schedule.cuh"
#include "sm90/kv_quant/format.cuh"

namespace flashmla::decode {

// The byte layout of a d_qk's cache format: the FP8 codec's traits (sm90/kv_quant/format.cuh, docs/spec.md
// section 3), so the decode and the codec read the same bytes.
template <int kDqk>
using Fp8Format = std::conditional_t<kDqk == 576, kv_quant::FormatV32, kv_quant::FormatModel1>;

// The index rows of chunk c's request in the main and the extra index tensors, found once per chunk: a request's
// (batch, token) is its number divided by s_q, which a tile's index loads would otherwise redo.
struct IndexRows {
    const int32_t* main;
    const int32_t* extra;  // not dereferenced without an extra cache (every key is then below c.main)
    static __device__ __forceinline__ IndexRows of(const DecodeParams& p, const Chunk& c) {
        const int64_t b = request_batch(p, c.b);
        const int64_t s = request_token(p, c.b);
        return {p.indices + b * p.indices_stride_b + s * p.indices_stride_s,
                p.extra_indices + b * p.extra_indices_stride_b + s * p.extra_indices_stride_s};
    }
};

// The raw index of key `key` of chunk c (-1 past the request's keys). Loaded a tile ahead of its use.
__device__ __forceinline__ int sparse_index(const IndexRows& rows, const Chunk& c, int key) {
    if (key >= c.len) return -1;
    return key < c.main ? __ldg(rows.main + key) : __ldg(rows.extra + (key - c.main));
}

// The same, finding the request's index row at every call: what the pair kernels' score warpgroup runs (at 232
// registers the rows held across its tile loop cost those kernels 1-4%, docs/perf-log.md).
__device__ __forceinline__ int sparse_index(const DecodeParams& p, const Chunk& c, int key) {
    if (key >= c.len) return -1;
    if (key < c.main) {
        return __ldg(p.indices + request_offset(p, c.b, p.indices_stride_b, p.indices_stride_s) + key);
    }
    return __ldg(p.extra_indices + request_offset(p, c.b, p.extra_indices_stride_b, p.extra_indices_stride_s) +
                 (key - c.main));
}

// A key's row: its block's first byte and its token in the block; block == nullptr for a missing key.
struct Fp8Row {
    const uint8_t* block;
    int t;
    int page_size;  // of the key's cache (MODEL1 places a block's scales after its B tokens)
};

// The row of index `idx` at key position `key` (main or extra cache by position).
__device__ __forceinline__ Fp8Row sparse_row(const DecodeParams& p, const Chunk& c, int key, int idx) {
    const bool extra = key >= c.main;
    const int page = extra ? p.extra_page_size : p.page_size;
    const int blocks = extra ? p.extra_num_blocks : p.num_blocks;
    if (idx < 0) return {nullptr, 0, page};
    const int blk = extra ? fast_div(idx, p.extra_page_div_mul, p.extra_page_div_shr) : page_div(p, idx);
    if (blk >= blocks) return {nullptr, 0, page};
    const uint8_t* base = extra ? p.extra_cache : reinterpret_cast<const uint8_t*>(p.k_cache);
    const int64_t stride = extra ? p.extra_stride_block : p.k_stride_block;
    return {base + static_cast<int64_t>(blk) * stride, idx - blk * page, page};
}

// Whether index `idx` at key position `key` names a token of its cache (the consumers' mask).
__device__ __forceinline__ bool sparse_valid(const DecodeParams& p, const Chunk& c, int key, int idx) {
    const bool extra = key >= c.main;
    const int64_t tokens = extra ? static_cast<int64_t>(p.extra_num_blocks) * p.extra_page_size
                                 : static_cast<int64_t>(p.num_blocks) * p.page_size;
    return idx >= 0 && idx < tokens;  // = sparse_row(...).block != nullptr, without its division
}

// Four e4m3 codes -> two bf16x2 words of code * scale (the code is exact in f16, the product is rounded to bf16 once,
// to nearest even, as the CPU dequantiser does).
__device__ __forceinline__ uint2 dequant4(uint32_t codes, float scale) {
    float a0, a1, b0, b1;
    e4m3x2_to_f32(codes & 0xFFFFu, a0, a1);
    e4m3x2_to_f32(codes >> 16, b0, b1);
    return make_uint2(pack_bf16x2(a0 * scale, a1 * scale), pack_bf16x2(b0 * scale, b1 * scale));
}

// A producer thread's part of a tile: its row, its half, and the byte offset inside any slab of its chunk j (0..3),
// swizzled.
struct RawLane {
    int row;         // t / 2
    int half;        // t % 2
    uint32_t base;   // row * 128
    uint32_t phase;  // (4 half) ^ (row % 8): chunk 4 half + j sits at physical chunk phase ^ j
    static __device__ __forceinline__ RawLane of(int t) {
        const int row = t / 2, half = t % 2;
        return {row, half, static_cast<uint32_t>(row * kSw128RowBytes),
                static_cast<uint32_t>((4 * half) ^ (row % kSw128AtomRows))};
    }
    // == sw128_chunk_offset(row, 4 half + j) for j in 0..3.
    __device__ __forceinline__ uint32_t chunk(int j) const {
        return base + ((phase ^ static_cast<uint32_t>(j)) * kSw128ChunkBytes);
    }
};

// The scales of a row, raw: V3.2 four f32 (one per 128 NoPE columns), MODEL1 seven e8m0 bytes (one per 64) in
// the low bytes of x, y. All zero for a missing key.
template <int kDqk>
__device__ __forceinline__ uint4 load_scales(const Fp8Row& r) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r.block == nullptr) return v;
    // 8-byte loads: a token's scale record is 8-byte aligned whatever the (8-byte aligned) block stride.
    const uint2* src = reinterpret_cast<const uint2*>(r.block + Fp8Format<kDqk>::scale_offset(r.t, r.page_size));
    const uint2 a = __ldg(src);
    v.x = a.x;
    v.y = a.y;
    if constexpr (Fp8Format<kDqk>::kScaleRecordBytes > 8) {  // V3.2: four f32
        const uint2 b = __ldg(src + 1);
        v.z = b.x;
        v.w = b.y;
    }
    return v;
}

// The f32 scale of NoPE slab s. e8m0: 2^(e - 127); e = 0 is the subnormal 2^-127 (flushed to 0 like any product
// below 2^-126 by the fast-math multiply), 255 is NaN.
template <int kDqk>
__device__ __forceinline__ float slab_scale(const uint4& raw, int s) {
    if constexpr (kDqk == 576) {
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        return __uint_as_float(w[s / 2]);
    } else {
        const uint32_t e = ((s < 4 ? raw.x : raw.y) >> (8 * (s % 4))) & 0xFFu;
        return e == 255u ? __uint_as_float(0x7FC00000u) : __uint_as_float(e << 23);
    }
}

// One 16-byte piece of a row into shared memory: one 16-byte copy, or two 8-byte ones for a cache that is only
// 8-byte aligned.
__device__ __forceinline__ void copy_piece(uint32_t dst, const uint8_t* src, bool ok, bool copy8) {
    if (copy8) {
        cp_async_8_zfill(dst, src, ok);
        cp_async_8_zfill(dst + 8, src + 8, ok);
    } else {
        cp_async_16_zfill_l2_256(dst, src, ok);
    }
}

// Copies the thread's 32 raw bytes of NoPE slab s (zeros for a missing key) into its chunks 0 and 1 of the slab.
template <int kDqk>
__device__ __forceinline__ void copy_nope_raw(uint32_t stage_addr, const RawLane& lane, const Fp8Row& r, int s,
                                              const void* never_read, bool copy8) {
    using C = Config<kDqk>;
    const bool ok = r.block != nullptr;
    const uint8_t* src = ok ? r.block + Fp8Format<kDqk>::nope_offset(r.t) + 64 * s + 32 * lane.half
                            : static_cast<const uint8_t*>(never_read);
    const uint32_t slab = stage_addr + s * C::kSlabBytes;
    copy_piece(slab + lane.chunk(0), src, ok, copy8);
    copy_piece(slab + lane.chunk(1), src + 16, ok, copy8);
}

// Copies the thread's 64 bytes of the RoPE slab (bf16, not quantised) to their place.
template <int kDqk>
__device__ __forceinline__ void copy_rope(uint32_t stage_addr, const RawLane& lane, const Fp8Row& r,
                                          const void* never_read, bool copy8) {
    using C = Config<kDqk>;
    using F = Fp8Format<kDqk>;
    const bool ok = r.block != nullptr;
    const uint8_t* src = ok ? r.block + F::rope_offset(r.t) + 64 * lane.half : static_cast<const uint8_t*>(never_read);
    const uint32_t slab = stage_addr + (F::kDNope / kSw128ColsBf16) * C::kSlabBytes;
#pragma unroll
    for (int j = 0; j < 4; ++j) copy_piece(slab + lane.chunk(j), src + 16 * j, ok, copy8);
}

// The thread's two raw chunks of NoPE slab s.
struct RawChunks {
    uint4 a, b;
};
template <int kDqk>
__device__ __forceinline__ RawChunks read_raw(uint32_t stage_addr, const RawLane& lane, int s) {
    const uint32_t slab = stage_addr + s * Config<kDqk>::kSlabBytes;
    return {ld_shared_v4(slab + lane.chunk(0)), ld_shared_v4(slab + lane.chunk(1))};
}

// Dequantises NoPE slabs [kFirst, kEnd) of the thread's row in place: 32 codes from chunks 0, 1 -> 32 bf16 in
// chunks 0..3 per slab. The raw chunks of slab s + 1 are read before slab s is written (different slabs), so the
// shared-memory latency overlaps the conversions.
template <int kDqk, int kFirst, int kEnd>
__device__ __forceinline__ void dequant_slabs(uint32_t stage_addr, const RawLane& lane, const uint4& scales) {
    RawChunks raw = read_raw<kDqk>(stage_addr, lane, kFirst);
#pragma unroll
    for (int s = kFirst; s < kEnd; ++s) {
        RawChunks next = raw;
        if (s + 1 < kEnd) next = read_raw<kDqk>(stage_addr, lane, s + 1);
        const uint32_t slab = stage_addr + s * Config<kDqk>::kSlabBytes;
        const float scale = slab_scale<kDqk>(scales, s);
        const uint32_t codes[8] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w, raw.b.x, raw.b.y, raw.b.z, raw.b.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint2 lo = dequant4(codes[2 * j], scale), hi = dequant4(codes[2 * j + 1], scale);
            st_shared_v4(slab + lane.chunk(j), make_uint4(lo.x, lo.y, hi.x, hi.y));
        }
        raw = next;
    }
}

// The *_pair kernels (the two CTAs of an h_q 128 cluster attend to the same keys): CTA `rank` owns rows
// 32 rank .. 32 rank + 31 of every tile; thread t owns row 32 rank + t / 4 and quarter q = t % 4 of every 64-column
// slab (bf16 columns 16 q .. 16 q + 15: logical chunks 2 q, 2 q + 1). It loads its 16 raw bytes of each NoPE slab
// (and its 32 bytes of the RoPE slab) into registers (PairRegs), dequantises them and writes the 16 bf16 to its own
// stage and, with st.async completing on the peer's full barrier, to the peer's: each CTA converts half the values a
// tile needs.
struct SplitLane {
    int row;         // tile row
    int quarter;     // t % 4
    uint32_t base;   // row * 128
    uint32_t phase;  // (2 quarter) ^ (row % 8)
    static __device__ __forceinline__ SplitLane of(int t, uint32_t rank) {
        const int row = 32 * static_cast<int>(rank) + t / 4, quarter = t % 4;
        return {row, quarter, static_cast<uint32_t>(row * kSw128RowBytes),
                static_cast<uint32_t>((2 * quarter) ^ (row % kSw128AtomRows))};
    }
    // == sw128_chunk_offset(row, 2 quarter + j) for j in 0..1.
    __device__ __forceinline__ uint32_t chunk(int j) const {
        return base + ((phase ^ static_cast<uint32_t>(j)) * kSw128ChunkBytes);
    }
};

// A 16-byte piece of a row loaded into registers (zeros for a missing key): one 16-byte load, or two 8-byte ones
// for a cache that is only 8-byte aligned. Read-only path: the cache does not change during the call.
__device__ __forceinline__ uint4 load_piece(const uint8_t* src, bool ok, bool copy8) {
    if (!ok) return make_uint4(0u, 0u, 0u, 0u);
    if (copy8) {
        const uint2 a = __ldg(reinterpret_cast<const uint2*>(src));
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(src + 8));
        return make_uint4(a.x, a.y, b.x, b.y);
    }
    return __ldg(reinterpret_cast<const uint4*>(src));
}

// The pair producer's registers for one key tile: the split thread's 16 raw bytes of every NoPE slab, its row's
// scales and its 32 bytes of the RoPE slab (row 32 rank + t / 4, quarter t % 4): each CTA sends its 32 rows of the
// RoPE slab to the other, as the NoPE. Loaded before the stage is released, so that the rows' latency overlaps the
// wait.
template <int kDqk>
struct PairRegs {
    static constexpr int kNopeSlabs = Fp8Format<kDqk>::kDNope / kSw128ColsBf16;
    uint4 nope[kNopeSlabs];
    uint4 scales;
    uint4 rope[2];
    // The pieces the rope and left groups need (the scales, V3.2's RoPE, NoPE slabs 0..3), then those of the right
    // group (NoPE slabs 4.., MODEL1's RoPE): the producer loads the next tile's left pieces as soon as it stored this
    // tile's, so they travel while it converts this tile's right group.
    __device__ __forceinline__ void load_left(const Fp8Row& row, const SplitLane& split, bool copy8) {
        using F = Fp8Format<kDqk>;
        scales = load_scales<kDqk>(row);
        const bool ok = row.block != nullptr;
        const uint8_t* src = ok ? row.block + F::nope_offset(row.t) + 16 * split.quarter : nullptr;
#pragma unroll
        for (int s = 0; s < kSlabsPerHalf; ++s) nope[s] = load_piece(src + 64 * s, ok, copy8);
        if constexpr (Config<kDqk>::kRopeSlabs > 0) load_rope(row, split, copy8);
    }
    __device__ __forceinline__ void load_right(const Fp8Row& row, const SplitLane& split, bool copy8) {
        using F = Fp8Format<kDqk>;
        const bool ok = row.block != nullptr;
        const uint8_t* src = ok ? row.block + F::nope_offset(row.t) + 16 * split.quarter : nullptr;
#pragma unroll
        for (int s = kSlabsPerHalf; s < kNopeSlabs; ++s) nope[s] = load_piece(src + 64 * s, ok, copy8);
        if constexpr (Config<kDqk>::kRopeSlabs == 0) load_rope(row, split, copy8);
    }
    __device__ __forceinline__ void load_rope(const Fp8Row& row, const SplitLane& split, bool copy8) {
        using F = Fp8Format<kDqk>;
        const bool ok = row.block != nullptr;
        const uint8_t* rsrc = ok ? row.block + F::rope_offset(row.t) + 32 * split.quarter : nullptr;
#pragma unroll
        for (int j = 0; j < 2; ++j) rope[j] = load_piece(rsrc + 16 * j, ok, copy8);
    }
    // NoPE slabs [kFirst, kEnd), with the tile's scales `sc`: dequantised into this CTA's stage and, by st.async
    // completing on `peer_full`, the peer's.
    template <int kFirst, int kEnd>
    __device__ __forceinline__ void store_nope(uint32_t stage_addr, uint32_t peer_stage, uint32_t peer_full,
                                               const SplitLane& split, const uint4& sc) const {
        using C = Config<kDqk>;
#pragma unroll
        for (int s = kFirst; s < kEnd; ++s) {
            const float scale = slab_scale<kDqk>(sc, s);
            const uint2 a = dequant4(nope[s].x, scale), b = dequant4(nope[s].y, scale);
            const uint2 c = dequant4(nope[s].z, scale), d = dequant4(nope[s].w, scale);
            const uint4 lo = make_uint4(a.x, a.y, b.x, b.y), hi = make_uint4(c.x, c.y, d.x, d.y);
            const uint32_t off = s * C::kSlabBytes;
            st_shared_v4(stage_addr + off + split.chunk(0), lo);
            st_shared_v4(stage_addr + off + split.chunk(1), hi);
            st_async_v4_b32(peer_stage + off + split.chunk(0), lo, peer_full);
            st_async_v4_b32(peer_stage + off + split.chunk(1), hi, peer_full);
        }
    }
    // The RoPE slab's 32 bytes of the split thread's row (bf16 columns 16 q .. 16 q + 15, as stored) into this CTA's
    // stage and the peer's.
    __device__ __forceinline__ void store_rope(uint32_t stage_addr, uint32_t peer_stage, uint32_t peer_full,
                                               const SplitLane& split) const {
        const uint32_t off = kNopeSlabs * Config<kDqk>::kSlabBytes;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            st_shared_v4(stage_addr + off + split.chunk(j), rope[j]);
            st_async_v4_b32(peer_stage + off + split.chunk(j), rope[j], peer_full);
        }
    }
};

}  // namespace flashmla::decode
