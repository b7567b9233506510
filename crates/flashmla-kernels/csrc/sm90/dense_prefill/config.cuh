// Tile sizes, warp roles and the shared-memory plan of the dense varlen prefill forward (docs/dense-prefill.md).
// A work item is 128 query rows of one (sequence, head): two consumer warpgroups of 64 rows each stream the
// sequence's keys in tiles of 128 through a 2-stage ring that one producer warpgroup fills. A CTA serves items until
// none is left.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"

namespace flashmla::dense_prefill {

inline constexpr int kTileM = 128;             // query rows per CTA
inline constexpr int kConsumers = 2;           // consumer warpgroups, each owning 64 of the rows (the wgmma M)
inline constexpr int kRowsPerConsumer = kTileM / kConsumers;
inline constexpr int kTileN = 128;             // keys per pipeline stage (the N of S = Q K^T)
inline constexpr int kDv = 128;                // value width
inline constexpr int kStages = 2;              // K/V ring depth (3 would not fit next to Q at d = 192)

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWarpsPerWarpgroup = kWarpgroupThreads / 32;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384

// Warpgroup roles (warpgroup index = threadIdx.x / 128): the producer loads Q once and K, V tile by tile; consumer
// c computes rows 64 c .. 64 c + 63 of the CTA's tile.
enum class Role : int { Producer = 0, Consumer0 = 1, Consumer1 = 2 };

// Register split after setmaxnreg (the pool is 3 x 168 per thread slot under __launch_bounds__(384, 1)). A consumer
// holds S (64), O (64), the P fragments (32) and its softmax state. The producer's loop over work items keeps the
// item and the ring position across its copies: at 72 registers ptxas spilled two values of the d 128 copy path;
// 80 / 208 is spill-free and measured level with 72 / 216 (H100, 2 x 8K and 1 x 16K causal, builds alternating).
inline constexpr uint32_t kRegsAtLaunch = (65536u / kThreads) & ~7u;  // 168
inline constexpr uint32_t kProducerRegs = 80;
inline constexpr uint32_t kConsumerRegs = 208;
static_assert(kProducerRegs + kConsumers * kConsumerRegs <= 3 * kRegsAtLaunch, "setmaxnreg pool of the CTA");

// Producer copy geometry: 8 threads per 128-byte slab row, so 16 rows per pass of the warpgroup.
inline constexpr int kRowsPerPass = kWarpgroupThreads / kSw128ChunksPerRow;  // 16
static_assert(kTileM == kTileN, "Q and K/V tiles share the copy geometry");

// Named barriers (id 0 is __syncthreads): the consumers' turns to issue MMAs (Turn<c>: consumer c waits there until
// the other consumer has issued); the producer's hand-off of its next work item among its own 128 threads.
enum class Bar : uint32_t { Turn0 = 1, Turn1 = 2, NextWork = 3 };

template <int kD>
struct Config {
    static_assert(kD == 128 || kD == 192, "d must be 128 or 192");
    static constexpr int kSlabBytes = kTileN * kSw128RowBytes;      // 16 KB: 128 rows x 64 columns
    static constexpr int kDSlabs = kD / kSw128ColsBf16;             // 2 or 3
    static constexpr int kDvSlabs = kDv / kSw128ColsBf16;           // 2
    static constexpr int kQBytes = kDSlabs * kSlabBytes;            // 32 / 48 KB
    static constexpr int kKBytes = kDSlabs * kSlabBytes;
    static constexpr int kVBytes = kDvSlabs * kSlabBytes;           // 32 KB
    static constexpr int kQkSteps = kD / 16;                        // wgmma k-steps of S = Q K^T
    static constexpr int kKStepsPerSlab = kSw128ColsBf16 / 16;      // 4
    static constexpr int kPvSteps = kTileN / 16;                    // 8 k-steps of O += P V
    static constexpr int kConsumerRowBytes = kRowsPerConsumer * kSw128RowBytes;  // 8 KB: a consumer's rows of a slab
};

// A work item: one 128-row query tile of one (sequence, head), found by the producer's warp 0.
struct TileWork {
    int32_t found;    // 0: no item (the CTA has served its last one)
    int32_t q0;       // first query row of the tile (global row index)
    int32_t rows;     // query rows of the tile that exist (1..128)
    int32_t m0;       // first row of the tile inside its sequence
    int32_t s_q;      // the sequence's query rows
    int32_t k0;       // the sequence's first key row (global)
    int32_t s_k;      // the sequence's key rows
    int32_t head;     // query head
};

// The shared-memory plan, one per d. Operand tiles are 1024-byte aligned (the SW128 period).
//   q  [slab][128 rows][128 B]         Q
//   k  [stage][slab][128 rows][128 B]  K tiles (K-major B of S = Q K^T)
//   v  [stage][slab][128 rows][128 B]  V tiles (MN-major B of O += P V)
template <int kD>
struct SmemPlan {
    using C = Config<kD>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQBytes];
    alignas(kSw128AtomBytes) uint8_t k[kStages][C::kKBytes];
    alignas(kSw128AtomBytes) uint8_t v[kStages][C::kVBytes];
    uint64_t q_full;             // producer -> consumers: `work` written and its Q landed (128 arrivals)
    uint64_t q_empty;            // consumers -> producer: Q and `work` read for the last time (256 arrivals)
    uint64_t k_full[kStages];    // producer -> consumers: a K tile landed (128 arrivals)
    uint64_t v_full[kStages];    // producer -> consumers: a V tile landed (same)
    uint64_t k_empty[kStages];   // consumers -> producer: a K tile released (one arrival per consumer warp)
    uint64_t v_empty[kStages];   // consumers -> producer: a V tile released (same)
    TileWork work;               // the item whose Q is in `q` (found = 0: the CTA is done)
    TileWork next;               // the producer's next item, from its warp 0 to its other warps
};

// Dynamic shared memory a launch requests: the plan plus slack to round the base up to 1024 bytes.
inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kD>
inline constexpr uint32_t kSmemBytes = static_cast<uint32_t>(sizeof(SmemPlan<kD>)) + kSmemAlignSlack;
inline constexpr uint32_t kMaxSmemPerBlock = 227 * 1024;
static_assert(kSmemBytes<192> <= kMaxSmemPerBlock, "d 192 plan exceeds 227 KB");
// launch.rs requests these exact sizes (SMEM_BYTES_D192 / SMEM_BYTES_D128); keep both in step.
static_assert(kSmemBytes<192> == 215040, "update launch.rs SMEM_BYTES_D192");
static_assert(kSmemBytes<128> == 165888, "update launch.rs SMEM_BYTES_D128");

}  // namespace flashmla::dense_prefill
