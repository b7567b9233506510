// Microbenchmark: the deterministic backward's d_kv reductions. Each warp reduces chunks of 16 random rows x 32
// columns (what one consumer warp reduces per dKV chunk) into an accumulator [s_kv, 576] of
//   f32_4rows : f32, red.global.add.v4.f32, lane l -> row 4k + l / 8, 16 bytes at column 4 (l % 8): 4 rows x 128
//               contiguous bytes per instruction (the default kernels' pattern)
//   s64_4rows : int64 fixed point, the same lane -> value map, four scalar red.global.add.u64 per lane and pass
//               (each instruction: 4 rows x 8 lanes x 8 bytes at a 32-byte stride)
//   s64_row   : int64 fixed point, lane l -> column l of one row: 256 contiguous bytes per instruction
//   s32_row   : int32 fixed point, lane l -> column l: 128 contiguous bytes per instruction (for scale only: 32
//               bits cannot hold the range)
//   s64_bulk  : int64 fixed point through shared memory, cp.reduce.async.bulk .add.u64 of 256-byte row segments
// Rows are random in [0, s_kv); s_q * topk = 4096 * 2048 contributions of 576 values (the V3.2 32K standard
// shape after the pair's on-chip sum). Prints ms and values/ns.
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o reduce_det_bw reduce_det_bw.cu
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "micro.cuh"

constexpr int kD = 576;
constexpr int kChunkRows = 16;
constexpr int kChunkCols = 32;

__device__ __forceinline__ const int* chunk_rows(const int* idx, long c) { return idx + c * kChunkRows; }

template <int kMode>
__global__ void red_kernel(void* acc, const int* idx, long chunks) {
    const int lane = threadIdx.x % 32;
    const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) / 32;
    const long nwarps = (gridDim.x * (long)blockDim.x) / 32;
    __shared__ __align__(128) long long stage[16][kChunkRows * kChunkCols];
    const int wib = threadIdx.x / 32;
    if (kMode == 4) {
        for (int i = lane; i < kChunkRows * kChunkCols; i += 32) stage[wib][i] = 1;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
    }
    for (long c = warp; c < chunks; c += nwarps) {
        const int* rows = chunk_rows(idx, c / (kD / kChunkCols));
        const int col = (c % (kD / kChunkCols)) * kChunkCols;
        if (kMode == 0) {
            float* a = static_cast<float*>(acc);
            for (int k = 0; k < 4; ++k) {
                const long r = __ldg(rows + 4 * k + lane / 8);
                float* d = a + r * kD + col + 4 * (lane % 8);
                asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(d), "f"(1.0f / 1024) : "memory");
            }
        } else if (kMode == 1) {
            long long* a = static_cast<long long*>(acc);
            for (int k = 0; k < 4; ++k) {
                const long r = __ldg(rows + 4 * k + lane / 8);
                long long* d = a + r * kD + col + 4 * (lane % 8);
                for (int j = 0; j < 4; ++j)
                    asm volatile("red.global.add.u64 [%0], %1;" ::"l"(d + j), "l"(1LL << 22) : "memory");
            }
        } else if (kMode == 2) {
            long long* a = static_cast<long long*>(acc);
            for (int k = 0; k < kChunkRows; ++k) {
                const long r = __ldg(rows + k);
                asm volatile("red.global.add.u64 [%0], %1;" ::"l"(a + r * kD + col + lane), "l"(1LL << 22) : "memory");
            }
        } else if (kMode == 3) {
            int* a = static_cast<int*>(acc);
            for (int k = 0; k < kChunkRows; ++k) {
                const long r = __ldg(rows + k);
                asm volatile("red.global.add.u32 [%0], %1;" ::"l"(a + r * kD + col + lane), "r"(1) : "memory");
            }
        } else {
            long long* a = static_cast<long long*>(acc);
            if (lane < kChunkRows) {
                const long r = __ldg(rows + lane);
                const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(&stage[wib][lane * kChunkCols]));
                asm volatile(
                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], 256;" ::"l"(
                        a + r * kD + col),
                    "r"(s)
                    : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory");
            }
        }
    }
    if (kMode == 4) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    const long rows = 4096L * 2048;
    const long chunks = rows / kChunkRows * (kD / kChunkCols);
    int* idx;
    CK(cudaMalloc(&idx, rows * 4));
    std::vector<int> h(rows);
    const char* names[] = {"f32_4rows", "s64_4rows", "s64_row", "s32_row", "s64_bulk"};
    const int bytes_per[] = {4, 8, 8, 4, 8};
    for (long s_kv : {2048L, 8192L, 32768L, 131072L}) {
        fill_random_rows(h, s_kv);
        CK(cudaMemcpy(idx, h.data(), rows * 4, cudaMemcpyHostToDevice));
        void* acc;
        CK(cudaMalloc(&acc, s_kv * kD * 8));
        CK(cudaMemset(acc, 0, s_kv * kD * 8));
        const double values = (double)rows * kD;
        const int sms = prop.multiProcessorCount;
        for (int mode = 0; mode < 5; ++mode) {
            for (int wpb : {8, 16}) {
                auto launch = [&] {
                    switch (mode) {
                        case 0: red_kernel<0><<<sms * 2, wpb * 32>>>(acc, idx, chunks); break;
                        case 1: red_kernel<1><<<sms * 2, wpb * 32>>>(acc, idx, chunks); break;
                        case 2: red_kernel<2><<<sms * 2, wpb * 32>>>(acc, idx, chunks); break;
                        case 3: red_kernel<3><<<sms * 2, wpb * 32>>>(acc, idx, chunks); break;
                        default: red_kernel<4><<<sms * 2, wpb * 32>>>(acc, idx, chunks); break;
                    }
                };
                const float ms = time_ms(launch, 5);
                CK(cudaGetLastError());
                printf("s_kv %6ld acc %5.0f MB  %-9s %2d warps/CTA x2: %7.2f ms %6.2f values/ns %5.2f TB/s\n", s_kv,
                       s_kv * kD * bytes_per[mode] / 1e6, names[mode], wpb, ms, values / ms / 1e6,
                       values * bytes_per[mode] / ms / 1e9);
            }
        }
        CK(cudaFree(acc));
    }
    return 0;
}
