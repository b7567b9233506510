// The 128-byte-swizzled shared-memory tile layout that wgmma reads, and the register fragment layouts of wgmma
// (accumulator and register-A), written down once.
//
// ## SW128 tiles ("slabs")
// A tile of R rows x 64 bf16 (128 bytes per row) is stored row after row, R * 128 bytes, its base 1024-byte
// aligned. Within row r the eight 16-byte chunks are permuted: logical chunk c (bf16 columns 8c..8c+7) sits at
// physical chunk c ^ (r % 8). This is the hardware's 128B swizzle (address bits [4,7) ^= bits [7,10)), so the same
// bytes can be described to wgmma by a descriptor with swizzle mode 128B. Wider matrices are a sequence of such
// slabs (64 columns each).
//
// The same slab serves two operand roles (see wgmma.cuh for the descriptors):
// * K-major (rows = M or N, columns = K): Q [heads x d], K [kv rows x d], P [heads x kv rows].
//   Descriptor: start = slab base (+32 bytes per 16-column k-step inside the slab), SBO = 8 rows * 128 B = 1024.
// * MN-major (rows = K, columns = N): V [kv rows x d_v] for O += P V. Descriptor: start = slab of the first
//   N column, +16 rows * 128 B per 16-row k-step; LBO = bytes between N-adjacent slabs; SBO = 1024.
//
// ## Accumulator fragment (wgmma .m64nNk16, f32 D)
// Thread t of the warpgroup (warp w = t / 32, lane l = t % 32, g = l / 4, q = l % 4) holds N / 2 floats:
// for n8 block j in [0, N/8):
//   d[4j + 0] = (row 16w + g,     col 8j + 2q)      d[4j + 1] = (row 16w + g,     col 8j + 2q + 1)
//   d[4j + 2] = (row 16w + g + 8, col 8j + 2q)      d[4j + 3] = (row 16w + g + 8, col 8j + 2q + 1)
// So each thread owns two rows (g and g + 8 of its warp's 16) and, per 8-column block, two adjacent columns;
// the four threads of a quad (same g) together own whole rows: row reductions are two xor-shuffles (1, 2).
//
// ## Register A fragment (wgmma .m64nNk16 with A in registers, bf16)
// Four 32-bit registers, each two bf16 (lower column in the low half), for the 64 x 16 A block:
//   a[0] = (row 16w + g,     cols 2q, 2q+1)        a[1] = (row 16w + g + 8, cols 2q, 2q+1)
//   a[2] = (row 16w + g,     cols 8+2q, 8+2q+1)    a[3] = (row 16w + g + 8, cols 8+2q, 8+2q+1)
// Hence the accumulator of a 16-column block kb converts to an A fragment without any data movement:
//   a[0] = pack(d[8kb+0], d[8kb+1]), a[1] = pack(d[8kb+2], d[8kb+3]),
//   a[2] = pack(d[8kb+4], d[8kb+5]), a[3] = pack(d[8kb+6], d[8kb+7]).
#pragma once

#include <cstdint>

namespace flashmla {

// Geometry of one SW128 slab row.
inline constexpr int kSw128RowBytes = 128;
inline constexpr int kSw128ChunkBytes = 16;
inline constexpr int kSw128ChunksPerRow = kSw128RowBytes / kSw128ChunkBytes;  // 8
inline constexpr int kSw128ColsBf16 = kSw128RowBytes / 2;                     // 64 bf16 columns per slab
inline constexpr int kSw128AtomRows = 8;                                      // rows per swizzle period
inline constexpr int kSw128AtomBytes = kSw128AtomRows * kSw128RowBytes;       // 1024: required base alignment

// Byte offset, inside a slab, of logical 16-byte chunk `chunk` (0..7) of row `row`.
__host__ __device__ constexpr uint32_t sw128_chunk_offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kSw128RowBytes + ((chunk ^ (row % kSw128AtomRows)) * kSw128ChunkBytes));
}

// One thread's part in filling SW128 slabs with 16-byte copies, 8 threads per 128-byte row (the sparse kernels'
// producer warpgroups): thread t copies chunk t % 8 of row t / 8 of each pass of (threads / 8) rows.
struct Sw128CopyThread {
    int row_in_pass;      // t / 8
    int chunk;            // t % 8
    uint32_t smem_off;    // sw128_chunk_offset(row_in_pass, chunk); a pass of R rows adds R * 128 bytes
    int chunk_elems;      // bf16 column of the chunk's first element in a row: 8 * chunk

    __host__ __device__ static constexpr Sw128CopyThread of(int t) {
        const int row = t / kSw128ChunksPerRow;
        const int c = t % kSw128ChunksPerRow;
        return {row, c, sw128_chunk_offset(row, c), c * (kSw128ChunkBytes / 2)};
    }
};

// Accumulator fragment coordinates (see the header comment): the two rows a thread owns, and the first of the
// two adjacent columns it owns in n8 block j.
struct AccFrag {
    int row0;  // 16 * warp + lane / 4; the second row is row0 + 8
    int quad;  // lane % 4
    static __device__ __forceinline__ AccFrag of_thread(int thread_in_warpgroup) {
        AccFrag f;
        f.row0 = 16 * (thread_in_warpgroup / 32) + (thread_in_warpgroup % 32) / 4;
        f.quad = thread_in_warpgroup % 4;
        return f;
    }
    __device__ __forceinline__ int row1() const { return row0 + 8; }
    __device__ __forceinline__ int col(int j) const { return 8 * j + 2 * quad; }
};

// Two floats to a bf16x2 word, `lo` in the low half (the lower column), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

}  // namespace flashmla
