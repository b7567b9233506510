//! Helpers shared by the integration tests: seeded generators of adversarial sparse-attention inputs
//! (docs/spec.md section 6), host-tensor builders and the spec section 6 comparison ([`assert_close`]).
//!
//! Every generator takes an explicit seed; tests put the seed in their assertion messages so a failure
//! can be replayed.
#![allow(dead_code)]

pub mod naive;

pub use flashmla::reference::compare;
pub use flashmla::reference::compare::Tolerance;

use flashmla::ops::sparse_bwd::SparseBwdArgs;
use flashmla::ops::sparse_fwd::SparseFwdArgs;
use flashmla::reference::sparse_fwd::SparseFwdProblem;
use flashmla::{DType, HostTensor};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Panics with `name`, the worst element, max abs/rel error and cos_diff unless `got` passes `tol`
/// against `want` per docs/spec.md section 6.
#[track_caller]
pub fn assert_close<W: Copy + Into<f64>>(name: &str, got: &[f32], want: &[W], tol: Tolerance) {
    if let Err(msg) = compare::compare(got, want).check(&tol) {
        panic!("{name}: {msg}");
    }
}

/// Like [`assert_close`] for a computed f64 tensor (e.g. the f64 reference against a naive f64
/// formulation); `got` is compared at full precision, not narrowed to f32.
#[track_caller]
pub fn assert_close_f64(name: &str, got: &[f64], want: &[f64], abs: f64, rel: f64) {
    assert_eq!(got.len(), want.len(), "{name}: lengths differ");
    for (i, (&a, &r)) in got.iter().zip(want).enumerate() {
        let same_nonfinite = (a.is_nan() && r.is_nan()) || (a.is_infinite() && a == r);
        if same_nonfinite {
            continue;
        }
        let err = (a - r).abs();
        assert!(
            err < abs || err / (r.abs() + compare::REL_EPS) < rel,
            "{name}: element {i}: got {a:e}, want {r:e} (abs err {err:.3e})"
        );
    }
}

pub use flashmla::testing::rng;

/// Rounds to the nearest bf16 value.
pub fn bf16_round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `n` values `randn / 10 + offset`, rounded to bf16 (the peer's input distribution).
pub fn randn_bf16(rng: &mut StdRng, n: usize, offset: f32) -> Vec<f32> {
    flashmla::testing::randn_bf16(rng, n, 0.1, offset)
}

/// A random per-tensor offset in `[-max, max]`.
pub fn offset(rng: &mut StdRng, max: f32) -> f32 {
    rng.random_range(-max..=max)
}

/// The spec section 6 invalid index values, as they apply to a KV tensor of `s_kv` rows.
pub fn invalid_index_values(s_kv: usize) -> Vec<i32> {
    let n = flashmla::testing::INVALID_INDEX_VALUES.len();
    let mut v: Vec<i32> = (0..n)
        .map(|k| flashmla::testing::invalid_index(k, s_kv))
        .collect();
    v.dedup();
    v
}

/// How [`gen_indices`] fills index rows.
#[derive(Debug, Clone, Copy)]
pub struct IndexOpts {
    /// Probability that an entry is an invalid value.
    pub p_invalid: f64,
    /// Probability that an entry repeats an earlier valid entry of its row.
    pub p_dup: f64,
    /// Every `n`-th token (starting at token 1) has only invalid entries.
    pub empty_row_every: Option<usize>,
}

impl IndexOpts {
    /// Only distinct-ish valid entries (duplicates may still occur by chance).
    pub const CLEAN: IndexOpts = IndexOpts {
        p_invalid: 0.0,
        p_dup: 0.0,
        empty_row_every: None,
    };
    /// Invalid values, duplicates and empty rows mixed in.
    pub const ADVERSARIAL: IndexOpts = IndexOpts {
        p_invalid: 0.2,
        p_dup: 0.1,
        empty_row_every: Some(5),
    };
}

/// Index rows `[s_q, topk]` for `s_kv` KV rows.
pub fn gen_indices(
    rng: &mut StdRng,
    s_q: usize,
    s_kv: usize,
    topk: usize,
    opts: IndexOpts,
) -> Vec<i32> {
    let invalid = invalid_index_values(s_kv);
    let mut out = Vec::with_capacity(s_q * topk);
    for t in 0..s_q {
        let empty = opts.empty_row_every.is_some_and(|n| t % n == 1) || s_kv == 0;
        let row_start = out.len();
        for j in 0..topk {
            let v = if empty || rng.random_bool(opts.p_invalid) {
                invalid[rng.random_range(0..invalid.len())]
            } else if j > 0 && rng.random_bool(opts.p_dup) {
                let earlier = out[row_start + rng.random_range(0..j)];
                if usize::try_from(earlier).is_ok_and(|r: usize| r < s_kv) {
                    earlier
                } else {
                    rng.random_range(0..s_kv) as i32
                }
            } else {
                rng.random_range(0..s_kv) as i32
            };
            out.push(v);
        }
    }
    out
}

/// `topk_length [s_q]` mixing 0, `topk`, values above `topk`, negatives and random lengths.
pub fn gen_topk_length(rng: &mut StdRng, s_q: usize, topk: usize) -> Vec<i32> {
    let topk_i = i32::try_from(topk).expect("topk fits i32");
    (0..s_q)
        .map(|t| match t % 6 {
            0 => 0,
            1 => topk_i,
            2 => topk_i + 7,
            3 => -3,
            _ => rng.random_range(0..=topk_i),
        })
        .collect()
}

/// Dimensions of a test problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Query tokens.
    pub s_q: usize,
    /// KV rows.
    pub s_kv: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Value width.
    pub d_v: usize,
    /// Entries per token.
    pub topk: usize,
}

/// A sink per head: finite values around the logits' scale, or `Some(fill)` for every head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sink {
    /// No sink.
    None,
    /// Random finite sinks.
    Random,
    /// The same value for every head (e.g. `±inf`).
    All(f32),
}

/// An owned sparse-attention problem with the seed that made it.
#[derive(Debug, Clone)]
pub struct Case {
    /// The seed `Case::random` was called with.
    pub seed: u64,
    /// Dimensions.
    pub shape: Shape,
    /// `[s_q, h_q, d_qk]`.
    pub q: Vec<f32>,
    /// `[s_kv, d_qk]`.
    pub kv: Vec<f32>,
    /// `[s_q, topk]`.
    pub indices: Vec<i32>,
    /// Softmax scale.
    pub sm_scale: f32,
    /// `[h_q]`.
    pub attn_sink: Option<Vec<f32>>,
    /// `[s_q]`.
    pub topk_length: Option<Vec<i32>>,
}

impl Case {
    /// Random inputs (`randn/10 + offset`, bf16-rounded), indices per `idx`, sink per `sink`,
    /// `topk_length` from [`gen_topk_length`] when `with_topk_length`.
    pub fn random(
        seed: u64,
        shape: Shape,
        idx: IndexOpts,
        sink: Sink,
        with_topk_length: bool,
    ) -> Case {
        let mut rng = rng(seed);
        let Shape {
            s_q,
            s_kv,
            h_q,
            d_qk,
            topk,
            ..
        } = shape;
        let (oq, okv) = (offset(&mut rng, 0.3), offset(&mut rng, 0.3));
        let q = randn_bf16(&mut rng, s_q * h_q * d_qk, oq);
        let kv = randn_bf16(&mut rng, s_kv * d_qk, okv);
        let indices = gen_indices(&mut rng, s_q, s_kv, topk, idx);
        let attn_sink = match sink {
            Sink::None => None,
            Sink::Random => Some((0..h_q).map(|_| rng.random_range(-2.0..3.0)).collect()),
            Sink::All(v) => Some(vec![v; h_q]),
        };
        let topk_length = with_topk_length.then(|| gen_topk_length(&mut rng, s_q, topk));
        Case {
            seed,
            shape,
            q,
            kv,
            indices,
            sm_scale: 1.0 / (d_qk as f32).sqrt(),
            attn_sink,
            topk_length,
        }
    }

    /// The reference problem over this case's data.
    pub fn problem(&self) -> SparseFwdProblem<'_> {
        let s = self.shape;
        SparseFwdProblem {
            s_q: s.s_q,
            s_kv: s.s_kv,
            h_q: s.h_q,
            d_qk: s.d_qk,
            d_v: s.d_v,
            topk: s.topk,
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale: self.sm_scale,
            attn_sink: self.attn_sink.as_deref(),
            topk_length: self.topk_length.as_deref(),
        }
    }

    /// Which KV rows some valid entry references (computed here, independently of the library).
    pub fn referenced(&self) -> Vec<bool> {
        let s = self.shape;
        let mut used = vec![false; s.s_kv];
        for t in 0..s.s_q {
            for r in naive::valid_entries(self, t) {
                used[r] = true;
            }
        }
        used
    }

    /// Fills every unreferenced KV row with NaN; returns how many rows that was.
    pub fn nan_unreferenced(&mut self) -> usize {
        let d_qk = self.shape.d_qk;
        let used = self.referenced();
        let mut n = 0;
        for (r, _) in used.iter().enumerate().filter(|(_, &u)| !u) {
            self.kv[r * d_qk..(r + 1) * d_qk].fill(f32::NAN);
            n += 1;
        }
        n
    }

    /// The inputs as contiguous host tensors in the op's shapes.
    pub fn tensors(&self) -> Inputs {
        let s = self.shape;
        Inputs {
            q: HostTensor::bf16_from_f32(&self.q, &[s.s_q, s.h_q, s.d_qk]).unwrap(),
            kv: HostTensor::bf16_from_f32(&self.kv, &[s.s_kv, 1, s.d_qk]).unwrap(),
            indices: HostTensor::from_i32(self.indices.clone(), &[s.s_q, 1, s.topk]).unwrap(),
            attn_sink: self
                .attn_sink
                .as_ref()
                .map(|v| HostTensor::from_f32(v.clone(), &[s.h_q]).unwrap()),
            topk_length: self
                .topk_length
                .as_ref()
                .map(|v| HostTensor::from_i32(v.clone(), &[s.s_q]).unwrap()),
            sm_scale: self.sm_scale,
        }
    }
}

/// A case's inputs as host tensors.
#[derive(Debug, Clone)]
pub struct Inputs {
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
    /// Softmax scale.
    pub sm_scale: f32,
}

impl Inputs {
    /// Forward arguments borrowing these tensors.
    pub fn fwd_args(&self) -> SparseFwdArgs<'_, HostTensor> {
        SparseFwdArgs {
            q: &self.q,
            kv: &self.kv,
            indices: &self.indices,
            sm_scale: self.sm_scale,
            attn_sink: self.attn_sink.as_ref(),
            topk_length: self.topk_length.as_ref(),
        }
    }

    /// Backward arguments borrowing these tensors and the forward's `out`, `lse` and `d_out`.
    pub fn bwd_args<'a>(
        &'a self,
        out: &'a HostTensor,
        d_out: &'a HostTensor,
        lse: &'a HostTensor,
        d_kv_dtype: DType,
    ) -> SparseBwdArgs<'a, HostTensor> {
        SparseBwdArgs {
            q: &self.q,
            kv: &self.kv,
            out,
            d_out,
            indices: &self.indices,
            lse,
            sm_scale: self.sm_scale,
            attn_sink: self.attn_sink.as_ref(),
            topk_length: self.topk_length.as_ref(),
            d_kv_dtype,
        }
    }

    /// Every tensor made non-contiguous per spec section 6: the last dimension padded by 128, every other
    /// by 1 (NaN / `i32::MIN` in the padding).
    pub fn padded(&self) -> Inputs {
        Inputs {
            q: pad(&self.q),
            kv: pad(&self.kv),
            indices: pad(&self.indices),
            attn_sink: self.attn_sink.as_ref().map(pad),
            topk_length: self.topk_length.as_ref().map(pad),
            sm_scale: self.sm_scale,
        }
    }
}

/// Padding of the last dimension in [`pad`].
pub const PAD_LAST: usize = 128;

/// A non-contiguous copy of `t`: last dimension padded by [`PAD_LAST`], every other by 1.
pub fn pad(t: &HostTensor) -> HostTensor {
    use flashmla::TensorMeta;
    let rank = t.shape().len();
    let pads: Vec<usize> = (0..rank)
        .map(|d| if d + 1 == rank { PAD_LAST } else { 1 })
        .collect();
    t.to_padded(&pads).unwrap()
}

/// Values of a bf16/f32 host tensor.
pub fn values(t: &HostTensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}
