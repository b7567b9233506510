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

/// A struct of a family's `csrc/sm90/<family>/params.h` as the host compiler laid it out (CUDA lays out kernel
/// parameters the same way on host and device). Read by `build.rs` from the header itself, so the library's
/// `#[repr(C)]` mirrors are checked against the compiler's answer, not a hand-kept copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CxxStruct {
    /// Kernel family.
    pub family: &'static str,
    /// Struct name, without namespaces.
    pub name: &'static str,
    /// `sizeof`, bytes.
    pub size: usize,
    /// `alignof`, bytes.
    pub align: usize,
    /// Every data member, in declaration order.
    pub fields: &'static [CxxField],
}

/// One data member of a [`CxxStruct`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CxxField {
    /// Member name.
    pub name: &'static str,
    /// `offsetof`, bytes.
    pub offset: usize,
    /// `sizeof` of the member, bytes.
    pub size: usize,
}

/// Whether two strings are equal (usable in constant evaluation).
pub const fn const_str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The layout of struct `name` of `family`'s `params.h`, if the kernels were built (usable in constant
/// evaluation, so a mismatching mirror fails the build).
pub const fn params_layout(family: &str, name: &str) -> Option<&'static CxxStruct> {
    let mut i = 0;
    while i < PARAMS_LAYOUTS.len() {
        let s = &PARAMS_LAYOUTS[i];
        if const_str_eq(s.family, family) && const_str_eq(s.name, name) {
            return Some(s);
        }
        i += 1;
    }
    None
}

/// The parser `build.rs` reads `params.h` with, tested here.
#[cfg(test)]
#[path = "../build_layout.rs"]
mod build_layout;

#[cfg(test)]
mod tests;
