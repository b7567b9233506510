//! Shared helpers of the decode tests: seeded generators of adversarial dense and sparse cases, a naive
//! f64 formulation of decode (keys gathered explicitly per request, then a plain softmax) and the spec
//! section 6 comparison.
#![allow(dead_code)]

use flashmla::reference::decode::{DenseDecodeInputs, DenseDecodeProblem};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

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

#[allow(unused_imports)]
pub use flashmla::testing::{
    sparse_decode_case as sparse_case, SparseCacheCase, SparseCacheSpec,
    SparseDecodeCase as SparseCase, INVALID_INDICES,
};

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
