// Microbenchmark: distributed shared memory (DSMEM) transfers between the two CTAs of a 2-CTA cluster, in the
// pattern of the sparse backward's bf16 pair exchange: every warp sends one chunk of `bytes` to the same warp of the
// peer through two receive buffers per warp, with an mbarrier per buffer for "full" (the arrival of the bytes) and
// one for "empty" (the peer's permission to send into it again), and receives the peer's chunk in between:
//   send chunk k, then receive chunk k - 1 (wait full, read the bytes, give the peer its permission for k + 1).
// Modes:
//   st.async : every lane st.async's 16-byte pieces into the peer's buffer (what the backward does)
//   bulk     : every lane writes its pieces to a local staging buffer, lane 0 pushes the chunk with one
//              cp.async.bulk.shared::cluster.shared::cta (the TMA engine moves it)
// One CTA per SM (the dynamic shared memory forces it), 132 CTAs = 66 clusters on an H100. Prints, per mode, chunk
// size and warps per CTA, the cycles per chunk of one warp and the bytes per cycle each SM sends (and receives).
// Build (from bench/micro): nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o dsmem_bw dsmem_bw.cu
// The figures of 2026-11-24 (docs/perf-log.md; the output is in git history) were taken with private copies of the same
// PTX (commit ff0735a); this version calls the kernels' own primitives from common/.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

// The kernels' own DSMEM and mbarrier primitives (the same PTX the backward's pair exchange issues).
#include "../../crates/flashmla-kernels/csrc/common/cluster.cuh"
#include "../../crates/flashmla-kernels/csrc/common/mbarrier.cuh"

#include "micro.cuh"

constexpr int kMaxWarps = 8;
constexpr int kMaxBytes = 4096;
constexpr int kSmem = 2 * kMaxWarps * 2 * kMaxBytes + 1024;  // receive + staging buffers, barriers

using flashmla::cluster_ctarank_volatile;
using flashmla::cluster_sync;
using flashmla::fence_mbarrier_init_cluster;
using flashmla::mapa_shared;
using flashmla::MBarrier;
using flashmla::mbarrier_arrive_expect_tx;
using flashmla::mbarrier_arrive_remote_relaxed;
using flashmla::mbarrier_wait_parity;
using flashmla::smem_addr;
using flashmla::st_async_v4_b32;

// The one primitive the kernels do not use: a bulk copy from this CTA's shared memory into the peer's, completing
// on the peer's mbarrier.
__device__ __forceinline__ void bulk_to_peer(uint32_t remote_dst, uint32_t local_src, uint32_t bytes,
                                             uint32_t remote_bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            remote_dst),
        "r"(local_src), "r"(bytes), "r"(remote_bar)
        : "memory");
}

// kBulk: staging + one bulk copy per chunk; else per-lane st.async. `bytes` per chunk and warp (multiple of 512).
template <bool kBulk>
__global__ void __cluster_dims__(2, 1, 1) exchange_kernel(int bytes, int iters, long long* cycles, float* sink) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const int warp = threadIdx.x / 32;
    const uint32_t lane = threadIdx.x % 32;
    const int warps = blockDim.x / 32;
    uint8_t* recv = smem;                                  // [warp][2][kMaxBytes]
    uint8_t* stage = smem + kMaxWarps * 2 * kMaxBytes;      // [warp][2][kMaxBytes]
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 2 * kMaxWarps * 2 * kMaxBytes);  // full[w][2], empty[w][2]
    const uint32_t rank = cluster_ctarank_volatile();
    if (threadIdx.x < warps * 4) MBarrier::init(bars + threadIdx.x, 1);
    fence_mbarrier_init_cluster();
    cluster_sync();

    const uint32_t full0 = smem_addr(bars + 4 * warp);      // full[b] = full0 + 8 b
    const uint32_t empty0 = smem_addr(bars + 4 * warp + 2);  // empty[b] = empty0 + 8 b
    const uint32_t recv0 = smem_addr(recv + warp * 2 * kMaxBytes);
    const uint32_t stage0 = smem_addr(stage + warp * 2 * kMaxBytes);
    const uint32_t delta = mapa_shared(recv0, rank ^ 1u) - recv0;  // local -> peer shared::cluster address
    // Permission for the peer's first use of each of our buffers.
    if (lane == 0) {
        mbarrier_arrive_remote_relaxed(empty0 + delta);
        mbarrier_arrive_remote_relaxed(empty0 + 8 + delta);
    }
    const int pieces = bytes / 512;  // 16 bytes per lane per piece
    float acc = 0.f;
    auto send = [&](int k) {
        const uint32_t b = k & 1, parity = (k >> 1) & 1;
        mbarrier_wait_parity(empty0 + 8 * b, parity);
        const uint4 v = make_uint4(k, lane, warp, rank);
        if constexpr (kBulk) {
            for (int i = 0; i < pieces; ++i) {
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(stage0 + b * kMaxBytes + 512 * i +
                                                                             16 * lane),
                             "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                             : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) {
                bulk_to_peer(recv0 + b * kMaxBytes + delta, stage0 + b * kMaxBytes, bytes, full0 + 8 * b + delta);
            }
        } else {
            for (int i = 0; i < pieces; ++i) {
                st_async_v4_b32(recv0 + b * kMaxBytes + 512 * i + 16 * lane + delta, v, full0 + 8 * b + delta);
            }
        }
    };
    auto receive = [&](int k) {
        const uint32_t b = k & 1, parity = (k >> 1) & 1;
        if (lane == 0) mbarrier_arrive_expect_tx(full0 + 8 * b, bytes);
        mbarrier_wait_parity(full0 + 8 * b, parity);
        for (int i = 0; i < pieces; ++i) {
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(recv0 + b * kMaxBytes + 512 * i + 16 * lane)
                         : "memory");
            acc += static_cast<float>(v.x + v.y + v.z + v.w);
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive_remote_relaxed(empty0 + 8 * b + delta);  // the peer may send chunk k + 2 into buffer b
    };
    const long long t0 = clock64();
    for (int k = 0; k < iters; ++k) {
        send(k);
        if (k > 0) receive(k - 1);
    }
    receive(iters - 1);
    const long long t1 = clock64();
    if (lane == 0) cycles[blockIdx.x * kMaxWarps + warp] = t1 - t0;
    if (acc == 12345.f) *sink = acc;
    // The peer's last permission arrivals may still target our barriers; nobody leaves before both are done.
    cluster_sync();
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int ctas = sms / 2 * 2;
    long long* d_cycles;
    float* d_sink;
    CK(cudaMalloc(&d_cycles, sizeof(long long) * ctas * kMaxWarps));
    CK(cudaMalloc(&d_sink, sizeof(float)));
    CK(cudaFuncSetAttribute(exchange_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(cudaFuncSetAttribute(exchange_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const int iters = 4000;
    printf("mode      bytes  warps  cycles/chunk(median warp)  B/clk/SM sent  GB/s total sent\n");
    for (int mode = 0; mode < 2; ++mode) {
        for (int bytes : {1024, 2048, 4096}) {
            for (int warps : {1, 4, 8}) {
                cudaEvent_t e0, e1;
                CK(cudaEventCreate(&e0));
                CK(cudaEventCreate(&e1));
                auto launch = [&]() {
                    if (mode == 0) {
                        exchange_kernel<false><<<ctas, 32 * warps, kSmem>>>(bytes, iters, d_cycles, d_sink);
                    } else {
                        exchange_kernel<true><<<ctas, 32 * warps, kSmem>>>(bytes, iters, d_cycles, d_sink);
                    }
                };
                launch();  // warm-up
                CK(cudaGetLastError());
                CK(cudaEventRecord(e0));
                launch();
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                float ms = 0.f;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                static long long h[132 * kMaxWarps];
                CK(cudaMemcpy(h, d_cycles, sizeof(long long) * ctas * kMaxWarps, cudaMemcpyDeviceToHost));
                // median over CTAs of warp 0's cycles
                long long v[132];
                for (int c = 0; c < ctas; ++c) v[c] = h[c * kMaxWarps];
                for (int i = 0; i < ctas; ++i)
                    for (int j = i + 1; j < ctas; ++j)
                        if (v[j] < v[i]) {
                            long long t = v[i];
                            v[i] = v[j];
                            v[j] = t;
                        }
                const double cyc = static_cast<double>(v[ctas / 2]) / iters;
                const double sent = static_cast<double>(ctas) * warps * iters * bytes;
                printf("%-8s  %5d  %5d  %25.0f  %13.1f  %15.0f\n", mode == 0 ? "st.async" : "bulk", bytes, warps, cyc,
                       warps * bytes / cyc, sent / (ms * 1e-3) / 1e9);
                CK(cudaEventDestroy(e0));
                CK(cudaEventDestroy(e1));
            }
        }
    }
    return 0;
}
