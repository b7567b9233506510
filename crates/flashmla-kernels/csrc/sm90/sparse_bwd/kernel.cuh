// Sparse MLA prefill backward for sm_90a (docs/spec.md section 2): the main kernel. docs/sparse-bwd.md has the design:
// shared-memory plan, warp roles, barrier protocols, masking, how d_kv is reduced. The small kernels of the family
// (accumulator zeroing, d_kv finalisation, sink gradient) are in aux.cuh; delta = rowsum(out * dO) is fused
// into consumer 1 (fused_delta).
//
// One CTA = one query token t x one group of 64 heads; 3 warpgroups:
//   WG 0 (producer): loads Q [64 x d_qk] and dO [64 x 512] of its heads once, then gathers the token's selected KV
//                    rows, 64 per tile, into ONE shared tile, slab (64 columns) by slab, with cp.async (16-byte
//                    chunks straight into the 128B-swizzled layout; invalid rows zero-filled without being read).
//                    Each slab is one cp.async group: the producer waits for it, issues the generic->async proxy
//                    fence itself and then arrives on the slab's barrier, so the consumers never fence. Tile i+1 is
//                    gathered as soon as both consumers' dQ(i) retired, i.e. during dKV(i). When the host asks for
//                    it (p.kv_buckets > 1: accumulator + KV larger than L2, grid launched in waves) the entries go in
//                    ascending KV-row bucket order ("Bucketed order" below).
//   WG 1, 2 (consumers c = 0, 1), per tile, one function per phase ("The consumer's phases" below):
//     mma_s_or_dp   c = 0: S = Q K^T, c = 1: dP = dO V^T, each over all 64 tile rows, slab by slab as the gather
//                   lands                                                      (wgmma 64x64, K = d_qk / 512)
//     handoff       P = exp2(S * sm_scale * log2e - lse2') (0 for invalid rows) and dS' = sm_scale * P * (dP - delta)
//                   -> bf16 P and dS tiles, each consumer one half of the elements from its own accumulator and the
//                   other's values (c = 1 publishes dP - delta of its half, c = 0 P of the other half)
//     mma_dq        dQ[:, own slabs] += dS' K                                  (A from the dS tile)
//     release_tile  the KV tile goes back to the producer
//     dkv_*         dKV[:, slab s] = dS'^T Q[:, s] + P^T dO[:, s] for the slabs s this consumer owns (wgmma 64x64,
//                   K = heads), each 64 x 64 f32 chunk reduced into the accumulator rows (valid rows only) through
//                   a 2 KB slot per warp, four rows x 128 contiguous bytes per red.global.add.v4.f32 warp instruction:
//       dkv_solo      (h_q <= 64): the warp stages its own rows, one 32-column half at a time;
//       dkv_pair_f32  (h_q > 64, 2-CTA cluster, one CTA per head group): CTA rank r keeps columns [32 r, 32 r + 32);
//                     each warp st.async's the other half of its rows to the same warp of the peer, adds the peer's
//                     half of its kept columns, and reduces: one add per (token, row) instead of two. The exchange
//                     of chunk k overlaps the MMAs of chunk k + 1.
//       dkv_pair_xb   the same with a bf16 d_kv (not deterministic, not accumulated: the `_xb` kernels, kXBf16):
//                     the pair splits each chunk by rows instead (rank 1 gathers its tile rows with the 8-row halves
//                     swapped), the peer's half travels as bf16 through two 1 KB buffers per warp and is added in
//                     registers (pair_send_xb).
//   Epilogue (store_dq): dQ (already scaled by sm_scale) -> bf16, staged through the Q region, coalesced 16-byte
//   stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/cluster.cuh"
#include "common/cp_async.cuh"
#include "common/cta_work.cuh"
#include "common/grid_dep.cuh"
#include "common/cp_async_group.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/red_global.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"
#include "common/vec_access.cuh"
#include "common/wgmma.cuh"
#include "sm90/sparse_bwd/config.cuh"
#include "sm90/sparse_bwd/params.h"

namespace flashmla::sparse_bwd {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kInf = __builtin_huge_valf();

// One KV tile in flight: tile i's barriers complete once per tile (parity i & 1); the producer waits for the
// release of tile i - 1 (parity of a fresh barrier's "previous phase" on i = 0).
using Ring = RingPos<1>;


// The lane index, read with a volatile asm at every use: values derived from it cannot be hoisted out of a loop (the
// compiler would, keep them in registers for the whole loop, and spill them).
__device__ __forceinline__ uint32_t lane_id_volatile() {
    uint32_t l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}

// ---------------------------------------------------------------------------------------------------------------
// Bucketed order (p.kv_buckets = nb > 1: the host picks it when the f32 accumulator plus the KV rows exceed what L2
// holds, and then launches the grid in waves of co-resident CTAs: launch.rs). The KV rows are split into nb buckets
// of R = ceil(s_kv / nb) rows, and the producer emits the token's valid entries bucket by bucket, in ascending bucket
// order: pass b takes, in index-row order, the entries whose row lies in bucket b and packs them into the tiles of
// 64 as they come; the rows left over at the end of the last tiles are invalid (-1). So the CTA processes the same
// number of tiles and the same valid entries (duplicates once per occurrence) in another order, and no invalid
// entry (nothing from one reaches an output anyway). The order is a function of the index row and topk_eff only: a
// pair's two CTAs have the same row and topk_eff, so their tiles hold the same rows (the dKV exchange pairs rows by
// position). The CTAs of one wave start together and progress at about the same pace, so they all add into about
// the same 1/nb of the accumulator and gather from the same 1/nb of kv at any moment: a working set that L2 holds.
// With p.kv_buckets_descending (odd waves) pass b takes bucket nb - 1 - b, so a wave starts on the buckets the
// previous one ended on, which are still in L2.
//
// Each producer warp w fills the 16 tile rows 16 k + 4 w + j (k, j in 0..3) of every tile from its own segment of the
// index row, positions [16 n_tiles w, 16 n_tiles (w + 1)) clipped to topk_eff (4 segments of 16 n_tiles >= topk_eff
// positions, each fitting the warp's 16 rows of the n_tiles tiles), making the nb passes over that segment alone: no
// shared memory, no barrier. At the start of the token the warp loads its segment once and keeps each entry's bucket
// as a 6-bit id in registers (entry 32 c + lane of the segment: lane `lane`, field c % 5 of word c / 5; kNoBucket for
// invalid entries and positions past the segment), so the passes touch no memory: per 32-entry chunk one ballot of
// the entries in the current bucket and popc ranks; a tile's 16 slots (slot s = 4 k + j in lane s) record segment
// positions, whose indices are loaded once per tile (one round trip) and handed out with shuffles. A chunk that
// yields more than the tile needs leaves the cursor just after the last entry taken.

// Whether this CTA's row is bucketed (uniform over the CTA, and over a pair: same n_tiles).
__device__ __forceinline__ bool bucketed_row(const SparseBwdParams& p, const CtaWork& w) {
    return p.kv_buckets > 1 && p.kv_buckets <= kMaxKvBuckets && w.n_tiles <= kMaxBucketTiles;
}

// Lane of the r-th (from 0) set bit of m; r < popc(m).
__device__ __forceinline__ int nth_set_lane(uint32_t m, int r) {
    int x = 0;  // the largest x with popc(m & (2^x - 1)) <= r
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) {
        if (__popc(m & ((1u << (x + step)) - 1u)) <= r) x += step;
    }
    return x;
}

// First position of a producer warp's segment of the index row (its end: the next warp's start, or topk_eff).
__device__ __forceinline__ int bucket_segment_begin(const CtaWork& w, int warp) {
    return min(kScanSlots * w.n_tiles * warp, w.topk_eff);  // kScanSlots * n_tiles <= 640
}

// A producer warp's bucket ids and its cursor between tiles, in as few registers as possible (the producer has 40).
// `cursor` is warp-uniform: bits 0-9 the next segment position of the current pass, bits 10-15 the bucket of the
// current pass (0..nb; nb: done), bits 16-20 the chunks of 32 in the segment.
struct BucketScan {
    uint32_t ids[kBucketIdWords];  // this lane's entries of the segment: bucket ids, pass b takes id b
    uint32_t cursor;
};
inline constexpr int kCursorStepShift = 10;
inline constexpr int kCursorChunksShift = 16;
static_assert(kScanSlots * kMaxBucketTiles <= (1 << kCursorStepShift) && kMaxKvBuckets < (1 << 6) &&
                  kBucketIdsPerWord * kBucketIdWords < (1 << 5),
              "cursor fields");

// Loads this warp's segment of the index row and computes its bucket ids; the cursor starts at pass 0.
__device__ __forceinline__ void bucket_scan_init(const SparseBwdParams& p, const int32_t* idx_row, const CtaWork& w,
                                                 int warp, BucketScan& sc) {
    const int nb = p.kv_buckets;
    const int rows = p.s_kv / nb + (p.s_kv % nb != 0 ? 1 : 0);  // R = ceil(s_kv / nb) without overflow
    // v / R by a float reciprocal (20 divisions otherwise): off by one at most near a bucket boundary, which only
    // moves the entry to a neighbouring bucket; the clamp keeps every valid entry in a bucket.
    const float inv_rows = 1.0f / static_cast<float>(max(rows, 1));
    const int lane = static_cast<int>(lane_id_volatile());
    const int begin = bucket_segment_begin(w, warp);
    const int end = warp + 1 < 4 ? bucket_segment_begin(w, warp + 1) : w.topk_eff;
    const int32_t* src = idx_row + begin + lane;  // one base: the 20 loads differ by immediate offsets
    const int len = end - begin - lane;
#pragma unroll
    for (int wd = 0; wd < kBucketIdWords; ++wd) {
        uint32_t word = 0;
#pragma unroll
        for (int f = 0; f < kBucketIdsPerWord; ++f) {
            const int j = 32 * (kBucketIdsPerWord * wd + f);
            const int v = j < len ? __ldg(src + j) : -1;
            uint32_t id = kNoBucket;
            if (v >= 0 && v < p.s_kv) {
                const int b = min(static_cast<int>(static_cast<float>(v) * inv_rows), nb - 1);
                id = static_cast<uint32_t>(p.kv_buckets_descending != 0 ? nb - 1 - b : b);  // pass `id` takes it
            }
            word |= id << (kBucketIdBits * f);
        }
        sc.ids[wd] = word;
    }
    const uint32_t n_chunks = static_cast<uint32_t>(end - begin + 31) / 32;
    sc.cursor = (n_chunks << kCursorChunksShift) | (n_chunks > 0 ? 0u : static_cast<uint32_t>(nb) << kCursorStepShift);
}

// Picks this warp's 16 rows of the next tile and returns this thread's 4 of them (tile row 16 k + row_in_pass, -1
// when invalid), like load_tile_indices. kRowSwap (pair mode, bf16 exchange, CTA rank 1): warp w fills the rows of
// warp w ^ 2 of the peer (tile row p here holds the peer's row p ^ 8), so it walks segment w ^ 2.
template <bool kRowSwap>
__device__ __forceinline__ void scan_bucket_tile(const SparseBwdParams& p, const int32_t* idx_row, const CtaWork& w,
                                                 BucketScan& sc, int (&idx)[kPassesPerTile]) {
    const uint32_t nb = static_cast<uint32_t>(p.kv_buckets);
    const int lane = static_cast<int>(lane_id_volatile());
    uint32_t pos = sc.cursor & ((1u << kCursorStepShift) - 1);
    uint32_t step = (sc.cursor >> kCursorStepShift) & ((1u << (kCursorChunksShift - kCursorStepShift)) - 1);
    const uint32_t n_chunks = sc.cursor >> kCursorChunksShift;
    int out = -1;   // segment position of slot `lane` (lanes < 16)
    int count = 0;  // slots filled
    while (count < kScanSlots && step < nb) {
        const uint32_t c = pos / 32;
        const uint32_t word = c < kBucketIdsPerWord       ? sc.ids[0]
                              : c < 2 * kBucketIdsPerWord ? sc.ids[1]
                              : c < 3 * kBucketIdsPerWord ? sc.ids[2]
                                                          : sc.ids[3];
        const uint32_t id = (word >> (kBucketIdBits * (c % kBucketIdsPerWord))) & kNoBucket;
        const uint32_t m = __ballot_sync(0xffffffffu, id == step) & (0xffffffffu << (pos % 32));
        bool whole = true;
        if (m != 0) {
            const int n = __popc(m);
            const int take = min(n, kScanSlots - count);
            // Slots [count, count + take) get the chunk's first `take` selected entries: slot `lane` the r-th.
            const int r = lane - count;
            if (r >= 0 && r < take) out = static_cast<int>(32 * c) + nth_set_lane(m, r);
            count += take;
            if (take < n) {  // the tile is full: resume after the last entry taken (a lane < 31)
                pos = 32 * c + static_cast<uint32_t>(nth_set_lane(m, take - 1)) + 1;
                whole = false;
            }
        }
        if (whole) {
            pos = 32 * (c + 1);
            if (c + 1 == n_chunks) {
                pos = 0;
                ++step;
            }
        }
    }
    sc.cursor = (n_chunks << kCursorChunksShift) | (step << kCursorStepShift) | pos;
    // A recorded position lies in the segment (< topk_eff) and holds a valid row. The segment's start is recomputed
    // from a volatile read of the thread index (hoisted out of the tile loop, its 64-bit offset would spill).
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    int seg = static_cast<int>(tid / 32);
    if constexpr (kRowSwap) seg ^= 2 * static_cast<int>(cluster_ctarank_volatile());
    const int v = out >= 0 ? __ldg(idx_row + bucket_segment_begin(w, seg) + out) : -1;
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        // Tile row 16 k + row_in_pass, row_in_pass = 4 warp + lane / 8: slot 4 k + lane / 8.
        idx[k] = __shfl_sync(0xffffffffu, v, 4 * k + static_cast<int>(lane_id_volatile()) / 8);
    }
}
static_assert(kTileRows == 64 && kRowsPerPass == 16 && kPassesPerTile == 4 && kThreadsPerRow == 8,
              "scan_bucket_tile: warp w gathers tile rows 16 k + 4 w + lane / 8");
static_assert(kScanSlots * kMaxBucketTiles <= kBucketIdsPerWord * kBucketIdWords * 32, "ids cover a segment");

// ---------------------------------------------------------------------------------------------------------------
// Producer warpgroup. Thread t copies 16-byte chunk (t % 8) of one 128-byte slab row; the 16 row groups (t / 8)
// cover 16 rows per pass, so pass k handles tile row 16k + t/8 (same geometry as the forward).

__device__ __forceinline__ void load_tile_indices(const int32_t* idx_row, int tile, int topk_eff, int row_in_pass,
                                                  int (&idx)[kPassesPerTile]) {
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        const int j = tile * kTileRows + k * kRowsPerPass + row_in_pass;
        idx[k] = j < topk_eff ? __ldg(idx_row + j) : -1;  // past topk_eff: never read, invalid
    }
}

// Issues the 16-byte copies of KV slab `slab` of the current tile (4 rows per thread) and closes them into one
// cp.async group.
template <int kDqk>
__device__ __forceinline__ void issue_kv_slab(uint32_t kv_base, const uint16_t* const (&src)[kPassesPerTile],
                                              const bool (&ok)[kPassesPerTile], int slab) {
    using C = Config<kDqk>;
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        cp_async_16_zfill_l2_256(kv_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                                 src[k] + slab * kSw128ColsBf16, ok[k]);
    }
    cp_async_commit_group();
}


// The producer's tile loop: gathers the w.n_tiles KV tiles whose indices come from load_tile_indices (index order)
// or scan_bucket_tile (kBucketed); `idx_next` holds tile 0's on entry. Indices of tile i + 1 are loaded while tile i
// is waited for and issued (bucketed order: picked after tile i is issued).
template <int kDqk, bool kBucketed, bool kRowSwap>
__device__ __forceinline__ void producer_tiles(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w,
                                               const int32_t* idx_row, BucketScan& sc,
                                               int (&idx_next)[kPassesPerTile]) {
    using C = Config<kDqk>;
    // d_qk 576: the last KV slabs double as the exchange / staging slots, refilled after the drain.
    constexpr int kLate = C::kLateSlabs;
    constexpr int kEarly = C::kDqkSlabs - kLate;
    // threadIdx.x is 0..127: the producer is warpgroup 0.
    const auto [row_in_pass, chunk, thread_off, chunk_elems] = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    // Index position (within a pass) of this thread's tile row (kRowSwap: rank 1 swaps the halves of each pass).
    const int entry_row =
        kRowSwap ? row_in_pass ^ static_cast<int>(cluster_ctarank() * (kRowsPerPass / 2)) : row_in_pass;
    const uint16_t* const dummy_src = p.q;  // zero-filled copies' source (see producer)
    const uint32_t kv_base = smem_addr(sm.kv) + thread_off;
    for (int i = 0; i < w.n_tiles; ++i) {
        const uint16_t* src[kPassesPerTile];
        bool ok[kPassesPerTile];
        int row[kPassesPerTile];
#pragma unroll
        for (int k = 0; k < kPassesPerTile; ++k) {
            // Invalid: any value < 0 or >= s_kv (including the -1 of the tail). Never dereferenced.
            ok[k] = idx_next[k] >= 0 && idx_next[k] < p.s_kv;
            row[k] = ok[k] ? idx_next[k] : -1;
            src[k] = (ok[k] ? p.kv + static_cast<int64_t>(idx_next[k]) * p.kv_stride_t : dummy_src) + chunk_elems;
        }
        if (!kBucketed && i + 1 < w.n_tiles) load_tile_indices(idx_row, i + 1, w.topk_eff, entry_row, idx_next);

        // Wait until the previous tile's readers (S, dP, dQ of both consumers) have retired. That also frees
        // row_idx[i & 1]: its last reader, dKV(i - 2), precedes dQ(i - 1) in both consumers.
        const Ring pos = Ring::of(i);
        MBarrier::wait(&sm.kv_empty, pos.empty_parity);
        if (chunk == 0) {
#pragma unroll
            for (int k = 0; k < kPassesPerTile; ++k) sm.row_idx[i & 1][k * kRowsPerPass + row_in_pass] = row[k];
        }
#pragma unroll
        for (int slab = 0; slab < kEarly; ++slab) issue_kv_slab<kDqk>(kv_base, src, ok, slab);
        // Q / dO are the group before this tile's kEarly slab groups (tile 0 only). Each arrival is a release: it also
        // publishes row_idx.
        if (i == 0) publish_landed_copies(&sm.qdo_full, kEarly);
#pragma unroll
        for (int slab = 0; slab < kEarly; ++slab) publish_landed_copies(&sm.kv_full[slab], kEarly - 1 - slab);
        if constexpr (kLate > 0) {
            // The late slabs hold the exchange / staging slots until every consumer thread finished the last chunk of
            // the previous tile (x_drained completes once per tile; tile 0 passes at once).
            MBarrier::wait(&sm.x_drained, pos.empty_parity);
#pragma unroll
            for (int slab = kEarly; slab < C::kDqkSlabs; ++slab) issue_kv_slab<kDqk>(kv_base, src, ok, slab);
#pragma unroll
            for (int slab = kEarly; slab < C::kDqkSlabs; ++slab) {
                publish_landed_copies(&sm.kv_full[slab], C::kDqkSlabs - 1 - slab);
            }
        }
        // Bucketed order: pick tile i + 1 once tile i is issued (its sources no longer need registers; the scan runs
        // while the consumers compute S, dP and dQ of tile i, before the next kv_empty wait).
        if constexpr (kBucketed) {
            if (i + 1 < w.n_tiles) scan_bucket_tile<kRowSwap>(p, idx_row, w, sc, idx_next);
        }
    }
}

// kRowSwap (pair mode with the bf16 exchange): CTA rank 1 gathers index position 16 m + r of every tile into tile row
// 16 m + (r ^ 8), so that the exchange can split each chunk by rows with compile-time registers (pair_send_xb).
template <int kDqk, bool kRowSwap>
__device__ __forceinline__ void producer(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;

    const int t = static_cast<int>(threadIdx.x);  // 0..127: the producer is warpgroup 0
    const auto [row_in_pass, chunk, thread_off, chunk_elems] = Sw128CopyThread::of(t);
    // Source operand of zero-filled copies: never read, but kept inside a mapped tensor anyway (q[0, 0, :]
    // exists whenever a CTA runs; kv may be empty).
    const uint16_t* const dummy_src = p.q;

    // Q [64 heads x d_qk] and dO [64 heads x 512] of the group (rows past h_q zero-filled): one cp.async group,
    // published together with tile 0 (a row without tiles: dO alone, published at once).
    const bool has_tiles = w.n_tiles > 0;
    {
        const uint32_t q_base = smem_addr(sm.q) + thread_off;
        const uint32_t do_base = smem_addr(sm.d_out) + thread_off;
        const uint16_t* q_tok = p.q + static_cast<int64_t>(w.token) * p.q_stride_t;
        const uint16_t* do_tok = p.d_out + static_cast<int64_t>(w.token) * p.d_out_stride_t;
#pragma unroll
        for (int k = 0; k < kPassesPerTile; ++k) {
            const int r = k * kRowsPerPass + row_in_pass;
            const bool ok = r < w.heads;
            const int64_t head = w.head0 + r;
            const uint16_t* q_src = (ok ? q_tok + head * p.q_stride_h : dummy_src) + chunk_elems;
            const uint16_t* do_src = (ok ? do_tok + head * p.d_out_stride_h : dummy_src) + chunk_elems;
            const uint32_t row_off = k * kRowsPerPass * kSw128RowBytes;
#pragma unroll
            for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
                if (has_tiles) {
                    cp_async_16_zfill(q_base + slab * C::kSlabBytes + row_off, q_src + slab * kSw128ColsBf16, ok);
                }
            }
#pragma unroll
            for (int slab = 0; slab < C::kDvSlabs; ++slab) {
                cp_async_16_zfill(do_base + slab * C::kSlabBytes + row_off, do_src + slab * kSw128ColsBf16, ok);
            }
        }
        cp_async_commit_group();
    }
    if (!has_tiles) {
        // A row without tiles: dO only, for consumer 1's delta (the epilogue stages d_q = 0 in the Q region).
        publish_landed_copies(&sm.qdo_full, 0);
        return;
    }

    // KV tiles, in index order or in bucketed order (two instantiations of the tile loop, so that the index-order
    // one is compiled exactly as without the bucketed order).
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;
    BucketScan sc;
    int idx_next[kPassesPerTile];
    const int swap = kRowSwap ? static_cast<int>(cluster_ctarank()) * (kRowsPerPass / 2) : 0;
    const int entry_row = row_in_pass ^ swap;  // index position (within a pass) of this thread's tile row
    if (bucketed_row(p, w)) {
        bucket_scan_init(p, idx_row, w, (t / 32) ^ (swap / 4), sc);
        scan_bucket_tile<kRowSwap>(p, idx_row, w, sc, idx_next);
        producer_tiles<kDqk, true, kRowSwap>(p, sm, w, idx_row, sc, idx_next);
    } else {
        load_tile_indices(idx_row, 0, w.topk_eff, entry_row, idx_next);
        producer_tiles<kDqk, false, kRowSwap>(p, sm, w, idx_row, sc, idx_next);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

// Base-2 log-sum-exp the probabilities are normalised by: lse2' = log2(2^a + 2^b) with a = lse * log2e and
// b = sink * log2e (docs/spec.md section 1: the sink is one more logit with a zero value vector). +inf when either is +inf: an
// empty row (lse = +inf) or a +inf sink gives P = exp2(s - inf) = 0 everywhere, without forming inf - inf.
__device__ __forceinline__ float lse2_with_sink(float lse, const float* sink) {
    const float a = lse * kLog2e;
    if (sink == nullptr) return a;
    const float b = __ldg(sink) * kLog2e;
    const float m = fmaxf(a, b);
    if (m == kInf || m == -kInf) return m;
    return m + log1pf(exp2f(-fabsf(a - b))) * kLog2e;  // -inf sink: exp2(-inf) = 0, lse2' = a
}

// The two bf16 halves of a bf16x2 word as f32 (exact).
__device__ __forceinline__ float bf16x2_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Dot product of eight bf16 pairs in f32.
__device__ __forceinline__ float dot_bf16x8(uint4 a, uint4 b) {
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
    const uint32_t bw[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s = fmaf(bf16x2_lo(aw[i]), bf16x2_lo(bw[i]), s);
        s = fmaf(bf16x2_hi(aw[i]), bf16x2_hi(bw[i]), s);
    }
    return s;
}

// delta = rowsum(out * dO) (docs/spec.md section 2) of the 16 heads of warp `warp` of consumer 1 (CTA rows [16 warp, 16 warp +
// 16): the rows whose dS' the warp computes), fused into the main kernel so that no pre-pass reads `out` and `dO`
// again. Lane l covers columns [16 l, 16 l + 16) of each row: 32 contiguous bytes of `out` (with 16-byte aligned
// rows all 16 heads' loads are in flight before the wait for dO) and chunks 2 (l % 4), +1 of dO slab l / 4 in
// shared memory (the producer loads dO even for a row without tiles). Writes `delta` of the group's real heads and
// returns, per thread, delta of its two accumulator rows (lane / 4, + 8).
template <int kDqk>
__device__ __forceinline__ void fused_delta(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w, int warp,
                                            int lane, float (&delta)[2]) {
    using C = Config<kDqk>;
    constexpr int kHeads = 16;
    constexpr int kLaneChunks = 2;  // 16-byte chunks per lane and row: 32 lanes x 32 bytes = one 512-column row
    constexpr int kLanesPerSlab = kSw128ChunksPerRow / kLaneChunks;
    static_assert(32 * kLaneChunks * 8 == kDv && kSw128ChunksPerRow % kLaneChunks == 0, "lane -> dO chunk map");
    const uint16_t* out_lane = p.out + static_cast<int64_t>(w.token) * p.out_stride_t +
                               static_cast<int64_t>(w.head0 + kHeads * warp) * p.out_stride_h + kLaneChunks * 8 * lane;
    const uint32_t do_slab = smem_addr(sm.d_out) + (lane / kLanesPerSlab) * C::kSlabBytes;
    const int chunk0 = kLaneChunks * (lane % kLanesPerSlab);
    // Rows past h_q: `out` is not read, dO is zero-filled by the producer.
    const auto dot_row = [&](const uint4 (&o)[kLaneChunks], int r) {
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < kLaneChunks; ++c) {
            s += dot_bf16x8(o[c], ld_shared_v4(do_slab + sw128_chunk_offset(r, chunk0 + c)));
        }
        return s;
    };
    // Warp sum of row j's partials, kept by the lanes that own the row and by lane j % 16, which writes it.
    float mine = 0.f;
    delta[0] = 0.f;
    delta[1] = 0.f;
    const auto finish = [&](int j, float s) {
#pragma unroll
        for (int m = 16; m >= 1; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);
        if (j == lane / 4) delta[0] = s;
        if (j == lane / 4 + 8) delta[1] = s;
        if (j == lane % kHeads) mine = s;
    };
    if ((p.flags & kFlagOutVec16) != 0) {
        uint4 o[kHeads][kLaneChunks];
#pragma unroll
        for (int j = 0; j < kHeads; ++j) {
            const bool ok = kHeads * warp + j < w.heads;
#pragma unroll
            for (int c = 0; c < kLaneChunks; ++c) {
                o[j][c] = ok ? load_bf16x8<true>(out_lane + j * p.out_stride_h + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        MBarrier::wait(&sm.qdo_full, 0);  // dO landed (the producer publishes it whatever the row length)
#pragma unroll
        for (int j = 0; j < kHeads; ++j) finish(j, dot_row(o[j], kHeads * warp + j));
    } else {
        // `out` rows not 16-byte aligned (a strided view): element loads, one row at a time.
        MBarrier::wait(&sm.qdo_full, 0);
#pragma unroll 1
        for (int j = 0; j < kHeads; ++j) {
            const bool ok = kHeads * warp + j < w.heads;
            uint4 o[kLaneChunks];
#pragma unroll
            for (int c = 0; c < kLaneChunks; ++c) {
                o[c] = ok ? load_bf16x8<false>(out_lane + j * p.out_stride_h + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
            }
            finish(j, dot_row(o, kHeads * warp + j));
        }
    }
    const int r = kHeads * warp + lane;
    if (lane < kHeads && r < w.heads) {
        p.delta[static_cast<int64_t>(w.token) * p.delta_stride_t + (w.head0 + r) * p.delta_stride_h] = mine;
    }
}

// dQ accumulator slice of one consumer: 4 slabs (one m64n256 accumulator) or 5 (plus one m64n64).
template <int kSlabs>
struct DqAcc;
template <>
struct DqAcc<4> {
    float a[128];  // columns [64 slab0, 64 slab0 + 256)
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int k = 0; k < 128; ++k) a[k] = 0.f;
    }
};
template <>
struct DqAcc<5> {
    float a[128];  // columns [64 slab0, 64 slab0 + 256)
    float b[32];   // columns [64 (slab0 + 4), 64 (slab0 + 5))
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int k = 0; k < 128; ++k) a[k] = 0.f;
#pragma unroll
        for (int k = 0; k < 32; ++k) b[k] = 0.f;
    }
};

// Shapes of the consumer's register tiles.
inline constexpr int kSdRegs = kHeadsPerCta * kTileRows / kWarpgroupThreads;  // 32: S or dP, 64 x 64 f32
inline constexpr int kSdBlocks = kSdRegs / 4;                                    // 8 n8 blocks
inline constexpr int kSteps = kTileRows / 16;                                    // 4 k-steps of 16 tile rows
inline constexpr int kChunkRegs = kTileRows * kSw128ColsBf16 / kWarpgroupThreads;  // 32: dKV chunk 64 x 64 f32
inline constexpr int kChunkBlocks = kChunkRegs / 4;                                // 8 n8 blocks
inline constexpr int kN256Slabs = 4;                                               // slabs per m64n256 accumulator
inline constexpr uint32_t kUnusedLbo = 16;  // K-major SW128 operands ignore LBO
inline constexpr uint32_t kKStepMnBytes = 16 * kSw128RowBytes;  // MN-major operands: 16 K rows = 2048 bytes

// Pair mode, f32 exchange: the exchange of one dKV chunk (config.cuh; the bf16 exchange splits rows, pair_send_xb
// below). CTA rank r keeps columns [32 r, 32 r + 32) of the chunk
// (the accumulator's n8 blocks 4r .. 4r + 3) and sends the other half of every row to the peer; consumer warp w
// (of consumer c) exchanges with warp w of consumer c in the peer through slot 4c + w of each CTA. Nothing of it
// is kept in registers across the tile loop (consumer 0 holds 160 dQ accumulators at d_qk 576): the addresses
// are recomputed per chunk; the peer's shared::cluster addresses are the local ones plus a constant (mapa
// translates the whole shared window).
struct PairLink {
    uint32_t slot;        // own slot: the peer's half of this warp's rows lands here
    uint32_t full;        // own x_full[slot]
    uint32_t empty;       // own x_empty[slot] (completes when the peer released ITS slot for our next chunk)
    uint32_t peer_delta;  // shared::cluster address of a byte in the peer = its local address + peer_delta
    uint32_t rank;        // cluster rank = the column half kept
};

// kXBf16: `full` / `empty` are the barriers of buffer 0 of the slot; buffer b's are 8 b bytes further.
template <int kDqk, bool kXBf16 = false>
__device__ __forceinline__ PairLink pair_link(SmemPlan<kDqk>& sm, int consumer, int warp) {
    PairLink l;
    const int slot = kConsumerWarps / kConsumers * consumer + warp;
    const int bar = kXBf16 ? kXbBufs * slot : slot;
    l.rank = cluster_ctarank();
    l.slot = smem_addr(sm.xbuf_base()) + slot * kXSlotBytes;
    l.full = smem_addr(&sm.x_full[bar]);
    l.empty = smem_addr(&sm.x_empty[bar]);
    l.peer_delta = mapa_shared(l.slot, l.rank ^ 1u) - l.slot;
    return l;
}

// Slot addressing. Slot row rl holds 32 f32 columns of accumulator row 16 w + rl (128 bytes); its 16-byte chunk c
// sits at position c ^ (rl % 8). With g = lane / 4, q = lane % 4:
//   fragment order (local n8 block jj in [0, 4), row half rr): row g + 8 rr, chunk (2 jj + (q >> 1)) ^ g, 8-byte
//     half q & 1, i.e. (frag_base ^ (jj << 5)) + rr * 1024, frag_base = slot + 128 g + 16 ((q >> 1) ^ g) + 8 (q & 1)
//     ((2 jj + h) ^ g == 2 jj ^ (h ^ g) since 2 jj and h share no bit; the XOR touches bits 5-6 only, which no
//     other term of frag_base sets: slots are 128-byte aligned);
//   row order (pass k in [0, 4), lanes 8 l3 .. 8 l3 + 7): row 4 k + l3, chunk c = lane % 8, i.e.
//     (row_base ^ ((k & 1) << 6)) + 512 k with row_base = slot + 128 l3 + 16 (c ^ l3).
// The lane is read with lane_id_volatile in every call, so the compiler cannot hoist these addresses out of the tile
// loop (it would, and then spill them).
inline constexpr int kXRowPasses = kXSlotRows * kXChunksPerRow / 32;  // 4: four rows x 128 bytes per instruction
// d_qk 576: reports that this thread's last access of its slot in the tile is done (x_drained, kConsumerThreads
// arrivals per tile), after which the producer refills the KV slabs the slots alias. EVERY thread arrives, each
// after its own slot accesses: a lane-0 arrival after __syncwarp() would be just as correct, but ptxas compiles that
// __syncwarp() in converged code to no instruction (BRA.DIV + NOP), and compute-sanitizer racecheck, which orders
// only the arriving thread's own accesses before an mbarrier phase, then reports every other lane's slot access
// against the producer's cp.async (docs/sparse-bwd.md, Verification). Cost: 31 more arrivals per warp and tile.
__device__ __forceinline__ void report_drained(uint64_t* drained) {
    if (drained != nullptr) MBarrier::arrive(drained);
}

__device__ __forceinline__ uint32_t pair_frag_base(uint32_t slot, uint32_t lane) {
    const uint32_t g = lane / 4;
    const uint32_t q = lane % 4;
    return slot + g * kXSlotRowBytes + (((q >> 1) ^ g) << 4) + 8 * (q & 1);
}
__device__ __forceinline__ uint32_t pair_frag_addr(uint32_t frag_base, int jj, int rr) {
    return (frag_base ^ (static_cast<uint32_t>(jj) << 5)) + rr * 8 * kXSlotRowBytes;
}
__device__ __forceinline__ uint32_t pair_row_base(uint32_t slot, uint32_t lane) {
    const uint32_t l3 = lane / kXChunksPerRow;
    const uint32_t c = lane % kXChunksPerRow;
    return slot + l3 * kXSlotRowBytes + ((c ^ l3) << 4);
}
__device__ __forceinline__ uint32_t pair_row_addr(uint32_t row_base, int k) {
    return (row_base ^ (static_cast<uint32_t>(k & 1) << 6)) + k * 4 * kXSlotRowBytes;
}
static_assert(kXSlotRowBytes == 128 && kXChunksPerRow == 8 && kXRowPasses == 4, "slot addressing above");

// Reads a slot (16 rows x 32 f32 columns, complete) back row by row and adds it into the accumulator rows
// ridx_warp[0..16), columns [col, col + 32). Rows with an invalid index (< 0) form no address.
//   f32 (default): lane l takes row 4k + l / 8, 16-byte chunk l % 8: four rows x 128 contiguous bytes per warp
//     instruction (the microbenchmarked pattern: ~1.3-1.6x the adds/s of 16 rows x 32 bytes).
//   int64 fixed point (kDet): lane l takes column l of every row: one row x 256 contiguous bytes per warp
//     instruction. (Four scalar adds per lane of the f32 pattern would put 8 bytes in every 32-byte sector of four
//     rows per instruction: bench/micro/reduce_det_bw.cu.) A slot row is 128 bytes with its 16-byte chunks
//     swizzled by the row's low three bits (pair_row_base / pair_row_addr), so the 32 lanes' reads of one row hit
//     32 distinct banks.
template <bool kDet>
__device__ __forceinline__ void reduce_slot_rows(const SparseBwdParams& p, uint32_t slot, uint32_t lane,
                                                 const int32_t* ridx_warp, int col) {
    if constexpr (kDet) {
        int64_t* acc = reinterpret_cast<int64_t*>(p.dkv_acc) + col + lane;
#pragma unroll
        for (int k = 0; k < kXRowPasses; ++k) {  // four rows at a time: the consumers' registers are nearly full
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 4 * k + i;
                v[i] = ld_shared_f32(slot + r * kXSlotRowBytes +
                                     ((((lane / 4) ^ static_cast<uint32_t>(r & 7)) << 4) | ((lane % 4) << 2)));
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = ridx_warp[4 * k + i];
                if (row < 0) continue;
                red_add_s64(acc + static_cast<int64_t>(row) * p.dkv_acc_stride, to_fixed_point(v[i]));
            }
        }
    } else {
        const uint32_t rb = pair_row_base(slot, lane);
        const int64_t col0 = col + 4 * (lane % kXChunksPerRow);
        float4 v[kXRowPasses];
#pragma unroll
        for (int k = 0; k < kXRowPasses; ++k) v[k] = ld_shared_v4_f32(pair_row_addr(rb, k));
#pragma unroll
        for (int k = 0; k < kXRowPasses; ++k) {
            const int r = ridx_warp[4 * k + lane / kXChunksPerRow];
            if (r < 0) continue;
            red_add_v4_f32(p.dkv_acc + static_cast<int64_t>(r) * p.dkv_acc_stride + col0, v[k]);
        }
    }
}

// Pair mode, sender side of chunk `round`: waits until the peer released its slot (its permission for the tile's
// first chunk, or its reduction of our previous chunk), then st.async's the 16 values per thread of the half the
// peer keeps into it, in fragment order; returns the half this CTA keeps in `kept`.
__device__ __forceinline__ void pair_send(const PairLink& l, const float (&acc)[kChunkRegs], uint32_t parity,
                                          float (&kept)[kXSlotVals]) {
    const uint32_t lane = lane_id_volatile();
    const bool hi = l.rank != 0;  // keeps n8 blocks 4..7, sends 0..3
    mbarrier_wait_parity(l.empty, parity);
    const uint32_t fb = pair_frag_base(l.slot, lane);
    const uint32_t peer_full = l.full + l.peer_delta;
#pragma unroll
    for (int jj = 0; jj < kChunkBlocks / 2; ++jj) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int lo_i = 4 * jj + 2 * rr;            // block jj: columns [0, 32)
            const int hi_i = 4 * (jj + 4) + 2 * rr;      // block jj + 4: columns [32, 64)
            const float s0 = hi ? acc[lo_i] : acc[hi_i];
            const float s1 = hi ? acc[lo_i + 1] : acc[hi_i + 1];
            kept[4 * jj + 2 * rr] = hi ? acc[hi_i] : acc[lo_i];
            kept[4 * jj + 2 * rr + 1] = hi ? acc[hi_i + 1] : acc[lo_i + 1];
            st_async_v2_f32(pair_frag_addr(fb, jj, rr) + l.peer_delta, s0, s1, peer_full);
        }
    }
}

// Pair mode, receiver side of chunk `round`: arms x_full for the peer's 2 KB, waits, adds the kept half into the
// slot, reads it back row by row (lane l: row 4k + l / 8, 16-byte chunk l % 8) and reduces four rows x 128 bytes
// per instruction into columns [64 slab + 32 rank, + 32); then releases the slot to the peer, except after the
// tile's last chunk: then every lane reports the drain locally (`drained`, d_qk 576) and the release waits for the
// next tile's permission.
template <bool kDet>
__device__ __forceinline__ void pair_reduce(const SparseBwdParams& p, const PairLink& l,
                                            const float (&kept)[kXSlotVals], const int32_t* ridx_warp, int slab,
                                            uint32_t parity, bool last, uint64_t* drained) {
    const uint32_t lane = lane_id_volatile();
    if (lane == 0) mbarrier_arrive_expect_tx(l.full, kXSlotBytes);
    mbarrier_wait_parity(l.full, parity);
    // Read all of the peer's values first, then write the sums: two shared-memory round trips per chunk instead of
    // one per pair (these run while the next chunk's wgmma saturates shared memory, so each round trip is long).
    const uint32_t fb = pair_frag_base(l.slot, lane);
    float2 peer[kXSlotVals / 2];
#pragma unroll
    for (int jj = 0; jj < kChunkBlocks / 2; ++jj) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) peer[2 * jj + rr] = ld_shared_v2_f32(pair_frag_addr(fb, jj, rr));
    }
#pragma unroll
    for (int jj = 0; jj < kChunkBlocks / 2; ++jj) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            st_shared_v2_f32(pair_frag_addr(fb, jj, rr), peer[2 * jj + rr].x + kept[4 * jj + 2 * rr],
                             peer[2 * jj + rr].y + kept[4 * jj + 2 * rr + 1]);
        }
    }
    __syncwarp();
    reduce_slot_rows<kDet>(p, l.slot, lane, ridx_warp, slab * kSw128ColsBf16 + kXSlotCols * static_cast<int>(l.rank));
    __syncwarp();  // every lane's slot reads done (their values were consumed by the reductions)
    if (!last) {
        if (lane == 0) mbarrier_arrive_remote_relaxed(l.empty + l.peer_delta);
    } else {
        report_drained(drained);  // every lane
    }
}

// Pair mode with the bf16 exchange (`kXBf16`). Each warp's 2 KB slot holds two 1 KB receive buffers; chunk k of a
// tile uses buffer k & 1 of the slot (barriers x_full / x_empty [2 slot + b]). The pair splits a chunk by ROWS, not
// columns: in CTA rank 1 the producer gathers index position 16 m + r into tile row 16 m + (r ^ 8) (kRowSwap), so
// that row half rr = 0 of a lane, accumulator row 16 w + g, holds the same entry as row half rr = 1 of the same lane
// in the peer. Every CTA therefore keeps its rr = 0 values and sends its rr = 1 values, with compile-time register
// indices: the receiving lane gets the peer's partials of exactly its own kept elements (same row entry, same
// columns), as eight bf16x2 words at buffer position 16 lane (+ 512), conflict-free, no re-layout. The reductions
// then take two shuffle steps (pair_reduce_xb) so that a warp instruction covers 4 rows x 128 contiguous bytes.
inline constexpr int kXbWords = kXSlotVals / 2;  // 8 bf16x2 words sent per lane and chunk
static_assert(kXbWords * 4 * 32 == kXbBufBytes, "a lane's 32 bytes fill the 1 KB buffer");
__device__ __forceinline__ uint32_t xb_parity_of(int uses_per_tile, int tile, int k) {
    return static_cast<uint32_t>(tile * uses_per_tile + (k >> 1)) & 1u;
}

// Sender side of chunk k (buffer b = k & 1): packs the row half rr = 1 to bf16, waits until the peer released its
// buffer b (tile-start permission, or its reduction of chunk k - 2), st.async's 2 x 16 bytes per lane.
__device__ __forceinline__ void pair_send_xb(const PairLink& l, const float (&acc)[kChunkRegs], uint32_t b,
                                             uint32_t parity) {
    uint32_t word[kXbWords];
#pragma unroll
    for (int j = 0; j < kChunkBlocks; ++j) word[j] = pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]);
    const uint32_t lane = lane_id_volatile();
    const uint32_t buf = l.slot + b * kXbBufBytes + 16 * lane + l.peer_delta;
    const uint32_t peer_full = l.full + 8 * b + l.peer_delta;
    mbarrier_wait_parity(l.empty + 8 * b, parity);
    st_async_v4_b32(buf, make_uint4(word[0], word[1], word[2], word[3]), peer_full);
    st_async_v4_b32(buf + kXbBufBytes / 2, make_uint4(word[4], word[5], word[6], word[7]), peer_full);
}

// The kept half of a chunk (row half rr = 0, f32; kept[2 j + e] = acc[4 j + e]), as real copies: the next chunk's
// wgmma overwrites acc while the kept values wait for the peer's (plain assignments let ptxas keep them in acc and
// serialise the wgmma, C7511).
__device__ __forceinline__ void keep_xb(const float (&acc)[kChunkRegs], float (&kept)[kXSlotVals]) {
#pragma unroll
    for (int j = 0; j < kChunkBlocks; ++j) {
        asm volatile("mov.b32 %0, %1;" : "=f"(kept[2 * j]) : "f"(acc[4 * j]));
        asm volatile("mov.b32 %0, %1;" : "=f"(kept[2 * j + 1]) : "f"(acc[4 * j + 1]));
    }
}

// The reductions of a tile's last chunk, held in registers so that they can be issued during the next tile's S / dP
// (kFlagDeferLastReduce): per lane two 16-byte adds to each of two accumulator rows, predicated on the rows' validity
// (an invalid row keeps the address of row 0 and adds nothing).
struct DeferredRed {
    float4 e[2];
    float4 o[2];
    float* dst_e;
    float* dst_o;
    bool pe;
    bool po;
};

// Issues the held reductions when `live` (predicated: no branch, so it may sit between wgmma issues).
__device__ __forceinline__ void issue_deferred(const DeferredRed& d, bool live) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        red_add_v4_f32_if(live && d.pe, d.dst_e + 32 * t, d.e[t]);
        red_add_v4_f32_if(live && d.po, d.dst_o + 32 * t, d.o[t]);
    }
}

// Receiver side of chunk k (buffer b): arms x_full[2 slot + b] for the peer's 1 KB, waits, adds the bf16 values to
// the kept f32 half and reduces 4 rows x 128 bytes per warp instruction into the rows' columns [64 slab, + 64).
// Then `release`: the peer may send chunk k + 2 into buffer b; `last` (the tile's last chunk): reports the drain
// locally (`drained`, d_qk 576, every lane); the tile's last two chunks release nothing (the next tile's permission
// does).
__device__ __forceinline__ void pair_reduce_xb(const SparseBwdParams& p, const PairLink& l,
                                               const float (&kept)[kXSlotVals], const int32_t* ridx_warp, int slab,
                                               uint32_t b, uint32_t parity, bool release, bool last,
                                               uint64_t* drained, DeferredRed* defer = nullptr) {
    const uint32_t lane = lane_id_volatile();
    const uint32_t full = l.full + 8 * b;
    if (lane == 0) mbarrier_arrive_expect_tx(full, kXbBufBytes);
    mbarrier_wait_parity(full, parity);
    const uint32_t buf = l.slot + b * kXbBufBytes + 16 * lane;
    const uint4 w0 = ld_shared_v4(buf);
    const uint4 w1 = ld_shared_v4(buf + kXbBufBytes / 2);
    // kFlagDrainFirst (accumulator beyond L2): the tile's last chunk frees the slots before its reductions, so the
    // producer's gather of the late KV slabs (which the slots alias) enters the memory pipeline ahead of them
    // instead of queueing behind their L2 misses. Each lane's arrive releases its own buffer reads.
    const bool drain_first = last && (p.flags & kFlagDrainFirst) != 0;
    if (drain_first) report_drained(drained);
    const uint32_t word[kXbWords] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
    const bool odd = (lane & 1u) != 0;
    // Step 1 (lane ^ 1): blocks A = 2m and B = 2m + 1 of the quad's row; the even lane of a pair keeps its A pair and
    // receives the partner's, the odd lane its B pair, so lane (g, q) holds v[m] = columns 16 m + c(q) .. + 3 of row
    // g, c(q) = 8 (q & 1) + 4 (q >> 1).
    float4 v[kChunkBlocks / 2];
#pragma unroll
    for (int m = 0; m < kChunkBlocks / 2; ++m) {
        const float a0 = kept[4 * m] + bf16x2_lo(word[2 * m]);
        const float a1 = kept[4 * m + 1] + bf16x2_hi(word[2 * m]);
        const float b0 = kept[4 * m + 2] + bf16x2_lo(word[2 * m + 1]);
        const float b1 = kept[4 * m + 3] + bf16x2_hi(word[2 * m + 1]);
        const float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
        const float r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
        v[m].x = odd ? r0 : a0;
        v[m].y = odd ? r1 : a1;
        v[m].z = odd ? b0 : r0;
        v[m].w = odd ? b1 : r1;
    }
    // Step 2 (lane ^ 4, quads g and g ^ 1, rows ge = g & ~1 and ge + 1): the even quad keeps m = 2t and takes the odd
    // quad's m = 2t, the odd quad keeps m = 2t + 1 and takes the even quad's m = 2t + 1 (t = 0, 1). Then one warp
    // instruction covers, for each of the 4 quad pairs, columns [32 t, 32 t + 32) of row ge (or ge + 1): 8 lanes x
    // 16 contiguous bytes, i.e. 4 rows x 128 bytes, the pattern that keeps whole lines per request when the
    // accumulator misses L2.
    const bool oq = (lane & 4u) != 0;
    const int ge = static_cast<int>(lane / 4) & ~1;
    const int r_e = ridx_warp[ge];      // < 0: invalid
    const int r_o = ridx_warp[ge + 1];
    // Invalid rows: predicated off, with the address of row 0 (no address is formed from an invalid index).
    const int64_t col = slab * kSw128ColsBf16 + 16 * static_cast<int>(oq) + 8 * (lane & 1u) + 4 * ((lane >> 1) & 1u);
    float* const dst_e = p.dkv_acc + static_cast<int64_t>(max(r_e, 0)) * p.dkv_acc_stride + col;
    float* const dst_o = p.dkv_acc + static_cast<int64_t>(max(r_o, 0)) * p.dkv_acc_stride + col;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const float4 own = oq ? v[2 * t + 1] : v[2 * t];
        const float4 give = oq ? v[2 * t] : v[2 * t + 1];
        float4 got;
        got.x = __shfl_xor_sync(0xffffffffu, give.x, 4);
        got.y = __shfl_xor_sync(0xffffffffu, give.y, 4);
        got.z = __shfl_xor_sync(0xffffffffu, give.z, 4);
        got.w = __shfl_xor_sync(0xffffffffu, give.w, 4);
        // Row ge: the even quad's own values, the odd quad's received ones; row ge + 1 the other way round.
        if (defer != nullptr) {
            defer->e[t] = oq ? got : own;
            defer->o[t] = oq ? own : got;
        } else {
            red_add_v4_f32_if(r_e >= 0, dst_e + 32 * t, oq ? got : own);
            red_add_v4_f32_if(r_o >= 0, dst_o + 32 * t, oq ? own : got);
        }
    }
    if (defer != nullptr) {
        defer->dst_e = dst_e;
        defer->dst_o = dst_o;
        defer->pe = r_e >= 0;
        defer->po = r_o >= 0;
    }
    if (release) {
        __syncwarp();  // every lane's buffer reads done: their values fed the reductions (as in pair_reduce)
        if (lane == 0) mbarrier_arrive_remote_relaxed(l.empty + 8 * b + l.peer_delta);
    } else if (last && !drain_first) {
        report_drained(drained);  // every lane
    }
}

// Solo mode (one head group): reduces a 64 x 64 f32 chunk through this warp's slot, one 32-column half at a
// time: the warp writes its 16 rows x 32 columns in fragment order, then reads them back in row order for
// row-contiguous reductions (reduce_slot_rows). Only this warp touches the slot. After the tile's last chunk every
// lane reports the drain (`drained`, d_qk 576, where the slots alias KV slabs 7-8).
template <bool kDet>
__device__ __forceinline__ void solo_reduce(const SparseBwdParams& p, uint32_t slot, const float (&acc)[kChunkRegs],
                                            const int32_t* ridx_warp, int slab, bool last, uint64_t* drained) {
    const uint32_t lane = lane_id_volatile();
    const uint32_t fb = pair_frag_base(slot, lane);
#pragma unroll
    for (int h = 0; h < kPairCtas; ++h) {
        __syncwarp();  // the previous half's (or chunk's) row reads of the slot are done
#pragma unroll
        for (int jj = 0; jj < kChunkBlocks / 2; ++jj) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int i0 = 4 * (jj + 4 * h) + 2 * rr;
                st_shared_v2_f32(pair_frag_addr(fb, jj, rr), acc[i0], acc[i0 + 1]);
            }
        }
        __syncwarp();
        reduce_slot_rows<kDet>(p, slot, lane, ridx_warp, slab * kSw128ColsBf16 + kXSlotCols * h);
    }
    if (last) report_drained(drained);  // every lane, after its own slot reads
}

// ---------------------------------------------------------------------------------------------------------------
// The consumer's phases. Per tile, each consumer warpgroup runs
//   mma_s_or_dp    S = Q K^T (c = 0) or dP = dO V^T (c = 1), waiting for each KV slab of the tile as it lands
//   handoff        P and dS' of the tile into the bf16 P and dS tiles, half of the elements from each consumer
//   mma_dq         dQ[:, own slabs] += dS' K (the bf16 exchange issues its first dKV chunk right behind it)
//   release_tile   the KV tile back to the producer (kv_empty); pair mode: the peer may send this tile's chunks
//   dkv_solo, dkv_pair_f32, dkv_pair_xb   the dKV chunks it owns, reduced into dkv_acc (one per reduction strategy)
// and after the last tile store_dq (the epilogue). Everything is inlined into one instruction stream per consumer.

// Compile-time role of consumer kCw in one kernel variant: the dQ slabs and dKV chunks it owns.
template <int kDqk_, int kCw_, bool kDet_, bool kPair_, bool kXBf16_>
struct ConsumerRole {
    static constexpr int kDqk = kDqk_;
    static constexpr int kCw = kCw_;
    static constexpr bool kDet = kDet_;
    static constexpr bool kPair = kPair_;
    static constexpr bool kXBf16 = kXBf16_;
    using C = Config<kDqk>;
    static constexpr int kDqSlab0 = kCw == 0 ? 0 : C::kDqSlabs0;
    static constexpr int kDqSlabs = kCw == 0 ? C::kDqSlabs0 : C::kDqSlabs1;
    static_assert(kDqSlabs == 4 || kDqSlabs == 5, "dQ slices are 4 or 5 slabs");
    // dKV chunks (slabs) of this consumer: odd slabs for c = 0, even for c = 1 (dkv_chunk_owner).
    static constexpr int kFirstChunk = kCw == 0 ? 1 : 0;
    static constexpr int kChunks = (C::kDqkSlabs - kFirstChunk + 1) / 2;
    static constexpr int kVChunks = (C::kDvSlabs - kFirstChunk + 1) / 2;  // chunks with a dO term (the rest: RoPE)
    static_assert(kChunks - kVChunks <= 1, "at most the RoPE slab lacks the dO term");
    static_assert(dkv_chunk_owner(kFirstChunk) == kCw, "chunk ownership");
    // Bf16 exchange: the first dKV chunk's MMAs queue right behind dQ (mma_dq).
    static constexpr bool kChunk0WithDq = kPair && kXBf16;
    // kFlagDeferLastReduce (bf16 exchange) may hold the last chunk's reductions over to the next tile (kDeferSlab).
    // Consumer 0 at d_qk 576 holds 160 dQ registers: its held values would spill (measured: 322 bytes), so it reduces
    // its last chunk right away.
    static constexpr bool kMayDefer = kPair && kXBf16 && (kCw == 1 || kDqk == 512);
};

// A consumer thread's place for the whole token: its accumulator fragment and the operand tiles' addresses. The
// phases take it, RowStats and ConsumerTile by value: copies are values the compiler reasons about as it did about
// the locals of one function (through references, the same phase bodies compiled to other instructions).
struct ConsumerThread {
    int t;        // 0..127 in this warpgroup
    int lane;
    int warp;     // 0..3 in this warpgroup: accumulator rows [16 warp, 16 warp + 16)
    AccFrag f;
    int rows[2];  // the two accumulator rows this thread owns: heads (S, dP, dQ) and tile rows (dKV) alike
    uint32_t q_addr;
    uint32_t do_addr;
    uint32_t kv_addr;
    uint32_t p_addr;
    uint32_t ds_addr;
};

template <int kDqk, int kCw>
__device__ __forceinline__ ConsumerThread consumer_thread(SmemPlan<kDqk>& sm) {
    ConsumerThread th;
    th.t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * (1 + kCw);
    th.lane = th.t % 32;
    th.warp = th.t / 32;
    th.f = AccFrag::of_thread(th.t);
    th.rows[0] = th.f.row0;
    th.rows[1] = th.f.row1();
    th.q_addr = smem_addr(sm.q);
    th.do_addr = smem_addr(sm.d_out);
    th.kv_addr = smem_addr(sm.kv);
    th.p_addr = smem_addr(sm.p);
    th.ds_addr = smem_addr(sm.ds);
    return th;
}

// Per-row statistics of this thread's two rows. Padding heads (>= h_q) get lse2' = +inf, so P = dS = 0 on their
// rows; consumer 1 computes delta of its rows (and writes the `delta` output), consumer 0 does not need it.
struct RowStats {
    float lse2[2];
    float delta[2];
};

template <int kDqk, int kCw>
__device__ __forceinline__ RowStats row_stats(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w,
                                              const ConsumerThread th) {
    RowStats st;
    st.delta[0] = 0.f;
    st.delta[1] = 0.f;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int64_t head = w.head0 + th.rows[rr];
        const int64_t tok = w.token;
        if (th.rows[rr] < w.heads) {
            const float lse = __ldg(p.lse + tok * p.lse_stride_t + head * p.lse_stride_h);
            const float* sink = p.attn_sink != nullptr ? p.attn_sink + head * p.attn_sink_stride : nullptr;
            st.lse2[rr] = lse2_with_sink(lse, sink);
        } else {
            st.lse2[rr] = kInf;
        }
    }
    if constexpr (kCw == 1) fused_delta<kDqk>(p, sm, w, th.warp, th.lane, st.delta);
    return st;
}

// One tile of the consumer's loop.
struct ConsumerTile {
    int i;                // tile index
    int n_tiles;          // tiles of the token
    Ring pos;             // phase of the tile's barriers
    const int32_t* ridx;  // row_idx[i & 1]: KV row of each tile row, -1 when invalid
};

template <int kDqk>
__device__ __forceinline__ ConsumerTile consumer_tile(SmemPlan<kDqk>& sm, const CtaWork& w, int i) {
    ConsumerTile tile;
    tile.i = i;
    tile.n_tiles = w.n_tiles;
    tile.pos = Ring::of(i);
    tile.ridx = sm.row_idx[i & 1];
    return tile;
}

// kFlagDeferLastReduce (bf16 exchange): the reductions of a tile's last chunk wait in registers and are issued during
// the next tile's S / dP, right before the wait for slab kDeferSlab (at d_qk 576 the first late slab, whose gather
// follows the drain), instead of stalling this consumer between the chunk phase and the next S / dP.
inline constexpr int kDeferSlab = 7;

// ---- S / dP. Consumer 0: S = Q K^T, consumer 1: dP = dO V^T, each over all 64 tile rows (m64n64: every operand
// byte read from shared memory feeds twice the MMA work of the m64n32 halves), slab by slab as the gather lands: the
// wait for the tile is one kv_full[slab] wait per slab (the producer fenced each slab before its barrier completed),
// so S / dP of the first slabs overlaps the gather of the last ones. Fragment (row h, column n) of either accumulator
// is head h, tile row n, so both consumers' threads hold the same elements.
template <class R>
__device__ __forceinline__ void mma_s_or_dp(SmemPlan<R::kDqk>& sm, const ConsumerThread th, const ConsumerTile tile,
                                            DeferredRed& dr, bool& dr_live, float (&sd)[kSdRegs]) {
    using C = typename R::C;
    constexpr int kSlabs = R::kCw == 0 ? C::kDqkSlabs : C::kDvSlabs;
    const uint64_t desc_a = make_wgmma_desc_sw128(R::kCw == 0 ? th.q_addr : th.do_addr, kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_k = make_wgmma_desc_sw128(th.kv_addr, kUnusedLbo, kSw128AtomBytes);  // all 64 tile rows
#pragma unroll
    for (int slab = 0; slab < kSlabs; ++slab) {
        if constexpr (R::kMayDefer) {
            if (slab == kDeferSlab) {
                issue_deferred(dr, dr_live);
                dr_live = false;
            }
        }
        MBarrier::wait(&sm.kv_full[slab], tile.pos.full_parity);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C::kStepsPerSlab; ++kk) {
            // d columns [64 slab + 16 kk, +16): 32-byte step kk inside the slab's 128-byte rows.
            const uint32_t off = slab * C::kSlabBytes + kk * 32;
            wgmma_m64n64k16_ss_kk(sd, wgmma_desc_advance(desc_a, off), wgmma_desc_advance(desc_k, off),
                                   slab > 0 || kk > 0);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(sd);
}

// This thread's bf16x2 of n8 block j, row half rr in the P / dS tiles (SW128, 128-byte rows): row r = rows[rr], chunk
// j ^ (r % 8) = j ^ g, byte 4 q, i.e. byte offset base(rr) ^ (j << 4) with base(rr) = 128 r + 16 g + 4 q (bits 4-6
// hold only g). Built from a volatile read of the lane, so the compiler does not hoist 16 offsets out of the tile
// loop into registers.
struct PdsFrag {
    uint32_t p_addr;
    uint32_t ds_addr;
    uint32_t base0;  // base(0)

    static __device__ __forceinline__ PdsFrag of(const ConsumerThread th) {
        const uint32_t lane_v = lane_id_volatile();
        PdsFrag pf;
        pf.p_addr = th.p_addr;
        pf.ds_addr = th.ds_addr;
        pf.base0 = static_cast<uint32_t>(th.rows[0]) * kSw128RowBytes + ((lane_v / 4) << 4) + 4 * (lane_v % 4);
        return pf;
    }
    __device__ __forceinline__ uint32_t off(int j, int rr) const {
        return (base0 + rr * 8 * kSw128RowBytes) ^ (static_cast<uint32_t>(j) << 4);
    }
    // The other consumer's published values of block j: v[2 rr + e] is element e of row half rr.
    __device__ __forceinline__ void load(int j, float (&v)[4]) const {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            v[2 * rr] = __uint_as_float(ld_shared_u32(p_addr + off(j, rr)));
            v[2 * rr + 1] = __uint_as_float(ld_shared_u32(ds_addr + off(j, rr)));
        }
    }
};
inline constexpr int kHalfBlocks = kSdBlocks / 2;

// Finishes block j into the bf16 P and dS tiles from this consumer's values `own` and the other's `v`: consumer 1
// receives P (its dP in `own`), consumer 0 dP - delta (its P in `own`).
template <int kCw>
__device__ __forceinline__ void finish_block(const SparseBwdParams& p, const PdsFrag pf, const float (&own)[kSdRegs],
                                             const float (&delta)[2], int j, const float (&v)[4]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float p0, p1, d0, d1;
        if constexpr (kCw == 1) {
            p0 = v[2 * rr];
            p1 = v[2 * rr + 1];
            d0 = own[4 * j + 2 * rr] - delta[rr];
            d1 = own[4 * j + 2 * rr + 1] - delta[rr];
        } else {
            p0 = own[4 * j + 2 * rr];
            p1 = own[4 * j + 2 * rr + 1];
            d0 = v[2 * rr];
            d1 = v[2 * rr + 1];
        }
        const uint32_t off = pf.off(j, rr);
        st_shared_u32(pf.p_addr + off, pack_bf16x2(p0, p1));
        st_shared_u32(pf.ds_addr + off, pack_bf16x2(p.sm_scale * p0 * d0, p.sm_scale * p1 * d1));
    }
}

// Finishes blocks [j0, j0 + 4), each block's values loaded one block ahead so that their latency hides.
template <int kCw>
__device__ __forceinline__ void finish_half(const SparseBwdParams& p, const PdsFrag pf, const float (&own)[kSdRegs],
                                            const float (&delta)[2], int j0) {
    float nx[4];
    pf.load(j0, nx);
#pragma unroll
    for (int j = j0; j < j0 + kHalfBlocks; ++j) {
        const float cur[4] = {nx[0], nx[1], nx[2], nx[3]};
        if (j + 1 < j0 + kHalfBlocks) pf.load(j + 1, nx);
        finish_block<kCw>(p, pf, own, delta, j, cur);
    }
}

// ---- The hand-off: P = exp2(S sm_scale log2e - lse2') and dS' = sm_scale P (dP - delta) into the P and dS tiles
// (bf16: the dKV and dQ operands), split by n8 blocks between the consumers so that both finish at once. Consumer 0
// turns its S into P in registers first (all 8 blocks: its exp2s run while it would wait for consumer 1, whose chunk
// phase is the longer one); consumer 1 publishes dP - delta of blocks [0, 4) as soon as its dP retired, consumer 0
// then publishes P of blocks [4, 8); each finishes its half from its own registers and the other's values, with no
// exp2 left after the rendezvous. A pair (element 0, element 1) of a block travels as two f32, element 0 at the
// pair's P-tile position and element 1 at its dS-tile position (PdsFrag::off): each thread reads and writes only its own fragment positions, which are the same in both consumers, and nothing is
// rounded before P and dS'. Column n of S is tile row n; invalid rows (bad index, tail) get P = 0, so nothing from a
// zero-filled row (or an inf/NaN logit) leaks.
// The two signals between the consumers' stores are rendezvous that both execute (bar.sync on both sides, which
// compute-sanitizer racecheck models; it does not model a barrier.arrive before its barrier.sync): HandoffStart
// (consumer 1 stored dP - delta, consumer 0 holds P) and HalvesStored. Each consumer reaches them when it would wait
// anyway. DsReady ends the phase: both halves stored and fenced for the dQ / dKV wgmma.
template <class R>
__device__ __forceinline__ void handoff(const SparseBwdParams& p, SmemPlan<R::kDqk>& sm, const ConsumerThread th,
                                        const RowStats st, const ConsumerTile tile, const float (&sd)[kSdRegs]) {
    const PdsFrag pf = PdsFrag::of(th);
    if constexpr (R::kCw == 1) {
        // Consumer 0's dKV(i - 1) products (readers of both tiles) retired: it arrived at the end of its chunk
        // phase. Our own retired in program order.
        if (tile.i > 0) MBarrier::wait(&sm.pds_free, static_cast<uint32_t>((tile.i - 1) & 1));
#pragma unroll
        for (int j = 0; j < kHalfBlocks; ++j) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t off = pf.off(j, rr);
                st_shared_u32(pf.p_addr + off, __float_as_uint(sd[4 * j + 2 * rr] - st.delta[rr]));
                st_shared_u32(pf.ds_addr + off, __float_as_uint(sd[4 * j + 2 * rr + 1] - st.delta[rr]));
            }
        }
        named_barrier_sync_unaligned(Bar::HandoffStart, kConsumerThreads);
        named_barrier_sync_unaligned(Bar::HalvesStored, kConsumerThreads);
        finish_half<1>(p, pf, sd, st.delta, kHalfBlocks);
    } else {
        // P (0 on invalid rows) into registers of its own: S is a wgmma accumulator, and writing it under a
        // condition makes the compiler serialise every wgmma of the kernel.
        float pv[kSdRegs];
        uint32_t p_bits = 0;
#pragma unroll
        for (int j = 0; j < kSdBlocks; ++j) {
            const int2 rid = *reinterpret_cast<const int2*>(tile.ridx + th.f.col(j));
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float e0 = exp2f(fmaf(sd[4 * j + 2 * rr], p.sm_scale_log2, -st.lse2[rr]));
                const float e1 = exp2f(fmaf(sd[4 * j + 2 * rr + 1], p.sm_scale_log2, -st.lse2[rr]));
                pv[4 * j + 2 * rr] = rid.x >= 0 ? e0 : 0.f;
                pv[4 * j + 2 * rr + 1] = rid.y >= 0 ? e1 : 0.f;
                p_bits |= __float_as_uint(pv[4 * j + 2 * rr]) | __float_as_uint(pv[4 * j + 2 * rr + 1]);
            }
        }
        // A store of a value that depends on every P, ahead of the rendezvous (which no shared-memory store
        // crosses): otherwise the scheduler sinks the exp2s below it, next to their uses. Never read.
        st_shared_u32(smem_addr(&sm.p_order_sink[th.t]), p_bits);
        // Consumer 1 stored its half, which also means that its dKV(i - 1) products retired.
        named_barrier_sync_unaligned(Bar::HandoffStart, kConsumerThreads);
#pragma unroll
        for (int j = kHalfBlocks; j < kSdBlocks; ++j) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t off = pf.off(j, rr);
                st_shared_u32(pf.p_addr + off, __float_as_uint(pv[4 * j + 2 * rr]));
                st_shared_u32(pf.ds_addr + off, __float_as_uint(pv[4 * j + 2 * rr + 1]));
            }
        }
        named_barrier_sync_unaligned(Bar::HalvesStored, kConsumerThreads);
        finish_half<0>(p, pf, pv, st.delta, 0);
    }
    fence_proxy_async_shared();  // P, dS': generic stores -> dQ / dKV wgmma reads (async proxy)
    named_barrier_sync_unaligned(Bar::DsReady, kConsumerThreads);
}

// Issues the MMAs of dKV chunk `slab` into `acc` and commits them (not waited for): dKV[:, slab] = dS'^T Q[:, slab]
// (+ P^T dO[:, slab] when kWithDo; the RoPE slab has no dO term). K = 64 heads; A is the transpose of the stored
// [head][row] tiles, B the stored [head][d] slabs: both MN-major.
template <int kDqk, bool kWithDo>
__device__ __forceinline__ void issue_dkv_chunk(const ConsumerThread th, float (&acc)[kChunkRegs], int slab) {
    using C = Config<kDqk>;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadsPerCta / 16; ++ks) {
        const uint64_t desc_a = make_wgmma_desc_sw128(th.ds_addr + ks * kKStepMnBytes, C::kSlabBytes, kSw128AtomBytes);
        const uint64_t desc_b = make_wgmma_desc_sw128(th.q_addr + slab * C::kSlabBytes + ks * kKStepMnBytes,
                                                      C::kSlabBytes, kSw128AtomBytes);
        wgmma_m64n64k16_ss_mnmn(acc, desc_a, desc_b, ks > 0);
    }
    if constexpr (kWithDo) {
#pragma unroll
        for (int ks = 0; ks < kHeadsPerCta / 16; ++ks) {
            const uint64_t desc_a = make_wgmma_desc_sw128(th.p_addr + ks * kKStepMnBytes, C::kSlabBytes,
                                                          kSw128AtomBytes);
            const uint64_t desc_b = make_wgmma_desc_sw128(th.do_addr + slab * C::kSlabBytes + ks * kKStepMnBytes,
                                                          C::kSlabBytes, kSw128AtomBytes);
            wgmma_m64n64k16_ss_mnmn(acc, desc_a, desc_b, true);
        }
    }
    wgmma_commit();
}

// Waits for the chunk's MMAs (the only ones in flight).
__device__ __forceinline__ void retire_dkv_chunk(float (&acc)[kChunkRegs]) {
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
}

// ---- dQ[:, own slabs] += dS' K over all 64 tile rows, A from the dS tile (K-major, +32 bytes per 16-row k-step), K
// read MN-major (LBO = next slab). Bf16 exchange: the first dKV chunk's MMAs queue right behind dQ (they read Q, dO, P
// and dS', not the KV tile), so the tensor cores have them when dQ retires; wait<1> waits for dQ alone.
template <class R>
__device__ __forceinline__ void mma_dq(const ConsumerThread th, DqAcc<R::kDqSlabs>& dq, float (&acc)[kChunkRegs]) {
    using C = typename R::C;
    const uint32_t k_slab0 = th.kv_addr + R::kDqSlab0 * C::kSlabBytes;
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kSteps; ++kb) {
        const int row0 = kb * 16;
        const uint64_t desc_b = make_wgmma_desc_sw128(k_slab0 + row0 * kSw128RowBytes, C::kSlabBytes,
                                                      kSw128AtomBytes);
        const uint64_t desc_a = make_wgmma_desc_sw128(th.ds_addr + row0 * 2, kUnusedLbo, kSw128AtomBytes);
        wgmma_m64n256k16_ss_kmn(dq.a, desc_a, desc_b, true);
        if constexpr (R::kDqSlabs == 5) {
            wgmma_m64n64k16_ss_kmn(dq.b, desc_a, wgmma_desc_advance(desc_b, kN256Slabs * C::kSlabBytes), true);
        }
    }
    wgmma_commit();
    if constexpr (R::kChunk0WithDq) {
        issue_dkv_chunk<R::kDqk, true>(th, acc, R::kFirstChunk);
        wgmma_wait<1>();
    } else {
        wgmma_wait<0>();
    }
    wgmma_fence_regs(dq.a);
    if constexpr (R::kDqSlabs == 5) wgmma_fence_regs(dq.b);
}

// ---- Release of the KV tile (S, dP, dQ of this thread retired): every consumer thread arrives, so that each lane's
// earlier shared-memory reads (e.g. the previous tile's row_idx, which the producer rewrites for tile i + 1 after
// this phase) are ordered before the producer's writes in racecheck's view too (see report_drained).
// Pair mode: then allow the peer to send this tile's first chunk into our slot. When the slots alias KV slabs (d_qk
// 576) that needs both consumers' KV readers of this tile retired: kv_empty's phase i. Bf16 exchange: both buffers of
// the slot (chunks 0 and 1).
template <class R>
__device__ __forceinline__ void release_tile(SmemPlan<R::kDqk>& sm, const ConsumerThread th,
                                             const ConsumerTile tile) {
    MBarrier::arrive(&sm.kv_empty);
    if constexpr (R::kPair) {
        const PairLink l = pair_link<R::kDqk, R::kXBf16>(sm, R::kCw, th.warp);
        if constexpr (R::C::kXbufInKv) MBarrier::wait(&sm.kv_empty, tile.pos.full_parity);
        __syncwarp();
        if (th.lane == 0) {
            mbarrier_arrive_remote_relaxed(l.empty + l.peer_delta);
            if constexpr (R::kXBf16) mbarrier_arrive_remote_relaxed(l.empty + 8 + l.peer_delta);
        }
    }
}

// Consumer 0's last dKV product of this tile retired: consumer 1 may write the next tile's dP - delta into the P / dS
// tiles (pds_free; consumer 1's own products retire in its program order).
template <int kCw, int kDqk>
__device__ __forceinline__ void release_pds(SmemPlan<kDqk>& sm, const ConsumerTile tile) {
    if constexpr (kCw == 0) {
        if (tile.i + 1 < tile.n_tiles) MBarrier::arrive(&sm.pds_free);
    }
}

// ---- dKV, one function per reduction strategy. Each computes the chunks this consumer owns, dKV[:, slab s] =
// dS'^T Q[:, s] + P^T dO[:, s] (issue_dkv_chunk), and reduces each 64 x 64 f32 chunk into the accumulator rows
// tile.ridx[0..64) (valid rows only; invalid rows form no address and write nothing):
//   f32 (default): reductions of 16 bytes (4 consecutive columns of one row).
//   kDet:          each value -> signed 64-bit fixed point (2^-32 units) and red.global.add.u64: integer adds
//                  commute, so the sum is the same bits in any order.
// The V chunks (with the dO term) run in a rolled loop (code size); the RoPE chunk (slab 8, d_qk 576, consumer 1)
// comes after it with its own straight-line code, so no branch ever sits between MMAs on one accumulator. `k` counts
// this consumer's chunks in the tile; chunk k is slab kFirstChunk + 2 k.

// Solo mode: each chunk is staged through this warp's own slot (no exchange). At d_qk 576 the slots alias KV slabs
// 7-8, free only once both consumers' KV readers of this tile retired (kv_empty's phase i).
template <class R>
__device__ __forceinline__ void dkv_solo(const SparseBwdParams& p, SmemPlan<R::kDqk>& sm, const ConsumerThread th,
                                         const ConsumerTile tile, float (&acc)[kChunkRegs]) {
    using C = typename R::C;
    constexpr int kFirstChunk = R::kFirstChunk;
    constexpr int kChunks = R::kChunks;
    constexpr int kVChunks = R::kVChunks;
    if constexpr (C::kXbufInKv) MBarrier::wait(&sm.kv_empty, tile.pos.full_parity);
    const uint32_t slot = smem_addr(sm.xbuf_base()) + (kConsumerWarps / kConsumers * R::kCw + th.warp) * kXSlotBytes;
    uint64_t* const drained = C::kXbufInKv ? &sm.x_drained : nullptr;
    const int32_t* const ridx_warp = tile.ridx + kXSlotRows * th.warp;
#pragma unroll 1
    for (int k = 0; k < kVChunks; ++k) {
        issue_dkv_chunk<R::kDqk, true>(th, acc, kFirstChunk + 2 * k);
        retire_dkv_chunk(acc);
        solo_reduce<R::kDet>(p, slot, acc, ridx_warp, kFirstChunk + 2 * k, k + 1 == kChunks, drained);
    }
    if constexpr (kVChunks < kChunks) {
        issue_dkv_chunk<R::kDqk, false>(th, acc, kFirstChunk + 2 * kVChunks);
        retire_dkv_chunk(acc);
        solo_reduce<R::kDet>(p, slot, acc, ridx_warp, kFirstChunk + 2 * kVChunks, true, drained);
    }
    release_pds<R::kCw>(sm, tile);
}

// Pair mode, f32 exchange: a software pipeline over the chunks, the exchange and reduction of chunk k - 1 run while
// the tensor cores compute chunk k. Round n = i * kChunks + k of every slot barrier is chunk k of tile i.
template <class R>
__device__ __forceinline__ void dkv_pair_f32(const SparseBwdParams& p, SmemPlan<R::kDqk>& sm,
                                             const ConsumerThread th, const ConsumerTile tile,
                                             float (&acc)[kChunkRegs]) {
    using C = typename R::C;
    constexpr int kFirstChunk = R::kFirstChunk;
    constexpr int kChunks = R::kChunks;
    constexpr int kVChunks = R::kVChunks;
    constexpr int kCw = R::kCw;
    const int warp = th.warp;
    float kept[kXSlotVals];
    const uint32_t round0 = static_cast<uint32_t>(tile.i * kChunks);
    uint64_t* const drained = C::kXbufInKv ? &sm.x_drained : nullptr;
    const int32_t* const ridx_warp = tile.ridx + kXSlotRows * warp;
    issue_dkv_chunk<R::kDqk, true>(th, acc, kFirstChunk);
    retire_dkv_chunk(acc);
    pair_send(pair_link(sm, kCw, warp), acc, round0 & 1u, kept);
#pragma unroll 1
    for (int k = 1; k < kVChunks; ++k) {
        issue_dkv_chunk<R::kDqk, true>(th, acc, kFirstChunk + 2 * k);
        pair_reduce<R::kDet>(p, pair_link(sm, kCw, warp), kept, ridx_warp, kFirstChunk + 2 * (k - 1),
                             (round0 + k - 1) & 1u, false, drained);
        retire_dkv_chunk(acc);
        pair_send(pair_link(sm, kCw, warp), acc, (round0 + k) & 1u, kept);
    }
    if constexpr (kVChunks < kChunks) {
        issue_dkv_chunk<R::kDqk, false>(th, acc, kFirstChunk + 2 * kVChunks);
        pair_reduce<R::kDet>(p, pair_link(sm, kCw, warp), kept, ridx_warp, kFirstChunk + 2 * (kVChunks - 1),
                             (round0 + kVChunks - 1) & 1u, false, drained);
        retire_dkv_chunk(acc);
        pair_send(pair_link(sm, kCw, warp), acc, (round0 + kVChunks) & 1u, kept);
    }
    release_pds<kCw>(sm, tile);
    pair_reduce<R::kDet>(p, pair_link(sm, kCw, warp), kept, ridx_warp, kFirstChunk + 2 * (kChunks - 1),
                         (round0 + kChunks - 1) & 1u, true, drained);
}

// Pair mode, bf16 exchange: as dkv_pair_f32, chunk k using buffer k & 1 of the slot; buffer b serves `uses` chunks
// per tile. Chunk k releases its buffer for chunk k + 2 of the same tile; the last two chunks release nothing. Chunk
// 0 was issued with dQ (mma_dq). With `defer_last` the reductions of the last chunk are left in `dr` (dr_live).
template <class R>
__device__ __forceinline__ void dkv_pair_xb(const SparseBwdParams& p, SmemPlan<R::kDqk>& sm, const ConsumerThread th,
                                            const ConsumerTile tile, float (&acc)[kChunkRegs], bool defer_last,
                                            DeferredRed& dr, bool& dr_live) {
    using C = typename R::C;
    constexpr int kDqk = R::kDqk;
    constexpr int kFirstChunk = R::kFirstChunk;
    constexpr int kChunks = R::kChunks;
    constexpr int kVChunks = R::kVChunks;
    constexpr int kCw = R::kCw;
    static_assert(R::kChunk0WithDq, "chunk 0 is issued behind dQ");
    static_assert(kChunks >= 2, "both buffers are used in every tile");
    constexpr int kUses0 = (kChunks + 1) / 2;
    constexpr int kUses1 = kChunks / 2;
    const int i = tile.i;
    const int warp = th.warp;
    float kept[kXSlotVals];
    uint64_t* const drained = C::kXbufInKv ? &sm.x_drained : nullptr;
    const int32_t* const ridx_warp = tile.ridx + kXSlotRows * warp;
    auto parity = [&](int k) { return xb_parity_of((k & 1) ? kUses1 : kUses0, i, k); };
    auto reduce = [&](int k, DeferredRed* defer) {
        pair_reduce_xb(p, pair_link<kDqk, true>(sm, kCw, warp), kept, ridx_warp, kFirstChunk + 2 * k,
                       static_cast<uint32_t>(k & 1), parity(k), k + 2 < kChunks, k + 1 == kChunks, drained, defer);
    };
    auto send = [&](int k) {
        pair_send_xb(pair_link<kDqk, true>(sm, kCw, warp), acc, static_cast<uint32_t>(k & 1), parity(k));
    };
    // Chunk k: its MMAs, then (d_qk 576) its half to the peer, then the reduction of chunk k - 1, whose peer half
    // was sent one chunk earlier and has had a whole chunk's time to arrive; then the kept half of chunk k. The
    // tensor cores run the other consumer's chunk meanwhile. At d_qk 512 the reduction of chunk k - 1 runs under
    // chunk k's MMAs instead (measured faster there: docs/sparse-bwd.md, v9.2).
    constexpr bool kEarlyReduce = kDqk == 512;
    auto step = [&](auto with_do, int k) {
        issue_dkv_chunk<kDqk, decltype(with_do)::value>(th, acc, kFirstChunk + 2 * k);
        if constexpr (kEarlyReduce) {
            if (k > 0) reduce(k - 1, nullptr);
            retire_dkv_chunk(acc);
            send(k);
        } else {
            retire_dkv_chunk(acc);
            send(k);
            if (k > 0) reduce(k - 1, nullptr);
        }
        keep_xb(acc, kept);
    };
    retire_dkv_chunk(acc);
    send(0);
    keep_xb(acc, kept);
#pragma unroll 1
    for (int k = 1; k < kVChunks; ++k) step(std::true_type{}, k);
    if constexpr (kVChunks < kChunks) step(std::false_type{}, kVChunks);
    release_pds<kCw>(sm, tile);
    if (defer_last) {
        reduce(kChunks - 1, &dr);
        dr_live = true;
    } else {
        reduce(kChunks - 1, nullptr);
    }
}

// ---- Epilogue: dQ (sm_scale already folded into dS') -> bf16 tile in the Q region, row-major with the chunk swizzle
// chunk ^ (row % 8) (conflict-free fragment writes and row-chunk reads), then 16-byte stores of the group's real
// heads.
template <class R>
__device__ __forceinline__ void store_dq(const SparseBwdParams& p, const ConsumerThread th, const CtaWork& w,
                                         const DqAcc<R::kDqSlabs>& dq) {
    using C = typename R::C;
    constexpr int kDqSlab0 = R::kDqSlab0;
    const uint32_t q_addr = th.q_addr;
    // The fragment derived from t here, not read from th.f: then the compiler sees that col (below) is not negative
    // (t % 4 > -4) and divides it by a shift.
    const AccFrag f = AccFrag::of_thread(th.t);
    const int rows[2] = {f.row0, f.row1()};
    named_barrier_sync_unaligned(Bar::MmaDone, kConsumerThreads);  // every wgmma read of Q (dKV) of both consumers retired
#pragma unroll
    for (int j = 0; j < 128 / 4; ++j) {
        const int col = kDqSlab0 * kSw128ColsBf16 + f.col(j);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const uint32_t addr = q_addr + rows[rr] * C::kStagingRowBytes +
                                  (((col / 8) ^ (rows[rr] % kSw128AtomRows)) * kSw128ChunkBytes) + 4 * f.quad;
            st_shared_u32(addr, pack_bf16x2(dq.a[4 * j + 2 * rr], dq.a[4 * j + 2 * rr + 1]));
        }
    }
    if constexpr (R::kDqSlabs == 5) {
#pragma unroll
        for (int j = 0; j < 32 / 4; ++j) {
            const int col = (kDqSlab0 + kN256Slabs) * kSw128ColsBf16 + f.col(j);
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t addr = q_addr + rows[rr] * C::kStagingRowBytes +
                                      (((col / 8) ^ (rows[rr] % kSw128AtomRows)) * kSw128ChunkBytes) +
                                      4 * f.quad;
                st_shared_u32(addr, pack_bf16x2(dq.b[4 * j + 2 * rr], dq.b[4 * j + 2 * rr + 1]));
            }
        }
    }
    named_barrier_sync_unaligned(Bar::StagingReady, kConsumerThreads);

    const int ct = static_cast<int>(threadIdx.x) - kWarpgroupThreads;  // 0..255 over both consumers
    const bool vec16 = (p.flags & kFlagDqVec16) != 0;
    uint16_t* d_q_tok = p.d_q + static_cast<int64_t>(w.token) * p.d_q_stride_t;
    constexpr int kChunksDq = kHeadsPerCta * C::kStagingChunksPerRow;
#pragma unroll 4
    for (int id = ct; id < kChunksDq; id += kConsumerThreads) {
        const int row = id / C::kStagingChunksPerRow;
        const int chunk = id % C::kStagingChunksPerRow;
        if (row < w.heads) {
            const uint4 v = ld_shared_v4(q_addr + row * C::kStagingRowBytes +
                                         ((chunk ^ (row % kSw128AtomRows)) * kSw128ChunkBytes));
            uint16_t* dst_q = d_q_tok + static_cast<int64_t>(w.head0 + row) * p.d_q_stride_h + chunk * 8;
            if (vec16) {
                store_bf16x8<true>(dst_q, v);
            } else {
                store_bf16x8<false>(dst_q, v);
            }
        }
    }
}

// A consumer warpgroup (kCw = 0 or 1): the tile loop, one call per phase.
template <int kDqk, int kCw, bool kDet, bool kPair, bool kXBf16>
__device__ __forceinline__ void consumer(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using R = ConsumerRole<kDqk, kCw, kDet, kPair, kXBf16>;
    const ConsumerThread th = consumer_thread<kDqk, kCw>(sm);
    const RowStats st = row_stats<kDqk, kCw>(p, sm, w, th);
    DqAcc<R::kDqSlabs> dq;
    dq.zero();
    // Q and dO landed and were fenced for the async proxy by the producer.
    if (w.n_tiles > 0) MBarrier::wait(&sm.qdo_full, 0);
    const bool defer_last = R::kMayDefer && (p.flags & kFlagDeferLastReduce) != 0;
    DeferredRed dr;  // the last chunk's reductions held over to the next tile, when dr_live
    dr.e[0] = dr.e[1] = dr.o[0] = dr.o[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    dr.dst_e = dr.dst_o = p.dkv_acc;
    dr.pe = dr.po = false;
    bool dr_live = false;

    for (int i = 0; i < w.n_tiles; ++i) {
        const ConsumerTile tile = consumer_tile(sm, w, i);
        float sd[kSdRegs];  // S (consumer 0) or dP (consumer 1)
        mma_s_or_dp<R>(sm, th, tile, dr, dr_live, sd);  // waits for each KV slab of the tile as it lands
        handoff<R>(p, sm, th, st, tile, sd);
        float acc[kChunkRegs];  // one dKV chunk (64 tile rows x 64 columns)
        mma_dq<R>(th, dq, acc);
        release_tile<R>(sm, th, tile);
        if constexpr (kPair && kXBf16) {
            dkv_pair_xb<R>(p, sm, th, tile, acc, defer_last, dr, dr_live);
        } else if constexpr (kPair) {
            dkv_pair_f32<R>(p, sm, th, tile, acc);
        } else {
            dkv_solo<R>(p, sm, th, tile, acc);
        }
    }
    // The last tile's held reductions (nothing follows to hide them under).
    if constexpr (R::kMayDefer) issue_deferred(dr, dr_live);
    store_dq<R>(p, th, w, dq);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by sparse_bwd.cu per d_qk, f32 or fixed-point d_kv reduction, solo or pair mode).
// `smem` is the dynamic shared memory. Pair mode must be launched as clusters of 2 CTAs along x with
// num_head_groups == 2, so that cluster rank == head group.
template <int kDqk, bool kDet, bool kPair, bool kXBf16 = false>
__device__ __forceinline__ void sparse_bwd_main(const SparseBwdParams& p, uint8_t* smem) {
    static_assert(!kXBf16 || (kPair && !kDet), "the bf16 exchange is a pair-mode, f32-reduction variant");
    // Uniform over a cluster: the grid is exactly s_q * num_head_groups and a cluster is one token.
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.s_q) * p.num_head_groups) return;
    if (kPair && p.num_head_groups != kPairCtas) __trap();  // launched for the wrong head count
    // Round the plan's base up to 1024 bytes (SW128 operand tiles); the launch requested the slack.
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(SmemPlan<kDqk>) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kDqk>
    SmemPlan<kDqk>& sm = *reinterpret_cast<SmemPlan<kDqk>*>(smem + pad);

    // Thread 0 initialises the mbarriers (their meanings: config.cuh, SmemPlan).
    using C = Config<kDqk>;
    if (threadIdx.x == 0) {
        MBarrier::init(&sm.qdo_full, kWarpgroupThreads);
#pragma unroll
        for (int s = 0; s < C::kDqkSlabs; ++s) MBarrier::init(&sm.kv_full[s], kWarpgroupThreads);
        MBarrier::init(&sm.kv_empty, kConsumerThreads);  // every consumer thread once per tile
        MBarrier::init(&sm.x_drained, kConsumerThreads);  // every consumer thread once per tile (report_drained)
        MBarrier::init(&sm.pds_free, kWarpgroupThreads);
        if constexpr (kPair) {
#pragma unroll
            for (int s = 0; s < kXbBufs * kXSlots; ++s) {
                MBarrier::init(&sm.x_full[s], 1);   // the warp's arrive_expect_tx (+ the peer's bytes)
                MBarrier::init(&sm.x_empty[s], 1);  // the peer's warp, remotely
            }
            fence_mbarrier_init_cluster();
        }
    }
    // Pair mode: the peer's barriers must be initialised before any remote arrival or st.async reaches them.
    if constexpr (kPair) {
        cluster_sync();
    } else {
        __syncthreads();
    }

    // Waves of the bucketed order (launch.rs), two head groups: the next wave may take the SMs this one frees as
    // soon as every CTA of this one runs; it needs nothing this wave writes (the reductions commute, d_q / delta rows
    // are disjoint). One head group signals only at the end (below): measured faster there.
    if (p.num_head_groups > 1) grid_dep_launch_dependents();

    const CtaWork w = cta_work<kHeadsPerCta, kTileRows>(p, p.token0);
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kDqk, kXBf16>(p, sm, w);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        if (wg == 1) {
            consumer<kDqk, 0, kDet, kPair, kXBf16>(p, sm, w);
        } else {
            consumer<kDqk, 1, kDet, kPair, kXBf16>(p, sm, w);
        }
    }
    // Pair mode: neither CTA may exit while the other could still touch its shared memory.
    if constexpr (kPair) {
        __syncwarp();
        cluster_sync();
    }
    // One head group: the next wave is set up while this one's last CTAs exit (a repeated signal does nothing).
    // A wave completes only after its predecessor has, so the launches after the last wave (which are not
    // programmatic) see the reductions of every wave. Both are no-ops in a grid launched the ordinary way.
    grid_dep_launch_dependents();
    grid_dep_wait();
}

}  // namespace flashmla::sparse_bwd
