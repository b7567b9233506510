// The split-KV schedule of the dense decode, computed on the device from `cache_seqlens` (docs/decode.md,
// "Schedule"), and the chunk enumeration every role of the split kernel and the combine kernel derive from it.
//
// The line: request b costs `chunk_overhead + tiles_b` units (tiles_b = ceil(len_b / 64), len_b = cache_seqlens[b]
// clamped to 0..max_blocks * page_size); requests lie on a line in order, request b on [S_b, S_{b + 1}), its key
// tile k at S_b + overhead + k. The line is cut into parts of `budget` units; part p processes every key tile on
// [p * budget, (p + 1) * budget), one chunk per request it meets. A request without keys is handled (out = 0,
// lse = +inf) by the part holding its unit S_b + overhead - 1.
//   balanced (fixed_budget == 0): budget = ceil(L / grid_parts), so the grid's parts share the work evenly, but at
//     least min(ceil(longest segment / max_request_parts), max_budget_floor) (a lone long request is not cut into
//     more partials than pay off, until its parts are long enough that more parallel tiles pay); when every request
//     has the same segment s and rounding the budget up to a multiple of s costs at most 1/16 more, the budget is
//     rounded up (whole requests per part, none split);
//   batch-invariant (fixed_budget > 0): every request's segment is rounded up to a multiple of the fixed budget,
//     so its chunk boundaries depend only on its own length, never on the rest of the batch.
// A request whose tiles span parts f_b < l_b is "split": each of its chunks writes a normalised f32 partial to slot
// 2 p + (p == f_b) (part p's last chunk if it is the request's first, else part p's first chunk), and the combine
// kernel merges them. Unsplit requests are written in final form by the split kernel.
#pragma once

#include <cstdint>

#include "sm90/decode/params.h"

namespace flashmla::decode {

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31: the host's multiplier and shift for d (`divider` in launch.rs; mul 0
// stands for d = 1), floor(n * mul / 2^(32 + shr)) with mul = ceil(2^(32 + shr) / d) is exact in that range. A
// division by a runtime value compiles to ~20 dependent instructions; the kernels divide by shapes at every index,
// row and block-table address, and those divisions were about a tenth of a split kernel's code.
__device__ __forceinline__ int fast_div(int n, uint32_t mul, uint32_t shr) {
    return mul == 0 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), mul) >> shr);
}

// Batch entry and query token a request stands for (dense: (req, 0); sparse: one query token per request).
__device__ __forceinline__ int request_batch(const DecodeParams& p, int req) {
    return fast_div(req, p.req_div_mul, p.req_div_shr);
}
__device__ __forceinline__ int request_token(const DecodeParams& p, int req) {
    return req - request_batch(p, req) * p.req_tokens;
}

// Offset of request `req` in a tensor whose first two dimensions are (batch entry, query token).
__device__ __forceinline__ int64_t request_offset(const DecodeParams& p, int req, int64_t stride_b, int64_t stride_s) {
    return static_cast<int64_t>(request_batch(p, req)) * stride_b + static_cast<int64_t>(request_token(p, req)) * stride_s;
}

// clamp(length[b], 0, cap), or cap without a length tensor (sparse topk_length / extra_topk_length).
__device__ __forceinline__ int clamped_length(const int32_t* length, int64_t stride, int b, int cap) {
    if (length == nullptr) return cap;
    return min(max(__ldg(length + static_cast<int64_t>(b) * stride), 0), cap);
}

// Sparse: entries of the main index row request `req` attends to (its extra entries follow them).
__device__ __forceinline__ int main_len(const DecodeParams& p, int req) {
    return clamped_length(p.topk_length, p.topk_length_stride, request_batch(p, req), p.topk);
}

// Key positions of request `req`. Dense: cache_seqlens[b] clamped to 0..max_blocks * page_size. Sparse: the main
// entries, then the extra ones.
__device__ __forceinline__ int request_len(const DecodeParams& p, int req) {
    if (p.flags & kFlagSparse) {
        const int extra = p.extra_topk == 0 ? 0
                                            : clamped_length(p.extra_topk_length, p.extra_topk_length_stride,
                                                             request_batch(p, req), p.extra_topk);
        return main_len(p, req) + extra;
    }
    const int len = __ldg(p.cache_seqlens + static_cast<int64_t>(req) * p.cache_seqlens_stride);
    const int64_t cap = static_cast<int64_t>(p.max_blocks) * p.page_size;
    return static_cast<int>(min(static_cast<int64_t>(max(len, 0)), cap));
}

// x / page_size and x % page_size of the main cache for x >= 0. The per-key address math of the producer and the
// consumers' block-id loads run once per key per tile, so a division's ~20 dependent instructions showed in their
// issue time.
__device__ __forceinline__ int page_div(const DecodeParams& p, int x) {
    return fast_div(x, p.page_div_mul, p.page_div_shr);
}
__device__ __forceinline__ int page_mod(const DecodeParams& p, int x) { return x - page_div(p, x) * p.page_size; }

__device__ __forceinline__ int tiles_of(int len) { return (len + kTileN - 1) / kTileN; }

// Line units request b occupies, in 32-bit arithmetic: lengths are clamped to the cache (request_len), and the host
// bounds every segment, the budget and the line below 2^29 (ops/decode/launch.rs, MAX_LINE).
__device__ __forceinline__ int segment_of(const DecodeParams& p, int len) {
    const int seg = p.chunk_overhead + tiles_of(len);
    if (p.fixed_budget > 0) return (seg + p.fixed_budget - 1) / p.fixed_budget * p.fixed_budget;
    return seg;
}

// The budget (line units per part) and the number of parts, from the line's length, its longest segment, whether every
// segment equals the first one (seg0), and the shape-only parameters (`aligned_budget` and the geometry in
// ops/decode/launch.rs and reference/decode/schedule.rs are the same rule). 32-bit divisions: the host bounds the
// line and the parts below 2^29 (a 64-bit division is a subroutine call, which costs the split kernel's prologue
// registers).
__device__ __forceinline__ void schedule_rule(const DecodeParams& p, int line, int longest, bool uniform, int seg0,
                                              int32_t& budget_out, int32_t& parts_out) {
    int budget, parts;
    if (p.fixed_budget > 0) {
        budget = p.fixed_budget;
        parts = line / budget;
    } else {
        budget = max(1, (line + p.grid_parts - 1) / p.grid_parts);
        if (p.max_request_parts > 0) {
            int floor = (longest + p.max_request_parts - 1) / p.max_request_parts;
            if (p.max_budget_floor > 0) floor = min(floor, p.max_budget_floor);
            budget = max(budget, floor);
        }
        // A uniform batch whose parts can hold whole requests at a cost of at most 1/16 more per part takes
        // whole requests: no request is split, so no partials and no combine work.
        if (uniform) {
            const int aligned = (budget + seg0 - 1) / seg0 * seg0;
            if (static_cast<int64_t>(aligned - budget) * 16 <= budget) budget = aligned;
        }
        parts = p.grid_parts;
    }
    budget_out = budget;
    parts_out = min(parts, p.max_parts);
}

// The schedule kernel's body: one CTA of kScheduleThreads threads writes S_0..S_batch, the budget and the number of
// parts (a block-wide prefix sum in rounds of kScheduleThreads requests).
inline constexpr int kScheduleThreads = 1024;
__device__ __forceinline__ void write_schedule(const DecodeParams& p) {
    __shared__ int64_t warp_sums[kScheduleThreads / 32];
    __shared__ int64_t carry_s;
    __shared__ int uniform_s;  // every request has the same segment
    __shared__ int longest_s;  // the longest segment (segments fit in int: the host bounds the line)
    const int t = static_cast<int>(threadIdx.x);
    const int lane = t % 32, warp = t / 32;
    if (t == 0) {
        carry_s = 0;
        uniform_s = 1;
        longest_s = 0;
    }
    __syncthreads();
    const int64_t seg0 = segment_of(p, request_len(p, 0));
    for (int base = 0; base < p.batch; base += kScheduleThreads) {
        const int b = base + t;
        const int64_t seg = b < p.batch ? segment_of(p, request_len(p, b)) : 0;
        if (b < p.batch && seg != seg0) uniform_s = 0;  // benign race: every writer stores 0
        if (b < p.batch) atomicMax(&longest_s, static_cast<int>(seg));
        int64_t incl = seg;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            int64_t w = warp_sums[lane];
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int64_t v = __shfl_up_sync(0xffffffffu, w, d);
                if (lane >= d) w += v;
            }
            warp_sums[lane] = w;  // inclusive over warps
        }
        __syncthreads();
        const int64_t carry = carry_s;
        const int64_t excl = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + incl - seg;
        if (b < p.batch) p.schedule[b] = static_cast<int32_t>(excl);
        __syncthreads();
        if (t == kScheduleThreads - 1) carry_s = excl + seg;
        __syncthreads();
    }
    if (t == 0) {
        const int64_t line = carry_s;
        int32_t budget, parts;
        schedule_rule(p, static_cast<int>(line), longest_s, uniform_s != 0, static_cast<int>(seg0), budget, parts);
        p.schedule[p.batch] = static_cast<int32_t>(line);
        p.schedule[p.batch + 1] = budget;
        p.schedule[p.batch + 2] = parts;
    }
}

// The schedule of a batch of at most kInlineScheduleMaxBatch requests, derived by warp 0 of a split CTA
// (kFlagInlineSchedule: no schedule kernel, one launch fewer per step). Lane l reads the lengths of requests l,
// l + 32, ... (all loads issued before any is used), a warp scan per 32 requests with a running carry gives the line
// starts, and the lanes write them with the budget and parts into `dst` (the CTA's own copy in shared memory, read
// after the CTA's first __syncthreads). CTA (0, 0) writes the same to p.schedule, which the combine kernel reads
// after this kernel.
__device__ __forceinline__ void write_schedule_warp(const DecodeParams& p, int32_t* dst, bool shared_copy) {
    constexpr int kRounds = kInlineScheduleMaxBatch / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    int seg[kRounds];
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
        const int r = 32 * k + lane;
        seg[k] = r < p.batch ? segment_of(p, request_len(p, r)) : 0;
    }
    const int seg0 = __shfl_sync(0xffffffffu, seg[0], 0);
    int carry = 0;
    int longest = 0;
    bool uniform = p.batch > 0;
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
        const int r = 32 * k + lane;
        const bool valid = r < p.batch;
        int incl = seg[k];
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        if (valid) {
            const int32_t start = carry + incl - seg[k];
            dst[r] = start;
            if (shared_copy) p.schedule[r] = start;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
        longest = max(longest, seg[k]);
        uniform = uniform && __all_sync(0xffffffffu, !valid || seg[k] == seg0);
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
    int32_t budget, parts;
    schedule_rule(p, carry, longest, uniform, seg0, budget, parts);
    if (lane == 0) {
        dst[p.batch] = carry;
        dst[p.batch + 1] = budget;
        dst[p.batch + 2] = parts;
        if (shared_copy) {
            p.schedule[p.batch] = carry;
            p.schedule[p.batch + 1] = budget;
            p.schedule[p.batch + 2] = parts;
        }
    }
}

// One chunk of work: key tiles [tile0, tile1) of request b.
struct Chunk {
    int b;       // the request
    int len;     // keys of the request
    int main;    // sparse: keys < main come from the main cache, the rest from the extra one (dense: len)
    int tile0;
    int tile1;   // tile0 == tile1: a request without keys
    bool split;  // the request spans several parts: write a partial to `slot`
    int slot;
};

// The schedule as read by a CTA.
struct Schedule {
    const int32_t* line;  // S_0..S_batch (unread with a uniform line)
    int budget;
    int parts;
    int seg;  // kFlagUniformLine: every request's segment, S_b = b * seg; else 0
    // The schedule at `line` (S_0..S_batch, then budget and parts): p.schedule, or a split CTA's inline copy. A
    // uniform line (kFlagUniformLine: a sparse batch without length tensors, whose requests all attend topk +
    // extra_topk entries) is derived from the shape alone, by the rule the schedule kernel applies: no schedule
    // kernel, no scan, no loads. kMayBeUniform: the caller serves sparse batches (the dense split kernels pass
    // false, and their code does not carry the test).
    template <bool kMayBeUniform = true>
    static __device__ __forceinline__ Schedule load(const DecodeParams& p, const int32_t* line) {
        if (kMayBeUniform && (p.flags & kFlagUniformLine)) {
            const int seg = segment_of(p, request_len(p, 0));
            int32_t budget, parts;
            schedule_rule(p, p.batch * seg, seg, p.batch > 0, seg, budget, parts);
            return {line, budget, parts, seg};
        }
        return {line, line[p.batch + 1], line[p.batch + 2], 0};
    }
    static __device__ __forceinline__ Schedule load(const DecodeParams& p) { return load(p, p.schedule); }
    // S_b, the line position where request b starts (b <= batch).
    __device__ __forceinline__ int start(int b) const { return seg > 0 ? b * seg : line[b]; }
    // Largest b with S_b <= pos (S_0 <= pos < S_batch), found by the calling warp (all 32 lanes, the same pos): each
    // round every lane reads one of 32 evenly spaced starts of the range and a ballot keeps the piece holding pos,
    // so the round trips are log32(batch), not log2(batch) (the line may be in global memory: a dependent load
    // each, in front of the CTA's first tile). A uniform line: pos / seg.
    __device__ __forceinline__ int request_at(int pos, int batch) const {
        if (seg > 0) return pos / seg;
        const int lane = static_cast<int>(threadIdx.x) % 32;
        int lo = 0, n = batch;  // the answer is in [lo, lo + n)
        while (n > 32) {
            const int step = (n + 31) / 32;
            const int at = lo + lane * step;
            const unsigned le = __ballot_sync(0xffffffffu, at < lo + n && line[at] <= pos);
            const int k = 31 - __clz(le);  // lane 0 reads S_lo <= pos, so le != 0
            lo += k * step;
            n = min(step, n - k * step);
        }
        const unsigned le = __ballot_sync(0xffffffffu, lane < n && line[lo + lane] <= pos);
        return lo + 31 - __clz(le);
    }
    // Part holding line position `pos`.
    __device__ __forceinline__ int part_of(int pos) const { return pos / budget; }
};

// Calls f(chunk) for every chunk of part `part`, in line order. Every role of a CTA runs the same enumeration. f is
// called from one site, so the chunk body (a role's tile loop and epilogue) is inlined once: a request without keys
// runs the same code with tile0 == tile1.
template <class F>
__device__ __forceinline__ void for_each_chunk(const DecodeParams& p, const Schedule& s, int part, F&& f) {
    const int lo = part * s.budget;
    const int hi = lo + s.budget;
    if (lo >= s.start(p.batch)) return;
    for (int b = s.request_at(lo, p.batch); b < p.batch; ++b) {
        const int start = s.start(b);
        if (start >= hi) break;
        const int first = start + p.chunk_overhead;  // line position of tile 0
        const int len = request_len(p, b);
        const int tiles = tiles_of(len);
        Chunk c{b, 0, 0, 0, 0, false, 0};  // a request without keys
        if (tiles == 0) {
            if (first - 1 < lo || first - 1 >= hi) continue;
        } else {
            const int k0 = max(lo - first, 0);
            const int k1 = min(hi - first, tiles);
            if (k0 >= k1) continue;
            const int fp = s.part_of(first);
            const int lp = s.part_of(first + tiles - 1);
            const int main = (p.flags & kFlagSparse) ? main_len(p, b) : len;
            c = Chunk{b, len, main, k0, k1, fp != lp, 2 * part + (part == fp ? 1 : 0)};
        }
        f(c);
    }
}

}  // namespace flashmla::decode
