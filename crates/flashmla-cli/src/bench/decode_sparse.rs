//! Sparse FP8 decode over a paged cache (the whole step: schedule, dequantising split, combine), at the peer's own
//! decode performance shapes (`s_q = 2`) and `h_q = 16`. FLOP = 2 * h_q * attended * (d_qk + d_v) over the valid
//! entries each query row attends (main and extra caches); bytes = every distinct cache row read once (656 or 584
//! bytes) + q + out + lse, as the peer's benchmark counts them. Indices are distinct random tokens of each
//! request's own range of the cache (requests of `s_k` tokens); the workspace is allocated once, outside the timed
//! calls, as a server (or a CUDA graph) would.

use super::{Bench, BenchSuite, Record};
use flashmla::fp8::KvFormat;
use flashmla::ops::decode::{
    decode_sparse_cuda, launch::sparse_workspace_words, validate_sparse, DecodeOptions,
    DecodeOutput, ExtraKvArgs, SparseDecodeArgs,
};
use flashmla::reference::kv_quant::{quantize_cache, CacheLayout};
use flashmla::testing::{peer_bf16, rng};
use flashmla::{DType, HostData, HostTensor};
use rand::rngs::StdRng;
use rand::seq::index::sample;

const D_V: usize = 512;

/// One cache of a timed shape: requests of `s_k` tokens each, `topk` indices per query token.
#[derive(Clone, Debug)]
struct CacheShape {
    s_k: usize,
    topk: usize,
    page: usize,
}

/// One timed shape.
#[derive(Clone, Debug)]
struct Shape {
    batch: usize,
    s_q: usize,
    h_q: usize,
    format: KvFormat,
    main: CacheShape,
    extra: Option<CacheShape>,
}

fn shapes(suite: BenchSuite) -> Vec<Shape> {
    let v32 = |batch: usize, s_q: usize, h_q: usize| Shape {
        batch,
        s_q,
        h_q,
        format: KvFormat::V32,
        main: CacheShape {
            s_k: 32768,
            topk: 2048,
            page: 64,
        },
        extra: None,
    };
    let model1 = |batch: usize, h_q: usize, extra_topk: usize, extra_page: usize| Shape {
        batch,
        s_q: 2,
        h_q,
        format: KvFormat::Model1,
        main: CacheShape {
            s_k: 16384,
            topk: 128,
            page: 256,
        },
        extra: Some(CacheShape {
            s_k: 16384,
            topk: extra_topk,
            page: extra_page,
        }),
    };
    match suite {
        BenchSuite::Small => vec![
            Shape {
                main: CacheShape {
                    s_k: 4096,
                    topk: 512,
                    page: 64,
                },
                ..v32(8, 2, 128)
            },
            model1(8, 64, 512, 64),
        ],
        BenchSuite::Standard | BenchSuite::Sweep => {
            let mut v = Vec::new();
            for b in [2usize, 64, 128] {
                v.push(v32(b, 2, 128));
            }
            for b in [64usize, 128] {
                v.push(model1(b, 64, 512, 64));
                v.push(model1(b, 128, 1024, 2));
            }
            // Tensor parallelism: 128 heads over 8 GPUs (16 each) or 4 (32 each), no padding; and s_q 1.
            v.push(v32(128, 1, 16));
            v.push(v32(128, 2, 16));
            v.push(v32(128, 1, 32));
            v.push(model1(128, 16, 512, 64));
            v.push(model1(128, 32, 512, 64));
            v.push(v32(128, 2, 64));
            v
        }
    }
}

/// Requests of `s_k` tokens laid out one after another in a paged cache; `[b, s_q, topk]` distinct random tokens of
/// the request's own range per query token. Returns the packed cache, its layout and the indices.
fn cache(
    r: &mut StdRng,
    format: KvFormat,
    c: &CacheShape,
    batch: usize,
    s_q: usize,
) -> flashmla::Result<(Vec<u8>, CacheLayout, Vec<i32>)> {
    let tokens = batch * c.s_k;
    let layout = CacheLayout::packed(format, tokens.div_ceil(c.page), c.page);
    // Quantise a pattern of 64 pages and repeat it: the speed does not depend on the values; building multi-GB
    // caches by repetition keeps the setup to seconds.
    let pattern_tokens = (64 * c.page).min(layout.num_tokens());
    let pattern_layout = CacheLayout::packed(format, pattern_tokens / c.page, c.page);
    let kv = peer_bf16(r, pattern_tokens * format.d_qk());
    let pattern = quantize_cache(&pattern_layout, &kv)?;
    let bytes: Vec<u8> = pattern
        .iter()
        .copied()
        .cycle()
        .take(layout.total_bytes())
        .collect();
    let mut idx = Vec::with_capacity(batch * s_q * c.topk);
    for b in 0..batch {
        for _ in 0..s_q {
            idx.extend(
                sample(r, c.s_k, c.topk.min(c.s_k))
                    .into_iter()
                    .map(|t| (b * c.s_k + t) as i32),
            );
            idx.extend(std::iter::repeat_n(-1, c.topk.saturating_sub(c.s_k)));
        }
    }
    Ok((bytes, layout, idx))
}

/// The sparse decode shapes (docs/benchmarking.md).
pub fn benches(suite: BenchSuite) -> Vec<Bench> {
    shapes(suite)
        .into_iter()
        .map(|s| {
            let d_qk = s.format.d_qk();
            let bpt = s.format.bytes_per_token();
            let rows = s.batch * s.s_q;
            let keys = s.main.topk + s.extra.as_ref().map_or(0, |e| e.topk);
            let flop = 2.0 * (rows * s.h_q * keys) as f64 * (d_qk + D_V) as f64;
            // Distinct rows: each query token's entries are distinct; tokens of one request may share rows, so
            // this counts an upper bound of s_q * topk rows per request (the peer's count, as in its benchmark).
            let bytes =
                (rows * keys * bpt + rows * s.h_q * (d_qk + D_V) * 2 + rows * s.h_q * 4) as f64;
            let record = Record {
                op: "decode_sparse".into(),
                b: Some(s.batch),
                s_q: Some(s.s_q),
                s_kv: Some(s.main.s_k),
                topk: Some(keys),
                h_q: Some(s.h_q),
                d_qk: Some(d_qk),
                d_v: Some(D_V),
                indices: Some("random".into()),
                format: Some(s.format.name().to_string()),
                page_size: Some(s.main.page),
                dtype: Some("bf16".into()),
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

fn upload_cache(
    gpu: &flashmla::cuda::Gpu,
    bytes: Vec<u8>,
    layout: &CacheLayout,
) -> flashmla::Result<flashmla::cuda::DeviceTensor> {
    let bpt = layout.format.bytes_per_token();
    gpu.upload(&HostTensor::new(
        HostData::U8(bytes),
        &[layout.num_blocks, layout.page_size, 1, bpt],
    )?)
}

fn setup(gpu: &flashmla::cuda::Gpu, s: &Shape) -> flashmla::Result<super::Timed> {
    let mut r = rng(12);
    let d_qk = s.format.d_qk();
    let (bytes, layout, idx) = cache(&mut r, s.format, &s.main, s.batch, s.s_q)?;
    let main = upload_cache(gpu, bytes, &layout)?;
    let main_idx = gpu.upload(&HostTensor::from_i32(idx, &[s.batch, s.s_q, s.main.topk])?)?;
    let extra = match &s.extra {
        Some(e) => {
            let (bytes, layout, idx) = cache(&mut r, s.format, e, s.batch, s.s_q)?;
            Some((
                upload_cache(gpu, bytes, &layout)?,
                gpu.upload(&HostTensor::from_i32(idx, &[s.batch, s.s_q, e.topk])?)?,
            ))
        }
        None => None,
    };
    let q = gpu.upload(&HostTensor::bf16_from_f32(
        &peer_bf16(&mut r, s.batch * s.s_q * s.h_q * d_qk),
        &[s.batch, s.s_q, s.h_q, d_qk],
    )?)?;
    let out = gpu.alloc(DType::Bf16, &[s.batch, s.s_q, s.h_q, D_V])?;
    let lse = gpu.alloc(DType::F32, &[s.batch, s.h_q, s.s_q])?;
    let options = DecodeOptions::default();
    let views = (
        q.view(),
        main.view(),
        main_idx.view(),
        extra.as_ref().map(|(c, i)| (c.view(), i.view())),
    );
    let dims = validate_sparse(&SparseDecodeArgs {
        q: &views.0,
        k_cache: &views.1,
        indices: &views.2,
        topk_length: None,
        softmax_scale: None,
        attn_sink: None,
        extra: views.3.as_ref().map(|(c, i)| ExtraKvArgs {
            k_cache: c,
            indices: i,
            topk_length: None,
        }),
    })?;
    let ws = gpu.alloc(
        DType::F32,
        &[sparse_workspace_words(
            &dims,
            &options,
            gpu.info().sm_count as usize,
        )?],
    )?;
    let gpu = gpu.clone();
    Ok(Box::new(move |_tuning| {
        // The tensors live in the closure: main, extra, out, lse, ws.
        let _keep = (&main, &main_idx, &extra, &q);
        decode_sparse_cuda(
            &gpu,
            &SparseDecodeArgs {
                q: &views.0,
                k_cache: &views.1,
                indices: &views.2,
                topk_length: None,
                softmax_scale: None,
                attn_sink: None,
                extra: views.3.as_ref().map(|(c, i)| ExtraKvArgs {
                    k_cache: c,
                    indices: i,
                    topk_length: None,
                }),
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
