// Entry points of the dense_prefill family (docs/spec.md section 5), one per (d, element type):
//   dense_prefill_fwd_d192_bf16, dense_prefill_fwd_d192_f16, dense_prefill_fwd_d128_bf16, dense_prefill_fwd_d128_f16
// Launch: grid (min(h_q * m_tiles, SMs), 1, 1) persistent CTAs that take the h_q * m_tiles work items from
// p.tile_counter (zeroed before the launch), block (kThreads = 384, 1, 1), dynamic shared memory kSmemBytes<d>
// (config.cuh; mirrored in ops/dense_prefill/launch.rs).
#include "sm90/dense_prefill/bwd.cuh"
#include "sm90/dense_prefill/kernel.cuh"

using flashmla::Bf16;
using flashmla::F16;
using flashmla::dense_prefill::DensePrefillBwdParams;
using flashmla::dense_prefill::DensePrefillFwdParams;
using flashmla::dense_prefill::kThreads;

#define FLASHMLA_DENSE_PREFILL_FWD(NAME, D, E)                                                      \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) NAME(const __grid_constant__ DensePrefillFwdParams p) { \
        extern __shared__ __align__(1024) uint8_t smem[];                                           \
        flashmla::dense_prefill::dense_prefill_fwd<D, E>(p, smem);                                  \
    }

FLASHMLA_DENSE_PREFILL_FWD(dense_prefill_fwd_d192_bf16, 192, Bf16)
FLASHMLA_DENSE_PREFILL_FWD(dense_prefill_fwd_d192_f16, 192, F16)
FLASHMLA_DENSE_PREFILL_FWD(dense_prefill_fwd_d128_bf16, 128, Bf16)
FLASHMLA_DENSE_PREFILL_FWD(dense_prefill_fwd_d128_f16, 128, F16)

// Backward (bwd.cuh): delta (block 256 threads, one warp per (row, head); also zeroes dq_accum when set), then
// either the fused pass (block bwd::kFusedThreads = 384, 128-key tiles, dynamic shared memory bwd::kFusedSmemBytes<d>)
// followed by dq_convert (block 256, one thread per 8 columns of a (row, head)); or, the separate schedule, no delta
// launch: dQ (block bwd::kDqThreads = 384, grid of 128-row tiles; it writes delta), then dK / dV (block
// bwd::kThreads = 384, 128-key tiles), dynamic shared memory bwd::kDqSmemBytes<d> / kDkvSmemBytes<d>.
#define FLASHMLA_DENSE_PREFILL_BWD(SUFFIX, D, E)                                                                  \
    extern "C" __global__ void __launch_bounds__(flashmla::dense_prefill::bwd::kDqThreads, 1)                     \
        dense_prefill_bwd_dq_##SUFFIX(const __grid_constant__ DensePrefillBwdParams p) {                         \
        extern __shared__ __align__(1024) uint8_t smem[];                                                         \
        flashmla::dense_prefill::bwd::dq_kernel<D, E>(p, smem);                                                   \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(flashmla::dense_prefill::bwd::kThreads, 1)                       \
        dense_prefill_bwd_dkv_##SUFFIX(const __grid_constant__ DensePrefillBwdParams p) {                        \
        extern __shared__ __align__(1024) uint8_t smem[];                                                         \
        flashmla::dense_prefill::bwd::dkv_kernel<D, E>(p, smem);                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(flashmla::dense_prefill::bwd::kFusedThreads, 1)                  \
        dense_prefill_bwd_fused_##SUFFIX(const __grid_constant__ DensePrefillBwdParams p) {                      \
        extern __shared__ __align__(1024) uint8_t smem[];                                                         \
        flashmla::dense_prefill::bwd::fused_kernel<D, E>(p, smem);                                                \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        dense_prefill_bwd_dq_convert_##SUFFIX(const __grid_constant__ DensePrefillBwdParams p) {                 \
        flashmla::dense_prefill::bwd::dq_convert_kernel<D, E>(p);                                                 \
    }

FLASHMLA_DENSE_PREFILL_BWD(d192_bf16, 192, Bf16)
FLASHMLA_DENSE_PREFILL_BWD(d192_f16, 192, F16)
FLASHMLA_DENSE_PREFILL_BWD(d128_bf16, 128, Bf16)
FLASHMLA_DENSE_PREFILL_BWD(d128_f16, 128, F16)

extern "C" __global__ void __launch_bounds__(256) dense_prefill_bwd_delta_bf16(const __grid_constant__ DensePrefillBwdParams p) {
    flashmla::dense_prefill::bwd::delta_kernel<Bf16>(p);
}
extern "C" __global__ void __launch_bounds__(256) dense_prefill_bwd_delta_f16(const __grid_constant__ DensePrefillBwdParams p) {
    flashmla::dense_prefill::bwd::delta_kernel<F16>(p);
}
