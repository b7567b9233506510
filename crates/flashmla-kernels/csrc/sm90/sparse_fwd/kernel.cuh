// Sparse MLA prefill forward for sm_90a (docs/spec.md section 1). docs/sparse-fwd.md has the design: shared-memory
// plan, warp roles, pipeline schedule, barrier protocol, masking.
//
// One CTA = one query token x one group of 64 heads; 3 warpgroups:
//   Producer: loads Q columns 0..511 once, then gathers the token's selected KV rows, 64 per tile, into a 2-stage
//             ring with cp.async (16-byte chunks placed straight into the 128B-swizzled layout; invalid rows are
//             zero-filled without being read). Each stage is filled and released per column group (rope, left,
//             right), completing on mbarriers. The right group's lines are prefetched into L2 about a tile before
//             their gather (its refill window is the shortest).
//   Score:    per tile, S = Q K^T (wgmma 64x64, K = d_qk; the rope columns of Q come from registers), masks
//             invalid rows to -inf (validity derived from the indices themselves), online softmax, publishes bf16
//             P and the row scales, and accumulates O[:, 0:256] += P V with P from registers.
//   Value:    accumulates O[:, 256:512] += P V with P from shared memory.
// Tensor-core order per tile (steady state): QK(i+1), PV_value(i), PV_score(i+1), ... so the softmax of tile
// i + 1 runs while the value warpgroup's PV of tile i occupies the tensor cores.
// The epilogue applies the sink, writes out (staged through the Q region for 16-byte stores), max_logits, lse.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/cta_work.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_layout.cuh"
#include "common/softmax_tile.cuh"
#include "common/wgmma.cuh"
#include "sm90/sparse_fwd/config.cuh"
#include "sm90/sparse_fwd/params.h"

namespace flashmla::sparse_fwd {

using Ring = RingPos<kStages>;
static_assert(kHeadsPerCta == kTileM && kTileRows == kTileN && kDvPerConsumer == kOHalfCols &&
                  kWarpgroupThreads == kTileThreads,
              "the CTA tiles are the shared softmax tiles (common/softmax_tile.cuh)");


// Index entry `j` of the token's row, or -1 (invalid) at and past topk_eff, which is never read.
__device__ __forceinline__ int load_index(const int32_t* idx_row, int j, int topk_eff) {
    return j < topk_eff ? __ldg(idx_row + j) : -1;
}

// An index selects a KV row iff 0 <= i < s_kv (s_kv clamped to i32::MAX on the host, which keeps this exact).
__device__ __forceinline__ bool index_valid(int idx, int s_kv) { return idx >= 0 && idx < s_kv; }

// ---------------------------------------------------------------------------------------------------------------
// Producer warpgroup.
//
// Thread t copies 16-byte chunk (t % 8) of one 128-byte slab row; the 16 row groups (t / 8) cover 16 rows per
// pass, so pass k handles tile row 16k + t/8. The swizzle phase of a row only depends on row % 8 = (t / 8) % 8,
// so every destination is one per-thread base plus compile-time offsets.

// Index-row entries of the thread's 4 rows of tile `tile`.
__device__ __forceinline__ void load_tile_indices(const int32_t* idx_row, int tile, int topk_eff, int row_in_pass,
                                                  int (&idx)[kPassesPerTile]) {
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        idx[k] = load_index(idx_row, tile * kTileRows + k * kRowsPerPass + row_in_pass, topk_eff);
    }
}

// Copies the slabs of column group `kGroup` of the thread's 4 rows into a stage. The thread's one arrival on the
// group's full barrier (expected count 128) is triggered by the hardware once every copy it issued so far has
// landed (cp.async.mbarrier.arrive.noinc), so the phase completes exactly when all 128 threads' copies are in
// shared memory; the producer makes no ordinary shared-memory stores, so it needs no arrive of its own.
template <int kDqk, int kGroup>
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
    MBarrier::arrive_on_cp_async_noinc(&sm.kv_full[pos.stage][kGroup]);
}

template <int kDqk, bool kAlt>
__device__ __forceinline__ void producer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    if (w.n_tiles == 0) return;  // consumers will not wait for anything

    // threadIdx.x is 0..127: the producer is warpgroup 0.
    const auto [row_in_pass, chunk, thread_off, chunk_elems] = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    // Source operand of zero-filled copies: never read, but kept inside a mapped tensor anyway. q[0, 0, :] exists
    // whenever a CTA runs (s_q >= 1, h_q >= 1); kv may be empty (s_kv = 0).
    const uint16_t* const dummy_src = p.q;
    const bool pf_rows = kAlt && (p.flags & kFlagPrefetchRows) != 0;

    // Q [64 heads x columns 0..511] -> sm.q (rows past h_q zero-filled). The rope columns go to registers.
    {
        const uint32_t q_base = smem_addr(sm.q) + thread_off;
        const uint16_t* q_tok = p.q + static_cast<int64_t>(w.token) * p.q_stride_t;
#pragma unroll
        for (int k = 0; k < kPassesPerTile; ++k) {
            const int r = k * kRowsPerPass + row_in_pass;
            const bool ok = r < w.heads;
            const uint16_t* row = ok ? q_tok + static_cast<int64_t>(w.head0 + r) * p.q_stride_h : dummy_src;
            const uint16_t* src = row + chunk_elems;
#pragma unroll
            for (int slab = 0; slab < kDvSlabs; ++slab) {
                cp_async_16_zfill(q_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                                  src + slab * kSw128ColsBf16, ok);
            }
        }
        MBarrier::arrive_on_cp_async_noinc(&sm.q_full);  // as for kv_full (gather_group)
    }

    // KV tiles, one column group at a time in the order the groups are released (rope right after QK, left after
    // the score warpgroup's PV, right after the value warpgroup's PV). Indices of tile i + 1 are loaded while
    // tile i's copies are issued.
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;
    int idx_next[kPassesPerTile];
    load_tile_indices(idx_row, 0, w.topk_eff, row_in_pass, idx_next);
    const uint32_t kv_base = smem_addr(sm.kv[0]) + thread_off;
    for (int i = 0; i < w.n_tiles; ++i) {
        const uint16_t* src[kPassesPerTile];
        bool ok[kPassesPerTile];
#pragma unroll
        for (int k = 0; k < kPassesPerTile; ++k) {
            // Invalid: any value < 0 or >= s_kv (including the -1 of the tail). Never dereferenced.
            ok[k] = index_valid(idx_next[k], p.s_kv);
            const uint16_t* row = ok[k] ? p.kv + static_cast<int64_t>(idx_next[k]) * p.kv_stride_t : dummy_src;
            src[k] = row + chunk_elems;
            // L2 prefetch of the right column group of tile i. That group can only be gathered after the value
            // warpgroup released it (PV(i - 2)), ~1200 tensor-core cycles before QK(i) reads it, which does not
            // cover a DRAM miss; this point follows the gather of tile i - 1, about one tile earlier. Only the right
            // group: the rope and left lines of tile i are gathered right after this, and prefetching lines that
            // are about to be read measured slower (docs/perf-log.md). Tiles 0 and 1 are gathered at once anyway.
            // Thread chunk c < 4 takes the line of slab 4 + c of each of its rows; valid rows only.
            // Alternating pipeline: both halves of a stage are refilled with less than a tile of cover
            // (docs/sparse-fwd.md), so with kFlagPrefetchRows thread chunk c takes slab c, i.e. all value columns;
            // without it (the KV hits L2 anyway) it prefetches nothing, which measured 1-4% faster there.
            if (i >= kStages && ok[k]) {
                if (pf_rows) {
                    prefetch_l2(row + chunk * kSw128ColsBf16);
                } else if (!kAlt && chunk < kSlabsPerHalf) {
                    prefetch_l2(row + (kSlabsPerHalf + chunk) * kSw128ColsBf16);
                }
            }
        }
        if (i + 1 < w.n_tiles) load_tile_indices(idx_row, i + 1, w.topk_eff, row_in_pass, idx_next);

        const Ring pos = Ring::of(i);
        const uint32_t stage_base = kv_base + pos.stage * C::kStageBytes;
        if constexpr (C::kRopeSlabs > 0) gather_group<kDqk, kGroupRope>(sm, pos, stage_base, src, ok);
        if (kAlt && pos.stage == 1) {
            // Alternating pipeline: stage 1 belongs to the consumer that owns the right half, which releases it
            // first (the left half is released by the other consumer's PV).
            gather_group<kDqk, kGroupRight>(sm, pos, stage_base, src, ok);
            gather_group<kDqk, kGroupLeft>(sm, pos, stage_base, src, ok);
            continue;
        }
        gather_group<kDqk, kGroupLeft>(sm, pos, stage_base, src, ok);
        gather_group<kDqk, kGroupRight>(sm, pos, stage_base, src, ok);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

// Eight bf16 (one 16-byte chunk) to global memory: one vector store when the host proved 16-byte alignment.
__device__ __forceinline__ void store_out_chunk(uint16_t* dst, uint4 v, bool vec16) {
    if (vec16) {
        *reinterpret_cast<uint4*>(dst) = v;
    } else {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            dst[2 * i] = static_cast<uint16_t>(w[i] & 0xFFFFu);
            dst[2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
        }
    }
}

// Validity of the 64 rows of a tile as a bit mask (bit n = tile row n), derived from the index row itself (the
// same test the producer applies), so no flag crosses from the producer to the consumers. Lane l holds the raw
// entries for rows l and l + 32, loaded a tile ahead.
struct TileIndices {
    int lo;
    int hi;
    static __device__ __forceinline__ TileIndices load(const int32_t* idx_row, int tile, int topk_eff, int lane) {
        return {load_index(idx_row, tile * kTileRows + lane, topk_eff),
                load_index(idx_row, tile * kTileRows + 32 + lane, topk_eff)};
    }
};
__device__ __forceinline__ TileMask tile_mask_of(const TileIndices& ix, int s_kv) {
    return TileMask::of_lanes(index_valid(ix.lo, s_kv), index_valid(ix.hi, s_kv));
}

// Q's rope columns (512..575) of the thread's two rows as register A fragments: a[0] = (row0, c, c+1),
// a[1] = (row0+8, c, c+1), a[2] = (row0, c+8, c+9), a[3] = (row0+8, c+8, c+9) with c = 512 + 16 ks + 2 quad
// (smem_layout.cuh). Rows past h_q stay zero.
template <int kDqk>
__device__ __forceinline__ void load_q_rope(const SparseFwdParams& p, const CtaWork& w, const AccFrag& f,
                                            const int (&rows)[2], uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4]) {
    using C = Config<kDqk>;
    if constexpr (C::kRopeSteps > 0) {
        const uint16_t* q_tok = p.q + static_cast<int64_t>(w.token) * p.q_stride_t;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            if (rows[rr] < w.heads) {
                const uint16_t* q_row = q_tok + static_cast<int64_t>(w.head0 + rows[rr]) * p.q_stride_h;
#pragma unroll
                for (int ks = 0; ks < C::kRopeSteps; ++ks) {
                    // 4-byte loads: q rows are 16-byte aligned (host-checked) and the column is even.
                    const uint32_t* src = reinterpret_cast<const uint32_t*>(q_row + kDv + 16 * ks + 2 * f.quad);
                    q_rope[ks][rr] = __ldg(src);
                    q_rope[ks][2 + rr] = __ldg(src + 4);  // columns + 8
                }
            }
        }
    }
}

// Both consumers stage their scaled O half (bf16) into the Q region, row-major 64 x 1024 B with the chunk swizzle
// chunk ^ (row % 8) (conflict-free for the fragment writes and the row-chunk reads), then copy it out with
// coalesced 16-byte stores. Called after every wgmma read of Q has completed.
template <int kDqk>
__device__ __forceinline__ void stage_and_store_output(const SparseFwdParams& p, SmemPlan<kDqk>& sm,
                                                       const CtaWork& w, const AccFrag& f, int consumer,
                                                       const float (&o)[kORegs], const float (&inv)[2]) {
    using C = Config<kDqk>;
    const uint32_t q_addr = smem_addr(sm.q);
    const int rows[2] = {f.row0, f.row1()};
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
        const int chunk = consumer * (kDvPerConsumer / 8) + j;  // column 256 c + 8 j + 2 q
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const uint32_t addr = q_addr + rows[rr] * C::kStagingRowBytes +
                                  ((chunk ^ (rows[rr] % kSw128AtomRows)) * kSw128ChunkBytes) + 4 * f.quad;
            st_shared_u32(addr, pack_bf16x2(o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]));
        }
    }
    named_barrier_sync_unaligned(Bar::StagingReady, kConsumerThreads);

    const int ct = static_cast<int>(threadIdx.x) - kWarpgroupThreads;  // 0..255 over both consumers
    const bool vec16 = (p.flags & kFlagOutVec16) != 0;
    uint16_t* out_tok = p.out + static_cast<int64_t>(w.token) * p.out_stride_t;
    constexpr int kChunks = kHeadsPerCta * C::kStagingChunksPerRow;
#pragma unroll 4
    for (int id = ct; id < kChunks; id += kConsumerThreads) {
        const int row = id / C::kStagingChunksPerRow;
        const int chunk = id % C::kStagingChunksPerRow;
        if (row < w.heads) {
            const uint4 v = ld_shared_v4(q_addr + row * C::kStagingRowBytes +
                                         ((chunk ^ (row % kSw128AtomRows)) * kSw128ChunkBytes));
            store_out_chunk(out_tok + static_cast<int64_t>(w.head0 + row) * p.out_stride_h + chunk * 8, v, vec16);
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

// Issues the k-steps of S = Q K^T that read column group `kGroup` of a stage, after waiting for it to land.
// The rope group takes A from the Q rope fragments in registers; the others read Q from shared memory.
template <int kDqk, int kGroup, bool kFirstGroup>
__device__ __forceinline__ void qk_group(SmemPlan<kDqk>& sm, const Ring& pos, uint64_t desc_q, uint64_t desc_k,
                                         const uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4],
                                         float (&s)[kSRegs]) {
    using C = Config<kDqk>;
    MBarrier::wait(&sm.kv_full[pos.stage][kGroup], pos.full_parity);
    fence_proxy_async_shared();  // cp.async (generic proxy) wrote the group; wgmma reads it (async proxy)
    constexpr int kFirstSlab = group_first_slab(kGroup);
    constexpr int kSteps = group_slabs<kDqk>(kGroup) * C::kKStepsPerSlab;
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
        // k-step ks of the group covers d columns [64 kFirstSlab + 16 ks, + 16): slab kFirstSlab + ks / 4,
        // 32-byte step ks % 4 inside its rows.
        const uint32_t off = (kFirstSlab + ks / C::kKStepsPerSlab) * C::kSlabBytes + (ks % C::kKStepsPerSlab) * 32;
        const bool acc = !(kFirstGroup && ks == 0);
        if constexpr (kGroup == kGroupRope) {
            wgmma_m64n64k16_rs_kk(s, q_rope[ks], wgmma_desc_advance(desc_k, off), acc);
        } else {
            wgmma_m64n64k16_ss_kk(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), acc);
        }
    }
}

// S = Q K^T of one tile: all column groups in the producer's fill order (rope, then the two halves in the order
// given: the split pipeline left then right; the alternating one the consumer's own half first), one commit group.
template <int kDqk, int kFirstHalf = kGroupLeft, int kSecondHalf = kGroupRight>
__device__ __forceinline__ void issue_qk(SmemPlan<kDqk>& sm, const Ring& pos, uint64_t desc_q,
                                         const uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4],
                                         float (&s)[kSRegs]) {
    using C = Config<kDqk>;
    const uint64_t desc_k =
        make_wgmma_desc_sw128(smem_addr(sm.kv[pos.stage]), kUnusedLbo, kSw128AtomBytes);
    wgmma_fence();  // s was read and written by the softmax since the last QK
    if constexpr (C::kRopeSlabs > 0) {
        qk_group<kDqk, kGroupRope, true>(sm, pos, desc_q, desc_k, q_rope, s);
        qk_group<kDqk, kFirstHalf, false>(sm, pos, desc_q, desc_k, q_rope, s);
    } else {
        qk_group<kDqk, kFirstHalf, true>(sm, pos, desc_q, desc_k, q_rope, s);
    }
    qk_group<kDqk, kSecondHalf, false>(sm, pos, desc_q, desc_k, q_rope, s);
    wgmma_commit();
}

// ---- State the consumers' phases share. The phases take the thread's and the tile's state (ConsumerThread,
// SplitTile, TileScale) by value: copies are values the compiler reasons about as it did about the locals of one
// function. What a phase updates (S, O, P fragments, the online-softmax rows) it takes by reference.

// A consumer thread's place in its warpgroup: its accumulator fragment and the two rows (heads) it owns.
struct ConsumerThread {
    int lane;
    AccFrag f;
    int rows[2];
};

__device__ __forceinline__ ConsumerThread consumer_thread(int warpgroup) {
    ConsumerThread th;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * warpgroup;
    th.lane = t % 32;
    th.f = AccFrag::of_thread(t);
    th.rows[0] = th.f.row0;
    th.rows[1] = th.f.row1();
    return th;
}

// One tile's rescale factor of O and l (alpha) and the reference max that P subtracts (m_exp).
struct TileScale {
    float alpha[2];
    float m_exp[2];
};

// One tile of the split pipeline's loop.
struct SplitTile {
    int i;                // tile index
    Ring pos;             // its stage and barrier parities
    bool has_next;        // tile i + 1 exists
    uint32_t stage_addr;  // its KV stage
};

template <int kDqk>
__device__ __forceinline__ SplitTile split_tile(SmemPlan<kDqk>& sm, const CtaWork& w, int i) {
    SplitTile tile;
    tile.i = i;
    tile.pos = Ring::of(i);
    tile.has_next = i + 1 < w.n_tiles;
    tile.stage_addr = smem_addr(sm.kv[tile.pos.stage]);
    return tile;
}

template <int kDqk>
__device__ __forceinline__ void zero_q_rope(uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4]) {
#pragma unroll
    for (int ks = 0; ks < Config<kDqk>::kRopeFragSteps; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) q_rope[ks][e] = 0u;
    }
}

// bf16 P(i) to a p tile for the other consumer's wgmma (A operand, K-major SW128): P column 8 j + 2 q is chunk j of
// the 128-byte row, byte 4 q inside it.
__device__ __forceinline__ void store_p_tile(uint32_t p_addr, const int (&rows)[2], const AccFrag& f,
                                             const uint32_t (&pa)[kPvSteps][4]) {
#pragma unroll
    for (int j = 0; j < kSBlocks; ++j) {
        st_shared_u32(p_addr + sw128_chunk_offset(rows[0], j) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 0]);
        st_shared_u32(p_addr + sw128_chunk_offset(rows[1], j) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 1]);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Split pipeline: score warpgroup (WG 1). Per tile i (stage i % 2), with QK(i) issued one iteration earlier:
//   wait_scores: wait QK(i), release the rope group -> tile_softmax: mask, online softmax (lazy rescale of O)
//   -> p_and_pv: P, PV(i) on O[:, 0:256] (A = P from registers) -> row sums, publish_p: alpha(i) and P(i) for the
//   value warpgroup -> release_left: wait PV(i), release the left group -> QK(i + 1) -> Handoff rendezvous (the
//   value warpgroup then issues its PV(i), which runs during this warpgroup's next softmax). Then the epilogue.

// S(i) landed (PV(i - 1) was waited for last iteration). Rope columns are no longer needed.
template <int kDqk>
__device__ __forceinline__ void wait_scores(SmemPlan<kDqk>& sm, const ConsumerThread th, const SplitTile tile,
                                            float (&s)[kSRegs], float (&o)[kORegs]) {
    wgmma_wait<0>();
    wgmma_fence_regs(s);
    wgmma_fence_regs(o);
    if constexpr (Config<kDqk>::kRopeSlabs > 0) release_by_warp(&sm.kv_empty[tile.pos.stage][kGroupRope], th.lane);
}

// Mask invalid rows, then the online softmax with a lazily raised reference max; O is brought to the new reference.
__device__ __forceinline__ void tile_softmax(const ConsumerThread th, float scale, const TileMask& mask,
                                                  float (&m_run)[2], float (&m_ref)[2], float (&s)[kSRegs], float (&o)[kORegs], TileScale& sc) {
    mask_invalid_rows(s, mask, th.f);
    update_row_max(s, scale, m_run, m_ref, sc.alpha, sc.m_exp);
    if (__any_sync(kFullMask, sc.alpha[0] != 1.f || sc.alpha[1] != 1.f)) {  // PV(i - 1) has completed
        scale_o_rows(o, sc.alpha[0], sc.alpha[1]);
    }
}

// P = exp2(S - m) in two halves of 32 kv rows; each half's PV k-steps on O[:, 0:256] (A = P from registers, B = the
// left group) are queued as soon as it is packed, so the tensor cores start while the second half is
// exponentiated. One commit group for the whole PV(i).
template <int kDqk>
__device__ __forceinline__ void p_and_pv(const SplitTile tile, float scale, const TileScale sc, float (&s)[kSRegs],
                                         uint32_t (&pa)[kPvSteps][4], float (&o)[kORegs]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int j = half * kSBlocks / 2; j < (half + 1) * kSBlocks / 2; ++j) {
            s[4 * j + 0] = exp2f(fmaf(s[4 * j + 0], scale, -sc.m_exp[0]));
            s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], scale, -sc.m_exp[0]));
            s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], scale, -sc.m_exp[1]));
            s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], scale, -sc.m_exp[1]));
        }
#pragma unroll
        for (int kb = half * kPvSteps / 2; kb < (half + 1) * kPvSteps / 2; ++kb) {
            pa[kb][0] = pack_bf16x2(s[8 * kb + 0], s[8 * kb + 1]);
            pa[kb][1] = pack_bf16x2(s[8 * kb + 2], s[8 * kb + 3]);
            pa[kb][2] = pack_bf16x2(s[8 * kb + 4], s[8 * kb + 5]);
            pa[kb][3] = pack_bf16x2(s[8 * kb + 6], s[8 * kb + 7]);
        }
        wgmma_fence();  // o (rescale) and this half's P fragments were written by ordinary instructions
#pragma unroll
        for (int kb = half * kPvSteps / 2; kb < (half + 1) * kPvSteps / 2; ++kb) {
            wgmma_m64n256k16_rs_mn(o, pa[kb], v_desc<kDqk>(tile.stage_addr, 0, kb), true);
        }
    }
    wgmma_commit();
}

// Off the tensor cores' path: row-sum partials, then alpha(i) and P(i) (bf16) for the value warpgroup.
template <int kDqk>
__device__ __forceinline__ void publish_p(SmemPlan<kDqk>& sm, const AccFrag& f, const int (&rows)[2],
                                          const SplitTile tile, const TileScale sc,
                                          const uint32_t (&pa)[kPvSteps][4]) {
    if (f.quad == 0) {
        sm.row_scale[tile.pos.stage][rows[0]] = sc.alpha[0];
        sm.row_scale[tile.pos.stage][rows[1]] = sc.alpha[1];
    }
    store_p_tile(smem_addr(sm.p[tile.pos.stage]), rows, f, pa);
    fence_proxy_async_shared();  // generic P stores -> the value warpgroup's wgmma reads (async proxy)
}

// PV(i) done: the left group and the P fragments are free. The group is released before QK(i + 1) is queued:
// issuing QK's 36 wgmmas blocks this warpgroup for most of QK's execution (the tensor core accepts them only as
// fast as it runs them), so a release after the issue would come ~1100 cycles later. QK(i + 1) cannot start before
// PV(i) ends anyway (one in-order tensor pipe).
template <int kDqk>
__device__ __forceinline__ void release_left(SmemPlan<kDqk>& sm, const ConsumerThread th, const SplitTile tile,
                                             uint32_t (&pa)[kPvSteps][4]) {
    wgmma_wait<0>();
    wgmma_fence_regs(pa[0]);
    wgmma_fence_regs(pa[1]);
    wgmma_fence_regs(pa[2]);
    wgmma_fence_regs(pa[3]);
    release_by_warp(&sm.kv_empty[tile.pos.stage][kGroupLeft], th.lane);
}

template <int kDqk>
__device__ __forceinline__ void score_consumer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    const ConsumerThread th = consumer_thread(static_cast<int>(Role::Score));
    const int lane = th.lane;
    const AccFrag f = th.f;
    const int rows[2] = {th.rows[0], th.rows[1]};
    const float scale = p.sm_scale_log2;  // > 0 (validated), so max and scaling commute

    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q), kUnusedLbo, kSw128AtomBytes);
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;

    float o[kORegs];
    zero_regs(o);
    float s[kSRegs];
    zero_regs(s);
    float m_run[2] = {-kInf, -kInf};  // running max of the base-2 logits (max_logits)
    float m_ref[2] = {-kInf, -kInf};  // reference P, O and l are relative to (lazy: m_run - 8 < m_ref <= m_run)
    float row_sum[2] = {0.f, 0.f};    // this thread's partial sum of P over its columns, relative to m_ref

    // Rope columns of Q (512..575) as register A fragments: a[0] = (row0, c, c+1), a[1] = (row0+8, c, c+1),
    // a[2] = (row0, c+8, c+9), a[3] = (row0+8, c+8, c+9) with c = 512 + 16 ks + 2 quad (smem_layout.cuh).
    uint32_t q_rope[C::kRopeFragSteps][4];
#pragma unroll
    for (int ks = 0; ks < C::kRopeFragSteps; ++ks) {
#pragma unroll
        for (int e = 0; e < 4; ++e) q_rope[ks][e] = 0u;
    }

    TileMask mask{0u, 0u};
    TileIndices ix_next{-1, -1};
    if (w.n_tiles > 0) {
        load_q_rope<kDqk>(p, w, f, rows, q_rope);
        mask = tile_mask_of(TileIndices::load(idx_row, 0, w.topk_eff, lane), p.s_kv);
        if (w.n_tiles > 1) ix_next = TileIndices::load(idx_row, 1, w.topk_eff, lane);
        MBarrier::wait(&sm.q_full, 0);
        issue_qk<kDqk>(sm, Ring::of(0), desc_q, q_rope, s);
    }

    for (int i = 0; i < w.n_tiles; ++i) {
        const SplitTile tile = split_tile(sm, w, i);
        const bool has_next = tile.has_next;
        wait_scores<kDqk>(sm, th, tile, s, o);

        TileScale sc;
        tile_softmax(th, scale, mask, m_run, m_ref, s, o, sc);
        const float (&alpha)[2] = sc.alpha;

        uint32_t pa[kPvSteps][4];
        p_and_pv<kDqk>(tile, scale, sc, s, pa, o);

        float psum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) {
            psum[0] += s[4 * j + 0] + s[4 * j + 1];
            psum[1] += s[4 * j + 2] + s[4 * j + 3];
        }
        row_sum[0] = row_sum[0] * alpha[0] + psum[0];
        row_sum[1] = row_sum[1] * alpha[1] + psum[1];
        publish_p<kDqk>(sm, f, rows, tile, sc, pa);

        if (has_next) {
            // Next tile's validity (indices loaded a tile ago); prefetch the one after. Done before the issue so
            // that nothing sits between the issue and the Handoff.
            mask = tile_mask_of(ix_next, p.s_kv);
            if (i + 2 < w.n_tiles) ix_next = TileIndices::load(idx_row, i + 2, w.topk_eff, lane);
        }
        release_left<kDqk>(sm, th, tile, pa);

        // ---- QK(i + 1), then the Handoff: the value warpgroup queues its PV(i) behind QK(i + 1), where it
        // overlaps the next softmax.
        if (has_next) issue_qk<kDqk>(sm, Ring::of(i + 1), desc_q, q_rope, s);
        named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);
    }

    // ---- Epilogue. Row sums over the quad; 1 / denominator for both consumers; max_logits and lse.
    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(row_sum[rr]);
        const int head = w.head0 + rows[rr];
        const bool exists = rows[rr] < w.heads;
        const bool empty = m_run[rr] == -kInf;  // no valid entry: out 0, lse +inf, max_logits -inf
        float denom = l;
        if (p.attn_sink != nullptr && exists && !empty) {
            // The sink is one more logit with a zero value vector: it only enlarges the denominator.
            const float sink = __ldg(p.attn_sink + static_cast<int64_t>(head) * p.attn_sink_stride);
            denom += exp2f(sink * kLog2e - m_ref[rr]);
        }
        inv[rr] = empty ? 0.f : 1.f / denom;
        if (f.quad == 0) {
            sm.row_inv[rows[rr]] = inv[rr];
            if (exists) {
                const int64_t tok = w.token;
                p.max_logits[tok * p.max_logits_stride_t + head * p.max_logits_stride_h] =
                    empty ? -kInf : m_run[rr] * kLn2;
                p.lse[tok * p.lse_stride_t + head * p.lse_stride_h] =
                    empty ? kInf : (m_ref[rr] + log2f(l)) * kLn2;
            }
        }
    }
    named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
    stage_and_store_output<kDqk>(p, sm, w, f, 0, o, inv);
}


// ---------------------------------------------------------------------------------------------------------------
// Split pipeline: value warpgroup (WG 2). Per tile i: wait for the right group, Handoff rendezvous -> rescale
// O[:, 256:512] by alpha(i), O += P(i) V (A = P from shared memory, B = the right group), wait -> release the right
// group; the epilogue last. Kept as one body: the same steps as phase functions compiled to other instructions.

template <int kDqk>
__device__ __forceinline__ void value_consumer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * static_cast<int>(Role::Value);
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int rows[2] = {f.row0, f.row1()};

    float o[kORegs];
    zero_regs(o);

    // The output is staged in the Q region, which the producer filled with cp.async: observe that directly.
    if (w.n_tiles > 0) MBarrier::wait(&sm.q_full, 0);

    for (int i = 0; i < w.n_tiles; ++i) {
        const Ring pos = Ring::of(i);
        const uint32_t stage_addr = smem_addr(sm.kv[pos.stage]);
        // The right group of tile i landed before QK(i) read it, so this wait never blocks for long; it is done
        // before the Handoff so that PV(i) is queued as soon as P(i) is published.
        MBarrier::wait(&sm.kv_full[pos.stage][kGroupRight], pos.full_parity);
        fence_proxy_async_shared();
        named_barrier_sync_unaligned(Bar::Handoff, kConsumerThreads);

        const float alpha[2] = {sm.row_scale[pos.stage][rows[0]], sm.row_scale[pos.stage][rows[1]]};
        if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {  // PV(i - 1) has completed
            scale_o_rows(o, alpha[0], alpha[1]);
        }

        const uint32_t p_addr = smem_addr(sm.p[pos.stage]);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < kPvSteps; ++kb) {
            // A = P[:, 16 kb .. 16 kb + 16): K-major, 32 bytes per 16-column step inside the 128-byte rows.
            const uint64_t desc_p = make_wgmma_desc_sw128(p_addr + kb * 32, kUnusedLbo, kSw128AtomBytes);
            wgmma_m64n256k16_ss_kmn(o, desc_p, v_desc<kDqk>(stage_addr, kSlabsPerHalf, kb), true);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        release_by_warp(&sm.kv_empty[pos.stage][kGroupRight], lane);
    }

    named_barrier_sync_unaligned(Bar::EpilogueScale, kConsumerThreads);
    const float inv[2] = {sm.row_inv[rows[0]], sm.row_inv[rows[1]]};
    stage_and_store_output<kDqk>(p, sm, w, f, 1, o, inv);
}

// ---------------------------------------------------------------------------------------------------------------
// Alternating pipeline (short contexts; docs/sparse-fwd.md, "Alternating pipeline"). Consumer c (WG 1 + c) owns
// O[:, 256 c : 256 c + 256] and the tiles i with i % 2 == c (stage c). Per own tile i: QK(i) -> remote PV(i - 1)
// (the other consumer's P from shared memory, on this consumer's O half) -> mask, row max chained from tile i - 1
// -> P(i) -> local PV(i) (P from registers) -> P(i) published for the other consumer. Each consumer's softmax
// overlaps the other's QK; the running reference max is handed from tile to tile through shared memory.
// As phases: alt_qk -> alt_remote_pv -> alt_wait_scores -> alt_chain_max -> alt_p -> alt_release_remote -> row
// sums -> alt_local_pv -> alt_publish_p -> alt_release_own; after the loop alt_last_remote_pv, then the epilogue
// (final chain state, alt_share_sums, alt_denominators, alt_share_inv, stage_and_store_output).
// Hand-offs between the consumers go through mbarriers (SmemPlan::alt_bar; every thread of the sender arrives, so
// each thread's shared-memory accesses are released by its own arrival); the epilogue uses full named barriers.
inline constexpr int kAltP = 0, kAltM = 1, kAltF = 2;
enum class AltBar : uint32_t { Epi = 7, Sums = 9 };
// Parity of the phase that the arrival for tile i of consumer `owner` completes (its (i - owner) / 2-th).
__device__ __forceinline__ uint32_t alt_parity(int i, int owner) { return static_cast<uint32_t>(((i - owner) / 2) & 1); }


// QK(i) of an own tile: rope, then this consumer's half (the producer's fill order), then the other half.
template <int kDqk, int kC>
__device__ __forceinline__ void alt_qk(SmemPlan<kDqk>& sm, const Ring pos, uint64_t desc_q,
                                       const uint32_t (&q_rope)[Config<kDqk>::kRopeFragSteps][4],
                                       float (&s)[kSRegs]) {
    issue_qk<kDqk, kC == 0 ? kGroupLeft : kGroupRight, kC == 0 ? kGroupRight : kGroupLeft>(sm, pos, desc_q, q_rope,
                                                                                          s);
}

// Remote PV of tile j (the other consumer's): waits for P(j), brings O and l to tile j's reference, queues
// O += P(j) V (A from p[1 - c], B = this consumer's V half of stage 1 - c). One commit group.
template <int kDqk, int kC>
__device__ __forceinline__ void alt_remote_pv(SmemPlan<kDqk>& sm, int j, const int (&rows)[2], float (&o)[kORegs],
                                              float (&l)[2]) {
    MBarrier::wait(&sm.alt_bar[kAltP][1 - kC], alt_parity(j, 1 - kC));
    const int slot = j % 2;
    const float a0 = sm.row_scale[slot][rows[0]];
    const float a1 = sm.row_scale[slot][rows[1]];
    l[0] *= a0;
    l[1] *= a1;
    if (__any_sync(kFullMask, a0 != 1.f || a1 != 1.f)) scale_o_rows(o, a0, a1);
    const uint32_t stage_addr = smem_addr(sm.kv[1 - kC]);
    const uint32_t p_addr = smem_addr(sm.p[1 - kC]);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kPvSteps; ++kb) {
        const uint64_t desc_p = make_wgmma_desc_sw128(p_addr + kb * 32, kUnusedLbo, kSw128AtomBytes);
        wgmma_m64n256k16_ss_kmn(o, desc_p, v_desc<kDqk>(stage_addr, kC * kSlabsPerHalf, kb), true);
    }
    wgmma_commit();
}

// S(i) landed; the remote PV(i - 1), when queued behind QK(i), may still run. Rope columns are no longer needed.
template <int kDqk>
__device__ __forceinline__ void alt_wait_scores(SmemPlan<kDqk>& sm, const ConsumerThread th, const Ring pos,
                                                bool remote_queued, float (&s)[kSRegs]) {
    if (remote_queued) {
        wgmma_wait<1>();
    } else {
        wgmma_wait<0>();
    }
    wgmma_fence_regs(s);
    if constexpr (Config<kDqk>::kRopeSlabs > 0) release_by_warp(&sm.kv_empty[pos.stage][kGroupRope], th.lane);
}

// Mask invalid rows; the row max chained from tile i - 1: wait for the state the other consumer published after
// it, update it with this tile (lazy reference), publish the new state and alpha(i) (for the other consumer's
// remote PV(i)).
template <int kDqk, int kC>
__device__ __forceinline__ void alt_chain_max(SmemPlan<kDqk>& sm, const ConsumerThread th, int i, int n, float scale,
                                              const TileMask& mask, float (&m_run)[2], float (&m_ref)[2],
                                              float (&s)[kSRegs], TileScale& sc) {
    mask_invalid_rows(s, mask, th.f);
    if (i >= 1) {
        MBarrier::wait(&sm.alt_bar[kAltM][1 - kC], alt_parity(i - 1, 1 - kC));
        const int ps = (i - 1) % 2;
        m_ref[0] = sm.chain_ref[ps][th.rows[0]];
        m_ref[1] = sm.chain_ref[ps][th.rows[1]];
        m_run[0] = sm.chain_run[ps][th.rows[0]];
        m_run[1] = sm.chain_run[ps][th.rows[1]];
    }
    update_row_max(s, scale, m_run, m_ref, sc.alpha, sc.m_exp);
    if (th.f.quad == 0) {
        const int cs = i % 2;
        sm.chain_ref[cs][th.rows[0]] = m_ref[0];
        sm.chain_ref[cs][th.rows[1]] = m_ref[1];
        sm.chain_run[cs][th.rows[0]] = m_run[0];
        sm.chain_run[cs][th.rows[1]] = m_run[1];
        sm.row_scale[cs][th.rows[0]] = sc.alpha[0];
        sm.row_scale[cs][th.rows[1]] = sc.alpha[1];
    }
    if (i + 1 < n) MBarrier::arrive(&sm.alt_bar[kAltM][kC]);
}

// P(i) = exp2(S - m) with this thread's row-sum partials, packed to bf16 A fragments.
__device__ __forceinline__ void alt_p(float scale, const TileScale sc, float (&s)[kSRegs], float (&psum)[2],
                                      uint32_t (&pa)[kPvSteps][4]) {
#pragma unroll
    for (int j = 0; j < kSBlocks; ++j) {
        s[4 * j + 0] = exp2f(fmaf(s[4 * j + 0], scale, -sc.m_exp[0]));
        s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], scale, -sc.m_exp[0]));
        s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], scale, -sc.m_exp[1]));
        s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], scale, -sc.m_exp[1]));
        psum[0] += s[4 * j + 0] + s[4 * j + 1];
        psum[1] += s[4 * j + 2] + s[4 * j + 3];
    }
#pragma unroll
    for (int kb = 0; kb < kPvSteps; ++kb) {
        pa[kb][0] = pack_bf16x2(s[8 * kb + 0], s[8 * kb + 1]);
        pa[kb][1] = pack_bf16x2(s[8 * kb + 2], s[8 * kb + 3]);
        pa[kb][2] = pack_bf16x2(s[8 * kb + 4], s[8 * kb + 5]);
        pa[kb][3] = pack_bf16x2(s[8 * kb + 6], s[8 * kb + 7]);
    }
}

// Remote PV(i - 1) must be done before O is rescaled to tile i's reference; then this consumer's V half of stage
// 1 - c and p[1 - c] are free (the latter for P(i + 1)).
template <int kDqk, int kC>
__device__ __forceinline__ void alt_release_remote(SmemPlan<kDqk>& sm, const ConsumerThread th, int i, int n,
                                                   float (&o)[kORegs]) {
    wgmma_wait<0>();
    wgmma_fence_regs(o);
    if (i >= 1) {
        release_by_warp(&sm.kv_empty[1 - kC][kC == 0 ? kGroupLeft : kGroupRight], th.lane);
        if (i + 1 < n) MBarrier::arrive(&sm.alt_bar[kAltF][1 - kC]);
    }
}

// O to tile i's reference, then O += P(i) V (A = P from registers, B = this consumer's V half of stage c). One
// commit group.
template <int kDqk, int kC>
__device__ __forceinline__ void alt_local_pv(SmemPlan<kDqk>& sm, const TileScale sc,
                                             const uint32_t (&pa)[kPvSteps][4], float (&o)[kORegs]) {
    if (__any_sync(kFullMask, sc.alpha[0] != 1.f || sc.alpha[1] != 1.f)) scale_o_rows(o, sc.alpha[0], sc.alpha[1]);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kPvSteps; ++kb) {
        wgmma_m64n256k16_rs_mn(o, pa[kb], v_desc<kDqk>(smem_addr(sm.kv[kC]), kC * kSlabsPerHalf, kb), true);
    }
    wgmma_commit();
}

// P(i) to p[c] for the other consumer's remote PV(i) (p[c] was consumed by its PV(i - 2)).
template <int kDqk, int kC>
__device__ __forceinline__ void alt_publish_p(SmemPlan<kDqk>& sm, const AccFrag& f, const int (&rows)[2], int i,
                                              const uint32_t (&pa)[kPvSteps][4]) {
    if (i >= 2) MBarrier::wait(&sm.alt_bar[kAltF][kC], alt_parity(i - 2, kC));
    store_p_tile(smem_addr(sm.p[kC]), rows, f, pa);
    fence_proxy_async_shared();  // generic P stores -> the other consumer's wgmma reads (async proxy)
    MBarrier::arrive(&sm.alt_bar[kAltP][kC]);
}

// Local PV(i) done: this consumer's V half of stage c and the P fragments are free.
template <int kDqk, int kC>
__device__ __forceinline__ void alt_release_own(SmemPlan<kDqk>& sm, const ConsumerThread th,
                                                uint32_t (&pa)[kPvSteps][4], float (&o)[kORegs]) {
    wgmma_wait<0>();
    wgmma_fence_regs(o);
    wgmma_fence_regs(pa[0]);
    wgmma_fence_regs(pa[1]);
    wgmma_fence_regs(pa[2]);
    wgmma_fence_regs(pa[3]);
    release_by_warp(&sm.kv_empty[kC][kC == 0 ? kGroupLeft : kGroupRight], th.lane);
}

// When the final tile n - 1 is the other consumer's: its remote PV, waited for; then its V half is free.
template <int kDqk, int kC>
__device__ __forceinline__ void alt_last_remote_pv(SmemPlan<kDqk>& sm, const ConsumerThread th, int n,
                                                   const int (&rows)[2], float (&o)[kORegs], float (&l)[2]) {
    if (n >= 1 && (n - 1) % 2 != kC) {
        alt_remote_pv<kDqk, kC>(sm, n - 1, rows, o, l);
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        release_by_warp(&sm.kv_empty[1 - kC][kC == 0 ? kGroupLeft : kGroupRight], th.lane);
    }
}

// Consumer 1's row sums to consumer 0 (through `sums`, sm.row_inv).
template <int kC>
__device__ __forceinline__ void alt_share_sums(float* sums, const AccFrag& f, const int (&rows)[2],
                                               const float (&lq)[2]) {
    if (kC == 1 && f.quad == 0) {
        sums[rows[0]] = lq[0];
        sums[rows[1]] = lq[1];
    }
    named_barrier_sync_unaligned(AltBar::Sums, kConsumerThreads);
}

// Consumer 0's 1 / denominator to consumer 1 (through `sums`). Consumer 1 has read its sums slot once both pass
// Epi; consumer 0 may then overwrite it.
template <int kC>
__device__ __forceinline__ void alt_share_inv(float* sums, const AccFrag& f, const int (&rows)[2], float (&inv)[2]) {
    named_barrier_sync_unaligned(AltBar::Epi, kConsumerThreads);
    if (kC == 0 && f.quad == 0) {
        sums[rows[0]] = inv[0];
        sums[rows[1]] = inv[1];
    }
    named_barrier_sync_unaligned(AltBar::Sums, kConsumerThreads);
    if (kC == 1) {
        inv[0] = sums[rows[0]];
        inv[1] = sums[rows[1]];
    }
}

// Consumer 0: the denominators over both consumers' sums (and the sink), 1 / denominator, max_logits and lse.
__device__ __forceinline__ void alt_denominators(const SparseFwdParams& p, const CtaWork& w, const float* sums,
                                                 const AccFrag& f, const int (&rows)[2], const float (&lq)[2],
                                                 const float (&fin_ref)[2], const float (&fin_run)[2],
                                                 float (&inv)[2]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float ltot = lq[rr] + sums[rows[rr]];
        const int head = w.head0 + rows[rr];
        const bool exists = rows[rr] < w.heads;
        const bool empty = fin_run[rr] == -kInf;
        float denom = ltot;
        if (p.attn_sink != nullptr && exists && !empty) {
            const float sink = __ldg(p.attn_sink + static_cast<int64_t>(head) * p.attn_sink_stride);
            denom += exp2f(sink * kLog2e - fin_ref[rr]);
        }
        inv[rr] = empty ? 0.f : 1.f / denom;
        if (f.quad == 0 && exists) {
            const int64_t tok = w.token;
            p.max_logits[tok * p.max_logits_stride_t + head * p.max_logits_stride_h] =
                empty ? -kInf : fin_run[rr] * kLn2;
            p.lse[tok * p.lse_stride_t + head * p.lse_stride_h] = empty ? kInf : (fin_ref[rr] + log2f(ltot)) * kLn2;
        }
    }
}

template <int kDqk, int kC>
__device__ __forceinline__ void alt_consumer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    const ConsumerThread th = consumer_thread(1 + kC);
    const int lane = th.lane;
    const AccFrag f = th.f;
    const int rows[2] = {th.rows[0], th.rows[1]};
    const float scale = p.sm_scale_log2;
    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q), kUnusedLbo, kSw128AtomBytes);
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;
    const int n = w.n_tiles;

    float o[kORegs];
    zero_regs(o);
    float s[kSRegs];
    zero_regs(s);
    float l[2] = {0.f, 0.f};            // this consumer's partial row sums, relative to the latest reference
    float m_ref[2] = {-kInf, -kInf};  // chain state after the latest tile this consumer saw
    float m_run[2] = {-kInf, -kInf};
    uint32_t q_rope[C::kRopeFragSteps][4];
    zero_q_rope<kDqk>(q_rope);
    if (n > kC) load_q_rope<kDqk>(p, w, f, rows, q_rope);
    if (n > 0) MBarrier::wait(&sm.q_full, 0);

    for (int i = kC; i < n; i += 2) {
        const Ring pos = Ring::of(i);
        const TileMask mask = tile_mask_of(TileIndices::load(idx_row, i, w.topk_eff, lane), p.s_kv);
        alt_qk<kDqk, kC>(sm, pos, desc_q, q_rope, s);
        if (i >= 1) alt_remote_pv<kDqk, kC>(sm, i - 1, rows, o, l);
        alt_wait_scores<kDqk>(sm, th, pos, i >= 1, s);

        TileScale sc;
        alt_chain_max<kDqk, kC>(sm, th, i, n, scale, mask, m_run, m_ref, s, sc);
        const float (&alpha)[2] = sc.alpha;

        uint32_t pa[kPvSteps][4];
        float psum[2] = {0.f, 0.f};
        alt_p(scale, sc, s, psum, pa);
        alt_release_remote<kDqk, kC>(sm, th, i, n, o);
        l[0] = l[0] * alpha[0] + psum[0];
        l[1] = l[1] * alpha[1] + psum[1];
        alt_local_pv<kDqk, kC>(sm, sc, pa, o);
        alt_publish_p<kDqk, kC>(sm, f, rows, i, pa);
        alt_release_own<kDqk, kC>(sm, th, pa, o);
    }
    // The other consumer's last tile, when it is the final one.
    alt_last_remote_pv<kDqk, kC>(sm, th, n, rows, o, l);

    // Epilogue: final chain state of tile n - 1; row sums of both consumers.
    named_barrier_sync_unaligned(AltBar::Epi, kConsumerThreads);
    float fin_ref[2] = {-kInf, -kInf};
    float fin_run[2] = {-kInf, -kInf};
    if (n > 0) {
        const int cs = (n - 1) % 2;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            fin_ref[rr] = sm.chain_ref[cs][rows[rr]];
            fin_run[rr] = sm.chain_run[cs][rows[rr]];
        }
    }
    float lq[2] = {quad_sum(l[0]), quad_sum(l[1])};
    float* sums = &sm.row_inv[0];  // [64]: consumer 1's sums, then 1 / denominator
    alt_share_sums<kC>(sums, f, rows, lq);
    float inv[2];
    if (kC == 0) alt_denominators(p, w, sums, f, rows, lq, fin_ref, fin_run, inv);
    alt_share_inv<kC>(sums, f, rows, inv);
    stage_and_store_output<kDqk>(p, sm, w, f, kC, o, inv);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by sparse_fwd.cu per d_qk). `smem` is the dynamic shared memory.
template <int kDqk, bool kAlt>
__device__ __forceinline__ void sparse_fwd(const SparseFwdParams& p, uint8_t* smem) {
    using Plan = SmemPlan<kDqk>;
    using C = Config<kDqk>;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.s_q) * p.num_head_groups) return;

    // Round the plan's base up to 1024 bytes (SW128 operand tiles); the launch requested the slack.
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kDqk>
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    if (threadIdx.x == 0) {
        MBarrier::init(&sm.q_full, kWarpgroupThreads);
#pragma unroll
        for (int st = 0; st < kStages; ++st) {
#pragma unroll
            for (int g = 0; g < C::kGroups; ++g) {
                MBarrier::init(&sm.kv_full[st][g], kWarpgroupThreads);
                MBarrier::init(&sm.kv_empty[st][g], kWarpsPerWarpgroup);  // one releasing warpgroup per group
            }
        }
#pragma unroll
        for (int k = 0; k < 3; ++k) {
#pragma unroll
            for (int c = 0; c < kConsumers; ++c) MBarrier::init(&sm.alt_bar[k][c], kWarpgroupThreads);
        }
    }
    __syncthreads();

    const CtaWork w = cta_work<kHeadsPerCta, kTileRows>(p);
    const Role role = static_cast<Role>(threadIdx.x / kWarpgroupThreads);
    if (role == Role::Producer) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kDqk, kAlt>(p, sm, w);
    } else if (role == Role::Score) {  // alternating pipeline: consumer 0
        if constexpr (kAlt) {
            setmaxnreg_inc<kAltRegs>();
            alt_consumer<kDqk, 0>(p, sm, w);
        } else {
            setmaxnreg_inc<kScoreRegs>();
            score_consumer<kDqk>(p, sm, w);
        }
    } else {  // alternating pipeline: consumer 1
        if constexpr (kAlt) {
            setmaxnreg_inc<kAltRegs>();
            alt_consumer<kDqk, 1>(p, sm, w);
        } else {
            setmaxnreg_inc<kValueRegs>();
            value_consumer<kDqk>(p, sm, w);
        }
    }
}

}  // namespace flashmla::sparse_fwd
