//! Sparse prefill backward on the standard shapes (docs/benchmarking.md): FLOP = 2 * s_q * topk * h_q *
//! (3 * d_qk + 2 * d_v) (recompute S, then dP, dV, dQ, dK). The timed call is the whole op (workspace zeroing,
//! delta, main kernel, cast, sink gradient); the record carries the op's extra device memory.

use super::sparse_fwd::{pattern_name, patterns, shapes};
use super::{Bench, BenchSuite, IndexChoice, Record};
use crate::device_ops::SparseBwdOnGpu;
use flashmla::ops::sparse_bwd::SparseBwdOptions;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::testing::{peer_bf16, rng, SparseCase};
use flashmla::{DType, HostTensor};

/// Experiment aid: when this variable is set while the inputs are prepared, the bench also builds, per token, two
/// index rows holding the entries of KV rows `[0, s_kv / 2)` and `[s_kv / 2, s_kv)` (compacted, with
/// `topk_length`); every call with the variable at `2` then runs the backward twice, once per half (all tokens
/// on the first half, then all on the second), to time a two-pass order whose live `d_kv` accumulator is half
/// the size. The second pass overwrites `d_q` and `d_kv` (timing only; a real two-pass op would add them). E.g.
/// `FLASHMLA_BENCH_SPARSE_BWD_PASSES=1 flashmla bench --op sparse_bwd --ab FLASHMLA_BENCH_SPARSE_BWD_PASSES=1,2`.
pub const PASSES_ENV: &str = "FLASHMLA_BENCH_SPARSE_BWD_PASSES";

/// Per token, the entries of `indices` (`[s_q, topk]` values) whose KV row lies in the lower (`upper` false) or
/// upper half of `[0, s_kv)`, compacted to the front of the row and padded with -1, and their counts.
fn half_rows(
    indices: &[i32],
    s_q: usize,
    topk: usize,
    s_kv: usize,
    upper: bool,
) -> (Vec<i32>, Vec<i32>) {
    let mid = (s_kv / 2) as i64;
    let mut rows = vec![-1i32; s_q * topk];
    let mut lens = vec![0i32; s_q];
    for t in 0..s_q {
        let mut n = 0;
        for &i in &indices[t * topk..(t + 1) * topk] {
            let v = i64::from(i);
            if v >= 0 && (v < s_kv as i64) && ((v >= mid) == upper) {
                rows[t * topk + n] = i;
                n += 1;
            }
        }
        lens[t] = n as i32;
    }
    (rows, lens)
}

/// Op name of the deterministic backward (`SparseBwdOptions::deterministic`), timed only when `--op`
/// names it.
pub const DETERMINISTIC_OP: &str = "sparse_bwd_deterministic";

/// The backward benchmarks (same shapes as the forward's); `deterministic`: with bitwise-reproducible
/// `d_kv` ([`DETERMINISTIC_OP`]), whose workspace is twice the f32 accumulator.
pub fn benches(suite: BenchSuite, choice: IndexChoice, deterministic: bool) -> Vec<Bench> {
    let mut v = Vec::new();
    for (s_q, s_kv, h_q, d_qk, topk) in shapes(suite) {
        for pattern in patterns(choice) {
            let name = pattern_name(pattern);
            let record = Record {
                op: if deterministic {
                    DETERMINISTIC_OP.into()
                } else {
                    "sparse_bwd".into()
                },
                s_q: Some(s_q),
                s_kv: Some(s_kv),
                topk: Some(topk),
                h_q: Some(h_q),
                d_qk: Some(d_qk),
                d_v: Some(D_V),
                indices: Some(name.into()),
                // The f32 d_kv accumulator the op allocates for a bf16 d_kv (PERF: at most one f32 copy of d_kv);
                // deterministic mode: int64 fixed point, twice that.
                extra_bytes: Some(s_kv * d_qk * if deterministic { 8 } else { 4 }),
                ..Record::default()
            };
            let flop = 2.0 * (s_q * topk * h_q) as f64 * (3 * d_qk + 2 * D_V) as f64;
            v.push(Bench {
                record,
                flop,
                bytes: 0.0,
                setup: Box::new(move |gpu| {
                    let mut case = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
                    case.pattern = pattern;
                    let inp = case.generate(0x5eed)?;
                    let d_out = peer_bf16(&mut rng(0xd0), s_q * h_q * D_V);
                    let d_out = HostTensor::bf16_from_f32(&d_out, &[s_q, h_q, D_V])?;
                    let dev = SparseBwdOnGpu::new(gpu, &inp, &d_out, DType::Bf16, false)?;
                    let halves = if std::env::var_os(PASSES_ENV).is_some() {
                        let idx = inp.indices.to_i32_vec()?;
                        let mut v = Vec::new();
                        for upper in [false, true] {
                            let (rows, lens) = half_rows(&idx, s_q, topk, s_kv, upper);
                            v.push((
                                gpu.upload(&HostTensor::from_i32(rows, &[s_q, 1, topk])?)?,
                                gpu.upload(&HostTensor::from_i32(lens, &[s_q])?)?,
                            ));
                        }
                        v
                    } else {
                        Vec::new()
                    };
                    let gpu = gpu.clone();
                    Ok(Box::new(move || {
                        let options = SparseBwdOptions {
                            deterministic,
                            ..SparseBwdOptions::default()
                        };
                        let two_pass = !halves.is_empty()
                            && std::env::var(PASSES_ENV).map(|v| v == "2").unwrap_or(false);
                        if two_pass {
                            for (rows, lens) in &halves {
                                dev.run_indices(&gpu, &options, Some((rows, Some(lens))))?;
                            }
                            Ok(())
                        } else {
                            dev.run(&gpu, &options)
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
    use super::half_rows;

    #[test]
    fn half_rows_split_every_valid_entry_once_and_drop_invalid_ones() {
        // s_kv 10: rows [0, 5) are the lower half. Token 0 holds both halves, an out-of-range row and -1; token 1
        // only upper rows.
        let idx = [0, 7, 4, 10, 5, -1, 9, 8, 6, 5, 7, 9];
        let (lo, lo_len) = half_rows(&idx, 2, 6, 10, false);
        let (hi, hi_len) = half_rows(&idx, 2, 6, 10, true);
        assert_eq!(lo, [0, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]);
        assert_eq!(lo_len, [2, 0]);
        assert_eq!(hi, [7, 5, -1, -1, -1, -1, 9, 8, 6, 5, 7, 9]);
        assert_eq!(hi_len, [2, 6]);
    }
}
