//! Sparse prefill forward: the kernel against the f64 reference (spec section 6 prefill tolerances) on the case grid of
//! the forward issue, with outputs poisoned before every run. Large problems compare a sample of query rows.

use super::{check, Case, Outcome, GRID_PAIRS};
use crate::device_ops::SparseFwdOnGpu;
use crate::tuning::Tuning;
use flashmla::cuda::Gpu;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::reference::compare::{PREFILL_LSE, PREFILL_MAX_LOGITS, PREFILL_OUT};
use flashmla::reference::sparse_fwd::sparse_fwd_rows_with;
use flashmla::testing::{IndexPattern, SinkKind, SparseCase};

/// How a case is run.
#[derive(Clone)]
struct Spec {
    case: SparseCase,
    /// Pass every input non-contiguous.
    padded: bool,
    /// Compare only this many query rows (spread over the tokens), or all when `None`.
    sample: Option<usize>,
}

fn rows_to_check(s_q: usize, sample: Option<usize>) -> Vec<usize> {
    match sample {
        Some(n) if n < s_q => {
            let mut rows: Vec<usize> = (0..n).map(|i| i * (s_q - 1) / (n - 1).max(1)).collect();
            rows.dedup();
            rows
        }
        _ => (0..s_q).collect(),
    }
}

fn gather_rows(all: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| all[r * width..(r + 1) * width].iter().copied())
        .collect()
}

fn run_case(gpu: &Gpu, tuning: &Tuning, spec: &Spec, seed: u64) -> flashmla::Result<Outcome> {
    let c = &spec.case;
    let inp = c.generate(seed)?;
    let dev = SparseFwdOnGpu::new(
        gpu,
        &if spec.padded {
            inp.padded()?
        } else {
            inp.clone()
        },
        true,
    )?;
    dev.run(gpu, &tuning.fwd)?;
    let got = dev.download(gpu)?;
    let values = inp.values()?;
    let rows = rows_to_check(c.s_q, spec.sample);
    let want = sparse_fwd_rows_with::<f64>(&values.problem(), &rows, crate::signals::token())?;
    Ok(Outcome::from_checks(vec![
        check(
            "out",
            &gather_rows(&got.out, c.h_q * D_V, &rows),
            &want.out,
            &PREFILL_OUT,
        ),
        check(
            "lse",
            &gather_rows(&got.lse, c.h_q, &rows),
            &want.lse,
            &PREFILL_LSE,
        ),
        check(
            "max_logits",
            &gather_rows(&got.max_logits, c.h_q, &rows),
            &want.max_logits,
            &PREFILL_MAX_LOGITS,
        ),
    ]))
}

fn variant(case: &mut SparseCase, k: usize) -> (&'static str, bool) {
    match k % 6 {
        0 => ("plain", false),
        1 => {
            case.sink = SinkKind::Random;
            case.topk_length = true;
            ("sink+topk_length", false)
        }
        2 => {
            case.sink = SinkKind::Infinite;
            ("sink_inf", false)
        }
        3 => {
            case.invalid_frac = 0.1;
            case.empty_every = 7;
            ("invalid+empty_rows", false)
        }
        4 => {
            case.nan_unreferenced = true;
            case.invalid_frac = 0.05;
            ("nan_unreferenced", false)
        }
        _ => {
            case.sink = SinkKind::Random;
            case.topk_length = true;
            ("noncontiguous", true)
        }
    }
}

fn push(v: &mut Vec<Case>, name: String, quick: bool, spec: Spec) {
    v.push(Case {
        name,
        quick,
        run: Box::new(move |gpu, tuning, seed| run_case(gpu, tuning, &spec, seed)),
    });
}

/// The forward grid: h_q {64,128} x d_qk {512,576} x 12 (s_kv, topk) x s_q {1,62,213}, each case with one of six
/// feature variants in rotation (so every feature meets every shape class), plus the extra cases.
pub fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut k = 0usize;
    for h_q in [64usize, 128] {
        for d_qk in [512usize, 576] {
            for (s_kv, topk) in GRID_PAIRS {
                for s_q in [1usize, 62, 213] {
                    let mut case = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
                    let (what, padded) = variant(&mut case, k);
                    let quick = k % 9 == 0;
                    k += 1;
                    let name =
                        format!("sparse_fwd/h{h_q}/d{d_qk}/skv{s_kv}/topk{topk}/sq{s_q}/{what}");
                    push(
                        &mut v,
                        name,
                        quick,
                        Spec {
                            case,
                            padded,
                            sample: None,
                        },
                    );
                }
            }
        }
    }
    // Every feature on one mid-size shape per (h_q, d_qk), so a failure names its feature.
    for h_q in [64usize, 128] {
        for d_qk in [512usize, 576] {
            for j in 0..6 {
                let mut case = SparseCase::plain(37, 1521, h_q, d_qk, 512);
                let (what, padded) = variant(&mut case, j);
                let name = format!("sparse_fwd/feature/{what}/h{h_q}/d{d_qk}");
                push(
                    &mut v,
                    name,
                    true,
                    Spec {
                        case,
                        padded,
                        sample: None,
                    },
                );
            }
        }
    }
    // topk far beyond s_kv; every row without a valid entry; heads that are not a multiple of 64.
    for (s_kv, topk) in [(32usize, 2048usize), (64, 8192)] {
        for (h_q, d_qk) in [(64usize, 576usize), (128, 512)] {
            let case = SparseCase::plain(62, s_kv, h_q, d_qk, topk);
            push(
                &mut v,
                format!("sparse_fwd/topk_gt_skv/skv{s_kv}/topk{topk}/h{h_q}/d{d_qk}"),
                false,
                Spec {
                    case,
                    padded: false,
                    sample: None,
                },
            );
        }
    }
    let mut all_invalid = SparseCase::plain(20, 500, 128, 576, 256);
    all_invalid.empty_every = 1;
    all_invalid.sink = SinkKind::Random;
    push(
        &mut v,
        "sparse_fwd/all_rows_invalid".into(),
        true,
        Spec {
            case: all_invalid,
            padded: false,
            sample: None,
        },
    );
    for h_q in [1usize, 3, 100] {
        let mut case = SparseCase::plain(40, 700, h_q, 576, 200);
        case.sink = SinkKind::Random;
        case.invalid_frac = 0.1;
        push(
            &mut v,
            format!("sparse_fwd/heads/h{h_q}"),
            true,
            Spec {
                case,
                padded: false,
                sample: None,
            },
        );
    }
    // Huge s_q (never on grid y/z): run, no crash, sampled rows checked.
    for (s_q, h_q) in [(70_000usize, 16usize), (200_000, 2)] {
        let mut case = SparseCase::plain(s_q, 8192, h_q, 576, 128);
        case.invalid_frac = 0.02;
        push(
            &mut v,
            format!("sparse_fwd/huge_sq/sq{s_q}/h{h_q}"),
            false,
            Spec {
                case,
                padded: false,
                sample: Some(48),
            },
        );
    }
    // The benchmark shape, random and local indices, sampled.
    for pattern in [IndexPattern::Random, IndexPattern::Local] {
        let mut case = SparseCase::plain(4096, 32768, 128, 576, 2048);
        case.pattern = pattern;
        push(
            &mut v,
            format!("sparse_fwd/perf_shape/{pattern:?}").to_lowercase(),
            false,
            Spec {
                case,
                padded: false,
                sample: Some(24),
            },
        );
    }
    v
}
