//! The CUDA kernels of flashmla, compiled by `build.rs` to sm_90a cubins and embedded in the binary.
//!
//! Each kernel family lives in `csrc/sm90/<family>/` with `<family>.cu` as its entry translation unit.
#![warn(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The GPU architecture the cubins target.
pub const ARCH: &str = "sm_90a";

/// The cubin of one kernel family, if it was built.
pub fn cubin(family: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(n, _)| *n == family).map(|(_, b)| *b)
}

// The build script's reader of ptxas reports, compiled here too so that its rules are unit-tested.
#[cfg(test)]
#[path = "../build_support/ptxas.rs"]
mod ptxas;

#[cfg(test)]
mod ptxas_tests;
