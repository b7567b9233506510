//! What the ops ask of the kernels, in one list ([`FAMILIES`]): per kernel family, every kernel symbol its
//! planner can name and every parameter struct it passes. The tests below check the list against what
//! `build.rs` embedded: each symbol against the cubin's symbol table, each struct against the layout read from
//! `params.h` (which `device_params!` already checks at compile time, field by field), and each family and
//! struct of the sources against the list, so a new one cannot go unchecked. Adding a family is one entry here
//! (docs/gpu-plumbing.md, "Host/device contract").

use crate::cuda::{DeviceParams, FieldLayout};
use crate::ops::{decode, dense_prefill, kv_quant, sparse_bwd, sparse_fwd};

/// A parameter struct's mirror, as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamsMirror {
    /// The family whose kernels take it.
    pub family: &'static str,
    /// Name of the C++ struct in the family's `params.h`.
    pub cxx_name: &'static str,
    /// Name of the Rust struct.
    pub rust_name: &'static str,
    /// The Rust struct's fields.
    pub fields: &'static [FieldLayout],
    /// `size_of` the Rust struct.
    pub size: usize,
}

impl ParamsMirror {
    /// The mirror `P`.
    pub const fn of<P: DeviceParams>() -> Self {
        ParamsMirror {
            family: P::FAMILY,
            cxx_name: P::CXX_NAME,
            rust_name: P::RUST_NAME,
            fields: P::FIELDS,
            size: std::mem::size_of::<P>(),
        }
    }
}

/// A kernel family as the ops launch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyContract {
    /// The family (its cubin's name, `csrc/sm90/<family>/`).
    pub family: &'static str,
    /// Every kernel symbol the family's planner can name.
    pub kernels: &'static [&'static str],
    /// Every parameter struct its launches pass.
    pub params: &'static [ParamsMirror],
}

/// Every kernel family the ops launch.
pub const FAMILIES: &[FamilyContract] = &[
    FamilyContract {
        family: sparse_fwd::launch::FAMILY,
        kernels: sparse_fwd::launch::kernels::ALL,
        params: &[ParamsMirror::of::<sparse_fwd::launch::SparseFwdParams>()],
    },
    FamilyContract {
        family: sparse_bwd::launch::FAMILY,
        kernels: sparse_bwd::launch::kernels::ALL,
        params: &[ParamsMirror::of::<sparse_bwd::launch::SparseBwdParams>()],
    },
    FamilyContract {
        family: kv_quant::launch::FAMILY,
        kernels: kv_quant::launch::kernels::ALL,
        params: &[ParamsMirror::of::<kv_quant::launch::KvQuantParams>()],
    },
    FamilyContract {
        family: decode::launch::FAMILY,
        kernels: decode::launch::kernels::ALL,
        params: &[ParamsMirror::of::<decode::launch::DecodeParams>()],
    },
    FamilyContract {
        family: dense_prefill::launch::FAMILY,
        kernels: dense_prefill::launch::kernels::ALL,
        params: &[
            ParamsMirror::of::<dense_prefill::launch::DensePrefillFwdParams>(),
            ParamsMirror::of::<dense_prefill::launch::DensePrefillBwdParams>(),
        ],
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernel_symbols;
    use crate::cuda::params::mirror_differences;

    #[test]
    fn every_family_in_the_sources_is_listed_once() {
        for family in flashmla_kernels::FAMILIES {
            let n = FAMILIES.iter().filter(|f| f.family == *family).count();
            assert_eq!(
                n, 1,
                "csrc/sm90/{family}/ is a kernel family: list it once in ops::contract::FAMILIES"
            );
        }
        for f in FAMILIES {
            assert!(
                flashmla_kernels::FAMILIES.contains(&f.family),
                "{}: no csrc/sm90/{0}/{0}.cu",
                f.family
            );
            for p in f.params {
                assert_eq!(
                    p.family, f.family,
                    "{} is listed under another family",
                    p.rust_name
                );
            }
        }
    }

    /// Every kernel a planner can name is an entry point of the family's embedded cubin, and every entry
    /// point is one a planner can name (no kernel is compiled for nothing).
    #[test]
    fn every_kernel_symbol_is_in_the_embedded_cubin() {
        let mut checked = 0;
        for f in FAMILIES {
            let Some(cubin) = flashmla_kernels::cubin(f.family) else {
                continue;
            };
            let symbols = kernel_symbols(cubin).unwrap();
            let mut listed = f.kernels.to_vec();
            listed.sort();
            let missing: Vec<_> = listed
                .iter()
                .filter(|k| !symbols.iter().any(|s| s == *k))
                .collect();
            assert!(
                missing.is_empty(),
                "{}: the launcher can ask for {missing:?}, which the cubin lacks (it has {symbols:?})",
                f.family
            );
            let unlisted: Vec<_> = symbols
                .iter()
                .filter(|s| !listed.contains(&s.as_str()))
                .collect();
            assert!(
                unlisted.is_empty(),
                "{}: the cubin's entry points {unlisted:?} are not in the family's kernels::ALL",
                f.family
            );
            checked += 1;
        }
        // Without nvcc nothing is embedded (and nothing can be launched); a build with kernels checks them all.
        let built = FAMILIES
            .iter()
            .filter(|f| flashmla_kernels::cubin(f.family).is_some())
            .count();
        assert_eq!(checked, built);
    }

    /// The compile-time check (`device_params!`) in full detail, and every struct of a `params.h` has a mirror.
    #[test]
    fn every_params_struct_has_a_matching_mirror() {
        for cxx in flashmla_kernels::PARAMS_LAYOUTS {
            let mirrors: Vec<&ParamsMirror> = FAMILIES
                .iter()
                .flat_map(|f| f.params)
                .filter(|p| p.family == cxx.family && p.cxx_name == cxx.name)
                .collect();
            assert_eq!(
                mirrors.len(),
                1,
                "struct {} of csrc/sm90/{}/params.h needs one Rust mirror (device_params!) listed in \
                 ops::contract::FAMILIES",
                cxx.name,
                cxx.family
            );
            let m = mirrors[0];
            let d = mirror_differences(m.fields, m.size, cxx);
            assert!(d.is_empty(), "{} against {}: {d:#?}", m.rust_name, cxx.name);
        }
        for f in FAMILIES {
            if flashmla_kernels::cubin(f.family).is_none() {
                continue;
            }
            for p in f.params {
                assert!(
                    flashmla_kernels::params_layout(p.family, p.cxx_name).is_some(),
                    "{}: csrc/sm90/{}/params.h defines no struct {}",
                    p.rust_name,
                    p.family,
                    p.cxx_name
                );
            }
        }
    }
}
