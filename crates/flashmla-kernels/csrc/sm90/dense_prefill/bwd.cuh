// Dense varlen prefill backward for sm_90a (docs/spec.md section 5; design in docs/dense-prefill.md, "Backward").
//
// Three kernels, none with atomics (each owns the rows it writes, so the results are deterministic):
//   delta: delta[h, r] = sum_j d_out[r, h, j] * out[r, h, j] (f32), one warp per (row, head).
//   dQ:    one CTA per 128 query rows of one (sequence, query head), two consumer warpgroups of 64 rows each that
//          share every streamed 64-key tile of K and V. S = Q K^T and dP = dO V^T (wgmma, shared-memory operands),
//          P = exp2(S * scale_log2 - lse2), dS = P (dP - delta), dQ += dS K (A from registers); dQ * scale is
//          written at the end. While one consumer forms dS the other's MMAs keep the tensor cores busy.
//   dK/dV: one CTA per 64 keys of one (sequence, key head); streams 64-row tiles of Q and dO of every query head of
//          the group. S^T = K Q^T and dP^T = V dO^T, P^T and dS^T as above, dV += P^T dO and dK += dS^T Q.
// Each CTA is a producer warpgroup (cp.async into a 2-stage ring, the CTA's own rows loaded once) and one (dK / dV)
// or two (dQ) consumer warpgroups. Masked and padded entries get P = 0: a padded row of a streamed tile is zero-filled (its P may be
// nonzero but multiplies zero dO and zero dP, so it adds nothing).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"
#include "common/softmax_tile.cuh"
#include "common/wgmma.cuh"
#include "sm90/dense_prefill/kernel.cuh"
#include "sm90/dense_prefill/params.h"
#include "sm90/dense_prefill/work.cuh"

namespace flashmla::dense_prefill::bwd {

inline constexpr int kThreads = 2 * kWarpgroupThreads;  // dK / dV: producer + consumer
inline constexpr int kDqConsumers = 2;
inline constexpr int kDqThreads = (1 + kDqConsumers) * kWarpgroupThreads;  // dQ: producer + two consumers
// dQ register split (3 x 168 at launch): the producer only issues copies.
inline constexpr uint32_t kDqProducerRegs = 56;
inline constexpr uint32_t kDqConsumerRegs = 224;
static_assert(kDqProducerRegs + kDqConsumers * kDqConsumerRegs <= 3 * ((65536u / kDqThreads) & ~7u),
              "setmaxnreg pool of the dQ CTA");
inline constexpr int kStages = 2;
inline constexpr int kRows = 64;        // the CTA's own rows (queries for dQ, keys for dK / dV); the wgmma M
inline constexpr int kKeyTile = 64;     // dQ: keys per streamed tile
// dK / dV: query rows per streamed tile, the N of S^T and dP^T. At d 192, dK (96 registers), dV (64), the two 64 x 64
// score tiles and the fragments take all 255 registers without a spill (ptxas); 64-row tiles measured 12-16% faster
// than 32-row ones there, and 16% at d 128 (docs/perf-log.md).
template <int kD>
inline constexpr int kQueryTile = 64;
inline constexpr uint32_t kSlab64 = kRows * kSw128RowBytes;       // 8 KB: a 64-row slab
template <int kD>
inline constexpr uint32_t kQuerySlab = kQueryTile<kD> * kSw128RowBytes;  // 4 or 8 KB: a slab of a query tile

// Shared-memory plans. Operand tiles are SW128 slabs of 64 columns.
template <int kD>
struct DqPlan {
    static constexpr int kDSlabs = kD / kSw128ColsBf16;
    alignas(kSw128AtomBytes) uint8_t q[kDqConsumers][kDSlabs * kSlab64];  // the CTA's 128 query rows, 64 per consumer
    alignas(kSw128AtomBytes) uint8_t d_out[kDqConsumers][2 * kSlab64];    // their d_out rows
    alignas(kSw128AtomBytes) uint8_t k[kStages][kDSlabs * kSlab64]; // K tiles
    alignas(kSw128AtomBytes) uint8_t v[kStages][2 * kSlab64];       // V tiles
    uint64_t own_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    SeqTile work;         // the CTA's 128 query rows
    int32_t other_start;  // the sequence's first key (global)
    int32_t other_len;    // its keys
};

template <int kD>
struct DkvPlan {
    static constexpr int kDSlabs = kD / kSw128ColsBf16;
    alignas(kSw128AtomBytes) uint8_t k[kDSlabs * kSlab64];              // the CTA's 64 keys
    alignas(kSw128AtomBytes) uint8_t v[2 * kSlab64];
    static constexpr int kQ = kQueryTile<kD>;
    alignas(kSw128AtomBytes) uint8_t q[kStages][kDSlabs * kQuerySlab<kD>];  // Q tiles of kQ rows
    alignas(kSw128AtomBytes) uint8_t d_out[kStages][2 * kQuerySlab<kD>];    // d_out tiles
    float lse[kStages][kQ];                                                 // the tile rows' lse (0 past the sequence)
    float delta[kStages][kQ];
    uint64_t own_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    SeqTile work;         // the CTA's 64 keys
    int32_t other_start;  // the sequence's first query (global)
    int32_t other_len;    // its queries
};

inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kD>
inline constexpr uint32_t kDqSmemBytes = static_cast<uint32_t>(sizeof(DqPlan<kD>)) + kSmemAlignSlack;
template <int kD>
inline constexpr uint32_t kDkvSmemBytes = static_cast<uint32_t>(sizeof(DkvPlan<kD>)) + kSmemAlignSlack;
// launch.rs requests these exact sizes; keep both in step.
static_assert(kDqSmemBytes<192> == 165888, "update launch.rs BWD_DQ_SMEM_D192");
static_assert(kDqSmemBytes<128> == 133120, "update launch.rs BWD_DQ_SMEM_D128");
static_assert(kDkvSmemBytes<192> == 125952, "update launch.rs BWD_DKV_SMEM_D192");
static_assert(kDkvSmemBytes<128> == 101376, "update launch.rs BWD_DKV_SMEM_D128");

template <class Plan>
__device__ __forceinline__ Plan& plan_of(uint8_t* smem) {
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // the launch asked for less than the plan
    return *reinterpret_cast<Plan*>(smem + pad);
}

// The prologue of the dQ and dK / dV kernels: warp 0 finds the CTA's tile of kTile rows of the tensor that `cu`
// offsets and the sequence's range in the other tensor (offsets `cu_other`) and publishes them in `sm.work`,
// `sm.other_start`, `sm.other_len`; thread 32 initialises the barriers (a stage is released by each consumer warp).
template <int kTile, int kConsumers, class Plan>
__device__ __forceinline__ void begin_cta(Plan& sm, int batch, const int32_t* cu, int total, int tiles,
                                          const int32_t* cu_other, int total_other) {
    if (threadIdx.x < 32) {
        const SeqTile t = find_seq_tile<kTile>(cu, batch, total, tiles, static_cast<int>(threadIdx.x));
        int start = 0;
        int len = 0;
        if (t.found) other_range(cu_other, t.seq, total_other, start, len);
        if (threadIdx.x == 0) {
            sm.work = t;
            sm.other_start = start;
            sm.other_len = len;
        }
    }
    if (threadIdx.x == 32) {
        MBarrier::init(&sm.own_full, kWarpgroupThreads);
        for (int st = 0; st < kStages; ++st) {
            MBarrier::init(&sm.full[st], kWarpgroupThreads);
            MBarrier::init(&sm.empty[st], kConsumers * kWarpsPerWarpgroup);
        }
    }
    __syncthreads();
}

// O += A B with A from registers and B = rows of an SW128 tile read MN-major (N = kN columns over kN / 64 slabs of
// `slab` bytes), k-step kb covering rows 16 kb .. 16 kb + 15.
template <class E, int kN, int kSteps, int N>
__device__ __forceinline__ void mma_rs_mn(float (&acc)[N], const uint32_t (&a)[kSteps][4], uint32_t tile_addr,
                                          uint32_t slab) {
    static_assert(N == kN / 2, "accumulator of a 64 x kN tile");
#pragma unroll
    for (int kb = 0; kb < kSteps; ++kb) {
        const uint64_t desc = make_wgmma_desc_sw128(tile_addr + kb * 16 * kSw128RowBytes, slab, kSw128AtomBytes);
        if constexpr (kN == 192) {
            wgmma_m64n192k16_rs_mn<E>(acc, a[kb], desc, true);
        } else {
            static_assert(kN == 128, "N 128 or 192");
            wgmma_m64n128k16_rs_mn<E>(acc, a[kb], desc, true);
        }
    }
}

// D[64 x 64] (+)= A B^T, both operands K-major in shared memory (the score tiles of the dK / dV kernel).
template <class E>
__device__ __forceinline__ void mma_ss_kk(float (&acc)[32], uint64_t a, uint64_t b, bool accumulate) {
    wgmma_m64n64k16_ss_kk<E>(acc, a, b, accumulate);
}

// Stores a 64 x kN f32 accumulator tile times `scale` as E to rows `row0 + r` (r < rows) of `dst` (row stride
// `stride`), two columns per 4-byte store.
template <class E, int kN, int N>
__device__ __forceinline__ void store_rows(uint16_t* dst, int64_t stride, int rows, const AccFrag& f,
                                           const float (&acc)[N], float scale) {
    const int r[2] = {f.row0, f.row1()};
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        if (r[rr] < rows) {
            uint32_t* row = reinterpret_cast<uint32_t*>(dst + static_cast<int64_t>(r[rr]) * stride);
#pragma unroll
            for (int j = 0; j < kN / 8; ++j) {
                row[f.col(j) / 2] = pack_x2<E>(acc[4 * j + 2 * rr] * scale, acc[4 * j + 2 * rr + 1] * scale);
            }
        }
    }
}

// The low / high element of a packed pair of E, as f32.
template <class E>
__device__ __forceinline__ float unpack_lo(uint32_t w) {
    if constexpr (kIsF16<E>) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
    } else {
        return __uint_as_float(w << 16);
    }
}
template <class E>
__device__ __forceinline__ float unpack_hi(uint32_t w) {
    if constexpr (kIsF16<E>) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
    } else {
        return __uint_as_float(w & 0xFFFF0000u);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// delta

// One warp per (query row, head), heads fastest: lane l reads d_v / 32 = 4 consecutive elements of both rows.
template <class E>
__device__ __forceinline__ void delta_kernel(const DensePrefillBwdParams& p) {
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (warp >= static_cast<int64_t>(p.total_q) * p.h_q) return;
    const int row = static_cast<int>(warp / p.h_q);
    const int head = static_cast<int>(warp % p.h_q);
    const uint2 o = *reinterpret_cast<const uint2*>(p.out + row * p.out_stride_t + head * p.out_stride_h + 4 * lane);
    const uint2 g =
        *reinterpret_cast<const uint2*>(p.d_out + row * p.d_out_stride_t + head * p.d_out_stride_h + 4 * lane);
    auto lo = [](uint32_t w) { return unpack_lo<E>(w); };
    auto hi = [](uint32_t w) { return unpack_hi<E>(w); };
    float s = lo(o.x) * lo(g.x) + hi(o.x) * hi(g.x) + lo(o.y) * lo(g.y) + hi(o.y) * hi(g.y);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) s += __shfl_xor_sync(kFullMask, s, off);
    if (lane == 0) p.delta[head * p.delta_stride_h + row] = s;
}

// ---------------------------------------------------------------------------------------------------------------
// dQ

inline constexpr int kDqRows = kDqConsumers * kRows;  // the dQ CTA's query rows

template <int kD, class E>
__device__ __forceinline__ void dq_kernel(const DensePrefillBwdParams& p, uint8_t* smem) {
    using Plan = DqPlan<kD>;
    constexpr int kDSlabs = Plan::kDSlabs;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.q_tiles) * p.h_q) return;
    Plan& sm = plan_of<Plan>(smem);
    begin_cta<kDqRows, kDqConsumers>(sm, p.batch, p.cu_seqlens_q, p.total_q, p.q_tiles, p.cu_seqlens_k, p.total_k);
    const SeqTile w = sm.work;
    if (!w.found) return;
    const int k0 = sm.other_start;
    const int s_k = sm.other_len;
    const int rows = min(kDqRows, w.len - w.t0);  // the CTA's rows
    const int q0 = w.start + w.t0;
    const int shift = s_k - w.len;
    const bool causal = (p.flags & kFlagCausal) != 0;
    // Both consumers walk the keys of the CTA's last row (the first consumer's rows mask the tail of the last tile).
    const int n_keys = causal ? clamp_to(w.t0 + rows + shift, 0, s_k) : s_k;
    const int n_tiles = (n_keys + kKeyTile - 1) / kKeyTile;
    const int kv_head = w.head / p.h_per_k;
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;

    if (wg == 0) {  // producer
        setmaxnreg_dec<kDqProducerRegs>();
        if (n_tiles == 0) return;
        const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
        const uint16_t* dummy = p.q;
        const uint16_t* q = p.q + q0 * p.q_stride_t + w.head * p.q_stride_h;
        const uint16_t* d_out = p.d_out + q0 * p.d_out_stride_t + w.head * p.d_out_stride_h;
#pragma unroll
        for (int c = 0; c < kDqConsumers; ++c) {
            copy_tile<kDSlabs, kRows>(smem_addr(sm.q[c]), q, p.q_stride_t, c * kRows, rows, ct, dummy);
            copy_tile<2, kRows>(smem_addr(sm.d_out[c]), d_out, p.d_out_stride_t, c * kRows, rows, ct, dummy);
        }
        MBarrier::arrive_on_cp_async_noinc(&sm.own_full);
        const uint16_t* k = p.k + static_cast<int64_t>(k0) * p.k_stride_t + kv_head * p.k_stride_h;
        const uint16_t* v = p.v + static_cast<int64_t>(k0) * p.v_stride_t + kv_head * p.v_stride_h;
        for (int i = 0; i < n_tiles; ++i) {
            const RingPos<kStages> pos = RingPos<kStages>::of(i);
            MBarrier::wait(&sm.empty[pos.stage], pos.empty_parity);
            copy_tile<kDSlabs, kKeyTile>(smem_addr(sm.k[pos.stage]), k, p.k_stride_t, i * kKeyTile, s_k, ct, dummy);
            copy_tile<2, kKeyTile>(smem_addr(sm.v[pos.stage]), v, p.v_stride_t, i * kKeyTile, s_k, ct, dummy);
            MBarrier::arrive_on_cp_async_noinc(&sm.full[pos.stage]);
        }
        return;
    }

    // Consumer c owns the CTA's rows 64 c .. 64 c + 63 (padded past `rows`: lse +inf, P = 0).
    setmaxnreg_inc<kDqConsumerRegs>();
    const int c = wg - 1;
    const int c_rows = clamp_to(rows - c * kRows, 0, kRows);
    const int c_t0 = w.t0 + c * kRows;  // the consumer's first row inside the sequence
    const int t = static_cast<int>(threadIdx.x) - wg * kWarpgroupThreads;
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int r[2] = {f.row0, f.row1()};
    float lse2[2];
    float delta[2];
    int limit[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const bool ok = r[rr] < c_rows;
        const int row = q0 + c * kRows + r[rr];
        // A padded row gets lse +inf: P = 0.
        lse2[rr] = ok ? p.lse[w.head * p.lse_stride_h + row] * kLog2e : kInf;
        delta[rr] = ok ? p.delta[w.head * p.delta_stride_h + row] : 0.f;
        limit[rr] = causal ? min(c_t0 + r[rr] + shift, s_k - 1) : s_k - 1;
    }
    const int mask_from = causal ? min(c_t0 + shift, s_k - 1) : s_k - 1;
    float dq[kD / 2];
    zero_regs(dq);
    if (n_tiles > 0) MBarrier::wait(&sm.own_full, 0);
    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q[c]), kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_do = make_wgmma_desc_sw128(smem_addr(sm.d_out[c]), kUnusedLbo, kSw128AtomBytes);
    for (int i = 0; i < n_tiles; ++i) {
        const RingPos<kStages> pos = RingPos<kStages>::of(i);
        MBarrier::wait(&sm.full[pos.stage], pos.full_parity);
        fence_proxy_async_shared();
        const uint32_t k_addr = smem_addr(sm.k[pos.stage]);
        const uint64_t desc_k = make_wgmma_desc_sw128(k_addr, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_v = make_wgmma_desc_sw128(smem_addr(sm.v[pos.stage]), kUnusedLbo, kSw128AtomBytes);
        float s[32];
        float dp[32];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
            const uint32_t off = (ks / 4) * kSlab64 + (ks % 4) * 32;
            wgmma_m64n64k16_ss_kk<E>(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < kDv / 16; ++ks) {
            const uint32_t off = (ks / 4) * kSlab64 + (ks % 4) * 32;
            wgmma_m64n64k16_ss_kk<E>(dp, wgmma_desc_advance(desc_do, off), wgmma_desc_advance(desc_v, off), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        wgmma_fence_regs(dp);
        const bool masked = i * kKeyTile + kKeyTile - 1 > mask_from;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e / 2;
                const int col = i * kKeyTile + f.col(j) + (e % 2);
                const float x = masked && col > limit[rr] ? -kInf : s[4 * j + e];
                const float prob = exp2f(fmaf(x, p.sm_scale_log2, -lse2[rr]));
                dp[4 * j + e] = prob * (dp[4 * j + e] - delta[rr]);  // dS
            }
        }
        uint32_t ds[kKeyTile / 16][4];
        to_frags<E>(dp, ds);
        wgmma_fence();
        mma_rs_mn<E, kD>(dq, ds, k_addr, kSlab64);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dq);
        release_by_warp(&sm.empty[pos.stage], lane);
    }
    store_rows<E, kD>(p.d_q + (q0 + c * kRows) * p.d_q_stride_t + w.head * p.d_q_stride_h, p.d_q_stride_t, c_rows,
                      f, dq, p.sm_scale);
}

// ---------------------------------------------------------------------------------------------------------------
// dK / dV

template <int kD, class E>
__device__ __forceinline__ void dkv_kernel(const DensePrefillBwdParams& p, uint8_t* smem) {
    using Plan = DkvPlan<kD>;
    constexpr int kDSlabs = Plan::kDSlabs;
    constexpr int kQ = Plan::kQ;
    constexpr uint32_t kQSlab = kQuerySlab<kD>;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.k_tiles) * p.h_k) return;
    Plan& sm = plan_of<Plan>(smem);
    begin_cta<kRows, 1>(sm, p.batch, p.cu_seqlens_k, p.total_k, p.k_tiles, p.cu_seqlens_q, p.total_q);
    const SeqTile w = sm.work;
    if (!w.found) return;
    const int q0 = sm.other_start;
    const int s_q = sm.other_len;
    const int keys = min(kRows, w.len - w.t0);
    const int k0 = w.start + w.t0;
    const int shift = w.len - s_q;
    const bool causal = (p.flags & kFlagCausal) != 0;
    // Query tiles that see any of the CTA's keys: under the mask, row r sees key c iff c <= r + shift.
    const int first_row = causal ? clamp_to(w.t0 - shift, 0, s_q) : 0;
    const int m_first = first_row / kQ;
    const int m_count = (s_q + kQ - 1) / kQ - m_first;
    const int n_iter = m_count > 0 ? m_count * p.h_per_k : 0;

    if (threadIdx.x < kWarpgroupThreads) {  // producer
        if (n_iter == 0) return;
        const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
        const uint16_t* dummy = p.q;
        copy_tile<kDSlabs, kRows>(smem_addr(sm.k), p.k + k0 * p.k_stride_t + w.head * p.k_stride_h, p.k_stride_t, 0,
                                  keys, ct, dummy);
        copy_tile<2, kRows>(smem_addr(sm.v), p.v + k0 * p.v_stride_t + w.head * p.v_stride_h, p.v_stride_t, 0, keys,
                            ct, dummy);
        MBarrier::arrive_on_cp_async_noinc(&sm.own_full);
        for (int it = 0; it < n_iter; ++it) {
            const int head = w.head * p.h_per_k + it / m_count;
            const int m0 = (m_first + it % m_count) * kQ;
            const RingPos<kStages> pos = RingPos<kStages>::of(it);
            MBarrier::wait(&sm.empty[pos.stage], pos.empty_parity);
            const int64_t row0 = static_cast<int64_t>(q0) + m0;
            copy_tile<kDSlabs, kQ>(smem_addr(sm.q[pos.stage]), p.q + row0 * p.q_stride_t + head * p.q_stride_h,
                                           p.q_stride_t, 0, s_q - m0, ct, dummy);
            copy_tile<2, kQ>(smem_addr(sm.d_out[pos.stage]),
                                     p.d_out + row0 * p.d_out_stride_t + head * p.d_out_stride_h, p.d_out_stride_t, 0,
                                     s_q - m0, ct, dummy);
            const int tid = static_cast<int>(threadIdx.x);
            if (tid < 2 * kQ) {  // threads 0..kQ-1: lse, kQ..2kQ-1: delta; rows past the sequence read 0
                const int rr = tid % kQ;
                const bool ok = m0 + rr < s_q;
                if (tid < kQ) {
                    const float* src = ok ? p.lse + head * p.lse_stride_h + row0 + rr : p.lse;
                    cp_async_4_zfill(smem_addr(&sm.lse[pos.stage][rr]), src, ok);
                } else {
                    const float* src = ok ? p.delta + head * p.delta_stride_h + row0 + rr : p.delta;
                    cp_async_4_zfill(smem_addr(&sm.delta[pos.stage][rr]), src, ok);
                }
            }
            MBarrier::arrive_on_cp_async_noinc(&sm.full[pos.stage]);
        }
        return;
    }

    // Consumer: rows of S^T are the CTA's keys, columns the tile's query rows.
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads;
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int key[2] = {w.t0 + f.row0, w.t0 + f.row1()};  // keys inside the sequence
    float dk[kD / 2];
    float dv[kDv / 2];
    zero_regs(dk);
    zero_regs(dv);
    if (n_iter > 0) MBarrier::wait(&sm.own_full, 0);
    const uint64_t desc_k = make_wgmma_desc_sw128(smem_addr(sm.k), kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_v = make_wgmma_desc_sw128(smem_addr(sm.v), kUnusedLbo, kSw128AtomBytes);
    for (int it = 0; it < n_iter; ++it) {
        const int m0 = (m_first + it % m_count) * kQ;
        const RingPos<kStages> pos = RingPos<kStages>::of(it);
        MBarrier::wait(&sm.full[pos.stage], pos.full_parity);
        fence_proxy_async_shared();
        const uint32_t q_addr = smem_addr(sm.q[pos.stage]);
        const uint32_t do_addr = smem_addr(sm.d_out[pos.stage]);
        const uint64_t desc_q = make_wgmma_desc_sw128(q_addr, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_do = make_wgmma_desc_sw128(do_addr, kUnusedLbo, kSw128AtomBytes);
        float s[kQ / 2];
        float dp[kQ / 2];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
            const uint32_t off_k = (ks / 4) * kSlab64 + (ks % 4) * 32;
            const uint32_t off_q = (ks / 4) * kQSlab + (ks % 4) * 32;
            mma_ss_kk<E>(s, wgmma_desc_advance(desc_k, off_k), wgmma_desc_advance(desc_q, off_q), ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < kDv / 16; ++ks) {
            const uint32_t off_v = (ks / 4) * kSlab64 + (ks % 4) * 32;
            const uint32_t off_o = (ks / 4) * kQSlab + (ks % 4) * 32;
            mma_ss_kk<E>(dp, wgmma_desc_advance(desc_v, off_v), wgmma_desc_advance(desc_do, off_o), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        wgmma_fence_regs(dp);
        // Under the mask, key c and query row r pair iff c <= r + shift; tiles wholly below the diagonal skip it.
        const bool masked = causal && w.t0 + kRows - 1 > m0 + shift;
#pragma unroll
        for (int j = 0; j < kQ / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e / 2;
                const int col = f.col(j) + (e % 2);  // query row m0 + col
                const float lse2 = sm.lse[pos.stage][col] * kLog2e;
                const float x = masked && key[rr] > m0 + col + shift ? -kInf : s[4 * j + e];
                const float prob = exp2f(fmaf(x, p.sm_scale_log2, -lse2));
                s[4 * j + e] = prob;
                dp[4 * j + e] = prob * (dp[4 * j + e] - sm.delta[pos.stage][col]);  // dS^T
            }
        }
        uint32_t pt[kQ / 16][4];
        uint32_t dst[kQ / 16][4];
        to_frags<E>(s, pt);
        to_frags<E>(dp, dst);
        wgmma_fence();
        mma_rs_mn<E, kDv>(dv, pt, do_addr, kQSlab);
        mma_rs_mn<E, kD>(dk, dst, q_addr, kQSlab);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dv);
        wgmma_fence_regs(dk);
        release_by_warp(&sm.empty[pos.stage], lane);
    }
    store_rows<E, kD>(p.d_k + k0 * p.d_k_stride_t + w.head * p.d_k_stride_h, p.d_k_stride_t, keys, f, dk,
                      p.sm_scale);
    store_rows<E, kDv>(p.d_v + k0 * p.d_v_stride_t + w.head * p.d_v_stride_h, p.d_v_stride_t, keys, f, dv, 1.f);
}

}  // namespace flashmla::dense_prefill::bwd
