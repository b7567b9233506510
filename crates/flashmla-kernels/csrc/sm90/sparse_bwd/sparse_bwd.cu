// Entry points of the sparse_bwd family (SPEC section 2), launched in this order by ops/sparse_bwd/launch.rs:
//   sparse_bwd_zero_acc      grid-stride over s_kv * d_qk / 4 float4s, kSmallThreads       (skipped when accumulating)
//   sparse_bwd_delta         grid (ceil(s_q * h_q / kDeltaRowsPerCta)), kSmallThreads
//   sparse_bwd_main_d576     grid (s_q * ceil(h_q / 64)), block kThreads = 384, dynamic smem kSmemBytes<576>
//   sparse_bwd_main_d512     same with kSmemBytes<512>; optional cluster (2, 1, 1) when h_q > 64 (co-scheduling
//                            of a token's two head groups; the kernel has no cluster-specific code)
//   sparse_bwd_main_det_d*   deterministic variants: d_kv reduced as int64 fixed point (kFlagFixedPoint)
//   sparse_bwd_finalize      grid-stride over s_kv * d_qk / 8 chunks, kSmallThreads        (only with a workspace)
//   sparse_bwd_sink_grad     grid (h_q), kSmallThreads                                     (only with attn_sink)
#include "sm90/sparse_bwd/aux.cuh"
#include "sm90/sparse_bwd/kernel.cuh"

using flashmla::sparse_bwd::kSmallThreads;
using flashmla::sparse_bwd::kThreads;
using flashmla::sparse_bwd::SparseBwdParams;

#define FLASHMLA_SPARSE_BWD_MAIN(NAME, DQK, DET)                                        \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) NAME(const __grid_constant__ SparseBwdParams p) { \
        extern __shared__ __align__(1024) uint8_t smem[];                                     \
        flashmla::sparse_bwd::sparse_bwd_main<DQK, DET>(p, smem);                             \
    }

FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_d576, 576, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_d512, 512, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_det_d576, 576, true)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_det_d512, 512, true)

extern "C" __global__ void __launch_bounds__(kSmallThreads) sparse_bwd_delta(const __grid_constant__ SparseBwdParams p) {
    flashmla::sparse_bwd::delta_prepass(p);
}

extern "C" __global__ void __launch_bounds__(kSmallThreads)
    sparse_bwd_zero_acc(const __grid_constant__ SparseBwdParams p) {
    flashmla::sparse_bwd::zero_acc(p);
}

extern "C" __global__ void __launch_bounds__(kSmallThreads)
    sparse_bwd_finalize(const __grid_constant__ SparseBwdParams p) {
    flashmla::sparse_bwd::finalize_dkv(p);
}

extern "C" __global__ void __launch_bounds__(kSmallThreads)
    sparse_bwd_sink_grad(const __grid_constant__ SparseBwdParams p) {
    flashmla::sparse_bwd::sink_grad(p);
}
