// Entry points of the sparse_fwd family (SPEC section 1), one per d_qk:
//   sparse_fwd_d576, sparse_fwd_d512
// Launch: grid (s_q * ceil(h_q / 64), 1, 1), block (kThreads = 384, 1, 1), dynamic shared memory
// kSmemBytes<d_qk> (config.cuh; mirrored in ops/sparse_fwd/launch.rs), no cluster.
#include "sm90/sparse_fwd/kernel.cuh"

using flashmla::sparse_fwd::kThreads;
using flashmla::sparse_fwd::SparseFwdParams;

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_fwd_d576(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<576>(p, smem);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_fwd_d512(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<512>(p, smem);
}
