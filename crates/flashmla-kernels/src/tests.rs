//! Tests of the `params.h` reader that `build.rs` uses (`build_layout.rs`).

use crate::build_layout::{layouts_rust, parse_probe_output, parse_structs, probe_source};

/// A header with every construct the reader must see through.
const HEADER: &str = r#"
// A comment with a struct Fake { int no; }; in it.
#pragma once
#include <cstdint>
#define FLASHMLA_X(a) \
    struct NotAStruct { int a; };

namespace flashmla::demo {

enum class Bar : uint32_t { A = 1, B = 2 };
inline constexpr uint32_t kFlag = 1u << 0;  /* block comment { */
template <class E>
inline constexpr bool kIsF16 = false;
template <int N>
struct Templated {
    int x[N];
};
struct Forward;

__device__ inline int helper(int a) { return a + 1; }

struct Params {
    const uint16_t* q;           // [s_q, h_q, d] bf16
    int64_t a_stride, b_stride;  // two declarators
    float scale = 1.0f;
    int32_t counts[4];
    uint32_t flags{0};
    alignas(8) int32_t aligned;
    static constexpr int kStatic = 3;
    using Index = int32_t;
    static_assert(sizeof(int) == 4, "int");
    struct Nested {
        int inner;
    };
    __device__ int twice() const { return 2 * flags; }
    Params() = default;
  public:
    int32_t last;
};

namespace inner {
struct Other {
    double d;
};
}  // namespace inner

}  // namespace flashmla::demo
"#;

#[test]
fn the_reader_finds_data_members_and_skips_the_rest() {
    let structs = parse_structs(HEADER).unwrap();
    let names: Vec<&str> = structs.iter().map(|s| s.qualified.as_str()).collect();
    assert_eq!(
        names,
        ["flashmla::demo::Params", "flashmla::demo::inner::Other"]
    );
    assert_eq!(structs[0].name, "Params");
    assert_eq!(
        structs[0].fields,
        ["q", "a_stride", "b_stride", "scale", "counts", "flags", "aligned", "last"]
    );
    assert_eq!(structs[1].fields, ["d"]);
}

#[test]
fn bit_fields_and_unbalanced_braces_are_errors() {
    let e = parse_structs("struct P { uint32_t a : 3; };").unwrap_err();
    assert!(e.contains("bit-field"), "{e}");
    assert!(parse_structs("struct P { int a; ").is_err());
}

#[test]
fn every_family_header_parses() {
    for (family, text) in [
        (
            "sparse_fwd",
            include_str!("../csrc/sm90/sparse_fwd/params.h"),
        ),
        (
            "sparse_bwd",
            include_str!("../csrc/sm90/sparse_bwd/params.h"),
        ),
        ("kv_quant", include_str!("../csrc/sm90/kv_quant/params.h")),
    ] {
        let structs = parse_structs(text).unwrap();
        assert!(!structs.is_empty(), "{family}");
        for s in &structs {
            assert!(
                s.qualified.starts_with(&format!("flashmla::{family}::")),
                "{family}: {}",
                s.qualified
            );
            let mut fields = s.fields.clone();
            fields.sort();
            fields.dedup();
            assert_eq!(fields.len(), s.fields.len(), "{family}: duplicate field");
            assert!(!fields.is_empty(), "{family}: {}", s.name);
        }
    }
}

#[test]
fn the_probe_prints_what_its_output_reader_reads() {
    let structs = parse_structs(HEADER).unwrap();
    let src = probe_source(&[("demo".into(), "sm90/demo/params.h".into(), structs.clone())]);
    assert!(src.contains("#include \"sm90/demo/params.h\""));
    assert!(src.contains("offsetof(flashmla::demo::Params, counts)"));
    assert!(src.contains("sizeof(static_cast<flashmla::demo::inner::Other*>(nullptr)->d)"));
    let out = "struct demo Params 64 8\nfield q 0 8\nfield a_stride 8 8\n\nstruct demo Other 8 8\nfield d 0 8\n";
    let layouts = parse_probe_output(out).unwrap();
    assert_eq!(layouts.len(), 2);
    assert_eq!((layouts[0].size, layouts[0].align), (64, 8));
    assert_eq!(
        layouts[0].fields,
        [("q".to_string(), 0, 8), ("a_stride".to_string(), 8, 8)]
    );
    let rust = layouts_rust(&layouts);
    assert!(rust.contains("CxxField { name: \"a_stride\", offset: 8, size: 8 }"));
    assert!(parse_probe_output("field q 0 8\n").is_err());
    assert!(parse_probe_output("struct demo P x 8\n").is_err());
}

#[test]
fn layouts_are_found_by_family_and_name() {
    for s in crate::PARAMS_LAYOUTS {
        assert_eq!(crate::params_layout(s.family, s.name), Some(s));
    }
    assert_eq!(crate::params_layout("no_such_family", "Params"), None);
    assert!(crate::const_str_eq("abc", "abc"));
    assert!(!crate::const_str_eq("abc", "abd"));
    assert!(!crate::const_str_eq("abc", "ab"));
}
