// Tile sizes, warp roles and the shared-memory plan of the sparse prefill forward (docs/sparse-fwd.md explains
// the choices). One CTA serves one (query token, group of 64 heads): it gathers the token's topk KV rows in
// tiles of 64 and keeps the whole 64 x 512 output tile on chip.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"

namespace flashmla::sparse_fwd {

inline constexpr int kHeadsPerCta = 64;        // wgmma M; heads beyond h_q in the last group are zero rows
inline constexpr int kMaxHeads = 128;          // host-checked limit on h_q
inline constexpr int kTileRows = 64;           // KV rows gathered per pipeline stage (the N of S = Q K^T)
inline constexpr int kStages = 2;              // KV ring depth; 3 would not fit next to Q at d_qk = 576
inline constexpr int kDv = 512;                // V width: the first 512 columns of each KV row
inline constexpr int kConsumers = 2;           // consumer warpgroups, each owning half of the output columns
inline constexpr int kDvPerConsumer = kDv / kConsumers;  // 256

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWarpsPerWarpgroup = kWarpgroupThreads / 32;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384
inline constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;

// Warpgroup roles (warpgroup index = threadIdx.x / 128).
//   Producer: loads Q once, gathers KV tiles into the ring.
//   Score:    S = Q K^T for every tile, the online softmax, P (bf16) for both consumers; O[:, 0:256] += P V.
//   Value:    O[:, 256:512] += P V with the P the score warpgroup published.
enum class Role : int { Producer = 0, Score = 1, Value = 2 };

// Register split after setmaxnreg. __launch_bounds__(384, 1) gives every thread 168 registers at launch, and
// setmaxnreg.inc only draws on registers other warpgroups of the CTA released with setmaxnreg.dec, so the three
// budgets must fit in 3 x 168 = 504 per thread slot (asking for more deadlocks the increasing warpgroup).
// The producer only computes addresses; the score warpgroup holds its O half (128), S (32), the P fragments
// (16), the Q rope fragments (16) and the softmax state; the value warpgroup holds its O half and addresses.
inline constexpr uint32_t kRegsAtLaunch = (65536u / kThreads) & ~7u;  // 168
inline constexpr uint32_t kProducerRegs = 48;
inline constexpr uint32_t kScoreRegs = 256;
inline constexpr uint32_t kValueRegs = 200;
static_assert(kProducerRegs + kScoreRegs + kValueRegs <= 3 * kRegsAtLaunch, "setmaxnreg pool of the CTA");
// Alternating pipeline: both consumers hold an O half, S, the P fragments and the Q rope fragments.
inline constexpr uint32_t kAltRegs = 224;
static_assert(kProducerRegs + 2 * kAltRegs <= 3 * kRegsAtLaunch, "setmaxnreg pool of the CTA (alternating)");

// Producer gather geometry: 8 consecutive threads copy one 128-byte slab row (8 x 16-byte chunks), so the 128
// producer threads cover 16 rows per pass; a 64-row tile takes 4 passes.
inline constexpr int kThreadsPerRow = kSw128ChunksPerRow;                  // 8
inline constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;    // 16
inline constexpr int kPassesPerTile = kTileRows / kRowsPerPass;            // 4
static_assert(kHeadsPerCta == kTileRows, "Q and KV tiles share the gather geometry");

// Column groups of a KV stage. Each has its own full/empty barrier pair so a group is refilled as soon as its
// last reader is done (docs/sparse-fwd.md, "Pipeline"):
//   Left  = slabs 0..3 (V columns 0..255):   read by QK and by the score warpgroup's PV; released by it.
//   Right = slabs 4..7 (V columns 256..511): read by QK and by the value warpgroup's PV; released by it.
//   Rope  = slabs 8.. (d_qk 576 only):       read by QK only; released by the score warpgroup after QK.
inline constexpr int kGroupLeft = 0;
inline constexpr int kGroupRight = 1;
inline constexpr int kGroupRope = 2;
inline constexpr int kMaxGroups = 3;
inline constexpr int kDvSlabs = kDv / kSw128ColsBf16;                      // 8
inline constexpr int kSlabsPerHalf = kDvPerConsumer / kSw128ColsBf16;      // 4

// Named barriers among the 256 consumer threads (id 0 is __syncthreads, used only before the role split). Both
// warpgroups block on each (a full rendezvous for every exchange through shared memory), each from its own code
// path, hence the unaligned barrier.sync (named_barrier_sync_unaligned).
enum class Bar : uint32_t {
    Handoff = 1,        // per tile i: P(i) and alpha(i) are published and QK(i + 1) is queued; the value
                        // warpgroup has finished PV(i - 1)
    EpilogueScale = 2,  // epilogue: the score warpgroup published 1 / row sum
    StagingReady = 3,   // epilogue: the bf16 output tile is complete in shared memory
};

template <int kDqk>
struct Config {
    static_assert(kDqk == 512 || kDqk == 576, "d_qk must be 512 or 576");
    static constexpr int kDqkSlabs = kDqk / kSw128ColsBf16;           // 8 or 9 slabs of 64 columns
    static constexpr int kRopeSlabs = kDqkSlabs - kDvSlabs;           // 1 or 0
    static constexpr int kGroups = kRopeSlabs > 0 ? 3 : 2;
    static constexpr int kSlabBytes = kTileRows * kSw128RowBytes;     // 8192: one 64-row slab
    // Q columns 0..511 live in shared memory; the rope columns (512..575) are register A fragments of the
    // score warpgroup, which frees the 8 KB that the second P buffer needs at d_qk 576.
    static constexpr int kQSmemBytes = kDvSlabs * kSlabBytes;         // 64 KB
    static constexpr int kStageBytes = kDqkSlabs * kSlabBytes;        // one KV tile: 72 KB (576) / 64 KB (512)
    static constexpr int kPBytes = kSlabBytes;                        // P: 64 heads x 64 kv rows bf16
    static constexpr int kKStepsPerSlab = kSw128ColsBf16 / 16;        // 4 wgmma k-steps per 64-column slab
    static constexpr int kRopeSteps = kRopeSlabs * kKStepsPerSlab;    // 4 or 0
    static constexpr int kRopeFragSteps = kRopeSteps > 0 ? kRopeSteps : 1;  // register array extent (>= 1)
    static constexpr int kStagingRowBytes = kDv * 2;                  // bf16 output row (1024 B)
    static constexpr int kStagingChunksPerRow = kStagingRowBytes / 16;
    static_assert(kHeadsPerCta * kStagingRowBytes <= kQSmemBytes, "the output tile is staged in the Q region");
};

// First slab and slab count of a column group.
__host__ __device__ constexpr int group_first_slab(int group) {
    return group == kGroupLeft ? 0 : group == kGroupRight ? kSlabsPerHalf : kDvSlabs;
}
template <int kDqk>
__host__ __device__ constexpr int group_slabs(int group) {
    return group == kGroupRope ? Config<kDqk>::kRopeSlabs : kSlabsPerHalf;
}

// The shared-memory plan, one per d_qk. Every operand tile is 1024-byte aligned (the SW128 period).
//   q          [slab][64 heads][128 B]         Q columns 0..511; after the last QK it stages the bf16 output
//   kv         [stage][slab][64 rows][128 B]   gathered KV rows (K for QK; slabs 0..7 are V for PV)
//   p          [stage][64 heads][128 B]        bf16 P of tile i in p[i % 2] (read by the value warpgroup)
//   row_scale  [stage][64]                     alpha of tile i (rescale of O before adding tile i)
//   row_inv    [64]                            epilogue: 1 / softmax denominator (0 for rows with nothing valid)
//   chain_ref, chain_run [stage][64]            alternating pipeline: the running reference / max after tile i
//   barriers:  q_full, kv_full[stage][group], kv_empty[stage][group]
// Only the score and value warpgroups touch p, row_scale and row_inv with ordinary loads and stores, always
// separated by bar.sync rendezvous; the producer writes only q and kv, through cp.async.
template <int kDqk>
struct SmemPlan {
    using C = Config<kDqk>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQSmemBytes];
    alignas(kSw128AtomBytes) uint8_t kv[kStages][C::kStageBytes];
    alignas(kSw128AtomBytes) uint8_t p[kStages][C::kPBytes];
    float row_scale[kStages][kHeadsPerCta];
    float row_inv[kHeadsPerCta];
    float chain_ref[kStages][kHeadsPerCta];  // alternating pipeline: m_ref / m_run after tile i, in slot i % 2
    float chain_run[kStages][kHeadsPerCta];
    uint64_t q_full;                        // producer -> consumers: Q landed (128 cp.async-tracked arrivals)
    uint64_t kv_full[kStages][kMaxGroups];  // producer -> consumers: a column group landed (same, 128)
    uint64_t kv_empty[kStages][kMaxGroups]; // consumers -> producer: a column group released (one per warp)
    // Alternating pipeline, consumer c -> consumer 1 - c (128 arrivals each, one per thread of c):
    // [0][c] P of c's tile published in p[c] (with its row scales); [1][c] chain state of c's tile published;
    // [2][c] p[c] consumed by the other consumer's PV (arrived by 1 - c).
    uint64_t alt_bar[3][kConsumers];
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
static_assert(kSmemBytes<576> == 232448, "update launch.rs SMEM_BYTES_D576");
static_assert(kSmemBytes<512> == 216064, "update launch.rs SMEM_BYTES_D512");

}  // namespace flashmla::sparse_fwd
