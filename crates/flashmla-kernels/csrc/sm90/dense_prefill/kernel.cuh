// Dense varlen prefill forward for sm_90a (docs/spec.md section 5; design in docs/dense-prefill.md).
//
// Persistent CTAs, one per SM: each serves work items (128 query rows of one (sequence, query head)) taken from the
// call's counter in the order of work.cuh, until none is left. 3 warpgroups:
//   Producer:  per item, once the consumers have read the previous item's Q for the last time: publishes the item and
//              loads its Q tile, then the sequence's K and V tiles (128 keys each) into a 2-stage ring that runs on
//              across items: by TMA where a tile lies wholly inside the sequence, else with cp.async (16-byte chunks
//              placed straight into the 128B-swizzled layout; rows past the sequence zero-filled without being read),
//              published after a proxy fence. K and V of a stage complete and are released separately. It takes its
//              next item while the consumers work on the current one.
//   Consumers: consumer c owns rows 64 c .. 64 c + 63. Per tile: S = Q K^T (wgmma 64 x 128), the mask (causal
//              diagonal and the sequence's last tile only), the online softmax, O += P V with P from registers.
//              Q is released after the last S; the epilogue writes out from registers (16-byte stores after a
//              transpose inside each quad) and lse, while the next item's Q and first tiles load.
// The two consumers run the same program on different rows, so one's softmax overlaps the other's MMAs.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/cp_async_group.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"
#include "common/softmax_tile.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "sm90/dense_prefill/config.cuh"
#include "sm90/dense_prefill/params.h"
#include "sm90/dense_prefill/work.cuh"

namespace flashmla::dense_prefill {

using Ring = RingPos<kStages>;

// ---------------------------------------------------------------------------------------------------------------
// Work item `linear`: a 128-row query tile of one (sequence, head) (work.cuh: order, offsets). Run by one warp.
__device__ __forceinline__ TileWork find_work(const DensePrefillFwdParams& p, int linear, int lane) {
    const SeqTile t = find_seq_tile<kTileM>(p.cu_seqlens_q, p.batch, p.total_q, p.m_tiles, linear, lane);
    TileWork w{};
    w.found = t.found;
    w.head = t.head;
    if (t.found) {
        w.s_q = t.len;
        w.m0 = t.t0;
        w.q0 = t.start + t.t0;
        w.rows = min(kTileM, t.len - t.t0);
        other_range(p.cu_seqlens_k, t.seq, p.total_k, w.k0, w.s_k);
    }
    return w;
}

// Key tiles the item's rows can see: all of the sequence's, or under the bottom-right causal mask up to row
// (last row + s_k - s_q). 0 when no row sees any key.
__device__ __forceinline__ int key_tiles(const DensePrefillFwdParams& p, const TileWork& w) {
    const int keys =
        (p.flags & kFlagCausal) == 0 ? w.s_k : clamp_to(w.m0 + w.rows + (w.s_k - w.s_q), 0, w.s_k);
    return (keys + kTileN - 1) / kTileN;
}

// The producer's next work item: its thread 0 takes indices from the call's counter until one names a tile (an
// index past the last sequence's tiles names none: the order's tiles per head are a bound) or none is left, and
// warp 0 finds the tile; the other warps read it from shared memory. found = 0 when the CTA is done.
template <int kD>
__device__ __forceinline__ TileWork next_work(const DensePrefillFwdParams& p, SmemPlan<kD>& sm) {
    named_barrier_sync_unaligned(Bar::NextWork, kWarpgroupThreads);  // every warp read the previous one
    if (threadIdx.x < 32) {
        const int lane = static_cast<int>(threadIdx.x);
        const uint32_t items = static_cast<uint32_t>(p.m_tiles) * static_cast<uint32_t>(p.h_q);
        TileWork w{};
        for (;;) {
            uint32_t idx = 0;
            if (lane == 0) idx = atomicAdd(p.tile_counter, 1u);
            idx = __shfl_sync(kFullMask, idx, 0);
            if (idx >= items) break;
            w = find_work(p, static_cast<int>(idx), lane);
            if (w.found) break;
        }
        if (lane == 0) sm.next = w;
    }
    named_barrier_sync_unaligned(Bar::NextWork, kWarpgroupThreads);
    return sm.next;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer warpgroup. Thread t copies 16-byte chunk t % 8 of tile row 16 k + t / 8 in pass k, for every slab.

// Copies rows row0 .. row0 + kRows - 1 of `base` (those below `rows`; the others zero-filled) into kSlabs SW128
// slabs of kRows rows each, by the 128 threads of a warpgroup.
template <int kSlabs, int kRows = kTileN>
__device__ __forceinline__ void copy_tile(uint32_t dst_base, const uint16_t* base, int64_t row_stride, int row0,
                                          int rows, const Sw128CopyThread& ct, const uint16_t* dummy) {
    constexpr int kSlabBytes = kRows * kSw128RowBytes;
    static_assert(kRows % kRowsPerPass == 0, "whole passes of 16 rows");
#pragma unroll
    for (int k = 0; k < kRows / kRowsPerPass; ++k) {
        const int r = k * kRowsPerPass + ct.row_in_pass;
        const bool ok = row0 + r < rows;
        const uint16_t* src = (ok ? base + static_cast<int64_t>(row0 + r) * row_stride : dummy) + ct.chunk_elems;
#pragma unroll
        for (int slab = 0; slab < kSlabs; ++slab) {
            cp_async_16_zfill(dst_base + slab * kSlabBytes + k * kRowsPerPass * kSw128RowBytes + ct.smem_off,
                              src + slab * kSw128ColsBf16, ok);
        }
    }
}

// Closes the thread's copies so far into a group and publishes them once they landed (one of the barrier's 128
// arrivals, after a proxy fence: the consumers do not fence).
__device__ __forceinline__ void publish_landed(uint64_t* full) {
    cp_async_commit_group();
    publish_landed_copies(full, 0);
}

// Issues the TMA boxes of kSlabs 64-column slabs of kRows rows of one head (map rows row0 ..), completing their
// bytes on `full`; the caller announced them (expect_tx). One thread issues them.
template <int kSlabs, int kRows>
__device__ __forceinline__ void tma_slabs(uint32_t dst, const TensorMapBytes* map, int head, int row0, uint64_t* full) {
    constexpr int kSlabBytes = kRows * kSw128RowBytes;
#pragma unroll
    for (int slab = 0; slab < kSlabs; ++slab) {
        tma_load_4d(dst + slab * kSlabBytes, map, slab * kSw128ColsBf16, head, row0, 0, smem_addr(full));
    }
}

// One tile of kSlabs slabs of 128 rows by TMA: thread 0 announces the bytes, issues the boxes and arrives for the
// warpgroup.
template <int kSlabs>
__device__ __forceinline__ void tma_tile(uint32_t dst, const TensorMapBytes* map, int head, int row0, uint64_t* full) {
    if (threadIdx.x != 0) return;
    MBarrier::expect_tx(full, kSlabs * kTileN * kSw128RowBytes);
    tma_slabs<kSlabs, kTileN>(dst, map, head, row0, full);
    MBarrier::arrive(full, kWarpgroupThreads);
}

// With kFlagTma, Q and every K / V tile that lies wholly inside the sequence load by TMA; the sequence's last,
// partial tile (its rows past s_k must be zeros: the rows after it belong to another sequence or to no tensor) and,
// without the flag, every tile are copied with cp.async and published by the producer. All 128 threads wait for each
// release, so that they keep in step with the ring's phases whichever path a tile takes. Thread 0 writes the item
// to `sm.work` before its arrival on q_full.
template <int kD>
__device__ __forceinline__ void load_item(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, const TileWork& w,
                                          int n_tiles, int first) {
    using C = Config<kD>;
    const bool tma = (p.flags & kFlagTma) != 0;
    const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    const uint16_t* dummy = p.q;  // source of zero-filled copies: never read, but inside a tensor anyway
    const int kv_head = w.head / p.h_per_k;

    if (threadIdx.x == 0) sm.work = w;
    if (n_tiles == 0) {  // the consumers read no Q: they write the item's rows at once
        if (threadIdx.x == 0) MBarrier::arrive(&sm.q_full, kWarpgroupThreads);
        return;
    }
    if (tma) {
        // Rows past the sequence's queries are other rows of q or zeros: a row's scores, softmax and output involve
        // no other row, and the epilogue writes only the tile's own rows.
        tma_tile<C::kDSlabs>(smem_addr(sm.q), &p.q_tmap, w.head, w.q0, &sm.q_full);
    } else {
        const uint16_t* q =
            p.q + static_cast<int64_t>(w.q0) * p.q_stride_t + static_cast<int64_t>(w.head) * p.q_stride_h;
        copy_tile<C::kDSlabs>(smem_addr(sm.q), q, p.q_stride_t, 0, w.rows, ct, dummy);
        publish_landed(&sm.q_full);
    }

    const uint16_t* k = p.k + static_cast<int64_t>(w.k0) * p.k_stride_t + kv_head * p.k_stride_h;
    const uint16_t* v = p.v + static_cast<int64_t>(w.k0) * p.v_stride_t + kv_head * p.v_stride_h;
    for (int i = 0; i < n_tiles; ++i) {
        const Ring pos = Ring::of(first + i);
        const int row0 = i * kTileN;
        if (tma && row0 + kTileN <= w.s_k) {
            MBarrier::wait(&sm.k_empty[pos.stage], pos.empty_parity);
            tma_tile<C::kDSlabs>(smem_addr(sm.k[pos.stage]), &p.k_tmap, kv_head, w.k0 + row0, &sm.k_full[pos.stage]);
            MBarrier::wait(&sm.v_empty[pos.stage], pos.empty_parity);
            tma_tile<C::kDvSlabs>(smem_addr(sm.v[pos.stage]), &p.v_tmap, kv_head, w.k0 + row0, &sm.v_full[pos.stage]);
        } else {
            MBarrier::wait(&sm.k_empty[pos.stage], pos.empty_parity);
            copy_tile<C::kDSlabs>(smem_addr(sm.k[pos.stage]), k, p.k_stride_t, row0, w.s_k, ct, dummy);
            cp_async_commit_group();
            MBarrier::wait(&sm.v_empty[pos.stage], pos.empty_parity);
            copy_tile<C::kDvSlabs>(smem_addr(sm.v[pos.stage]), v, p.v_stride_t, row0, w.s_k, ct, dummy);
            cp_async_commit_group();
            publish_landed_copies(&sm.k_full[pos.stage], 1);
            publish_landed_copies(&sm.v_full[pos.stage], 0);
        }
    }
}

// The producer's loop over the CTA's items. `first` is the ring position of an item's first key tile: the ring runs
// on across items, so the next item's first tiles load while the consumers finish the current one.
template <int kD>
__device__ __forceinline__ void producer(const DensePrefillFwdParams& p, SmemPlan<kD>& sm) {
    if ((p.flags & kFlagTma) != 0 && threadIdx.x == 0) {
        tma_prefetch_map(&p.q_tmap);
        tma_prefetch_map(&p.k_tmap);
        tma_prefetch_map(&p.v_tmap);
    }
    TileWork w = next_work(p, sm);
    int first = 0;
    for (int item = 0;; ++item) {
        if (item > 0) MBarrier::wait(&sm.q_empty, static_cast<uint32_t>((item - 1) & 1));
        if (!w.found) {
            if (threadIdx.x == 0) {
                sm.work = w;
                MBarrier::arrive(&sm.q_full, kWarpgroupThreads);
            }
            return;
        }
        const int n_tiles = key_tiles(p, w);
        load_item<kD>(p, sm, w, n_tiles, first);
        first += n_tiles;
        w = next_work(p, sm);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

inline constexpr int kSRegs = kRowsPerConsumer * kTileN / kWarpgroupThreads;  // 64: S, 64 x 128 f32
inline constexpr int kORegs = kRowsPerConsumer * kDv / kWarpgroupThreads;     // 64: O, 64 x 128 f32
inline constexpr int kSBlocks = kSRegs / 4;                                   // 16 n8 blocks of S
inline constexpr int kPSteps = kTileN / 16;                                   // 8 k-steps of O += P V

// A consumer's rows: the two the thread owns (relative to the sequence) and their causal horizons.
struct RowState {
    float m_run[2];  // running max of the base-2 logits
    float m_ref[2];  // lazily raised reference that P subtracts (softmax_tile.cuh, kRescaleThreshold)
    float l[2];      // this thread's part of the softmax denominators
};

// Masks S of tile `i` to -inf where a key is past the sequence or, causally, past the row's horizon (a select,
// so an inf in Q or K cannot turn into NaN). `limit[rr]`: last key the row sees (s_k - 1 without a causal mask).
__device__ __forceinline__ void mask_tile(float (&s)[kSRegs], int i, const AccFrag& f, const int (&limit)[2]) {
#pragma unroll
    for (int j = 0; j < kSBlocks; ++j) {
        const int col = i * kTileN + f.col(j);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            s[4 * j + 2 * rr + 0] = col <= limit[rr] ? s[4 * j + 2 * rr + 0] : -kInf;
            s[4 * j + 2 * rr + 1] = col + 1 <= limit[rr] ? s[4 * j + 2 * rr + 1] : -kInf;
        }
    }
}

// Online-softmax bookkeeping of one tile (as softmax_tile.cuh's update_row_max, for 128 keys): returns the rescale
// of O and l (alpha) and the reference P subtracts (m_exp, 0 while a row has seen no valid key).
__device__ __forceinline__ void tile_row_max(const float (&s)[kSRegs], float scale, RowState& st, float (&alpha)[2],
                                             float (&m_exp)[2]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float t[kSBlocks];
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) t[j] = fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]);
#pragma unroll
        for (int level = 1; level < kSBlocks; level *= 2) {  // a tree: 16 -> 8 -> 4 -> 2 -> 1
#pragma unroll
            for (int j = 0; j < kSBlocks; j += 2 * level) t[j] = fmaxf(t[j], t[j + level]);
        }
        st.m_run[rr] = fmaxf(st.m_run[rr], quad_max(t[0]) * scale);
        alpha[rr] = 1.f;
        if (st.m_run[rr] > st.m_ref[rr] + kRescaleThreshold) {
            alpha[rr] = exp2f(st.m_ref[rr] - st.m_run[rr]);
            st.m_ref[rr] = st.m_run[rr];
        }
        m_exp[rr] = st.m_ref[rr] == -kInf ? 0.f : st.m_ref[rr];
    }
}

// A 4 x 4 transpose of 32-bit words inside each quad of lanes: lane q's a[k] becomes lane k's a[q] (two rounds of
// exchanges with the lane whose index differs in one bit, each swapping the two words whose index bit differs from
// the lane's).
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4], int quad) {
    const bool odd = (quad & 1) != 0;
    uint32_t x0 = __shfl_xor_sync(kFullMask, odd ? a[0] : a[1], 1);
    uint32_t x1 = __shfl_xor_sync(kFullMask, odd ? a[2] : a[3], 1);
    if (odd) {
        a[0] = x0;
        a[2] = x1;
    } else {
        a[1] = x0;
        a[3] = x1;
    }
    const bool high = (quad & 2) != 0;
    x0 = __shfl_xor_sync(kFullMask, high ? a[0] : a[2], 2);
    x1 = __shfl_xor_sync(kFullMask, high ? a[1] : a[3], 2);
    if (high) {
        a[0] = x0;
        a[1] = x1;
    } else {
        a[2] = x0;
        a[3] = x1;
    }
}

// The epilogue: O / l to E and lse (natural log) per row; rows that saw no key get out 0 and lse +inf. From
// registers: a quad holds two columns of each n8 block of its two rows, so a transpose inside the quad over four
// blocks gives each lane the eight columns of one block, stored as 16 bytes (out rows are 16-byte aligned).
template <class E>
__device__ __forceinline__ void epilogue(const DensePrefillFwdParams& p, const TileWork& w, int consumer,
                                         const AccFrag& f, const RowState& st, const float (&o)[kORegs]) {
    const int rows[2] = {kRowsPerConsumer * consumer + f.row0, kRowsPerConsumer * consumer + f.row1()};
    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float l = quad_sum(st.l[rr]);
        inv[rr] = l > 0.f ? 1.f / l : 0.f;
        if (f.quad == 0 && rows[rr] < w.rows) {
            const float lse = l > 0.f ? (st.m_ref[rr] + __log2f(l)) * kLn2 : kInf;
            p.lse[static_cast<int64_t>(w.head) * p.lse_stride_h + w.q0 + rows[rr]] = lse;
        }
    }
    uint16_t* out = p.out + static_cast<int64_t>(w.q0) * p.out_stride_t + static_cast<int64_t>(w.head) * p.out_stride_h;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int g = 0; g < kORegs / 16; ++g) {  // n8 blocks 4 g .. 4 g + 3
            uint32_t a[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int j = 4 * g + k;
                a[k] = pack_x2<E>(o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]);
            }
            quad_transpose(a, f.quad);
            if (rows[rr] < w.rows) {
                *reinterpret_cast<uint4*>(out + static_cast<int64_t>(rows[rr]) * p.out_stride_t +
                                          8 * (4 * g + f.quad)) = make_uint4(a[0], a[1], a[2], a[3]);
            }
        }
    }
}

// The consumer's phases, in the order the pipeline runs them.

// Issues S = Q K^T of tile `i` (one commit group) once its K tile landed.
template <int kD, class E>
__device__ __forceinline__ void issue_qk(SmemPlan<kD>& sm, uint64_t desc_q, int i, float (&s)[kSRegs]) {
    using C = Config<kD>;
    const Ring pos = Ring::of(i);
    MBarrier::wait(&sm.k_full[pos.stage], pos.full_parity);  // TMA, or cp.async published after a proxy fence
    const uint64_t desc_k = make_wgmma_desc_sw128(smem_addr(sm.k[pos.stage]), kUnusedLbo, kSw128AtomBytes);
    wgmma_fence();  // s was last written by ordinary instructions (the softmax)
#pragma unroll
    for (int ks = 0; ks < C::kQkSteps; ++ks) {
        const uint32_t off = (ks / C::kKStepsPerSlab) * C::kSlabBytes + (ks % C::kKStepsPerSlab) * 32;
        wgmma_m64n128k16_ss_kk<E>(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), ks > 0);
    }
    wgmma_commit();
}

// Issues O += P V of tile `i` (one commit group) once its V tile landed; P from registers.
template <int kD, class E>
__device__ __forceinline__ void issue_pv(SmemPlan<kD>& sm, int i, const uint32_t (&pa)[kPSteps][4],
                                         float (&o)[kORegs]) {
    using C = Config<kD>;
    const Ring pos = Ring::of(i);
    MBarrier::wait(&sm.v_full[pos.stage], pos.full_parity);
    const uint32_t v_addr = smem_addr(sm.v[pos.stage]);
    wgmma_fence();  // o (rescale) and pa were written by ordinary instructions
#pragma unroll
    for (int kb = 0; kb < kPSteps; ++kb) {
        const uint64_t desc_v = make_wgmma_desc_sw128(v_addr + kb * 16 * kSw128RowBytes, C::kSlabBytes, kSw128AtomBytes);
        wgmma_m64n128k16_rs_mn<E>(o, pa[kb], desc_v, true);
    }
    wgmma_commit();
}

// S(i) -> P(i) in place (f32), the row bookkeeping: mask, row max, exp2, row sums. Returns alpha, the rescale
// of O that P(i) assumes (applied once PV(i - 1) has completed).
__device__ __forceinline__ void softmax_tile(float (&s)[kSRegs], int i, const AccFrag& f, const int (&limit)[2],
                                             int mask_from, float scale, RowState& st, float (&alpha)[2]) {
    if (i * kTileN + kTileN - 1 > mask_from) mask_tile(s, i, f, limit);
    float m_exp[2];
    tile_row_max(s, scale, st, alpha, m_exp);
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kSBlocks; ++j) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            s[4 * j + 2 * rr] = exp2f(fmaf(s[4 * j + 2 * rr], scale, -m_exp[rr]));
            s[4 * j + 2 * rr + 1] = exp2f(fmaf(s[4 * j + 2 * rr + 1], scale, -m_exp[rr]));
            sum[rr] += s[4 * j + 2 * rr] + s[4 * j + 2 * rr + 1];
        }
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) st.l[rr] = st.l[rr] * alpha[rr] + sum[rr];
}

// Register A fragments (E) of a 64 x (16 kSteps) accumulator tile (fragment layout: smem_layout.cuh).
template <class E, int kSteps, int N>
__device__ __forceinline__ void to_frags(const float (&x)[N], uint32_t (&a)[kSteps][4]) {
    static_assert(N == 8 * kSteps, "a 64 x 16 kSteps tile");
#pragma unroll
    for (int kb = 0; kb < kSteps; ++kb) {
        a[kb][0] = pack_x2<E>(x[8 * kb + 0], x[8 * kb + 1]);
        a[kb][1] = pack_x2<E>(x[8 * kb + 2], x[8 * kb + 3]);
        a[kb][2] = pack_x2<E>(x[8 * kb + 4], x[8 * kb + 5]);
        a[kb][3] = pack_x2<E>(x[8 * kb + 6], x[8 * kb + 7]);
    }
}

__device__ __forceinline__ void scale_o(float (&o)[kORegs], const float (&alpha)[2]) {
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
        for (int j = 0; j < kORegs / 4; ++j) {
            o[4 * j + 0] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }
}

// The two consumers take turns issuing their MMAs: consumer c waits at Turn<c> for the other to have issued its
// previous batch, issues its own, and lets the other go. So one consumer's MMAs run while the other computes its
// softmax, instead of both landing in their softmax together with the tensor cores idle. Both consumers issue the
// same number of batches (every key tile, plus the last P V); consumer 1 opens the sequence and skips the last
// hand-off, which nobody waits for. Measured (H100, against torch's cuDNN attention in the same process): 2-3.5%
// less time at every shape of docs/dense-prefill.md's table.
struct Turns {
    int self;
    __device__ __forceinline__ void wait() const {
        named_barrier_sync_unaligned(self == 0 ? Bar::Turn0 : Bar::Turn1, 2 * kWarpgroupThreads);
    }
    __device__ __forceinline__ void pass() const {
        named_barrier_arrive(self == 0 ? Bar::Turn1 : Bar::Turn0, 2 * kWarpgroupThreads);
    }
};

// The consumer's loop, software-pipelined by one tile: iteration i queues QK(i) and PV(i - 1) back to back, waits
// for QK(i) only, and runs the softmax of tile i while PV(i - 1) occupies the tensor cores. P(i) stays in f32 in S's
// registers until PV(i - 1) has read the previous fragments; then O is rescaled for tile i and P(i) packed.
// `first`: the ring position of the item's first key tile. Q is released after the last S.
template <int kD, class E>
__device__ __forceinline__ void consume_item(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, const TileWork& w,
                                             int n_tiles, int first, int consumer_idx) {
    using C = Config<kD>;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * (1 + consumer_idx);
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const float scale = p.sm_scale_log2;
    const bool causal = (p.flags & kFlagCausal) != 0;

    // Last key each of the thread's rows sees; the consumer's first row bounds which tiles need the mask.
    const int row_first = w.m0 + kRowsPerConsumer * consumer_idx;
    const int shift = w.s_k - w.s_q;
    int limit[2];
    limit[0] = causal ? min(row_first + f.row0 + shift, w.s_k - 1) : w.s_k - 1;
    limit[1] = causal ? min(row_first + f.row1() + shift, w.s_k - 1) : w.s_k - 1;
    const int mask_from = causal ? min(row_first + shift, w.s_k - 1) : w.s_k - 1;

    RowState st;
    float o[kORegs];
    zero_regs(o);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        st.m_run[rr] = -kInf;
        st.m_ref[rr] = -kInf;
        st.l[rr] = 0.f;
    }

    const uint64_t desc_q =
        make_wgmma_desc_sw128(smem_addr(sm.q) + consumer_idx * C::kConsumerRowBytes, kUnusedLbo, kSw128AtomBytes);
    if (n_tiles == 0) {
        MBarrier::arrive(&sm.q_empty);
    } else {
        const Turns turns{consumer_idx};
        if (consumer_idx == 1) turns.pass();  // consumer 0 issues first
        float s[kSRegs];
        uint32_t pa[kPSteps][4];
        float alpha[2];
        // Prologue: tile 0's scores and P.
        turns.wait();
        issue_qk<kD, E>(sm, desc_q, first, s);
        turns.pass();
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        release_by_warp(&sm.k_empty[Ring::of(first).stage], lane);
        if (n_tiles == 1) MBarrier::arrive(&sm.q_empty);
        softmax_tile(s, 0, f, limit, mask_from, scale, st, alpha);  // O is zero: alpha needs no rescale
        to_frags<E>(s, pa);
        for (int i = 1; i < n_tiles; ++i) {
            turns.wait();
            issue_qk<kD, E>(sm, desc_q, first + i, s);
            issue_pv<kD, E>(sm, first + i - 1, pa, o);
            turns.pass();
            wgmma_wait<1>();  // QK(i) done (groups retire in order); PV(i - 1) may still run
            wgmma_fence_regs(s);
            release_by_warp(&sm.k_empty[Ring::of(first + i).stage], lane);
            if (i == n_tiles - 1) MBarrier::arrive(&sm.q_empty);
            softmax_tile(s, i, f, limit, mask_from, scale, st, alpha);
            wgmma_wait<0>();  // PV(i - 1) done: pa and V(i - 1) are free, O may be rescaled
            wgmma_fence_regs(o);
            release_by_warp(&sm.v_empty[Ring::of(first + i - 1).stage], lane);
            scale_o(o, alpha);
            to_frags<E>(s, pa);
        }
        turns.wait();
        issue_pv<kD, E>(sm, first + n_tiles - 1, pa, o);
        if (consumer_idx == 0) turns.pass();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        release_by_warp(&sm.v_empty[Ring::of(first + n_tiles - 1).stage], lane);
    }
    epilogue<E>(p, w, consumer_idx, f, st, o);
}

// The consumer's loop over the CTA's items, in the producer's order; it ends at the item with found = 0.
template <int kD, class E>
__device__ __forceinline__ void consumer(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, int consumer_idx) {
    int first = 0;
    for (int item = 0;; ++item) {
        MBarrier::wait(&sm.q_full, static_cast<uint32_t>(item & 1));
        const TileWork w = sm.work;
        if (!w.found) return;
        const int n_tiles = key_tiles(p, w);
        consume_item<kD, E>(p, sm, w, n_tiles, first, consumer_idx);
        first += n_tiles;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by dense_prefill.cu per (d, element type)). `smem` is the dynamic shared memory.
template <int kD, class E>
__device__ __forceinline__ void dense_prefill_fwd(const DensePrefillFwdParams& p, uint8_t* smem) {
    using Plan = SmemPlan<kD>;
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kD>
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    if (threadIdx.x == 0) {
        MBarrier::init(&sm.q_full, kWarpgroupThreads);
        MBarrier::init(&sm.q_empty, kConsumers * kWarpgroupThreads);  // every consumer thread (its `work` read)
#pragma unroll
        for (int st = 0; st < kStages; ++st) {
            MBarrier::init(&sm.k_full[st], kWarpgroupThreads);
            MBarrier::init(&sm.v_full[st], kWarpgroupThreads);
            MBarrier::init(&sm.k_empty[st], kConsumers * kWarpsPerWarpgroup);
            MBarrier::init(&sm.v_empty[st], kConsumers * kWarpsPerWarpgroup);
        }
    }
    __syncthreads();

    const Role role = static_cast<Role>(threadIdx.x / kWarpgroupThreads);
    if (role == Role::Producer) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kD>(p, sm);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consumer<kD, E>(p, sm, role == Role::Consumer0 ? 0 : 1);
    }
}

}  // namespace flashmla::dense_prefill
