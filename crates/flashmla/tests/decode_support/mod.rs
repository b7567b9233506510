//! Shared helpers of the decode tests: seeded generators of adversarial dense and sparse cases, a naive
//! f64 formulation of decode (keys gathered explicitly per request, then a plain softmax) and the spec
//! section 6 comparison.
#![allow(dead_code)]

use flashmla::fp8::KvFormat;
use flashmla::reference::decode::{
    DenseDecodeInputs, DenseDecodeProblem, SparseDecodeInputs, SparseDecodeProblem, SparseKv,
};
use flashmla::reference::kv_quant::{dequantize_cache, quantize_cache, CacheLayout};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// The invalid index values docs/spec.md section 6 draws from (`s_kv` is replaced by the cache's token count).
pub const INVALID_INDICES: [i32; 7] =
    [i32::MIN, -123456, -1, 114514, 1919810, 2147480000, i32::MAX];

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `randn / 10 + offset`, rounded to bf16 (the spec section 6 generator).
pub fn randn_bf16(rng: &mut StdRng, n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|_| round_bf16(rng.sample::<f32, _>(StandardNormal) / 10.0 + offset))
        .collect()
}

/// docs/spec.md section 6 tolerances.
#[derive(Debug, Clone, Copy)]
pub struct Tol {
    pub abs: f64,
    pub rel: f64,
    pub cos: Option<f64>,
}

pub const DECODE_OUT: Tol = Tol {
    abs: 1e-3,
    rel: 2.01 / 128.0,
    cos: Some(5e-6),
};
pub const DECODE_LSE: Tol = Tol {
    abs: 1e-6,
    rel: 8.01 / 65536.0,
    cos: None,
};
/// For f64-vs-f64 comparisons that differ only in summation order.
pub const F64_EXACT: Tol = Tol {
    abs: 1e-13,
    rel: 1e-12,
    cos: None,
};

/// Every element passes `|a-r| < abs || |a-r|/(|r|+1e-6) < rel`, non-finite positions match exactly, and the
/// cosine difference is under `cos`.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: Tol, seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: length (seed {seed})");
    for (k, (&a, &r)) in got.iter().zip(want).enumerate() {
        if !r.is_finite() || !a.is_finite() {
            let same = (a.is_nan() && r.is_nan()) || a == r;
            assert!(same, "{what}[{k}]: got {a}, want {r} (seed {seed})");
            continue;
        }
        let d = (a - r).abs();
        assert!(
            d < tol.abs || d / (r.abs() + 1e-6) < tol.rel,
            "{what}[{k}]: got {a}, want {r}, diff {d} (seed {seed})"
        );
    }
    if let Some(cos) = tol.cos {
        let (mut ar, mut aa) = (0.0f64, 0.0f64);
        for (&a, &r) in got.iter().zip(want) {
            if a.is_finite() && r.is_finite() {
                ar += a * r;
                aa += a * a + r * r;
            }
        }
        let diff = if aa == 0.0 { 0.0 } else { 1.0 - 2.0 * ar / aa };
        assert!(diff < cos, "{what}: cos_diff {diff} >= {cos} (seed {seed})");
    }
}

pub fn widen<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

/// Naive softmax over explicit (logit, value row) pairs with an optional sink, in f64.
/// Returns `(out [d_v], lse)`; no key gives `(0, +inf)`.
pub fn naive_softmax(
    logits: &[f64],
    values: &[&[f32]],
    d_v: usize,
    sink: Option<f64>,
) -> (Vec<f64>, f64) {
    let mut out = vec![0.0; d_v];
    if logits.is_empty() {
        return (out, f64::INFINITY);
    }
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + logits.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
    // lse' = log(exp(lse) + exp(sink)); a +inf sink takes all the weight (its value vector is zero).
    let lse_eff = match sink {
        None => lse,
        Some(s) if s == f64::INFINITY => return (out, lse),
        Some(s) if s == f64::NEG_INFINITY => lse,
        Some(s) => {
            let big = lse.max(s);
            big + ((lse - big).exp() + (s - big).exp()).ln()
        }
    };
    for (s, v) in logits.iter().zip(values) {
        let p = (s - lse_eff).exp();
        for c in 0..d_v {
            out[c] += p * v[c] as f64;
        }
    }
    (out, lse)
}

fn dot(q: &[f32], k: &[f32]) -> f64 {
    q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum()
}

#[allow(unused_imports)] // not every test file that includes this module draws dense cases
pub use flashmla::testing::{dense_case, DenseCase, DenseSpec};

/// Naive dense decode in f64: per request, gather its keys through the block table (a key whose block id is
/// out of range does not exist), then a plain softmax per row. Returns `(out [b,s_q,h_q,d_v], lse [b,h_q,s_q])`.
pub fn naive_dense(p: &DenseDecodeProblem, x: &DenseDecodeInputs<'_>) -> (Vec<f64>, Vec<f64>) {
    let (b_n, s_q, h_q, d, d_v) = (p.batch, p.s_q, p.h_q, p.d_qk, p.d_v);
    let mut out = vec![0.0; b_n * s_q * h_q * d_v];
    let mut lse = vec![0.0; b_n * h_q * s_q];
    for b in 0..b_n {
        let s_k = x.cache_seqlens[b].max(0) as usize;
        // keys[pos] = row offset of (block, slot) for kv head 0, when the block exists.
        let keys: Vec<Option<usize>> = (0..s_k)
            .map(|pos| {
                let blk = x.block_table[b * p.max_blocks + pos / p.page_size];
                (blk >= 0 && (blk as usize) < p.num_blocks)
                    .then(|| (blk as usize * p.page_size + pos % p.page_size) * p.h_kv * d)
            })
            .collect();
        for i in 0..s_q {
            let limit = if p.causal && s_q > 1 {
                s_k as i64 - s_q as i64 + i as i64 + 1
            } else {
                s_k as i64
            };
            for h in 0..h_q {
                let g = h / (h_q / p.h_kv);
                let qr = &x.q[((b * s_q + i) * h_q + h) * d..][..d];
                let mut logits = Vec::new();
                let mut values = Vec::new();
                for (pos, key) in keys.iter().enumerate() {
                    if let (Some(at), true) = (key, (pos as i64) < limit) {
                        let k = &x.k_cache[at + g * d..][..d];
                        logits.push(p.softmax_scale as f64 * dot(qr, k));
                        values.push(k);
                    }
                }
                let sink = x.attn_sink.map(|s| s[h] as f64);
                let (o, l) = naive_softmax(&logits, &values, d_v, sink);
                out[((b * s_q + i) * h_q + h) * d_v..][..d_v].copy_from_slice(&o);
                lse[(b * h_q + h) * s_q + i] = l;
            }
        }
    }
    (out, lse)
}

/// One generated FP8 cache with its indices.
#[derive(Debug, Clone)]
pub struct SparseCacheCase {
    /// The layout as the decode sees it (block stride possibly padded).
    pub layout: CacheLayout,
    /// Cache bytes in `layout` (the last block's padding left out); dead tokens hold 0xFF (NaN everywhere).
    pub bytes: Vec<u8>,
    /// The packed cache (no padding), for `dequantize_cache`.
    pub packed: Vec<u8>,
    pub indices: Vec<i32>,
    pub topk: usize,
    pub topk_length: Option<Vec<i32>>,
}

impl SparseCacheCase {
    pub fn kv(&self) -> SparseKv<'_> {
        SparseKv {
            layout: self.layout,
            cache: &self.bytes,
            indices: &self.indices,
            topk: self.topk,
            topk_length: self.topk_length.as_deref(),
        }
    }
    /// Dequantised tokens of the packed copy, `[num_tokens, d_qk]` (dead tokens are NaN).
    pub fn dequantized(&self) -> Vec<f32> {
        let packed = CacheLayout::packed(
            self.layout.format,
            self.layout.num_blocks,
            self.layout.page_size,
        );
        dequantize_cache(&packed, &self.packed).expect("packed cache")
    }
}

/// What to generate for one sparse cache.
#[derive(Debug, Clone)]
pub struct SparseCacheSpec {
    pub format: KvFormat,
    pub num_blocks: usize,
    pub page_size: usize,
    /// Extra bytes between blocks.
    pub block_pad: usize,
    pub topk: usize,
    /// Probability that an index entry is invalid.
    pub p_invalid: f64,
    pub topk_length: Option<Vec<i32>>,
}

/// Marks token `t` of a packed cache dead: every byte it owns becomes 0xFF (NaN values, NaN scales).
fn poison(format: KvFormat, cache: &mut [u8], page: usize, t: usize) {
    let block = &mut cache[(t / page) * page * format.bytes_per_token()..]
        [..page * format.bytes_per_token()];
    let slot = t % page;
    match format {
        KvFormat::V32 => block[format.nope_offset(slot)..][..format.bytes_per_token()].fill(0xFF),
        KvFormat::Model1 => {
            block[format.nope_offset(slot)..][..format.value_bytes()].fill(0xFF);
            block[format.scale_offset(slot, page)..][..format.scale_record_bytes()].fill(0xFF);
        }
    }
}

pub fn sparse_cache_case(
    rng: &mut StdRng,
    spec: &SparseCacheSpec,
    batch: usize,
    s_q: usize,
) -> SparseCacheCase {
    let f = spec.format;
    let packed_layout = CacheLayout::packed(f, spec.num_blocks, spec.page_size);
    let n_tok = packed_layout.num_tokens();
    let offset = rng.random_range(-0.2f32..0.2);
    let kv = randn_bf16(rng, n_tok * f.d_qk(), offset);
    let mut packed = quantize_cache(&packed_layout, &kv).expect("quantise");
    // About a third of the tokens are dead (never referenced): NaN in every byte.
    let live: Vec<usize> = (0..n_tok).filter(|_| rng.random_bool(0.67)).collect();
    let live = if live.is_empty() { vec![0] } else { live };
    for t in (0..n_tok).filter(|t| !live.contains(t)) {
        poison(f, &mut packed, spec.page_size, t);
    }
    let block_bytes = spec.page_size * f.bytes_per_token();
    let stride = block_bytes + spec.block_pad;
    let span = (spec.num_blocks - 1) * stride + block_bytes;
    let mut bytes = vec![0xFFu8; span];
    for b in 0..spec.num_blocks {
        bytes[b * stride..][..block_bytes]
            .copy_from_slice(&packed[b * block_bytes..][..block_bytes]);
    }
    let invalid = |rng: &mut StdRng| -> i32 {
        match rng.random_range(0..INVALID_INDICES.len() + 1) {
            k if k == INVALID_INDICES.len() => n_tok as i32, // s_kv itself
            k => INVALID_INDICES[k],
        }
    };
    let mut indices = Vec::with_capacity(batch * s_q * spec.topk);
    for _ in 0..batch * s_q * spec.topk {
        let v = if rng.random_bool(spec.p_invalid) {
            invalid(rng)
        } else {
            live[rng.random_range(0..live.len())] as i32
        };
        indices.push(v);
    }
    SparseCacheCase {
        layout: CacheLayout {
            format: f,
            num_blocks: spec.num_blocks,
            page_size: spec.page_size,
            block_stride: stride,
        },
        bytes,
        packed,
        indices,
        topk: spec.topk,
        topk_length: spec.topk_length.clone(),
    }
}

/// A sparse case: query, main cache, optional extra cache and sink.
#[derive(Debug, Clone)]
pub struct SparseCase {
    pub p: SparseDecodeProblem,
    pub q: Vec<f32>,
    pub kv: SparseCacheCase,
    pub extra: Option<SparseCacheCase>,
    pub sink: Option<Vec<f32>>,
}

impl SparseCase {
    pub fn inputs(&self) -> SparseDecodeInputs<'_> {
        SparseDecodeInputs {
            q: &self.q,
            kv: self.kv.kv(),
            extra: self.extra.as_ref().map(|e| e.kv()),
            attn_sink: self.sink.as_deref(),
        }
    }
}

pub fn sparse_case(
    rng: &mut StdRng,
    (batch, s_q, h_q): (usize, usize, usize),
    main: &SparseCacheSpec,
    extra: Option<&SparseCacheSpec>,
    sink: bool,
) -> SparseCase {
    let d_qk = main.format.d_qk();
    let kv = sparse_cache_case(rng, main, batch, s_q);
    let extra = extra.map(|e| sparse_cache_case(rng, e, batch, s_q));
    let offset = rng.random_range(-0.2f32..0.2);
    let q = randn_bf16(rng, batch * s_q * h_q * d_qk, offset);
    let sink = sink.then(|| {
        (0..h_q)
            .map(|_| rng.sample::<f32, _>(StandardNormal))
            .collect()
    });
    SparseCase {
        p: SparseDecodeProblem {
            batch,
            s_q,
            h_q,
            d_v: 512,
            softmax_scale: (d_qk as f32).sqrt().recip(),
        },
        q,
        kv,
        extra,
        sink,
    }
}

/// Naive sparse decode in f64 over `dequantize_cache`: per row, the valid entries among the first
/// `clamp(topk_length, 0, topk)` of each cache, then a plain softmax.
pub fn naive_sparse(c: &SparseCase) -> (Vec<f64>, Vec<f64>) {
    let p = &c.p;
    let d = c.kv.layout.format.d_qk();
    let caches: Vec<(&SparseCacheCase, Vec<f32>)> = std::iter::once(&c.kv)
        .chain(c.extra.as_ref())
        .map(|k| (k, k.dequantized()))
        .collect();
    let mut out = vec![0.0; p.batch * p.s_q * p.h_q * p.d_v];
    let mut lse = vec![0.0; p.batch * p.h_q * p.s_q];
    for b in 0..p.batch {
        for i in 0..p.s_q {
            let row = b * p.s_q + i;
            let mut keys: Vec<&[f32]> = Vec::new();
            for (k, deq) in &caches {
                let n = match &k.topk_length {
                    Some(t) => (t[b].max(0) as usize).min(k.topk),
                    None => k.topk,
                };
                for &idx in &k.indices[row * k.topk..][..n] {
                    if idx >= 0 && (idx as usize) < k.layout.num_tokens() {
                        keys.push(&deq[idx as usize * d..][..d]);
                    }
                }
            }
            for h in 0..p.h_q {
                let qr = &c.q[(row * p.h_q + h) * d..][..d];
                let logits: Vec<f64> = keys
                    .iter()
                    .map(|k| p.softmax_scale as f64 * dot(qr, k))
                    .collect();
                let sink = c.sink.as_ref().map(|s| s[h] as f64);
                let (o, l) = naive_softmax(&logits, &keys, p.d_v, sink);
                out[(row * p.h_q + h) * p.d_v..][..p.d_v].copy_from_slice(&o);
                lse[(b * p.h_q + h) * p.s_q + i] = l;
            }
        }
    }
    (out, lse)
}
