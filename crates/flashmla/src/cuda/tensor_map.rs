//! Tensor maps (the driver's `CUtensorMap`) for kernels that load tiles with the TMA unit
//! (`csrc/common/tma.cuh`). A map describes a strided global tensor and the box one copy moves; kernels carry it
//! inside their `__grid_constant__` parameter struct as [`TensorMapBytes`].

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;

/// The 128 bytes of an encoded `CUtensorMap` (64-byte aligned, as the driver and the TMA unit require); all zeros
/// where a kernel does not use one. Mirrors `flashmla::TensorMapBytes` (csrc/common/tensor_map.h).
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TensorMapBytes(pub [u64; 16]);

/// Encodes a tiled map of a rank-4 tensor of 16-bit elements at device address `base`: `dims` innermost first
/// (the innermost contiguous), `strides_bytes` of dimensions 1..4, boxes of `box_dims` elements, 128-byte swizzle
/// (the box's innermost extent must then be 128 bytes), L2 promotion of 256 bytes, zeros for coordinates outside
/// the tensor. The driver checks alignment (base and strides multiples of 16 bytes) and bounds; a refusal is
/// [`crate::Error::Cuda`]. Needs a loaded driver (a live [`super::Gpu`]); it touches no device state.
pub(crate) fn encode_tiled_u16_sw128(
    base: u64,
    dims: [u64; 4],
    strides_bytes: [u64; 3],
    box_dims: [u32; 4],
) -> Result<TensorMapBytes> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let element_strides = [1u32; 4];
    // SAFETY: every pointer is to a live local array of the rank's length (4 dims and boxes, 3 strides) or the
    // output map; the driver reads them and writes the 128-byte map, nothing else.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            4,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides_bytes.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    check("cuTensorMapEncodeTiled", r)?;
    Ok(TensorMapBytes(map.opaque))
}
