//! The decode ops' CPU path at its limits (issue 27): a broadcast (stride-0) dense cache costs only the blocks
//! that are used, a cancelled call stops with `Interrupted`, and `topk_length` outside `[0, topk]` is clamped as
//! documented.

mod decode_support;

use decode_support::*;
use flashmla::fp8::KvFormat;
use flashmla::ops::decode::{
    decode_dense_cpu, decode_dense_cpu_with, decode_sparse_cpu, decode_sparse_cpu_with,
    DenseDecodeArgs, ExtraKvArgs, SparseDecodeArgs,
};
use flashmla::{CancelToken, Error, HostData, HostTensor, Layout};
use half::bf16;

const PAGE: usize = 16;
const D_QK: usize = 576;

fn bf16_data(v: &[f32]) -> HostData {
    HostData::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
}

/// A dense decode of 2 requests over one cache block of random keys, `[b=2, s_q=1, h_q=4]`.
struct Dense {
    q: HostTensor,
    block: Vec<f32>,
    seqlens: HostTensor,
}

impl Dense {
    fn new(seed: u64) -> Self {
        let mut rng = rng(seed);
        Dense {
            q: HostTensor::bf16_from_f32(
                &randn_bf16(&mut rng, 2 * 4 * D_QK, 0.1),
                &[2, 1, 4, D_QK],
            )
            .unwrap(),
            block: randn_bf16(&mut rng, PAGE * D_QK, -0.05),
            seqlens: HostTensor::from_i32(vec![40, 33], &[2]).unwrap(),
        }
    }

    fn args<'a>(
        &'a self,
        cache: &'a HostTensor,
        table: &'a HostTensor,
    ) -> DenseDecodeArgs<'a, HostTensor> {
        DenseDecodeArgs {
            q: &self.q,
            k_cache: cache,
            block_table: table,
            cache_seqlens: &self.seqlens,
            softmax_scale: None,
            causal: false,
            attn_sink: None,
        }
    }
}

/// `k_cache[:1].expand(2**40, 16, 1, 576)` with block ids up to `i32::MAX`: only the blocks the requests use
/// are read, and the result equals the same decode over the one real block.
#[test]
fn dense_decode_over_a_broadcast_cache_reads_only_the_used_blocks() {
    let d = Dense::new(2710);
    let num_blocks = 1usize << 40;
    let layout = Layout::strided(&[num_blocks, PAGE, 1, D_QK], &[0, D_QK, D_QK, 1]).unwrap();
    let big = HostTensor::with_layout(bf16_data(&d.block), layout).unwrap();
    // 40 and 33 keys: three blocks each; the fourth column is past every request's keys.
    let ids = [i32::MAX, 7, 1 << 30, -1, 0, 123_456, 1 << 20, i32::MAX];
    let big_table = HostTensor::from_i32(ids.to_vec(), &[2, 4]).unwrap();
    let small = HostTensor::bf16_from_f32(&d.block, &[1, PAGE, 1, D_QK]).unwrap();
    let small_table = HostTensor::from_i32(vec![0, 0, 0, -1, 0, 0, 0, 0], &[2, 4]).unwrap();
    let got = decode_dense_cpu(&d.args(&big, &big_table)).unwrap();
    let want = decode_dense_cpu(&d.args(&small, &small_table)).unwrap();
    assert_eq!(got, want);
}

#[test]
fn cancelled_decodes_return_interrupted() {
    let cancelled = CancelToken::new();
    cancelled.cancel();
    let d = Dense::new(2711);
    let cache = HostTensor::bf16_from_f32(&d.block, &[1, PAGE, 1, D_QK]).unwrap();
    let table = HostTensor::from_i32(vec![0, 0, 0, 0, 0, 0, 0, 0], &[2, 4]).unwrap();
    assert_eq!(
        decode_dense_cpu_with(&d.args(&cache, &table), &cancelled).unwrap_err(),
        Error::Interrupted
    );
    let s = SparseTensors::new(&case(2712, None));
    assert_eq!(
        decode_sparse_cpu_with(&s.args(None, None), &cancelled).unwrap_err(),
        Error::Interrupted
    );
}

fn case(seed: u64, topk_length: Option<Vec<i32>>) -> SparseCase {
    let main = SparseCacheSpec {
        format: KvFormat::V32,
        num_blocks: 3,
        page_size: PAGE,
        block_pad: 0,
        topk: 8,
        p_invalid: 0.1,
        topk_length,
    };
    let extra = SparseCacheSpec {
        num_blocks: 2,
        topk: 5,
        topk_length: None,
        ..main.clone()
    };
    sparse_case(&mut rng(seed), (4, 2, 4), &main, Some(&extra), true)
}

/// Host tensors of a sparse case (packed caches).
struct SparseTensors {
    q: HostTensor,
    cache: HostTensor,
    indices: HostTensor,
    extra_cache: HostTensor,
    extra_indices: HostTensor,
    sink: HostTensor,
    scale: f32,
}

impl SparseTensors {
    fn new(c: &SparseCase) -> Self {
        let cache = |k: &SparseCacheCase| {
            let l = k.layout;
            HostTensor::from_u8(
                k.packed.clone(),
                &[l.num_blocks, l.page_size, 1, l.format.bytes_per_token()],
            )
            .unwrap()
        };
        let extra = c.extra.as_ref().unwrap();
        SparseTensors {
            q: HostTensor::bf16_from_f32(&c.q, &[4, 2, 4, D_QK]).unwrap(),
            cache: cache(&c.kv),
            indices: HostTensor::from_i32(c.kv.indices.clone(), &[4, 2, c.kv.topk]).unwrap(),
            extra_cache: cache(extra),
            extra_indices: HostTensor::from_i32(extra.indices.clone(), &[4, 2, extra.topk])
                .unwrap(),
            sink: HostTensor::from_f32(c.sink.clone().unwrap(), &[4]).unwrap(),
            scale: c.p.softmax_scale,
        }
    }

    fn args<'a>(
        &'a self,
        lengths: Option<&'a HostTensor>,
        extra_lengths: Option<&'a HostTensor>,
    ) -> SparseDecodeArgs<'a, HostTensor> {
        SparseDecodeArgs {
            q: &self.q,
            k_cache: &self.cache,
            indices: &self.indices,
            topk_length: lengths,
            softmax_scale: Some(self.scale),
            attn_sink: Some(&self.sink),
            extra: Some(ExtraKvArgs {
                k_cache: &self.extra_cache,
                indices: &self.extra_indices,
                topk_length: extra_lengths,
            }),
        }
    }
}

/// Entries at positions `>= clamp(len[b], 0, topk)` of request `b`'s rows replaced by -1.
fn mask(indices: &[i32], lengths: &[i32], s_q: usize, topk: usize) -> Vec<i32> {
    indices
        .chunks(topk)
        .enumerate()
        .flat_map(|(row, r)| {
            let keep = lengths[row / s_q].clamp(0, topk as i32) as usize;
            r.iter()
                .enumerate()
                .map(move |(j, &v)| if j < keep { v } else { -1 })
        })
        .collect()
}

/// `topk_length` and `extra_topk_length` outside `[0, topk]` are clamped: above `topk` every entry is used,
/// below 0 none, exactly as if the ignored entries were -1 and no lengths were given.
#[test]
fn sparse_decode_clamps_topk_length_to_zero_through_topk() {
    let c = case(2713, None);
    let t = SparseTensors::new(&c);
    let (len, extra_len) = ([9, i32::MAX, -2, i32::MIN], [-1, 5, 6, 0]);
    let len_t = HostTensor::from_i32(len.to_vec(), &[4]).unwrap();
    let extra_len_t = HostTensor::from_i32(extra_len.to_vec(), &[4]).unwrap();
    let got = decode_sparse_cpu(&t.args(Some(&len_t), Some(&extra_len_t))).unwrap();

    let extra = c.extra.as_ref().unwrap();
    let masked = SparseTensors {
        indices: HostTensor::from_i32(mask(&c.kv.indices, &len, 2, 8), &[4, 2, 8]).unwrap(),
        extra_indices: HostTensor::from_i32(mask(&extra.indices, &extra_len, 2, 5), &[4, 2, 5])
            .unwrap(),
        ..SparseTensors::new(&c)
    };
    let want = decode_sparse_cpu(&masked.args(None, None)).unwrap();
    assert_eq!(got, want);
    // Request 3 uses nothing of either cache (i32::MIN and 0): lse +inf, out 0.
    let lse = got.lse.to_f32_vec().unwrap();
    assert!(
        lse[3 * 4 * 2..].iter().all(|&l| l == f32::INFINITY),
        "{lse:?}"
    );
}
