// Microbenchmark: scattered f32 row reductions into a d_kv-like accumulator [s_kv, 576] (the sparse backward's
// d_kv path). Compares
//   red   : red.global.add.v4.f32 from registers, one warp per row (what the backward's consumers issue today)
//   bulk  : cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 from shared memory, one instruction per
//           segment of `seg` bytes, issued by one lane per warp (the TMA engine does the adds)
// Rows are random in [0, s_kv); `rows` contributions of 576 floats each. Prints TB/s of f32 adds.
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o reduce_bw reduce_bw.cu
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

constexpr int kD = 576;
constexpr int kRowBytes = kD * 4;

#include "micro.cuh"

__global__ void red_kernel(float* acc, const int* idx, long rows) {
    const int lane = threadIdx.x % 32;
    const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
    const long nwarps = (gridDim.x * (long)blockDim.x) / 32;
    const float v = 1.0f / 1024;
    for (long r = warp; r < rows; r += nwarps) {
        float* row = acc + (long)__ldg(idx + r) * kD;
        for (int c = lane * 4; c < kD; c += 128) {
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(row + c), "f"(v), "f"(v), "f"(v), "f"(v)
                         : "memory");
        }
    }
}

template <int kSeg>
__global__ void bulk_kernel(float* acc, const int* idx, long rows) {
    __shared__ __align__(128) float src[kD];
    for (int i = threadIdx.x; i < kD; i += blockDim.x) src[i] = 1.0f / 1024;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
    const long nwarps = (gridDim.x * (long)blockDim.x) / 32;
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
    constexpr int kSegs = kRowBytes / kSeg;
    // lanes 0..kSegs-1 each issue one segment of the row (kSegs <= 32)
    for (long r = warp; r < rows; r += nwarps) {
        if (lane < kSegs) {
            char* row = reinterpret_cast<char*>(acc + (long)__ldg(idx + r) * kD) + lane * kSeg;
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(row),
                         "r"(s + lane * kSeg), "n"(kSeg)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    const long rows = 4096L * 2048;  // s_q * topk contributions (pair-reduced: one per token and row)
    int* idx;
    CK(cudaMalloc(&idx, rows * 4));
    std::vector<int> h(rows);
    for (long s_kv : {8192L, 32768L, 131072L}) {
        fill_random_rows(h, s_kv);
        CK(cudaMemcpy(idx, h.data(), rows * 4, cudaMemcpyHostToDevice));
        float* acc;
        CK(cudaMalloc(&acc, s_kv * kRowBytes));
        CK(cudaMemset(acc, 0, s_kv * kRowBytes));
        const double bytes = (double)rows * kRowBytes;
        const int sms = prop.multiProcessorCount;
        for (int wpb : {8, 16}) {
            float ms = time_ms([&] { red_kernel<<<sms * 2, wpb * 32>>>(acc, idx, rows); }, 5);
            printf("s_kv %6ld acc %5.0f MB  red.v4   %2d warps/CTA x2: %7.2f ms %5.2f TB/s\n", s_kv,
                   s_kv * kRowBytes / 1e6, wpb, ms, bytes / ms / 1e9);
        }
        for (int wpb : {4, 8, 16}) {
            float ms = time_ms([&] { bulk_kernel<2304><<<sms * 2, wpb * 32>>>(acc, idx, rows); }, 5);
            printf("s_kv %6ld acc %5.0f MB  bulk2304 %2d warps/CTA x2: %7.2f ms %5.2f TB/s\n", s_kv,
                   s_kv * kRowBytes / 1e6, wpb, ms, bytes / ms / 1e9);
            ms = time_ms([&] { bulk_kernel<576><<<sms * 2, wpb * 32>>>(acc, idx, rows); }, 5);
            printf("s_kv %6ld acc %5.0f MB  bulk576  %2d warps/CTA x2: %7.2f ms %5.2f TB/s\n", s_kv,
                   s_kv * kRowBytes / 1e6, wpb, ms, bytes / ms / 1e9);
            ms = time_ms([&] { bulk_kernel<128><<<sms * 2, wpb * 32>>>(acc, idx, rows); }, 5);
            printf("s_kv %6ld acc %5.0f MB  bulk128  %2d warps/CTA x2: %7.2f ms %5.2f TB/s\n", s_kv,
                   s_kv * kRowBytes / 1e6, wpb, ms, bytes / ms / 1e9);
        }
        CK(cudaGetLastError());
        CK(cudaFree(acc));
    }
    return 0;
}
