// Microbenchmark: can TMA gather random 1152-byte KV rows (d_qk 576 bf16) into the forward's 128B-swizzled slab
// layout as fast as today's per-thread cp.async gather, and what does multicasting each row to both CTAs of a
// token's 2-CTA cluster give? This is the premise of sparse-fwd next step 7 (docs/sparse-fwd.md): one fetch of
// each row for both head groups.
//
// One CTA of 128 threads per SM (a producer warpgroup, no consumers), launched as 2-CTA clusters; both CTAs of a
// cluster walk the same index rows (a "token" of `topk` entries, 64-row tiles) into a 2-stage ring of 9 slabs x
// 64 rows x 128 B (73 728 B per stage; slab s, row r, 16-byte chunk c at s * 8192 + r * 128 + (c ^ (r % 8)) * 16,
// the layout the kernels' wgmma descriptors read). A stage is released once its tile has landed, so one tile is
// always in flight behind the one being issued. Modes:
//   cp.async       128 threads, 16 B each, 9 x 4 copies per thread per tile (today's producer)
//   cp.async-half  the same, but each CTA fetches only its half of the rows and zero-fills the rest (wrong data:
//                  what the forward's half-gather diagnostic measured)
//   tma            2-D tensor map over KV [s_kv, 576], box 64 columns x 1 row, 128B swizzle: 9 copies per row,
//                  issued by `lanes` lanes of warp 0, completing on the stage's full barrier by bytes
//   tma-mc         the same, each CTA issuing the rows of its half with .multicast::cluster to both CTAs; a stage
//                  is refilled only when both CTAs released it (remote arrival on the peer's empty barrier)
// Invalid indices (-1, s_kv) in the verified tile check that TMA zero-fills rows outside the tensor and still
// completes their bytes. Every wait is bounded (a hang traps instead).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I crates/flashmla-kernels/csrc \
//          -o tma_row_gather bench/micro/tma_row_gather.cu
#include <cstdint>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda.h>
#include <cudaTypedefs.h>

#include "micro.cuh"
#include "common/mbarrier.cuh"
#include "common/cluster.cuh"

using namespace flashmla;

constexpr int kD = 576;
constexpr int kRowBytes = kD * 2;
constexpr int kSlabs = 9;
constexpr int kRows = 64;
constexpr int kSlabBytes = kRows * 128;
constexpr int kStageBytes = kSlabs * kSlabBytes;
constexpr int kStages = 2;
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 64;

enum Mode : int { kCpAsync = 0, kCpAsyncHalf = 1, kTma = 2, kTmaMc = 3 };
static const char* kModeName[] = {"cp.async", "cp.async-half", "tma", "tma-mc"};

struct Params {
    const uint16_t* kv;
    const int* idx;    // [n_tok, topk]
    int topk;          // multiple of 64
    int n_tok;
    int s_kv;
    int mode;
    int lanes;         // TMA issuing lanes of warp 0
    uint16_t* dump;    // non-null: both CTAs of cluster 0 copy stage 0 after tile 0 here (2 x kStageBytes)
};

__device__ __forceinline__ void bounded_wait(uint64_t* bar, uint32_t parity) {
    for (uint32_t n = 0; !MBarrier::try_wait(bar, parity); ++n) {
        if (n > (1u << 26)) asm volatile("trap;");
    }
}

__device__ __forceinline__ void tma_row(const CUtensorMap* map, uint32_t dst, uint32_t bar, int col, int row,
                                        bool multicast) {
    if (multicast) {
        const uint16_t mask = 0x3;
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
            "l"(map), "r"(col), "r"(row), "r"(bar), "h"(mask)
            : "memory");
    } else {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
            "l"(map), "r"(col), "r"(row), "r"(bar)
            : "memory");
    }
}

__global__ void __launch_bounds__(128, 1) gather(const __grid_constant__ CUtensorMap map, Params p) {
    extern __shared__ uint8_t raw[];
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    uint64_t* full = reinterpret_cast<uint64_t*>(base + kStages * kStageBytes);
    uint64_t* empty = full + kStages;
    const int t = threadIdx.x;
    const uint32_t rank = cluster_ctarank();
    const bool tma = p.mode == kTma || p.mode == kTmaMc;
    const bool mc = p.mode == kTmaMc;
    if (t == 0) {
        for (int s = 0; s < kStages; ++s) {
            MBarrier::init(&full[s], tma ? 1 : 128);
            MBarrier::init(&empty[s], mc ? 2 : 1);
        }
        fence_mbarrier_init_cluster();
    }
    __syncthreads();
    cluster_sync();

    const int cluster = blockIdx.x / 2, n_clusters = gridDim.x / 2;
    const int tiles = p.topk / kRows;
    const bool active = !tma || t < 32;
    const int lane = t & 31;
    uint32_t g = 0;  // tiles issued by this CTA
    auto release = [&](uint32_t gi) {
        // The tile gi has landed here: give its stage back (to both producers in multicast mode).
        const int s = gi % kStages;
        bounded_wait(&full[s], (gi / kStages) & 1);
        if (p.dump != nullptr && gi == 0 && cluster == 0) {
            const uint4* src = reinterpret_cast<const uint4*>(base);
            uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(p.dump) + rank * kStageBytes);
            for (int i = (tma ? lane : t); i < kStageBytes / 16; i += (tma ? 32 : 128)) dst[i] = src[i];
            if (tma) __syncwarp(); else asm volatile("bar.sync 1, 128;");
        }
        if ((tma ? lane : t) == 0) {
            MBarrier::arrive(&empty[s]);
            if (mc) mbarrier_arrive_remote_relaxed(mapa_shared(smem_addr(&empty[s]), rank ^ 1));
        }
    };
    if (active) {
        for (int tok = cluster; tok < p.n_tok; tok += n_clusters) {
            const int* row_idx = p.idx + static_cast<int64_t>(tok) * p.topk;
            for (int ti = 0; ti < tiles; ++ti, ++g) {
                const int s = g % kStages;
                bounded_wait(&empty[s], ((g / kStages) & 1) ^ 1);
                const uint32_t stage = smem_addr(base) + s * kStageBytes;
                const int* ti_idx = row_idx + ti * kRows;
                if (!tma) {
                    const int row_in_pass = t / 8, chunk = t % 8;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int r = k * 16 + row_in_pass;
                        const int ix = ti_idx[r];
                        bool ok = ix >= 0 && ix < p.s_kv;
                        if (p.mode == kCpAsyncHalf && (r / 32) != static_cast<int>(rank)) ok = false;
                        const uint16_t* src = ok ? p.kv + static_cast<int64_t>(ix) * kD + chunk * 8 : p.kv;
                        const uint32_t dst = stage + r * 128 + ((chunk ^ (r % 8)) * 16);
#pragma unroll
                        for (int sl = 0; sl < kSlabs; ++sl) {
                            const uint32_t n = ok ? 16u : 0u;
                            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + sl * kSlabBytes),
                                         "l"(src + sl * 64), "r"(n)
                                         : "memory");
                        }
                    }
                    MBarrier::arrive_on_cp_async_noinc(&full[s]);
                } else {
                    const uint32_t bar = smem_addr(&full[s]);
                    if (lane == 0) mbarrier_arrive_expect_tx(bar, kStageBytes);
                    __syncwarp();
                    const int r0 = mc ? 32 * static_cast<int>(rank) : 0;
                    const int r1 = mc ? r0 + 32 : kRows;
                    if (lane < p.lanes) {
                        for (int r = r0 + lane; r < r1; r += p.lanes) {
                            const int ix = ti_idx[r];
                            // Invalid rows: a coordinate outside the tensor; TMA fills zeros and reads nothing.
                            const int row = (ix >= 0 && ix < p.s_kv) ? ix : p.s_kv;
#pragma unroll
                            for (int sl = 0; sl < kSlabs; ++sl) {
                                tma_row(&map, stage + sl * kSlabBytes + r * 128, bar, sl * 64, row, mc);
                            }
                        }
                    }
                }
                if (g >= 1) release(g - 1);
            }
        }
        if (g >= 1) release(g - 1);
    }
    __syncthreads();
    cluster_sync();
}

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s, %d SMs\n", prop.name, sms);
    const int n_tok = 4096, topk = 2048;

    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                        cudaEnableDefault, &q));
    if (encode == nullptr) {
        printf("cuTensorMapEncodeTiled not found\n");
        return 1;
    }
    CK(cudaFuncSetAttribute(gather, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));

    for (int s_kv : {32768, 131072}) {
        std::vector<uint16_t> h_kv(static_cast<size_t>(s_kv) * kD);
        for (size_t i = 0; i < h_kv.size(); ++i) h_kv[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
        std::vector<int> h_idx(static_cast<size_t>(n_tok) * topk);
        std::mt19937 rng(s_kv);
        std::vector<int> perm(s_kv);
        for (int i = 0; i < s_kv; ++i) perm[i] = i;
        for (int tk = 0; tk < n_tok; ++tk) {
            for (int j = 0; j < topk; ++j) std::swap(perm[j], perm[j + rng() % (s_kv - j)]);
            std::copy(perm.begin(), perm.begin() + topk, h_idx.begin() + static_cast<size_t>(tk) * topk);
        }
        h_idx[5] = -1;    // token 0, tile 0: two invalid rows (verified below)
        h_idx[40] = s_kv;
        uint16_t* kv;
        int* idx;
        uint16_t* dump;
        CK(cudaMalloc(&kv, h_kv.size() * 2));
        CK(cudaMalloc(&idx, h_idx.size() * 4));
        CK(cudaMalloc(&dump, 2 * kStageBytes));
        CK(cudaMemcpy(kv, h_kv.data(), h_kv.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(idx, h_idx.data(), h_idx.size() * 4, cudaMemcpyHostToDevice));

        CUtensorMap map;
        const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(s_kv)};
        const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kRowBytes)};
        const cuuint32_t box[2] = {64, 1};
        const cuuint32_t estr[2] = {1, 1};
        CUresult cr = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kv, dims, strides, box, estr,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (cr != CUDA_SUCCESS) {
            printf("cuTensorMapEncodeTiled: %d\n", static_cast<int>(cr));
            return 1;
        }

        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = 2;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.blockDim = dim3(128);
        cfg.dynamicSmemBytes = kSmemBytes;
        cfg.attrs = attr;
        cfg.numAttrs = 1;

        struct Variant {
            int mode, lanes;
        };
        const Variant variants[] = {{kCpAsync, 0}, {kCpAsyncHalf, 0}, {kTma, 1}, {kTma, 32}, {kTmaMc, 1}, {kTmaMc, 32}};
        for (const Variant& v : variants) {
            // Verify the layout of token 0's first tile in both CTAs of cluster 0.
            Params p{kv, idx, topk, 1, s_kv, v.mode, v.lanes, dump};
            cfg.gridDim = dim3(2);
            CK(cudaMemset(dump, 0xFF, 2 * kStageBytes));
            CK(cudaLaunchKernelEx(&cfg, gather, map, p));
            CK(cudaDeviceSynchronize());
            std::vector<uint8_t> h_dump(2 * kStageBytes);
            CK(cudaMemcpy(h_dump.data(), dump, h_dump.size(), cudaMemcpyDeviceToHost));
            int bad = 0;
            for (int cta = 0; cta < 2; ++cta) {
                for (int r = 0; r < kRows; ++r) {
                    if (v.mode == kCpAsyncHalf && r / 32 != cta) continue;
                    const int ix = h_idx[r];
                    for (int sl = 0; sl < kSlabs; ++sl) {
                        for (int c = 0; c < 8; ++c) {
                            const uint8_t* got =
                                h_dump.data() + cta * kStageBytes + sl * kSlabBytes + r * 128 + ((c ^ (r % 8)) * 16);
                            uint16_t want[8];
                            for (int e = 0; e < 8; ++e) {
                                want[e] = (ix >= 0 && ix < s_kv) ? h_kv[static_cast<size_t>(ix) * kD + sl * 64 + c * 8 + e]
                                                                 : 0;
                            }
                            if (memcmp(got, want, 16) != 0) ++bad;
                        }
                    }
                }
            }

            p = Params{kv, idx, topk, n_tok, s_kv, v.mode, v.lanes, nullptr};
            cfg.gridDim = dim3(sms / 2 * 2);
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            CK(cudaLaunchKernelEx(&cfg, gather, map, p));  // warm-up
            CK(cudaDeviceSynchronize());
            std::vector<float> ms(5);
            for (float& m : ms) {
                CK(cudaEventRecord(e0));
                CK(cudaLaunchKernelEx(&cfg, gather, map, p));
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&m, e0, e1));
            }
            std::sort(ms.begin(), ms.end());
            const double t = ms[2] * 1e-3;
            // Bytes landed in shared memory (both CTAs of each cluster get every row) and bytes fetched from L2.
            const double landed = 2.0 * n_tok * topk * kRowBytes;
            const double fetched = (v.mode == kCpAsyncHalf || v.mode == kTmaMc) ? landed / 2 : landed;
            printf("s_kv %6d  %-13s lanes %2d: %7.3f ms  into smem %5.2f TB/s (%5.1f KB/us/SM)  from L2 %5.2f TB/s"
                   "  layout %s (%d bad chunks)\n",
                   s_kv, kModeName[v.mode], v.lanes, ms[2], landed / t / 1e12, landed / t / 1e9 / sms,
                   fetched / t / 1e12, bad == 0 ? "ok" : "WRONG", bad);
            CK(cudaEventDestroy(e0));
            CK(cudaEventDestroy(e1));
        }
        CK(cudaFree(kv));
        CK(cudaFree(idx));
        CK(cudaFree(dump));
    }
    return 0;
}
