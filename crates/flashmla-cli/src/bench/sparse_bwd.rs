//! Sparse prefill backward on the standard shapes (docs/benchmarking.md): FLOP = 2 * s_q * topk * h_q *
//! (3 * d_qk + 2 * d_v) (recompute S, then dP, dV, dQ, dK). The timed call is the whole op (workspace zeroing,
//! delta, main kernel, cast, sink gradient); the record carries the op's extra device memory.

use super::sparse_fwd::{pattern_name, patterns, shapes};
use super::{Bench, BenchSuite, IndexChoice, Record, Timed};
use crate::device_ops::SparseBwdOnGpu;
use crate::tuning::Tuning;
use flashmla::cuda::Gpu;
use flashmla::ops::sparse_bwd::SparseBwdOptions;
use flashmla::ops::sparse_fwd::D_V;
use flashmla::testing::{peer_bf16, rng, SparseCase};
use flashmla::{DType, HostTensor};

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
                setup: Box::new(move |gpu, variants| {
                    let mut case = SparseCase::plain(s_q, s_kv, h_q, d_qk, topk);
                    case.pattern = pattern;
                    setup(gpu, &case, deterministic, variants)
                }),
            });
        }
    }
    v
}

/// Uploads a problem, runs the forward for `out` and `lse`, and returns the call to time (`variants`:
/// the launch choices it will be called with, which the bench experiments look at).
#[cfg_attr(not(feature = "experiments"), allow(unused_variables))]
fn setup(
    gpu: &Gpu,
    case: &SparseCase,
    deterministic: bool,
    variants: &[Tuning],
) -> flashmla::Result<Timed> {
    let inp = case.generate(0x5eed)?;
    let (s_q, h_q) = (case.s_q, case.h_q);
    let d_out = peer_bf16(&mut rng(0xd0), s_q * h_q * D_V);
    let d_out = HostTensor::bf16_from_f32(&d_out, &[s_q, h_q, D_V])?;
    let dev = SparseBwdOnGpu::new(gpu, &inp, &d_out, DType::Bf16, false)?;
    #[cfg(feature = "experiments")]
    let passes = super::experiments::BwdPassRuns::prepare(gpu, &inp, variants)?;
    let gpu = gpu.clone();
    let options = move |t: &Tuning| SparseBwdOptions {
        deterministic,
        tuning: t.bwd,
        ..SparseBwdOptions::default()
    };
    #[cfg(feature = "experiments")]
    let timed: Timed = Box::new(move |t| passes.run(&dev, &gpu, &options(t), t));
    #[cfg(not(feature = "experiments"))]
    let timed: Timed = Box::new(move |t| dev.run(&gpu, &options(t)));
    Ok(timed)
}
