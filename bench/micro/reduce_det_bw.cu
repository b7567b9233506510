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
//   s32_carry : int64 fixed point as two int32 arrays, lane l -> column l: the low words by atom.global.add.u32,
//               whose returned old value gives the add's carry; the high word gets `high + carry` by
//               red.global.add.s32 only where that is not 0. For a value of magnitude below 2^31 units (below 0.5
//               at 2^32 units per 1.0) that is rare: a small positive value carries with probability ~value / 2^32,
//               a small negative one (high word -1) almost always does, cancelling its -1. The carries telescope
//               (their sum is (sum of low words + low_0 - low_final) / 2^32 whatever the order), so the pair is the
//               exact int64 sum, bitwise the same in any order, at about 4 bytes of adds per value instead of 8.
// Rows are random in [0, s_kv); s_q * topk = 4096 * 2048 contributions of 576 values (the V3.2 32K standard
// shape after the pair's on-chip sum). s64_row and s32_carry add pseudo-random values of up to +-2^23 units (the
// others constants); before timing, both run once on zeroed accumulators and every element of s32_carry's pair
// must equal s64_row's int64 sum. Prints ms and values/ns.
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

// A pseudo-random int64 fixed-point value in [-2^23, 2^23) for (chunk c, row k, lane).
__device__ __forceinline__ long long value_of(long c, int k, int lane) {
    uint32_t x = static_cast<uint32_t>(c) * 2654435761u ^ static_cast<uint32_t>(k * 32 + lane) * 2246822519u;
    x ^= x >> 15;
    x *= 2654435761u;
    x ^= x >> 13;
    return static_cast<long long>(x & 0xFFFFFFu) - (1LL << 23);
}

// `acc`: the accumulator; `hi`: s32_carry's high words (its low words are `acc`).
template <int kMode>
__global__ void red_kernel(void* acc, int* hi, const int* idx, long chunks) {
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
                asm volatile("red.global.add.u64 [%0], %1;" ::"l"(a + r * kD + col + lane), "l"(value_of(c, k, lane))
                             : "memory");
            }
        } else if (kMode == 5) {
            uint32_t* lo = static_cast<uint32_t*>(acc);
            uint32_t low[kChunkRows];
            uint32_t old[kChunkRows];
            long at[kChunkRows];
#pragma unroll
            for (int k = 0; k < kChunkRows; ++k) {
                at[k] = __ldg(rows + k) * kD + col + lane;
                low[k] = static_cast<uint32_t>(value_of(c, k, lane));
                old[k] = atomicAdd(lo + at[k], low[k]);
            }
#pragma unroll
            for (int k = 0; k < kChunkRows; ++k) {
                const int high = static_cast<int>(value_of(c, k, lane) >> 32);
                const int carry = old[k] + low[k] < low[k] ? 1 : 0;
                if (high + carry != 0) {
                    asm volatile("red.global.add.s32 [%0], %1;" ::"l"(hi + at[k]), "r"(high + carry) : "memory");
                }
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
    const char* names[] = {"f32_4rows", "s64_4rows", "s64_row", "s32_row", "s64_bulk", "s32_carry"};
    const int bytes_per[] = {4, 8, 8, 4, 8, 4};
    for (long s_kv : {2048L, 8192L, 32768L, 131072L}) {
        fill_random_rows(h, s_kv);
        CK(cudaMemcpy(idx, h.data(), rows * 4, cudaMemcpyHostToDevice));
        void* acc;
        int* hi;
        const long n = s_kv * kD;
        CK(cudaMalloc(&acc, n * 8));
        CK(cudaMalloc(&hi, n * 4));
        const double values = (double)rows * kD;
        const int sms = prop.multiProcessorCount;
        {
            // The carry scheme against the int64 sums of the same values, once, from zero.
            std::vector<long long> want(n);
            std::vector<uint32_t> lo(n);
            std::vector<int> high(n);
            CK(cudaMemset(acc, 0, n * 8));
            red_kernel<2><<<sms * 2, 256>>>(acc, hi, idx, chunks);
            CK(cudaMemcpy(want.data(), acc, n * 8, cudaMemcpyDeviceToHost));
            CK(cudaMemset(acc, 0, n * 8));
            CK(cudaMemset(hi, 0, n * 4));
            red_kernel<5><<<sms * 2, 256>>>(acc, hi, idx, chunks);
            CK(cudaMemcpy(lo.data(), acc, n * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(high.data(), hi, n * 4, cudaMemcpyDeviceToHost));
            long bad = 0;
            for (long i = 0; i < n; ++i) {
                const long long got = static_cast<long long>(static_cast<uint64_t>(static_cast<uint32_t>(high[i])) << 32 | lo[i]);
                bad += got != want[i];
            }
            printf("s_kv %6ld: s32_carry equals the int64 sums at %ld of %ld elements\n", s_kv, n - bad, n);
        }
        CK(cudaMemset(acc, 0, n * 8));
        CK(cudaMemset(hi, 0, n * 4));
        for (int mode = 0; mode < 6; ++mode) {
            for (int wpb : {8, 16}) {
                auto launch = [&] {
                    switch (mode) {
                        case 0: red_kernel<0><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
                        case 1: red_kernel<1><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
                        case 2: red_kernel<2><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
                        case 3: red_kernel<3><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
                        case 4: red_kernel<4><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
                        default: red_kernel<5><<<sms * 2, wpb * 32>>>(acc, hi, idx, chunks); break;
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
        CK(cudaFree(hi));
    }
    return 0;
}
