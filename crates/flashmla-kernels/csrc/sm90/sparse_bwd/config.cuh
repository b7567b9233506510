// Tile sizes, warp roles, register split and the shared-memory plan of the sparse prefill backward main kernel
// (docs/sparse-bwd.md explains the choices). One CTA serves one (query token, group of 64 heads): it keeps Q and
// dO of its heads resident, streams the token's topk KV rows in tiles of 64 through ONE shared-memory tile that
// is refilled as soon as the last product reading it (dQ) has retired, keeps the 64 x d_qk f32 dQ accumulator in
// registers for the whole token, and reduces each tile's dKV contribution (summed over its 64 heads by the MMA)
// into global f32. When h_q > 64 the two head groups of a token run as a 2-CTA cluster ("pair mode") and add
// their dKV partials on chip, through distributed shared memory, before the global reduction: each CTA reduces
// half of the columns of every chunk, so every (token, selected row) costs one 2304-byte row of global adds
// instead of two.
#pragma once

#include <cstdint>

#include "common/smem_layout.cuh"

namespace flashmla::sparse_bwd {

inline constexpr int kHeadsPerCta = 64;                   // wgmma M of S, dP, dQ; K of dKV
inline constexpr int kMaxHeads = 128;                     // host-checked limit on h_q
inline constexpr int kTileRows = 64;                      // KV rows per tile: wgmma M of dKV
inline constexpr int kDv = 512;                           // V width: the first 512 columns of each KV row
inline constexpr int kConsumers = 2;                      // consumer warpgroups

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // 384: producer WG 0, consumers WG 1, 2
inline constexpr int kConsumerThreads = kConsumers * kWarpgroupThreads;
inline constexpr int kConsumerWarps = kConsumerThreads / 32;

// Pair mode (2-CTA cluster, one CTA per head group of a token). For every dKV chunk (64 tile rows x 64 columns f32,
// one consumer warpgroup's accumulator) CTA rank r keeps columns [32 r, 32 r + 32) of every row and sends the other
// 32 columns to the peer: each consumer warp exchanges its 16 rows x 32 columns (2 KB) with the warp of the same
// index in the peer, adds what it receives to the half it kept, and reduces it into global memory. Every warp does
// the same work, and the exchange of chunk k overlaps the MMAs of chunk k + 1. One slot per consumer warp.
inline constexpr int kPairCtas = 2;
static_assert(kMaxHeads == kPairCtas * kHeadsPerCta, "h_q > 64 runs as a pair of head groups");
inline constexpr int kXSlotRows = 16;                                        // one warp's accumulator rows
inline constexpr int kXSlotCols = 32;                                        // half of a dKV chunk
inline constexpr int kXSlotRowBytes = kXSlotCols * 4;                        // 128: f32 half row
inline constexpr int kXSlotBytes = kXSlotRows * kXSlotRowBytes;              // 2048
inline constexpr int kXSlotVals = kXSlotRows * kXSlotCols / 32;              // 16 f32 per thread
inline constexpr int kXChunksPerRow = kXSlotRowBytes / 16;                   // 8 16-byte chunks per slot row
inline constexpr int kXSlots = kConsumerWarps;                               // one slot per consumer warp
inline constexpr int kXBytes = kXSlots * kXSlotBytes;                        // 16 KB
static_assert(kXSlotCols * kPairCtas == kSw128ColsBf16, "the pair splits a 64-column chunk in halves");
// bf16 exchange (the `_xb` pair kernels: bf16 d_kv, not deterministic, not accumulating): the peer's half travels as
// bf16 (1 KB per warp and chunk), so each warp's 2 KB holds TWO receive buffers, used by alternate chunks of a
// tile: a send waits for the peer's reduction of the chunk before the previous one (two chunks of slack). The
// receiver adds the bf16 values to its f32 kept half in registers (no staging in shared memory). These kernels split
// a chunk by rows instead (each warp keeps 8 of its 16 rows, all 64 columns: pair_send_xb), the same bytes.
inline constexpr int kXbBufBytes = kXSlotRows * kXSlotCols * 2;  // 1024: 16 rows x 32 bf16
inline constexpr int kXbBufs = 2;
static_assert(kXbBufs * kXbBufBytes == kXSlotBytes, "two bf16 buffers per f32 slot");

// Register split after setmaxnreg: 128 * 40 + 256 * 232 = 64512 <= 65536. Consumer 0 holds the widest dQ slice
// (5 slabs = 160 f32 at d_qk 576) plus S (32 f32); consumer 1 dQ (128) plus dP (32) and the dS A-fragments (16);
// during dKV each also holds one 64 x 64 chunk (32) and, in pair mode, the kept half of the previous one (16).
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
static_assert(kWarpgroupThreads * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "register file");

// Producer gather geometry (same as the forward): 8 consecutive threads copy one 128-byte slab row, 128 threads
// cover 16 rows per pass, 4 passes per 64-row tile.
inline constexpr int kThreadsPerRow = kSw128ChunksPerRow;                // 8
inline constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;  // 16
inline constexpr int kPassesPerTile = kTileRows / kRowsPerPass;          // 4

// Bucketed entry order (SparseBwdParams::kv_buckets > 1; kernel.cuh, "Bucketed order"). Each producer warp keeps a
// 6-bit bucket id per entry of its quarter of the token's index row in kBucketIdWords registers per lane (5 ids per
// word, id 63 = no bucket), so a row of at most kMaxBucketedTopk entries can be bucketed; longer rows keep the
// index order. launch.rs mirrors kMaxKvBuckets and kMaxBucketedTopk (MAX_KV_BUCKETS, MAX_BUCKETED_TOPK).
inline constexpr int kBucketIdBits = 6;
inline constexpr uint32_t kNoBucket = (1u << kBucketIdBits) - 1;   // 63: invalid entry, in no bucket
inline constexpr int kMaxKvBuckets = static_cast<int>(kNoBucket);  // 63: ids 0..62
inline constexpr int kBucketIdsPerWord = 32 / kBucketIdBits;       // 5
inline constexpr int kBucketIdWords = 4;
inline constexpr int kScanSlots = kTileRows / 4;  // 16: tile rows filled by each producer warp
inline constexpr int kMaxBucketTiles = kBucketIdsPerWord * kBucketIdWords * 32 / kScanSlots;  // 40
inline constexpr int kMaxBucketedTopk = kMaxBucketTiles * kTileRows;                          // 2560
static_assert(kHeadsPerCta == kTileRows, "Q/dO and KV tiles share the gather geometry");

// Named barriers among the 256 consumer threads (id 0 is __syncthreads, used only before the role split). The two
// consumers are different instantiations of `consumer<..., kCw, ...>`, so each barrier is reached from two static
// code paths: hence the unaligned barrier.sync (named_barrier_sync_unaligned; the aligned bar.sync is what
// compute-sanitizer synccheck reported as divergent).
enum class Bar : uint32_t {
    DsReady = 1,       // both consumers stored their halves of the bf16 P and dS' tiles (fenced for the async proxy)
    HandoffStart = 2,  // consumer 1 stored dP - delta of its half, consumer 0's S retired
    HalvesStored = 5,  // consumer 0 stored the exp2 arguments of its half
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
    // The per-warp slots (pair exchange, solo staging). At d_qk 576 there is no spare shared memory for them: they
    // alias the last two KV slabs (7 and 8, 16 KB), which the producer therefore refills only after every consumer
    // warp finished the last chunk of the previous tile (the consumers read those slabs last in S = Q K^T, so the
    // late refill overlaps S of slabs 0..6). At d_qk 512 they have their own 16 KB.
    static constexpr bool kXbufInKv = kDqk == 576;
    static constexpr int kLateSlabs = kXbufInKv ? kXBytes / kSlabBytes : 0;  // KV slabs refilled after the drain
    static_assert(!kXbufInKv || kLateSlabs * kSlabBytes == kXBytes, "the exchange covers whole KV slabs");
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
//   xbuf     [slot][16 rows][128 B] f32     pair mode: the peer's 32 columns of one warp's dKV chunk rows, row-major
//                                           with the 16-byte chunk index XORed with (row % 8), so both the
//                                           fragment-order accesses and the row-order reads are conflict-free.
//                                           Own region at d_qk 512 (first in the plan); KV slabs 7-8 at d_qk 576
//   barriers: qdo_full, kv_full[slab], kv_empty; pair mode x_full[slot], x_empty[slot], x_drained; the
//            consumers' hand-off pds_free
template <int kDqk>
struct XbufRegion {
    alignas(kSw128AtomBytes) uint8_t xbuf[kXBytes];
};
template <>
struct XbufRegion<576> {};  // empty base: no bytes

template <int kDqk>
struct SmemPlan : XbufRegion<kDqk> {
    using C = Config<kDqk>;
    alignas(kSw128AtomBytes) uint8_t q[C::kQBytes];
    alignas(kSw128AtomBytes) uint8_t d_out[C::kDoBytes];
    alignas(kSw128AtomBytes) uint8_t kv[C::kKvBytes];
    alignas(kSw128AtomBytes) uint8_t p[C::kTileBf16Bytes];
    alignas(kSw128AtomBytes) uint8_t ds[C::kTileBf16Bytes];
    int32_t row_idx[2][kTileRows];
    uint64_t qdo_full;               // producer -> consumers: Q and dO landed and fenced (128 arrivals)
    uint64_t kv_full[C::kDqkSlabs];  // producer -> consumers: slab s of the current tile landed, fenced (128)
    uint64_t kv_empty;               // consumers -> producer: tile released (one arrival per consumer thread)
    uint64_t x_full[kXbBufs * kXSlots];   // pair: the peer's 2 KB of a chunk landed in slot s (1 arrival + tx
                                          // bytes); bf16 exchange: [2 s + b] for buffer b of slot s (1 KB)
    uint64_t x_empty[kXbBufs * kXSlots];  // pair: the peer may write its next chunk into ITS slot s (1 remote
                                          // arrival); bf16 exchange: [2 s + b] for buffer b
    uint64_t x_drained;              // every consumer thread consumed the last chunk of a tile (producer waits
                                     // at d_qk 576 before refilling the KV slabs the slots alias)
    // Consumer 0 -> 1 (one arrival per thread; an mbarrier, whose ordering racecheck models):
    uint64_t pds_free;  // consumer 0 -> 1: its dKV products of tile i retired, phase i (128; not after the last)
    uint32_t p_order_sink[kWarpgroupThreads];  // consumer 0 thread t stores a value derived from all of its P
                                               // at [t] before HandoffStart (keeps the exp2s ahead of the
                                               // rendezvous); never read

    // Base of the exchange slots.
    __device__ __forceinline__ uint8_t* xbuf_base() {
        if constexpr (C::kXbufInKv) {
            return kv + (C::kDqkSlabs - C::kLateSlabs) * C::kSlabBytes;
        } else {
            return this->xbuf;
        }
    }
};

// Dynamic shared memory a launch requests: the plan plus slack to round the base up to 1024 bytes.
inline constexpr uint32_t kSmemAlignSlack = kSw128AtomBytes;
template <int kDqk>
inline constexpr uint32_t kSmemBytes = static_cast<uint32_t>(sizeof(SmemPlan<kDqk>)) + kSmemAlignSlack;

inline constexpr uint32_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
static_assert(kSmemBytes<576> <= kMaxSmemPerBlock, "d_qk 576 plan exceeds 227 KB");
static_assert(kSmemBytes<512> <= kMaxSmemPerBlock, "d_qk 512 plan exceeds 227 KB");
// launch.rs requests these exact sizes (SMEM_BYTES_D576 / SMEM_BYTES_D512); keep both in step.
static_assert(kSmemBytes<576> == 232448, "update launch.rs SMEM_BYTES_D576");
static_assert(kSmemBytes<512> == 232448, "update launch.rs SMEM_BYTES_D512");

// The small kernels of the family.
inline constexpr int kSmallThreads = 256;           // every auxiliary kernel: 8 warps
inline constexpr int kElemChunk = 8;                // finalisation: 8 values per thread step (16 B bf16 / 32 B f32)

}  // namespace flashmla::sparse_bwd
