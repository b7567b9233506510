// The bytes of a CUtensorMap, as kernel parameter structs carry it (host- and device-side; no device code here so
// that parameter headers stay plain C++). The host encodes it with cuTensorMapEncodeTiled; common/tma.cuh loads
// boxes with it.
#pragma once

#include <cstdint>

namespace flashmla {

// 128 bytes, 64-byte aligned (the driver's requirement). Inside a `__grid_constant__` parameter struct its address
// is what the TMA unit reads.
struct alignas(64) TensorMapBytes {
    uint64_t opaque[16];
};

}  // namespace flashmla
