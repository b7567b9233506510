//! Sparse FP8 decode over a paged cache (the whole step: schedule, dequantising split, combine), at the peer's own
//! decode performance shapes (`s_q = 2`: V3.2, MODEL1 configurations 1, 3 and 4, the peak cases) and the
//! tensor-parallel head counts 16 and 32. FLOP = 2 * h_q * attended * (d_qk + d_v) over the valid entries each query
//! row attends (main and extra caches, within `extra_topk_length` where given); bytes = every distinct cache row read
//! once (656 or 584 bytes) + q + out + lse, as the peer's benchmark counts them. Indices are distinct random tokens
//! of each request's own range of the cache (requests of `s_k` tokens); every call passes a sink. As in
//! `bench/side_by_side.py`, small shapes rotate input sets (q, indices, lengths) so that the sets together select at
//! least [`ROTATED_BYTES`] of cache rows and no call finds the previous call's rows in the L2; the workspace is
//! allocated once, outside the timed calls, as a server (or a CUDA graph) would.

use super::{Bench, BenchSuite, Record};
use flashmla::cuda::{DeviceTensor, Gpu};
use flashmla::fp8::KvFormat;
use flashmla::ops::decode::{
    decode_sparse_cuda, launch::sparse_workspace_words, validate_sparse, DecodeOptions,
    DecodeOutput, ExtraKvArgs, SparseDecodeArgs,
};
use flashmla::reference::kv_quant::{quantize_cache, CacheLayout};
use flashmla::testing::{peer_bf16, rng};
use flashmla::{DType, DeviceView, HostData, HostTensor};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::seq::SliceRandom;

const D_V: usize = 512;

/// Bytes of cache rows the input sets of one shape select together at least: three L2s of an H200 (60 MB).
const ROTATED_BYTES: usize = 180_000_000;

/// Most input sets rotated.
const MAX_SETS: usize = 16;

/// One cache of a timed shape: requests of `s_k` tokens each, `topk` indices per query token.
#[derive(Clone, Debug)]
struct CacheShape {
    s_k: usize,
    topk: usize,
    page: usize,
    /// A `[b]` topk length: the requests' lengths spread evenly over `0..=topk` (mean `topk / 2`), in a random
    /// order per input set.
    with_length: bool,
}

impl CacheShape {
    /// Valid entries per request and query token, per request (the same multiset for every input set).
    fn lengths(&self, batch: usize) -> Vec<usize> {
        let valid = self.topk.min(self.s_k);
        (0..batch)
            .map(|j| {
                if self.with_length {
                    (j * (self.topk + 1) / batch).min(valid)
                } else {
                    valid
                }
            })
            .collect()
    }
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

impl Shape {
    /// Query-row entries attended per call, main and extra caches (each row's entries are distinct).
    fn attended(&self) -> usize {
        let scope = |c: &CacheShape| self.s_q * c.lengths(self.batch).iter().sum::<usize>();
        scope(&self.main) + self.extra.as_ref().map_or(0, scope)
    }

    /// Input sets to rotate: enough that together they select [`ROTATED_BYTES`] of rows, at most [`MAX_SETS`].
    fn input_sets(&self) -> usize {
        let rows = self.attended() * self.format.bytes_per_token();
        ROTATED_BYTES.div_ceil(rows.max(1)).clamp(1, MAX_SETS)
    }
}

fn shapes(suite: BenchSuite) -> Vec<Shape> {
    let cache = |s_k: usize, topk: usize, page: usize| CacheShape {
        s_k,
        topk,
        page,
        with_length: false,
    };
    let v32 = |batch: usize, s_q: usize, h_q: usize| Shape {
        batch,
        s_q,
        h_q,
        format: KvFormat::V32,
        main: cache(32768, 2048, 64),
        extra: None,
    };
    // The peer's MODEL1 configurations: 1 (h_q 64, extra topk 512 in pages of 64), 3 and 4 (h_q 64 and 128, extra
    // topk 1024 in pages of 2, with extra_topk_length).
    let model1 = |batch: usize, h_q: usize, extra_topk: usize, extra_page: usize| Shape {
        batch,
        s_q: 2,
        h_q,
        format: KvFormat::Model1,
        main: cache(16384, 128, 256),
        extra: Some(CacheShape {
            with_length: extra_page == 2,
            ..cache(16384, extra_topk, extra_page)
        }),
    };
    let peak = |h_q: usize, format: KvFormat| Shape {
        batch: 148,
        format,
        main: cache(32768, 16384, 64),
        ..v32(148, 2, h_q)
    };
    match suite {
        BenchSuite::Small => vec![
            Shape {
                main: cache(4096, 512, 64),
                ..v32(8, 2, 128)
            },
            model1(8, 64, 512, 64),
        ],
        BenchSuite::Sweep => {
            // Time against tiles per chunk (every part takes whole requests): the slope is a tile's cost, the
            // intercept a chunk's and the step's fixed cost.
            let mut v = Vec::new();
            for (h_q, format) in [
                (64usize, KvFormat::V32),
                (128, KvFormat::V32),
                (64, KvFormat::Model1),
            ] {
                for topk in [256usize, 512, 1024, 2048, 4096, 8192] {
                    v.push(Shape {
                        format,
                        main: cache(32768, topk, 64),
                        ..v32(128, 2, h_q)
                    });
                }
            }
            // The same 64 tiles a part at V3.2 h_q 64 in 1, 2, 4 and 8 whole requests (requests of 8K tokens): the
            // difference is a chunk's cost.
            for (b, topk) in [(64usize, 4096usize), (128, 2048), (256, 1024), (512, 512)] {
                v.push(Shape {
                    main: cache(8192, topk, 64),
                    ..v32(b, 2, 64)
                });
            }
            v
        }
        BenchSuite::Standard => {
            let mut v = Vec::new();
            for b in [2usize, 64, 128] {
                v.push(v32(b, 2, 128));
            }
            for b in [64usize, 128] {
                v.push(model1(b, 64, 512, 64));
                v.push(model1(b, 128, 1024, 2));
            }
            v.push(model1(128, 64, 1024, 2));
            for h_q in [64usize, 128] {
                v.push(peak(h_q, KvFormat::V32));
                v.push(peak(h_q, KvFormat::Model1));
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

/// Requests of `s_k` tokens laid out one after another in a paged cache. Returns the packed cache and its layout.
fn cache(
    r: &mut StdRng,
    format: KvFormat,
    c: &CacheShape,
    batch: usize,
) -> flashmla::Result<(Vec<u8>, CacheLayout)> {
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
    Ok((bytes, layout))
}

/// `[b, s_q, topk]` distinct random tokens of the request's own range per query token (-1 past `s_k`).
fn indices(r: &mut StdRng, c: &CacheShape, batch: usize, s_q: usize) -> Vec<i32> {
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
    idx
}

/// The sparse decode shapes (docs/benchmarking.md).
pub fn benches(suite: BenchSuite) -> Vec<Bench> {
    shapes(suite)
        .into_iter()
        .map(|s| {
            let d_qk = s.format.d_qk();
            let rows = s.batch * s.s_q;
            let attended = s.attended();
            let flop = 2.0 * (s.h_q * attended) as f64 * (d_qk + D_V) as f64;
            // Distinct rows: each query token's entries are distinct; tokens of one request may share rows, so
            // this counts an upper bound of s_q * topk rows per request (the peer's count, as in its benchmark).
            let bytes = (attended * s.format.bytes_per_token()
                + rows * s.h_q * (d_qk + D_V) * 2
                + rows * s.h_q * 4) as f64;
            let sets = s.input_sets();
            let record = Record {
                op: "decode_sparse".into(),
                b: Some(s.batch),
                s_q: Some(s.s_q),
                s_kv: Some(s.main.s_k),
                topk: Some(s.main.topk + s.extra.as_ref().map_or(0, |e| e.topk)),
                h_q: Some(s.h_q),
                d_qk: Some(d_qk),
                d_v: Some(D_V),
                indices: Some("random".into()),
                format: Some(s.format.name().to_string()),
                page_size: Some(s.main.page),
                dtype: Some("bf16".into()),
                input_sets: (sets > 1).then_some(sets),
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

fn upload_cache(gpu: &Gpu, bytes: Vec<u8>, layout: &CacheLayout) -> flashmla::Result<DeviceTensor> {
    let bpt = layout.format.bytes_per_token();
    gpu.upload(&HostTensor::new(
        HostData::U8(bytes),
        &[layout.num_blocks, layout.page_size, 1, bpt],
    )?)
}

/// One input set's tensors: q, the main indices, and the extra cache's indices and lengths.
struct InputSet {
    q: DeviceTensor,
    main_idx: DeviceTensor,
    extra_idx: Option<DeviceTensor>,
    extra_len: Option<DeviceTensor>,
}

fn input_set(gpu: &Gpu, r: &mut StdRng, s: &Shape) -> flashmla::Result<InputSet> {
    let d_qk = s.format.d_qk();
    let q = gpu.upload(&HostTensor::bf16_from_f32(
        &peer_bf16(r, s.batch * s.s_q * s.h_q * d_qk),
        &[s.batch, s.s_q, s.h_q, d_qk],
    )?)?;
    let idx = indices(r, &s.main, s.batch, s.s_q);
    let main_idx = gpu.upload(&HostTensor::from_i32(idx, &[s.batch, s.s_q, s.main.topk])?)?;
    let (mut extra_idx, mut extra_len) = (None, None);
    if let Some(e) = &s.extra {
        let idx = indices(r, e, s.batch, s.s_q);
        extra_idx = Some(gpu.upload(&HostTensor::from_i32(idx, &[s.batch, s.s_q, e.topk])?)?);
        if e.with_length {
            let mut lengths: Vec<i32> = e.lengths(s.batch).into_iter().map(|l| l as i32).collect();
            lengths.shuffle(r);
            extra_len = Some(gpu.upload(&HostTensor::from_i32(lengths, &[s.batch])?)?);
        }
    }
    Ok(InputSet {
        q,
        main_idx,
        extra_idx,
        extra_len,
    })
}

/// Views of one input set's tensors.
struct SetViews {
    q: DeviceView,
    main_idx: DeviceView,
    extra_idx: Option<DeviceView>,
    extra_len: Option<DeviceView>,
}

/// Views of every tensor the timed calls read.
struct CallViews {
    main: DeviceView,
    extra: Option<DeviceView>,
    sink: DeviceView,
    sets: Vec<SetViews>,
}

impl CallViews {
    /// The arguments of a call on input set `i`.
    fn args(&self, i: usize) -> SparseDecodeArgs<'_, DeviceView> {
        let set = &self.sets[i];
        SparseDecodeArgs {
            q: &set.q,
            k_cache: &self.main,
            indices: &set.main_idx,
            topk_length: None,
            softmax_scale: None,
            attn_sink: Some(&self.sink),
            extra: self
                .extra
                .as_ref()
                .zip(set.extra_idx.as_ref())
                .map(|(k_cache, indices)| ExtraKvArgs {
                    k_cache,
                    indices,
                    topk_length: set.extra_len.as_ref(),
                }),
        }
    }
}

fn setup(gpu: &Gpu, s: &Shape) -> flashmla::Result<super::Timed> {
    let mut r = rng(12);
    let (bytes, layout) = cache(&mut r, s.format, &s.main, s.batch)?;
    let main = upload_cache(gpu, bytes, &layout)?;
    let extra = match &s.extra {
        Some(e) => {
            let (bytes, layout) = cache(&mut r, s.format, e, s.batch)?;
            Some(upload_cache(gpu, bytes, &layout)?)
        }
        None => None,
    };
    let sets = (0..s.input_sets())
        .map(|_| input_set(gpu, &mut r, s))
        .collect::<flashmla::Result<Vec<_>>>()?;
    let sink: Vec<f32> = peer_bf16(&mut r, s.h_q);
    let sink = gpu.upload(&HostTensor::from_f32(sink, &[s.h_q])?)?;
    let out = gpu.alloc(DType::Bf16, &[s.batch, s.s_q, s.h_q, D_V])?;
    let lse = gpu.alloc(DType::F32, &[s.batch, s.h_q, s.s_q])?;
    let options = DecodeOptions::default();
    let views = CallViews {
        main: main.view(),
        extra: extra.as_ref().map(|c| c.view()),
        sink: sink.view(),
        sets: sets
            .iter()
            .map(|set| SetViews {
                q: set.q.view(),
                main_idx: set.main_idx.view(),
                extra_idx: set.extra_idx.as_ref().map(|t| t.view()),
                extra_len: set.extra_len.as_ref().map(|t| t.view()),
            })
            .collect(),
    };
    let dims = validate_sparse(&views.args(0))?;
    let ws = gpu.alloc(
        DType::F32,
        &[sparse_workspace_words(
            &dims,
            &options,
            gpu.info().sm_count as usize,
        )?],
    )?;
    let gpu = gpu.clone();
    let mut next = 0;
    Ok(Box::new(move |_tuning| {
        // The tensors live in the closure: main, extra, the sets, sink, out, lse, ws.
        let _keep = (&main, &extra, &sets, &sink);
        let i = next;
        next = (next + 1) % views.sets.len();
        decode_sparse_cuda(
            &gpu,
            &views.args(i),
            &DecodeOutput {
                out: out.view(),
                lse: lse.view(),
            },
            &options,
            Some(&ws.view()),
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::{shapes, CacheShape, MAX_SETS, ROTATED_BYTES};
    use crate::bench::BenchSuite;

    #[test]
    fn topk_lengths_spread_over_the_whole_range() {
        let c = CacheShape {
            s_k: 16384,
            topk: 1024,
            page: 2,
            with_length: true,
        };
        let l = c.lengths(128);
        assert_eq!((l[0], l[127]), (0, 1016));
        let mean = l.iter().sum::<usize>() as f64 / 128.0;
        assert!((mean - 512.0).abs() < 8.0, "{mean}");
        let all = CacheShape {
            with_length: false,
            ..c
        };
        assert!(all.lengths(4).iter().all(|&x| x == 1024));
    }

    #[test]
    fn small_shapes_rotate_sets_past_the_l2() {
        for s in shapes(BenchSuite::Standard) {
            let rows = s.attended() * s.format.bytes_per_token();
            let sets = s.input_sets();
            assert!(
                sets == MAX_SETS || sets * rows >= ROTATED_BYTES,
                "{s:?}: {sets} sets of {rows} bytes"
            );
            assert!(sets == 1 || (sets - 1) * rows < ROTATED_BYTES, "{s:?}");
        }
    }
}
