//! Reading ptxas's report on a kernel family (nvcc's stderr with `-Xptxas=-warn-spills`): which lines are news
//! and which are known information. Shared by `build.rs` and the crate's unit tests.
//!
//! A build prints only the news: wgmma that ptxas serialised (C7520, C7514: correct, but several times slower),
//! spills in a kernel that had none, a known spill that grew, and any line this module does not recognise. The known
//! information (compiler-injected `warpgroup.arrive` / `warpgroup.wait`, C7519 / C7517; stack frames; the spills
//! of [`KNOWN_SPILLS`] up to their recorded size) stays in the report file only.

/// Kernels that spill by design, with the spill measured when it was accepted: `(kernel, bytes stored, bytes
/// loaded)`. The backward's pair kernels hold a token's dQ accumulators in registers for the whole token
/// (docs/sparse-bwd.md), which leaves a few registers short. A spill above these sizes is reported; a spill in
/// any other kernel fails a build that requires kernels.
pub const KNOWN_SPILLS: &[(&str, u64, u64)] = &[
    ("sparse_bwd_main_pair_xb_d512", 12, 20),
    ("sparse_bwd_main_pair_xb_d576", 12, 24),
    // The deterministic pair kernel's row-contiguous int64 reductions (kernel.cuh, `reduce_slot_rows`) hold four
    // rows of values at a time; ptxas then keeps a few more values of the d_qk 576 tile loop on the stack.
    ("sparse_bwd_main_pair_det_d576", 56, 56),
    ("sparse_bwd_main_pair_d576", 12, 28),
    // The narrow MODEL1 kN = 32 kernel (96 / 160 / 160 registers, narrow.cuh): its score warpgroup keeps a few
    // values of the chunk loop on the stack, reloaded per chunk; its tile loop does not spill.
    ("decode_split_fp8_model1_n32", 20, 20),
    // The fused dense backward at d 192 (dK 96 + dV 64 accumulator registers of its 240): a few loop-invariant
    // values of the tile walk. Its MMAs are not serialised.
    ("dense_prefill_bwd_fused_d192_bf16", 20, 24),
    ("dense_prefill_bwd_fused_d192_f16", 20, 24),
    // The dK / dV kernel at d 192 (dK 96 + dV 64 accumulator registers of the consumers' 240, P^T in f32 and dP^T
    // in halves): two values of the tile walk, reloaded per tile. Its MMAs are not serialised.
    ("dense_prefill_bwd_dkv_d192_bf16", 8, 12),
    ("dense_prefill_bwd_dkv_d192_f16", 8, 12),
];

/// Markers of ptxas lines that carry known information wherever they appear: the injected `warpgroup.arrive`
/// (C7519) and `warpgroup.wait` (C7517) around register use by wgmma, and the stack-frame line of `-v`.
const KNOWN_INFO: &[&str] = &["(C7519)", "(C7517)", "bytes stack frame"];

/// Markers of the other per-function resource lines of `-v`, known information on a `ptxas info` line.
const KNOWN_RESOURCE_INFO: &[&str] = &[
    ": Used ",
    "Compiling entry function",
    "Function properties for",
    "Compile time",
];

/// Whether a line carries known information only.
fn is_known_info(line: &str) -> bool {
    KNOWN_INFO.iter().any(|m| line.contains(m))
        || (line.starts_with("ptxas info") && KNOWN_RESOURCE_INFO.iter().any(|m| line.contains(m)))
}

/// Markers of ptxas serialising every wgmma of a kernel: C7520 (e.g. extern calls) and the text every such notice
/// carries (C7514: an ordinary instruction reads a wgmma's accumulators before the wait that retires it). Causes met
/// so far besides those: a `wgmma.wait` or an accumulator update under a branch inside the tile loop (C7515, C7520);
/// one `setmaxnreg` before the branch that splits two consumer roles (C7520; each role sets its own); an accumulator
/// zero-initialised on one path and left by an in-flight wgmma on another, merged at a loop head (C7515); registers
/// spilled around a wgmma because the compiler hoisted loop-invariant addresses out of the loop (C7520; opaque copies
/// through `asm volatile` keep them in the loop, as decode's `StagingGeometry` does). From a two-role kernel without
/// a producer (docs/perf-log.md, the dual-score decode): roles without any `setmaxnreg` (C7518 / C7520; one per role,
/// even to the full budget, splits ptxas's analysis by role); an accumulator left undefined on one path and written by
/// an in-flight wgmma on another, merged at a loop head (C7520, as the zero-initialised case above); an accumulator
/// scaled under one branch and multiplied into under another (C7520).
const SERIALISED_WGMMA: &[&str] = &["(C7520)", "wgmma.mma_async instructions are serialized"];

/// Something in a ptxas report worth showing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// ptxas serialised the wgmma of a kernel (the whole line).
    SerialisedWgmma(String),
    /// A kernel that is not in [`KNOWN_SPILLS`] spilled.
    UnexpectedSpill {
        /// The kernel.
        kernel: String,
        /// Bytes of spill stores.
        stores: u64,
        /// Bytes of spill loads.
        loads: u64,
    },
    /// A kernel of [`KNOWN_SPILLS`] spilled more than its recorded size.
    SpillGrew {
        /// The kernel.
        kernel: String,
        /// Bytes of spill stores.
        stores: u64,
        /// Bytes of spill loads.
        loads: u64,
        /// The recorded `(stores, loads)`.
        known: (u64, u64),
    },
    /// A line that is none of the known kinds (a new warning, say).
    Other(String),
}

impl Finding {
    /// Whether the finding fails a build that requires kernels (`FLASHMLA_REQUIRE_KERNELS=1`).
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Finding::SerialisedWgmma(_) | Finding::UnexpectedSpill { .. }
        )
    }

    /// One line for a cargo warning or a build error.
    pub fn describe(&self) -> String {
        match self {
            Finding::SerialisedWgmma(line) => format!("ptxas serialised wgmma: {line}"),
            Finding::UnexpectedSpill {
                kernel,
                stores,
                loads,
            } => format!(
                "kernel `{kernel}` spills registers ({stores} bytes stored, {loads} bytes loaded) and is not \
                 expected to: remove the spill, or record it in KNOWN_SPILLS (build_support/ptxas.rs)"
            ),
            Finding::SpillGrew {
                kernel,
                stores,
                loads,
                known: (s, l),
            } => format!(
                "kernel `{kernel}` spills more than recorded: {stores} / {loads} bytes stored / loaded, \
                 recorded {s} / {l} (KNOWN_SPILLS in build_support/ptxas.rs)"
            ),
            Finding::Other(line) => line.clone(),
        }
    }
}

/// `(kernel, stores, loads)` of a ptxas spill line: `... spilled to local memory in function 'K', S bytes spill
/// stores, L bytes spill loads`.
fn parse_spill(line: &str) -> Option<(String, u64, u64)> {
    let rest = line.split_once("spilled to local memory in function '")?.1;
    let (kernel, rest) = rest.split_once('\'')?;
    let number_before = |what: &str| -> Option<u64> {
        let head = rest.split_once(what)?.0;
        head.rsplit(|c: char| !c.is_ascii_digit())
            .find(|s| !s.is_empty())?
            .parse()
            .ok()
    };
    Some((
        kernel.to_string(),
        number_before("bytes spill stores")?,
        number_before("bytes spill loads")?,
    ))
}

/// The findings of one kernel family's report, in line order, judged against `known_spills`.
pub fn review(log: &str, known_spills: &[(&str, u64, u64)]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for line in log.lines().map(str::trim_end) {
        if SERIALISED_WGMMA.iter().any(|m| line.contains(m)) {
            findings.push(Finding::SerialisedWgmma(line.to_string()));
            continue;
        }
        if line.trim().is_empty() || is_known_info(line) {
            continue;
        }
        let Some((kernel, stores, loads)) = parse_spill(line) else {
            findings.push(Finding::Other(line.to_string()));
            continue;
        };
        match known_spills.iter().find(|(k, _, _)| *k == kernel) {
            None => findings.push(Finding::UnexpectedSpill {
                kernel,
                stores,
                loads,
            }),
            Some(&(_, s, l)) if stores > s || loads > l => findings.push(Finding::SpillGrew {
                kernel,
                stores,
                loads,
                known: (s, l),
            }),
            Some(_) => {}
        }
    }
    findings
}
