//! CPU reference of the sparse MLA prefill forward (docs/spec.md section 1).
//!
//! Every query token `t` attends to the multiset of KV rows its `indices[t, :]` name; every query head
//! reads the same latent row (`h_kv = 1`), and V is the first `d_v` columns of that row:
//!
//! ```text
//! s[t,h,j]          = sm_scale * dot(q[t,h,:], kv[idx[t,j], :])      over the valid entries j
//! max_logits[t,h]   = max_j s[t,h,j]
//! lse[t,h]          = ln sum_j exp(s[t,h,j])                          (natural log)
//! out[t,h,:]        = sum_j exp(s[t,h,j] - lse'[t,h]) * kv[idx[t,j], :d_v]
//! lse'[t,h]         = lse[t,h], or ln(exp(lse[t,h]) + exp(attn_sink[h])) with a sink
//! ```
//!
//! An entry is valid when its position is below `topk_length[t]` (when given) and its value is in
//! `0..s_kv`; invalid entries are never dereferenced, so unreferenced KV rows may hold NaN. A token with
//! no valid entry gives `out = 0`, `lse = +inf`, `max_logits = -inf`.
//!
//! The softmax is evaluated stably as `exp(s - max) / (sum exp(s - max) + exp(sink - max))`, which gives
//! the exact limits for `attn_sink = +inf` (out = 0) and `-inf` (no effect).

use super::Real;
use crate::alloc::{try_clear_for, try_filled, try_refill};
use crate::cancel::CancelToken;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// One sparse prefill forward problem: dimensions plus contiguous f32 slices holding the (bf16) inputs.
///
/// The op layer enforces the spec's `d_v = 512`, `d_qk` in {512, 576}; the reference accepts any
/// `d_qk >= d_v >= 1` and `h_q >= 1` so that tests can use tiny problems.
#[derive(Debug, Clone, Copy)]
pub struct SparseFwdProblem<'a> {
    /// Query tokens.
    pub s_q: usize,
    /// Rows of the latent KV tensor.
    pub s_kv: usize,
    /// Query heads.
    pub h_q: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Value width: V is `kv[:, :d_v]`.
    pub d_v: usize,
    /// Index entries per query token.
    pub topk: usize,
    /// Queries `[s_q, h_q, d_qk]`.
    pub q: &'a [f32],
    /// Latent KV rows `[s_kv, d_qk]` (the op's `[s_kv, 1, d_qk]`).
    pub kv: &'a [f32],
    /// KV row per entry `[s_q, topk]` (the op's `[s_q, 1, topk]`); values outside `0..s_kv` are invalid.
    pub indices: &'a [i32],
    /// Scale applied to every dot product.
    pub sm_scale: f32,
    /// Per-head sink logit `[h_q]`: an extra softmax term whose value vector is zero.
    pub attn_sink: Option<&'a [f32]>,
    /// Per-token count of leading entries to use `[s_q]`: entries at positions `>= topk_length[t]` are
    /// ignored; a length above `topk` means all `topk` entries, a negative one none (clamped to `0..=topk`).
    pub topk_length: Option<&'a [i32]>,
}

/// How many leading index entries a `topk_length` value selects: the value clamped to `0..=topk` (a
/// negative length selects none, one above `topk` all `topk`). The GPU kernels clamp the same way.
pub fn clamp_topk_length(len: i32, topk: usize) -> usize {
    usize::try_from(len).map_or(0, |l| l.min(topk))
}

/// Checks that a slice holds exactly `n` elements, where `n` is a product that must not overflow.
pub(crate) fn expect_len(arg: &str, got: usize, dims: &[usize], what: &str) -> Result<()> {
    let want = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            Error::invalid(arg, format!("{what} elements"), "a size overflowing usize")
        })?;
    if got != want {
        return Err(Error::invalid(
            arg,
            format!("{want} elements ({what})"),
            got,
        ));
    }
    Ok(())
}

impl SparseFwdProblem<'_> {
    /// Checks that the dimensions are usable and every slice has the length its shape implies.
    pub fn check(&self) -> Result<()> {
        if self.h_q == 0 {
            return Err(Error::invalid("h_q", "at least 1", 0));
        }
        if self.d_v == 0 || self.d_v > self.d_qk {
            return Err(Error::invalid(
                "d_v",
                format!("1..={} (d_qk)", self.d_qk),
                self.d_v,
            ));
        }
        let (s_q, s_kv, h_q, d_qk) = (self.s_q, self.s_kv, self.h_q, self.d_qk);
        expect_len("q", self.q.len(), &[s_q, h_q, d_qk], "s_q * h_q * d_qk")?;
        expect_len("kv", self.kv.len(), &[s_kv, d_qk], "s_kv * d_qk")?;
        expect_len(
            "indices",
            self.indices.len(),
            &[s_q, self.topk],
            "s_q * topk",
        )?;
        if let Some(sink) = self.attn_sink {
            expect_len("attn_sink", sink.len(), &[h_q], "h_q")?;
        }
        if let Some(len) = self.topk_length {
            expect_len("topk_length", len.len(), &[s_q], "s_q")?;
        }
        Ok(())
    }

    /// How many leading entries of token `t`'s index row are considered: `topk_length[t]` clamped to
    /// `0..=topk`, or `topk` without `topk_length`.
    pub fn row_len(&self, t: usize) -> usize {
        match self.topk_length {
            Some(len) => clamp_topk_length(len[t], self.topk),
            None => self.topk,
        }
    }

    /// The KV rows token `t` attends to, in index order, one item per valid occurrence (a multiset).
    pub fn valid_rows(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        let row = &self.indices[t * self.topk..t * self.topk + self.row_len(t)];
        row.iter()
            .filter_map(move |&i| usize::try_from(i).ok().filter(|&r| r < self.s_kv))
    }

    /// Query vector of token `t`, head `h` (`d_qk` values).
    pub(crate) fn q_row(&self, t: usize, h: usize) -> &[f32] {
        let start = (t * self.h_q + h) * self.d_qk;
        &self.q[start..start + self.d_qk]
    }

    /// KV row `r` (`d_qk` values; the first `d_v` are V).
    pub(crate) fn kv_row(&self, r: usize) -> &[f32] {
        &self.kv[r * self.d_qk..(r + 1) * self.d_qk]
    }
}

/// Outputs of [`sparse_fwd`] (or [`sparse_fwd_rows`], where the leading dimension is the selected rows).
#[derive(Debug, Clone, PartialEq)]
pub struct SparseFwdResult<R> {
    /// Attention output `[s_q, h_q, d_v]`.
    pub out: Vec<R>,
    /// Largest valid logit `[s_q, h_q]` (`-inf` for a token without valid entries).
    pub max_logits: Vec<R>,
    /// Natural-log sum of exponentials of the valid logits `[s_q, h_q]` (`+inf` without valid entries;
    /// the sink is not included).
    pub lse: Vec<R>,
}

/// Independent partial sums in [`dot`]: lets the compiler vectorise, and shortens the summation chains.
const DOT_LANES: usize = 8;

/// `dot(a, b)` accumulated in `R` (in [`DOT_LANES`] interleaved partial sums, then added up in order).
#[inline]
pub(crate) fn dot<R: Real>(a: &[f32], b: &[f32]) -> R {
    let n = a.len().min(b.len());
    let split = n - n % DOT_LANES;
    let mut lanes = [R::zero(); DOT_LANES];
    for (x, y) in a[..split]
        .chunks_exact(DOT_LANES)
        .zip(b[..split].chunks_exact(DOT_LANES))
    {
        for l in 0..DOT_LANES {
            lanes[l] = lanes[l] + R::of(x[l]) * R::of(y[l]);
        }
    }
    let tail = a[split..n]
        .iter()
        .zip(&b[split..n])
        .fold(R::zero(), |acc, (&x, &y)| acc + R::of(x) * R::of(y));
    lanes.iter().fold(tail, |acc, &l| acc + l)
}

/// Maximum that propagates NaN (a NaN logit must show in `max_logits`, not be skipped).
#[inline]
fn nan_max<R: Real>(a: R, b: R) -> R {
    if a.is_nan() || b > a || b.is_nan() {
        b
    } else {
        a
    }
}

/// Runs the forward for every query token.
///
/// Allocates the outputs plus, per worker thread, scratch for one token: its valid rows, the logits
/// `[h_q, topk]`, an output accumulator `[h_q, d_v]` and `[h_q]` normalisers.
pub fn sparse_fwd<R: Real>(p: &SparseFwdProblem<'_>) -> Result<SparseFwdResult<R>> {
    sparse_fwd_with(p, CancelToken::never())
}

/// [`sparse_fwd`], stopping with [`Error::Interrupted`] soon after `cancel` is cancelled (it is polled
/// before every query token).
pub fn sparse_fwd_with<R: Real>(
    p: &SparseFwdProblem<'_>,
    cancel: &CancelToken,
) -> Result<SparseFwdResult<R>> {
    p.check()?;
    let rows: Vec<usize> = (0..p.s_q).collect();
    sparse_fwd_rows_with(p, &rows, cancel)
}

/// Runs the forward for the query tokens in `rows` only (any order, repeats allowed); the outputs'
/// leading dimension is `rows.len()`. Used to check huge problems on a sample of tokens.
pub fn sparse_fwd_rows<R: Real>(
    p: &SparseFwdProblem<'_>,
    rows: &[usize],
) -> Result<SparseFwdResult<R>> {
    sparse_fwd_rows_with(p, rows, CancelToken::never())
}

/// [`sparse_fwd_rows`], stopping with [`Error::Interrupted`] soon after `cancel` is cancelled (it is
/// polled before every query token).
pub fn sparse_fwd_rows_with<R: Real>(
    p: &SparseFwdProblem<'_>,
    rows: &[usize],
    cancel: &CancelToken,
) -> Result<SparseFwdResult<R>> {
    p.check()?;
    if let Some(&bad) = rows.iter().find(|&&t| t >= p.s_q) {
        return Err(Error::invalid(
            "rows",
            format!("token indices below s_q = {}", p.s_q),
            bad,
        ));
    }
    let (h_q, d_v) = (p.h_q, p.d_v);
    let n = rows.len();
    let mut res = SparseFwdResult {
        out: try_filled(
            "sparse_fwd out",
            n.saturating_mul(h_q).saturating_mul(d_v),
            R::zero(),
        )?,
        max_logits: try_filled(
            "sparse_fwd max_logits",
            n.saturating_mul(h_q),
            R::neg_infinity(),
        )?,
        lse: try_filled("sparse_fwd lse", n.saturating_mul(h_q), R::infinity())?,
    };
    res.out
        .par_chunks_mut(h_q * d_v)
        .zip(res.max_logits.par_chunks_mut(h_q))
        .zip(res.lse.par_chunks_mut(h_q))
        .zip(rows.par_iter())
        .try_for_each_init(TokenScratch::default, |scratch, (((out, max), lse), &t)| {
            cancel.check()?;
            forward_token(p, t, scratch, out, max, lse)
        })?;
    Ok(res)
}

/// Per-thread buffers reused across tokens.
struct TokenScratch<R> {
    /// Valid KV rows of the current token (multiset, index order).
    rows: Vec<usize>,
    /// Logits `[h_q, rows.len()]`, then unnormalised weights `exp(s - max)`.
    weights: Vec<R>,
    /// Output accumulator `[h_q, d_v]`.
    acc: Vec<R>,
    /// `1 / (sum_j exp(s - max) + exp(sink - max))` per head `[h_q]`.
    inv_denominator: Vec<R>,
}

impl<R> Default for TokenScratch<R> {
    fn default() -> Self {
        TokenScratch {
            rows: Vec::new(),
            weights: Vec::new(),
            acc: Vec::new(),
            inv_denominator: Vec::new(),
        }
    }
}

/// Forward for token `t`; `out [h_q, d_v]`, `max`/`lse [h_q]` arrive as 0 / -inf / +inf (the empty-row
/// values) and stay so when the token has no valid entry. Fails only when its scratch cannot be allocated.
fn forward_token<R: Real>(
    p: &SparseFwdProblem<'_>,
    t: usize,
    scratch: &mut TokenScratch<R>,
    out: &mut [R],
    max: &mut [R],
    lse: &mut [R],
) -> Result<()> {
    let (h_q, d_v) = (p.h_q, p.d_v);
    try_clear_for(&mut scratch.rows, "sparse_fwd token scratch", p.row_len(t))?;
    scratch.rows.extend(p.valid_rows(t));
    let n = scratch.rows.len();
    if n == 0 {
        return Ok(());
    }
    let scale = R::of(p.sm_scale);
    // Logits [h_q, n]; the loop visits each gathered KV row once for all heads.
    try_refill(
        &mut scratch.weights,
        "sparse_fwd token scratch",
        h_q.saturating_mul(n),
        R::zero(),
    )?;
    for (j, &r) in scratch.rows.iter().enumerate() {
        let k = p.kv_row(r);
        for h in 0..h_q {
            scratch.weights[h * n + j] = scale * dot::<R>(p.q_row(t, h), k);
        }
    }
    // Softmax statistics per head; weights become exp(s - max), the normaliser includes the sink.
    try_refill(
        &mut scratch.inv_denominator,
        "sparse_fwd token scratch",
        h_q,
        R::zero(),
    )?;
    for h in 0..h_q {
        let s = &mut scratch.weights[h * n..(h + 1) * n];
        let m = s.iter().copied().fold(R::neg_infinity(), nan_max);
        let mut sum = R::zero();
        for x in s.iter_mut() {
            *x = (*x - m).exp();
            sum = sum + *x;
        }
        max[h] = m;
        lse[h] = m + sum.ln();
        let sink = p
            .attn_sink
            .map_or(R::zero(), |sink| (R::of(sink[h]) - m).exp());
        scratch.inv_denominator[h] = R::one() / (sum + sink);
    }
    // out[h, :] = sum_j w[h, j] * V[r_j, :], again one pass over the gathered rows for all heads.
    try_refill(
        &mut scratch.acc,
        "sparse_fwd token scratch",
        h_q * d_v,
        R::zero(),
    )?;
    for (j, &r) in scratch.rows.iter().enumerate() {
        let v = &p.kv_row(r)[..d_v];
        for h in 0..h_q {
            let w = scratch.weights[h * n + j];
            let acc = &mut scratch.acc[h * d_v..(h + 1) * d_v];
            for (a, &x) in acc.iter_mut().zip(v) {
                *a = *a + w * R::of(x);
            }
        }
    }
    for h in 0..h_q {
        let inv = scratch.inv_denominator[h];
        for (o, &a) in out[h * d_v..(h + 1) * d_v]
            .iter_mut()
            .zip(&scratch.acc[h * d_v..(h + 1) * d_v])
        {
            *o = a * inv;
        }
    }
    Ok(())
}
