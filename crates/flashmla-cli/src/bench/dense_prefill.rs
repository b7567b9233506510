//! Dense varlen prefill forward and backward on the standard shapes (docs/benchmarking.md): h 128, (d, d_v) = (192,
//! 128), bf16, causal, b x s = 4 x 4K, 2 x 8K, 1 x 16K and a mixed-length batch of 16K tokens; plus the non-causal 4 x
//! 4K and the (128, 128) head. Forward FLOP = 2 * sum over sequences of s_q * s_k * h * (d + d_v), halved under the
//! causal mask; the backward counts 2.5 times that (recompute S, then dP, dV, dQ, dK), in both of its schedules.

use super::{Bench, BenchSuite, Record, Timed};
use crate::device_ops::{DensePrefillBwdOnGpu, DensePrefillOnGpu};
use flashmla::testing::randn_half;
use flashmla::testing::{prefill_case, rng, PrefillSpec};
use flashmla::DType;

/// Op name of the deterministic backward (`DensePrefillBwdOptions::deterministic`), timed only when `--op` names it.
pub const DETERMINISTIC_OP: &str = "dense_prefill_bwd_deterministic";
/// Op name of the backward forced onto the fused schedule (`DensePrefillBwdOptions::fused`), timed only when `--op`
/// names it (at d 128 it is the measured choice, so the default op times it too).
pub const FUSED_OP: &str = "dense_prefill_bwd_fused";

/// Which pass a benchmark times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The forward.
    Forward,
    /// The backward, default schedule (f32 dQ accumulator).
    Backward,
    /// The deterministic backward.
    BackwardDeterministic,
    /// The backward on the fused schedule.
    BackwardFused,
}

/// Query heads of the standard shapes.
const HEADS: usize = 128;

/// The sequence lengths of the mixed batch: 16K tokens in sequences of 512 to 4K.
pub fn mixed_lengths() -> Vec<usize> {
    vec![4096, 512, 2048, 1024, 3072, 1536, 2560, 1024, 512]
}

/// (sequence lengths, d, causal) of a suite.
fn shapes(suite: BenchSuite) -> Vec<(Vec<usize>, usize, bool)> {
    match suite {
        BenchSuite::Standard => {
            let mut v: Vec<_> = [(4, 4096), (2, 8192), (1, 16384)]
                .into_iter()
                .map(|(b, s)| (vec![s; b], 192, true))
                .collect();
            v.push((mixed_lengths(), 192, true));
            v.push((vec![4096; 4], 192, false));
            v.push((vec![4096; 4], 128, true));
            v
        }
        BenchSuite::Small => vec![(vec![2048], 192, true)],
        BenchSuite::Sweep => Vec::new(),
    }
}

/// Forward FLOP of sequences `lens` (s_q = s_k each).
pub fn flop(lens: &[usize], h: usize, d: usize, causal: bool) -> f64 {
    let pairs: f64 = lens.iter().map(|&s| (s * s) as f64).sum();
    let full = 2.0 * pairs * h as f64 * (d + 128) as f64;
    if causal {
        full / 2.0
    } else {
        full
    }
}

/// The benchmarks of one pass.
pub fn benches(suite: BenchSuite, pass: Pass) -> Vec<Bench> {
    let backward = pass != Pass::Forward;
    let options = flashmla::ops::dense_prefill::DensePrefillBwdOptions {
        deterministic: pass == Pass::BackwardDeterministic,
        fused: (pass == Pass::BackwardFused).then_some(true),
    };
    shapes(suite)
        .into_iter()
        .map(|(lens, d, causal)| {
            let total: usize = lens.iter().sum();
            let record = Record {
                op: match pass {
                    Pass::Forward => "dense_prefill",
                    Pass::Backward => "dense_prefill_bwd",
                    Pass::BackwardDeterministic => DETERMINISTIC_OP,
                    Pass::BackwardFused => FUSED_OP,
                }
                .into(),
                b: Some(lens.len()),
                s_q: Some(total),
                s_kv: Some(total),
                h_q: Some(HEADS),
                d_qk: Some(d),
                d_v: Some(128),
                causal: Some(causal),
                seqlens: Some(
                    lens.iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                dtype: Some("bf16".into()),
                // The backward's workspace: delta [h, total] f32, and the f32 dQ accumulator when fused.
                extra_bytes: if backward {
                    flashmla::ops::dense_prefill::bwd_workspace_shape_for(
                        HEADS,
                        total,
                        lens.len(),
                        d,
                        &options,
                    )
                    .ok()
                    .map(|s| 4 * s.iter().product::<usize>())
                } else {
                    None
                },
                ..Record::default()
            };
            let fwd_flop = flop(&lens, HEADS, d, causal);
            Bench {
                record,
                flop: if backward { 2.5 * fwd_flop } else { fwd_flop },
                bytes: 0.0,
                setup: Box::new(move |gpu, _variants| {
                    let spec = PrefillSpec {
                        lens: lens.iter().map(|&s| (s, s)).collect(),
                        h_q: HEADS,
                        h_k: HEADS,
                        d,
                        dtype: DType::Bf16,
                        q_std: 1.0,
                    };
                    let mut rng = rng(0x5eed);
                    let case = prefill_case(&mut rng, &spec)?;
                    let gpu = gpu.clone();
                    let timed: Timed = if backward {
                        let d_out = randn_half(&mut rng, &[total, HEADS, 128], 1.0, DType::Bf16)?;
                        let dev = DensePrefillBwdOnGpu::new(&gpu, &case, &d_out, false, options)?;
                        dev.fwd.run(&gpu, causal, None)?;
                        Box::new(move |_t| dev.run(&gpu, causal, None))
                    } else {
                        let dev = DensePrefillOnGpu::new(&gpu, &case, false)?;
                        Box::new(move |_t| dev.run(&gpu, causal, None))
                    };
                    Ok(timed)
                }),
            }
        })
        .collect()
}
