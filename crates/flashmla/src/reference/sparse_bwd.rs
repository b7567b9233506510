//! CPU reference of the sparse MLA prefill backward (docs/spec.md section 2).
//!
//! The forward's `out` and `lse` are taken as given (not recomputed). With
//! `p[t,h,j] = exp(s[t,h,j] - lse'[t,h])`, where `lse'` combines the given `lse` with the sink as in
//! the forward:
//!
//! ```text
//! delta[t,h]   = sum_c d_out[t,h,c] * out[t,h,c]
//! dp[t,h,j]    = dot(d_out[t,h,:], kv[idx[t,j], :d_v])
//! ds[t,h,j]    = p[t,h,j] * (dp[t,h,j] - delta[t,h])
//! d_q[t,h,:]   = sm_scale * sum_j ds[t,h,j] * kv[idx[t,j], :]
//! d_kv[r,:]    = sum over (t,h,j) with idx[t,j] = r of
//!                  sm_scale * ds[t,h,j] * q[t,h,:]  +  p[t,h,j] * d_out[t,h,:] (first d_v columns)
//! d_sink[h]    = - sum_t exp(attn_sink[h] - lse'[t,h]) * delta[t,h]
//! ```
//!
//! `p` is evaluated as `exp(s - lse) * sigmoid(lse - sink)` (equal to `exp(s - lse')`), so a sink of
//! `+inf` gives `p = 0` and `-inf` changes nothing, without forming `inf - inf`. A `(t, h)` whose given
//! `lse` is `+inf` (the forward's empty row) contributes nothing to `d_q`, `d_kv` or `d_attn_sink`.
//! KV rows that no valid entry references stay exactly 0 and are never read.

use super::sparse_fwd::{dot, SparseFwdProblem};
use super::Real;
use crate::alloc::{try_clear_for, try_collect, try_filled};
use crate::cancel::CancelToken;
use crate::error::Result;
use rayon::prelude::*;

/// One sparse prefill backward problem: the forward problem plus the forward's outputs and the
/// incoming gradient, all contiguous f32 slices.
#[derive(Debug, Clone, Copy)]
pub struct SparseBwdProblem<'a> {
    /// The forward problem (inputs and dimensions).
    pub fwd: SparseFwdProblem<'a>,
    /// Forward output `[s_q, h_q, d_v]` (as the forward returned it, e.g. rounded to bf16).
    pub out: &'a [f32],
    /// Gradient of the loss with respect to `out`, `[s_q, h_q, d_v]`.
    pub d_out: &'a [f32],
    /// Forward log-sum-exp `[s_q, h_q]`, natural log, without the sink; `+inf` for empty rows.
    pub lse: &'a [f32],
}

impl SparseBwdProblem<'_> {
    /// Checks the forward problem and the lengths of `out`, `d_out` and `lse`.
    pub fn check(&self) -> Result<()> {
        use super::sparse_fwd::expect_len;
        let f = &self.fwd;
        f.check()?;
        expect_len(
            "out",
            self.out.len(),
            &[f.s_q, f.h_q, f.d_v],
            "s_q * h_q * d_v",
        )?;
        expect_len(
            "d_out",
            self.d_out.len(),
            &[f.s_q, f.h_q, f.d_v],
            "s_q * h_q * d_v",
        )?;
        expect_len("lse", self.lse.len(), &[f.s_q, f.h_q], "s_q * h_q")?;
        Ok(())
    }
}

/// Outputs of [`sparse_bwd`].
#[derive(Debug, Clone, PartialEq)]
pub struct SparseBwdResult<R> {
    /// Gradient of the queries `[s_q, h_q, d_qk]`.
    pub d_q: Vec<R>,
    /// Gradient of the latent KV rows `[s_kv, d_qk]` (the op's `[s_kv, 1, d_qk]`).
    pub d_kv: Vec<R>,
    /// `sum_c d_out * out` per `[s_q, h_q]`.
    pub delta: Vec<R>,
    /// Gradient of the sink logits `[h_q]`, present when the problem has a sink.
    pub d_attn_sink: Option<Vec<R>>,
}

/// Logistic function, evaluated without overflow; exact at `±inf` (1 and 0).
#[inline]
fn sigmoid<R: Real>(x: R) -> R {
    if x >= R::zero() {
        R::one() / (R::one() + (-x).exp())
    } else {
        let e = x.exp();
        e / (R::one() + e)
    }
}

/// What every entry of one `(t, h)` needs: the given `lse`, the share left to the real entries after the
/// sink (`exp(lse - lse')`), and `delta`.
#[derive(Debug, Clone, Copy)]
struct HeadStats<R> {
    lse: R,
    keep: R,
    delta: R,
}

impl<R: Real> HeadStats<R> {
    /// A `(t, h)` whose forward found no valid entry (`lse = +inf`) contributes nothing.
    fn is_empty(&self) -> bool {
        self.lse == R::infinity()
    }
}

/// `(p, sm_scale * ds)` of one entry: token `t`, head `h`, KV row `r`. The only place these are
/// computed, so `d_q` and `d_kv` see identical values.
#[inline]
fn entry_grad<R: Real>(
    p: &SparseBwdProblem<'_>,
    t: usize,
    h: usize,
    r: usize,
    st: HeadStats<R>,
) -> (R, R) {
    let f = &p.fwd;
    let k = f.kv_row(r);
    let scale = R::of(f.sm_scale);
    let s = scale * dot::<R>(f.q_row(t, h), k);
    let prob = (s - st.lse).exp() * st.keep;
    let dp = dot::<R>(d_out_row(p, t, h), &k[..f.d_v]);
    (prob, scale * prob * (dp - st.delta))
}

/// `d_out[t, h, :]` (`d_v` values).
#[inline]
fn d_out_row<'a>(p: &SparseBwdProblem<'a>, t: usize, h: usize) -> &'a [f32] {
    let d_v = p.fwd.d_v;
    let start = (t * p.fwd.h_q + h) * d_v;
    &p.d_out[start..start + d_v]
}

/// Pass 1: per-(t, h) statistics. lse' = lse (+) sink, so exp(lse - lse') = sigmoid(lse - sink).
/// Polls `cancel` once per token.
fn head_stats<R: Real>(
    p: &SparseBwdProblem<'_>,
    cancel: &CancelToken,
) -> Result<Vec<HeadStats<R>>> {
    let f = &p.fwd;
    let (h_q, d_v) = (f.h_q, f.d_v);
    let zero = HeadStats {
        lse: R::zero(),
        keep: R::zero(),
        delta: R::zero(),
    };
    let mut stats = try_filled("sparse_bwd statistics", f.s_q * h_q, zero)?;
    stats
        .par_chunks_mut(h_q)
        .enumerate()
        .for_each(|(t, token_stats)| {
            if cancel.is_cancelled() {
                return;
            }
            for (h, st) in token_stats.iter_mut().enumerate() {
                let th = t * h_q + h;
                let (o, g) = (
                    &p.out[th * d_v..(th + 1) * d_v],
                    &p.d_out[th * d_v..(th + 1) * d_v],
                );
                let lse = R::of(p.lse[th]);
                let keep = f
                    .attn_sink
                    .map_or(R::one(), |sink| sigmoid(lse - R::of(sink[h])));
                *st = HeadStats {
                    lse,
                    keep,
                    delta: dot::<R>(o, g),
                };
            }
        });
    cancel.check()?;
    Ok(stats)
}

/// Passes 2 and 3: `(d_q, d_kv)`, or with `ABS` the same sums over the absolute values of every product
/// (`sum |ds| |k|` and `sum |ds| |q| + |p| |d_out|`). Polls `cancel` once per token (pass 2) and per KV row
/// (pass 3).
fn gradients<R: Real, const ABS: bool>(
    p: &SparseBwdProblem<'_>,
    stats: &[HeadStats<R>],
    cancel: &CancelToken,
) -> Result<(Vec<R>, Vec<R>)> {
    let f = &p.fwd;
    let (s_q, s_kv, h_q, d_qk, d_v) = (f.s_q, f.s_kv, f.h_q, f.d_qk, f.d_v);
    let m = |x: R| if ABS { x.abs() } else { x };

    // Pass 2: d_q, one token per task.
    let mut d_q = try_filled("sparse_bwd d_q", s_q * h_q * d_qk, R::zero())?;
    d_q.par_chunks_mut(h_q * d_qk)
        .enumerate()
        .try_for_each_init(
            Vec::new,
            |rows: &mut Vec<usize>, (t, d_q_t)| -> Result<()> {
                cancel.check()?;
                try_clear_for(rows, "sparse_bwd token scratch", f.row_len(t))?;
                rows.extend(f.valid_rows(t));
                for h in 0..h_q {
                    let st = stats[t * h_q + h];
                    if st.is_empty() {
                        continue;
                    }
                    let acc = &mut d_q_t[h * d_qk..(h + 1) * d_qk];
                    for &r in rows.iter() {
                        let (_, ds) = entry_grad(p, t, h, r, st);
                        let ds = m(ds);
                        for (a, &k) in acc.iter_mut().zip(f.kv_row(r)) {
                            *a = *a + ds * m(R::of(k));
                        }
                    }
                }
                Ok(())
            },
        )?;

    // Row -> tokens index of the valid entries (counting sort, tokens ascending within a row; a token
    // appears once per occurrence of the row in its index list).
    let mut offsets = try_filled("sparse_bwd row index", s_kv + 1, 0usize)?;
    for t in 0..s_q {
        for r in f.valid_rows(t) {
            offsets[r + 1] += 1;
        }
    }
    for r in 0..s_kv {
        offsets[r + 1] += offsets[r];
    }
    let mut tokens = try_filled("sparse_bwd row index", offsets[s_kv], 0usize)?;
    let mut fill = try_collect("sparse_bwd row index", s_kv + 1, offsets.iter().copied())?;
    for t in 0..s_q {
        for r in f.valid_rows(t) {
            tokens[fill[r]] = t;
            fill[r] += 1;
        }
    }

    // Pass 3: d_kv, one KV row per task; unreferenced rows keep their zeros.
    let mut d_kv = try_filled("sparse_bwd d_kv", s_kv * d_qk, R::zero())?;
    d_kv.par_chunks_mut(d_qk).enumerate().for_each(|(r, acc)| {
        if cancel.is_cancelled() {
            return;
        }
        for &t in &tokens[offsets[r]..offsets[r + 1]] {
            for h in 0..h_q {
                let st = stats[t * h_q + h];
                if st.is_empty() {
                    continue;
                }
                let (prob, ds) = entry_grad(p, t, h, r, st);
                let (prob, ds) = (m(prob), m(ds));
                for (a, &x) in acc.iter_mut().zip(f.q_row(t, h)) {
                    *a = *a + ds * m(R::of(x));
                }
                for (a, &g) in acc[..d_v].iter_mut().zip(d_out_row(p, t, h)) {
                    *a = *a + prob * m(R::of(g));
                }
            }
        }
    });
    cancel.check()?;
    Ok((d_q, d_kv))
}

/// Runs the backward.
///
/// Parallel passes, all deterministic (every output element is summed in a fixed order, whatever
/// the thread count):
/// 1. over `(t, h)`: `delta` and the statistics every entry needs (`lse`, `exp(lse - lse')`);
/// 2. over tokens: `d_q`;
/// 3. over KV rows: `d_kv[r]` sums its contributions in `(t, j)` order, recomputing `p` and `ds`
///    with the same function as pass 2 instead of storing `[s_q, h_q, topk]` of them;
/// 4. `d_attn_sink[h]`, summed over tokens in order.
///
/// Allocates the outputs (`d_q`, `d_kv`, `delta`, `d_attn_sink`), the `[s_q, h_q]` statistics (three
/// `R` each), a row-to-token index of the valid entries (`s_kv + 1` offsets and one `usize` per valid
/// occurrence) and, per worker thread, one token's valid rows. `p` and `ds` are computed twice (for
/// `d_q` and for `d_kv`), which costs about 40% more arithmetic than storing them would.
pub fn sparse_bwd<R: Real>(p: &SparseBwdProblem<'_>) -> Result<SparseBwdResult<R>> {
    sparse_bwd_with(p, CancelToken::never())
}

/// [`sparse_bwd`], stopping with [`crate::Error::Interrupted`] soon after `cancel` is cancelled (it is
/// polled before every token of passes 1 and 2 and every KV row of pass 3).
pub fn sparse_bwd_with<R: Real>(
    p: &SparseBwdProblem<'_>,
    cancel: &CancelToken,
) -> Result<SparseBwdResult<R>> {
    p.check()?;
    let f = &p.fwd;
    let (s_q, h_q) = (f.s_q, f.h_q);
    let stats = head_stats::<R>(p, cancel)?;
    let (d_q, d_kv) = gradients::<R, false>(p, &stats, cancel)?;

    // Pass 4: d_sink[h] = -sum_t exp(sink - lse') * delta, with exp(sink - lse') = sigmoid(sink - lse);
    // summed over tokens in order.
    let d_attn_sink = f.attn_sink.map(|sink| {
        (0..h_q)
            .map(|h| {
                let sink_h = R::of(sink[h]);
                -(0..s_q)
                    .map(|t| stats[t * h_q + h])
                    .filter(|st| !st.is_empty())
                    .fold(R::zero(), |acc, st| {
                        acc + sigmoid(sink_h - st.lse) * st.delta
                    })
            })
            .collect()
    });

    Ok(SparseBwdResult {
        d_q,
        d_kv,
        delta: try_collect(
            "sparse_bwd delta",
            stats.len(),
            stats.iter().map(|st| st.delta),
        )?,
        d_attn_sink,
    })
}

/// Unit roundoff of bf16 (8 significant bits, round to nearest): `|bf16(x) - x| <= 2^-8 |x|`.
pub const BF16_UNIT_ROUNDOFF: f64 = 1.0 / 256.0;

/// Per-element bounds of the error a tensor-core backward makes by design, `[s_q, h_q, d_qk]` and
/// `[s_kv, d_qk]`, from [`sparse_bwd_operand_rounding`].
#[derive(Debug, Clone, PartialEq)]
pub struct OperandRounding {
    /// `u * sum_j |ds| |k|` per `d_q` element.
    pub d_q: Vec<f64>,
    /// `u * (sum |ds| |q| + sum |p| |d_out|)` per `d_kv` element.
    pub d_kv: Vec<f64>,
}

/// Bounds the error that comes from rounding the MMA operands `P` and `dS' = sm_scale * ds` to bf16,
/// as the GPU backward does (like every bf16 tensor-core attention backward): each product `P * d_out`
/// and `dS' * q` (or `dS' * k`) then carries a relative error of at most `u = 2^-8`
/// ([`BF16_UNIT_ROUNDOFF`]), so an element's error is at most `u` times the sum of the absolute values
/// of its products. Everything else (f32 accumulation, exp2) is orders of magnitude smaller.
///
/// The bound matters where probabilities are large: a token with a handful of valid entries has
/// `P ~ 1/len`, and its products, similar across heads, round the same way, which can exceed the
/// spec section 6 absolute tolerance of `d_kv` (1e-3); with `topk` in the hundreds or more it is far below it.
/// A wrongly kept or dropped contribution is about `1/u = 256` times larger than its share of the
/// bound, so judging errors net of it still catches every real mistake.
///
/// A kernel that also rounds partial sums of these products to bf16 once (the GPU pair kernel's bf16
/// exchange between the two head groups of a token) adds at most the same again: twice `d_kv` bounds it.
pub fn sparse_bwd_operand_rounding(p: &SparseBwdProblem<'_>) -> Result<OperandRounding> {
    p.check()?;
    let never = CancelToken::never();
    let stats = head_stats::<f64>(p, never)?;
    let (d_q, d_kv) = gradients::<f64, true>(p, &stats, never)?;
    let u = BF16_UNIT_ROUNDOFF;
    Ok(OperandRounding {
        d_q: d_q.into_iter().map(|x| u * x).collect(),
        d_kv: d_kv.into_iter().map(|x| u * x).collect(),
    })
}
