// Entry points of the sparse_fwd family (docs/spec.md section 1), one per (pipeline, d_qk):
//   sparse_fwd_d576, sparse_fwd_d512            split pipeline (score + value warpgroups; long contexts)
//   sparse_fwd_alt_d576, sparse_fwd_alt_d512    alternating pipeline (consumers alternate tiles; short contexts)
// Launch: grid (s_q * ceil(h_q / 64), 1, 1), block (kThreads = 384, 1, 1), dynamic shared memory
// kSmemBytes<d_qk> (config.cuh; mirrored in ops/sparse_fwd/launch.rs). With two head groups the host launches
// each token's pair of CTAs as a 2-CTA cluster (co-scheduling only: the kernel uses no cluster feature).
#include "sm90/sparse_fwd/kernel.cuh"

using flashmla::sparse_fwd::kThreads;
using flashmla::sparse_fwd::SparseFwdParams;

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_fwd_d576(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<576, false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) sparse_fwd_d512(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<512, false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    sparse_fwd_alt_d576(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<576, true>(p, smem);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    sparse_fwd_alt_d512(const __grid_constant__ SparseFwdParams p) {
    extern __shared__ __align__(1024) uint8_t smem[];
    flashmla::sparse_fwd::sparse_fwd<512, true>(p, smem);
}
