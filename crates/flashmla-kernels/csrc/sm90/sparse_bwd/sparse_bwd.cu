// Entry points of the sparse_bwd family (docs/spec.md section 2), launched in this order by ops/sparse_bwd/launch.rs:
//   sparse_bwd_zero_acc          grid-stride over s_kv * d_qk / 4 float4s, kSmallThreads   (skipped when accumulating)
//   sparse_bwd_main_d576         h_q <= 64 ("solo"): grid (s_q), block kThreads = 384, dynamic smem kSmemBytes<576>
//   sparse_bwd_main_pair_d576    64 < h_q <= 128 ("pair"): grid (2 s_q) in clusters of (2, 1, 1), same block and
//                                shared memory; the two head groups of a token reduce dKV together on chip
//   sparse_bwd_main[_pair]_d512  the same for d_qk 512 (kSmemBytes<512>)
//   sparse_bwd_main[_pair]_det_d* deterministic variants: d_kv reduced as int64 fixed point (kFlagFixedPoint)
//   sparse_bwd_main_pair_xb_d*   pair mode exchanging the peer's half as bf16 (bf16 d_kv, not deterministic, not
//                                accumulating: the d_kv rounding to bf16 dominates the extra rounding)
//   sparse_bwd_finalize          grid-stride over s_kv * d_qk / 8 chunks, kSmallThreads    (only with a workspace)
//   sparse_bwd_sink_grad         grid (h_q), kSmallThreads                                 (only with attn_sink)
#include "sm90/sparse_bwd/aux.cuh"
#include "sm90/sparse_bwd/kernel.cuh"

using flashmla::sparse_bwd::kSmallThreads;
using flashmla::sparse_bwd::kThreads;
using flashmla::sparse_bwd::SparseBwdParams;

#define FLASHMLA_SPARSE_BWD_MAIN(NAME, DQK, DET, PAIR, XBF16)                                                          \
    extern "C" __global__ void __launch_bounds__(kThreads, 1) NAME(const __grid_constant__ SparseBwdParams p) {        \
        extern __shared__ __align__(1024) uint8_t smem[];                                                              \
        flashmla::sparse_bwd::sparse_bwd_main<DQK, DET, PAIR, XBF16>(p, smem);                                         \
    }

FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_d576, 576, false, false, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_d512, 512, false, false, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_det_d576, 576, true, false, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_det_d512, 512, true, false, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_d576, 576, false, true, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_d512, 512, false, true, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_det_d576, 576, true, true, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_det_d512, 512, true, true, false)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_xb_d576, 576, false, true, true)
FLASHMLA_SPARSE_BWD_MAIN(sparse_bwd_main_pair_xb_d512, 512, false, true, true)

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
