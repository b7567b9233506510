//! Sparse prefill forward on the PERF.md shapes. FLOP = 2 * s_q * topk * h_q * (d_qk + d_v).

use super::{Bench, BenchSuite, IndexChoice, Record};
use flashmla::ops::sparse_fwd::{sparse_fwd_cuda, SparseFwdArgs, SparseFwdOutput, D_V};
use flashmla::testing::{IndexPattern, SparseCase};
use flashmla::DType;

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
    }
}

/// Index patterns chosen on the command line.
pub fn patterns(choice: IndexChoice) -> Vec<IndexPattern> {
    match choice {
        IndexChoice::Random => vec![IndexPattern::Random],
        IndexChoice::Local => vec![IndexPattern::Local],
        IndexChoice::Both => vec![IndexPattern::Random, IndexPattern::Local],
    }
}

/// The forward benchmarks.
pub fn benches(suite: BenchSuite, choice: IndexChoice) -> Vec<Bench> {
    let mut v = Vec::new();
    for (s_q, s_kv, h_q, d_qk, topk) in shapes(suite) {
        for pattern in patterns(choice) {
            let name = if pattern == IndexPattern::Random { "random" } else { "local" };
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
                    let q = gpu.upload(&inp.q)?;
                    let kv = gpu.upload(&inp.kv)?;
                    let idx = gpu.upload(&inp.indices)?;
                    let out = gpu.alloc(DType::Bf16, &[s_q, h_q, D_V])?;
                    let max_logits = gpu.alloc(DType::F32, &[s_q, h_q])?;
                    let lse = gpu.alloc(DType::F32, &[s_q, h_q])?;
                    let gpu = gpu.clone();
                    let sm_scale = inp.sm_scale;
                    Ok(Box::new(move || {
                        let (vq, vkv, vidx) = (q.view(), kv.view(), idx.view());
                        let args = SparseFwdArgs {
                            q: &vq,
                            kv: &vkv,
                            indices: &vidx,
                            sm_scale,
                            attn_sink: None,
                            topk_length: None,
                        };
                        let outs = SparseFwdOutput {
                            out: out.view(),
                            max_logits: max_logits.view(),
                            lse: lse.view(),
                        };
                        sparse_fwd_cuda(&gpu, &args, &outs)
                    }))
                }),
            });
        }
    }
    v
}
