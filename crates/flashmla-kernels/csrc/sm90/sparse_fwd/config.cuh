// Tile sizes, warp roles and the shared-memory plan of the sparse prefill forward (docs/sparse-fwd.md explains
// the choices). One CTA serves one (query token, group of 64 heads): it gathers the token's topk KV rows in
// tiles of 64 and keeps the whole 64 x 512 output tile on chip.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"

namespace flashmla::sparse_fwd {

inline constexpr int kHeadsPerCta = 64;        // wgmma M; heads beyond h_q in the last group are zero rows
inline constexpr int kMaxHeads = 128;          // host-checked limit on h_q
inline constexpr int kTileRows = 64;           // KV rows gathered per pipeline stage
inline constexpr int kStages = 2;              // KV ring depth; 3 would not fit next to Q at d_qk = 576
inline constexpr int kDv = 512;                // V width: the first 512 columns of each KV row
inline constexpr int kConsumers = 2;           // consumer warpgroups
inline constexpr int kHalfRows = kTileRows / kConsumers;  // 32: each consumer computes S for its half of a tile
inline constexpr int kDvPerConsumer = kDv / kConsumers;   // 256: each consumer owns these output columns

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384: producer WG 0, consumers WG 1, 2
inline constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;
inline constexpr int kConsumerWarps = kConsumerThreads / 32;

// Register split after setmaxnreg: 128 * 40 + 256 * 232 = 64512 <= 65536. The producer only computes addresses;
// a consumer holds a 64 x 256 f32 accumulator (128 registers) plus S, P and softmax state.
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
static_assert(kWarpgroupThreads * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");

// Producer gather geometry: 8 consecutive threads copy one 128-byte slab row (8 x 16-byte chunks), so the 128
// producer threads cover 16 rows per pass; a 64-row tile takes 4 passes, 2 per consumer half.
inline constexpr int kThreadsPerRow = kSw128ChunksPerRow;                  // 8
inline constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;    // 16
inline constexpr int kPassesPerTile = kTileRows / kRowsPerPass;            // 4
inline constexpr int kPassesPerHalf = kPassesPerTile / kConsumers;         // 2
static_assert(kHeadsPerCta == kTileRows, "Q and KV tiles share the gather geometry");

// Named barriers among the 256 consumer threads (id 0 is __syncthreads, used only before the role split).
enum class Bar : uint32_t {
    RowMaxReady = 1,   // both consumers published their tile row maxima in red[]
    PReady = 2,        // both consumers stored their bf16 P half (and fenced it for the async proxy)
    RowSumReady = 3,   // epilogue: both consumers published their row-sum partials in red[]
    StagingReady = 4,  // epilogue: the bf16 output tile is complete in shared memory
};

template <int kDqk>
struct Config {
    static_assert(kDqk == 512 || kDqk == 576, "d_qk must be 512 or 576");
    static constexpr int kDqkSlabs = kDqk / kSw128ColsBf16;           // 8 or 9 slabs of 64 columns
    static constexpr int kDvSlabs = kDv / kSw128ColsBf16;             // 8
    static constexpr int kSlabBytes = kTileRows * kSw128RowBytes;     // 8192: one 64-row slab
    static constexpr int kQBytes = kDqkSlabs * kSlabBytes;            // 72 KB (576) / 64 KB (512)
    static constexpr int kStageBytes = kDqkSlabs * kSlabBytes;        // one KV tile, same geometry as Q
    static constexpr int kPBytes = kSlabBytes;                        // P: 64 heads x 64 kv rows bf16
    static constexpr int kQkSteps = kDqk / 16;                        // wgmma k-steps of S = Q K^T
    static constexpr int kStagingRowBytes = kDv * 2;                  // bf16 output row (1024 B)
    static constexpr int kStagingChunksPerRow = kStagingRowBytes / 16;
    static_assert(kHeadsPerCta * kStagingRowBytes <= kQBytes, "the output tile is staged in the Q region");
};

// The shared-memory plan, one per d_qk. Every operand tile is 1024-byte aligned (the SW128 period).
//   q       [slab][64 heads][128 B]          Q tile; after the last QK it stages the bf16 output tile
//   kv      [stage][slab][64 rows][128 B]    gathered KV rows (K for QK; slabs 0..7 are V for PV)
//   p       [64 heads][128 B]                bf16 P of the current tile, both consumers' halves
//   red     [consumer][64]                   per-row maxima of the current tile; in the epilogue, row sums
//   valid   [stage][64]                      1 if tile row r holds a real KV row (index valid and in range)
//   barriers: q_full, kv_full[stage][half], kv_empty[stage]
template <int kDqk>
struct SmemPlan {
    using C = Config<kDqk>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQBytes];
    alignas(kSw128AtomBytes) uint8_t kv[kStages][C::kStageBytes];
    alignas(kSw128AtomBytes) uint8_t p[C::kPBytes];
    float red[kConsumers][kHeadsPerCta];
    uint8_t valid[kStages][kTileRows];
    uint64_t q_full;                       // producer -> consumers: Q landed (128 arrivals + cp.async)
    uint64_t kv_full[kStages][kConsumers]; // producer -> consumers: rows of one half landed (128 + cp.async)
    uint64_t kv_empty[kStages];            // consumers -> producer: stage released (one arrival per warp)
};

// Dynamic shared memory a launch requests: the plan plus slack to round the base up to 1024 bytes (the
// runtime only promises 16-byte alignment of dynamic shared memory).
inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kDqk>
inline constexpr uint32_t kSmemBytes = static_cast<uint32_t>(sizeof(SmemPlan<kDqk>)) + kSmemAlignSlack;

inline constexpr uint32_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
static_assert(kSmemBytes<576> <= kMaxSmemPerBlock, "d_qk 576 plan exceeds 227 KB");
static_assert(kSmemBytes<512> <= kMaxSmemPerBlock, "d_qk 512 plan exceeds 227 KB");
// launch.rs requests these exact sizes (SMEM_BYTES_D576 / SMEM_BYTES_D512); keep both in step.
static_assert(kSmemBytes<576> == 231424, "update launch.rs SMEM_BYTES_D576");
static_assert(kSmemBytes<512> == 206848, "update launch.rs SMEM_BYTES_D512");

}  // namespace flashmla::sparse_fwd
