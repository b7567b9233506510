// Dense MLA decode over a paged cache for sm_90a (docs/spec.md section 4). docs/decode.md has the design:
// schedule, shared-memory plan, warp roles, barrier protocol, partials and combine.
//
// Three kernels per decode step (two for at most 128 requests, one for a sparse batch without lengths whose parts
// hold whole requests), all on the caller's stream and with no host synchronisation:
//   decode_schedule  one CTA: the split-KV schedule from cache_seqlens (schedule.cuh); for a batch of at most 128
//                    requests (kFlagInlineSchedule) not launched: warp 0 of every split CTA derives it instead; nor
//                    for a uniform line (kFlagUniformLine), which every role derives from the shape;
//   decode_split     grid (head_tiles, grid_parts): CTA (x, y) serves query-row tile x for the chunks of the parts
//                    y, y + grid_parts, ...; writes unsplit requests in final form, split ones as f32 partials;
//   decode_combine   grid (batch or parts, head_tiles): merges the partials of split requests (f32), applies the sink.
//
// decode_split's CTA has the sparse forward's split pipeline (3 warpgroups):
//   Producer: per chunk, loads the Q tile (columns 0..511; rows past `rows` zero-filled), then gathers the chunk's
//             key tiles through the block table into a 2-stage ring with cp.async (missing keys zero-filled, never
//             read), per column group (rope, left, right). The sparse decode's producers dequantise FP8 rows into
//             the same bf16 slabs (sparse_keys.cuh; the pair kernels' from registers, producer_sparse_regs).
//   Score:    per tile, S = Q K^T (rope columns of Q from registers), masks missing keys and (causal) keys past
//             each row's limit, online softmax, publishes P and the row scales, O[:, 0:256] += P V.
//   Value:    O[:, 256:512] += P V with the published P.
// Per chunk, both consumers then write their O half (final: scaled by 1 / denominator, in the output dtype, staged
// in the chunk's last key stage, kept from the producer until the rows left (Q is released after the last QK), and
// sent as one bulk store per 1 KB row when out rows are 16-byte aligned, else copied by a rolled loop;
// partial: by 1 / row sum, f32, staged in shared memory (score: the Q tile, value: the chunk's last key stage) and
// sent as one bulk store per row; the producer writes nothing of the next chunk into either area until the staged
// rows left).
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/grid_dep.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_layout.cuh"
#include "common/softmax_tile.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "sm90/decode/config.cuh"
#include "sm90/decode/params.h"
#include "sm90/decode/schedule.cuh"
#include "sm90/decode/sparse_keys.cuh"

namespace flashmla::decode {

using Ring = RingPos<kStages>;

// The CTA's query-row tile: key head and first row (row r = (token r / hpk, head r % hpk of the key head's group)).
struct RowTile {
    int kv_head;
    int row0;   // first row of the tile
    int rows;   // rows of the tile that exist (1..64)
    static __device__ __forceinline__ RowTile of(const DecodeParams& p) { return at(p, static_cast<int>(blockIdx.x)); }
    // Row tile x of the grid's head tiles (the split kernel's blockIdx.x, the combine's blockIdx.y).
    static __device__ __forceinline__ RowTile at(const DecodeParams& p, int x) {
        RowTile t;
        t.kv_head = fast_div(x, p.row_tiles_div_mul, p.row_tiles_div_shr);
        t.row0 = (x - t.kv_head * p.row_tiles) * kRowsPerCta;
        t.rows = min(kRowsPerCta, p.rows - t.row0);
        return t;
    }
    // Query token and head of tile row r (r < rows).
    __device__ __forceinline__ int token(const DecodeParams& p, int r) const {
        return fast_div(row0 + r, p.hpk_div_mul, p.hpk_div_shr);
    }
    __device__ __forceinline__ int head(const DecodeParams& p, int r) const {
        return kv_head * p.heads_per_kv + (row0 + r - token(p, r) * p.heads_per_kv);
    }
};

// Block id of key `key` of request b (the caller checked key < len, so the block-table column is in range), or -1
// past the request's keys. A block id outside 0..num_blocks is a missing key: never dereferenced.
__device__ __forceinline__ int key_block(const DecodeParams& p, int b, int len, int key) {
    if (key >= len) return -1;
    return __ldg(p.block_table + static_cast<int64_t>(b) * p.block_table_stride_b + page_div(p, key));
}
__device__ __forceinline__ bool block_valid(const DecodeParams& p, int block) {
    return block >= 0 && block < p.num_blocks;
}
// Row of key `key` in block `block` (valid) for key head `kv_head`.
__device__ __forceinline__ const uint16_t* key_row(const DecodeParams& p, int block, int key, int kv_head) {
    return p.k_cache + static_cast<int64_t>(block) * p.k_stride_block +
           static_cast<int64_t>(page_mod(p, key)) * p.k_stride_tok + static_cast<int64_t>(kv_head) * p.k_stride_head;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer warpgroup (threads 0..127): thread t copies 16-byte chunk t % 8 of one 128-byte slab row, 16 rows per
// pass, 4 passes per 64-row tile (as in the sparse forward).

// Waits for column group kGroup's release and issues the thread's copies of it. kFenced: the copies form their own
// cp.async group, which the caller waits for and publishes after a proxy fence (the TMA mode, whose consumers do not
// fence); otherwise they complete the group's full barrier themselves and the consumers fence.
template <int kDqk, int kGroup, bool kFenced>
__device__ __forceinline__ void gather_group(SmemPlan<kDqk>& sm, const Ring& pos, uint32_t stage_base,
                                             const uint16_t* const (&src)[kPassesPerTile],
                                             const bool (&ok)[kPassesPerTile]) {
    using C = Config<kDqk>;
    MBarrier::wait(&sm.kv_empty[pos.stage][kGroup], pos.empty_parity);
    constexpr int kFirst = group_first_slab(kGroup);
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
#pragma unroll
        for (int slab = kFirst; slab < kFirst + group_slabs<kDqk>(kGroup); ++slab) {
            cp_async_16_zfill(stage_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                              src[k] + slab * kSw128ColsBf16, ok[k]);
        }
    }
    if constexpr (kFenced) {
        cp_async_commit_group();
    } else if constexpr (kGroup == kGroupRight) {
#pragma unroll
        for (int j = 0; j < kSlabsPerHalf; ++j) MBarrier::arrive_on_cp_async_noinc(&sm.kv_right_slab[pos.stage][j]);
    } else {
        MBarrier::arrive_on_cp_async_noinc(&sm.kv_full[pos.stage][kGroup]);
    }
}

// Q [64 rows x columns 0..511] of request b -> sm.q (rows past the tile's rows zero-filled).
template <int kDqk>
__device__ __forceinline__ void load_q_tile(const DecodeParams& p, SmemPlan<kDqk>& sm, const RowTile& rt, int b,
                                            const Sw128CopyThread& ct) {
    using C = Config<kDqk>;
    const uint32_t q_base = smem_addr(sm.q) + ct.smem_off;
    const uint16_t* q_req = p.q + request_offset(p, b, p.q_stride_b, p.q_stride_s);
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        const int r = k * kRowsPerPass + ct.row_in_pass;
        const bool ok = r < rt.rows;
        const uint16_t* row = ok ? q_req + static_cast<int64_t>(rt.token(p, r)) * p.q_stride_s +
                                       static_cast<int64_t>(rt.head(p, r)) * p.q_stride_h
                                 : p.q;  // never read
        const uint16_t* src = row + ct.chunk_elems;
#pragma unroll
        for (int slab = 0; slab < kDvSlabs; ++slab) {
            cp_async_16_zfill(q_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                              src + slab * kSw128ColsBf16, ok);
        }
    }
    MBarrier::arrive_on_cp_async_noinc(&sm.q_full);
}

// A whole key tile by TMA (kFlagKTma: pages are multiples of 64 keys, so tile k is 64 consecutive rows of one
// page): every producer thread waits for each column group's release, so that all of them keep in step with the
// ring's phases (the gather path below needs that); thread 0 announces the group's bytes, issues one box per 64-column
// slab and arrives for the warpgroup.
// kEvictFirst: the CTA is the only reader of these keys (one row tile per key head); they leave L2 first.
template <int kDqk, int kGroup, bool kEvictFirst>
__device__ __forceinline__ void tma_group(const DecodeParams& p, SmemPlan<kDqk>& sm, const Ring& pos,
                                          uint32_t stage_addr, int block, int row0, int kv_head) {
    using C = Config<kDqk>;
    MBarrier::wait(&sm.kv_empty[pos.stage][kGroup], pos.empty_parity);
    if (threadIdx.x != 0) return;
    constexpr int kFirst = group_first_slab(kGroup);
    constexpr int kSlabs = group_slabs<kDqk>(kGroup);
    uint64_t* full = &sm.kv_full[pos.stage][kGroup];
    if constexpr (kGroup != kGroupRight) MBarrier::expect_tx(full, kSlabs * C::kSlabBytes);
#pragma unroll
    for (int slab = kFirst; slab < kFirst + kSlabs; ++slab) {
        const uint32_t dst = stage_addr + slab * C::kSlabBytes;
        uint64_t* bar = full;
        if constexpr (kGroup == kGroupRight) {
            bar = &sm.kv_right_slab[pos.stage][slab - kFirst];
            MBarrier::expect_tx(bar, C::kSlabBytes);
        }
        if constexpr (kEvictFirst) {
            tma_load_4d_hint(dst, &p.k_tmap, slab * kSw128ColsBf16, kv_head, row0, block, smem_addr(bar),
                             l2_policy_evict_first());
        } else {
            tma_load_4d(dst, &p.k_tmap, slab * kSw128ColsBf16, kv_head, row0, block, smem_addr(bar));
        }
        if constexpr (kGroup == kGroupRight) MBarrier::arrive(bar, kWarpgroupThreads);
    }
    if constexpr (kGroup != kGroupRight) MBarrier::arrive(full, kWarpgroupThreads);
}

// The thread's share of gathering key tile k with cp.async (rows of keys past the request or in a missing block
// zero-filled, never read), given the block ids of its 4 rows.
template <int kDqk, bool kFenced>
__device__ __forceinline__ void gather_tile(const DecodeParams& p, SmemPlan<kDqk>& sm, const RowTile& rt, int k,
                                            const Ring& pos, uint32_t stage_base, const int (&blk)[kPassesPerTile],
                                            const Sw128CopyThread& ct) {
    using C = Config<kDqk>;
    const uint16_t* src[kPassesPerTile];
    bool ok[kPassesPerTile];
#pragma unroll
    for (int pass = 0; pass < kPassesPerTile; ++pass) {
        const int key = k * kKeysPerTile + pass * kRowsPerPass + ct.row_in_pass;
        ok[pass] = block_valid(p, blk[pass]);
        src[pass] = (ok[pass] ? key_row(p, blk[pass], key, rt.kv_head) : p.q) + ct.chunk_elems;
    }
    if constexpr (C::kRopeSlabs > 0) gather_group<kDqk, kGroupRope, kFenced>(sm, pos, stage_base, src, ok);
    gather_group<kDqk, kGroupLeft, kFenced>(sm, pos, stage_base, src, ok);
    gather_group<kDqk, kGroupRight, kFenced>(sm, pos, stage_base, src, ok);
    if constexpr (kFenced) {
        if constexpr (C::kRopeSlabs > 0) {
            cp_async_wait_group<2>();
            publish_generic_writes(&sm.kv_full[pos.stage][kGroupRope]);
        }
        cp_async_wait_group<1>();
        publish_generic_writes(&sm.kv_full[pos.stage][kGroupLeft]);
        cp_async_wait_group<0>();
        fence_proxy_async_shared();
#pragma unroll
        for (int j = 0; j < kSlabsPerHalf; ++j) MBarrier::arrive(&sm.kv_right_slab[pos.stage][j]);
    }
}

// kKeysOnce: one row tile per key head (the *_once kernels), whose key tiles no other CTA reads.
template <int kDqk, bool kKeysOnce>
__device__ __forceinline__ void producer(const DecodeParams& p, SmemPlan<kDqk>& sm, const Schedule& sched) {
    using C = Config<kDqk>;
    const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    const RowTile rt = RowTile::of(p);
    const uint32_t kv_base = smem_addr(sm.kv[0]) + ct.smem_off;
    const bool tma = (p.flags & kFlagKTma) != 0;
    if (tma && threadIdx.x == 0) tma_prefetch_map(&p.k_tmap);
    int tile = 0;      // ring position, continued across chunks
    int q_uses = 0;    // chunks with keys so far (phases of q_full / q_empty)
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            if (c.tile0 == c.tile1) return;
            if (q_uses > 0) MBarrier::wait(&sm.q_empty, static_cast<uint32_t>((q_uses - 1) & 1));
            load_q_tile<kDqk>(p, sm, rt, c.b, ct);
            ++q_uses;
            // Block ids of the thread's 4 rows (gather) or of the tile (TMA, the same for every thread), loaded a
            // tile ahead: their latency would otherwise sit in front of every tile.
            auto load_blocks = [&](int kt, int (&blk)[kPassesPerTile]) {
#pragma unroll
                for (int pass = 0; pass < kPassesPerTile; ++pass) {
                    blk[pass] = key_block(p, c.b, c.len, kt * kKeysPerTile + pass * kRowsPerPass + ct.row_in_pass);
                }
            };
            if (tma) {
                int next = key_block(p, c.b, c.len, c.tile0 * kKeysPerTile);
                for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                    const int block = next;
                    if (k + 1 < c.tile1) next = key_block(p, c.b, c.len, (k + 1) * kKeysPerTile);
                    const Ring pos = Ring::of(tile);
                    const int key0 = k * kKeysPerTile;
                    if (block_valid(p, block) && key0 + kKeysPerTile <= c.len) {
                        const uint32_t stage_addr = smem_addr(sm.kv[pos.stage]);
                        const int row0 = page_mod(p, key0);
                        if constexpr (C::kRopeSlabs > 0) {
                            tma_group<kDqk, kGroupRope, kKeysOnce>(p, sm, pos, stage_addr, block, row0, rt.kv_head);
                        }
                        tma_group<kDqk, kGroupLeft, kKeysOnce>(p, sm, pos, stage_addr, block, row0, rt.kv_head);
                        tma_group<kDqk, kGroupRight, kKeysOnce>(p, sm, pos, stage_addr, block, row0, rt.kv_head);
                    } else {
                        // The request's last, partial tile or a missing block: rows past the request's keys must
                        // be zeros (the cache may hold NaN there), which only the gather writes.
                        int blk[kPassesPerTile];
                        load_blocks(k, blk);
                        gather_tile<kDqk, true>(p, sm, rt, k, pos, kv_base + pos.stage * C::kStageBytes, blk, ct);
                    }
                }
                return;
            }
            int blk[kPassesPerTile];
            int blk_next[kPassesPerTile];
            load_blocks(c.tile0, blk);
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                if (k + 1 < c.tile1) load_blocks(k + 1, blk_next);
                const Ring pos = Ring::of(tile);
                gather_tile<kDqk, false>(p, sm, rt, k, pos, kv_base + pos.stage * C::kStageBytes, blk, ct);
#pragma unroll
                for (int pass = 0; pass < kPassesPerTile; ++pass) blk[pass] = blk_next[pass];
            }
        });
    }
}

// The sparse decode's producer: the same chunk walk and Q tile as the dense one. Per key tile, each thread copies
// its row's raw bytes into the stage with cp.async as soon as each column group is released (sparse_keys.cuh has
// the scheme), then dequantises them in place once they landed and publishes the group (proxy fence, 128
// arrivals). The RoPE group (V3.2) needs no dequantisation: its copies join the left group's cp.async group and are
// published with it. Indices are loaded a tile ahead; scales are loaded with the copies and used after them.
template <int kDqk>
__device__ __forceinline__ void producer_sparse(const DecodeParams& p, SmemPlan<kDqk>& sm, const Schedule& sched) {
    using C = Config<kDqk>;
    constexpr int kNopeSlabs = Fp8Format<kDqk>::kDNope / kSw128ColsBf16;  // 8 (V3.2) or 7 (MODEL1)
    const int t = static_cast<int>(threadIdx.x);
    const Sw128CopyThread ct = Sw128CopyThread::of(t);
    const RawLane lane = RawLane::of(t);
    const bool copy8 = (p.flags & kFlagCopy8) != 0;
    int tile = 0;
    int q_uses = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            if (c.tile0 == c.tile1) return;
            if (q_uses > 0) MBarrier::wait(&sm.q_empty, static_cast<uint32_t>((q_uses - 1) & 1));
            load_q_tile<kDqk>(p, sm, RowTile::of(p), c.b, ct);  // re-derived: registers are short
            ++q_uses;
            const IndexRows ir = IndexRows::of(p, c);
            int idx = sparse_index(ir, c, c.tile0 * kKeysPerTile + lane.row);
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                const Fp8Row row = sparse_row(p, c, k * kKeysPerTile + lane.row, idx);
                const uint4 scales = load_scales<kDqk>(row);
                if (k + 1 < c.tile1) idx = sparse_index(ir, c, (k + 1) * kKeysPerTile + lane.row);
                const Ring pos = Ring::of(tile);
                const uint32_t stage = smem_addr(sm.kv[pos.stage]);
                if constexpr (C::kRopeSlabs > 0) {  // published with the left group (same cp.async group)
                    MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRope], pos.empty_parity);
                    copy_rope<kDqk>(stage, lane, row, p.q, copy8);
                }
                MBarrier::wait(&sm.kv_empty[pos.stage][kGroupLeft], pos.empty_parity);
#pragma unroll
                for (int s = 0; s < kSlabsPerHalf; ++s) copy_nope_raw<kDqk>(stage, lane, row, s, p.q, copy8);
                cp_async_commit_group();
                MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRight], pos.empty_parity);
#pragma unroll
                for (int s = kSlabsPerHalf; s < kNopeSlabs; ++s) copy_nope_raw<kDqk>(stage, lane, row, s, p.q, copy8);
                if constexpr (C::kRopeSlabs == 0) copy_rope<kDqk>(stage, lane, row, p.q, copy8);  // MODEL1: slab 7
                cp_async_commit_group();

                cp_async_wait_group<1>();
                dequant_slabs<kDqk, 0, kSlabsPerHalf>(stage, lane, scales);
                fence_proxy_async_shared();
                if constexpr (C::kRopeSlabs > 0) MBarrier::arrive(&sm.kv_full[pos.stage][kGroupRope]);
                MBarrier::arrive(&sm.kv_full[pos.stage][kGroupLeft]);
                cp_async_wait_group<0>();
                dequant_slabs<kDqk, kSlabsPerHalf, kNopeSlabs>(stage, lane, scales);
                MBarrier::arrive(&sm.kv_full[pos.stage][kGroupRight]);  // no fence: `consumers_fence_right`
            }
        });
    }
}

// The sparse producer of a 2-CTA cluster (the *_pair kernels), filling every group of a tile from registers: CTA
// `rank` converts rows 32 rank .. 32 rank + 31 (SplitLane) and writes them to both CTAs' stages (st.async to the
// peer's, completing on its full barrier), RoPE rows included, so each CTA converts and sends half of every tile. A
// tile's bytes travel in registers (PairRegs) in two parts: the next tile's left pieces (scales, V3.2's RoPE, NoPE
// slabs 0..3) are loaded as soon as this tile's left group is stored, its right pieces once the right group is, so
// each part is in flight while the other is converted and while the stage is released. Groups are written once both
// CTAs' consumers released them (kv_empty counts the peer's credits too) and published in the order the consumers
// read them: rope (d_qk 576) and left behind one proxy fence, then right behind another. A chunk's Q is loaded once
// its first tile is stored, so that tile's loads travel during the previous chunk's epilogue. The value warpgroup only
// multiplies.
template <int kDqk>
__device__ __forceinline__ void producer_sparse_regs(const DecodeParams& p, SmemPlan<kDqk>& sm,
                                                     const Schedule& sched) {
    using C = Config<kDqk>;
    using Regs = PairRegs<kDqk>;
    constexpr int kNopeSlabs = Regs::kNopeSlabs;                  // 8 (V3.2) or 7 (MODEL1)
    constexpr uint32_t kPeerBytesPerSlab = 32 * kSw128RowBytes;  // the peer's 32 rows of a slab
    const int t = static_cast<int>(threadIdx.x);
    const uint32_t rank = cluster_ctarank();
    const uint32_t peer = rank ^ 1u;
    const Sw128CopyThread ct = Sw128CopyThread::of(t);
    const SplitLane split = SplitLane::of(t, rank);  // row 32 rank + t / 4
    const bool copy8 = (p.flags & kFlagCopy8) != 0;
    int tile = 0;
    int q_uses = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            if (c.tile0 == c.tile1) return;
            const IndexRows ir = IndexRows::of(p, c);
            Regs regs;
            {
                const int k0 = c.tile0 * kKeysPerTile;
                const Fp8Row row0 = sparse_row(p, c, k0 + split.row, sparse_index(ir, c, k0 + split.row));
                regs.load_left(row0, split, copy8);
                regs.load_right(row0, split, copy8);
            }
            int idx = sparse_index(ir, c, (c.tile0 + 1) * kKeysPerTile + split.row);
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                const Ring pos = Ring::of(tile);
                const uint32_t stage = smem_addr(sm.kv[pos.stage]);
                const uint32_t peer_stage = mapa_shared(stage, peer);
                uint64_t* left = &sm.kv_full[pos.stage][kGroupLeft];
                uint64_t* right = &sm.kv_full[pos.stage][kGroupRight];
                if constexpr (C::kRopeSlabs > 0) {
                    uint64_t* rope = &sm.kv_full[pos.stage][kGroupRope];
                    MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRope], pos.empty_parity);
                    regs.store_rope(stage, peer_stage, mapa_shared(smem_addr(rope), peer), split);
                }
                MBarrier::wait(&sm.kv_empty[pos.stage][kGroupLeft], pos.empty_parity);
                regs.template store_nope<0, kSlabsPerHalf>(stage, peer_stage, mapa_shared(smem_addr(left), peer), split,
                                                           regs.scales);
                fence_proxy_async_shared();
                if constexpr (C::kRopeSlabs > 0) {
                    uint64_t* rope = &sm.kv_full[pos.stage][kGroupRope];
                    if (t == 0) {
                        mbarrier_arrive_expect_tx(smem_addr(rope), kPeerBytesPerSlab);
                    } else {
                        MBarrier::arrive(rope);
                    }
                }
                if (t == 0) {
                    mbarrier_arrive_expect_tx(smem_addr(left), kSlabsPerHalf * kPeerBytesPerSlab);
                } else {
                    MBarrier::arrive(left);
                }
                // The next tile's left pieces, in flight while this tile's right group is converted.
                const uint4 sc = regs.scales;
                const bool has_next = k + 1 < c.tile1;
                Fp8Row next{nullptr, 0, 0};
                if (has_next) {
                    next = sparse_row(p, c, (k + 1) * kKeysPerTile + split.row, idx);
                    regs.load_left(next, split, copy8);
                }
                MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRight], pos.empty_parity);
                regs.template store_nope<kSlabsPerHalf, kNopeSlabs>(stage, peer_stage,
                                                                    mapa_shared(smem_addr(right), peer), split, sc);
                constexpr int kRightSlabs = kNopeSlabs - kSlabsPerHalf + (C::kRopeSlabs == 0 ? 1 : 0);
                if constexpr (C::kRopeSlabs == 0) {  // MODEL1: slab 7, the right group
                    regs.store_rope(stage, peer_stage, mapa_shared(smem_addr(right), peer), split);
                }
                // No fence: the consumers fence the right group (`consumers_fence_right`).
                if (t == 0) {
                    mbarrier_arrive_expect_tx(smem_addr(right), kRightSlabs * kPeerBytesPerSlab);
                } else {
                    MBarrier::arrive(right);
                }
                // The chunk's Q once its first tile is stored: that tile's stage was released during the previous
                // chunk's loop; Q, after its last QK (a split chunk: once its partial left the Q tile).
                if (k == c.tile0) {
                    if (q_uses > 0) MBarrier::wait(&sm.q_empty, static_cast<uint32_t>((q_uses - 1) & 1));
                    load_q_tile<kDqk>(p, sm, RowTile::of(p), c.b, ct);
                    ++q_uses;
                }
                // The next tile's right pieces, in flight while its stage is released.
                if (has_next) {
                    regs.load_right(next, split, copy8);
                    if (k + 2 < c.tile1) idx = sparse_index(ir, c, (k + 2) * kKeysPerTile + split.row);
                }
            }
        });
    }
    // Lifetime: the peer's consumers may still credit this CTA's kv_empty barriers for the last two tiles, so the
    // producer waits for both CTAs' releases of them before the CTA may exit.
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
        const Ring pos = Ring::of(tile + i);
        MBarrier::wait(&sm.kv_empty[pos.stage][kGroupLeft], pos.empty_parity);
        MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRight], pos.empty_parity);
        if constexpr (C::kRopeSlabs > 0) MBarrier::wait(&sm.kv_empty[pos.stage][kGroupRope], pos.empty_parity);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

// Whether the consumers must fence the generic proxy after a key group's full barrier: where the producer's
// cp.async copies complete the barrier themselves (the dense gather path). TMA tiles are written by the async proxy;
// the dense TMA path's gathered tiles (a request's partial last tile, a missing block) and the sparse rope and left
// groups are fenced by the producer before its arrival.
template <bool kSparse>
__device__ __forceinline__ bool consumers_fence(const DecodeParams& p) {
    return !kSparse && (p.flags & kFlagKTma) == 0;
}

// The right group: also fenced by the consumers in every sparse kernel. A proxy fence's MEMBAR waits for the thread's
// loads in flight; when a sparse producer publishes its right group, those are the next tile's left pieces (pair
// kernels) or its index loads, so its own fence there would wait for HBM (docs/decode.md, "Proxy fences").
template <bool kSparse>
__device__ __forceinline__ bool consumers_fence_right(const DecodeParams& p) {
    return kSparse || consumers_fence<kSparse>(p);
}

// "S first" (dense decode, two or more row tiles per key head): the value warpgroup multiplies tile i - 1 only once
// S(i) is in (Bar::SDone). S = Q K^T reads both operands from shared memory at N = 64, so the value warpgroup's P V
// beside it slowed it; after it, that P V overlaps the score warpgroup's softmax instead (h_q 128 at 16K / 32K keys:
// +2 to +8%, causal +4%). With one row tile (the `*_once` kernels, HBM-bound) the later release of the right group
// costs as much as it gains (docs/decode.md).
__device__ __forceinline__ bool s_first_pipeline(const DecodeParams& p) {
    return (p.flags & kFlagSparse) == 0 && p.row_tiles > 1;
}

// Key references of keys `lane` and `lane + 32` of tile k of chunk c (the score warpgroup's view of the producer's
// test: block ids when dense, raw indices when sparse), loaded a tile before the mask is formed from them.
template <bool kSparse>
struct TileKeys {
    int lo;
    int hi;
    // ir: the chunk's index rows, or nullptr to find them at each load (sparse_keys.cuh, sparse_index).
    static __device__ __forceinline__ TileKeys load(const DecodeParams& p, const IndexRows* ir, const Chunk& c, int k,
                                                    int lane) {
        const int key = k * kKeysPerTile + lane;
        if constexpr (kSparse) {
            if (ir == nullptr) return {sparse_index(p, c, key), sparse_index(p, c, key + 32)};
            return {sparse_index(*ir, c, key), sparse_index(*ir, c, key + 32)};
        }
        return {key_block(p, c.b, c.len, key), key_block(p, c.b, c.len, key + 32)};
    }
    __device__ __forceinline__ TileMask mask(const DecodeParams& p, const Chunk& c, int k, int lane) const {
        if constexpr (kSparse) {
            const int key = k * kKeysPerTile + lane;
            return TileMask::of_lanes(sparse_valid(p, c, key, lo), sparse_valid(p, c, key + 32, hi));
        }
        return TileMask::of_lanes(block_valid(p, lo), block_valid(p, hi));
    }
};

// Bottom-right causal mask of tile k: row r (token s) sees keys < limit[r] = len - s_q + s + 1. Applied only when a
// key of the tile reaches the smallest limit of the thread's rows (warp-uniform test).
__device__ __forceinline__ void mask_causal(float (&s)[kSRegs], int k, const int (&limit)[2], const AccFrag& f) {
    const int key0 = k * kKeysPerTile;
    if (!__any_sync(kFullMask, key0 + kKeysPerTile > min(limit[0], limit[1]))) return;
#pragma unroll
    for (int j = 0; j < kSBlocks; ++j) {
        const int key = key0 + f.col(j);
        s[4 * j + 0] = key < limit[0] ? s[4 * j + 0] : -kInf;
        s[4 * j + 1] = key + 1 < limit[0] ? s[4 * j + 1] : -kInf;
        s[4 * j + 2] = key < limit[1] ? s[4 * j + 2] : -kInf;
        s[4 * j + 3] = key + 1 < limit[1] ? s[4 * j + 3] : -kInf;
    }
}

// Q's rope columns (512..575) of the thread's two rows as register A fragments (layout: smem_layout.cuh). Rows past
// the tile's rows stay zero.
template <int kDqk>
__device__ __forceinline__ void load_q_rope(const DecodeParams& p, const RowTile& rt, int b, const AccFrag& f,
                                            const int (&rows)[2], uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4]) {
    using C = Config<kDqk>;
#pragma unroll
    for (int ks = 0; ks < C::kRopeFragSteps; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) q_rope[ks][e] = 0u;
    }
    if constexpr (C::kRopeSteps > 0) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            if (rows[rr] < rt.rows) {
                const uint16_t* q_row = p.q + request_offset(p, b, p.q_stride_b, p.q_stride_s) +
                                        static_cast<int64_t>(rt.token(p, rows[rr])) * p.q_stride_s +
                                        static_cast<int64_t>(rt.head(p, rows[rr])) * p.q_stride_h;
#pragma unroll
                for (int ks = 0; ks < C::kRopeSteps; ++ks) {
                    // 4-byte loads: q rows are 16-byte aligned (host-checked) and the column is even.
                    const uint32_t* src = reinterpret_cast<const uint32_t*>(q_row + kDv + 16 * ks + 2 * f.quad);
                    q_rope[ks][rr] = __ldg(src);
                    q_rope[ks][2 + rr] = __ldg(src + 4);
                }
            }
        }
    }
}

// V operand of PV (MN-major): rows 16 kb.. of the 4 slabs starting at `first_slab` of a stage.
template <int kDqk>
__device__ __forceinline__ uint64_t v_desc(uint32_t stage_addr, int first_slab, int kb) {
    using C = Config<kDqk>;
    return make_wgmma_desc_sw128(stage_addr + first_slab * C::kSlabBytes + kb * 16 * kSw128RowBytes, C::kSlabBytes,
                                 kSw128AtomBytes);
}

// The k-steps of S = Q K^T that read column group kGroup of a stage, after waiting for it to land.
// kSlabBarriers (dense decode, right group): each slab of the group has its own full barrier (kv_right_slab).
template <class E, int kDqk, int kGroup, bool kFirstGroup, bool kSlabBarriers = false>
__device__ __forceinline__ void qk_group(SmemPlan<kDqk>& sm, const Ring& pos, uint64_t desc_q, uint64_t desc_k,
                                         const uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4],
                                         float (&s)[kSRegs], bool fence) {
    using C = Config<kDqk>;
    if constexpr (!kSlabBarriers) {
        MBarrier::wait(&sm.kv_full[pos.stage][kGroup], pos.full_parity);
        if (fence) fence_proxy_async_shared();  // cp.async (generic proxy) wrote the group; wgmma reads it (async)
    }
    constexpr int kFirstSlab = group_first_slab(kGroup);
    constexpr int kSteps = group_slabs<kDqk>(kGroup) * C::kKStepsPerSlab;
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
        if constexpr (kSlabBarriers) {
            if (ks % C::kKStepsPerSlab == 0) {
                MBarrier::wait(&sm.kv_right_slab[pos.stage][ks / C::kKStepsPerSlab], pos.full_parity);
                if (fence) fence_proxy_async_shared();
            }
        }
        const uint32_t off = (kFirstSlab + ks / C::kKStepsPerSlab) * C::kSlabBytes + (ks % C::kKStepsPerSlab) * 32;
        const bool acc = !(kFirstGroup && ks == 0);
        if constexpr (kGroup == kGroupRope) {
            wgmma_m64n64k16_rs_kk<E>(s, q_rope[ks], wgmma_desc_advance(desc_k, off), acc);
        } else {
            wgmma_m64n64k16_ss_kk<E>(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), acc);
        }
    }
}

// S = Q K^T of one tile (rope group first, then the halves in the producer's fill order), one commit group.
template <class E, int kDqk, bool kSparse>
__device__ __forceinline__ void issue_qk(SmemPlan<kDqk>& sm, const Ring& pos, uint64_t desc_q,
                                         const uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4],
                                         float (&s)[kSRegs], bool fence, bool fence_right) {
    using C = Config<kDqk>;
    const uint64_t desc_k = make_wgmma_desc_sw128(smem_addr(sm.kv[pos.stage]), kUnusedLbo, kSw128AtomBytes);
    wgmma_fence();
    if constexpr (C::kRopeSlabs > 0) {
        qk_group<E, kDqk, kGroupRope, true>(sm, pos, desc_q, desc_k, q_rope, s, fence);
        qk_group<E, kDqk, kGroupLeft, false>(sm, pos, desc_q, desc_k, q_rope, s, fence);
    } else {
        qk_group<E, kDqk, kGroupLeft, true>(sm, pos, desc_q, desc_k, q_rope, s, fence);
    }
    qk_group<E, kDqk, kGroupRight, false, !kSparse>(sm, pos, desc_q, desc_k, q_rope, s, fence_right);
    wgmma_commit();
}

// A staging area's base and the thread's accumulator rows and quad, as opaque copies: the 64 shared-memory write
// addresses formed from them are loop invariants of the caller's chunk loop, and formed from plain values they
// were hoisted there (and spilled).
struct StagingGeometry {
    uint32_t base;
    uint32_t row0;
    uint32_t quad;
    static __device__ __forceinline__ StagingGeometry of(uint32_t area, const AccFrag& f) {
        StagingGeometry g;
        asm volatile("mov.u32 %0, %1;" : "=r"(g.base) : "r"(area));
        asm volatile("mov.u32 %0, %1;" : "=r"(g.row0) : "r"(static_cast<uint32_t>(f.row0)));
        asm volatile("mov.u32 %0, %1;" : "=r"(g.quad) : "r"(static_cast<uint32_t>(f.quad)));
        return g;
    }
};

// Writes one consumer's O half of a split chunk as an f32 partial (scaled by inv). Stored from registers, a CTA's
// 128 KB partial took 8-10 us of the load/store path (the accumulator layout writes each 128-byte row segment in
// four 32-byte pieces). So the half is staged in `area`, 64 KB of shared memory nothing reads now (the caller keeps
// the producer off it until PartialStaged), as 64 rows of 1 KB, and each row leaves as one bulk store. (The staging
// writes are 8-way bank conflicted: a padded or swizzled row does not fit the area or would reach memory permuted,
// and the combine measured 1.3-1.6x slower reading a row-swizzled partial.)
__device__ __forceinline__ void store_partial_half(const DecodeParams& p, const RowTile& rt, const Chunk& c,
                                                   const AccFrag& f, int consumer, const float (&o)[kORegs],
                                                   const float (&inv)[2], uint32_t area) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const auto [base, row0, quad] = StagingGeometry::of(area, f);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const uint32_t row_base = base + (row0 + 8 * rr) * kPartialRowBytes + quad * 8;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j) {
            // Columns f.col(j) = 8 j + 2 quad and the next one.
            st_shared_v2_f32(row_base + 32 * j, o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]);
        }
    }
    fence_proxy_async_shared();  // generic-proxy writes -> the bulk copy (async proxy) reads them
    __syncwarp();
    const int row = (f.row0 & ~15) + lane;  // lanes 0..15 store the warp's 16 rows
    if (lane < 16 && row < rt.rows) {
        float* dst = p.part_o + ((static_cast<int64_t>(c.slot) * p.head_tiles + blockIdx.x) * kRowsPerCta + row) * kDv +
                     consumer * kDvPerConsumer;
        bulk_store_s2g_keep(dst, base + row * kPartialRowBytes, kPartialRowBytes);
    }
    bulk_commit();
    bulk_wait_read();
    __syncwarp();
}

// Stages one consumer's final half (output dtype, scaled by inv) into `area` (the chunk's last key stage): row r's
// 512 elements at area + r * 1 KB, this consumer's 256 at + consumer * 512 bytes. The score warpgroup then sends
// each row as one 1 KB bulk store (store_final_rows) once both halves are staged.
template <class E>
__device__ __forceinline__ void stage_final_half(const AccFrag& f, int consumer, const float (&o)[kORegs],
                                                 const float (&inv)[2], uint32_t area) {
    const auto [base, row0, quad] = StagingGeometry::of(area, f);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const uint32_t row_base = base + (row0 + 8 * rr) * 1024u + consumer * 512u + quad * 4;
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j) {
            st_shared_u32(row_base + 16 * j, pack_x2<E>(o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]));
        }
    }
    fence_proxy_async_shared();
}
// Score warpgroup: lanes 0..15 of each warp send the warp's 16 staged rows of chunk c to `out` (1 KB each).
__device__ __forceinline__ void store_final_rows(const DecodeParams& p, const RowTile& rt, const Chunk& c,
                                                 const AccFrag& f, uint32_t area) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int row = (f.row0 & ~15) + lane;
    if (lane < 16 && row < rt.rows) {
        uint16_t* dst = p.out + request_offset(p, c.b, p.out_stride_b, p.out_stride_s) +
                        static_cast<int64_t>(rt.token(p, row)) * p.out_stride_s +
                        static_cast<int64_t>(rt.head(p, row)) * p.out_stride_h;
        bulk_store_s2g_keep(dst, area + row * 1024u, 1024u);
    }
    bulk_commit();
    bulk_wait_read();
    __syncwarp();
}
// ... or, where out rows are not 16-byte aligned (no kFlagOutBulk), each warp copies its 16 staged rows with 4-byte
// (kFlagOutVec4) or 2-byte stores, in a rolled loop; `area` == kNoStaging writes zeros (a chunk without keys, whose
// rows have no staging area: the producer may be loading the next chunk's Q into the Q tile). The unrolled register
// form this replaces was a fifth of a split kernel's code (32 KB) for a path few calls take.
inline constexpr uint32_t kNoStaging = 0xFFFFFFFFu;
__device__ __forceinline__ void copy_final_rows(const DecodeParams& p, const RowTile& rt, const Chunk& c,
                                                const AccFrag& f, uint32_t area) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const bool vec4 = (p.flags & kFlagOutVec4) != 0;
    const int first = f.row0 & ~15;
    const int end = min(first + 16, rt.rows);
#pragma unroll 1
    for (int row = first; row < end; ++row) {
        uint16_t* dst = p.out + request_offset(p, c.b, p.out_stride_b, p.out_stride_s) +
                        static_cast<int64_t>(rt.token(p, row)) * p.out_stride_s +
                        static_cast<int64_t>(rt.head(p, row)) * p.out_stride_h;
#pragma unroll 1
        for (int i = lane; i < kDv / 2; i += 32) {
            const uint32_t v = area == kNoStaging ? 0u : ld_shared_u32(area + row * 1024u + 4 * i);
            if (vec4) {
                *reinterpret_cast<uint32_t*>(dst + 2 * i) = v;
            } else {
                dst[2 * i] = static_cast<uint16_t>(v & 0xFFFFu);
                dst[2 * i + 1] = static_cast<uint16_t>(v >> 16);
            }
        }
    }
    __syncwarp();
}

// Per-chunk state of the score warpgroup's softmax.
struct SoftmaxState {
    float m_run[2];   // running max of the base-2 logits
    float m_ref[2];   // reference P, O and l are relative to (lazy: m_run - 8 < m_ref <= m_run)
    float row_sum[2]; // this thread's partial row sums, relative to m_ref
};

// Row `row`'s sink logit in base 2, or -inf without a sink or past the tile's rows. A row's head is the same in
// every chunk, so the split kernels' score warpgroup loads it once, before its chunks: in the epilogue the load sat
// in front of every chunk's 1 / denominator, which both consumers wait for.
__device__ __forceinline__ float row_sink_log2(const DecodeParams& p, const RowTile& rt, int row) {
    if (p.attn_sink == nullptr || row >= rt.rows) return -kInf;
    return __ldg(p.attn_sink + static_cast<int64_t>(rt.head(p, row)) * p.attn_sink_stride) * kLog2e;
}

// One query row's end of a chunk: 1 / denominator (row sum, plus the sink term in an unsplit chunk; 0 for a row
// without keys) and, by the thread that `writes`, row_inv[row] and the row's lse (final: natural log, +inf without
// keys; partial: -inf without keys). `m_ref`: the base-2 reference the row sum `l` is relative to; `sink_log2`:
// row_sink_log2 of the row.
__device__ __forceinline__ float finish_row(const DecodeParams& p, float* row_inv, const RowTile& rt, const Chunk& c,
                                            int row, float m_ref, bool empty, float l, bool writes, float sink_log2) {
    const bool exists = row < rt.rows;
    float denom = l;
    if (!c.split && sink_log2 != -kInf && !empty) {
        // The sink is one more logit with a zero value vector: it only enlarges the denominator.
        denom += exp2f(sink_log2 - m_ref);
    }
    const float inv = empty ? 0.f : 1.f / denom;
    if (writes) {
        row_inv[row] = inv;
        if (exists) {
            const float lse = (m_ref + log2f(l)) * kLn2;
            if (c.split) {
                p.part_lse[(static_cast<int64_t>(c.slot) * p.head_tiles + blockIdx.x) * kRowsPerCta + row] =
                    empty ? -kInf : lse;
            } else {
                p.lse[request_offset(p, c.b, p.lse_stride_b, p.lse_stride_s) +
                      static_cast<int64_t>(rt.head(p, row)) * p.lse_stride_h +
                      static_cast<int64_t>(rt.token(p, row)) * p.lse_stride_s] = empty ? kInf : lse;
            }
        }
    }
    return inv;
}

// The chunk's epilogue on the score side: row sums, lse (final or partial), 1 / denominator for both consumers.
__device__ __forceinline__ void score_epilogue(const DecodeParams& p, float* row_inv, const RowTile& rt,
                                               const Chunk& c, const AccFrag& f, const SoftmaxState& st,
                                               const float (&sink_log2)[2], float (&inv)[2]) {
    const int rows[2] = {f.row0, f.row1()};
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        // m_run == -inf: no key (out 0, lse +inf final / -inf partial).
        inv[rr] = finish_row(p, row_inv, rt, c, rows[rr], st.m_ref[rr], st.m_run[rr] == -kInf,
                             quad_sum(st.row_sum[rr]), f.quad == 0, sink_log2[rr]);
    }
}

// Score warpgroup (WG 1). Per chunk: wait Q; per tile i (stage i % 2), with QK(i) issued one iteration earlier:
//   wait QK(i) -> (S first: SDone) -> release rope group (and Q after the chunk's last QK) -> mask, online softmax,
//   P -> PV(i) on O[:, 0:256] -> publish P(i), alpha(i) -> wait PV(i) -> release left group -> QK(i + 1) -> Handoff.
// (The sparse kernels pass Handoff right after publishing P(i), so that the value warpgroup's PV(i) releases the
// right group, whose refill the score warpgroup waits for most, one PV earlier.) Then the epilogue.
// `split_dequant`: a *_pair kernel, whose peer's producer writes this CTA's stages too (it credits both).
template <class E, int kDqk, bool kSparse, bool kPair>
__device__ __forceinline__ void score_consumer(const DecodeParams& p, SmemPlan<kDqk>& sm, const Schedule& sched,
                                               bool split_dequant) {
    using C = Config<kDqk>;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * static_cast<int>(Role::Score);
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int rows[2] = {f.row0, f.row1()};
    const float scale = p.sm_scale_log2;  // > 0 (validated), so max and scaling commute
    const RowTile rt = RowTile::of(p);
    const bool causal = (p.flags & kFlagCausal) != 0;
    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q), kUnusedLbo, kSw128AtomBytes);
    const bool bulk_out = (p.flags & kFlagOutBulk) != 0;
    const uint32_t peer = split_dequant ? cluster_ctarank() ^ 1u : 0u;
    const bool consumer_fence = consumers_fence<kSparse>(p);
    const bool consumer_fence_right = consumers_fence_right<kSparse>(p);
    const bool s_first = s_first_pipeline(p);
    const float sink_log2[2] = {row_sink_log2(p, rt, rows[0]), row_sink_log2(p, rt, rows[1])};

    int tile = 0;
    int q_uses = 0;
    int chunks = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            // Sparse: the request's index rows, found once per chunk; the pair kernels' score warpgroup finds them at
            // every load (held across its tile loop, they cost those kernels 1-4%: docs/perf-log.md).
            const IndexRows ir_chunk = IndexRows::of(p, c);
            const IndexRows* const ir = kPair ? nullptr : &ir_chunk;
            const int n_tiles = c.tile1 - c.tile0;
            float o[kORegs];
            zero_regs(o);
            float s[kSRegs];
            zero_regs(s);
            SoftmaxState st{{-kInf, -kInf}, {-kInf, -kInf}, {0.f, 0.f}};
            uint32_t q_rope[C::kRopeFragSteps][4];
            int limit[2] = {c.len, c.len};
            if (causal) {
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    limit[rr] = rows[rr] < rt.rows ? c.len - p.s_q + rt.token(p, rows[rr]) + 1 : c.len;
                }
            }
            TileMask mask{0u, 0u};
            TileKeys<kSparse> blk_next{-1, -1};
            if (n_tiles > 0) {
                load_q_rope<kDqk>(p, rt, c.b, f, rows, q_rope);
                // The first tile's key references are loaded here and turned into its mask only once QK(0) is
                // issued: their latency then overlaps the Q wait and the product instead of preceding both.
                const TileKeys<kSparse> blk_first = TileKeys<kSparse>::load(p, ir, c, c.tile0, lane);
                if (n_tiles > 1) blk_next = TileKeys<kSparse>::load(p, ir, c, c.tile0 + 1, lane);
                MBarrier::wait(&sm.q_full, static_cast<uint32_t>(q_uses & 1));
                fence_proxy_async_shared();  // the Q tile's cp.async (generic proxy) -> wgmma (async proxy)
                issue_qk<E, kDqk, kSparse>(sm, Ring::of(tile), desc_q, q_rope, s, consumer_fence,
                                           consumer_fence_right);
                mask = blk_first.mask(p, c, c.tile0, lane);
            }
            for (int i = 0; i < n_tiles; ++i, ++tile) {
                const Ring pos = Ring::of(tile);
                const bool has_next = i + 1 < n_tiles;
                const uint32_t stage_addr = smem_addr(sm.kv[pos.stage]);

                wgmma_wait<0>();
                wgmma_fence_regs(s);
                wgmma_fence_regs(o);
                // S first (s_first_pipeline): the value warpgroup multiplies tile i - 1 only now, so that S(i) had
                // the tensor cores and the shared-memory reads to itself.
                if (!kSparse && s_first && i > 0) named_barrier_arrive(Bar::SDone, kConsumerThreads);
                if constexpr (C::kRopeSlabs > 0) {
                    release_by_warp(&sm.kv_empty[pos.stage][kGroupRope], lane);
                    if (split_dequant && lane == 0) {  // the peer's producer writes this CTA's rope rows too
                        mbarrier_arrive_remote_relaxed(
                            mapa_shared(smem_addr(&sm.kv_empty[pos.stage][kGroupRope]), peer));
                    }
                }
                // The chunk's last QK has read Q. A split chunk keeps it until its epilogue has staged the partial
                // there (the producer loads nothing of the next chunk before Q but, in the pair kernels, its first
                // tile, into the other key stage).
                // (A final chunk's rows are staged in its last key stage: Q is free now.)
                const bool final_in_stage = !c.split;
                if (!has_next && final_in_stage) release_by_warp(&sm.q_empty, lane);

                mask_invalid_rows(s, mask, f);
                if (causal) mask_causal(s, c.tile0 + i, limit, f);
                float alpha[2];
                float m_exp[2];
                update_row_max(s, scale, st.m_run, st.m_ref, alpha, m_exp);
                if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) scale_o_rows(o, alpha[0], alpha[1]);

                uint32_t pa[kPvSteps][4];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
#pragma unroll
                    for (int j = half * kSBlocks / 2; j < (half + 1) * kSBlocks / 2; ++j) {
                        s[4 * j + 0] = exp2f(fmaf(s[4 * j + 0], scale, -m_exp[0]));
                        s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], scale, -m_exp[0]));
                        s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], scale, -m_exp[1]));
                        s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], scale, -m_exp[1]));
                    }
#pragma unroll
                    for (int kb = half * kPvSteps / 2; kb < (half + 1) * kPvSteps / 2; ++kb) {
                        pa[kb][0] = pack_x2<E>(s[8 * kb + 0], s[8 * kb + 1]);
                        pa[kb][1] = pack_x2<E>(s[8 * kb + 2], s[8 * kb + 3]);
                        pa[kb][2] = pack_x2<E>(s[8 * kb + 4], s[8 * kb + 5]);
                        pa[kb][3] = pack_x2<E>(s[8 * kb + 6], s[8 * kb + 7]);
                    }
                    wgmma_fence();
#pragma unroll
                    for (int kb = half * kPvSteps / 2; kb < (half + 1) * kPvSteps / 2; ++kb) {
                        wgmma_m64n256k16_rs_mn<E>(o, pa[kb], v_desc<kDqk>(stage_addr, 0, kb), true);
                    }
                }
                wgmma_commit();

                float psum[2] = {0.f, 0.f};
#pragma unroll
                for (int j = 0; j < kSBlocks; ++j) {
                    psum[0] += s[4 * j + 0] + s[4 * j + 1];
                    psum[1] += s[4 * j + 2] + s[4 * j + 3];
                }
                st.row_sum[0] = st.row_sum[0] * alpha[0] + psum[0];
                st.row_sum[1] = st.row_sum[1] * alpha[1] + psum[1];
                if (f.quad == 0) {
                    sm.row_scale[pos.stage][rows[0]] = alpha[0];
                    sm.row_scale[pos.stage][rows[1]] = alpha[1];
                }
                const uint32_t p_addr = smem_addr(sm.p[pos.stage]);
#pragma unroll
                for (int j = 0; j < kSBlocks; ++j) {
                    st_shared_u32(p_addr + sw128_chunk_offset(rows[0], j) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 0]);
                    st_shared_u32(p_addr + sw128_chunk_offset(rows[1], j) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 1]);
                }
                fence_proxy_async_shared();
                // The sparse kernels hand P(i) over before their P V(i) wait and QK(i + 1): the value warpgroup's P V(i)
                // then releases the right group a P V earlier, and the producer's refill of it (a dequantisation, not
                // a TMA copy) is what the score warpgroup waits for most.
                if constexpr (kSparse) named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);

                if (has_next) {
                    mask = blk_next.mask(p, c, c.tile0 + i + 1, lane);
                    if (i + 2 < n_tiles) blk_next = TileKeys<kSparse>::load(p, ir, c, c.tile0 + i + 2, lane);
                }
                wgmma_wait<0>();
                wgmma_fence_regs(pa[0]);
                wgmma_fence_regs(pa[1]);
                wgmma_fence_regs(pa[2]);
                wgmma_fence_regs(pa[3]);
                if (has_next || !final_in_stage) {
                    release_by_warp(&sm.kv_empty[pos.stage][kGroupLeft], lane);
                    if (split_dequant && lane == 0) {
                        mbarrier_arrive_remote_relaxed(
                            mapa_shared(smem_addr(&sm.kv_empty[pos.stage][kGroupLeft]), peer));
                    }
                }
                if (has_next) {
                    issue_qk<E, kDqk, kSparse>(sm, Ring::of(tile + 1), desc_q, q_rope, s, consumer_fence,
                                               consumer_fence_right);
                }
                if constexpr (!kSparse) named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);
            }
            if (n_tiles > 0) ++q_uses;

            float inv[2];
            score_epilogue(p, sm.row_inv[chunks % 2], rt, c, f, st, sink_log2, inv);
            named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
            if (c.split) {
                store_partial_half(p, rt, c, f, 0, o, inv, smem_addr(sm.q));
                // Both halves have left shared memory: the producer may load the next chunk (Q, then its tiles).
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                // Split dequantisation: the value half goes through the Q tile after this one (the peer's producer
                // may already fill the last key stage).
                if (split_dequant) named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                release_by_warp(&sm.q_empty, lane);
            } else if (n_tiles > 0) {
                // The rows go through the last key stage, whose left and right groups both consumers kept; Q was
                // released after the last QK, so the producer loads the next chunk's Q and first tile meanwhile.
                // Once this warp's rows left, it releases both groups (the right one for the value warpgroup; in
                // the pair kernels the peer's producer writes this stage too, so the peer is credited as well).
                const Ring last = Ring::of(tile - 1);
                const uint32_t area = smem_addr(sm.kv[last.stage]);
                stage_final_half<E>(f, 0, o, inv, area);
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                if (bulk_out) {
                    store_final_rows(p, rt, c, f, area);
                } else {
                    copy_final_rows(p, rt, c, f, area);
                }
#pragma unroll
                for (int g = kGroupLeft; g <= kGroupRight; ++g) {
                    release_by_warp(&sm.kv_empty[last.stage][g], lane);
                    if (split_dequant && lane == 0) {
                        mbarrier_arrive_remote_relaxed(mapa_shared(smem_addr(&sm.kv_empty[last.stage][g]), peer));
                    }
                }
            } else {
                copy_final_rows(p, rt, c, f, kNoStaging);  // no keys: zeros, both halves
            }
            ++chunks;
        });
    }
}

// Value warpgroup (WG 2). Per tile i: wait for the right group -> Handoff -> (S first: SDone, S(i + 1) is in) ->
// rescale O[:, 256:512] by alpha(i) -> O += P(i) V -> wait -> release the right group. Per chunk, the epilogue.
template <class E, int kDqk, bool kSparse, bool kPair>
__device__ __forceinline__ void value_consumer(const DecodeParams& p, SmemPlan<kDqk>& sm, const Schedule& sched,
                                               bool split_dequant, bool consumer_fence) {
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * static_cast<int>(Role::Value);
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int rows[2] = {f.row0, f.row1()};
    const RowTile rt = RowTile::of(p);
    const uint32_t peer = split_dequant ? cluster_ctarank() ^ 1u : 0u;
    const bool s_first = s_first_pipeline(p);
    int tile = 0;
    int chunks = 0;
    for (int part = static_cast<int>(blockIdx.y); part < sched.parts; part += static_cast<int>(gridDim.y)) {
        for_each_chunk(p, sched, part, [&](const Chunk& c) {
            float o[kORegs];
            zero_regs(o);
            for (int k = c.tile0; k < c.tile1; ++k, ++tile) {
                const Ring pos = Ring::of(tile);
                const uint32_t stage_addr = smem_addr(sm.kv[pos.stage]);
                if constexpr (kSparse) {
                    MBarrier::wait(&sm.kv_full[pos.stage][kGroupRight], pos.full_parity);
                } else {
#pragma unroll
                    for (int j = 0; j < kSlabsPerHalf; ++j) {
                        MBarrier::wait(&sm.kv_right_slab[pos.stage][j], pos.full_parity);
                    }
                }
                if (consumer_fence) fence_proxy_async_shared();
                named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);
                if (s_first && k + 1 < c.tile1) named_barrier_sync_unaligned(Bar::SDone, kConsumerThreads);

                const float alpha[2] = {sm.row_scale[pos.stage][rows[0]], sm.row_scale[pos.stage][rows[1]]};
                if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) scale_o_rows(o, alpha[0], alpha[1]);

                const uint32_t p_addr = smem_addr(sm.p[pos.stage]);
                wgmma_fence();
#pragma unroll
                for (int kb = 0; kb < kPvSteps; ++kb) {
                    const uint64_t desc_p = make_wgmma_desc_sw128(p_addr + kb * 32, kUnusedLbo, kSw128AtomBytes);
                    wgmma_m64n256k16_ss_kmn<E>(o, desc_p, v_desc<kDqk>(stage_addr, kSlabsPerHalf, kb), true);
                }
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_regs(o);
                // A final chunk keeps its last stage for the rows (the score warpgroup releases it once they
                // left).
                if (k + 1 < c.tile1 || c.split) {
                    release_by_warp(&sm.kv_empty[pos.stage][kGroupRight], lane);
                    if (split_dequant && lane == 0) {
                        mbarrier_arrive_remote_relaxed(
                            mapa_shared(smem_addr(&sm.kv_empty[pos.stage][kGroupRight]), peer));
                    }
                }
            }
            named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
            const float inv[2] = {sm.row_inv[chunks % 2][rows[0]], sm.row_inv[chunks % 2][rows[1]]};
            if (c.split) {
                // The chunk's last stage takes this half: both PVs are done, and the producer writes no stage
                // before the next chunk's Q, which the score warpgroup releases after PartialStaged.
                if (split_dequant) {
                    // The peer's producer may write the last key stage once both CTAs released it: stage this half
                    // in the Q tile after the score warpgroup's half left it.
                    named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
                    store_partial_half(p, rt, c, f, 1, o, inv, smem_addr(sm.q));
                } else {
                    store_partial_half(p, rt, c, f, 1, o, inv, smem_addr(sm.kv[Ring::of(tile - 1).stage]));
                }
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
            } else if (c.tile1 > c.tile0) {
                // The rows go through the chunk's last key stage, which both consumers kept (the score warpgroup
                // releases it once they left).
                const uint32_t area = smem_addr(sm.kv[Ring::of(tile - 1).stage]);
                stage_final_half<E>(f, 1, o, inv, area);
                named_barrier_sync_unaligned(Bar::PartialStaged, kConsumerThreads);
            }  // (a chunk without keys: the score warpgroup writes both halves' zeros)
            ++chunks;
        });
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel bodies (instantiated by decode.cu).

// kPair (sparse only): the 2-CTA cluster of two row tiles whose producers each dequantise half of a tile's rows.
// kKeysOnce (dense only): the *_once kernels, for one row tile per key head; its key tiles are read by this CTA
// alone, so their TMA loads are evicted from L2 first (the host picks these kernels; with two or more row tiles the
// other CTAs of the key head read each tile right after, from L2). A runtime flag instead of separate kernels
// measured 1.5-2% slower where it was off: the added code changed ptxas's schedule of the whole kernel.
// (Requests of at most 32 query rows of the sparse decode run decode_narrow instead: narrow.cuh.)
template <class E, int kDqk, bool kSparse, bool kPair, bool kKeysOnce = false>
__device__ __forceinline__ void decode_split(const DecodeParams& p, uint8_t* smem) {
    static_assert(kSparse || !kPair, "only the sparse decode splits its dequantisation");
    static_assert(!kSparse || !kKeysOnce, "the sparse producer gathers by index, without TMA");
    using Plan = SmemPlan<kDqk>;
    using C = Config<kDqk>;
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kDqk>
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    // Split dequantisation (sparse, 2-CTA cluster): the peer's consumers release the left / right groups too, since
    // its producer writes them; the barriers must exist cluster-wide before either CTA touches the other's.
    constexpr bool split_dequant = kPair;
    // A small batch's schedule is derived here (no schedule kernel); the __syncthreads below publishes it.
    const int32_t* const sched_line = (p.flags & kFlagInlineSchedule) ? sm.sched : p.schedule;
    if ((p.flags & kFlagInlineSchedule) && threadIdx.x < 32) {
        write_schedule_warp(p, sm.sched, blockIdx.x == 0 && blockIdx.y == 0);
    }
    if (threadIdx.x == 0) {
        MBarrier::init(&sm.q_full, kWarpgroupThreads);
        MBarrier::init(&sm.q_empty, kWarpsPerWarpgroup);
#pragma unroll
        for (int st = 0; st < kStages; ++st) {
#pragma unroll
            for (int g = 0; g < C::kGroups; ++g) {
                MBarrier::init(&sm.kv_full[st][g], kWarpgroupThreads);
                MBarrier::init(&sm.kv_empty[st][g], split_dequant ? 2 * kWarpsPerWarpgroup : kWarpsPerWarpgroup);
            }
#pragma unroll
            for (int j = 0; j < kSlabsPerHalf; ++j) MBarrier::init(&sm.kv_right_slab[st][j], kWarpgroupThreads);
        }
        if (split_dequant) fence_mbarrier_init_cluster();
    }
    __syncthreads();
    if (split_dequant) cluster_sync();
    // Launched programmatically after the schedule kernel: the CTA got here while that kernel ran; its schedule is
    // read only after this (a no-op in a plain launch).
    grid_dep_wait();
    grid_dep_launch_dependents();  // the combine's CTAs may take SMs as this grid's CTAs leave

    const Schedule sched = Schedule::load<kSparse>(p, sched_line);
    const Role role = static_cast<Role>(threadIdx.x / kWarpgroupThreads);
    if (role == Role::Producer) {
        if constexpr (kPair) {
            setmaxnreg_dec<kProducerRegsPair>();
            producer_sparse_regs<kDqk>(p, sm, sched);
        } else if constexpr (kSparse) {
            setmaxnreg_dec<kProducerRegsSparse>();
            producer_sparse<kDqk>(p, sm, sched);
        } else {
            setmaxnreg_dec<kProducerRegs>();
            producer<kDqk, kKeysOnce>(p, sm, sched);
        }
    } else if (role == Role::Score) {
        setmaxnreg_inc<kSparse ? kScoreRegsSparse : kScoreRegs>();
        score_consumer<E, kDqk, kSparse, kPair>(p, sm, sched, split_dequant);
        bulk_wait_all();  // the partials' bulk stores are performed before the CTA ends
    } else {
        setmaxnreg_inc<kPair ? kValueRegsPair : kSparse ? kValueRegsSparse : kValueRegs>();
        value_consumer<E, kDqk, kSparse, kPair>(p, sm, sched, split_dequant, consumers_fence_right<kSparse>(p));
        bulk_wait_all();
    }
}

// Combine: CTA (i, x, g) merges the partials of rows kRows g .. kRows g + kRows - 1 of row tile x of one split
// request, and returns at once where there is none; kRows = kCombineRowsPerCta<kWarpsPerRow>. The request is b = i, or
// with kFlagCombineByPart the request split by the boundary between parts i and i + 1 that starts in part i (a split
// request crosses the boundary after its first part, so each is found once; the grid then has as many CTAs as parts,
// not requests: fewer where most requests lie whole in a part). Warp w serves row w % kRows
// and the parts fp + w / kRows + kWarpsPerRow k; lse = M + log(sum w), out = sum(w * O_p) / (sum w + exp(sink - M)),
// w = exp(lse_p - M), M = max lse_p; a row without any key (every lse_p = -inf) gets out 0, lse +inf. The warps of
// a row add their sums through shared memory in a fixed order.
template <class E, int kWarpsPerRow>
__device__ __forceinline__ void decode_combine(const DecodeParams& p) {
    constexpr int kRows = kCombineRowsPerCta<kWarpsPerRow>;
    constexpr int kOthers = kWarpsPerRow > 1 ? kWarpsPerRow - 1 : 1;
    __shared__ float4 part_sum[kWarpsPerRow > 1 ? kRows : 1][kOthers][kWarpsPerRow > 1 ? kDv / 4 : 1];
    __shared__ float part_wsum[kRows][kOthers];
    const int x = static_cast<int>(blockIdx.y);
    // Launched programmatically after the split kernel: its partials are visible after grid_dep_wait. The schedule
    // kernel's line (or a uniform one) and the lengths are final before this grid starts, so the CTA finds its
    // request first, while the split kernel's last CTAs run; an inline schedule is written by split CTA (0, 0).
    const bool line_final = (p.flags & kFlagInlineSchedule) == 0;
    if (!line_final) grid_dep_wait();
    const Schedule sched = Schedule::load(p);
    int b = static_cast<int>(blockIdx.x);
    if (p.flags & kFlagCombineByPart) {
        const int pos = (b + 1) * sched.budget - 1;  // the last line position of part b
        if (b + 1 >= sched.parts || pos >= sched.start(p.batch)) return;
        b = sched.request_at(pos, p.batch);  // every lane of every warp: request_at is warp-collective
    }
    const int len = request_len(p, b);
    const int tiles = tiles_of(len);
    if (tiles == 0) return;
    const int first = sched.start(b) + p.chunk_overhead;
    const int fp = sched.part_of(first);
    const int lp = sched.part_of(first + tiles - 1);
    if (fp == lp || ((p.flags & kFlagCombineByPart) && fp != static_cast<int>(blockIdx.x))) return;

    const RowTile rt = RowTile::at(p, x);
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int slot_r = warp % kRows;  // the row among the CTA's
    const int share = warp / kRows;   // which of the row's warps
    const int r = static_cast<int>(blockIdx.z) * kRows + slot_r;
    const bool row_valid = r < rt.rows;
    if (kWarpsPerRow == 1 && !row_valid) return;
    const int token = rt.token(p, r);
    const int head = rt.head(p, r);
    // The sink logit is an input, read before the wait too.
    const float sink = p.attn_sink != nullptr && row_valid
                           ? __ldg(p.attn_sink + static_cast<int64_t>(head) * p.attn_sink_stride)
                           : 0.f;
    if (line_final) grid_dep_wait();
    auto slot_of = [&](int part) { return 2 * part + (part == fp ? 1 : 0); };
    auto lse_at = [&](int part) {
        return p.part_lse[(static_cast<int64_t>(slot_of(part)) * p.head_tiles + x) * kRowsPerCta + r];
    };
    // The largest partial lse: each lane reads every 32nd part, then a warp reduction (every warp of the row).
    float m = -kInf;
    if (row_valid) {
        for (int part = fp + lane; part <= lp; part += 32) m = fmaxf(m, lse_at(part));
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, d));

    float acc[kCombineColsPerLane];
#pragma unroll
    for (int e = 0; e < kCombineColsPerLane; ++e) acc[e] = 0.f;
    float wsum = 0.f;
    auto add_part = [&](int part) {
        const float w = __expf(lse_at(part) - m);
        wsum += w;
        const float4* src = reinterpret_cast<const float4*>(
            p.part_o + ((static_cast<int64_t>(slot_of(part)) * p.head_tiles + x) * kRowsPerCta + r) * kDv);
#pragma unroll
        for (int v = 0; v < kCombineColsPerLane / 4; ++v) {
            // float4 v of the lane: columns 4 (32 v + lane) .. + 4 (coalesced over the warp).
            const float4 o = src[32 * v + lane];
            acc[4 * v + 0] += w * o.x;
            acc[4 * v + 1] += w * o.y;
            acc[4 * v + 2] += w * o.z;
            acc[4 * v + 3] += w * o.w;
        }
    };
    if (row_valid && m != -kInf) {
        if constexpr (kWarpsPerRow == 1) {
#pragma unroll 8
            for (int part = fp; part <= lp; ++part) add_part(part);
        } else {
#pragma unroll 4
            for (int part = fp + share; part <= lp; part += kWarpsPerRow) add_part(part);
        }
    }
    if constexpr (kWarpsPerRow > 1) {
        // The row's other warps hand their sums to its first warp, which adds them in order.
        if (share > 0) {
#pragma unroll
            for (int v = 0; v < kCombineColsPerLane / 4; ++v) {
                part_sum[slot_r][share - 1][32 * v + lane] =
                    make_float4(acc[4 * v + 0], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
            }
            if (lane == 0) part_wsum[slot_r][share - 1] = wsum;
        }
        __syncthreads();
        if (share > 0 || !row_valid) return;
#pragma unroll
        for (int q = 0; q < kWarpsPerRow - 1; ++q) {
#pragma unroll
            for (int v = 0; v < kCombineColsPerLane / 4; ++v) {
                const float4 o = part_sum[slot_r][q][32 * v + lane];
                acc[4 * v + 0] += o.x;
                acc[4 * v + 1] += o.y;
                acc[4 * v + 2] += o.z;
                acc[4 * v + 3] += o.w;
            }
            wsum += part_wsum[slot_r][q];
        }
    }
    float denom = wsum;
    if (p.attn_sink != nullptr && m != -kInf) denom += __expf(sink - m);
    const float inv = m == -kInf ? 0.f : 1.f / denom;
    const bool vec4 = (p.flags & kFlagOutVec4) != 0;
    uint16_t* dst = p.out + request_offset(p, b, p.out_stride_b, p.out_stride_s) +
                    static_cast<int64_t>(token) * p.out_stride_s +
                    static_cast<int64_t>(head) * p.out_stride_h;
#pragma unroll
    for (int v = 0; v < kCombineColsPerLane / 4; ++v) {
        const int col = 4 * (32 * v + lane);
        const uint32_t w0 = pack_x2<E>(acc[4 * v + 0] * inv, acc[4 * v + 1] * inv);
        const uint32_t w1 = pack_x2<E>(acc[4 * v + 2] * inv, acc[4 * v + 3] * inv);
        if (vec4) {
            *reinterpret_cast<uint32_t*>(dst + col) = w0;
            *reinterpret_cast<uint32_t*>(dst + col + 2) = w1;
        } else {
            dst[col + 0] = static_cast<uint16_t>(w0 & 0xFFFFu);
            dst[col + 1] = static_cast<uint16_t>(w0 >> 16);
            dst[col + 2] = static_cast<uint16_t>(w1 & 0xFFFFu);
            dst[col + 3] = static_cast<uint16_t>(w1 >> 16);
        }
    }
    if (lane == 0) {
        p.lse[request_offset(p, b, p.lse_stride_b, p.lse_stride_s) + static_cast<int64_t>(head) * p.lse_stride_h +
              static_cast<int64_t>(token) * p.lse_stride_s] = m == -kInf ? kInf : m + __logf(wsum);
    }
}

}  // namespace flashmla::decode
