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
    let key = MapKey {
        base,
        dims,
        strides_bytes,
        box_dims,
    };
    if let Some(map) = RECENT.with(|r| r.borrow().get(&key)) {
        return Ok(map);
    }
    let map = encode_uncached(base, dims, strides_bytes, box_dims)?;
    RECENT.with(|r| r.borrow_mut().put(key, map));
    Ok(map)
}

/// [`encode_tiled_u16_sw128`] without the thread's cache of recent maps, for tensors a call is unlikely to see again
/// (a prefill's activations): their maps would push out the ones that repeat every step (a decode cache per layer).
pub(crate) fn encode_tiled_u16_sw128_uncached(
    base: u64,
    dims: [u64; 4],
    strides_bytes: [u64; 3],
    box_dims: [u32; 4],
) -> Result<TensorMapBytes> {
    encode_uncached(base, dims, strides_bytes, box_dims)
}

/// What a map is a function of: encoding the same arguments again gives the same bytes (the map holds the address,
/// not the memory), so a reused entry is exact even if the memory behind it was freed and allocated again.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MapKey {
    base: u64,
    dims: [u64; 4],
    strides_bytes: [u64; 3],
    box_dims: [u32; 4],
}

/// The last maps this thread encoded (a model's layers each keep their own cache: a few dozen distinct maps per
/// decode step). Looking one up costs a short scan; encoding costs a driver call.
struct RecentMaps {
    entries: Vec<(MapKey, TensorMapBytes)>,
    next: usize,
}

impl RecentMaps {
    const CAPACITY: usize = 128;

    fn get(&self, key: &MapKey) -> Option<TensorMapBytes> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, m)| *m)
    }

    /// Inserts, replacing the oldest entry once full.
    fn put(&mut self, key: MapKey, map: TensorMapBytes) {
        if self.entries.len() < Self::CAPACITY {
            self.entries.push((key, map));
        } else {
            self.entries[self.next] = (key, map);
            self.next = (self.next + 1) % Self::CAPACITY;
        }
    }
}

thread_local! {
    static RECENT: std::cell::RefCell<RecentMaps> = const {
        std::cell::RefCell::new(RecentMaps { entries: Vec::new(), next: 0 })
    };
}

fn encode_uncached(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key(base: u64) -> MapKey {
        MapKey {
            base,
            dims: [576, 1, 64, 10],
            strides_bytes: [1152, 1152, 73728],
            box_dims: [64, 1, 64, 1],
        }
    }

    #[test]
    fn recent_maps_find_what_was_put_and_replace_the_oldest_once_full() {
        let mut r = RecentMaps {
            entries: Vec::new(),
            next: 0,
        };
        for i in 0..RecentMaps::CAPACITY as u64 {
            r.put(key(i), TensorMapBytes([i; 16]));
        }
        assert_eq!(r.get(&key(5)), Some(TensorMapBytes([5; 16])));
        assert_eq!(r.get(&key(1000)), None);
        r.put(key(1000), TensorMapBytes([7; 16]));
        assert_eq!(r.get(&key(0)), None, "the oldest entry gave way");
        assert_eq!(r.get(&key(1000)), Some(TensorMapBytes([7; 16])));
        assert_eq!(r.entries.len(), RecentMaps::CAPACITY);
    }
}
