// Microbenchmark: how fast can bulk copies (`cp.async.bulk`, one per row) gather random FP8 cache rows into shared
// memory? The premise of the narrow sparse decode's copy warps (docs/decode.md, "Few query rows").
//
// 128 requests of 32768 tokens (a 2.7 GB V3.2 cache at 656 bytes per token); each request picks 2048 random tokens of
// its own range, in tiles of 64 rows. Each CTA is one warp that walks its tiles (tile j, j + grid, ...) through a
// ring of `depth` slots of 64 rows: lane 0 announces a tile's bytes on the slot's mbarrier, every lane bulk-copies two
// rows, the warp waits for the oldest slot and refills it. Nothing is computed. Variants: the row and stride in bytes
// (656 at 656: V3.2 tokens; 640 at 768; 768 at 768), random or contiguous tokens, one or two CTAs (issuing warps) per
// SM, ring depth 1-5 (two CTAs per SM co-reside only up to depth 2). Prints GB/s of rows copied.
//
// Measured (H200, 2026-11-28): random 656-byte rows 1.71 / 1.94 / 1.92 / 1.97 / 1.91 TB/s at depth 1-5 with one warp
// per SM, 2.81 / 3.12 at depth 1 / 2 with two; contiguous rows 1.76-1.99 and 2.94 / 3.27. A warp issues its lanes'
// bulk copies one after another, so the issuing warps, not DRAM, set the rate.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o row_gather bench/micro/row_gather.cu
#include "micro.cuh"

constexpr int kRows = 64;

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <int kDepth>
__global__ void __launch_bounds__(32, 1) gather(const uint8_t* cache, const int* idx, int tiles, int row_bytes,
                                                int stride, unsigned long long* sink) {
    extern __shared__ __align__(128) uint8_t sm[];
    __shared__ uint64_t bar[kDepth];
    const int lane = static_cast<int>(threadIdx.x);
    const int slot_bytes = kRows * row_bytes;
    if (lane == 0) {
        for (int s = 0; s < kDepth; ++s) asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(sa(&bar[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
    __syncwarp();
    auto issue = [&](int tile, int k) {  // tile into slot k % kDepth
        const int s = k % kDepth;
        if (lane == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(sa(&bar[s])),
                         "r"(kRows * row_bytes));
        }
        __syncwarp();
        for (int h = 0; h < 2; ++h) {
            const int r = lane + 32 * h;
            const uint8_t* src = cache + static_cast<int64_t>(idx[static_cast<int64_t>(tile) * kRows + r]) * stride;
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    sa(sm + s * slot_bytes + r * row_bytes)),
                "l"(src), "r"(row_bytes), "r"(sa(&bar[s]))
                : "memory");
        }
    };
    int n = 0;
    for (int j = static_cast<int>(blockIdx.x); j < tiles; j += static_cast<int>(gridDim.x)) ++n;
    for (int k = 0; k < kDepth && k < n; ++k) issue(static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x), k);
    unsigned long long acc = 0;
    for (int k = 0; k < n; ++k) {
        const int s = k % kDepth;
        const uint32_t parity = (k / kDepth) & 1;
        asm volatile(
            "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(
                sa(&bar[s])),
            "r"(parity)
            : "memory");
        acc += sm[s * slot_bytes + lane];
        __syncwarp();
        if (k + kDepth < n) {
            issue(static_cast<int>(blockIdx.x) + (k + kDepth) * static_cast<int>(gridDim.x), k + kDepth);
        }
    }
    if (acc == 12345) sink[0] = acc;  // keeps the reads
}

template <int kDepth>
double run(const uint8_t* cache, const int* idx, int tiles, int row_bytes, int stride, int ctas,
           unsigned long long* sink) {
    const int smem = kDepth * kRows * row_bytes;
    if (smem > 227 * 1024) return 0.0;  // does not fit a CTA (printed as 0)
    CK(cudaFuncSetAttribute(gather<kDepth>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const float ms =
        time_ms([&] { gather<kDepth><<<ctas, 32, smem>>>(cache, idx, tiles, row_bytes, stride, sink); }, 10);
    CK(cudaGetLastError());
    return static_cast<double>(tiles) * kRows * row_bytes / (ms * 1e-3) / 1e9;
}

int main() {
    const int64_t reqs = 128, per = 32768, topk = 2048;
    uint8_t* cache;
    CK(cudaMalloc(&cache, reqs * per * 768));
    CK(cudaMemset(cache, 1, reqs * per * 768));
    unsigned long long* sink;
    CK(cudaMalloc(&sink, 8));
    const int tiles = static_cast<int>(reqs * topk / kRows);
    std::vector<int> rnd(reqs * topk), lin(reqs * topk), pick(topk);
    for (int64_t r = 0; r < reqs; ++r) {
        fill_random_rows(pick, per);
        for (int64_t k = 0; k < topk; ++k) {
            rnd[r * topk + k] = static_cast<int>(r * per + pick[(k + 7 * r) % topk]);
            lin[r * topk + k] = static_cast<int>(r * per + k);
        }
    }
    int *d_rnd, *d_lin;
    CK(cudaMalloc(&d_rnd, rnd.size() * 4));
    CK(cudaMalloc(&d_lin, lin.size() * 4));
    CK(cudaMemcpy(d_rnd, rnd.data(), rnd.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_lin, lin.data(), lin.size() * 4, cudaMemcpyHostToDevice));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    struct Variant {
        const char* name;
        const int* idx;
        int row, stride;
    } variants[] = {{"random 656@656", d_rnd, 656, 656},
                    {"random 640@768", d_rnd, 640, 768},
                    {"random 768@768", d_rnd, 768, 768},
                    {"contiguous 656@656", d_lin, 656, 656}};
    printf("%-20s %5s  GB/s at ring depth 1 / 2 / 3 / 4 / 5\n", "rows", "CTAs");
    for (const Variant& v : variants) {
        for (int per_sm : {1, 2}) {
            const int ctas = sms * per_sm;
            printf("%-20s %5d  %6.0f %6.0f", v.name, ctas, run<1>(cache, v.idx, tiles, v.row, v.stride, ctas, sink),
                   run<2>(cache, v.idx, tiles, v.row, v.stride, ctas, sink));
            if (per_sm == 1) {
                printf(" %6.0f %6.0f %6.0f", run<3>(cache, v.idx, tiles, v.row, v.stride, ctas, sink),
                       run<4>(cache, v.idx, tiles, v.row, v.stride, ctas, sink),
                       run<5>(cache, v.idx, tiles, v.row, v.stride, ctas, sink));
            }
            printf("\n");
        }
    }
    return 0;
}
