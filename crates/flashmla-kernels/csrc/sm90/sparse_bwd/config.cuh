// Tile sizes, warp roles, register split and the shared-memory plan of the sparse prefill backward main kernel
// (docs/sparse-bwd.md explains the choices). One CTA serves one (query token, group of 64 heads): it keeps Q and
// dO of its heads resident, streams the token's topk KV rows in tiles of 64 through ONE shared-memory tile that
// is refilled as soon as the last product reading it (dQ) has retired, keeps the 64 x d_qk f32 dQ accumulator in
// registers for the whole token, and reduces each tile's dKV contribution (already summed over its 64 heads by
// the MMA) into global f32 with 16-byte vector reductions.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"

namespace flashmla::sparse_bwd {

inline constexpr int kHeadsPerCta = 64;                   // wgmma M of S, dP, dQ; K of dKV
inline constexpr int kMaxHeads = 128;                     // host-checked limit on h_q
inline constexpr int kTileRows = 64;                      // KV rows per tile: wgmma M of dKV
inline constexpr int kDv = 512;                           // V width: the first 512 columns of each KV row
inline constexpr int kConsumers = 2;                      // consumer warpgroups
inline constexpr int kHalfRows = kTileRows / kConsumers;  // 32: consumer c computes S, dP for tile rows 32c..32c+31

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384: producer WG 0, consumers WG 1, 2
inline constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;
inline constexpr int kConsumerWarps = kConsumerThreads / 32;

// Register split after setmaxnreg: 128 * 40 + 256 * 232 = 64512 <= 65536. Consumer 0 holds the widest dQ slice
// (5 slabs = 160 f32 at d_qk 576) plus S and dP halves (16 + 16 f32) and the dS A-fragments (8).
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
static_assert(kWarpgroupThreads * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");

// Producer gather geometry (same as the forward): 8 consecutive threads copy one 128-byte slab row, 128 threads
// cover 16 rows per pass, 4 passes per 64-row tile.
inline constexpr int kThreadsPerRow = kSw128ChunksPerRow;                // 8
inline constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;  // 16
inline constexpr int kPassesPerTile = kTileRows / kRowsPerPass;          // 4
static_assert(kHeadsPerCta == kTileRows, "Q/dO and KV tiles share the gather geometry");

// Named barriers among the 256 consumer threads (id 0 is __syncthreads, used only before the role split).
enum class Bar : uint32_t {
    DsReady = 1,       // both consumers stored their bf16 P and dS halves (fenced for the async proxy)
    PdsFree = 2,       // both consumers finished the dKV products of the previous tile (P, dS tiles reusable)
    MmaDone = 3,       // epilogue: every wgmma of both consumers retired (the Q region becomes staging)
    StagingReady = 4,  // epilogue: the bf16 dQ tile is complete in shared memory
};

template <int kDqk>
struct Config {
    static_assert(kDqk == 512 || kDqk == 576, "d_qk must be 512 or 576");
    static constexpr int kDqkSlabs = kDqk / kSw128ColsBf16;        // 9 or 8 slabs of 64 columns
    static constexpr int kDvSlabs = kDv / kSw128ColsBf16;          // 8
    static constexpr int kSlabBytes = kTileRows * kSw128RowBytes;  // 8192: one 64-row slab
    static constexpr int kQBytes = kDqkSlabs * kSlabBytes;         // 72 KB (576) / 64 KB (512)
    static constexpr int kDoBytes = kDvSlabs * kSlabBytes;         // 64 KB
    static constexpr int kKvBytes = kDqkSlabs * kSlabBytes;        // one KV tile, same geometry as Q
    static constexpr int kTileBf16Bytes = kSlabBytes;              // P or dS: 64 heads x 64 kv rows bf16
    static constexpr int kStepsPerSlab = kSw128ColsBf16 / 16;      // 4 wgmma k-steps of 16 columns per slab

    // dQ columns: consumer 0 owns slabs [0, kDqSlabs0), consumer 1 the rest (MN-major B operands must start on a
    // slab boundary, so the split is by whole slabs: 5 + 4 at d_qk 576, 4 + 4 at 512).
    static constexpr int kDqSlabs0 = (kDqkSlabs + 1) / 2;
    static constexpr int kDqSlabs1 = kDqkSlabs - kDqSlabs0;
    // dKV column chunks (one slab each, 64 x 64 f32): consumer 1 (the narrower dQ) owns the even slabs, consumer 0
    // the odd ones. MMA k-steps per tile then balance: 576: c0 = 20 (dQ) + 4 x 8 = 52, c1 = 16 + 4 x 8 + 4 = 52.
    static constexpr int kStagingRowBytes = kDqk * 2;  // bf16 dQ row staged in the Q region by the epilogue
    static constexpr int kStagingChunksPerRow = kStagingRowBytes / kSw128ChunkBytes;
    static_assert(kStagingChunksPerRow % kSw128ChunksPerRow == 0, "staging swizzle permutes groups of 8 chunks");
    static_assert(kHeadsPerCta * kStagingRowBytes <= kQBytes, "the dQ tile is staged in the Q region");
};

// Owner of dKV column chunk (slab) s.
__host__ __device__ constexpr int dkv_chunk_owner(int s) { return (s % 2 == 0) ? 1 : 0; }

// The shared-memory plan, one per d_qk. Every operand tile is 1024-byte aligned (the SW128 period).
//   q        [slab][64 heads][128 B]        Q (K-major A of S; MN-major B of dKV); staging of the bf16 dQ at the end
//   d_out    [slab][64 heads][128 B]        dO (K-major A of dP; MN-major B of dKV)
//   kv       [slab][64 rows][128 B]         the current KV tile (K-major B of S and dP; MN-major B of dQ); ONE
//                                           tile, refilled slab by slab once dQ of the previous tile retired
//   p, ds    [64 heads][64 rows] bf16       P and sm_scale * dS of the current tile (MN-major A of dKV; dS also
//                                           K-major A of dQ for the other consumer's rows)
//   row_idx  [2][64] i32                    KV row of each tile row, -1 when invalid (masking and dKV targets);
//                                           double-buffered because dKV(i) still reads it while tile i+1 lands
//   barriers: qdo_full, kv_full[slab], kv_empty
template <int kDqk>
struct SmemPlan {
    using C = Config<kDqk>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQBytes];
    alignas(kSw128AtomBytes) uint8_t d_out[C::kDoBytes];
    alignas(kSw128AtomBytes) uint8_t kv[C::kKvBytes];
    alignas(kSw128AtomBytes) uint8_t p[C::kTileBf16Bytes];
    alignas(kSw128AtomBytes) uint8_t ds[C::kTileBf16Bytes];
    int32_t row_idx[2][kTileRows];
    uint64_t qdo_full;               // producer -> consumers: Q and dO landed (128 arrivals + cp.async)
    uint64_t kv_full[C::kDqkSlabs];  // producer -> consumers: slab s of the current tile landed (128 + cp.async)
    uint64_t kv_empty;               // consumers -> producer: tile released (one arrival per consumer warp)
};

// Dynamic shared memory a launch requests: the plan plus slack to round the base up to 1024 bytes.
inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kDqk>
inline constexpr uint32_t kSmemBytes = static_cast<uint32_t>(sizeof(SmemPlan<kDqk>)) + kSmemAlignSlack;

inline constexpr uint32_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
static_assert(kSmemBytes<576> <= kMaxSmemPerBlock, "d_qk 576 plan exceeds 227 KB");
static_assert(kSmemBytes<512> <= kMaxSmemPerBlock, "d_qk 512 plan exceeds 227 KB");
// launch.rs requests these exact sizes (SMEM_BYTES_D576 / SMEM_BYTES_D512); keep both in step.
static_assert(kSmemBytes<576> == 231424, "update launch.rs SMEM_BYTES_D576");
static_assert(kSmemBytes<512> == 215040, "update launch.rs SMEM_BYTES_D512");

// The small kernels of the family.
inline constexpr int kSmallThreads = 256;           // every auxiliary kernel: 8 warps
inline constexpr int kDeltaRowsPerWarp = 4;         // delta pre-pass: (t, h) rows per warp
inline constexpr int kDeltaRowsPerCta = kDeltaRowsPerWarp * (kSmallThreads / 32);  // 32
inline constexpr int kElemChunk = 8;                // finalisation: 8 values per thread step (16 B bf16 / 32 B f32)

}  // namespace flashmla::sparse_bwd
