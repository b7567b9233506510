// Microbenchmark: do scattered f32 reductions slow a concurrent wgmma stream on the same SM, and does it matter
// which warps issue them? This is the premise of the sparse backward's "reductions off the chunk phase" design
// (docs/sparse-bwd.md, next step 6): that the d_kv adds, once staged, can drain while the tensor cores run.
//
// One persistent CTA per SM, 384 threads, like the kernels: warpgroups 1 and 2 ("consumers") issue back-to-back
// m64n64k16 bf16 wgmma with both operands in shared memory (K-major, 128B swizzle; what S = Q K^T and dP = dO V^T
// issue), one commit group of 4 k-steps at a time with one group in flight. Warpgroup 0 ("producer") is idle or
// reduces into an f32 accumulator of `s_kv` rows x 576 at random rows. Modes:
//   mma            consumers only: the MMA rate alone
//   red            producer only (red.global.add.v4.f32 from registers, 512 contiguous bytes per warp instruction):
//                  the reduction rate alone
//   mma+prod_red   both at once: reductions issued by the producer warps
//   mma+prod_bulk  both at once: reductions by cp.reduce.async.bulk (TMA) of 2304-byte rows from shared memory,
//                  one lane per producer warp, up to 8 bulk groups in flight
//   mma+cons_red   the consumers interleave `red_per_batch` reductions (512 B each, per warp) after every group
//                  of 4 k-steps: today's arrangement, where the issuing warps are the MMA warps
// For each mode: the MMA rate (TFLOPS over the whole GPU) and the reduction rate (TB/s of f32 adds).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I crates/flashmla-kernels/csrc \
//          -o mma_red_overlap bench/micro/mma_red_overlap.cu
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <utility>
#include <cuda_runtime.h>

#include "common/wgmma.cuh"

using namespace flashmla;

constexpr int kD = 576;
constexpr int kRowBytes = kD * 4;
constexpr int kThreads = 384;
constexpr int kSlabBytes = 64 * 128;  // 64 rows x 128 bytes (64 bf16 of K)
constexpr int kStageRows = 8;         // bulk-reduce source rows in shared memory
constexpr int kSmemBytes = 1024 + 2 * kSlabBytes + kStageRows * kRowBytes;

enum Mode : int { kMma = 0, kRed = 1, kMmaProdRed = 2, kMmaProdBulk = 3, kMmaConsRed = 4 };

#include "micro.cuh"

struct Params {
    float* acc;               // [s_kv, 576] f32
    const int* idx;           // random rows in [0, s_kv)
    long n_idx;               // entries of idx (a power of two)
    unsigned long long* red;  // bytes reduced, summed over the grid
    float* sink;              // keeps the MMA results alive
    int mode;
    int iters;                // consumer groups of 4 k-steps
    int red_per_batch;        // kMmaConsRed: reductions per warp per group
    long red_rows;            // kRed: rows per producer warp
};

__device__ __forceinline__ void red_v4(float* dst, float v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(dst), "f"(v) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) overlap_kernel(Params p) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    __shared__ volatile int consumers_done;
    const int wg = threadIdx.x / 128;
    const int t = threadIdx.x % 128;
    const int lane = threadIdx.x % 32;
    const long gwarp = static_cast<long>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
    // Operands: arbitrary non-zero bf16 bit patterns (the tensor core's power depends on the data).
    for (int i = threadIdx.x; i < (2 * kSlabBytes + kStageRows * kRowBytes) / 4; i += kThreads) {
        reinterpret_cast<uint32_t*>(smem)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
    }
    if (threadIdx.x == 0) consumers_done = 0;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();

    const bool consumers_run = p.mode != kRed;
    unsigned long long reduced = 0;
    if (wg > 0) {
        if (consumers_run) {
            const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
            const uint64_t da = make_wgmma_desc_sw128(a, 16, 1024);
            const uint64_t db = make_wgmma_desc_sw128(a + kSlabBytes, 16, 1024);
            float acc[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[i] = 0.f;
            long r = gwarp * 977;
            for (int it = 0; it < p.iters; ++it) {
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    wgmma_m64n64k16_ss_kk(acc, wgmma_desc_advance(da, 32 * k), wgmma_desc_advance(db, 32 * k), true);
                }
                wgmma_commit();
                if (p.mode == kMmaConsRed) {
                    for (int j = 0; j < p.red_per_batch; ++j) {
                        const int row = __ldg(p.idx + (r++ & (p.n_idx - 1)));
                        float* dst = p.acc + static_cast<long>(row) * kD + 4 * lane;  // 512 contiguous bytes
                        red_v4(dst, 1.0f / 1024);
                        reduced += 512 / 32;
                    }
                }
                wgmma_wait<1>();
            }
            wgmma_wait<0>();
            wgmma_fence_regs(acc);
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 32; ++i) s += acc[i];
            if (s == 12345.f) p.sink[threadIdx.x] = s;  // never true; keeps the MMAs
        }
        asm volatile("bar.sync 1, 256;" ::: "memory");
        if (wg == 1 && t == 0) consumers_done = 1;
    } else if (p.mode == kRed || p.mode == kMmaProdRed) {
        long r = gwarp * 7919;
        for (long n = 0; p.mode == kRed ? n < p.red_rows : !consumers_done; ++n) {
            const int row = __ldg(p.idx + (r++ & (p.n_idx - 1)));
            float* base = p.acc + static_cast<long>(row) * kD;
            // 576 floats = 4.5 x 512 bytes: lanes cover 128 floats per instruction.
#pragma unroll
            for (int c = 0; c < kD; c += 128) {
                if (c + 4 * lane < kD) red_v4(base + c + 4 * lane, 1.0f / 1024);
            }
            reduced += kRowBytes / 32;
        }
    } else if (p.mode == kMmaProdBulk) {
        const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem + 2 * kSlabBytes));
        long r = gwarp * 7919;
        if (lane == 0) {
            for (long n = 0; !consumers_done; ++n) {
                const int row = __ldg(p.idx + (r++ & (p.n_idx - 1)));
                asm volatile(
                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                        p.acc + static_cast<long>(row) * kD),
                    "r"(src + static_cast<uint32_t>(n % kStageRows) * kRowBytes), "n"(kRowBytes)
                    : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
                reduced += kRowBytes;
            }
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        }
    }
    // Sum the bytes reduced (per lane for warp-wide reductions, per issuing lane for bulk ones).
    if (reduced) atomicAdd(p.red, reduced);
}

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s, %d SMs\n", prop.name, sms);
    const int iters = argc > 1 ? atoi(argv[1]) : 20000;  // groups of 4 k-steps per consumer warpgroup
    const long n_idx = 1L << 22;
    int* idx;
    CK(cudaMalloc(&idx, n_idx * 4));
    unsigned long long* red;
    CK(cudaMalloc(&red, sizeof(unsigned long long)));
    float* sink;
    CK(cudaMalloc(&sink, kThreads * 4));
    CK(cudaFuncSetAttribute(overlap_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    std::vector<int> h(n_idx);
    // MMA FLOP per launch: 2 consumer warpgroups x iters x 4 k-steps x (64 x 64 x 16 x 2), per SM.
    const double mma_flop = 2.0 * iters * 4 * (64.0 * 64 * 16 * 2) * sms;
    for (long s_kv : {8192L, 32768L}) {
        fill_random_rows(h, s_kv);
        CK(cudaMemcpy(idx, h.data(), n_idx * 4, cudaMemcpyHostToDevice));
        float* acc;
        CK(cudaMalloc(&acc, s_kv * kRowBytes));
        CK(cudaMemset(acc, 0, s_kv * kRowBytes));
        cudaEvent_t ev0, ev1;
        CK(cudaEventCreate(&ev0));
        CK(cudaEventCreate(&ev1));
        // One warm-up launch, then 5 timed ones, each with its own byte count; the median launch by time is printed.
        auto run = [&](const char* name, int mode, int red_per_batch, long red_rows) {
            Params p{acc, idx, n_idx, red, sink, mode, iters, red_per_batch, red_rows};
            std::vector<std::pair<float, unsigned long long>> runs;
            for (int rep = 0; rep < 6; ++rep) {
                CK(cudaMemset(red, 0, sizeof(unsigned long long)));
                CK(cudaEventRecord(ev0));
                overlap_kernel<<<sms, kThreads, kSmemBytes>>>(p);
                CK(cudaGetLastError());
                CK(cudaEventRecord(ev1));
                CK(cudaEventSynchronize(ev1));
                float ms = 0.f;
                CK(cudaEventElapsedTime(&ms, ev0, ev1));
                unsigned long long bytes = 0;
                CK(cudaMemcpy(&bytes, red, sizeof(bytes), cudaMemcpyDeviceToHost));
                if (rep > 0) runs.emplace_back(ms, bytes);
            }
            std::sort(runs.begin(), runs.end());
            const auto [ms, bytes] = runs[runs.size() / 2];
            printf("acc %5.0f MB  %-14s rpb %2d: %8.3f ms  MMA %6.1f TFLOPS  red %5.2f TB/s\n",
                   s_kv * kRowBytes / 1e6, name, red_per_batch, ms, mode == kRed ? 0.0 : mma_flop / ms / 1e9,
                   bytes / ms / 1e9);
        };
        run("mma", kMma, 0, 0);
        run("red", kRed, 0, 4096);
        run("mma+prod_red", kMmaProdRed, 0, 0);
        run("mma+prod_bulk", kMmaProdBulk, 0, 0);
        for (int rpb : {1, 2, 4}) run("mma+cons_red", kMmaConsRed, rpb, 0);
        CK(cudaFree(acc));
    }
    return 0;
}
