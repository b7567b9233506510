//! Sparse prefill forward on the standard shapes (docs/benchmarking.md). FLOP = 2 * s_q * topk * h_q * (d_qk + d_v).

use super::{Bench, BenchSuite, IndexChoice, Record, Timed};
use crate::device_ops::SparseFwdOnGpu;
use crate::tuning::Tuning;
use flashmla::cuda::Gpu;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::testing::{IndexPattern, SparseCase};

/// (s_q, s_kv, h_q, d_qk, topk) of a suite.
pub fn shapes(suite: BenchSuite) -> Vec<(usize, usize, usize, usize, usize)> {
    match suite {
        BenchSuite::Standard => {
            let mut v = Vec::new();
            for s_kv in [8192, 32768, 65536, 131072] {
                v.push((4096, s_kv, 128, 576, 2048));
            }
            v.push((4096, 32768, 64, 576, 2048));
            for s_kv in [8192, 32768, 65536] {
                v.push((4096, s_kv, 64, 512, 512));
                v.push((4096, s_kv, 128, 512, 1024));
            }
            v.push((1024, 2048, 128, 576, 512));
            v.push((128, 4096, 128, 576, 2048));
            v
        }
        BenchSuite::Small => vec![(1024, 2048, 128, 576, 512)],
        BenchSuite::Sweep => {
            let mut v: Vec<_> = [
                8192, 12288, 16384, 20480, 24576, 32768, 49152, 65536, 131072,
            ]
            .into_iter()
            .map(|s_kv| (4096, s_kv, 128, 576, 2048))
            .collect();
            v.extend([512, 1024, 4096, 8192].map(|topk| (4096, 8192, 128, 576, topk)));
            v
        }
    }
}

/// Index patterns chosen on the command line.
pub fn patterns(choice: IndexChoice) -> Vec<IndexPattern> {
    match choice {
        IndexChoice::Random => vec![IndexPattern::Random],
        IndexChoice::Local => vec![IndexPattern::Local],
        IndexChoice::Both => vec![IndexPattern::Random, IndexPattern::Local],
        IndexChoice::Window => vec![IndexPattern::Window],
    }
}

/// The name of an index pattern in the records.
pub fn pattern_name(pattern: IndexPattern) -> &'static str {
    match pattern {
        IndexPattern::Random => "random",
        IndexPattern::Local => "local",
        IndexPattern::Window => "window",
        IndexPattern::Hot => "hot",
        IndexPattern::Duplicates => "duplicates",
    }
}

/// The forward benchmarks.
pub fn benches(suite: BenchSuite, choice: IndexChoice) -> Vec<Bench> {
    let mut v = Vec::new();
    for (s_q, s_kv, h_q, d_qk, topk) in shapes(suite) {
        for pattern in patterns(choice) {
            let name = pattern_name(pattern);
            let record = Record {
                op: "sparse_fwd".into(),
                s_q: Some(s_q),
                s_kv: Some(s_kv),
                topk: Some(topk),
                h_q: Some(h_q),
                d_qk: Some(d_qk),
                d_v: Some(D_V),
                indices: Some(name.into()),
                ..Record::default()
            };
            let flop = 2.0 * (s_q * topk * h_q) as f64 * (d_qk + D_V) as f64;
            v.push(Bench {
                record,
                flop,
                bytes: 0.0,
                setup: Box::new(move |gpu, variants| {
                    let mut case = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
                    case.pattern = pattern;
                    setup(gpu, &case, variants)
                }),
            });
        }
    }
    v
}

/// Uploads a problem and returns the call to time (`variants`: the launch choices it will be called
/// with, which the bench experiments look at).
#[cfg_attr(not(feature = "experiments"), allow(unused_variables))]
fn setup(gpu: &Gpu, case: &SparseCase, variants: &[Tuning]) -> flashmla::Result<Timed> {
    let inp = case.generate(0x5eed)?;
    let dev = SparseFwdOnGpu::new(gpu, &inp, false)?;
    #[cfg(feature = "experiments")]
    let order = super::experiments::FwdOrderRuns::prepare(gpu, &inp, variants)?;
    let gpu = gpu.clone();
    #[cfg(feature = "experiments")]
    let timed: Timed = Box::new(move |t| order.run(&dev, &gpu, t));
    #[cfg(not(feature = "experiments"))]
    let timed: Timed = Box::new(move |t| dev.run(&gpu, &t.fwd));
    Ok(timed)
}
