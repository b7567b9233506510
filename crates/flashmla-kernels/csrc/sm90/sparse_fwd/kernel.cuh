// Sparse MLA prefill forward for sm_90a (SPEC section 1). docs/sparse-fwd.md has the design: shared-memory
// plan, warp roles, barrier protocol, masking.
//
// One CTA = one query token x one group of 64 heads; 3 warpgroups:
//   WG 0 (producer): loads Q once, then gathers the token's selected KV rows, 64 per tile, into a 2-stage ring
//                    with cp.async (16-byte chunks placed straight into the 128B-swizzled layout; invalid rows are
//                    zero-filled without being read), completing on mbarriers.
//   WG 1, 2 (consumers c = 0, 1): consumer c computes S = Q K^T for tile rows [32c, 32c + 32) (wgmma 64x32,
//                    K = d_qk), masks invalid rows to -inf, exchanges row maxima with the other consumer through
//                    shared memory, forms P = exp2(S - m) (logits pre-scaled by sm_scale * log2 e), publishes its
//                    bf16 P half, and accumulates O[:, 256c, 256c + 256) += P V over all 64 tile rows (wgmma
//                    64x256: its own P half from registers, the other half from shared memory).
// The epilogue merges the two consumers' row sums, applies the sink, writes out (staged through the Q region
// for 16-byte stores), max_logits and lse.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/mbarrier.cuh"
#include "common/pipeline.cuh"
#include "common/smem_layout.cuh"
#include "common/wgmma.cuh"
#include "sm90/sparse_fwd/config.cuh"
#include "sm90/sparse_fwd/params.h"

namespace flashmla::sparse_fwd {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kInf = __builtin_huge_valf();

using Ring = RingPos<kStages>;

// What one CTA works on; identical in every thread.
struct CtaWork {
    int token;     // query token t
    int head0;     // first head of the group
    int heads;     // heads of the group that exist (1..64); rows >= heads are zero padding
    int topk_eff;  // entries of the index row that take part: min(max(topk_length[t], 0), topk) or topk
    int n_tiles;   // ceil(topk_eff / 64)
};

__device__ __forceinline__ CtaWork cta_work(const SparseFwdParams& p) {
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
// Producer warpgroup.
//
// Thread t copies 16-byte chunk (t % 8) of one 128-byte slab row; the 16 row groups (t / 8) cover 16 rows per
// pass, so pass k handles tile row 16k + t/8. The swizzle phase of a row only depends on row % 8 = (t / 8) % 8,
// so every destination is one per-thread base plus compile-time offsets.

// Index-row entries the thread's 4 rows of tile `tile` refer to; -1 (invalid) past topk_eff, which is never read.
__device__ __forceinline__ void load_tile_indices(const int32_t* idx_row, int tile, int topk_eff, int row_in_pass,
                                                  int (&idx)[kPassesPerTile]) {
#pragma unroll
    for (int k = 0; k < kPassesPerTile; ++k) {
        const int j = tile * kTileRows + k * kRowsPerPass + row_in_pass;
        idx[k] = j < topk_eff ? __ldg(idx_row + j) : -1;
    }
}

template <int kDqk>
__device__ __forceinline__ void producer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w) {
    using C = Config<kDqk>;
    if (w.n_tiles == 0) return;  // consumers will not wait for anything

    const int t = static_cast<int>(threadIdx.x);  // 0..127: the producer is warpgroup 0
    const int row_in_pass = t / kThreadsPerRow;
    const int chunk = t % kThreadsPerRow;
    const uint32_t thread_off = sw128_chunk_offset(row_in_pass, chunk);  // + k * kRowsPerPass * 128 per pass
    const int chunk_elems = chunk * (kSw128ChunkBytes / 2);
    // Source operand of zero-filled copies: never read, but kept inside a mapped tensor anyway. q[0, 0, :] exists
    // whenever a CTA runs (s_q >= 1, h_q >= 1); kv may be empty (s_kv = 0).
    const uint16_t* const dummy_src = p.q;

    // Q [64 heads x d_qk] -> sm.q (rows past h_q zero-filled).
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
            for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
                cp_async_16_zfill(q_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                                  src + slab * kSw128ColsBf16, ok);
            }
        }
        MBarrier::arrive_on_cp_async(&sm.q_full);
        MBarrier::arrive(&sm.q_full);
    }

    // KV tiles. Indices of tile i + 1 are loaded while tile i's copies are issued.
    const int32_t* idx_row = p.indices + static_cast<int64_t>(w.token) * p.indices_stride_t;
    int idx_next[kPassesPerTile];
    load_tile_indices(idx_row, 0, w.topk_eff, row_in_pass, idx_next);
    const uint32_t kv_base = smem_addr(sm.kv[0]) + thread_off;
    for (int i = 0; i < w.n_tiles; ++i) {
        int idx[kPassesPerTile];
#pragma unroll
        for (int k = 0; k < kPassesPerTile; ++k) idx[k] = idx_next[k];
        if (i + 1 < w.n_tiles) load_tile_indices(idx_row, i + 1, w.topk_eff, row_in_pass, idx_next);

        const Ring pos = Ring::of(i);
        MBarrier::wait(&sm.kv_empty[pos.stage], pos.empty_parity);
        const uint32_t stage_base = kv_base + pos.stage * C::kStageBytes;
#pragma unroll
        for (int half = 0; half < kConsumers; ++half) {
#pragma unroll
            for (int pp = 0; pp < kPassesPerHalf; ++pp) {
                const int k = half * kPassesPerHalf + pp;
                const int r = k * kRowsPerPass + row_in_pass;
                // Invalid: any value < 0 or >= s_kv (including the -1 of the tail). Never dereferenced.
                const bool ok = idx[k] >= 0 && idx[k] < p.s_kv;
                const uint16_t* row = ok ? p.kv + static_cast<int64_t>(idx[k]) * p.kv_stride_t : dummy_src;
                const uint16_t* src = row + chunk_elems;
#pragma unroll
                for (int slab = 0; slab < C::kDqkSlabs; ++slab) {
                    cp_async_16_zfill(stage_base + slab * C::kSlabBytes + k * kRowsPerPass * kSw128RowBytes,
                                      src + slab * kSw128ColsBf16, ok);
                }
                if (chunk == 0) sm.valid[pos.stage][r] = ok ? 1 : 0;
            }
            // Completes once all 128 threads arrived and every copy issued so far has landed.
            MBarrier::arrive_on_cp_async(&sm.kv_full[pos.stage][half]);
            MBarrier::arrive(&sm.kv_full[pos.stage][half]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroups.

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

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

// Shapes of the consumer's register tiles.
inline constexpr int kSRegs = kHeadsPerCta * kHalfRows / kWarpgroupThreads;      // 16: S half, 64 x 32 f32
inline constexpr int kORegs = kHeadsPerCta * kDvPerConsumer / kWarpgroupThreads;  // 128: O part, 64 x 256 f32
inline constexpr int kPvSteps = kHalfRows / 16;                                    // 2 k-steps of 16 rows per half

template <int kDqk>
__device__ __forceinline__ void consumer(const SparseFwdParams& p, SmemPlan<kDqk>& sm, const CtaWork& w,
                                         const int cw) {
    using C = Config<kDqk>;
    const int other = cw ^ 1;
    const int t = static_cast<int>(threadIdx.x) - kWarpgroupThreads * (1 + cw);  // 0..127 in this warpgroup
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int rows[2] = {f.row0, f.row1()};

    const uint32_t q_addr = smem_addr(sm.q);
    const uint32_t kv_addr = smem_addr(sm.kv[0]);
    const uint32_t p_addr = smem_addr(sm.p);
    constexpr uint32_t kUnusedLbo = 16;  // K-major SW128 operands ignore LBO
    const uint64_t desc_q = make_wgmma_desc_sw128(q_addr, kUnusedLbo, kSw128AtomBytes);

    float o[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
    float row_max[2] = {-kInf, -kInf};  // running max of the base-2 logits (identical in both consumers)
    float row_sum[2] = {0.f, 0.f};      // this thread's partial sum of P over its own columns

    if (w.n_tiles > 0) MBarrier::wait(&sm.q_full, 0);

    for (int i = 0; i < w.n_tiles; ++i) {
        const Ring pos = Ring::of(i);
        const uint32_t stage_addr = kv_addr + pos.stage * C::kStageBytes;

        // ---- S = Q K^T over this consumer's 32 tile rows.
        MBarrier::wait(&sm.kv_full[pos.stage][cw], pos.full_parity);
        fence_proxy_async_shared();  // cp.async (generic proxy) wrote the tile; wgmma reads it (async proxy)
        float s[kSRegs];
#pragma unroll
        for (int k = 0; k < kSRegs; ++k) s[k] = 0.f;
        const uint64_t desc_k =
            make_wgmma_desc_sw128(stage_addr + cw * kHalfRows * kSw128RowBytes, kUnusedLbo, kSw128AtomBytes);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::kQkSteps; ++ks) {
            // k-step ks covers d columns [16 ks, 16 ks + 16): slab ks / 4, 32-byte step ks % 4 inside its rows.
            const uint32_t off = (ks / 4) * C::kSlabBytes + (ks % 4) * 32;
            wgmma_m64n32k16_ss_kk(s, wgmma_desc_advance(desc_q, off), wgmma_desc_advance(desc_k, off), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(s);

        // ---- Mask and scale: column n of S is tile row 32 cw + n. Invalid rows (bad index, tail) -> -inf.
        const uint8_t* vflags = sm.valid[pos.stage] + cw * kHalfRows;
        float mx[2] = {-kInf, -kInf};
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
            const uint32_t v = *reinterpret_cast<const uint16_t*>(vflags + f.col(j));
            const bool va = (v & 0xFFu) != 0;
            const bool vb = (v >> 8) != 0;
            s[4 * j + 0] = va ? s[4 * j + 0] * p.sm_scale_log2 : -kInf;
            s[4 * j + 1] = vb ? s[4 * j + 1] * p.sm_scale_log2 : -kInf;
            s[4 * j + 2] = va ? s[4 * j + 2] * p.sm_scale_log2 : -kInf;
            s[4 * j + 3] = vb ? s[4 * j + 3] * p.sm_scale_log2 : -kInf;
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * j + 0], s[4 * j + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        mx[0] = quad_max(mx[0]);
        mx[1] = quad_max(mx[1]);

        // ---- Row maxima of the whole 64-row tile: exchange halves with the other consumer.
        if (f.quad == 0) {
            sm.red[cw][rows[0]] = mx[0];
            sm.red[cw][rows[1]] = mx[1];
        }
        named_barrier_sync(Bar::RowMaxReady, kConsumerThreads);
        float alpha[2];
        float m_use[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            // Same operands in both consumers (max is exact and commutative), so both get the same new max.
            const float m_new = fmaxf(row_max[rr], fmaxf(mx[rr], sm.red[other][rows[rr]]));
            m_use[rr] = m_new == -kInf ? 0.f : m_new;  // a row with nothing valid yet: keep exp2 away from NaN
            alpha[rr] = exp2f(row_max[rr] - m_use[rr]);
            row_max[rr] = m_new;
        }

        // ---- P = exp2(S - m); row-sum partials; rescale O when some row's max moved.
        float psum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
            s[4 * j + 0] = exp2f(s[4 * j + 0] - m_use[0]);
            s[4 * j + 1] = exp2f(s[4 * j + 1] - m_use[0]);
            s[4 * j + 2] = exp2f(s[4 * j + 2] - m_use[1]);
            s[4 * j + 3] = exp2f(s[4 * j + 3] - m_use[1]);
            psum[0] += s[4 * j + 0] + s[4 * j + 1];
            psum[1] += s[4 * j + 2] + s[4 * j + 3];
        }
        row_sum[0] = row_sum[0] * alpha[0] + psum[0];
        row_sum[1] = row_sum[1] * alpha[1] + psum[1];
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < kORegs / 4; ++j) {
                o[4 * j + 0] *= alpha[0];
                o[4 * j + 1] *= alpha[0];
                o[4 * j + 2] *= alpha[1];
                o[4 * j + 3] *= alpha[1];
            }
        }

        // ---- P half to bf16: as register A fragments (own rows of V) and into sm.p for the other consumer.
        // PV also reads V rows of the other half: observe their barrier too (complete by now in practice), so
        // the single proxy fence below covers both those cp.async writes and this thread's P stores.
        MBarrier::wait(&sm.kv_full[pos.stage][other], pos.full_parity);
        uint32_t pa[kPvSteps][4];
#pragma unroll
        for (int kb = 0; kb < kPvSteps; ++kb) {
            pa[kb][0] = pack_bf16x2(s[8 * kb + 0], s[8 * kb + 1]);
            pa[kb][1] = pack_bf16x2(s[8 * kb + 2], s[8 * kb + 3]);
            pa[kb][2] = pack_bf16x2(s[8 * kb + 4], s[8 * kb + 5]);
            pa[kb][3] = pack_bf16x2(s[8 * kb + 6], s[8 * kb + 7]);
        }
#pragma unroll
        for (int j = 0; j < kSRegs / 4; ++j) {
            // P column 32 cw + 8 j + 2 q: chunk 4 cw + j of the 128-byte row, byte 4 q inside it.
            const int pchunk = cw * (kHalfRows / 8) + j;
            st_shared_u32(p_addr + sw128_chunk_offset(rows[0], pchunk) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 0]);
            st_shared_u32(p_addr + sw128_chunk_offset(rows[1], pchunk) + 4 * f.quad, pa[j / 2][(j % 2) * 2 + 1]);
        }
        fence_proxy_async_shared();  // generic writes (P stores, other half's cp.async) -> wgmma reads (async)

        // ---- O[:, 256 cw, 256 cw + 256) += P V over all 64 tile rows: own P half from registers first, then,
        // once the other consumer published its half, the rest from sm.p.
        const uint32_t v_addr = stage_addr + cw * (kDvPerConsumer / kSw128ColsBf16) * C::kSlabBytes;
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < kPvSteps; ++kb) {
            const int row0 = cw * kHalfRows + kb * 16;
            const uint64_t desc_v = make_wgmma_desc_sw128(v_addr + row0 * kSw128RowBytes, C::kSlabBytes,
                                                          kSw128AtomBytes);
            wgmma_m64n256k16_rs_mn(o, pa[kb], desc_v, true);
        }
        named_barrier_sync(Bar::PReady, kConsumerThreads);
#pragma unroll
        for (int kb = 0; kb < kPvSteps; ++kb) {
            const int row0 = other * kHalfRows + kb * 16;
            const uint64_t desc_p = make_wgmma_desc_sw128(p_addr + (row0 * 2), kUnusedLbo, kSw128AtomBytes);
            const uint64_t desc_v = make_wgmma_desc_sw128(v_addr + row0 * kSw128RowBytes, C::kSlabBytes,
                                                          kSw128AtomBytes);
            wgmma_m64n256k16_ss_kmn(o, desc_p, desc_v, true);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        wgmma_fence_regs(pa[0]);
        wgmma_fence_regs(pa[1]);

        // ---- Release the stage: one arrival per consumer warp.
        __syncwarp();
        if (lane == 0) MBarrier::arrive(&sm.kv_empty[pos.stage]);
    }

    // ---- Epilogue. Row sums: quad, then across consumers (red[] is free: the last maxima were read before
    // the last PReady, which both consumers have passed).
    float lsum[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};
    if (f.quad == 0) {
        sm.red[cw][rows[0]] = lsum[0];
        sm.red[cw][rows[1]] = lsum[1];
    }
    named_barrier_sync(Bar::RowSumReady, kConsumerThreads);

    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int head = w.head0 + rows[rr];
        const bool exists = rows[rr] < w.heads;
        const float l = sm.red[0][rows[rr]] + sm.red[1][rows[rr]];
        const float m = row_max[rr];
        const bool empty = m == -kInf;  // no valid entry: out 0, lse +inf, max_logits -inf
        float denom = l;
        if (p.attn_sink != nullptr && exists && !empty) {
            // The sink is one more logit with a zero value vector: it only enlarges the denominator.
            const float sink = __ldg(p.attn_sink + static_cast<int64_t>(head) * p.attn_sink_stride);
            denom += exp2f(sink * kLog2e - m);
        }
        inv[rr] = empty ? 0.f : 1.f / denom;
        if (cw == 0 && f.quad == 0 && exists) {
            const int64_t tok = w.token;
            p.max_logits[tok * p.max_logits_stride_t + head * p.max_logits_stride_h] = empty ? -kInf : m * kLn2;
            p.lse[tok * p.lse_stride_t + head * p.lse_stride_h] = empty ? kInf : (m + log2f(l)) * kLn2;
        }
    }

    // O tile (bf16) -> Q region, row-major 64 x 1024 B with the chunk swizzle chunk ^ (row % 8) (conflict-free
    // for both the fragment writes and the row-chunk reads). Every wgmma read of Q completed before RowSumReady.
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
        const int chunk = cw * (kDvPerConsumer / 8) + j;  // column 256 cw + 8 j + 2 q
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const uint32_t addr = q_addr + rows[rr] * C::kStagingRowBytes +
                                  ((chunk ^ (rows[rr] % kSw128AtomRows)) * kSw128ChunkBytes) + 4 * f.quad;
            st_shared_u32(addr, pack_bf16x2(o[4 * j + 2 * rr] * inv[rr], o[4 * j + 2 * rr + 1] * inv[rr]));
        }
    }
    named_barrier_sync(Bar::StagingReady, kConsumerThreads);

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

// ---------------------------------------------------------------------------------------------------------------
// The kernel body (instantiated by sparse_fwd.cu per d_qk). `smem` is the dynamic shared memory.
template <int kDqk>
__device__ __forceinline__ void sparse_fwd(const SparseFwdParams& p, uint8_t* smem) {
    using Plan = SmemPlan<kDqk>;
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
            for (int h = 0; h < kConsumers; ++h) MBarrier::init(&sm.kv_full[st][h], kWarpgroupThreads);
            MBarrier::init(&sm.kv_empty[st], kConsumerWarps);
        }
    }
    __syncthreads();

    const CtaWork w = cta_work(p);
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        producer<kDqk>(p, sm, w);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consumer<kDqk>(p, sm, w, wg - 1);
    }
}

}  // namespace flashmla::sparse_fwd
