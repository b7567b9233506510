// Which sequence tile a work item of the dense prefill kernels names. Items enumerate (head, tile) pairs, head-major
// and tile-minor, so the items that run together share their heads' operands in L2; inside a head the query tiles run
// last first and the backward's key blocks first to last (under a causal mask those see the most keys or queries, so
// the longest items start first). The backward's kernels take item blockIdx.x; the forward's persistent CTAs take
// items from a counter in that order. Tile indices count the kTile-row tiles of the sequences in order; warp 0 finds
// the sequence of its tile with a prefix scan over the offsets, 32 sequences per step. The offsets are clamped into
// [0, total] and made non-decreasing on the way (a running max), so sequences never overlap and all their tiles fit
// the grid's bound `tiles` = ceil(total / kTile) + batch, whatever the offsets hold.
#pragma once

#include <cstdint>

#include "common/softmax_tile.cuh"

namespace flashmla::dense_prefill {

__device__ __forceinline__ int clamp_to(int v, int lo, int hi) { return min(max(v, lo), hi); }

// A CTA's tile of one sequence's rows (of the tiled tensor: queries or keys).
struct SeqTile {
    int found;  // 0: the tile index is past the last sequence's tiles
    int seq;    // the sequence
    int head;   // the head (of the tiled tensor)
    int start;  // the sequence's first row (global)
    int len;    // the sequence's rows
    int t0;     // the tile's first row inside the sequence
};

// The tile of item `linear`: heads major; inside a head the last tile first (kLastFirst: under the causal mask the
// query tiles that see the most keys) or the first (the key blocks that see the most queries). Run by all 32 lanes
// of one warp; the result is the same in every lane.
template <int kTile, bool kLastFirst = true>
__device__ __forceinline__ SeqTile find_seq_tile(const int32_t* cu, int batch, int total, int tiles, int linear,
                                                 int lane) {
    const int tile = kLastFirst ? tiles - 1 - linear % tiles : linear % tiles;
    SeqTile w{};
    w.head = linear / tiles;
    int carry_end = clamp_to(__ldg(cu), 0, total);
    int carry_tiles = 0;
    for (int base = 0; base < batch; base += 32) {
        const int b = base + lane;
        int end = b < batch ? clamp_to(__ldg(cu + b + 1), 0, total) : 0;
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const int v = __shfl_up_sync(kFullMask, end, off);
            if (lane >= off) end = max(end, v);
        }
        end = max(end, carry_end);
        int start = __shfl_up_sync(kFullMask, end, 1);
        if (lane == 0) start = carry_end;
        const int n = (end - start + kTile - 1) / kTile;  // 0 past the batch (end == start there)
        int incl = n;
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const int v = __shfl_up_sync(kFullMask, incl, off);
            if (lane >= off) incl += v;
        }
        incl += carry_tiles;
        const uint32_t hit = __ballot_sync(kFullMask, b < batch && incl > tile);
        if (hit != 0) {
            const int src = __ffs(hit) - 1;
            w.found = 1;
            w.seq = base + src;
            w.start = __shfl_sync(kFullMask, start, src);
            w.len = __shfl_sync(kFullMask, end, src) - w.start;
            w.t0 = (tile - __shfl_sync(kFullMask, incl - n, src)) * kTile;
            return w;
        }
        carry_end = __shfl_sync(kFullMask, end, 31);
        carry_tiles = __shfl_sync(kFullMask, incl, 31);
    }
    return w;
}

// The rows [start, start + len) of sequence `seq` in the other tensor, from its offsets clamped into [0, total].
__device__ __forceinline__ void other_range(const int32_t* cu, int seq, int total, int& start, int& len) {
    start = clamp_to(__ldg(cu + seq), 0, total);
    len = clamp_to(__ldg(cu + seq + 1), start, total) - start;
}

}  // namespace flashmla::dense_prefill
