// Shared by the standalone microbenchmarks in this folder (each builds alone with nvcc + cudart and prints its
// table): CK(call) exits with the failing CUDA runtime call and its message.
#pragma once

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
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

// Median time in ms of `reps` runs of f() (after one untimed run), each between two events on the default stream.
template <class F>
float time_ms(F f, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    f();
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}
