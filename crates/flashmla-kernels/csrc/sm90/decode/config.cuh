// Tile sizes, warp roles and the shared-memory plan of the dense decode (docs/decode.md explains the choices).
// One CTA of the split kernel serves one tile of 64 query rows (rows = (query token, head) pairs of one key head)
// over the chunks of key positions its part of the schedule holds; it gathers each chunk's keys in tiles of 64
// from the paged cache and keeps the 64 x 512 output tile on chip.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"
#include "common/softmax_tile.cuh"
#include "sm90/decode/params.h"

namespace flashmla::decode {

inline constexpr int kRowsPerCta = kTileM;     // query rows per CTA (the wgmma M); rows past `rows` are zero
inline constexpr int kKeysPerTile = kTileN;    // keys gathered per pipeline stage (the N of S = Q K^T)
inline constexpr int kStages = 2;              // KV ring depth; 3 would not fit next to Q at d_qk = 576
inline constexpr int kDv = 512;                // V width: the first 512 columns of each key row
inline constexpr int kConsumers = 2;           // consumer warpgroups, each owning half of the output columns
inline constexpr int kDvPerConsumer = kOHalfCols;  // 256
static_assert(kConsumers * kDvPerConsumer == kDv, "the two O halves cover d_v");

inline constexpr int kWarpgroupThreads = kTileThreads;  // 128
inline constexpr int kWarpsPerWarpgroup = kWarpgroupThreads / 32;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384
inline constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;

// Warpgroup roles (warpgroup index = threadIdx.x / 128), as in the sparse forward's split pipeline:
//   Producer: per chunk, loads the Q tile, then gathers the chunk's key tiles into the ring.
//   Score:    S = Q K^T per tile, masks, online softmax, P for both consumers; O[:, 0:256] += P V.
//   Value:    O[:, 256:512] += P V with the P the score warpgroup published.
enum class Role : int { Producer = 0, Score = 1, Value = 2 };

// Register split after setmaxnreg (see sparse_fwd/config.cuh: the three budgets share 3 x 168 per thread slot).
inline constexpr uint32_t kRegsAtLaunch = (65536u / kThreads) & ~7u;  // 168
// 48 / 256 / 200 (the sparse forward's split) spills 36 bytes in the value warpgroup, which holds the chunk
// enumeration on top of its O half; both splits time the same (H100, within 1%).
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kScoreRegs = 248;
inline constexpr uint32_t kValueRegs = 216;
static_assert(kProducerRegs + kScoreRegs + kValueRegs <= 3 * kRegsAtLaunch, "setmaxnreg pool of the CTA");
// The sparse FP8 decode's one-row-tile kernels (`producer_sparse`): the copy, dequantisation and publication chain
// of the key groups is what the consumers wait for (docs/decode.md), and at 40 registers its producer spilled (one row
// tile) or re-derived its addressing from the parameters (2-CTA pair). 80 / 232 / 192 runs the h_q 16 and 64 shapes
// 2-5% and the pair kernels' h_q 128 shapes up to 2% faster (H100, A/B of the builds; 96 / 224 / 184 measured the
// same) and leaves ptxas a few bytes of the epilogue's addressing to spill.
inline constexpr uint32_t kProducerRegsSparse = 80;
inline constexpr uint32_t kScoreRegsSparse = 232;
inline constexpr uint32_t kValueRegsSparse = 192;
static_assert(kProducerRegsSparse + kScoreRegsSparse + kValueRegsSparse <= 3 * kRegsAtLaunch,
              "setmaxnreg pool of the CTA");
// The pair kernels' producer holds a tile's bytes in registers (PairRegs: 44 for V3.2, plus the scales of the group
// being converted) and fills every group; their value warpgroup only multiplies. At 112 / 160 the value warpgroup
// spilled 452 bytes, at 96 / 176 52; 88 / 184 spills 32-40 bytes of the epilogue's addressing and keeps the tile's
// loads in flight across the release waits (SASS checked). Two tiles in registers (120 producer registers, with
// Q's RoPE slab in shared memory and one P buffer to pay for them) measured 7-9% slower (docs/perf-log.md).
inline constexpr uint32_t kProducerRegsPair = 88;
inline constexpr uint32_t kValueRegsPair = 184;
static_assert(kProducerRegsPair + kScoreRegsSparse + kValueRegsPair <= 3 * kRegsAtLaunch, "setmaxnreg pool of the CTA");

// Producer gather geometry: 8 threads per 128-byte slab row, 16 rows per pass, 4 passes per 64-row tile.
inline constexpr int kThreadsPerRow = kSw128ChunksPerRow;                  // 8
inline constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;    // 16
inline constexpr int kPassesPerTile = kKeysPerTile / kRowsPerPass;         // 4
static_assert(kRowsPerCta == kKeysPerTile, "Q and key tiles share the gather geometry");

// Column groups of a key stage, each with its own full/empty barrier pair (as in the sparse forward):
//   Left  = slabs 0..3 (V columns 0..255):   read by QK and by the score warpgroup's PV; released by it.
//   Right = slabs 4..7 (V columns 256..511): read by QK and by the value warpgroup's PV; released by it.
//   Rope  = slabs 8.. (d_qk 576 only):       read by QK only; released by the score warpgroup after QK.
inline constexpr int kGroupLeft = 0;
inline constexpr int kGroupRight = 1;
inline constexpr int kGroupRope = 2;
inline constexpr int kMaxGroups = 3;
inline constexpr int kDvSlabs = kDv / kSw128ColsBf16;                      // 8
inline constexpr int kSlabsPerHalf = kDvPerConsumer / kSw128ColsBf16;      // 4

// Named barriers among the 256 consumer threads (id 0 is __syncthreads, used only before the role split).
enum class Bar : uint32_t {
    Handoff = 1,        // per tile i: P(i) and alpha(i) are published and QK(i + 1) is queued; the value
                        // warpgroup has finished PV(i - 1)
    EpilogueScale = 2,  // per chunk: the score warpgroup published 1 / row sum (row_inv[chunk % 2])
    PartialStaged = 3,  // per split chunk: both consumers' bulk stores have read their staged halves
    // The narrow decode (narrow.cuh), within one warpgroup (128 threads):
    NarrowScore = 4,    // the score warpgroup's column maxima / sums and staged partial rows
    NarrowValue = 5,    // the value warpgroup's staged partial rows
    // ... and between the two consumer warpgroups (256 threads):
    NarrowChunk = 6,    // per chunk after the first: the previous chunk's staged rows left the Q tile
    NarrowQ = 7,        // per chunk with keys: both consumers' halves of the Q rows are stored and fenced
    SDone = 8,          // "S first" (kernel.cuh), per tile i >= 1: S(i) is in, the value warpgroup multiplies
                        // tile i - 1
};

template <int kDqk>
struct Config {
    static_assert(kDqk == 512 || kDqk == 576, "d_qk must be 512 or 576");
    static constexpr int kDqkSlabs = kDqk / kSw128ColsBf16;           // 8 or 9 slabs of 64 columns
    static constexpr int kRopeSlabs = kDqkSlabs - kDvSlabs;           // 1 or 0
    static constexpr int kGroups = kRopeSlabs > 0 ? 3 : 2;
    static constexpr int kSlabBytes = kKeysPerTile * kSw128RowBytes;  // 8192: one 64-row slab
    // Q columns 0..511 live in shared memory; the rope columns (512..575) are register A fragments of the score
    // warpgroup.
    static constexpr int kQSmemBytes = kDvSlabs * kSlabBytes;         // 64 KB
    static constexpr int kStageBytes = kDqkSlabs * kSlabBytes;        // one key tile: 72 KB (576) / 64 KB (512)
    static constexpr int kPBytes = kSlabBytes;                        // P: 64 rows x 64 keys, 16-bit
    static constexpr int kKStepsPerSlab = kSw128ColsBf16 / 16;        // 4 wgmma k-steps per 64-column slab
    static constexpr int kRopeSteps = kRopeSlabs * kKStepsPerSlab;    // 4 or 0
    static constexpr int kRopeFragSteps = kRopeSteps > 0 ? kRopeSteps : 1;
};

__host__ __device__ constexpr int group_first_slab(int group) {
    return group == kGroupLeft ? 0 : group == kGroupRight ? kSlabsPerHalf : kDvSlabs;
}
template <int kDqk>
__host__ __device__ constexpr int group_slabs(int group) {
    return group == kGroupRope ? Config<kDqk>::kRopeSlabs : kSlabsPerHalf;
}

// The shared-memory plan, one per d_qk. Every operand tile is 1024-byte aligned (the SW128 period).
//   q          [slab][64 rows][128 B]          Q columns 0..511 of the current chunk's rows
//   kv         [stage][slab][64 keys][128 B]   gathered key rows (K for QK; slabs 0..7 are V for PV)
//   p          [stage][64 rows][128 B]         16-bit P of tile i in p[i % 2] (read by the value warpgroup)
//   row_scale  [stage][64]                     alpha of tile i (rescale of O before adding tile i)
//   row_inv    [2][64]                         per chunk c, in slot c % 2: 1 / softmax denominator (0: no key)
//   barriers:  q_full / q_empty (per chunk with keys), kv_full[stage][group], kv_empty[stage][group]
//   sched      [kInlineScheduleWords]          kFlagInlineSchedule: the CTA's copy of the schedule (line starts,
//                                              end, budget, parts); it fills part of the 1 KB tail padding the
//                                              struct's alignment adds anyway, so the plan's size is unchanged
template <int kDqk>
struct SmemPlan {
    using C = Config<kDqk>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQSmemBytes];
    alignas(kSw128AtomBytes) uint8_t kv[kStages][C::kStageBytes];
    alignas(kSw128AtomBytes) uint8_t p[kStages][C::kPBytes];
    float row_scale[kStages][kRowsPerCta];
    float row_inv[2][kRowsPerCta];
    uint64_t q_full;                        // producer -> consumers: Q landed (128 cp.async-tracked arrivals)
    uint64_t q_empty;                       // score warpgroup -> producer: the chunk's last QK read Q (one per warp)
    uint64_t kv_full[kStages][kMaxGroups];  // producer -> consumers: a column group landed (128 arrivals)
    uint64_t kv_empty[kStages][kMaxGroups]; // consumers -> producer: a column group released (one per warp)
    // Dense decode: the right group lands slab by slab, one full barrier each (128 arrivals), so that S = Q K^T runs
    // over its first slabs while the last ones are in flight (the right group is the last one released); its
    // kv_full barrier is unused there.
    uint64_t kv_right_slab[kStages][kSlabsPerHalf];
    int32_t sched[kInlineScheduleWords];    // warp 0 -> every role (after __syncthreads)
};

inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kDqk>
inline constexpr uint32_t kSmemBytes = static_cast<uint32_t>(sizeof(SmemPlan<kDqk>)) + kSmemAlignSlack;

inline constexpr uint32_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
static_assert(kSmemBytes<576> <= kMaxSmemPerBlock, "d_qk 576 plan exceeds 227 KB");
static_assert(kSmemBytes<512> <= kMaxSmemPerBlock, "d_qk 512 plan exceeds 227 KB");
// launch.rs requests these exact sizes (SMEM_BYTES_D576 / SMEM_BYTES_D512); keep both in step.
static_assert(kSmemBytes<576> == 232448, "update launch.rs SMEM_BYTES_D576");
static_assert(kSmemBytes<512> == 216064, "update launch.rs SMEM_BYTES_D512");

// A split chunk's f32 partial: per row tile 64 rows of kDv floats; each consumer's half-row (1 KB) leaves the CTA as
// one bulk store from a staged copy in the Q tile (score) or the chunk's last key stage (value).
inline constexpr uint32_t kPartialRowBytes = kDvPerConsumer * sizeof(float);
static_assert(kRowsPerCta * kPartialRowBytes <= Config<512>::kQSmemBytes, "a staged partial half fits the Q tile");
static_assert(kRowsPerCta * kPartialRowBytes <= Config<512>::kStageBytes, "a staged partial half fits a key stage");

// Combine kernel: 256 threads, kWarpsPerRow (1, 2 or 4) warps per output row, each merging every kWarpsPerRow-th
// part of it (16 columns per lane); with several, they add their sums through shared memory. A warp's walk over its
// parts is a chain of L2 round trips, which is what a split request's combine waits on. launch.rs gives a row as many
// warps as keep a request's CTAs at most 8 per row tile (four for up to 16 rows, two for up to 32) and four for a small
// batch; more CTAs cost where many have nothing to merge.
inline constexpr int kCombineThreads = 256;
template <int kWarpsPerRow>
inline constexpr int kCombineRowsPerCta = kCombineThreads / 32 / kWarpsPerRow;  // 8, 4 or 2
// launch.rs sizes the combine grid z from these (COMBINE_THREADS); keep both in step.
static_assert(kCombineRowsPerCta<1> == 8 && kCombineRowsPerCta<2> == 4 && kCombineRowsPerCta<4> == 2,
              "update launch.rs combine_launch");
inline constexpr int kCombineColsPerLane = kDv / 32;  // 16

}  // namespace flashmla::decode
