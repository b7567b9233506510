// The work item of one CTA in the sparse prefill kernels (forward and backward): grid x enumerates
// (token, 64-head group) pairs, token-major, so the head groups of a token are neighbours (and, in the backward's
// pair mode, one cluster).
#pragma once

#include <cstdint>

namespace flashmla {

// What one CTA works on; identical in every thread.
struct CtaWork {
    int token;     // query token t
    int head0;     // first head of the group
    int heads;     // heads of the group that exist (1..kHeadsPerCta); rows >= heads are zero padding
    int topk_eff;  // entries of the index row that take part: min(max(topk_length[t], 0), topk) or topk
    int n_tiles;   // ceil(topk_eff / kTileRows)
};

// `Params` has num_head_groups, h_q, topk, topk_length (nullable) and topk_length_stride. `token0`: the first token
// of the launch (a launch may cover a range of tokens; the host checked that token0 + grid / groups <= s_q).
template <int kHeadsPerCta, int kTileRows, class Params>
__device__ __forceinline__ CtaWork cta_work(const Params& p, int token0 = 0) {
    CtaWork w;
    const int group = static_cast<int>(blockIdx.x) % p.num_head_groups;
    w.token = token0 + static_cast<int>(blockIdx.x) / p.num_head_groups;
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

}  // namespace flashmla
