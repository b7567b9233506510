//! Sparse prefill forward on the standard shapes (docs/benchmarking.md). FLOP = 2 * s_q * topk * h_q * (d_qk + d_v).

use super::{Bench, BenchSuite, IndexChoice, Record};
use crate::device_ops::SparseFwdOnGpu;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::testing::{IndexPattern, SparseCase};
use flashmla::HostTensor;

/// Experiment aid: when this variable is set while the inputs are prepared, the bench also uploads every token's
/// index row sorted by KV row; each call then reads the variable: `sorted` runs on the sorted rows, `waves` launches
/// the op once per wave of tokens (as many as the GPU holds at once: `sm_count` CTAs of 64 heads), one after
/// another, `sorted-waves` both, anything else the op as built. The outputs are the same up to the order of the
/// online softmax's additions. It bounds what a KV-row order inside the forward would be worth (the backward's
/// buckets): within a wave every CTA then walks the KV rows from low to high at about the same pace. E.g.
/// `FLASHMLA_BENCH_SPARSE_FWD_ORDER=index flashmla bench --op sparse_fwd --ab
/// FLASHMLA_BENCH_SPARSE_FWD_ORDER=index,waves,sorted,sorted-waves`.
pub const ORDER_ENV: &str = "FLASHMLA_BENCH_SPARSE_FWD_ORDER";

/// Each `topk`-entry row of `indices` sorted ascending (invalid `-1` entries first).
pub(crate) fn sorted_rows(indices: &[i32], topk: usize) -> Vec<i32> {
    let mut v = indices.to_vec();
    for row in v.chunks_mut(topk.max(1)) {
        row.sort_unstable();
    }
    v
}

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
                setup: Box::new(move |gpu| {
                    let mut case = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
                    case.pattern = pattern;
                    let inp = case.generate(0x5eed)?;
                    let dev = SparseFwdOnGpu::new(gpu, &inp, false)?;
                    let sorted = if std::env::var_os(ORDER_ENV).is_some() {
                        let rows = sorted_rows(&inp.indices.to_i32_vec()?, topk);
                        Some(gpu.upload(&HostTensor::from_i32(rows, &[s_q, 1, topk])?)?)
                    } else {
                        None
                    };
                    let wave = (gpu.info().sm_count as usize / h_q.div_ceil(64)).max(1);
                    let gpu = gpu.clone();
                    Ok(Box::new(move || {
                        let order = std::env::var(ORDER_ENV).unwrap_or_default();
                        let indices = sorted.as_ref().filter(|_| order.starts_with("sorted"));
                        let waves = (order == "waves" || order == "sorted-waves").then_some(wave);
                        if indices.is_none() && waves.is_none() {
                            dev.run(&gpu)
                        } else {
                            dev.run_ordered(&gpu, indices, waves)
                        }
                    }))
                }),
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::sorted_rows;

    #[test]
    fn sorted_rows_sorts_each_row_on_its_own() {
        let idx = [5, -1, 3, 9, 2, 8, 0, 1];
        assert_eq!(sorted_rows(&idx, 4), [-1, 3, 5, 9, 0, 1, 2, 8]);
    }
}
