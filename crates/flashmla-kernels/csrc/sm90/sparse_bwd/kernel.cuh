// Sparse MLA prefill backward for sm_90a (SPEC section 2): the main kernel. docs/sparse-bwd.md has the design:
// shared-memory plan, warp roles, barrier protocol, masking, how d_kv is reduced. The small kernels of the family
// (delta pre-pass, accumulator zeroing, d_kv finalisation, sink gradient) are in aux.cuh.
//
// One CTA = one query token t x one group of 64 heads; 3 warpgroups:
//   WG 0 (producer): loads Q [64 x d_qk] and dO [64 x 512] of its heads once, then gathers the token's selected KV
//                    rows, 64 per tile, into ONE shared tile, slab (64 columns) by slab, with cp.async (16-byte
//                    chunks straight into the 128B-swizzled layout; invalid rows zero-filled without being read).
//                    Tile i+1 is gathered as soon as both consumers' dQ(i) retired, i.e. during dKV(i).
//   WG 1, 2 (consumers c = 0, 1), per tile:
//     S_c = Q K_c^T, dP_c = dO V_c^T     over tile rows [32c, 32c + 32)            (wgmma 64x32, K = d_qk / 512)
//     P = exp2(S * sm_scale * log2e - lse2'), 0 for invalid rows; dS' = sm_scale * P * (dP - delta)
//     P, dS' -> bf16: own half as register A fragments, both into shared tiles
//     dQ[:, own slabs] += dS' K          (own rows from registers, the other consumer's from shared memory)
//     -> release the KV tile
//     dKV[:, slab s] = dS'^T Q[:, s] + P^T dO[:, s] for the slabs s this consumer owns (wgmma 64x64, K = heads),
//     then red.global.add.v4.f32 of the 64 x 64 f32 chunk into the accumulator rows (valid rows only).
//   Epilogue: dQ (already scaled by sm_scale) -> bf16, staged through the Q region, coalesced 16-byte stores.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/red_global.cuh"
#include "common/smem_access.cuh"
#include "common/smem_layout.cuh"
#include "common/vec_access.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_m64n64.cuh"
#include "sm90/sparse_bwd/config.cuh"
#include "sm90/sparse_bwd/params.h"

namespace flashmla::sparse_bwd {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kInf = __builtin_huge_valf();

// One KV tile in flight: tile i's barriers complete once per tile (parity i & 1); the producer waits for the
// release of tile i - 1 (parity of a fresh barrier's "previous phase" on i = 0).
using Ring = RingPos<1>;

// What one CTA works on; identical in every thread.
struct CtaWork {
    int token;     // query token t
    int head0;     // first head of the group
    int heads;     // heads of the group that exist (1..64); rows >= heads are zero padding
    int topk_eff;  // entries of the index row that take part: min(max(topk_length[t], 0), topk) or topk
    int n_tiles;   // ceil(topk_eff / 64)
};

__device__ __forceinline__ CtaWork cta_work(const SparseBwdParams& p) {
    CtaWork w;
    const int group = static_cast<int>(blockIdx.x) % p.num_head_groups;
    w.token = static_cast<int>(blockIdx.x) / p.num_head_groups;
    w.head0 = group * kHeadsPerCta;
    w.heads = min(kHeadsPerCta, p.h_q - w.head0);
    w.topk_eff = p.topk;
    if (p.topk_length != nullptr) {
        const int len = __ldg(p.topk_length + static_cast<int64_t>(w.token) * p.topk_length_stride);
        w.topk_eff = min(max(len, 0), p.topk);
    }
    w.n_tiles = (w.topk_eff + kTileRows - 1) / kTileRows;
    return w;
}

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

template <int kDqk>
__device__ __forceinline__ void producer(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    if (w.n_tiles == 0) return;  // consumers wait for nothing

    const int t = static_cast<int>(threadIdx.x);  // 0..127: the producer is warpgroup 0
    const int row_in_pass = t / kThreadsPerRow;
    const int chunk = t % kThreadsPerRow;
    const uint32_t thread_off = sw128_chunk_offset(row_in_pass, chunk);  // + k * kRowsPerPass * 128 per pass
    const int chunk_elems = chunk * (kSw128ChunkBytes / 2);
    // Source operand of zero-filled copies: never read, but kept inside a mapped tensor anyway (q[0, 0, :]
    // exists whenever a CTA runs; kv may be empty).
    const uint16_t* const dummy_src = p.q;

    // Q [64 heads x d_qk] and dO [64 heads x 512] of the group (rows past h_q zero-filled).
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
                cp_async_16_zfill(q_base + slab * C::kSlabBytes + row_off, q_src + slab * kSw128ColsBf16, ok);
            }
#pragma unroll
            for (int slab = 0; slab < C::kDvSlabs; ++slab) {
                cp_async_16_zfill(do_base + slab * C::kSlabBytes + row_off, do_src + slab * kSw128ColsBf16, ok);
            }
        }
        MBarrier::arrive_on_cp_async(&sm.qdo_full);
        MBarrier::arrive(&sm.qdo_full);
    }

    // KV tiles. Indices of tile i + 1 are loaded while tile i is waited for and issued.
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;
    int idx_next[kPassesPerTile];
    load_tile_indices(idx_row, 0, w.topk_eff, row_in_pass, idx_next);
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
        if (i + 1 < w.n_tiles) load_tile_indices(idx_row, i + 1, w.topk_eff, row_in_pass, idx_next);

        // Wait until the previous tile's readers (S, dP, dQ of both consumers) have retired. That also frees
        // row_idx[i & 1]: its last reader, dKV(i - 2), precedes dQ(i - 1) in both consumers.
        const Ring pos = Ring::of(i);
        MBarrier::wait(&sm.kv_empty, pos.empty_parity);
        if (chunk == 0) {
#pragma unroll
            for (int k = 0; k < kPassesPerTile; ++k) sm.row_idx[i & 1][k * kRowsPerPass + row_in_pass] = row[k];
        }
#pragma unroll
        for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
#pragma unroll
            for (int k = 0; k < kPassesPerTile; ++k) {
                cp_async_16_zfill(kv_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                                  src[k] + slab * kSw128ColsBf16, ok[k]);
            }
            // Completes once all 128 threads arrived and every copy they issued so far (slabs <= slab) landed.
            // The first arrival also publishes row_idx (release).
            MBarrier::arrive_on_cp_async(&sm.kv_full[slab]);
            MBarrier::arrive(&sm.kv_full[slab]);
        }
    }
    // Leave no copy of this thread in flight when it exits (the consumers wait for them anyway).
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

// Base-2 log-sum-exp the probabilities are normalised by: lse2' = log2(2^a + 2^b) with a = lse * log2e and
// b = sink * log2e (SPEC 1: the sink is one more logit with a zero value vector). +inf when either is +inf: an
// empty row (lse = +inf) or a +inf sink gives P = exp2(s - inf) = 0 everywhere, without forming inf - inf.
__device__ __forceinline__ float lse2_with_sink(float lse, const float* sink) {
    const float a = lse * kLog2e;
    if (sink == nullptr) return a;
    const float b = __ldg(sink) * kLog2e;
    const float m = fmaxf(a, b);
    if (m == kInf || m == -kInf) return m;
    return m + log1pf(exp2f(-fabsf(a - b))) * kLog2e;  // -inf sink: exp2(-inf) = 0, lse2' = a
}

// dQ accumulator slice of one consumer: 4 slabs (one m64n256 accumulator) or 5 (plus one m64n64).
template <int kSlabs>
struct DqAcc;
template <>
struct DqAcc<4> {
    float a[128];  // columns [64 slab0, 64 slab0 + 256)
};
template <>
struct DqAcc<5> {
    float a[128];  // columns [64 slab0, 64 slab0 + 256)
    float b[32];   // columns [64 (slab0 + 4), 64 (slab0 + 5))
};

// Shapes of the consumer's register tiles.
inline constexpr int kSRegs = kHeadsPerCta * kHalfRows / kWarpgroupThreads;  // 16: S or dP half, 64 x 32 f32
inline constexpr int kSBlocks = kSRegs / 4;                                    // 4 n8 blocks
inline constexpr int kHalfSteps = kHalfRows / 16;                              // 2 k-steps of 16 rows per half
inline constexpr int kChunkRegs = kTileRows * kSw128ColsBf16 / kWarpgroupThreads;  // 32: dKV chunk 64 x 64 f32
inline constexpr int kChunkBlocks = kChunkRegs / 4;                                // 8 n8 blocks
inline constexpr int kN256Slabs = 4;                                               // slabs per m64n256 accumulator
inline constexpr uint32_t kUnusedLbo = 16;  // K-major SW128 operands ignore LBO
inline constexpr uint32_t kKStepMnBytes = 16 * kSw128RowBytes;  // MN-major operands: 16 K rows = 2048 bytes

template <int kDqk, int kCw, bool kDet>
__device__ __forceinline__ void consumer(const SparseBwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    constexpr int kOther = kCw ^ 1;
    constexpr int kDqSlab0 = kCw == 0 ? 0 : C::kDqSlabs0;
    constexpr int kDqSlabs = kCw == 0 ? C::kDqSlabs0 : C::kDqSlabs1;
    static_assert(kDqSlabs == 4 || kDqSlabs == 5, "dQ slices are 4 or 5 slabs");

    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * (1 + kCw);  // 0..127 in this warpgroup
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    // The two accumulator rows this thread owns: heads (S, dP, dQ) and tile rows (dKV) alike.
    const int rows[2] = {f.row0, f.row1()};

    const uint32_t q_addr = smem_addr(sm.q);
    const uint32_t do_addr = smem_addr(sm.d_out);
    const uint32_t kv_addr = smem_addr(sm.kv);
    const uint32_t p_addr = smem_addr(sm.p);
    const uint32_t ds_addr = smem_addr(sm.ds);

    // ---- Per-row statistics. Padding heads (>= h_q) get lse2' = +inf, so P = dS = 0 on their rows.
    float lse2[2];
    float delta[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int64_t head = w.head0 + rows[rr];
        const int64_t tok = w.token;
        if (rows[rr] < w.heads) {
            const float lse = __ldg(p.lse + tok * p.lse_stride_t + head * p.lse_stride_h);
            const float* sink = p.attn_sink != nullptr ? p.attn_sink + head * p.attn_sink_stride : nullptr;
            lse2[rr] = lse2_with_sink(lse, sink);
            delta[rr] = p.delta[tok * p.delta_stride_t + head * p.delta_stride_h];  // written by the pre-pass
        } else {
            lse2[rr] = kInf;
            delta[rr] = 0.f;
        }
    }

    DqAcc<kDqSlabs> dq;
#pragma unroll
    for (int k = 0; k < 128; ++k) dq.a[k] = 0.f;
    if constexpr (kDqSlabs == 5) {
#pragma unroll
        for (int k = 0; k < 32; ++k) dq.b[k] = 0.f;
    }

    if (w.n_tiles > 0) {
        MBarrier::wait(&sm.qdo_full, 0);
        fence_proxy_async_shared();  // cp.async (generic proxy) wrote Q, dO; wgmma reads them (async proxy)
    }
    const uint64_t desc_q = make_wgmma_desc_sw128(q_addr, kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_do = make_wgmma_desc_sw128(do_addr, kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_k = make_wgmma_desc_sw128(kv_addr + kCw * kHalfRows * kSw128RowBytes, kUnusedLbo,
                                                  kSw128AtomBytes);

    for (int i = 0; i < w.n_tiles; ++i) {
        const Ring pos = Ring::of(i);
        const int32_t* ridx = sm.row_idx[i & 1];

        // ---- S = Q K^T and dP = dO V^T over this consumer's 32 tile rows, slab by slab as the gather lands.
        float s[kSRegs];
        float dp[kSRegs];
#pragma unroll
        for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
            MBarrier::wait(&sm.kv_full[slab], pos.full_parity);
            fence_proxy_async_shared();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < C::kStepsPerSlab; ++kk) {
                // d columns [64 slab + 16 kk, +16): 32-byte step kk inside the slab's 128-byte rows.
                const uint32_t off = slab * C::kSlabBytes + kk * 32;
                const bool acc = slab > 0 || kk > 0;
                wgmma_m64n32k16_ss_kk(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), acc);
                if (slab < C::kDvSlabs) {
                    wgmma_m64n32k16_ss_kk(dp, wgmma_desc_advance(desc_do, off), wgmma_desc_advance(desc_k, off),
                                          acc);
                }
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(s);
        wgmma_fence_regs(dp);

        // ---- P and dS' = sm_scale * P * (dP - delta). Column n of S is tile row 32 c + n; invalid rows (bad
        // index, tail) get P = 0 by a select, so nothing from a zero-filled row (or an inf/NaN logit) leaks.
        uint32_t p_pk[kSBlocks][2];   // bf16x2 of P per n8 block j and row rr
        uint32_t ds_pk[kSBlocks][2];  // bf16x2 of dS'
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) {
            const int2 rid = *reinterpret_cast<const int2*>(ridx + kCw * kHalfRows + f.col(j));
            const bool va = rid.x >= 0;
            const bool vb = rid.y >= 0;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float p0 = va ? exp2f(fmaf(s[4 * j + 2 * rr], p.sm_scale_log2, -lse2[rr])) : 0.f;
                const float p1 = vb ? exp2f(fmaf(s[4 * j + 2 * rr + 1], p.sm_scale_log2, -lse2[rr])) : 0.f;
                const float d0 = p.sm_scale * p0 * (dp[4 * j + 2 * rr] - delta[rr]);
                const float d1 = p.sm_scale * p1 * (dp[4 * j + 2 * rr + 1] - delta[rr]);
                p_pk[j][rr] = pack_bf16x2(p0, p1);
                ds_pk[j][rr] = pack_bf16x2(d0, d1);
            }
        }
        // dS' of this consumer's rows as register A fragments (smem_layout.cuh): k-step kb covers n8 blocks 2kb, 2kb+1.
        uint32_t pa[kHalfSteps][4];
#pragma unroll
        for (int kb = 0; kb < kHalfSteps; ++kb) {
            pa[kb][0] = ds_pk[2 * kb][0];
            pa[kb][1] = ds_pk[2 * kb][1];
            pa[kb][2] = ds_pk[2 * kb + 1][0];
            pa[kb][3] = ds_pk[2 * kb + 1][1];
        }

        // ---- Publish P and dS' halves. The tiles are free once both consumers' dKV(i - 1) retired.
        if (i > 0) named_barrier_sync(Bar::PdsFree, kConsumerThreads);
#pragma unroll
        for (int j = 0; j < kSBlocks; ++j) {
            // Column 32 c + 8 j + 2 q: chunk 4 c + j of the 128-byte row, byte 4 q inside it.
            const int chunk = kCw * (kHalfRows / 8) + j;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t off = sw128_chunk_offset(rows[rr], chunk) + 4 * f.quad;
                st_shared_u32(p_addr + off, p_pk[j][rr]);
                st_shared_u32(ds_addr + off, ds_pk[j][rr]);
            }
        }
        fence_proxy_async_shared();  // generic P/dS' stores -> wgmma reads (async proxy)

        // ---- dQ[:, own slabs] += dS' K over all 64 tile rows: own rows from registers first, then, once the
        // other consumer published its half, its rows from shared memory. K read MN-major (LBO = next slab).
        const uint32_t k_slab0 = kv_addr + kDqSlab0 * C::kSlabBytes;
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < kHalfSteps; ++kb) {
            const int row0 = kCw * kHalfRows + kb * 16;
            const uint64_t desc_b = make_wgmma_desc_sw128(k_slab0 + row0 * kSw128RowBytes, C::kSlabBytes,
                                                          kSw128AtomBytes);
            wgmma_m64n256k16_rs_mn(dq.a, pa[kb], desc_b, true);
            if constexpr (kDqSlabs == 5) {
                wgmma_m64n64k16_rs_mn(dq.b, pa[kb], wgmma_desc_advance(desc_b, kN256Slabs * C::kSlabBytes), true);
            }
        }
        named_barrier_sync(Bar::DsReady, kConsumerThreads);
#pragma unroll
        for (int kb = 0; kb < kHalfSteps; ++kb) {
            const int row0 = kOther * kHalfRows + kb * 16;
            const uint64_t desc_a = make_wgmma_desc_sw128(ds_addr + row0 * 2, kUnusedLbo, kSw128AtomBytes);
            const uint64_t desc_b = make_wgmma_desc_sw128(k_slab0 + row0 * kSw128RowBytes, C::kSlabBytes,
                                                          kSw128AtomBytes);
            wgmma_m64n256k16_ss_kmn(dq.a, desc_a, desc_b, true);
            if constexpr (kDqSlabs == 5) {
                wgmma_m64n64k16_ss_kmn(dq.b, desc_a, wgmma_desc_advance(desc_b, kN256Slabs * C::kSlabBytes),
                                       true);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dq.a);
        if constexpr (kDqSlabs == 5) wgmma_fence_regs(dq.b);
        wgmma_fence_regs(pa[0]);
        wgmma_fence_regs(pa[1]);

        // ---- Release the KV tile (S, dP, dQ of this warp retired): one arrival per consumer warp.
        __syncwarp();
        if (lane == 0) MBarrier::arrive(&sm.kv_empty);

        // ---- dKV chunks this consumer owns: dKV[:, slab s] = dS'^T Q[:, s] + P^T dO[:, s] (K = 64 heads; A is
        // the transpose of the stored [head][row] tiles, B the stored [head][d] slabs: both MN-major).
        // Accumulator rows are tile rows rows[0], rows[1]; invalid rows form no address and write nothing.
        //   f32 (default): lanes q and q ^ 1 swap halves so that each holds 4 consecutive columns of one row
        //                  (even q row rows[0], odd q row rows[1], columns 8 j + 4 (q >> 1)): one 16-byte
        //                  red.global.add.v4.f32 per n8 block.
        //   kDet:          each value -> signed 64-bit fixed point (2^-32 units) and red.global.add.u64: integer
        //                  adds commute, so the sum is the same bits in any order.
        const bool odd = (f.quad & 1) != 0;
        const int kv_row = ridx[odd ? rows[1] : rows[0]];
        const bool red_ok = kv_row >= 0;
        float* const dst = p.dkv_acc + static_cast<int64_t>(red_ok ? kv_row : 0) * p.dkv_acc_stride +
                           4 * (f.quad >> 1);
        int64_t* dst_fx[2];
        bool row_ok[2];
        if constexpr (kDet) {
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int r = ridx[rows[rr]];
                row_ok[rr] = r >= 0;
                dst_fx[rr] = reinterpret_cast<int64_t*>(p.dkv_acc) +
                             static_cast<int64_t>(row_ok[rr] ? r : 0) * p.dkv_acc_stride + 2 * f.quad;
            }
        }
#pragma unroll
        for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
            if (dkv_chunk_owner(slab) != kCw) continue;  // compile-time after unrolling
            float acc[kChunkRegs];
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < kHeadsPerCta / 16; ++ks) {
                const uint64_t desc_a = make_wgmma_desc_sw128(ds_addr + ks * kKStepMnBytes, C::kSlabBytes,
                                                              kSw128AtomBytes);
                const uint64_t desc_b = make_wgmma_desc_sw128(q_addr + slab * C::kSlabBytes + ks * kKStepMnBytes,
                                                              C::kSlabBytes, kSw128AtomBytes);
                wgmma_m64n64k16_ss_mnmn(acc, desc_a, desc_b, ks > 0);
            }
            if (slab < C::kDvSlabs) {
#pragma unroll
                for (int ks = 0; ks < kHeadsPerCta / 16; ++ks) {
                    const uint64_t desc_a = make_wgmma_desc_sw128(p_addr + ks * kKStepMnBytes, C::kSlabBytes,
                                                                  kSw128AtomBytes);
                    const uint64_t desc_b = make_wgmma_desc_sw128(
                        do_addr + slab * C::kSlabBytes + ks * kKStepMnBytes, C::kSlabBytes, kSw128AtomBytes);
                    wgmma_m64n64k16_ss_mnmn(acc, desc_a, desc_b, true);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(acc);
            if constexpr (kDet) {
#pragma unroll
                for (int j = 0; j < kChunkBlocks; ++j) {
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        if (!row_ok[rr]) continue;
                        int64_t* d = dst_fx[rr] + slab * kSw128ColsBf16 + 8 * j;
                        red_add_s64(d, to_fixed_point(acc[4 * j + 2 * rr]));
                        red_add_s64(d + 1, to_fixed_point(acc[4 * j + 2 * rr + 1]));
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < kChunkBlocks; ++j) {
                    const float sx = odd ? acc[4 * j + 0] : acc[4 * j + 2];
                    const float sy = odd ? acc[4 * j + 1] : acc[4 * j + 3];
                    const float rx = __shfl_xor_sync(0xffffffffu, sx, 1);
                    const float ry = __shfl_xor_sync(0xffffffffu, sy, 1);
                    const float4 v = odd ? make_float4(rx, ry, acc[4 * j + 2], acc[4 * j + 3])
                                         : make_float4(acc[4 * j + 0], acc[4 * j + 1], rx, ry);
                    if (red_ok) red_add_v4_f32(dst + slab * kSw128ColsBf16 + 8 * j, v);
                }
            }
        }
    }

    // ---- Epilogue: dQ (sm_scale already folded into dS') -> bf16 tile in the Q region, row-major with the chunk
    // swizzle chunk ^ (row % 8) (conflict-free fragment writes and row-chunk reads), then 16-byte stores.
    named_barrier_sync(Bar::MmaDone, kConsumerThreads);  // every wgmma read of Q (dKV) of both consumers retired
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
    if constexpr (kDqSlabs == 5) {
#pragma unroll
        for (int j = 0; j < 32 / 4; ++j) {
            const int col = (kDqSlab0 + kN256Slabs) * kSw128ColsBf16 + f.col(j);
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t addr = q_addr + rows[rr] * C::kStagingRowBytes +
                                      (((col / 8) ^ (rows[rr] % kSw128AtomRows)) * kSw128ChunkBytes) + 4 * f.quad;
                st_shared_u32(addr, pack_bf16x2(dq.b[4 * j + 2 * rr], dq.b[4 * j + 2 * rr + 1]));
            }
        }
    }
    named_barrier_sync(Bar::StagingReady, kConsumerThreads);

    const int ct = static_cast<int>(threadIdx.x) - kWarpgroupThreads;  // 0..255 over both consumers
    const bool vec16 = (p.flags & kFlagDqVec16) != 0;
    uint16_t* d_q_tok = p.d_q + static_cast<int64_t>(w.token) * p.d_q_stride_t;
    constexpr int kChunks = kHeadsPerCta * C::kStagingChunksPerRow;
#pragma unroll 4
    for (int id = ct; id < kChunks; id += kConsumerThreads) {
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

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by sparse_bwd.cu per d_qk, f32 or fixed-point d_kv reduction). `smem` is the
// dynamic shared memory.
template <int kDqk, bool kDet>
__device__ __forceinline__ void sparse_bwd_main(const SparseBwdParams& p, uint8_t* smem) {
    using Plan = SmemPlan<kDqk>;
    using C = Config<kDqk>;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.s_q) * p.num_head_groups) return;

    // Round the plan's base up to 1024 bytes (SW128 operand tiles); the launch requested the slack.
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // launch asked for less than kSmemBytes<kDqk>
    Plan& sm = *reinterpret_cast<Plan*>(smem + pad);

    if (threadIdx.x == 0) {
        MBarrier::init(&sm.qdo_full, kWarpgroupThreads);
#pragma unroll
        for (int s = 0; s < C::kDqkSlabs; ++s) MBarrier::init(&sm.kv_full[s], kWarpgroupThreads);
        MBarrier::init(&sm.kv_empty, kConsumerWarps);
    }
    __syncthreads();

    const CtaWork w = cta_work(p);
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kDqk>(p, sm, w);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        if (wg == 1) {
            consumer<kDqk, 0, kDet>(p, sm, w);
        } else {
            consumer<kDqk, 1, kDet>(p, sm, w);
        }
    }
}

}  // namespace flashmla::sparse_bwd
