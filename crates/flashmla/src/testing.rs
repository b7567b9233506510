//! Input generators shared by the tests, the CLI's `check`, `bench` and `demo`: the peer's adversarial data
//! (docs/spec.md section 6) in one place, seeded so every failure can be replayed.

use crate::error::Result;
use crate::fp8::KvFormat;
use crate::reference::decode::{
    DenseDecodeInputs, DenseDecodeProblem, SparseDecodeInputs, SparseDecodeProblem, SparseKv,
};
use crate::reference::kv_quant::{dequantize_cache, quantize_cache, CacheLayout};
use crate::tensor::{HostTensor, TensorMeta};
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// Invalid index values the kernels must survive (docs/spec.md section 6): never dereferenced, whatever they are.
pub const INVALID_INDEX_VALUES: [i64; 8] = [
    i32::MIN as i64,
    -123456,
    -1,
    -2, // placeholder for `s_kv`, substituted by [`invalid_index`]
    114514,
    1919810,
    2147480000,
    i32::MAX as i64,
];

/// The `k`-th adversarial invalid index for a KV tensor of `s_kv` rows (`k` wraps around).
pub fn invalid_index(k: usize, s_kv: usize) -> i32 {
    let v = INVALID_INDEX_VALUES[k % INVALID_INDEX_VALUES.len()];
    let v = if v == -2 { s_kv as i64 } else { v };
    // Values that happen to be valid for a huge s_kv are moved out of range.
    if v >= 0 && (v as u64) < s_kv as u64 {
        i32::MAX
    } else {
        v.clamp(i32::MIN as i64, i32::MAX as i64) as i32
    }
}

/// A seeded generator.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Values per independently seeded block of [`randn_map`].
const RANDN_BLOCK: usize = 1 << 16;

/// `n` standard normal draws `z`, each mapped by `f`, drawn on all cores: block `i` of [`RANDN_BLOCK`] values comes
/// from its own generator, seeded from one draw of `rng` and `i`, so the values depend on the seed alone (not on the
/// thread count). The benchmarks' inputs (hundreds of millions of values) took tens of seconds on one core.
fn randn_map<T: Copy + Default + Send>(
    rng: &mut StdRng,
    n: usize,
    f: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let base: u64 = rng.random();
    let mut out = vec![T::default(); n];
    out.par_chunks_mut(RANDN_BLOCK)
        .enumerate()
        .for_each(|(i, block)| {
            let mut r =
                StdRng::seed_from_u64(base ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for x in block {
                *x = f(StandardNormal.sample(&mut r));
            }
        });
    out
}

/// `n` values `randn * std + offset`, rounded to bf16 (returned as f32 holding bf16 values).
pub fn randn_bf16(rng: &mut StdRng, n: usize, std: f32, offset: f32) -> Vec<f32> {
    randn_map(rng, n, |z| bf16::from_f32(z * std + offset).to_f32())
}

/// The peer's input distribution: `randn / 10` plus a random per-tensor offset in [-0.05, 0.05].
pub fn peer_bf16(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let offset = rng.random_range(-0.05f32..0.05);
    randn_bf16(rng, n, 0.1, offset)
}

/// How the selected KV rows of each query token are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexPattern {
    /// Distinct random rows of `[0, s_kv)` (with repeats only when `topk > s_kv`).
    Random,
    /// 31 of 32 indices in the last 20000 rows (closer to real attention, kinder to L2).
    Local,
    /// Every token selects among the same few rows (the first [`HOT_ROWS`]): heavy reuse of each KV row, the
    /// worst case for the backward's `d_kv` reduction.
    Hot,
    /// Random rows where about a quarter of the entries repeat an earlier entry of the same row (a multiset).
    Duplicates,
    /// Distinct random rows of a window of [`WINDOW_ROWS`] rows that slides from the first rows to the last ones as
    /// the token goes from 0 to `s_q - 1`: the tokens that run at the same time select from almost the same rows,
    /// so a kernel's KV and `d_kv` working set stays small whatever `s_kv` is (a benchmark aid: the best any
    /// KV-row reordering of random indices could give).
    Window,
}

/// Rows of the sliding window of [`IndexPattern::Window`].
pub const WINDOW_ROWS: usize = 8192;

/// Rows shared by every token under [`IndexPattern::Hot`].
pub const HOT_ROWS: usize = 96;

/// Index rows `[s_q, topk]` following `pattern`; a fraction `invalid_frac` of entries is replaced by
/// adversarial invalid values, and every `empty_every`-th token (if non-zero) gets only invalid entries.
pub fn sparse_indices(
    rng: &mut StdRng,
    s_q: usize,
    s_kv: usize,
    topk: usize,
    pattern: IndexPattern,
    invalid_frac: f64,
    empty_every: usize,
) -> Vec<i32> {
    let mut idx = vec![0i32; s_q * topk];
    let local_lo = s_kv.saturating_sub(20000);
    for t in 0..s_q {
        let row = &mut idx[t * topk..(t + 1) * topk];
        match pattern {
            IndexPattern::Random => fill_distinct(rng, row, 0, s_kv),
            IndexPattern::Local => {
                fill_distinct(rng, row, local_lo, s_kv);
                for (j, v) in row.iter_mut().enumerate() {
                    if j % 32 == 31 && s_kv > 0 {
                        *v = rng.random_range(0..s_kv) as i32;
                    }
                }
            }
            IndexPattern::Hot => fill_distinct(rng, row, 0, s_kv.min(HOT_ROWS)),
            IndexPattern::Window => {
                let w = s_kv.min(WINDOW_ROWS);
                let lo = (s_kv - w) * t / s_q.saturating_sub(1).max(1);
                fill_distinct(rng, row, lo, lo + w)
            }
            IndexPattern::Duplicates => {
                fill_distinct(rng, row, 0, s_kv);
                for j in 1..row.len() {
                    if rng.random_bool(0.25) {
                        row[j] = row[rng.random_range(0..j)];
                    }
                }
            }
        }
        let empty = empty_every > 0 && t % empty_every == empty_every - 1;
        for (j, v) in row.iter_mut().enumerate() {
            if empty || s_kv == 0 || (invalid_frac > 0.0 && rng.random_bool(invalid_frac.min(1.0)))
            {
                *v = invalid_index(t + j, s_kv);
            }
        }
    }
    idx
}

/// Fills `row` with distinct values of `[lo, hi)` when the range is large enough, random ones otherwise.
fn fill_distinct(rng: &mut StdRng, row: &mut [i32], lo: usize, hi: usize) {
    let n = hi.saturating_sub(lo);
    if n == 0 {
        return;
    }
    if row.len() * 2 <= n {
        // Rejection sampling against a small open-addressing set: O(topk) per row.
        let cap = (row.len() * 4).next_power_of_two();
        let mut seen = vec![u32::MAX; cap];
        let mut k = 0;
        while k < row.len() {
            let v = rng.random_range(lo..hi) as u32;
            let mut h = (v.wrapping_mul(0x9E37_79B9) as usize) & (cap - 1);
            loop {
                if seen[h] == u32::MAX {
                    seen[h] = v;
                    row[k] = v as i32;
                    k += 1;
                    break;
                }
                if seen[h] == v {
                    break;
                }
                h = (h + 1) & (cap - 1);
            }
        }
    } else if row.len() <= n {
        // Dense case: partial Fisher-Yates over the range.
        let mut all: Vec<i32> = (lo..hi).map(|v| v as i32).collect();
        for k in 0..row.len() {
            let j = rng.random_range(k..n);
            all.swap(k, j);
            row[k] = all[k];
        }
    } else {
        for v in row.iter_mut() {
            *v = rng.random_range(lo..hi) as i32;
        }
    }
}

/// The attention-sink variants of the test grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SinkKind {
    /// No sink tensor.
    None,
    /// Random finite sinks.
    Random,
    /// Mixed finite, `+inf` and `-inf` entries.
    Infinite,
}

/// One sparse-prefill problem of the test grid (docs/spec.md section 6).
#[derive(Debug, Clone, PartialEq)]
pub struct SparseCase {
    /// Query tokens.
    pub s_q: usize,
    /// KV rows.
    pub s_kv: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width (512 or 576).
    pub d_qk: usize,
    /// Selected rows per token.
    pub topk: usize,
    /// Sink variant.
    pub sink: SinkKind,
    /// Whether a `topk_length` tensor is passed (with some zeros).
    pub topk_length: bool,
    /// Fraction of invalid entries.
    pub invalid_frac: f64,
    /// Every `empty_every`-th token has no valid entry (0: none).
    pub empty_every: usize,
    /// Fill KV rows that no index references with NaN.
    pub nan_unreferenced: bool,
    /// Index pattern.
    pub pattern: IndexPattern,
}

impl SparseCase {
    /// A plain case: no sink, no `topk_length`, no invalid entries, random indices.
    pub fn plain(s_q: usize, s_kv: usize, h_q: usize, d_qk: usize, topk: usize) -> Self {
        SparseCase {
            s_q,
            s_kv,
            h_q,
            d_qk,
            topk,
            sink: SinkKind::None,
            topk_length: false,
            invalid_frac: 0.0,
            empty_every: 0,
            nan_unreferenced: false,
            pattern: IndexPattern::Random,
        }
    }
}

/// Host inputs of a sparse-prefill problem, in spec shapes and dtypes.
#[derive(Debug, Clone)]
pub struct SparseInputs {
    /// `[s_q, h_q, d_qk]` bf16.
    pub q: HostTensor,
    /// `[s_kv, 1, d_qk]` bf16.
    pub kv: HostTensor,
    /// `[s_q, 1, topk]` i32.
    pub indices: HostTensor,
    /// `[h_q]` f32.
    pub attn_sink: Option<HostTensor>,
    /// `[s_q]` i32.
    pub topk_length: Option<HostTensor>,
    /// Softmax scale (`d_qk^-0.5`).
    pub sm_scale: f32,
}

impl SparseCase {
    /// Generates the inputs of this case from `seed`.
    pub fn generate(&self, seed: u64) -> Result<SparseInputs> {
        let mut r = rng(seed);
        let q = peer_bf16(&mut r, self.s_q * self.h_q * self.d_qk);
        let mut kv = peer_bf16(&mut r, self.s_kv * self.d_qk);
        let idx = sparse_indices(
            &mut r,
            self.s_q,
            self.s_kv,
            self.topk,
            self.pattern,
            self.invalid_frac,
            self.empty_every,
        );
        let topk_length = self.topk_length.then(|| {
            (0..self.s_q)
                .map(|t| match t % 5 {
                    0 => 0,
                    1 => self.topk as i32,
                    _ => r.random_range(0..=self.topk) as i32,
                })
                .collect::<Vec<i32>>()
        });
        if self.nan_unreferenced {
            let mut used = vec![false; self.s_kv];
            for t in 0..self.s_q {
                let len = topk_length
                    .as_ref()
                    .map_or(self.topk, |l| l[t].max(0) as usize);
                for &i in &idx[t * self.topk..t * self.topk + len.min(self.topk)] {
                    if i >= 0 && (i as usize) < self.s_kv {
                        used[i as usize] = true;
                    }
                }
            }
            for (row, &u) in used.iter().enumerate() {
                if !u {
                    kv[row * self.d_qk..(row + 1) * self.d_qk].fill(f32::NAN);
                }
            }
        }
        let attn_sink = match self.sink {
            SinkKind::None => None,
            SinkKind::Random => Some(
                (0..self.h_q)
                    .map(|_| r.random_range(-2.0f32..6.0))
                    .collect(),
            ),
            SinkKind::Infinite => Some(
                (0..self.h_q)
                    .map(|h| match h % 3 {
                        0 => f32::INFINITY,
                        1 => f32::NEG_INFINITY,
                        _ => r.random_range(-2.0f32..6.0),
                    })
                    .collect::<Vec<f32>>(),
            ),
        };
        Ok(SparseInputs {
            q: HostTensor::bf16_from_f32(&q, &[self.s_q, self.h_q, self.d_qk])?,
            kv: HostTensor::bf16_from_f32(&kv, &[self.s_kv, 1, self.d_qk])?,
            indices: HostTensor::from_i32(idx, &[self.s_q, 1, self.topk])?,
            attn_sink: attn_sink
                .map(|s| HostTensor::from_f32(s, &[self.h_q]))
                .transpose()?,
            topk_length: topk_length
                .map(|l| HostTensor::from_i32(l, &[self.s_q]))
                .transpose()?,
            sm_scale: (self.d_qk as f32).powf(-0.5),
        })
    }
}

/// The values of [`SparseInputs`] as contiguous vectors, ready for the CPU reference.
#[derive(Debug, Clone)]
pub struct SparseValues {
    /// Query tokens.
    pub s_q: usize,
    /// KV rows.
    pub s_kv: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Index entries per token.
    pub topk: usize,
    /// `[s_q, h_q, d_qk]`.
    pub q: Vec<f32>,
    /// `[s_kv, d_qk]`.
    pub kv: Vec<f32>,
    /// `[s_q, topk]`.
    pub indices: Vec<i32>,
    /// `[h_q]`.
    pub attn_sink: Option<Vec<f32>>,
    /// `[s_q]`.
    pub topk_length: Option<Vec<i32>>,
    /// Softmax scale.
    pub sm_scale: f32,
}

impl SparseInputs {
    /// Gathers the tensors into contiguous vectors (works for strided inputs too).
    pub fn values(&self) -> Result<SparseValues> {
        let (qs, ks, is) = (self.q.shape(), self.kv.shape(), self.indices.shape());
        Ok(SparseValues {
            s_q: qs[0],
            s_kv: ks[0],
            h_q: qs[1],
            d_qk: qs[2],
            topk: is[2],
            q: self.q.to_f32_vec()?,
            kv: self.kv.to_f32_vec()?,
            indices: self.indices.to_i32_vec()?,
            attn_sink: self
                .attn_sink
                .as_ref()
                .map(|t| t.to_f32_vec())
                .transpose()?,
            topk_length: self
                .topk_length
                .as_ref()
                .map(|t| t.to_i32_vec())
                .transpose()?,
            sm_scale: self.sm_scale,
        })
    }

    /// The same inputs, every tensor made non-contiguous as docs/spec.md section 6 asks: the last dimension padded by
    /// 128 elements and every other dimension by 1, then sliced back.
    pub fn padded(&self) -> Result<SparseInputs> {
        fn pad(t: &HostTensor) -> Result<HostTensor> {
            let rank = t.shape().len();
            let p: Vec<usize> = (0..rank)
                .map(|d| if d + 1 == rank { 128 } else { 1 })
                .collect();
            t.to_padded(&p)
        }
        Ok(SparseInputs {
            q: pad(&self.q)?,
            kv: pad(&self.kv)?,
            indices: pad(&self.indices)?,
            attn_sink: self.attn_sink.as_ref().map(pad).transpose()?,
            topk_length: self.topk_length.as_ref().map(pad).transpose()?,
            sm_scale: self.sm_scale,
        })
    }
}

impl SparseValues {
    /// The forward's outputs in the form the backward takes them, from the f64 reference: `out` rounded
    /// to bf16 (as the GPU forward stores it) and `lse` narrowed to f32.
    pub fn reference_fwd_outputs(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let f = crate::reference::sparse_fwd::sparse_fwd::<f64>(&self.problem())?;
        let out = f.out.iter().map(|&a| bf16::from_f64(a).to_f32()).collect();
        let lse = f.lse.iter().map(|&a| a as f32).collect();
        Ok((out, lse))
    }

    /// The reference problem over these values (`d_v` = 512).
    pub fn problem(&self) -> crate::reference::sparse_fwd::SparseFwdProblem<'_> {
        crate::reference::sparse_fwd::SparseFwdProblem {
            s_q: self.s_q,
            s_kv: self.s_kv,
            h_q: self.h_q,
            d_qk: self.d_qk,
            d_v: crate::ops::sparse_fwd::D_V,
            topk: self.topk,
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale: self.sm_scale,
            attn_sink: self.attn_sink.as_deref(),
            topk_length: self.topk_length.as_deref(),
        }
    }
}

fn normal(rng: &mut StdRng) -> f32 {
    rng.sample::<f32, _>(StandardNormal)
}

/// FP8 KV-cache token flavours (extremes the quantiser must survive); `token_values` picks one per token so every cache mixes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFlavour {
    /// `randn / 10 + offset` (docs/spec.md section 6).
    Plain,
    /// Each scale tile at its own magnitude, `10^-8 .. 10^8`.
    Magnitudes,
    /// Zeros, including -0.0.
    Zeros,
    /// bf16 subnormals and other tiny values (below the 1e-4 scale floor).
    Tiny,
    /// Near the bf16 maximum, next to ordinary values.
    Huge,
    /// NaN (both signs) and +-inf sprinkled among ordinary values.
    Specials,
    /// Values exactly halfway between e4m3 neighbours once scaled (tests round-to-nearest-even).
    Ties,
    /// Every value NaN.
    AllNan,
}

/// All flavours.
pub const KV_FLAVOURS: [KvFlavour; 8] = [
    KvFlavour::Plain,
    KvFlavour::Magnitudes,
    KvFlavour::Zeros,
    KvFlavour::Tiny,
    KvFlavour::Huge,
    KvFlavour::Specials,
    KvFlavour::Ties,
    KvFlavour::AllNan,
];

/// One token of `d_qk` bf16-exact values of the given flavour.
pub fn kv_token_values(format: KvFormat, flavour: KvFlavour, rng: &mut StdRng) -> Vec<f32> {
    let d = format.d_qk();
    let tile = format.tile();
    let offset = normal(rng);
    let mut x: Vec<f32> = match flavour {
        KvFlavour::Plain => (0..d).map(|_| normal(rng) / 10.0 + offset).collect(),
        KvFlavour::Magnitudes => {
            let mags: Vec<f32> = (0..=format.num_scales())
                .map(|_| 10f32.powf(rng.random_range(-8.0..8.0)))
                .collect();
            (0..d)
                .map(|i| normal(rng) * mags[(i / tile).min(format.num_scales())])
                .collect()
        }
        KvFlavour::Zeros => (0..d)
            .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
            .collect(),
        KvFlavour::Tiny => (0..d)
            .map(|i| match i % 4 {
                0 => f32::from_bits(rng.random_range(1u32..0x0080_0000)), // f32/bf16 subnormal
                1 => -f32::from_bits(rng.random_range(1u32..0x0080_0000)),
                2 => normal(rng) * 1e-30,
                _ => normal(rng) * 1e-6,
            })
            .collect(),
        KvFlavour::Huge => (0..d)
            .map(|i| match i % 5 {
                0 => 3.3e38 * if rng.random_bool(0.5) { 1.0 } else { -1.0 },
                1 => normal(rng) * 1e37,
                _ => normal(rng),
            })
            .collect(),
        KvFlavour::Specials => (0..d)
            .map(|_| match rng.random_range(0..16) {
                0 => f32::NAN,
                1 => -f32::NAN,
                2 => f32::INFINITY,
                3 => f32::NEG_INFINITY,
                _ => normal(rng) * 4.0,
            })
            .collect(),
        KvFlavour::Ties => {
            // A tile whose maximum is 448 * 2^k has scale exactly 2^k; its other values are midpoints between
            // neighbouring e4m3 values (normal and subnormal), times 2^k.
            let k = rng.random_range(-10i32..10);
            let s = 2f32.powi(k);
            (0..d)
                .map(|i| {
                    if i % tile == 0 {
                        return 448.0 * s;
                    }
                    let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                    let mid = if rng.random_bool(0.3) {
                        // subnormal midpoints: (2n + 1) * 2^-10
                        (2 * rng.random_range(0..8) + 1) as f32 / 1024.0
                    } else {
                        // normal midpoints: 2^e * (1 + (2m + 1) / 16)
                        let e = rng.random_range(-6i32..8);
                        2f32.powi(e) * (1.0 + (2 * rng.random_range(0..8) + 1) as f32 / 16.0)
                    };
                    sign * mid * s
                })
                .collect()
        }
        KvFlavour::AllNan => vec![f32::NAN; d],
    };
    for v in &mut x {
        *v = bf16::from_f32(*v).to_f32();
    }
    x
}

/// `num_tokens` tokens, flavours cycling through `FLAVOURS` with a seeded shuffle; returns values and flavours.
pub fn kv_cache_values(
    format: KvFormat,
    num_tokens: usize,
    seed: u64,
) -> (Vec<f32>, Vec<KvFlavour>) {
    let mut r = rng(seed);
    let mut values = Vec::with_capacity(num_tokens * format.d_qk());
    let mut flavours = Vec::with_capacity(num_tokens);
    for t in 0..num_tokens {
        // Mostly plain tokens, every flavour present in any cache of 16+ tokens.
        let f = if t % 2 == 0 {
            KV_FLAVOURS[(t / 2) % KV_FLAVOURS.len()]
        } else {
            KV_FLAVOURS[r.random_range(0..KV_FLAVOURS.len())]
        };
        values.extend(kv_token_values(format, f, &mut r));
        flavours.push(f);
    }
    (values, flavours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_indices_are_invalid_for_any_s_kv() {
        for s_kv in [
            0usize,
            1,
            95,
            114515,
            1919811,
            2147480001,
            i32::MAX as usize,
        ] {
            for k in 0..8 {
                let v = invalid_index(k, s_kv);
                assert!(v < 0 || v as usize >= s_kv, "k={k} s_kv={s_kv} v={v}");
            }
        }
    }

    #[test]
    fn random_indices_are_distinct_and_in_range() {
        let mut r = rng(7);
        for &(s_kv, topk) in &[(8192usize, 2048usize), (300, 100), (128, 128), (95, 128)] {
            let idx = sparse_indices(&mut r, 3, s_kv, topk, IndexPattern::Random, 0.0, 0);
            for row in idx.chunks(topk) {
                assert!(row.iter().all(|&v| v >= 0 && (v as usize) < s_kv));
                if topk <= s_kv {
                    let mut s = row.to_vec();
                    s.sort();
                    s.dedup();
                    assert_eq!(s.len(), topk, "s_kv={s_kv} topk={topk}");
                }
            }
        }
    }

    #[test]
    fn local_pattern_concentrates_on_the_tail() {
        let mut r = rng(3);
        let idx = sparse_indices(&mut r, 4, 100_000, 2048, IndexPattern::Local, 0.0, 0);
        let tail = idx.iter().filter(|&&v| v >= 80_000).count();
        assert!(tail as f64 >= 0.96 * idx.len() as f64 - 1.0);
    }

    #[test]
    fn window_indices_slide_with_the_token_and_stay_distinct() {
        let mut r = rng(11);
        let (s_q, s_kv, topk) = (5, 40_000, 1024);
        let idx = sparse_indices(&mut r, s_q, s_kv, topk, IndexPattern::Window, 0.0, 0);
        for (t, row) in idx.chunks(topk).enumerate() {
            let lo = (s_kv - WINDOW_ROWS) * t / (s_q - 1);
            assert!(row
                .iter()
                .all(|&v| (lo..lo + WINDOW_ROWS).contains(&(v as usize))));
            let mut sorted = row.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), topk, "token {t}: distinct rows");
        }
        // The last token's window ends at the last row; a KV tensor smaller than the window uses all of it.
        assert!(idx[(s_q - 1) * topk..]
            .iter()
            .any(|&v| v as usize >= s_kv - 512));
        let small = sparse_indices(&mut r, 3, 300, 200, IndexPattern::Window, 0.0, 0);
        assert!(small.iter().all(|&v| (0..300).contains(&v)));
    }

    #[test]
    fn empty_rows_and_invalid_fraction() {
        let mut r = rng(11);
        let idx = sparse_indices(&mut r, 8, 500, 64, IndexPattern::Random, 0.25, 4);
        for (t, row) in idx.chunks(64).enumerate() {
            let invalid = row.iter().filter(|&&v| !(0..500).contains(&v)).count();
            if t % 4 == 3 {
                assert_eq!(invalid, 64);
            } else {
                assert!(invalid < 64);
            }
        }
    }
}

/// What to generate for a dense case.
#[derive(Debug, Clone)]
pub struct DenseSpec {
    /// Requests.
    pub batch: usize,
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key heads.
    pub h_kv: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Value width.
    pub d_v: usize,
    /// Tokens per cache block.
    pub page_size: usize,
    /// `cache_seqlens`, one per request.
    pub seqlens: Vec<i32>,
    /// Bottom-right causal mask.
    pub causal: bool,
    /// Draw an `attn_sink`.
    pub sink: bool,
}

/// A dense case: paged cache with shuffled blocks, NaN in every slot no request owns (spare blocks and the
/// tails of partly used blocks), garbage block ids past each request's used blocks.
#[derive(Debug, Clone)]
pub struct DenseCase {
    /// The problem's dimensions.
    pub p: DenseDecodeProblem,
    /// `[b, s_q, h_q, d_qk]` (bf16 values).
    pub q: Vec<f32>,
    /// `[num_blocks, page_size, h_kv, d_qk]` (bf16 values; NaN where no request reads).
    pub k_cache: Vec<f32>,
    /// `[b, max_blocks]`.
    pub block_table: Vec<i32>,
    /// `[b]`.
    pub cache_seqlens: Vec<i32>,
    /// `[h_q]`, when drawn.
    pub sink: Option<Vec<f32>>,
}

impl DenseCase {
    /// The reference's view of the case.
    pub fn inputs(&self) -> DenseDecodeInputs<'_> {
        DenseDecodeInputs {
            q: &self.q,
            k_cache: &self.k_cache,
            block_table: &self.block_table,
            cache_seqlens: &self.cache_seqlens,
            attn_sink: self.sink.as_deref(),
        }
    }
}

/// Draws a dense decode case (`randn / 10` plus a per-tensor offset, rounded to bf16).
pub fn dense_case(rng: &mut StdRng, spec: &DenseSpec) -> DenseCase {
    let page = spec.page_size;
    let used: Vec<usize> = spec
        .seqlens
        .iter()
        .map(|&n| (n.max(0) as usize).div_ceil(page))
        .collect();
    let num_blocks = used.iter().sum::<usize>() + 2;
    let max_blocks = used.iter().copied().max().unwrap_or(0) + 1;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(rng);
    let garbage = [-1, i32::MAX, num_blocks as i32, i32::MIN];
    let mut block_table = Vec::with_capacity(spec.batch * max_blocks);
    let mut next = 0;
    for &u in &used {
        for j in 0..max_blocks {
            if j < u {
                block_table.push(ids[next]);
                next += 1;
            } else {
                block_table.push(garbage[j % garbage.len()]);
            }
        }
    }
    let row = spec.h_kv * spec.d_qk;
    let mut k_cache = vec![f32::NAN; num_blocks * page * row];
    let offset_k = rng.random_range(-0.2f32..0.2);
    for (b, &n) in spec.seqlens.iter().enumerate() {
        for pos in 0..n.max(0) as usize {
            let block = block_table[b * max_blocks + pos / page] as usize;
            let at = (block * page + pos % page) * row;
            k_cache[at..at + row].copy_from_slice(&randn_bf16(rng, row, 0.1, offset_k));
        }
    }
    let offset_q = rng.random_range(-0.2f32..0.2);
    let q = randn_bf16(
        rng,
        spec.batch * spec.s_q * spec.h_q * spec.d_qk,
        0.1,
        offset_q,
    );
    let sink = spec.sink.then(|| {
        (0..spec.h_q)
            .map(|_| rng.sample::<f32, _>(StandardNormal))
            .collect()
    });
    DenseCase {
        p: DenseDecodeProblem {
            batch: spec.batch,
            s_q: spec.s_q,
            h_q: spec.h_q,
            h_kv: spec.h_kv,
            d_qk: spec.d_qk,
            d_v: spec.d_v,
            num_blocks,
            page_size: page,
            max_blocks,
            softmax_scale: (spec.d_qk as f32).sqrt().recip(),
            causal: spec.causal,
        },
        q,
        k_cache,
        block_table,
        cache_seqlens: spec.seqlens.clone(),
        sink,
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Sparse FP8 decode.

/// The invalid index values of docs/spec.md section 6 as i32 (`s_kv` is added by the generator: the cache's token
/// count).
pub const INVALID_INDICES: [i32; 7] =
    [i32::MIN, -123456, -1, 114514, 1919810, 2147480000, i32::MAX];

/// One generated FP8 cache with its indices.
#[derive(Debug, Clone)]
pub struct SparseCacheCase {
    /// The layout as the decode sees it (block stride possibly padded).
    pub layout: CacheLayout,
    /// Cache bytes in `layout` (the last block's padding left out); dead tokens hold 0xFF (NaN everywhere).
    pub bytes: Vec<u8>,
    /// The packed cache (no padding), for `dequantize_cache`.
    pub packed: Vec<u8>,
    /// `[b, s_q, topk]` token indices (valid ones name live tokens only).
    pub indices: Vec<i32>,
    /// Entries per index row.
    pub topk: usize,
    /// `[b]` lengths, when given.
    pub topk_length: Option<Vec<i32>>,
}

impl SparseCacheCase {
    /// The reference's view of this cache.
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
    /// Cache format.
    pub format: KvFormat,
    /// Blocks of the cache.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Extra bytes between blocks.
    pub block_pad: usize,
    /// Entries per index row.
    pub topk: usize,
    /// Probability that an index entry is invalid.
    pub p_invalid: f64,
    /// `[b]` lengths, optional.
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

/// Draws one FP8 cache (quantised from `randn / 10` plus an offset; about a third of the tokens dead, every byte
/// 0xFF) and `[batch, s_q, topk]` indices naming live tokens or, with probability `p_invalid`, an invalid value of
/// docs/spec.md section 6.
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
    let kv = randn_bf16(rng, n_tok * f.d_qk(), 0.1, offset);
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

/// A sparse decode case: query, main cache, optional extra cache and sink.
#[derive(Debug, Clone)]
pub struct SparseDecodeCase {
    /// The problem's dimensions.
    pub p: SparseDecodeProblem,
    /// `[b, s_q, h_q, d_qk]` (bf16 values).
    pub q: Vec<f32>,
    /// The main cache.
    pub kv: SparseCacheCase,
    /// The extra cache, when drawn.
    pub extra: Option<SparseCacheCase>,
    /// `[h_q]`, when drawn.
    pub sink: Option<Vec<f32>>,
}

impl SparseDecodeCase {
    /// The reference's view of the case.
    pub fn inputs(&self) -> SparseDecodeInputs<'_> {
        SparseDecodeInputs {
            q: &self.q,
            kv: self.kv.kv(),
            extra: self.extra.as_ref().map(|e| e.kv()),
            attn_sink: self.sink.as_deref(),
        }
    }
}

/// Draws a sparse decode case of `(batch, s_q, h_q)`.
pub fn sparse_decode_case(
    rng: &mut StdRng,
    (batch, s_q, h_q): (usize, usize, usize),
    main: &SparseCacheSpec,
    extra: Option<&SparseCacheSpec>,
    sink: bool,
) -> SparseDecodeCase {
    let d_qk = main.format.d_qk();
    let kv = sparse_cache_case(rng, main, batch, s_q);
    let extra = extra.map(|e| sparse_cache_case(rng, e, batch, s_q));
    let offset = rng.random_range(-0.2f32..0.2);
    let q = randn_bf16(rng, batch * s_q * h_q * d_qk, 0.1, offset);
    let sink = sink.then(|| (0..h_q).map(|_| StandardNormal.sample(rng)).collect());
    SparseDecodeCase {
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

/// What to generate for a dense varlen prefill case (docs/spec.md section 5).
#[derive(Debug, Clone)]
pub struct PrefillSpec {
    /// `(query rows, key rows)` of each sequence.
    pub lens: Vec<(usize, usize)>,
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads.
    pub h_k: usize,
    /// Query/key width (`d_v` is 128).
    pub d: usize,
    /// bf16 or f16.
    pub dtype: crate::tensor::DType,
    /// Standard deviation of q (k and v are `randn`); larger values make the softmax peakier.
    pub q_std: f32,
}

/// A dense prefill case: host tensors and the values the reference reads (the tensors' own, as f32).
#[derive(Debug, Clone)]
pub struct PrefillCase {
    /// `[total_q, h_q, d]`.
    pub q: HostTensor,
    /// `[total_k, h_k, d]`.
    pub k: HostTensor,
    /// `[total_k, h_k, 128]`.
    pub v: HostTensor,
    /// `[b + 1]` i32.
    pub cu_q: HostTensor,
    /// `[b + 1]` i32.
    pub cu_k: HostTensor,
    /// The offsets as vectors.
    pub offsets: (Vec<i32>, Vec<i32>),
    /// q, k, v as f32 (row-major, contiguous).
    pub values: (Vec<f32>, Vec<f32>, Vec<f32>),
}

impl PrefillCase {
    /// The reference problem of the case with a mask and scale.
    pub fn problem(
        &self,
        spec: &PrefillSpec,
        causal: bool,
        scale: f32,
    ) -> crate::reference::dense_prefill::DensePrefillProblem<'_> {
        crate::reference::dense_prefill::DensePrefillProblem {
            h_q: spec.h_q,
            h_k: spec.h_k,
            d: spec.d,
            d_v: 128,
            cu_seqlens_q: &self.offsets.0,
            cu_seqlens_k: &self.offsets.1,
            q: &self.values.0,
            k: &self.values.1,
            v: &self.values.2,
            scale,
            causal,
        }
    }

    /// The same inputs with q, k and v non-contiguous (last dimension padded by 128 elements, the others by 1, then
    /// sliced back), rows still 16-byte aligned.
    pub fn padded(&self) -> Result<PrefillCase> {
        let pad = |t: &HostTensor| t.to_padded(&[1, 1, 128]);
        Ok(PrefillCase {
            q: pad(&self.q)?,
            k: pad(&self.k)?,
            v: pad(&self.v)?,
            ..self.clone()
        })
    }
}

/// A tensor of `shape` with values `randn * std` plus a small per-tensor offset, rounded to `dtype` (bf16, or f16).
pub fn randn_half(
    rng: &mut StdRng,
    shape: &[usize],
    std: f32,
    dtype: crate::tensor::DType,
) -> Result<HostTensor> {
    use crate::tensor::{DType, HostData};
    let n = shape.iter().product();
    let offset = rng.random_range(-0.05f32..0.05);
    match dtype {
        DType::F16 => HostTensor::new(
            HostData::F16(randn_map(rng, n, |z| half::f16::from_f32(z * std + offset))),
            shape,
        ),
        _ => HostTensor::new(
            HostData::Bf16(randn_map(rng, n, |z| bf16::from_f32(z * std + offset))),
            shape,
        ),
    }
}

/// Draws a dense prefill case: q `randn * q_std`, k and v `randn` ([`randn_half`]).
pub fn prefill_case(rng: &mut StdRng, spec: &PrefillSpec) -> Result<PrefillCase> {
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    for &(a, b) in &spec.lens {
        cu_q.push(cu_q[cu_q.len() - 1] + a as i32);
        cu_k.push(cu_k[cu_k.len() - 1] + b as i32);
    }
    let (tq, tk) = (cu_q[cu_q.len() - 1] as usize, cu_k[cu_k.len() - 1] as usize);
    let t = spec.dtype;
    let q = randn_half(rng, &[tq, spec.h_q, spec.d], spec.q_std, t)?;
    let k = randn_half(rng, &[tk, spec.h_k, spec.d], 1.0, t)?;
    let v = randn_half(rng, &[tk, spec.h_k, 128], 1.0, t)?;
    let values = (q.to_f32_vec()?, k.to_f32_vec()?, v.to_f32_vec()?);
    Ok(PrefillCase {
        q,
        k,
        v,
        cu_q: HostTensor::from_i32(cu_q.clone(), &[cu_q.len()])?,
        cu_k: HostTensor::from_i32(cu_k.clone(), &[cu_k.len()])?,
        offsets: (cu_q, cu_k),
        values,
    })
}
