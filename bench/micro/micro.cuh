// Shared by the standalone microbenchmarks in this folder (each builds alone with nvcc + cudart and prints its
// table): CK(call) exits with the failing CUDA runtime call and its message.
#pragma once

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x)                                                                  \
    do {                                                                       \
        cudaError_t e = (x);                                                   \
        if (e != cudaSuccess) {                                                \
            printf("%s: %s\n", #x, cudaGetErrorString(e));                     \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

// Fills `rows` with pseudo-random row indices in [0, s_kv), the same sequence for every call with the same s_kv
// (srand(1) first), so that the benchmarks' variants reduce into the same rows.
inline void fill_random_rows(std::vector<int>& rows, long s_kv) {
    srand(1);
    for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = static_cast<int>((static_cast<uint64_t>(rand()) * 2654435761u + rand()) % s_kv);
    }
}
