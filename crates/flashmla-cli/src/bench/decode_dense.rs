//! Dense decode over a paged cache (the whole step: schedule, split, combine). FLOP = 2 * b * s_q * h_q * keys *
//! (d_qk + d_v) over the keys each query row attends (causal rows fewer); bytes = q + every distinct key row read
//! once (h_kv * d_qk * 2 per token) + out + lse. Caches are larger than the L2 at the standard shapes; the
//! workspace is allocated once, outside the timed calls, as a server (or a CUDA graph) would.

use super::{Bench, BenchSuite, Record};
use flashmla::ops::decode::{
    decode_dense_cuda, launch::dense_workspace_words, validate_dense, DecodeOptions, DecodeOutput,
    DenseDecodeArgs,
};
use flashmla::testing::{peer_bf16, rng};
use flashmla::{DType, HostData, HostTensor};
use rand::seq::SliceRandom;

const D_QK: usize = 576;
const D_V: usize = 512;

/// One timed shape.
#[derive(Clone, Debug)]
struct Shape {
    batch: usize,
    s_q: usize,
    h_q: usize,
    seqlens: Vec<usize>,
    causal: bool,
    page: usize,
    dtype: DType,
    label: &'static str,
}

fn shapes(suite: BenchSuite) -> Vec<Shape> {
    let mut v = Vec::new();
    let uniform = |b: usize, s_q: usize, h_q: usize, s_k: usize, causal: bool| Shape {
        batch: b,
        s_q,
        h_q,
        seqlens: vec![s_k; b],
        causal,
        page: 64,
        dtype: DType::Bf16,
        label: "uniform",
    };
    match suite {
        BenchSuite::Small => {
            v.push(uniform(8, 1, 128, 1024, false));
            v.push(uniform(8, 2, 64, 1024, true));
        }
        BenchSuite::Standard | BenchSuite::Sweep => {
            for h_q in [16usize, 64, 128] {
                for s_q in [1usize, 2] {
                    for s_k in [4096usize, 16384, 32768] {
                        for causal in [false, true] {
                            if s_q == 1 && causal {
                                continue; // causal has no effect with one query token
                            }
                            v.push(uniform(128, s_q, h_q, s_k, causal));
                        }
                    }
                }
            }
            // One request of 131072 keys among 127 of 1024, at every head count and with two query tokens.
            let mut skew = vec![1024usize; 128];
            skew[0] = 131072;
            for (s_q, h_q) in [(1usize, 16usize), (1, 64), (1, 128), (2, 16)] {
                v.push(Shape {
                    seqlens: skew.clone(),
                    label: "skewed",
                    ..uniform(128, s_q, h_q, 0, false)
                });
            }
            // A lone request: its split over the SMs against its partials.
            v.push(uniform(1, 1, 128, 4096, false));
            v.push(uniform(1, 1, 64, 131072, false));
            // What the peer has no kernel for: other page sizes, s_q up to 16, f16.
            v.push(Shape {
                page: 16,
                ..uniform(128, 1, 128, 4096, false)
            });
            v.push(uniform(32, 16, 128, 4096, true));
            v.push(Shape {
                dtype: DType::F16,
                ..uniform(128, 2, 128, 4096, true)
            });
        }
    }
    v
}

/// Keys row `(b, i)` of a request attends.
fn attended(s: &Shape) -> f64 {
    s.seqlens
        .iter()
        .map(|&n| {
            (0..s.s_q)
                .map(|i| {
                    if s.causal && s.s_q > 1 {
                        (n + i + 1).saturating_sub(s.s_q).min(n)
                    } else {
                        n
                    }
                })
                .sum::<usize>() as f64
        })
        .sum()
}

fn tensor(values: &[f32], shape: &[usize], dtype: DType) -> flashmla::Result<HostTensor> {
    match dtype {
        DType::F16 => HostTensor::new(
            HostData::F16(values.iter().map(|&v| half::f16::from_f32(v)).collect()),
            shape,
        ),
        _ => HostTensor::bf16_from_f32(values, shape),
    }
}

/// The dense decode shapes (docs/benchmarking.md).
pub fn benches(suite: BenchSuite) -> Vec<Bench> {
    shapes(suite)
        .into_iter()
        .map(|s| {
            let keys: usize = s.seqlens.iter().sum();
            let flop = 2.0 * s.h_q as f64 * attended(&s) * (D_QK + D_V) as f64;
            let bytes = (keys * D_QK * 2
                + s.batch * s.s_q * s.h_q * (D_QK + D_V) * 2
                + s.batch * s.s_q * s.h_q * 4) as f64;
            let uniform = s.label == "uniform";
            let record = Record {
                op: "decode_dense".into(),
                b: Some(s.batch),
                s_q: Some(s.s_q),
                s_kv: uniform.then_some(s.seqlens[0]),
                h_q: Some(s.h_q),
                d_qk: Some(D_QK),
                d_v: Some(D_V),
                causal: Some(s.causal),
                page_size: Some(s.page),
                seqlens: (!uniform).then(|| s.label.to_string()),
                dtype: Some(s.dtype.to_string()),
                ..Record::default()
            };
            Bench {
                record,
                flop,
                bytes,
                setup: Box::new(move |gpu, _variants| setup(gpu, &s)),
            }
        })
        .collect()
}

fn setup(gpu: &flashmla::cuda::Gpu, s: &Shape) -> flashmla::Result<super::Timed> {
    let mut r = rng(11);
    let blocks_of: Vec<usize> = s.seqlens.iter().map(|&n| n.div_ceil(s.page)).collect();
    let num_blocks: usize = blocks_of.iter().sum();
    let max_blocks = blocks_of.iter().copied().max().unwrap_or(1).max(1);
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(&mut r);
    let mut table = vec![0i32; s.batch * max_blocks];
    let mut next = 0;
    for (b, &n) in blocks_of.iter().enumerate() {
        for j in 0..n {
            table[b * max_blocks + j] = ids[next];
            next += 1;
        }
    }
    // The cache repeats a pattern of 64 random blocks (the kernel's speed does not depend on the values, only on
    // their not being zero); building it by repetition keeps the setup of multi-GB caches to seconds.
    let block_elems = s.page * D_QK;
    let pattern = peer_bf16(&mut r, 64 * block_elems);
    let n = num_blocks * block_elems;
    let data = match s.dtype {
        DType::F16 => {
            let p: Vec<half::f16> = pattern.iter().map(|&v| half::f16::from_f32(v)).collect();
            HostData::F16(p.iter().copied().cycle().take(n).collect())
        }
        _ => {
            let p: Vec<half::bf16> = pattern.iter().map(|&v| half::bf16::from_f32(v)).collect();
            HostData::Bf16(p.iter().copied().cycle().take(n).collect())
        }
    };
    let cache = gpu.upload(&HostTensor::new(data, &[num_blocks, s.page, 1, D_QK])?)?;
    let q = gpu.upload(&tensor(
        &peer_bf16(&mut r, s.batch * s.s_q * s.h_q * D_QK),
        &[s.batch, s.s_q, s.h_q, D_QK],
        s.dtype,
    )?)?;
    let bt = gpu.upload(&HostTensor::from_i32(table, &[s.batch, max_blocks])?)?;
    let sl = gpu.upload(&HostTensor::from_i32(
        s.seqlens.iter().map(|&n| n as i32).collect(),
        &[s.batch],
    )?)?;
    let out = gpu.alloc(s.dtype, &[s.batch, s.s_q, s.h_q, D_V])?;
    let lse = gpu.alloc(DType::F32, &[s.batch, s.h_q, s.s_q])?;
    let options = DecodeOptions::default();
    let dims = validate_dense(&DenseDecodeArgs {
        q: &q.view(),
        k_cache: &cache.view(),
        block_table: &bt.view(),
        cache_seqlens: &sl.view(),
        softmax_scale: None,
        causal: s.causal,
        attn_sink: None,
    })?;
    let ws = gpu.alloc(
        DType::F32,
        &[dense_workspace_words(
            &dims,
            &options,
            gpu.info().sm_count as usize,
        )?],
    )?;
    let gpu = gpu.clone();
    let causal = s.causal;
    Ok(Box::new(move |_tuning| {
        decode_dense_cuda(
            &gpu,
            &DenseDecodeArgs {
                q: &q.view(),
                k_cache: &cache.view(),
                block_table: &bt.view(),
                cache_seqlens: &sl.view(),
                softmax_scale: None,
                causal,
                attn_sink: None,
            },
            &DecodeOutput {
                out: out.view(),
                lse: lse.view(),
            },
            &options,
            Some(&ws.view()),
        )
    }))
}
