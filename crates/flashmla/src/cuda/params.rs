//! The host/device contract of kernel parameters, checked by the compiler.
//!
//! Every kernel takes one struct by value, defined in `csrc/sm90/<family>/params.h` and mirrored here by a
//! `#[repr(C)]` struct declared through `device_params!`. `build.rs` of
//! `flashmla-kernels` lays out every struct of every `params.h` with the host compiler
//! ([`flashmla_kernels::PARAMS_LAYOUTS`]); the macro lists the mirror's fields ([`DeviceParams::FIELDS`]) and
//! adds a constant check that fails the build unless
//! * the mirror's fields tile it (no implicit padding: a C++ field can then hide nowhere),
//! * the C++ struct has the same size, alignment and number of fields, and
//! * every field exists there under the same name at the same offset with the same size.
//!
//! Without nvcc there are no layouts and no cubins: nothing is checked and nothing can be launched. The test
//! `ops::contract` also checks that every struct of a `params.h` has a mirror and that every kernel symbol the
//! planners can name is in the cubins. [`crate::cuda::Gpu::launch`] takes only [`DeviceParams`].

pub use flashmla_kernels::{CxxField, CxxStruct};

/// One field of a Rust mirror: name, byte offset and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldLayout {
    /// Field name (the C++ member's).
    pub name: &'static str,
    /// `offset_of!`, bytes.
    pub offset: usize,
    /// `size_of` of the field's type, bytes.
    pub size: usize,
}

/// A `#[repr(C)]` struct that the kernels of [`Self::FAMILY`] receive by value, mirroring struct
/// [`Self::CXX_NAME`] of `csrc/sm90/<FAMILY>/params.h`. Implemented by
/// `device_params!`, which checks the mirror at compile time.
pub trait DeviceParams: Copy {
    /// Kernel family (the directory under `csrc/sm90/`).
    const FAMILY: &'static str;
    /// Name of the C++ struct, without namespaces.
    const CXX_NAME: &'static str;
    /// Name of the Rust struct.
    const RUST_NAME: &'static str;
    /// Every field, in declaration order.
    const FIELDS: &'static [FieldLayout];
}

/// The layout of `family`'s C++ struct `name`, when the kernels were built.
pub const fn cxx_layout(family: &str, name: &str) -> Option<&'static CxxStruct> {
    flashmla_kernels::params_layout(family, name)
}

/// Whether `fields` (in declaration order) cover `0..size` without gaps or overlaps.
pub const fn fields_tile(fields: &[FieldLayout], size: usize) -> bool {
    let mut end = 0;
    let mut i = 0;
    while i < fields.len() {
        if fields[i].offset != end {
            return false;
        }
        end += fields[i].size;
        i += 1;
    }
    end == size
}

/// Whether `cxx` has a field `name` at `offset` of `size` bytes.
pub const fn cxx_has_field(cxx: &CxxStruct, name: &str, offset: usize, size: usize) -> bool {
    let mut i = 0;
    while i < cxx.fields.len() {
        let f = &cxx.fields[i];
        if flashmla_kernels::const_str_eq(f.name, name) {
            return f.offset == offset && f.size == size;
        }
        i += 1;
    }
    false
}

/// The differences between a mirror and its C++ struct, one line each (empty when they agree): what the
/// compile-time check reports in one sentence, spelled out for tests and messages.
pub fn mirror_differences(fields: &[FieldLayout], size: usize, cxx: &CxxStruct) -> Vec<String> {
    let mut d = Vec::new();
    if size != cxx.size {
        d.push(format!("size: Rust {size}, C++ {}", cxx.size));
    }
    for f in fields {
        match cxx.fields.iter().find(|c| c.name == f.name) {
            None => d.push(format!("`{}`: not in the C++ struct", f.name)),
            Some(c) if (c.offset, c.size) != (f.offset, f.size) => d.push(format!(
                "`{}`: Rust offset {} size {}, C++ offset {} size {}",
                f.name, f.offset, f.size, c.offset, c.size
            )),
            Some(_) => {}
        }
    }
    for c in cxx.fields {
        if !fields.iter().any(|f| f.name == c.name) {
            d.push(format!(
                "`{}`: C++ field (offset {}, size {}) not in the Rust struct",
                c.name, c.offset, c.size
            ));
        }
    }
    d
}

/// Declares a `#[repr(C)]` mirror of a kernel family's C++ parameter struct and checks it against the
/// layout `build.rs` read from `csrc/sm90/<family>/params.h` (module docs): a mismatch is a compile error
/// naming the field.
///
/// ```ignore
/// device_params! {
///     family = "sparse_fwd", cxx = "SparseFwdParams";
///     /// Docs.
///     #[derive(Debug, Clone, Copy, PartialEq)]
///     pub struct SparseFwdParams {
///         /// `[s_q, h_q, d_qk]` bf16.
///         pub q: u64,
///         // ...
///     }
/// }
/// ```
macro_rules! device_params {
    (
        family = $family:literal, cxx = $cxx:literal;
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty ),+
        }

        impl $crate::cuda::DeviceParams for $name {
            const FAMILY: &'static str = $family;
            const CXX_NAME: &'static str = $cxx;
            const RUST_NAME: &'static str = stringify!($name);
            const FIELDS: &'static [$crate::cuda::FieldLayout] = &[
                $( $crate::cuda::FieldLayout {
                    name: stringify!($field),
                    offset: ::std::mem::offset_of!($name, $field),
                    size: ::std::mem::size_of::<$ty>(),
                } ),+
            ];
        }

        const _: () = {
            let fields = <$name as $crate::cuda::DeviceParams>::FIELDS;
            let size = ::std::mem::size_of::<$name>();
            if !$crate::cuda::params::fields_tile(fields, size) {
                panic!(concat!(
                    stringify!($name),
                    ": the fields leave padding; add explicit fields (e.g. `reserved`) to both sides"
                ));
            }
            if let Some(cxx) = $crate::cuda::params::cxx_layout($family, $cxx) {
                if cxx.size != size || cxx.align != ::std::mem::align_of::<$name>() {
                    panic!(concat!(
                        stringify!($name), ": its size or alignment differs from `", $cxx,
                        "` in csrc/sm90/", $family, "/params.h"
                    ));
                }
                if cxx.fields.len() != fields.len() {
                    panic!(concat!(
                        stringify!($name), ": its field count differs from `", $cxx,
                        "` in csrc/sm90/", $family, "/params.h"
                    ));
                }
                $(
                    if !$crate::cuda::params::cxx_has_field(
                        cxx,
                        stringify!($field),
                        ::std::mem::offset_of!($name, $field),
                        ::std::mem::size_of::<$ty>(),
                    ) {
                        panic!(concat!(
                            stringify!($name), "::", stringify!($field), ": not in `", $cxx,
                            "` of csrc/sm90/", $family, "/params.h at the same offset with the same size"
                        ));
                    }
                )+
            }
        };
    };
}
pub(crate) use device_params;

#[cfg(test)]
mod tests {
    use super::*;

    device_params! {
        family = "no_such_family", cxx = "Demo";
        /// A mirror with no C++ side (no layout: only the padding rule applies).
        #[derive(Debug, Clone, Copy)]
        pub struct Demo {
            /// A pointer.
            pub p: u64,
            /// A count.
            pub n: i32,
            /// Padding made explicit.
            pub reserved: i32,
        }
    }

    #[test]
    fn the_macro_lists_every_field_in_order() {
        assert_eq!(
            Demo::FIELDS,
            [
                FieldLayout {
                    name: "p",
                    offset: 0,
                    size: 8
                },
                FieldLayout {
                    name: "n",
                    offset: 8,
                    size: 4
                },
                FieldLayout {
                    name: "reserved",
                    offset: 12,
                    size: 4
                },
            ]
        );
        assert_eq!(
            (Demo::FAMILY, Demo::CXX_NAME, Demo::RUST_NAME),
            ("no_such_family", "Demo", "Demo")
        );
        assert!(cxx_layout("no_such_family", "Demo").is_none());
        let d = Demo {
            p: 1,
            n: 2,
            reserved: 0,
        };
        assert_eq!((d.p, d.n, d.reserved), (1, 2, 0));
    }

    #[test]
    fn padding_gaps_and_tails_are_found() {
        let f = |name, offset, size| FieldLayout { name, offset, size };
        assert!(fields_tile(
            &[f("a", 0, 8), f("b", 8, 4), f("c", 12, 4)],
            16
        ));
        // A gap after `b` (an i32 before a u64), a tail (the size rounded up to the alignment).
        assert!(!fields_tile(
            &[f("a", 0, 8), f("b", 8, 4), f("c", 16, 8)],
            24
        ));
        assert!(!fields_tile(&[f("a", 0, 8), f("b", 8, 4)], 16));
    }

    #[test]
    fn differences_name_every_field_that_disagrees() {
        const CXX: CxxStruct = CxxStruct {
            family: "f",
            name: "P",
            size: 16,
            align: 8,
            fields: &[
                CxxField {
                    name: "a",
                    offset: 0,
                    size: 8,
                },
                CxxField {
                    name: "b",
                    offset: 8,
                    size: 4,
                },
                CxxField {
                    name: "c",
                    offset: 12,
                    size: 4,
                },
            ],
        };
        let f = |name, offset, size| FieldLayout { name, offset, size };
        let same = [f("a", 0, 8), f("b", 8, 4), f("c", 12, 4)];
        assert!(mirror_differences(&same, 16, &CXX).is_empty());
        assert!(cxx_has_field(&CXX, "b", 8, 4));
        assert!(!cxx_has_field(&CXX, "b", 12, 4));
        assert!(!cxx_has_field(&CXX, "d", 8, 4));
        // `b` and `c` swapped, and a field renamed.
        let swapped = [f("a", 0, 8), f("c", 8, 4), f("b", 12, 4)];
        assert_eq!(mirror_differences(&swapped, 16, &CXX).len(), 2);
        let renamed = [f("a", 0, 8), f("b", 8, 4), f("d", 12, 4)];
        let d = mirror_differences(&renamed, 16, &CXX);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].contains("`d`: not in the C++") && d[1].contains("`c`: C++ field"));
        let d = mirror_differences(&same[..2], 12, &CXX);
        assert!(d[0].starts_with("size"), "{d:?}");
    }
}
