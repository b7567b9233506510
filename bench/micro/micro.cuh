// Shared by the standalone microbenchmarks in this folder (each builds alone with nvcc + cudart and prints its
// table): CK(call) exits with the failing CUDA runtime call and its message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                                  \
    do {                                                                       \
        cudaError_t e = (x);                                                   \
        if (e != cudaSuccess) {                                                \
            printf("%s: %s\n", #x, cudaGetErrorString(e));                     \
            exit(1);                                                           \
        }                                                                      \
    } while (0)
