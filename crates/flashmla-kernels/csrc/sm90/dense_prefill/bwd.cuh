// Dense varlen prefill backward for sm_90a (docs/spec.md section 5; design in docs/dense-prefill.md, "Backward").
//
// Two schedules; delta[h, r] = sum_j d_out[r, h, j] * out[r, h, j] (f32) is the fused schedule's first kernel and
// the separate schedule's dQ kernel's prologue.
// Fused (the default at d 128): delta, one pass and a conversion.
//   delta: one warp per (row, head); also zeroes the f32 dQ accumulator.
//   fused: one CTA per 128 keys of one (sequence, key head), two consumer warpgroups of 64 keys each that share every
//          streamed 64-row tile of Q and dO (of every query head of the group). S^T = K Q^T, dP^T = V dO^T (in full
//          at d 128, in two halves of 32 rows at d 192), P^T and dS^T go to shared memory; dV += P^T dO,
//          dK += dS^T Q; then the consumers split dQ(tile) = dS K over the CTA's 128 keys by 64-column slabs and add
//          each slab into the f32 accumulator with one bulk (TMA) reduction of a 16 KB block. Five MMAs per (query
//          tile, key tile).
//   dq_convert: dQ = accumulator * scale in the element type.
// Separate (deterministic; the default at d 192), no atomics, each kernel owns the rows it writes:
//   dQ:    one CTA per 128 query rows of one (sequence, query head), two consumer warpgroups of 64 rows each that
//          share every streamed 64-key tile of K and V. Each consumer first computes delta of its rows (and writes it
//          for the dK / dV kernel, launched after this one). S = Q K^T and dP = dO V^T (wgmma, shared-memory operands),
//          P = exp2(S * scale_log2 - lse2) (while dP's MMAs run), dS = P (dP - delta), dQ += dS K (A from registers);
//          dQ * scale is written at the end. While one consumer forms dS the other's MMAs keep the tensor cores busy.
//   dK/dV: one CTA per 128 keys of one (sequence, key head), two consumer warpgroups of 64 keys each that share every
//          streamed 64-row tile of Q and dO (of every query head of the group) and nothing else. S^T = K Q^T and
//          dP^T = V dO^T, P^T and dS^T as above, dV += P^T dO (queued behind dP^T's last part, under dS^T) and
//          dK += dS^T Q (A from registers).
// Each CTA has a producer warpgroup (a 2-stage ring, the CTA's own rows loaded once): with kFlagTma, whole 64-row
// tiles and whole own rows by TMA, else (the sequence's partial tiles, or no maps) cp.async published after a proxy
// fence, so the consumers never fence. Masked and padded entries get P = 0: a padded row of a streamed tile is
// zero-filled (its P may be nonzero but multiplies zero dO and zero dP, so it adds nothing); the fused kernel also
// masks keys past the sequence, whose dS feeds dQ.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "common/cp_async.cuh"
#include "common/cp_async_group.cuh"
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

// dK / dV: a producer and two consumer warpgroups of 64 keys each (128 keys per CTA).
inline constexpr int kDkvConsumers = 2;
inline constexpr int kThreads = (1 + kDkvConsumers) * kWarpgroupThreads;
// dK / dV register split (3 x 168 at launch): the producer only issues copies.
inline constexpr uint32_t kDkvProducerRegs = 24;
inline constexpr uint32_t kDkvConsumerRegs = 240;
static_assert(kDkvProducerRegs + kDkvConsumers * kDkvConsumerRegs <= 3 * ((65536u / kThreads) & ~7u),
              "setmaxnreg pool of the dK / dV CTA");
inline constexpr int kDqConsumers = 2;
inline constexpr int kDqThreads = (1 + kDqConsumers) * kWarpgroupThreads;  // dQ: producer + two consumers
// dQ register split (3 x 168 at launch): the producer only issues copies.
inline constexpr uint32_t kDqProducerRegs = 56;
inline constexpr uint32_t kDqConsumerRegs = 224;
static_assert(kDqProducerRegs + kDqConsumers * kDqConsumerRegs <= 3 * ((65536u / kDqThreads) & ~7u),
              "setmaxnreg pool of the dQ CTA");
inline constexpr int kStages = 2;
inline constexpr int kRows = 64;        // a consumer's own rows (queries for dQ, keys for dK / dV); the wgmma M
inline constexpr int kKeyTile = 64;     // dQ: keys per streamed tile
// dK / dV: query rows per streamed tile, the N of S^T and dP^T. 64-row tiles measured 12-16% faster than 32-row ones
// at d 192 and 16% at d 128 (docs/perf-log.md); at d 192 the consumers take dP^T in two halves of 32 rows.
template <int kD>
inline constexpr int kQueryTile = 64;
inline constexpr uint32_t kSlab64 = kRows * kSw128RowBytes;       // 8 KB: a 64-row slab
// The f32 dQ accumulator is private to the backward, so it is laid out for the adds: per (head, 64-row query tile of a
// sequence, 64-column slab) one contiguous 16 KB block in accumulator-fragment order, float 4 (128 k + t) + e holding
// element 4 k + e of consumer thread t's fragment (kDqBlockFloats). A consumer stages its chunk in that order (one
// conflict-free 16-byte store per 4 values) and adds it with one bulk reduction; dq_convert_kernel undoes the order.
inline constexpr int kDqBlockFloats = kRows * 64;  // 4096
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
    alignas(kSw128AtomBytes) uint8_t k[kDkvConsumers][kDSlabs * kSlab64];  // the CTA's 128 keys, 64 per consumer
    alignas(kSw128AtomBytes) uint8_t v[kDkvConsumers][2 * kSlab64];
    static constexpr int kQ = kQueryTile<kD>;
    alignas(kSw128AtomBytes) uint8_t q[kStages][kDSlabs * kQuerySlab<kD>];  // Q tiles of kQ rows
    alignas(kSw128AtomBytes) uint8_t d_out[kStages][2 * kQuerySlab<kD>];    // d_out tiles
    float lse[kStages][kQ];                                                 // the tile rows' lse (0 past the sequence)
    float delta[kStages][kQ];
    uint64_t own_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    SeqTile work;         // the CTA's 128 keys
    int32_t other_start;  // the sequence's first query (global)
    int32_t other_len;    // its queries
    uint32_t zero;        // 0, read (volatile) once per tile: see tile_zero
};

inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kD>
inline constexpr uint32_t kDqSmemBytes = static_cast<uint32_t>(sizeof(DqPlan<kD>)) + kSmemAlignSlack;
template <int kD>
inline constexpr uint32_t kDkvSmemBytes = static_cast<uint32_t>(sizeof(DkvPlan<kD>)) + kSmemAlignSlack;
// launch.rs requests these exact sizes; keep both in step.
static_assert(kDqSmemBytes<192> == 165888, "update launch.rs BWD_DQ_SMEM_D192");
static_assert(kDqSmemBytes<128> == 133120, "update launch.rs BWD_DQ_SMEM_D128");
static_assert(kDkvSmemBytes<192> == 166912, "update launch.rs BWD_DKV_SMEM_D192");
static_assert(kDkvSmemBytes<128> == 134144, "update launch.rs BWD_DKV_SMEM_D128");

template <class Plan>
__device__ __forceinline__ Plan& plan_of(uint8_t* smem) {
    const uint32_t raw = smem_addr(smem);
    const uint32_t pad = ((raw + kSw128AtomBytes - 1) & ~static_cast<uint32_t>(kSw128AtomBytes - 1)) - raw;
    if (pad + sizeof(Plan) > dynamic_smem_bytes()) __trap();  // the launch asked for less than the plan
    return *reinterpret_cast<Plan*>(smem + pad);
}

// The prologue of the dQ and dK / dV kernels: warp 0 finds the CTA's tile of kTile rows of the tensor that `cu`
// offsets and the sequence's range in the other tensor (offsets `cu_other`) and publishes them in `sm.work`,
// `sm.other_start`, `sm.other_len`; thread 32 initialises the barriers (a stage is released by every consumer thread).
template <int kTile, int kConsumers, bool kLastFirst, class Plan>
__device__ __forceinline__ void begin_cta(Plan& sm, int batch, const int32_t* cu, int total, int tiles,
                                          const int32_t* cu_other, int total_other) {
    if (threadIdx.x < 32) {
        const SeqTile t = find_seq_tile<kTile, kLastFirst>(cu, batch, total, tiles, static_cast<int>(blockIdx.x),
                                                               static_cast<int>(threadIdx.x));
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
            MBarrier::init(&sm.empty[st], kConsumers * kWarpgroupThreads);
        }
    }
    __syncthreads();
}

// The producer's load of the CTA's own rows, 64 per consumer, of two tensors of one head: `a` (kASlabs slabs: q or
// k) and `b` (two slabs: d_out or v), from row `row0` on, `rows` of them real. Whole by TMA when `tma` (thread 0
// announces the bytes and arrives for the warpgroup), else with cp.async, rows past `rows` zero-filled, published
// after a proxy fence; `full` completes either way.
template <int kASlabs, int kConsumers>
__device__ __forceinline__ void load_own_rows(uint8_t (&a)[kConsumers][kASlabs * kSlab64],
                                              uint8_t (&b)[kConsumers][2 * kSlab64], const TensorMapBytes* a_map,
                                              const TensorMapBytes* b_map, const uint16_t* a_src, int64_t a_stride,
                                              const uint16_t* b_src, int64_t b_stride, int head, int row0, int rows,
                                              bool tma, uint64_t* full, const Sw128CopyThread& ct,
                                              const uint16_t* dummy) {
    if (tma) {
        if (threadIdx.x == 0) {
            MBarrier::expect_tx(full, kConsumers * (kASlabs + 2) * kSlab64);
#pragma unroll
            for (int c = 0; c < kConsumers; ++c) {
                tma_slabs<kASlabs, kRows>(smem_addr(a[c]), a_map, head, row0 + c * kRows, full);
                tma_slabs<2, kRows>(smem_addr(b[c]), b_map, head, row0 + c * kRows, full);
            }
            MBarrier::arrive(full, kWarpgroupThreads);
        }
    } else {
#pragma unroll
        for (int c = 0; c < kConsumers; ++c) {
            copy_tile<kASlabs, kRows>(smem_addr(a[c]), a_src, a_stride, c * kRows, rows, ct, dummy);
            copy_tile<2, kRows>(smem_addr(b[c]), b_src, b_stride, c * kRows, rows, ct, dummy);
        }
        publish_landed(full);
    }
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
    if (p.dq_accum != nullptr) {  // the fused schedule: zero the dQ accumulator (every block, padded rows too)
        const int64_t n4 = static_cast<int64_t>(p.h_q) * p.q_tiles * (p.d_qk / 64) * (kDqBlockFloats / 4);
        float4* acc = reinterpret_cast<float4*>(p.dq_accum);
        const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += stride) {
            acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
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
    begin_cta<kDqRows, kDqConsumers, true>(sm, p.batch, p.cu_seqlens_q, p.total_q, p.q_tiles, p.cu_seqlens_k,
                                           p.total_k);
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
        const bool tma = (p.flags & kFlagTma) != 0;
        const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
        const uint16_t* dummy = p.q;
        load_own_rows<kDSlabs, kDqConsumers>(sm.q, sm.d_out, &p.q_tmap, &p.d_out_tmap,
                                             p.q + q0 * p.q_stride_t + w.head * p.q_stride_h, p.q_stride_t,
                                             p.d_out + q0 * p.d_out_stride_t + w.head * p.d_out_stride_h,
                                             p.d_out_stride_t, w.head, q0, rows, tma && rows == kDqRows,
                                             &sm.own_full, ct, dummy);
        const uint16_t* k = p.k + static_cast<int64_t>(k0) * p.k_stride_t + kv_head * p.k_stride_h;
        const uint16_t* v = p.v + static_cast<int64_t>(k0) * p.v_stride_t + kv_head * p.v_stride_h;
        for (int i = 0; i < n_tiles; ++i) {
            const RingPos<kStages> pos = RingPos<kStages>::of(i);
            MBarrier::wait(&sm.empty[pos.stage], pos.empty_parity);
            if (tma && (i + 1) * kKeyTile <= s_k) {  // a whole key tile by TMA
                if (threadIdx.x == 0) {
                    uint64_t* full = &sm.full[pos.stage];
                    MBarrier::expect_tx(full, (kDSlabs + 2) * kSlab64);
                    tma_slabs<kDSlabs, kKeyTile>(smem_addr(sm.k[pos.stage]), &p.k_tmap, kv_head, k0 + i * kKeyTile,
                                                 full);
                    tma_slabs<2, kKeyTile>(smem_addr(sm.v[pos.stage]), &p.v_tmap, kv_head, k0 + i * kKeyTile, full);
                    MBarrier::arrive(full, kWarpgroupThreads);
                }
            } else {  // the sequence's partial last tile (rows past it zero-filled), or no maps
                copy_tile<kDSlabs, kKeyTile>(smem_addr(sm.k[pos.stage]), k, p.k_stride_t, i * kKeyTile, s_k, ct,
                                             dummy);
                copy_tile<2, kKeyTile>(smem_addr(sm.v[pos.stage]), v, p.v_stride_t, i * kKeyTile, s_k, ct, dummy);
                publish_landed(&sm.full[pos.stage]);
            }
        }
        return;
    }

    // Consumer c owns the CTA's rows 64 c .. 64 c + 63 (padded past `rows`: lse +inf, P = 0).
    setmaxnreg_inc<kDqConsumerRegs>();
    const int c = wg - 1;
    const int c_rows = clamp_to(rows - c * kRows, 0, kRows);
    const int c_t0 = w.t0 + c * kRows;  // the consumer's first row inside the sequence
    const int t = static_cast<int>(threadIdx.x) - wg * kWarpgroupThreads;
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
        limit[rr] = causal ? min(c_t0 + r[rr] + shift, s_k - 1) : s_k - 1;
    }
    // delta = rowsum(d_out * out) of the thread's two rows: each lane of the quad takes 32 columns (out from global
    // memory, loaded before the wait for the CTA's own rows; d_out from those rows in shared memory), then the quad
    // adds up. Written for the dK / dV kernel, which runs after this one, whether or not the row sees any key.
    uint4 o_chunks[2][4];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = min(q0 + c * kRows + r[rr], p.total_q - 1);  // padded rows read a real row, unused
        const uint4* o = reinterpret_cast<const uint4*>(p.out + static_cast<int64_t>(row) * p.out_stride_t +
                                                        w.head * p.out_stride_h) +
                         4 * f.quad;
#pragma unroll
        for (int k = 0; k < 4; ++k) o_chunks[rr][k] = __ldg(o + k);
    }
    if (n_tiles > 0) MBarrier::wait(&sm.own_full, 0);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const bool ok = r[rr] < c_rows;
        const int row = q0 + c * kRows + r[rr];
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            uint4 g;
            if (n_tiles > 0) {  // the own rows landed (rows past the sequence are zeros)
                g = ld_shared_v4(smem_addr(sm.d_out[c]) + (f.quad / 2) * kSlab64 +
                                 sw128_chunk_offset(r[rr], (f.quad % 2) * 4 + k));
            } else {  // no key tile: the producer loaded nothing
                g = ok ? __ldg(reinterpret_cast<const uint4*>(p.d_out + static_cast<int64_t>(row) * p.d_out_stride_t +
                                                              w.head * p.d_out_stride_h) +
                               4 * f.quad + k)
                       : make_uint4(0, 0, 0, 0);
            }
            const uint32_t aw[4] = {o_chunks[rr][k].x, o_chunks[rr][k].y, o_chunks[rr][k].z, o_chunks[rr][k].w};
            const uint32_t bw[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc = fmaf(unpack_lo<E>(aw[i]), unpack_lo<E>(bw[i]), acc);
                acc = fmaf(unpack_hi<E>(aw[i]), unpack_hi<E>(bw[i]), acc);
            }
        }
        acc += __shfl_xor_sync(kFullMask, acc, 1);
        acc += __shfl_xor_sync(kFullMask, acc, 2);
        delta[rr] = ok ? acc : 0.f;
        if (ok && f.quad == 0) p.delta[w.head * p.delta_stride_h + row] = acc;
    }
    const int mask_from = causal ? min(c_t0 + shift, s_k - 1) : s_k - 1;
    float dq[kD / 2];
    zero_regs(dq);
    const uint64_t desc_q = make_wgmma_desc_sw128(smem_addr(sm.q[c]), kUnusedLbo, kSw128AtomBytes);
    const uint64_t desc_do = make_wgmma_desc_sw128(smem_addr(sm.d_out[c]), kUnusedLbo, kSw128AtomBytes);
    for (int i = 0; i < n_tiles; ++i) {
        const RingPos<kStages> pos = RingPos<kStages>::of(i);
        MBarrier::wait(&sm.full[pos.stage], pos.full_parity);  // TMA, or cp.async published after a proxy fence
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
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < kDv / 16; ++ks) {
            const uint32_t off = (ks / 4) * kSlab64 + (ks % 4) * 32;
            wgmma_m64n64k16_ss_kk<E>(dp, wgmma_desc_advance(desc_do, off), wgmma_desc_advance(desc_v, off), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();  // S; P is formed while dP's MMAs run
        wgmma_fence_regs(s);
        const bool masked = i * kKeyTile + kKeyTile - 1 > mask_from;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = e / 2;
                const int col = i * kKeyTile + f.col(j) + (e % 2);
                const float x = masked && col > limit[rr] ? -kInf : s[4 * j + e];
                s[4 * j + e] = exp2f(fmaf(x, p.sm_scale_log2, -lse2[rr]));  // P
            }
        }
        wgmma_wait<0>();
        wgmma_fence_regs(dp);
#pragma unroll
        for (int e = 0; e < 32; ++e) dp[e] = s[e] * (dp[e] - delta[(e % 4) / 2]);  // dS
        uint32_t ds[kKeyTile / 16][4];
        to_frags<E>(dp, ds);
        wgmma_fence();
        mma_rs_mn<E, kD>(dq, ds, k_addr, kSlab64);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dq);
        MBarrier::arrive(&sm.empty[pos.stage]);  // every thread: its reads of the stage are done
    }
    store_rows<E, kD>(p.d_q + (q0 + c * kRows) * p.d_q_stride_t + w.head * p.d_q_stride_h, p.d_q_stride_t, c_rows,
                      f, dq, p.sm_scale);
}

// The dK / dV producers' tile loop: streams the 64-row tiles of Q and d_out (with their lse and delta; rows past the
// sequence read 0) of every query head of key head `kv_head`'s group, query tiles m_first .. m_first + m_count - 1
// of the sequence starting at row q0, through the plan's kStages ring.
template <int kDSlabs, int kQ, class Plan>
__device__ __forceinline__ void stream_query_tiles(const DensePrefillBwdParams& p, Plan& sm, int kv_head, int q0,
                                                   int s_q, int m_first, int m_count, int n_iter,
                                                   const Sw128CopyThread& ct) {
    const uint16_t* dummy = p.q;
    const bool tma = (p.flags & kFlagTma) != 0;
    for (int it = 0; it < n_iter; ++it) {
        const int head = kv_head * p.h_per_k + it / m_count;
        const int m0 = (m_first + it % m_count) * kQ;
        const RingPos<kStages> pos = RingPos<kStages>::of(it);
        uint64_t* full = &sm.full[pos.stage];
        MBarrier::wait(&sm.empty[pos.stage], pos.empty_parity);
        const int64_t row0 = static_cast<int64_t>(q0) + m0;
        // A whole tile's Q and d_out by TMA (thread 0 announces their bytes before its own arrival below can
        // complete the phase); a partial one (rows past the sequence zero-filled) or, without maps, every one with
        // cp.async, published after a proxy fence.
        const bool whole = tma && m0 + kQ <= s_q;
        if (whole) {
            if (threadIdx.x == 0) {
                MBarrier::expect_tx(full, (kDSlabs + 2) * kQ * kSw128RowBytes);
                tma_slabs<kDSlabs, kQ>(smem_addr(sm.q[pos.stage]), &p.q_tmap, head, static_cast<int>(row0), full);
                tma_slabs<2, kQ>(smem_addr(sm.d_out[pos.stage]), &p.d_out_tmap, head, static_cast<int>(row0), full);
            }
        } else {
            copy_tile<kDSlabs, kQ>(smem_addr(sm.q[pos.stage]), p.q + row0 * p.q_stride_t + head * p.q_stride_h,
                                   p.q_stride_t, 0, s_q - m0, ct, dummy);
            copy_tile<2, kQ>(smem_addr(sm.d_out[pos.stage]),
                             p.d_out + row0 * p.d_out_stride_t + head * p.d_out_stride_h, p.d_out_stride_t, 0,
                             s_q - m0, ct, dummy);
        }
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
        // lse and delta are read with ordinary loads: their copies need no proxy fence.
        if (whole) {
            MBarrier::arrive_on_cp_async_noinc(full);
        } else {
            publish_landed(full);
        }
    }
}

// The query tiles that a CTA of kKeys keys (`w`, of a sequence with s_q queries) streams, in the dK / dV and fused
// kernels: tiles m_first .. m_first + m_count - 1 of every query head of the key head's group.
struct KeyBlockWalk {
    int keys;     // the CTA's keys inside the sequence (1..kKeys)
    int k0;       // its first key (global row)
    int shift;    // s_k - s_q: under the mask, row r sees key c iff c <= r + shift
    int m_first;  // the first query tile that sees any of the CTA's keys
    int m_count;  // query tiles per head
    int n_iter;   // tiles streamed
    template <int kKeys, int kQ>
    static __device__ __forceinline__ KeyBlockWalk of(const DensePrefillBwdParams& p, const SeqTile& w, int s_q) {
        KeyBlockWalk k;
        k.keys = min(kKeys, w.len - w.t0);
        k.k0 = w.start + w.t0;
        k.shift = w.len - s_q;
        const int first_row = (p.flags & kFlagCausal) != 0 ? clamp_to(w.t0 - k.shift, 0, s_q) : 0;
        k.m_first = first_row / kQ;
        k.m_count = (s_q + kQ - 1) / kQ - k.m_first;
        k.n_iter = k.m_count > 0 ? k.m_count * p.h_per_k : 0;
        return k;
    }
};

// The producer of the dK / dV and fused kernels: the CTA's own K and V rows (64 per consumer), then the walk's query
// tiles. Nothing when the walk is empty.
template <int kDSlabs, int kQ, int kConsumers, class Plan>
__device__ __forceinline__ void produce_key_block(const DensePrefillBwdParams& p, Plan& sm, const SeqTile& w, int q0,
                                                  int s_q, const KeyBlockWalk& k) {
    if (k.n_iter == 0) return;
    const Sw128CopyThread ct = Sw128CopyThread::of(static_cast<int>(threadIdx.x));
    const uint16_t* dummy = p.q;
    load_own_rows<kDSlabs, kConsumers>(sm.k, sm.v, &p.k_tmap, &p.v_tmap,
                                       p.k + k.k0 * p.k_stride_t + w.head * p.k_stride_h, p.k_stride_t,
                                       p.v + k.k0 * p.v_stride_t + w.head * p.v_stride_h, p.v_stride_t, w.head, k.k0,
                                       k.keys, (p.flags & kFlagTma) != 0 && k.keys == kConsumers * kRows,
                                       &sm.own_full, ct, dummy);
    stream_query_tiles<kDSlabs, kQ>(p, sm, w.head, q0, s_q, k.m_first, k.m_count, k.n_iter, ct);
}

// ---------------------------------------------------------------------------------------------------------------
// dK / dV

// 0, read from shared memory with a volatile load. The consumer adds it to the shared addresses its tile derives
// swizzled store addresses and MMA descriptors from: the compiler cannot prove those loop-invariant, so it computes
// them next to their uses instead of hoisting dozens of them out of the tile loop into registers (which at d 192
// spilled and serialized the MMAs).
__device__ __forceinline__ uint32_t tile_zero(const uint32_t* zero) {
    uint32_t v;
    asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(v) : "r"(smem_addr(zero)) : "memory");
    return v;
}

// P^T = exp2(S^T * scale_log2 - lse * log2 e), in place, over a consumer's 64-key x kQ-row score tile (the thread's
// keys key[0] and key[1], columns the query rows m0 + col of the streamed tile, `lse` their rows' lse). Where
// `masked`, an entry is 0 whose key lies past its row's causal horizon (key > m0 + col + shift; the dK / dV kernel
// tests it only on causal tiles, so `masked` implies `causal` there) or, with kKeyEnd, at or past `key_end` (keys past
// the sequence, whose dS^T the fused kernel's dQ reads). A select, so an inf in the inputs cannot become NaN.
template <int kQ, bool kKeyEnd>
__device__ __forceinline__ void pt_from_scores(float (&s)[kQ / 2], const float* lse, const AccFrag& f,
                                               const int (&key)[2], int m0, int shift, bool causal, int key_end,
                                               bool masked, float scale_log2) {
#pragma unroll
    for (int j = 0; j < kQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int rr = e / 2;
            const int col = f.col(j) + (e % 2);  // query row m0 + col
            const float lse2 = lse[col] * kLog2e;
            bool out;
            if constexpr (kKeyEnd) {
                out = (causal && key[rr] > m0 + col + shift) || key[rr] >= key_end;
            } else {
                out = key[rr] > m0 + col + shift;
            }
            const float x = masked && out ? -kInf : s[4 * j + e];
            s[4 * j + e] = exp2f(fmaf(x, scale_log2, -lse2));
        }
    }
}

// How many parts of 32 query rows the dK / dV and fused consumers compute dP^T in: at d 128 the whole 64 x 64 tile
// (its MMAs run under the softmax of P^T); at d 192 two, since dK's 96 registers, dV's 64 and both score tiles in
// full do not fit a consumer's 240 (ptxas spilled and serialised the MMAs).
template <int kD>
inline constexpr int kDpParts = kD == 192 ? 2 : 1;

// dP^T for query rows N h .. N h + N - 1 of the tile (N = 2 * the accumulator's registers, 32 or 64): V (64 keys,
// K-major) times those rows of dO; committed.
template <class E, int N>
__device__ __forceinline__ void issue_dp_part(float (&dp)[N], uint64_t desc_v, uint64_t desc_do, int h) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDv / 16; ++ks) {
        const uint32_t off = (ks / 4) * kSlab64 + (ks % 4) * 32;
        const uint32_t off_rows = off + h * 2 * N * kSw128RowBytes;
        if constexpr (N == 16) {
            wgmma_m64n32k16_ss_kk<E>(dp, wgmma_desc_advance(desc_v, off), wgmma_desc_advance(desc_do, off_rows),
                                     ks > 0);
        } else {
            static_assert(N == 32, "dP^T of 32 or 64 query rows");
            wgmma_m64n64k16_ss_kk<E>(dp, wgmma_desc_advance(desc_v, off), wgmma_desc_advance(desc_do, off_rows),
                                     ks > 0);
        }
    }
    wgmma_commit();
}

template <int kD, class E>
__device__ __forceinline__ void dkv_kernel(const DensePrefillBwdParams& p, uint8_t* smem) {
    using Plan = DkvPlan<kD>;
    constexpr int kDSlabs = Plan::kDSlabs;
    constexpr int kQ = Plan::kQ;
    constexpr int kKeys = kDkvConsumers * kRows;  // the CTA's keys
    constexpr uint32_t kQSlab = kQuerySlab<kD>;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.k_tiles) * p.h_k) return;
    Plan& sm = plan_of<Plan>(smem);
    if (threadIdx.x == 0) sm.zero = 0;  // published by begin_cta's barrier
    begin_cta<kKeys, kDkvConsumers, false>(sm, p.batch, p.cu_seqlens_k, p.total_k, p.k_tiles, p.cu_seqlens_q,
                                           p.total_q);
    const SeqTile w = sm.work;
    if (!w.found) return;
    const int s_q = sm.other_len;
    // The second consumer's keys see one tile fewer; it computes that tile under the mask (P = 0) rather than skip
    // it (a consumer a tile ahead of the other waits for every refill, docs/perf-log.md).
    const KeyBlockWalk kw = KeyBlockWalk::of<kKeys, kQ>(p, w, s_q);
    const int shift = kw.shift;
    const int m_first = kw.m_first;
    const int m_count = kw.m_count;
    const int n_iter = kw.n_iter;
    const bool causal = (p.flags & kFlagCausal) != 0;
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;

    if (wg == 0) {  // producer
        setmaxnreg_dec<kDkvProducerRegs>();
        produce_key_block<kDSlabs, kQ, kDkvConsumers>(p, sm, w, sm.other_start, s_q, kw);
        return;
    }

    // Consumer c: rows of S^T are the CTA's keys 64 c .. 64 c + 63, columns the tile's query rows. The two consumers
    // share every streamed tile and nothing else: while one forms P^T and dS^T, the other's MMAs run.
    setmaxnreg_inc<kDkvConsumerRegs>();
    const int c = wg - 1;
    const int t = static_cast<int>(threadIdx.x) - wg * kWarpgroupThreads;
    const AccFrag f = AccFrag::of_thread(t);
    const int c_t0 = w.t0 + c * kRows;  // the consumer's first key inside the sequence
    const int key[2] = {c_t0 + f.row0, c_t0 + f.row1()};
    float dk[kD / 2];
    float dv[kDv / 2];
    zero_regs(dk);
    zero_regs(dv);
    if (n_iter > 0) MBarrier::wait(&sm.own_full, 0);
    for (int it = 0; it < n_iter; ++it) {
        const uint32_t z = tile_zero(&sm.zero);
        const uint64_t desc_k = make_wgmma_desc_sw128(smem_addr(sm.k[c]) + z, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_v = make_wgmma_desc_sw128(smem_addr(sm.v[c]) + z, kUnusedLbo, kSw128AtomBytes);
        const int m0 = (m_first + it % m_count) * kQ;
        const RingPos<kStages> pos = RingPos<kStages>::of(it);
        MBarrier::wait(&sm.full[pos.stage], pos.full_parity);  // TMA, or cp.async published after a proxy fence
        const uint32_t q_addr = smem_addr(sm.q[pos.stage]);
        const uint32_t do_addr = smem_addr(sm.d_out[pos.stage]);
        const uint64_t desc_q = make_wgmma_desc_sw128(q_addr, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_do = make_wgmma_desc_sw128(do_addr, kUnusedLbo, kSw128AtomBytes);
        // S^T, then dP^T in kDpParts parts; dV += P^T dO runs while dS^T is formed (from P^T in f32).
        constexpr int kDpParts = bwd::kDpParts<kD>;
        constexpr int kPartBlocks = kQ / 8 / kDpParts;  // accumulator blocks (8 query columns) per part
        float s[kQ / 2];
        float dp[kQ / 2 / kDpParts];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
            const uint32_t off_k = (ks / 4) * kSlab64 + (ks % 4) * 32;
            const uint32_t off_q = (ks / 4) * kQSlab + (ks % 4) * 32;
            mma_ss_kk<E>(s, wgmma_desc_advance(desc_k, off_k), wgmma_desc_advance(desc_q, off_q), ks > 0);
        }
        wgmma_commit();
        issue_dp_part<E>(dp, desc_v, desc_do, 0);
        wgmma_wait<1>();  // S^T
        wgmma_fence_regs(s);
        // Under the mask, key c and query row r pair iff c <= r + shift; tiles wholly below the diagonal skip it.
        const bool masked = causal && c_t0 + kRows - 1 > m0 + shift;
        pt_from_scores<kQ, false>(s, sm.lse[pos.stage], f, key, m0, shift, causal, 0, masked, p.sm_scale_log2);
        uint32_t pt[kQ / 16][4];
        uint32_t dst[kQ / 16][4];
#pragma unroll
        for (int h = 0; h < kDpParts; ++h) {
            // k-steps 2 h and 2 h + 1 (d 192) or all four (d 128) of P^T as A fragments.
#pragma unroll
            for (int kk = 0; kk < kPartBlocks / 2; ++kk) {
                const int kb = h * (kPartBlocks / 2) + kk;
#pragma unroll
                for (int i = 0; i < 4; ++i) pt[kb][i] = pack_x2<E>(s[8 * kb + 2 * i], s[8 * kb + 2 * i + 1]);
            }
            if (h == 0 && kDpParts == 2) {
                wgmma_wait<0>();  // dP^T's first part
                wgmma_fence_regs(dp);
            }
            if (h == kDpParts - 1) {
                // dV += P^T dO, queued behind dP^T's last part; it runs while that part becomes dS^T.
                if (h == 1) issue_dp_part<E>(dp, desc_v, desc_do, 1);
                wgmma_fence();
                mma_rs_mn<E, kDv>(dv, pt, do_addr, kQSlab);
                wgmma_commit();
                wgmma_wait<1>();
                wgmma_fence_regs(dp);
            }
#pragma unroll
            for (int jh = 0; jh < kPartBlocks; ++jh) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = f.col(h * kPartBlocks + jh) + (e % 2);
                    dp[4 * jh + e] = s[4 * (h * kPartBlocks + jh) + e] * (dp[4 * jh + e] - sm.delta[pos.stage][col]);
                }
            }
            // The same k-steps of dS^T.
#pragma unroll
            for (int kk = 0; kk < kPartBlocks / 2; ++kk) {
                const int kb = h * (kPartBlocks / 2) + kk;
#pragma unroll
                for (int i = 0; i < 4; ++i) dst[kb][i] = pack_x2<E>(dp[8 * kk + 2 * i], dp[8 * kk + 2 * i + 1]);
            }
        }
        wgmma_fence();
        mma_rs_mn<E, kD>(dk, dst, q_addr, kQSlab);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(dv);
        wgmma_fence_regs(dk);
        MBarrier::arrive(&sm.empty[pos.stage]);  // every thread: its reads of the stage are done
    }
    // Keys past the sequence (zero rows of K and V) computed rows that are not stored.
    const int c_keys = clamp_to(kw.keys - c * kRows, 0, kRows);
    const int64_t kc0 = kw.k0 + c * kRows;
    store_rows<E, kD>(p.d_k + kc0 * p.d_k_stride_t + w.head * p.d_k_stride_h, p.d_k_stride_t, c_keys, f, dk,
                      p.sm_scale);
    store_rows<E, kDv>(p.d_v + kc0 * p.d_v_stride_t + w.head * p.d_v_stride_h, p.d_v_stride_t, c_keys, f, dv, 1.f);
}

// ---------------------------------------------------------------------------------------------------------------
// dK / dV / dQ in one pass (the default schedule)
//
// One CTA per 128 keys of one (sequence, key head): a producer and two consumer warpgroups of 64 keys each, sharing
// every streamed 64-row tile of Q and dO. Each consumer computes S^T, dP^T, P^T and dS^T for its keys as the dK / dV
// kernel does, stores dS^T (the element type) in shared memory, and adds dV += P^T dO, dK += dS^T Q. Once both halves
// of dS^T are stored, the consumers split dQ(tile) = dS K over the CTA's 128 keys by columns (at d 192 one takes 128
// columns and the other 64, swapping each tile) and add it into the f32 `dq_accum` with `red.global.add.v2.f32`.
// Five MMAs per (query tile, key tile) where the deterministic schedule issues seven; the price is the f32 adds
// (64 rows x d x 4 bytes per 128 keys) and their order, which varies from run to run.

inline constexpr int kFusedConsumers = 2;
inline constexpr int kFusedKeys = kFusedConsumers * kRows;  // the CTA's keys
inline constexpr int kFusedThreads = (1 + kFusedConsumers) * kWarpgroupThreads;
inline constexpr int kFusedQ = 64;  // query rows per streamed tile
// Register split (3 x 168 at launch). The consumer holds dK (d / 2), dV (64) and, in turn, the score tiles (64) or
// the dQ part (at most 64) and the P^T / dS^T fragments (32).
inline constexpr uint32_t kFusedProducerRegs = 24;
inline constexpr uint32_t kFusedConsumerRegs = 240;
static_assert(kFusedProducerRegs + kFusedConsumers * kFusedConsumerRegs <= 3 * ((65536u / kFusedThreads) & ~7u),
              "setmaxnreg pool of the fused CTA");

template <int kD>
struct FusedPlan {
    static constexpr int kDSlabs = kD / kSw128ColsBf16;
    alignas(kSw128AtomBytes) uint8_t k[kFusedConsumers][kDSlabs * kSlab64];  // the CTA's 128 keys, 64 per consumer
    alignas(kSw128AtomBytes) uint8_t v[kFusedConsumers][2 * kSlab64];
    alignas(kSw128AtomBytes) uint8_t q[kStages][kDSlabs * kSlab64];       // Q tiles of 64 rows
    alignas(kSw128AtomBytes) uint8_t d_out[kStages][2 * kSlab64];         // d_out tiles
    // dS^T of the tile, one [64 keys][64 rows] slab per consumer; both consumers' dQ MMAs read both.
    alignas(kSw128AtomBytes) uint8_t ds[kFusedConsumers][kSlab64];
    // The tile's P^T ([64 keys][64 rows], an SW128 slab) per consumer, the A operand of dV += P^T dO at d 192
    // (at d 128 the consumers keep P^T in registers).
    alignas(kSw128AtomBytes) uint8_t pt[kFusedConsumers][kSlab64];
    // Each consumer's 64 x 64 f32 dQ chunk on its way to the bulk add (block order). The bulk reduction reads it
    // while the consumer goes on (its next write waits for that read): P^T lives apart (sharing this buffer made
    // every tile wait for the previous tile's reduction to leave shared memory, 3-5% slower at d 192 and d 128).
    alignas(16) float dq_stage[kFusedConsumers][kDqBlockFloats];
    float lse[kStages][kFusedQ];  // the tile rows' lse (0 past the sequence)
    float delta[kStages][kFusedQ];
    uint64_t own_full;
    uint64_t full[kStages];
    uint64_t empty[kStages];
    SeqTile work;         // the CTA's 128 keys
    int32_t other_start;  // the sequence's first query (global)
    int32_t other_len;    // its queries
    uint32_t zero;        // 0, read (volatile) once per tile: see tile_zero
};
template <int kD>
inline constexpr uint32_t kFusedSmemBytes = static_cast<uint32_t>(sizeof(FusedPlan<kD>)) + kSmemAlignSlack;
static_assert(kFusedSmemBytes<192> == 232448, "update launch.rs BWD_FUSED_SMEM_D192");
static_assert(kFusedSmemBytes<128> == 199680, "update launch.rs BWD_FUSED_SMEM_D128");

// Named barriers of the fused kernel: the two consumers' rendezvous around the shared dS^T tile, and each consumer's
// own (128 threads) around its dQ staging buffer.
enum class FusedBar : uint32_t { DsFree = 1, DsStored = 2, Staged0 = 3, Staged1 = 4 };

// acc[64 x kN] += A B over 64 query rows: A = a [64 keys][64 rows] (K-major SW128 slab), B = rows of an SW128 tile
// read MN-major (kN columns over kN / 64 slabs of kSlab64 bytes).
template <class E, int kN, int N>
__device__ __forceinline__ void mma_ss_kmn(float (&acc)[N], uint32_t a, uint32_t b) {
    static_assert(N == kN / 2, "accumulator of a 64 x kN tile");
#pragma unroll
    for (int kb = 0; kb < kFusedQ / 16; ++kb) {
        const uint64_t da = make_wgmma_desc_sw128(a + kb * 32, kUnusedLbo, kSw128AtomBytes);
        const uint64_t db = make_wgmma_desc_sw128(b + kb * 16 * kSw128RowBytes, kSlab64, kSw128AtomBytes);
        if constexpr (kN == 192) {
            wgmma_m64n192k16_ss<0, 1, E>(acc, da, db, true);
        } else {
            static_assert(kN == 128, "N 128 or 192");
            wgmma_m64n128k16_ss<0, 1, E>(acc, da, db, true);
        }
    }
}

// One 64-column chunk of dQ(tile) = dS[64 rows x 128 keys] K[keys, columns of slab `slab`], both operands MN-major
// (dS^T stored [key][row], K stored [key][d]); waited for.
template <class E>
__device__ __forceinline__ void dq_chunk(float (&acc)[32], const uint32_t (&ds_addr)[kFusedConsumers],
                                         const uint32_t (&k_addr)[kFusedConsumers], int slab) {
    constexpr uint32_t kKStep = 16 * kSw128RowBytes;  // 16 keys
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kFusedKeys / 16; ++kk) {
        const int kc = kk / (kRows / 16);
        const int kb = kk % (kRows / 16);
        const uint64_t a = make_wgmma_desc_sw128(ds_addr[kc] + kb * kKStep, kSlab64, kSw128AtomBytes);
        const uint64_t b = make_wgmma_desc_sw128(k_addr[kc] + slab * kSlab64 + kb * kKStep, kSlab64, kSw128AtomBytes);
        wgmma_m64n64k16_ss<1, 1, E>(acc, a, b, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
}

// The first 64-row query tile of sequence `seq` among all sequences' tiles (sum of ceil(len / 64) before it): the
// tile numbering of find_seq_tile<64> over `cu`. Run by all 32 lanes of one warp.
__device__ __forceinline__ int seq_tile_base(const int32_t* cu, int seq, int total, int lane) {
    int base = 0;
    for (int b0 = 0; b0 < seq; b0 += 32) {
        const int b = b0 + lane;
        int n = 0;
        if (b < seq) {
            int start = 0;
            int len = 0;
            other_range(cu, b, total, start, len);
            n = (len + kRows - 1) / kRows;
        }
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) n += __shfl_xor_sync(kFullMask, n, off);
        base += n;
    }
    return base;
}

// Adds a 64 x 64 dQ chunk into its accumulator block `dst`: the consumer stores the fragments into its staging
// buffer in block order and thread 0 hands the 16 KB to the TMA engine as one bulk reduction (the adds take no issue
// slots; `red.global` issued by the MMA warps themselves slowed the kernel by about 40% at d 128, and one bulk add
// per 256-byte row kept the TMA unit busier than the MMAs). Thread 0 waits for the previous bulk read of the buffer
// before anyone overwrites it.
__device__ __forceinline__ void reduce_dq_chunk(float* dst, bool in_bounds, float* stage, FusedBar bar, int t,
                                                const float (&acc)[32]) {
    if (t == 0) bulk_wait_read();
    named_barrier_sync_unaligned(bar, kWarpgroupThreads);
    const uint32_t src = smem_addr(stage);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        st_shared_v4(src + (k * kWarpgroupThreads + t) * 16,
                     make_uint4(__float_as_uint(acc[4 * k]), __float_as_uint(acc[4 * k + 1]),
                                __float_as_uint(acc[4 * k + 2]), __float_as_uint(acc[4 * k + 3])));
    }
    fence_proxy_async_shared();  // staged block: generic stores -> the bulk reduction's reads (async proxy)
    named_barrier_sync_unaligned(bar, kWarpgroupThreads);
    if (t == 0 && in_bounds) {
        bulk_reduce_add_f32_s2g(dst, src, kDqBlockFloats * 4);
        bulk_commit();
    }
}

template <int kD, class E>
__device__ __forceinline__ void fused_kernel(const DensePrefillBwdParams& p, uint8_t* smem) {
    using Plan = FusedPlan<kD>;
    constexpr int kDSlabs = Plan::kDSlabs;
    constexpr int kQ = kFusedQ;
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.k_tiles) * p.h_k) return;
    Plan& sm = plan_of<Plan>(smem);
    if (threadIdx.x == 0) sm.zero = 0;  // published by begin_cta's barrier
    begin_cta<kFusedKeys, kFusedConsumers, false>(sm, p.batch, p.cu_seqlens_k, p.total_k, p.k_tiles, p.cu_seqlens_q,
                                                  p.total_q);
    const SeqTile w = sm.work;
    if (!w.found) return;
    const int q0 = sm.other_start;
    const int s_q = sm.other_len;
    const KeyBlockWalk kw = KeyBlockWalk::of<kFusedKeys, kQ>(p, w, s_q);
    const int shift = kw.shift;
    const int m_first = kw.m_first;
    const int m_count = kw.m_count;
    const int n_iter = kw.n_iter;
    const bool causal = (p.flags & kFlagCausal) != 0;
    const int wg = static_cast<int>(threadIdx.x) / kWarpgroupThreads;

    if (wg == 0) {  // producer
        setmaxnreg_dec<kFusedProducerRegs>();
        produce_key_block<kDSlabs, kQ, kFusedConsumers>(p, sm, w, q0, s_q, kw);
        return;
    }

    // Consumer c: rows of S^T are the CTA's keys 64 c .. 64 c + 63, columns the tile's query rows.
    setmaxnreg_inc<kFusedConsumerRegs>();
    const int c = wg - 1;
    const int t = static_cast<int>(threadIdx.x) - wg * kWarpgroupThreads;
    const int lane = t % 32;
    const AccFrag f = AccFrag::of_thread(t);
    const int c_t0 = w.t0 + c * kRows;                  // the consumer's first key inside the sequence
    const int q_tile0 = seq_tile_base(p.cu_seqlens_q, w.seq, p.total_q, lane);  // the sequence's first query tile
    const int key[2] = {c_t0 + f.row0, c_t0 + f.row1()};
    float dk[kD / 2];
    float dv[kDv / 2];
    zero_regs(dk);
    zero_regs(dv);
    if (n_iter > 0) MBarrier::wait(&sm.own_full, 0);
    for (int it = 0; it < n_iter; ++it) {
        const uint32_t z = tile_zero(&sm.zero);
        const uint64_t desc_k = make_wgmma_desc_sw128(smem_addr(sm.k[c]) + z, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_v = make_wgmma_desc_sw128(smem_addr(sm.v[c]) + z, kUnusedLbo, kSw128AtomBytes);
        const int head = w.head * p.h_per_k + it / m_count;
        const int m0 = (m_first + it % m_count) * kQ;
        const RingPos<kStages> pos = RingPos<kStages>::of(it);
        MBarrier::wait(&sm.full[pos.stage], pos.full_parity);  // TMA, or cp.async published after a proxy fence
        const uint32_t q_addr = smem_addr(sm.q[pos.stage]);
        const uint32_t do_addr = smem_addr(sm.d_out[pos.stage]);
        const uint64_t desc_q = make_wgmma_desc_sw128(q_addr, kUnusedLbo, kSw128AtomBytes);
        const uint64_t desc_do = make_wgmma_desc_sw128(do_addr, kUnusedLbo, kSw128AtomBytes);
        // S^T in full, dP^T in kDpParts parts.
        constexpr int kDpParts = bwd::kDpParts<kD>;
        float s[kQ / 2];
        float dp[kQ / 2 / kDpParts];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
            const uint32_t off = (ks / 4) * kSlab64 + (ks % 4) * 32;
            mma_ss_kk<E>(s, wgmma_desc_advance(desc_k, off), wgmma_desc_advance(desc_q, off), ks > 0);
        }
        wgmma_commit();
        issue_dp_part<E>(dp, desc_v, desc_do, 0);
        if constexpr (kDpParts == 1) {
            wgmma_wait<1>();  // S^T
        } else {
            wgmma_wait<0>();
            wgmma_fence_regs(dp);
        }
        wgmma_fence_regs(s);
        // Keys past the sequence (zero rows of K) get P = 0 too: their dS^T feeds dQ, and with a very negative lse
        // an unmasked exp2(0 - lse) overflows (then dS * 0 = NaN).
        const bool masked = (causal && c_t0 + kRows - 1 > m0 + shift) || c_t0 + kRows > w.len;
        pt_from_scores<kQ, true>(s, sm.lse[pos.stage], f, key, m0, shift, causal, w.len, masked, p.sm_scale_log2);
        // At d 128 P^T stays in registers, the A operand of dV += P^T dO, whose MMAs then run while dP^T becomes
        // dS^T; at d 192 (dK's 96 registers) that spilled 192 bytes and ran 15% slower, so P^T goes to shared memory
        // beside dS^T and dV's MMAs follow dS^T.
        constexpr bool kPtInRegs = kD == 128;
        if constexpr (kPtInRegs) {
            uint32_t pt[kQ / 16][4];
            to_frags<E>(s, pt);
            wgmma_fence();
            mma_rs_mn<E, kDv>(dv, pt, do_addr, kSlab64);
            wgmma_commit();
        }
        // The other consumer's dQ MMAs of the previous tile read dS^T: wait until both retired them.
        if (it > 0) named_barrier_sync_unaligned(FusedBar::DsFree, kFusedConsumers * kWarpgroupThreads);
        // dS^T (and P^T) to shared memory, SW128 slabs [key][row]: accumulator block j holds query columns
        // 8 j + 2 quad (+1), chunk j of rows g and g + 8.
        // Row g of the slabs at chunk 0 (xor z: the compiler cannot reassociate it with the chunk offsets and
        // hoist them); chunk j of rows g and g + 8 is that address xor 16 j, plus 1024 for g + 8 (smem_layout.cuh).
        const uint32_t row_g = static_cast<uint32_t>(f.row0 * kSw128RowBytes + (f.row0 % kSw128AtomRows) * 16 + 4 * f.quad);
        const uint32_t ds_g = (smem_addr(sm.ds[c]) ^ z) + row_g;
        const uint32_t pt_g = (smem_addr(sm.pt[c]) ^ z) + row_g;
#pragma unroll
        for (int h = 0; h < kDpParts; ++h) {
            if constexpr (kPtInRegs) {
                wgmma_wait<1>();  // dP^T (it ran beside the softmax); dV runs on
                wgmma_fence_regs(dp);
            } else if (h == 1) {
                issue_dp_part<E>(dp, desc_v, desc_do, 1);
                wgmma_wait<0>();
                wgmma_fence_regs(dp);
            }
#pragma unroll
            for (int jh = 0; jh < kQ / 8 / kDpParts; ++jh) {
                const int j = h * (kQ / 8 / kDpParts) + jh;
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    float ds[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = f.col(j) + e;
                        ds[e] = s[4 * j + 2 * rr + e] * (dp[4 * jh + 2 * rr + e] - sm.delta[pos.stage][col]);
                    }
                    const uint32_t off = static_cast<uint32_t>(j * 16);
                    const uint32_t row_off = rr * 8 * kSw128RowBytes;
                    if constexpr (!kPtInRegs) {
                        st_shared_u32((pt_g ^ off) + row_off, pack_x2<E>(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]));
                    }
                    st_shared_u32((ds_g ^ off) + row_off, pack_x2<E>(ds[0], ds[1]));
                }
            }
        }
        fence_proxy_async_shared();  // dS^T (P^T): generic stores -> the MMAs' reads (async proxy)
        __syncwarp();
        // Each warp's MMA rows are its own 16 keys' rows of dS^T (P^T), but wgmma reads the whole warpgroup's tile:
        // the consumer's four warps meet first.
        named_barrier_sync_unaligned(c == 0 ? FusedBar::Staged0 : FusedBar::Staged1, kWarpgroupThreads);
        wgmma_fence();
        if constexpr (!kPtInRegs) mma_ss_kmn<E, kDv>(dv, smem_addr(sm.pt[c]) + z, do_addr);
        mma_ss_kmn<E, kD>(dk, smem_addr(sm.ds[c]) + z, q_addr);
        wgmma_commit();
        // Both halves of dS^T stored.
        named_barrier_sync_unaligned(FusedBar::DsStored, kFusedConsumers * kWarpgroupThreads);
        wgmma_wait<0>();
        wgmma_fence_regs(dv);
        wgmma_fence_regs(dk);
        MBarrier::arrive(&sm.empty[pos.stage]);  // every thread: its reads of the stage are done
        const uint32_t ds_addr[kFusedConsumers] = {smem_addr(sm.ds[0]) + z, smem_addr(sm.ds[1]) + z};
        const uint32_t k_addr[kFusedConsumers] = {smem_addr(sm.k[0]) + z, smem_addr(sm.k[1]) + z};
        // This tile's accumulator blocks: (head, tile, slab) with p.q_tiles 64-row tiles per head. Offsets that
        // break the contract (overlapping sequences) can number a tile past them: its adds are dropped.
        const int q_tile = q_tile0 + m0 / kQ;
        float* dq_blocks =
            p.dq_accum + ((static_cast<int64_t>(head) * p.q_tiles + q_tile) * (kD / 64)) * kDqBlockFloats;
        // The consumers split dQ's 64-column slabs: at d 128 one each; at d 192 two and one, swapping every tile.
        int slab_begin = c;
        int slab_end = c + 1;
        if constexpr (kD == 192) {
            const bool two = ((it + c) & 1) == 0;
            slab_begin = two ? 0 : 2;
            slab_end = two ? 2 : 3;
        }
#pragma unroll 1
        for (int slab = slab_begin; slab < slab_end; ++slab) {
            float acc[32];
            dq_chunk<E>(acc, ds_addr, k_addr, slab);
            reduce_dq_chunk(dq_blocks + slab * kDqBlockFloats, q_tile < p.q_tiles, sm.dq_stage[c],
                            c == 0 ? FusedBar::Staged0 : FusedBar::Staged1, t, acc);
        }
    }
    if (t == 0) bulk_wait_all();  // the bulk reductions read shared memory until they complete
    const int c_keys = clamp_to(kw.keys - c * kRows, 0, kRows);
    const int64_t kc0 = kw.k0 + c * kRows;
    store_rows<E, kD>(p.d_k + kc0 * p.d_k_stride_t + w.head * p.d_k_stride_h, p.d_k_stride_t, c_keys, f, dk,
                      p.sm_scale);
    store_rows<E, kDv>(p.d_v + kc0 * p.d_v_stride_t + w.head * p.d_v_stride_h, p.d_v_stride_t, c_keys, f, dv, 1.f);
}

// dQ = dq_accum * scale in the element type: one CTA of 128 threads per (64-row query tile, head), numbered as
// find_seq_tile<64> numbers tiles (p.q_tiles per head); thread t converts its fragment positions of each block.
template <int kD, class E>
__device__ __forceinline__ void dq_convert_kernel(const DensePrefillBwdParams& p) {
    if (static_cast<int64_t>(blockIdx.x) >= static_cast<int64_t>(p.q_tiles) * p.h_q) return;
    __shared__ SeqTile tile;
    const int t = static_cast<int>(threadIdx.x);
    if (t < 32) {
        const SeqTile w = find_seq_tile<kRows>(p.cu_seqlens_q, p.batch, p.total_q, p.q_tiles,
                                                   static_cast<int>(blockIdx.x), t);
        if (t == 0) tile = w;
    }
    __syncthreads();
    const SeqTile w = tile;
    if (!w.found) return;
    const int rows = min(kRows, w.len - w.t0);
    const int tile_index = p.q_tiles - 1 - static_cast<int>(blockIdx.x % p.q_tiles);  // find_seq_tile's numbering
    const AccFrag f = AccFrag::of_thread(t);
    const float* blocks =
        p.dq_accum + ((static_cast<int64_t>(w.head) * p.q_tiles + tile_index) * (kD / 64)) * kDqBlockFloats;
    uint16_t* out = p.d_q + static_cast<int64_t>(w.start + w.t0) * p.d_q_stride_t + w.head * p.d_q_stride_h;
    const float sc = p.sm_scale;
#pragma unroll 1
    for (int slab = 0; slab < kD / 64; ++slab) {
        float acc[32];
        const float4* src = reinterpret_cast<const float4*>(blocks + slab * kDqBlockFloats);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float4 v = src[k * kWarpgroupThreads + t];
            acc[4 * k] = v.x;
            acc[4 * k + 1] = v.y;
            acc[4 * k + 2] = v.z;
            acc[4 * k + 3] = v.w;
        }
        store_rows<E, 64>(out + slab * 64, p.d_q_stride_t, rows, f, acc, sc);
    }
}

}  // namespace flashmla::dense_prefill::bwd
