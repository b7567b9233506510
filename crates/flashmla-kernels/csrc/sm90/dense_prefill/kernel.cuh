// Dense varlen prefill forward for sm_90a (docs/spec.md section 5; design in docs/dense-prefill.md).
//
// One CTA = 128 query rows of one (sequence, query head); 3 warpgroups:
//   Producer:  loads the Q tile once, then the sequence's K and V tiles (128 keys each) into a 2-stage ring: by TMA
//              where a tile lies wholly inside the sequence, else with cp.async (16-byte chunks placed straight into
//              the 128B-swizzled layout; rows past the sequence zero-filled without being read), published after a
//              proxy fence. K and V of a stage complete and are released separately.
//   Consumers: consumer c owns rows 64 c .. 64 c + 63. Per tile: S = Q K^T (wgmma 64 x 128), the mask (causal
//              diagonal and the sequence's last tile only), the online softmax, O += P V with P from registers.
//              The epilogue writes out (staged through the consumer's own Q rows for 16-byte stores) and lse.
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
// Work of the CTA: a 128-row query tile of one (sequence, head) (work.cuh: grid order, offsets).
__device__ __forceinline__ TileWork find_work(const DensePrefillFwdParams& p, int lane) {
    const SeqTile t = find_seq_tile<kTileM>(p.cu_seqlens_q, p.batch, p.total_q, p.m_tiles, lane);
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

// Keys the CTA's rows can see: all of the sequence's, or under the bottom-right causal mask up to row
// (last row + s_k - s_q). 0 when no row sees any key.
__device__ __forceinline__ int keys_seen(const DensePrefillFwdParams& p, const TileWork& w) {
    if ((p.flags & kFlagCausal) == 0) return w.s_k;
    return clamp_to(w.m0 + w.rows + (w.s_k - w.s_q), 0, w.s_k);
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
// release, so that they keep in step with the ring's phases whichever path a tile takes.
template <int kD>
__device__ __forceinline__ void producer(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, const TileWork& w,
                                         int n_tiles) {
    using C = Config<kD>;
    if (n_tiles == 0) return;  // the consumers wait for nothing
    const bool tma = (p.flags & kFlagTma) != 0;
    const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    const uint16_t* dummy = p.q;  // source of zero-filled copies: never read, but inside a tensor anyway
    const int kv_head = w.head / p.h_per_k;

    if (tma) {
        if (threadIdx.x == 0) {
            tma_prefetch_map(&p.k_tmap);
            tma_prefetch_map(&p.v_tmap);
        }
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
        const Ring pos = Ring::of(i);
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

// The epilogue: O / l to E, staged in the consumer's own rows of Q slabs 0..1 (the SW128 layout: row r, column
// chunk j at slab j / 8, chunk j % 8 of row r), then copied out with 16-byte stores; lse (natural log) per row.
// Rows that saw no key get out 0 and lse +inf. Called after the consumer's last wgmma read of Q completed.
template <int kD, class E>
__device__ __forceinline__ void epilogue(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, const TileWork& w,
                                         int consumer, int t, const AccFrag& f, const RowState& st,
                                         const float (&o)[kORegs]) {
    using C = Config<kD>;
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
    const uint32_t q_addr = smem_addr(sm.q);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {  // n8 block j: columns 8 j + 2 q, + 1
        const int slab = j / kSw128ChunksPerRow;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const uint32_t addr = q_addr + slab * C::kSlabBytes +
                                  sw128_chunk_offset(rows[rr], j % kSw128ChunksPerRow) + 4 * f.quad;
            st_shared_u32(addr, pack_x2<E>(o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]));
        }
    }
    named_barrier_sync_unaligned(consumer == 0 ? Bar::Staging0 : Bar::Staging1, kWarpgroupThreads);
    constexpr int kChunksPerRow = kDv * 2 / 16;  // 16
    uint16_t* out = p.out + static_cast<int64_t>(w.q0) * p.out_stride_t + static_cast<int64_t>(w.head) * p.out_stride_h;
#pragma unroll
    for (int it = 0; it < kRowsPerConsumer * kChunksPerRow / kWarpgroupThreads; ++it) {
        const int id = it * kWarpgroupThreads + t;
        const int row = kRowsPerConsumer * consumer + id / kChunksPerRow;
        const int chunk = id % kChunksPerRow;
        if (row < w.rows) {
            const uint4 val = ld_shared_v4(q_addr + (chunk / kSw128ChunksPerRow) * C::kSlabBytes +
                                           sw128_chunk_offset(row, chunk % kSw128ChunksPerRow));
            *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * p.out_stride_t + chunk * 8) = val;
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
template <int kD, class E>
__device__ __forceinline__ void consumer(const DensePrefillFwdParams& p, SmemPlan<kD>& sm, const TileWork& w,
                                         int n_tiles, int consumer_idx) {
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
    if (n_tiles > 0) {
        const Turns turns{consumer_idx};
        if (consumer_idx == 1) turns.pass();  // consumer 0 issues first
        MBarrier::wait(&sm.q_full, 0);
        float s[kSRegs];
        uint32_t pa[kPSteps][4];
        float alpha[2];
        // Prologue: tile 0's scores and P.
        turns.wait();
        issue_qk<kD, E>(sm, desc_q, 0, s);
        turns.pass();
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        release_by_warp(&sm.k_empty[0], lane);
        softmax_tile(s, 0, f, limit, mask_from, scale, st, alpha);  // O is zero: alpha needs no rescale
        to_frags<E>(s, pa);
        for (int i = 1; i < n_tiles; ++i) {
            turns.wait();
            issue_qk<kD, E>(sm, desc_q, i, s);
            issue_pv<kD, E>(sm, i - 1, pa, o);
            turns.pass();
            wgmma_wait<1>();  // QK(i) done (groups retire in order); PV(i - 1) may still run
            wgmma_fence_regs(s);
            release_by_warp(&sm.k_empty[Ring::of(i).stage], lane);
            softmax_tile(s, i, f, limit, mask_from, scale, st, alpha);
            wgmma_wait<0>();  // PV(i - 1) done: pa and V(i - 1) are free, O may be rescaled
            wgmma_fence_regs(o);
            release_by_warp(&sm.v_empty[Ring::of(i - 1).stage], lane);
            scale_o(o, alpha);
            to_frags<E>(s, pa);
        }
        turns.wait();
        issue_pv<kD, E>(sm, n_tiles - 1, pa, o);
        if (consumer_idx == 0) turns.pass();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        release_by_warp(&sm.v_empty[Ring::of(n_tiles - 1).stage], lane);
    }
    epilogue<kD, E>(p, sm, w, consumer_idx, t, f, st, o);
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by dense_prefill.cu per (d, element type)). `smem` is the dynamic shared memory.
template <int kD, class E>
__device__ __forceinline__ void dense_prefill_fwd(const DensePrefillFwdParams& p, uint8_t* smem) {
    using Plan = SmemPlan<kD>;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.m_tiles) * p.h_q) return;

    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kD>
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    if (threadIdx.x < 32) {
        const TileWork w = find_work(p, static_cast<int>(threadIdx.x));
        if (threadIdx.x == 0) sm.work = w;
    }
    if (threadIdx.x == 32) {
        MBarrier::init(&sm.q_full, kWarpgroupThreads);
#pragma unroll
        for (int st = 0; st < kStages; ++st) {
            MBarrier::init(&sm.k_full[st], kWarpgroupThreads);
            MBarrier::init(&sm.v_full[st], kWarpgroupThreads);
            MBarrier::init(&sm.k_empty[st], kConsumers * kWarpsPerWarpgroup);
            MBarrier::init(&sm.v_empty[st], kConsumers * kWarpsPerWarpgroup);
        }
    }
    __syncthreads();
    const TileWork w = sm.work;
    if (!w.found) return;
    const int n_keys = keys_seen(p, w);
    const int n_tiles = (n_keys + kTileN - 1) / kTileN;

    const Role role = static_cast<Role>(threadIdx.x / kWarpgroupThreads);
    if (role == Role::Producer) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kD>(p, sm, w, n_tiles);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consumer<kD, E>(p, sm, w, n_tiles, role == Role::Consumer0 ? 0 : 1);
    }
}

}  // namespace flashmla::dense_prefill
