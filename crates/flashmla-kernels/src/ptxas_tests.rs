//! The rules of `build_support/ptxas.rs` on report lines as ptxas prints them.

use crate::ptxas::{review, Finding, KNOWN_SPILLS};

const INJECTED: &str =
    "ptxas info    : (C7519) warpgroup.arrive is injected in around line 669 by compiler to \
                        allow use of registers in GMMA in function 'sparse_fwd_d576'";
const INJECTED_WAIT: &str = "ptxas info    : (C7517) warpgroup.wait is injected in around line 4587 by compiler \
                             to allow use of registers defined by GMMA in function 'sparse_fwd_d576'";
const SERIALISED: &str = "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are \
                          serialized due to the presence of Extern calls in the function 'sparse_bwd_main_d512'";

const SERIALISED_READ: &str = "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions \
                               are serialized due to non wgmma instructions reading accumulator registers of  a \
                               wgmma between start and end of the pipeline stage in the function \
                               'dense_prefill_fwd_d192_bf16'";

fn spill(kernel: &str, stores: u64, loads: u64) -> String {
    format!(
        "ptxas warning : Registers are spilled to local memory in function '{kernel}', {stores} bytes spill \
         stores, {loads} bytes spill loads"
    )
}

#[test]
fn known_information_is_not_news() {
    let mut log = vec![
        INJECTED.to_string(),
        INJECTED_WAIT.to_string(),
        String::new(),
    ];
    log.extend(KNOWN_SPILLS.iter().map(|&(k, s, l)| spill(k, s, l)));
    log.push("ptxas info    : Used 168 registers, used 1 barriers, 8 bytes cmem[0]".into());
    log.push("ptxas info    : Function properties for sparse_fwd_d576".into());
    log.push("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads".into());
    assert_eq!(review(&log.join("\n"), KNOWN_SPILLS), vec![]);
}

#[test]
fn a_known_spill_that_shrinks_is_not_news_but_one_that_grows_is() {
    let (kernel, s, l) = KNOWN_SPILLS[0];
    assert_eq!(review(&spill(kernel, s / 2, 0), KNOWN_SPILLS), vec![]);
    let grown = review(&spill(kernel, s, l + 4), KNOWN_SPILLS);
    assert_eq!(
        grown,
        vec![Finding::SpillGrew {
            kernel: kernel.into(),
            stores: s,
            loads: l + 4,
            known: (s, l)
        }]
    );
    assert!(!grown[0].is_error(), "a grown known spill is a warning");
    assert!(grown[0].describe().contains(kernel));
}

#[test]
fn serialised_wgmma_and_unexpected_spills_are_errors() {
    let log = [
        INJECTED,
        SERIALISED,
        SERIALISED_READ,
        &spill("sparse_fwd_d576", 8, 16),
    ]
    .join("\n");
    let found = review(&log, KNOWN_SPILLS);
    assert_eq!(
        found,
        vec![
            Finding::SerialisedWgmma(SERIALISED.into()),
            Finding::SerialisedWgmma(SERIALISED_READ.into()),
            Finding::UnexpectedSpill {
                kernel: "sparse_fwd_d576".into(),
                stores: 8,
                loads: 16
            },
        ]
    );
    assert!(found.iter().all(Finding::is_error));
    assert!(found[2].describe().contains("KNOWN_SPILLS"));
}

#[test]
fn unknown_lines_are_shown_as_they_are() {
    let line = "ptxas warning : Value of threads per SM for entry foo is out of range";
    let found = review(&format!("{INJECTED}\n{line}\n"), KNOWN_SPILLS);
    assert_eq!(found, vec![Finding::Other(line.into())]);
    assert!(!found[0].is_error());
    assert_eq!(found[0].describe(), line);
}
