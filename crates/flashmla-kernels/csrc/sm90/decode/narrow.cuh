// The narrow sparse FP8 decode: requests of at most kN = 16 or 32 query rows (h_q 16 or 32 per query token, the
// tensor-parallel shards of 128 heads). docs/decode.md, "Few query rows", has the design and its measurements.
//
// A 64-row query tile on 16 real rows would spend the MMAs of 64, so the MMAs swap their operands: S^T = K Q^T takes
// the tile's 64 keys as the wgmma M and the query rows as N (m64nNk16, K from the stage as A, Q as B), the softmax
// runs down the columns of S^T, P^T is stored as a K-major [row][key] B operand, and each consumer computes four
// 64-column M tiles of O^T = V^T P^T (V read MN-major from the stage as A).
//
// The keys move as raw bytes and are dequantised by the warps that copy them, so the consumers only compute:
//   copy      warpgroups 0 and 3: eight warps, warp w owning rows 8 w .. 8 w + 7 of every tile. Per tile it reads
//             its rows of the one raw slot into registers, issues the next tile's bulk copies (cp.async.bulk, one per
//             valid row, completing on the warp's own slot barrier; MODEL1's 8-byte scale records by cp.async) into
//             the same rows, and, while those fly, converts the registers into a free bf16 stage and publishes it
//             (kv_full). Nothing but the slot and the stages' barriers paces it.
//   consumers warpgroups 1 and 2, per tile (kv_full): the score warpgroup computes S^T and the softmax, both
//             consumers their half of P V (Handoff), and each warp releases the stage (kv_empty). With two stages a
//             tile's conversion overlaps the previous tile's MMAs (V3.2 at kN = 32, whose Q rows leave room for one
//             stage, is not built: launch.rs sends those requests to the 64-row kernel).
// Per chunk, the consumers load the Q rows after the previous chunk's staged rows left (NarrowChunk); the epilogues
// are the split pipeline's (partials and final rows staged in the Q tile, combine).
#pragma once

#include <cstdint>

#include "sm90/decode/kernel.cuh"

namespace flashmla::decode {

// Bulk copy of `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), completing as
// transaction bytes on the mbarrier at shared address `bar`.
__device__ __forceinline__ void bulk_load_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

template <int kN>
struct Narrow {
    static_assert(kN == 16 || kN == 32, "narrow tiles: 16 or 32 query rows");
    static constexpr int kSRegs = kN / 2;  // S^T: keys row0 / row0 + 8, columns 8 j + 2 quad + e
    static constexpr int kCols = kN / 4;   // the thread's columns (query rows), index 2 j + e
    static __device__ __forceinline__ int col(int ci, int quad) { return 8 * (ci / 2) + 2 * quad + (ci % 2); }
};

// The narrow kernels run four warpgroups: copy warps in warpgroups 0 and 3 (the conversion needs two warps per
// scheduler: one alone took ~3.8 us per tile, the consumers ~2.5), the consumers in 1 and 2.
inline constexpr int kNarrowThreads = 4 * kWarpgroupThreads;                      // 512
inline constexpr uint32_t kNarrowRegsAtLaunch = (65536u / kNarrowThreads) & ~7u;  // 128
inline constexpr int kCopyWarps = 2 * kWarpsPerWarpgroup;                         // 8
inline constexpr int kCopyRowsPerWarp = kKeysPerTile / kCopyWarps;                // 8 rows of a tile each
inline constexpr int kConsumerWarps = kConsumerThreads / 32;                      // 8

// How a copy warp's lanes split a raw row for the conversion: lane l converts row 8 w + l % 8, quarter l / 8. A
// row's NoPE bytes are 16-byte units (32 at V3.2, 28 at MODEL1) of 16 codes; quarter q takes units 8 q .. 8 q + 7
// (MODEL1's last quarter 4), i.e. NoPE slabs 2 q, 2 q + 1, and RoPE units (bf16, moved as they are) 2 q, 2 q + 1.
// So a lane holds 40 registers of raw bytes.
template <int kDqk>
struct RawSplit {
    using F = Fp8Format<kDqk>;
    static constexpr int kNopeUnits = F::kDNope / 16;
    static constexpr int kNopeQuarter = 8;
    static constexpr int kRopeQuarter = kSw128RowBytes / 16 / 4;  // 2
    static_assert(kNopeUnits > 3 * kNopeQuarter && kNopeUnits <= 4 * kNopeQuarter, "four quarters of NoPE units");
    static __device__ __forceinline__ int nope_count(int q) {
        return q < 3 ? kNopeQuarter : kNopeUnits - 3 * kNopeQuarter;
    }
};

// The narrow decode's shared-memory plan (every operand 1024-byte aligned):
//   q          [slab][kN rows][128 B]        Q of the chunk's rows, all d_qk columns (SW128, K-major B operand); the
//                                            epilogues stage their rows here
//   kv         [stage][slab][64 keys][128 B] bf16 key tiles (the 64-row plan's stage layout)
//   p          [stage][kN rows][128 B]       P^T of the stage's tile, 16-bit (SW128, K-major B operand)
//   raw        [64 rows][kSlotRowBytes]      the raw token records of the next tile (V3.2: all 656 bytes; MODEL1:
//                                            the 576 value bytes), then MODEL1's 64 scale records of 8 bytes
//   red_max / red_sum  [2][4 warps][32]      the score warpgroup's column reductions
//   row_scale  [stage][kN]                   alpha of the stage's tile
//   row_inv    [2][64]                       per chunk c, in slot c % 2: 1 / softmax denominator
//   raw_full   [copy warp]                   the warp's 32 lanes (their cp.async) and lane 0 once more; the bytes
//   kv_full    [stage]                       one arrival per copy warp (its rows converted and fenced)
//   kv_empty   [stage]                       one arrival per consumer warp (its MMAs on the stage done)
template <int kDqk, int kN>
struct NarrowPlan {
    using C = Config<kDqk>;
    using F = Fp8Format<kDqk>;
    static constexpr int kQSlabBytes = kN * kSw128RowBytes;
    static constexpr int kQBytes = C::kDqkSlabs * kQSlabBytes;
    static constexpr int kPBytes = kN * kSw128RowBytes;
    static constexpr bool kScalesApart = kDqk == 512;  // MODEL1 keeps a block's scale records after its tokens
    static constexpr int kRowBytes = kScalesApart ? F::kValueBytes : F::kBytesPerToken;  // 576 / 656
    // A slot row is an odd number of 16-byte units, so that eight lanes reading eight consecutive rows at the same
    // offset hit eight different bank groups (MODEL1: 576 -> 592).
    static constexpr int kSlotRowBytes = (kRowBytes / 16) % 2 == 1 ? kRowBytes : kRowBytes + 16;
    static constexpr int kScaleOff = F::kDNope;  // V3.2: a row's scale record, after its NoPE bytes
    static constexpr int kRopeOff = kScalesApart ? F::kDNope : F::kDNope + F::kScaleRecordBytes;
    static constexpr int kScaleAreaOff = kKeysPerTile * kSlotRowBytes;  // MODEL1: the slot's scale records
    static constexpr int kSlotBytes =
        (kScaleAreaOff + (kScalesApart ? kKeysPerTile * F::kScaleRecordBytes : 0) + 127) / 128 * 128;
    // Everything but the stages and their P^T, with room for the small arrays and the alignment padding.
    static constexpr int kFixedBytes = kQBytes + kSlotBytes + 4096;
    static constexpr int kMaxStages = 2;
    static constexpr int kStagesFit = (static_cast<int>(kMaxSmemPerBlock - kSmemAlignSlack) - kFixedBytes) /
                                      (C::kStageBytes + kPBytes);
    static constexpr int kStages = kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
    static_assert(kStages >= 1, "the narrow plan needs a bf16 stage");
    static_assert(kRowBytes % 16 == 0 && kRopeOff % 16 == 0, "bulk copies and 16-byte moves of a row");
    // The staged f32 partial halves (one after the other) and the final rows, in the Q tile.
    static_assert(kN * kPartialRowBytes <= kQBytes, "a staged partial half fits the Q tile");
    static_assert(kN * kDv * 2 <= kQBytes, "staged final rows fit the Q tile");

    alignas(kSw128AtomBytes) uint8_t q[kQBytes];
    alignas(kSw128AtomBytes) uint8_t kv[kStages][C::kStageBytes];
    alignas(kSw128AtomBytes) uint8_t p[kStages][kPBytes];
    alignas(128) uint8_t raw[kSlotBytes];
    float red_max[2][4][32];
    float red_sum[2][4][32];
    float row_scale[kStages][kN];
    float row_inv[2][kRowsPerCta];
    uint64_t raw_full[kCopyWarps];
    uint64_t kv_full[kStages];
    uint64_t kv_empty[kStages];
    int32_t sched[kInlineScheduleWords];
};
template <int kDqk, int kN>
inline constexpr uint32_t kNarrowSmemBytes = static_cast<uint32_t>(sizeof(NarrowPlan<kDqk, kN>)) + kSmemAlignSlack;
static_assert(kNarrowSmemBytes<576, 16> <= kMaxSmemPerBlock && kNarrowSmemBytes<512, 16> <= kMaxSmemPerBlock &&
                  kNarrowSmemBytes<512, 32> <= kMaxSmemPerBlock,
              "narrow plans fit 227 KB (launch.rs requests SMEM_BYTES_NARROW = the limit)");
// The built plans have two stages. V3.2 at kN = 32 (36 KB of Q rows) has room for one, whose conversions the MMAs
// would wait for: its requests run the 64-row kernel (launch.rs).
static_assert(NarrowPlan<576, 16>::kStages == 2 && NarrowPlan<512, 16>::kStages == 2 &&
                  NarrowPlan<512, 32>::kStages == 2 && NarrowPlan<576, 32>::kStages == 1,
              "narrow plans: two bf16 stages");

// Registers after setmaxnreg: the copy warps hold a tile's share of raw rows (40) and addresses; the consumers O^T,
// S^T and the Q rows in flight.
// (kN = 32: O^T takes 64 registers, and its consumers need 160.)
template <int kN>
inline constexpr uint32_t kNarrowCopierRegs = kN == 16 ? 104 : 96;
template <int kN>
inline constexpr uint32_t kNarrowConsumerRegs = kN == 16 ? 152 : 160;
static_assert(2 * kNarrowCopierRegs<16> + 2 * kNarrowConsumerRegs<16> <= 4 * kNarrowRegsAtLaunch &&
                  2 * kNarrowCopierRegs<32> + 2 * kNarrowConsumerRegs<32> <= 4 * kNarrowRegsAtLaunch,
              "setmaxnreg pool");

// ---------------------------------------------------------------------------------------------------------------
// Phase: copy (warpgroups 0 and 3; copy warp w, rows 8 w .. 8 w + 7 of every tile, the raw slot's rows of its own).

// Issues copy warp w's raw copies of tile k of chunk c: lane l < 8 copies row 8 w + l (raw index `idx`) with one bulk
// copy if the index names a token (MODEL1: and cp.asyncs its scale record). Lane 0 announces the bytes of the warp's
// valid rows; every lane arrives once its cp.asyncs landed, and lane 0 once more. Returns whether the lane's row is
// valid (false for lanes 8..31).
template <int kDqk, int kN>
__device__ __forceinline__ bool narrow_copy_rows(const DecodeParams& p, NarrowPlan<kDqk, kN>& sm, const Chunk& c,
                                                 int k, int idx, int warp, int lane) {
    using Plan = NarrowPlan<kDqk, kN>;
    using F = Fp8Format<kDqk>;
    uint64_t* full = &sm.raw_full[warp];
    const uint32_t slot = smem_addr(sm.raw);
    const int row = kCopyRowsPerWarp * warp + lane;
    const bool mine = lane < kCopyRowsPerWarp;
    const Fp8Row r = mine ? sparse_row(p, c, k * kKeysPerTile + row, idx) : Fp8Row{nullptr, 0, 1};
    const bool ok = r.block != nullptr;
    const int valid_rows = __popc(__ballot_sync(kFullMask, ok));
    if (lane == 0) MBarrier::expect_tx(full, static_cast<uint32_t>(valid_rows * Plan::kRowBytes));
    __syncwarp();
    if (ok) {
        bulk_load_g2s(slot + row * Plan::kSlotRowBytes, r.block + F::nope_offset(r.t), Plan::kRowBytes,
                      smem_addr(full));
        if constexpr (Plan::kScalesApart) {
            cp_async_8_zfill(slot + Plan::kScaleAreaOff + row * F::kScaleRecordBytes,
                             r.block + F::scale_offset(r.t, r.page_size), true);
        }
    }
    MBarrier::arrive_on_cp_async_noinc(full);
    __syncwarp();
    if (lane == 0) MBarrier::arrive(full);
    return ok;
}

// A copy lane's share of one tile's raw rows (row 8 w + l % 8, quarter l / 8: RawSplit), zeros for a missing row.
template <int kDqk>
struct RawShare {
    uint4 nope[RawSplit<kDqk>::kNopeQuarter];
    uint4 rope[RawSplit<kDqk>::kRopeQuarter];
    uint4 scales;  // the quarter's own: V3.2 one f32 in x; MODEL1 two e8m0 bytes in x (slab_scale of j / 4)
};

// Reads the lane's share out of the raw slot (`ok`: its row was copied; otherwise zeros, which convert to zeros).
template <int kDqk, int kN>
__device__ __forceinline__ RawShare<kDqk> narrow_read_share(const NarrowPlan<kDqk, kN>& sm, int warp, int lane,
                                                            bool ok) {
    using Plan = NarrowPlan<kDqk, kN>;
    using S = RawSplit<kDqk>;
    using F = Fp8Format<kDqk>;
    const int row = kCopyRowsPerWarp * warp + lane % 8;
    const int q = lane / 8;
    const uint32_t src = smem_addr(sm.raw) + row * Plan::kSlotRowBytes;
    RawShare<kDqk> v;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int j = 0; j < S::kNopeQuarter; ++j) {
        v.nope[j] = ok && j < S::nope_count(q) ? ld_shared_v4(src + 16 * (S::kNopeQuarter * q + j)) : zero;
    }
#pragma unroll
    for (int j = 0; j < S::kRopeQuarter; ++j) {
        v.rope[j] = ok ? ld_shared_v4(src + Plan::kRopeOff + 16 * (S::kRopeQuarter * q + j)) : zero;
    }
    v.scales = zero;
    if (ok) {
        if constexpr (Plan::kScalesApart) {  // bytes 2 q, 2 q + 1 of the record: slabs 2 q, 2 q + 1
            const uint32_t w =
                ld_shared_u32(smem_addr(sm.raw) + Plan::kScaleAreaOff + row * F::kScaleRecordBytes + 4 * (q / 2));
            v.scales.x = (w >> (16 * (q % 2))) & 0xFFFFu;
        } else {  // f32 q: 128 columns
            v.scales.x = ld_shared_u32(src + Plan::kScaleOff + 4 * q);
        }
    }
    return v;
}

// Converts the lane's share into `stage` (the 64-row stage layout): NoPE unit u (16 codes of slab u / 4, quarter
// u % 4) -> bf16 chunks 2 (u % 4), + 1 of its slab; RoPE unit v -> chunk v of the RoPE slab (swizzled by the row).
template <int kDqk>
__device__ __forceinline__ void narrow_convert_share(const RawShare<kDqk>& v, uint32_t stage, int warp, int lane) {
    using C = Config<kDqk>;
    using S = RawSplit<kDqk>;
    using F = Fp8Format<kDqk>;
    constexpr int kNopeSlabs = F::kDNope / kSw128ColsBf16;  // 8 (V3.2) or 7 (MODEL1)
    const int row = kCopyRowsPerWarp * warp + lane % 8;
    const int qt = lane / 8;
    const uint32_t base = stage + row * kSw128RowBytes;
    const uint32_t swz = static_cast<uint32_t>(row % kSw128AtomRows);
#pragma unroll
    for (int j = 0; j < S::kNopeQuarter; ++j) {
        if (j < S::nope_count(qt)) {
            const int u = S::kNopeQuarter * qt + j;
            const int s = u / 4, q = u % 4;
            const float scale = slab_scale<kDqk>(v.scales, j / 4);  // the quarter's slab j / 4
            const uint2 a = dequant4(v.nope[j].x, scale), b = dequant4(v.nope[j].y, scale);
            const uint2 c = dequant4(v.nope[j].z, scale), d = dequant4(v.nope[j].w, scale);
            const uint32_t slab = base + s * C::kSlabBytes;
            st_shared_v4(slab + (((2 * q) ^ swz) << 4), make_uint4(a.x, a.y, b.x, b.y));
            st_shared_v4(slab + (((2 * q + 1) ^ swz) << 4), make_uint4(c.x, c.y, d.x, d.y));
        }
    }
#pragma unroll
    for (int j = 0; j < S::kRopeQuarter; ++j) {
        const uint32_t chunk = static_cast<uint32_t>(S::kRopeQuarter * qt + j);
        st_shared_v4(base + kNopeSlabs * C::kSlabBytes + ((chunk ^ swz) << 4), v.rope[j]);
    }
}

// Both consumers: the chunk's Q rows into the Q tile (zeros past the tile's rows), thread u moving 16-byte chunks u,
// u + 256, ...; fenced for wgmma (the callers then meet at NarrowQ, before the first S^T).
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_load_q(const DecodeParams& p, NarrowPlan<kDqk, kN>& sm, const RowTile& rt,
                                              const Chunk& c, int u) {
    using Plan = NarrowPlan<kDqk, kN>;
    using C = Config<kDqk>;
    constexpr int kRowChunks = 8 * C::kDqkSlabs;
    constexpr int kChunks = kN * kRowChunks;
    constexpr int kPerThread = (kChunks + kConsumerThreads - 1) / kConsumerThreads;
    const uint16_t* q_req = p.q + request_offset(p, c.b, p.q_stride_b, p.q_stride_s);
    uint4 qv[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
        const int idx = u + k * kConsumerThreads;
        const int n = idx / kRowChunks;
        qv[k] = make_uint4(0u, 0u, 0u, 0u);
        if (idx < kChunks && n < rt.rows) {
            const uint16_t* row = q_req + static_cast<int64_t>(rt.token(p, n)) * p.q_stride_s +
                                  static_cast<int64_t>(rt.head(p, n)) * p.q_stride_h;
            qv[k] = __ldg(reinterpret_cast<const uint4*>(row) + idx % kRowChunks);
        }
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
        const int idx = u + k * kConsumerThreads;
        if (idx < kChunks) {
            const int n = idx / kRowChunks;
            const int slab = (idx % kRowChunks) / 8, chunk = idx % 8;
            st_shared_v4(smem_addr(sm.q) + slab * Plan::kQSlabBytes + n * kSw128RowBytes +
                             ((chunk ^ (n % kSw128AtomRows)) << 4),
                         qv[k]);
        }
    }
    fence_proxy_async_shared();
}

// ---------------------------------------------------------------------------------------------------------------
// Phase: MMAs.

// S^T = K Q^T of the stage's tile (every d_qk column), waited for.
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_qk(const NarrowPlan<kDqk, kN>& sm, uint32_t stage_addr, float (&s)[kN / 2]) {
    using C = Config<kDqk>;
    using Plan = NarrowPlan<kDqk, kN>;
    const uint64_t desc_k = make_wgmma_desc_sw128(stage_addr, kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q), kUnusedLbo, kSw128AtomBytes);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < C::kDqkSlabs * C::kKStepsPerSlab; ++step) {
        const int slab = step / C::kKStepsPerSlab, ks = step % C::kKStepsPerSlab;
        wgmma_m64nk16_ss<kN, 0, 0>(s, wgmma_desc_advance(desc_k, slab * C::kSlabBytes + ks * 32),
                                   wgmma_desc_advance(desc_q, slab * Plan::kQSlabBytes + ks * 32), step > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(s);
}

// O^T (this consumer's four M tiles, value slabs first_slab..) += V^T P^T, waited for.
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_pv(float (&o)[4][kN / 2], uint32_t stage_addr, uint32_t p_addr,
                                          int first_slab) {
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kPvSteps; ++kb) {
        const uint64_t desc_p = make_wgmma_desc_sw128(p_addr + kb * 32, kUnusedLbo, kSw128AtomBytes);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            wgmma_m64nk16_ss<kN, 1, 0>(o[mt], v_desc<kDqk>(stage_addr, first_slab + mt, kb), desc_p, true);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
}

// ---------------------------------------------------------------------------------------------------------------
// Phase: epilogue (per chunk, both consumers).

__device__ __forceinline__ void st_shared_bf16(uint32_t addr, float v) {
    asm volatile("{\n.reg .b16 h;\ncvt.rn.bf16.f32 h, %1;\nst.shared.b16 [%0], h;\n}\n" ::"r"(addr), "f"(v)
                 : "memory");
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// One consumer's O^T half of a split chunk: the f32 partial scaled by inv, staged in `area` as rows of 1 KB and sent
// as one bulk store per row. `bar`: the warpgroup's own barrier.
template <int kN>
__device__ __forceinline__ void narrow_stage_partial(const DecodeParams& p, const RowTile& rt, const Chunk& c,
                                                     const AccFrag& f, int consumer, int t, Bar bar,
                                                     const float (&o)[4][kN / 2], const float (&inv)[kN / 4],
                                                     uint32_t area) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int ci = 0; ci < kN / 4; ++ci) {
            const int n = Narrow<kN>::col(ci, f.quad);
            const int j = ci / 2, e = ci % 2;
            const uint32_t row = area + n * kPartialRowBytes + (64 * mt + f.row0) * 4;
            st_shared_f32(row, o[mt][4 * j + e] * inv[ci]);
            st_shared_f32(row + 32, o[mt][4 * j + 2 + e] * inv[ci]);
        }
    }
    fence_proxy_async_shared();
    named_barrier_sync_unaligned(bar, kWarpgroupThreads);
    if (t < rt.rows) {
        float* dst = p.part_o + ((static_cast<int64_t>(c.slot) * p.head_tiles + blockIdx.x) * kRowsPerCta + t) * kDv +
                     consumer * kDvPerConsumer;
        bulk_store_s2g_keep(dst, area + t * kPartialRowBytes, kPartialRowBytes);
    }
    bulk_commit();
    bulk_wait_read();
}
// One consumer's O^T half of an unsplit chunk, final rows in bf16 staged in the Q tile (1 KB per row).
template <int kN>
__device__ __forceinline__ void narrow_stage_final(const AccFrag& f, int consumer, const float (&o)[4][kN / 2],
                                                   const float (&inv)[kN / 4], uint32_t q_area) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int ci = 0; ci < kN / 4; ++ci) {
            const int n = Narrow<kN>::col(ci, f.quad);
            const int j = ci / 2, e = ci % 2;
            const uint32_t row = q_area + n * 1024u + (consumer * kDvPerConsumer + 64 * mt + f.row0) * 2;
            st_shared_bf16(row, o[mt][4 * j + e] * inv[ci]);
            st_shared_bf16(row + 16, o[mt][4 * j + 2 + e] * inv[ci]);
        }
    }
    fence_proxy_async_shared();
}
// ... or stored from registers (out rows not 16-byte aligned).
template <int kN>
__device__ __forceinline__ void narrow_store_out(const DecodeParams& p, const RowTile& rt, const Chunk& c,
                                                 const AccFrag& f, int consumer, const float (&o)[4][kN / 2],
                                                 const float (&inv)[kN / 4]) {
#pragma unroll
    for (int ci = 0; ci < kN / 4; ++ci) {
        const int n = Narrow<kN>::col(ci, f.quad);
        if (n >= rt.rows) continue;
        const int j = ci / 2, e = ci % 2;
        uint16_t* dst = p.out + request_offset(p, c.b, p.out_stride_b, p.out_stride_s) +
                        static_cast<int64_t>(rt.token(p, n)) * p.out_stride_s +
                        static_cast<int64_t>(rt.head(p, n)) * p.out_stride_h + consumer * kDvPerConsumer;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            const uint32_t a = pack_bf16x2(o[mt][4 * j + e] * inv[ci], o[mt][4 * j + 2 + e] * inv[ci]);
            dst[64 * mt + f.row0] = static_cast<uint16_t>(a & 0xFFFFu);
            dst[64 * mt + f.row0 + 8] = static_cast<uint16_t>(a >> 16);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Roles.

// Warpgroups 0 and 3: the copy warps. Per tile T of the CTA's chunks, warp w: reads its rows of tile T - 1 out of
// the raw slot into registers, issues tile T's copies into the same rows (the index of its row loaded a tile ahead),
// then waits for a free stage and converts tile T - 1 into it while tile T's rows travel; after the last tile, the
// last conversion. A warp issues its bulk copies one lane after another (~15 GB/s per warp), so each warp copies
// only its own 8 rows and meets the others only through the stage's kv_full. `warp`: 0..7 over both warpgroups.
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_copier(const DecodeParams& p, NarrowPlan<kDqk, kN>& sm, const Schedule& sched,
                                              int warp) {
    using Plan = NarrowPlan<kDqk, kN>;
    using Stage = RingPos<Plan::kStages>;  // the CTA's tile, counted over its chunks
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int row = kCopyRowsPerWarp * warp + lane;
    const bool mine = lane < kCopyRowsPerWarp;
    int tile = 0;          // tiles whose copies were issued
    bool prev_ok = false;  // whether the lane's conversion row of tile - 1 was copied
    // Tile `tile - 1` out of the slot: its share into registers, ordered before the slot's next bulk writes.
    const auto read_prev = [&]() {
        MBarrier::wait(&sm.raw_full[warp], static_cast<uint32_t>((tile - 1) & 1));
        const RawShare<kDqk> v = narrow_read_share<kDqk, kN>(sm, warp, lane, prev_ok);
        fence_proxy_async_shared();
        __syncwarp();
        return v;
    };
    // ... converted into its stage once the consumers released it, and published.
    const auto publish_prev = [&](const RawShare<kDqk>& v) {
        const Stage pos = Stage::of(tile - 1);
        MBarrier::wait(&sm.kv_empty[pos.stage], pos.empty_parity);
        narrow_convert_share<kDqk>(v, smem_addr(sm.kv[pos.stage]), warp, lane);
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) MBarrier::arrive(&sm.kv_full[pos.stage]);
    };
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            const IndexRows ir = IndexRows::of(p, c);  // sparse: the request's index rows
            int idx = mine && c.tile0 < c.tile1 ? sparse_index(ir, c, c.tile0 * kKeysPerTile + row) : -1;
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                RawShare<kDqk> v;
                if (tile > 0) v = read_prev();
                // Loaded after the fence above, whose MEMBAR would wait for it.
                const int next = mine && k + 1 < c.tile1 ? sparse_index(ir, c, (k + 1) * kKeysPerTile + row) : -1;
                const bool ok = narrow_copy_rows<kDqk, kN>(p, sm, c, k, idx, warp, lane);
                if (tile > 0) publish_prev(v);
                prev_ok = __shfl_sync(kFullMask, ok, lane % 8);
                idx = next;
            }
        });
    }
    if (tile > 0) publish_prev(read_prev());
}

// Score warpgroup (WG 1). Per chunk, its half of the Q rows. Per tile i: kv_full -> S^T(i) -> mask keys -> column
// max (warp shuffles, then the four warps through shared memory) -> online softmax per column -> alpha(i), P^T(i)
// into the stage's slots -> Handoff -> PV(i) on value columns 0..255 -> kv_empty. Per chunk, the epilogue.
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_score(const DecodeParams& p, NarrowPlan<kDqk, kN>& sm, const Schedule& sched) {
    using Plan = NarrowPlan<kDqk, kN>;
    using Nw = Narrow<kN>;
    using Stage = RingPos<Plan::kStages>;  // the CTA's tile, counted over its chunks
    constexpr int kCols = Nw::kCols;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * static_cast<int>(Role::Score);
    const int lane = t % 32;
    const int warp = t / 32;
    const AccFrag f = AccFrag::of_thread(t);  // row0: the thread's first key; its columns: Nw::col(ci, quad)
    const float scale = p.sm_scale_log2;      // > 0 (validated)
    const RowTile rt = RowTile::of(p);
    const bool bulk_out = (p.flags & kFlagOutBulk) != 0;
    const uint32_t q_addr = smem_addr(sm.q);
    // The thread's keys in the tile mask: warps 0-1 in .lo, 2-3 in .hi.
    const int key_bit = f.row0 - 32 * (warp / 2);

    int tile = 0;
    int chunks = 0;
    int red_buf = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            const IndexRows ir = IndexRows::of(p, c);  // sparse: the request's index rows
            const int n_tiles = c.tile1 - c.tile0;
            if (chunks > 0) named_barrier_sync_unaligned(Bar::NarrowChunk, kConsumerThreads);
            if (n_tiles > 0) {
                narrow_load_q<kDqk, kN>(p, sm, rt, c, t);
                named_barrier_sync_unaligned(Bar::NarrowQ, kConsumerThreads);  // the value half, before S^T
            }
            float o[4][kN / 2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) zero_regs(o[mt]);
            float m[kCols];
            float l[kCols];
#pragma unroll
            for (int ci = 0; ci < kCols; ++ci) {
                m[ci] = -kInf;
                l[ci] = 0.f;
            }
            TileMask mask{0u, 0u};
            TileKeys<true> keys_next{-1, -1};
            if (n_tiles > 0) {
                mask = TileKeys<true>::load(p, &ir, c, c.tile0, lane).mask(p, c, c.tile0, lane);
                if (n_tiles > 1) keys_next = TileKeys<true>::load(p, &ir, c, c.tile0 + 1, lane);
            }
            for (int i = 0; i < n_tiles; ++i, ++tile) {
                const Stage pos = Stage::of(tile);
                const uint32_t stage_addr = smem_addr(sm.kv[pos.stage]);
                const uint32_t p_addr = smem_addr(sm.p[pos.stage]);
                MBarrier::wait(&sm.kv_full[pos.stage], pos.full_parity);

                float s[Nw::kSRegs];
                narrow_qk<kDqk, kN>(sm, stage_addr, s);

                // Keys that are missing (bad index, past the request) score -inf (a select: no NaN from an inf).
                const uint32_t bits = warp < 2 ? mask.lo : mask.hi;
                const bool k0 = ((bits >> key_bit) & 1u) != 0;
                const bool k1 = ((bits >> (key_bit + 8)) & 1u) != 0;
                float cmax[kCols];
#pragma unroll
                for (int ci = 0; ci < kCols; ++ci) {
                    const int j = ci / 2, e = ci % 2;
                    s[4 * j + e] = k0 ? s[4 * j + e] : -kInf;
                    s[4 * j + 2 + e] = k1 ? s[4 * j + 2 + e] : -kInf;
                    cmax[ci] = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
#pragma unroll
                    for (int d = 4; d < 32; d *= 2) cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(kFullMask, cmax[ci], d));
                }
                if (lane < 4) {
#pragma unroll
                    for (int ci = 0; ci < kCols; ++ci) sm.red_max[red_buf][warp][Nw::col(ci, f.quad)] = cmax[ci];
                }
                named_barrier_sync_unaligned(Bar::NarrowScore, kWarpgroupThreads);
                float alpha[kCols];
#pragma unroll
                for (int ci = 0; ci < kCols; ++ci) {
                    const int n = Nw::col(ci, f.quad);
                    float tmax = sm.red_max[red_buf][0][n];
#pragma unroll
                    for (int w = 1; w < 4; ++w) tmax = fmaxf(tmax, sm.red_max[red_buf][w][n]);
                    const float m_new = fmaxf(m[ci], tmax * scale);
                    alpha[ci] = m_new == m[ci] ? 1.f : exp2f(m[ci] - m_new);
                    m[ci] = m_new;
                    const float mu = m_new == -kInf ? 0.f : m_new;
                    const int j = ci / 2, e = ci % 2;
                    s[4 * j + e] = exp2f(fmaf(s[4 * j + e], scale, -mu));
                    s[4 * j + 2 + e] = exp2f(fmaf(s[4 * j + 2 + e], scale, -mu));
                    l[ci] = l[ci] * alpha[ci] + s[4 * j + e] + s[4 * j + 2 + e];
#pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        o[mt][4 * j + e] *= alpha[ci];
                        o[mt][4 * j + 2 + e] *= alpha[ci];
                    }
                    // P^T(key, n) at row n, key of the SW128 [row][64 keys] B operand.
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        const int key = f.row0 + 8 * rr;
                        st_shared_bf16(p_addr + n * kSw128RowBytes + (((key >> 3) ^ (n & 7)) << 4) + (key & 7) * 2,
                                       s[4 * j + 2 * rr + e]);
                    }
                }
                red_buf ^= 1;
                if (t < 4) {
#pragma unroll
                    for (int ci = 0; ci < kCols; ++ci) sm.row_scale[pos.stage][Nw::col(ci, f.quad)] = alpha[ci];
                }
                if (i + 1 < n_tiles) {
                    mask = keys_next.mask(p, c, c.tile0 + i + 1, lane);
                    if (i + 2 < n_tiles) keys_next = TileKeys<true>::load(p, &ir, c, c.tile0 + i + 2, lane);
                }
                fence_proxy_async_shared();
                named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);
                narrow_pv<kDqk, kN>(o, stage_addr, p_addr, 0);
                release_by_warp(&sm.kv_empty[pos.stage], lane);
            }

            // Column sums: the lanes of a column, then the four warps in order.
#pragma unroll
            for (int ci = 0; ci < kCols; ++ci) {
#pragma unroll
                for (int d = 4; d < 32; d *= 2) l[ci] += __shfl_xor_sync(kFullMask, l[ci], d);
            }
            const int sums = chunks % 2;
            if (lane < 4) {
#pragma unroll
                for (int ci = 0; ci < kCols; ++ci) sm.red_sum[sums][warp][Nw::col(ci, f.quad)] = l[ci];
            }
            named_barrier_sync_unaligned(Bar::NarrowScore, kWarpgroupThreads);
            float inv[kCols];
#pragma unroll
            for (int ci = 0; ci < kCols; ++ci) {
                const int n = Nw::col(ci, f.quad);
                float lsum = sm.red_sum[sums][0][n];
#pragma unroll
                for (int w = 1; w < 4; ++w) lsum += sm.red_sum[sums][w][n];
                inv[ci] = finish_row(p, sm.row_inv[chunks % 2], rt, c, n, m[ci], m[ci] == -kInf, lsum, t < 4,
                                     row_sink_log2(p, rt, n));
            }
            named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
            if (c.split) {
                narrow_stage_partial<kN>(p, rt, c, f, 0, t, Bar::NarrowScore, o, inv, q_addr);
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
            } else if (bulk_out && n_tiles > 0) {
                narrow_stage_final<kN>(f, 0, o, inv, q_addr);
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                store_final_rows(p, rt, c, f, q_addr);
            } else {
                narrow_store_out<kN>(p, rt, c, f, 0, o, inv);
            }
            ++chunks;
        });
    }
}

// Value warpgroup (WG 2). Per chunk, its half of the Q rows. Per tile i: Handoff -> rescale O^T by alpha(i) -> O^T
// (value columns 256..511) += V^T P^T(i) -> kv_empty. Per chunk, the epilogue.
template <int kDqk, int kN>
__device__ __forceinline__ void narrow_value(const DecodeParams& p, NarrowPlan<kDqk, kN>& sm, const Schedule& sched) {
    using Plan = NarrowPlan<kDqk, kN>;
    using Nw = Narrow<kN>;
    using Stage = RingPos<Plan::kStages>;  // the CTA's tile, counted over its chunks
    constexpr int kCols = Nw::kCols;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * static_cast<int>(Role::Value);
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const RowTile rt = RowTile::of(p);
    const bool bulk_out = (p.flags & kFlagOutBulk) != 0;
    int tile = 0;
    int chunks = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            if (chunks > 0) named_barrier_sync_unaligned(Bar::NarrowChunk, kConsumerThreads);
            if (c.tile1 > c.tile0) {
                narrow_load_q<kDqk, kN>(p, sm, rt, c, kWarpgroupThreads + t);
                named_barrier_sync_unaligned(Bar::NarrowQ, kConsumerThreads);
            }
            float o[4][kN / 2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) zero_regs(o[mt]);
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                const Stage pos = Stage::of(tile);
                named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);
                // Complete already (the score warpgroup waited for it before Handoff): makes the copy warps' stores
                // visible to this warpgroup's wgmma as well.
                MBarrier::wait(&sm.kv_full[pos.stage], pos.full_parity);
#pragma unroll
                for (int ci = 0; ci < kCols; ++ci) {
                    const float a = sm.row_scale[pos.stage][Nw::col(ci, f.quad)];
                    const int j = ci / 2, e = ci % 2;
#pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        o[mt][4 * j + e] *= a;
                        o[mt][4 * j + 2 + e] *= a;
                    }
                }
                narrow_pv<kDqk, kN>(o, smem_addr(sm.kv[pos.stage]), smem_addr(sm.p[pos.stage]), kSlabsPerHalf);
                release_by_warp(&sm.kv_empty[pos.stage], lane);
            }
            named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
            float inv[kCols];
#pragma unroll
            for (int ci = 0; ci < kCols; ++ci) inv[ci] = sm.row_inv[chunks % 2][Nw::col(ci, f.quad)];
            if (c.split) {
                // The copy warps may be filling every stage with the next chunk's keys: this half takes the Q tile
                // once the score warpgroup's half left it (the next chunk's Q waits for NarrowChunk).
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                narrow_stage_partial<kN>(p, rt, c, f, 1, t, Bar::NarrowValue, o, inv, smem_addr(sm.q));
            } else if (bulk_out && c.tile1 > c.tile0) {
                narrow_stage_final<kN>(f, 1, o, inv, smem_addr(sm.q));
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
            } else {
                narrow_store_out<kN>(p, rt, c, f, 1, o, inv);
            }
            ++chunks;
        });
    }
}

// The narrow kernel body (instantiated by decode.cu as decode_split_fp8_{v32,model1}_n{16,32}).
template <int kDqk, int kN>
__device__ __forceinline__ void decode_narrow(const DecodeParams& p, uint8_t* smem) {
    using Plan = NarrowPlan<kDqk, kN>;
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kNarrowSmemBytes
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    const int32_t* const sched_line = (p.flags & kFlagInlineSchedule) ? sm.sched : p.schedule;
    if ((p.flags & kFlagInlineSchedule) && threadIdx.x < 32) {
        write_schedule_warp(p, sm.sched, blockIdx.x == 0 && blockIdx.y == 0);
    }
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 0; w < kCopyWarps; ++w) MBarrier::init(&sm.raw_full[w], 32 + 1);
#pragma unroll
        for (int s = 0; s < Plan::kStages; ++s) {
            MBarrier::init(&sm.kv_full[s], kCopyWarps);
            MBarrier::init(&sm.kv_empty[s], kConsumerWarps);
        }
    }
    __syncthreads();
    grid_dep_wait();  // after the schedule kernel, as in decode_split
    grid_dep_launch_dependents();

    const Schedule sched = Schedule::load(p, sched_line);
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
    if (wg == 0 || wg == 3) {
        setmaxnreg_dec<kNarrowCopierRegs<kN>>();
        const int warp = (wg == 0 ? 0 : kWarpsPerWarpgroup) + static_cast<int>(threadIdx.x) / 32 % kWarpsPerWarpgroup;
        narrow_copier<kDqk, kN>(p, sm, sched, warp);
    } else if (wg == static_cast<int>(Role::Score)) {
        setmaxnreg_inc<kNarrowConsumerRegs<kN>>();
        narrow_score<kDqk, kN>(p, sm, sched);
        bulk_wait_all();  // the partials' bulk stores are performed before the CTA ends
    } else {
        setmaxnreg_inc<kNarrowConsumerRegs<kN>>();
        narrow_value<kDqk, kN>(p, sm, sched);
        bulk_wait_all();
    }
}

}  // namespace flashmla::decode
