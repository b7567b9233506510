//! CPU reference of the dense MHA prefill, forward and backward, over packed variable-length sequences (docs/spec.md
//! section 5).
//!
//! Sequence `i` owns query rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` and key rows
//! `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` (lengths `s_q`, `s_k`). Query head `h` reads key head `h / (h_q / h_k)`
//! (grouped-query attention). Query row `r` of a sequence (`0 <= r < s_q`) attends to key rows `c < s_k`, and with
//! `causal` only to `c <= r + s_k - s_q` (bottom-right aligned, as in the decode):
//!
//! ```text
//! s[t,h,c]   = scale * dot(q[t,h,:], k[c,h/g,:])
//! lse[h,t]   = ln sum_c exp(s[t,h,c])                       (+inf for a row that attends to nothing)
//! out[t,h,:] = sum_c exp(s[t,h,c] - lse[h,t]) * v[c,h/g,:]  (0 for such a row)
//! ```
//!
//! The backward takes the forward's `out` and `lse` as given: with `p = exp(s - lse)`,
//! `delta[t,h] = sum d_out * out`, `ds = p * (dot(d_out, v) - delta)`:
//! `d_q[t,h] = scale * sum_c ds * k[c]`, `d_k[c,j] = scale * sum over the heads h of group j and the rows t that
//! attend to c of ds * q[t,h]`, `d_v[c,j] = sum p * d_out[t,h]`. Rows with `lse = +inf` contribute nothing.

use super::sparse_fwd::dot;
use super::Real;
use crate::alloc::try_filled;
use crate::cancel::CancelToken;
use crate::error::{Error, Result};
use rayon::prelude::*;

/// One dense varlen prefill problem: dimensions, sequence bounds and contiguous f32 slices of the inputs.
#[derive(Debug, Clone, Copy)]
pub struct DensePrefillProblem<'a> {
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads (`h_q % h_k == 0`).
    pub h_k: usize,
    /// Query/key width.
    pub d: usize,
    /// Value width.
    pub d_v: usize,
    /// Query row offsets of the sequences `[b + 1]`: non-decreasing, from 0 to `total_q`.
    pub cu_seqlens_q: &'a [i32],
    /// Key row offsets `[b + 1]`: non-decreasing, from 0 to `total_k`.
    pub cu_seqlens_k: &'a [i32],
    /// Queries `[total_q, h_q, d]`.
    pub q: &'a [f32],
    /// Keys `[total_k, h_k, d]`.
    pub k: &'a [f32],
    /// Values `[total_k, h_k, d_v]`.
    pub v: &'a [f32],
    /// Scale applied to every dot product.
    pub scale: f32,
    /// Bottom-right causal mask.
    pub causal: bool,
}

/// Row bounds of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seq {
    q0: usize,
    s_q: usize,
    k0: usize,
    s_k: usize,
}

/// Checks one `cu_seqlens` vector: at least two entries, starting at 0, non-decreasing, ending at `total`.
fn check_offsets(arg: &str, cu: &[i32], total: usize) -> Result<()> {
    if cu.len() < 2 {
        return Err(Error::invalid(
            arg,
            "at least 2 offsets (b + 1, b >= 1)",
            cu.len(),
        ));
    }
    if cu[0] != 0 {
        return Err(Error::invalid(format!("{arg}[0]"), 0, cu[0]));
    }
    if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
        return Err(Error::invalid(
            format!("{arg}[{i}]"),
            format!("at least {arg}[{}] = {}", i - 1, cu[i - 1]),
            cu[i],
        ));
    }
    let last = cu[cu.len() - 1];
    if usize::try_from(last).ok() != Some(total) {
        return Err(Error::invalid(
            format!("{arg}[{}]", cu.len() - 1),
            format!("the row count {total}"),
            last,
        ));
    }
    Ok(())
}

impl DensePrefillProblem<'_> {
    /// Sequences.
    pub fn batch(&self) -> usize {
        self.cu_seqlens_q.len().saturating_sub(1)
    }

    /// Query rows of all sequences.
    pub fn total_q(&self) -> usize {
        self.q.len() / (self.h_q * self.d).max(1)
    }

    /// Key rows of all sequences.
    pub fn total_k(&self) -> usize {
        self.k.len() / (self.h_k * self.d).max(1)
    }

    /// Checks the dimensions, the offsets and every slice's length.
    pub fn check(&self) -> Result<()> {
        if self.h_k == 0 || self.h_q == 0 || self.h_q % self.h_k != 0 {
            return Err(Error::invalid(
                "h_q",
                format!("a positive multiple of h_k = {}", self.h_k),
                self.h_q,
            ));
        }
        if self.d == 0 || self.d_v == 0 {
            return Err(Error::invalid(
                "d",
                "d >= 1 and d_v >= 1",
                format!("{} / {}", self.d, self.d_v),
            ));
        }
        if self.q.len() % (self.h_q * self.d) != 0 {
            return Err(Error::invalid(
                "q",
                "a multiple of h_q * d elements",
                self.q.len(),
            ));
        }
        if self.k.len() % (self.h_k * self.d) != 0 {
            return Err(Error::invalid(
                "k",
                "a multiple of h_k * d elements",
                self.k.len(),
            ));
        }
        let total_k = self.total_k();
        super::sparse_fwd::expect_len(
            "v",
            self.v.len(),
            &[total_k, self.h_k, self.d_v],
            "total_k * h_k * d_v",
        )?;
        check_offsets("cu_seqlens_q", self.cu_seqlens_q, self.total_q())?;
        check_offsets("cu_seqlens_k", self.cu_seqlens_k, total_k)?;
        if self.cu_seqlens_k.len() != self.cu_seqlens_q.len() {
            return Err(Error::invalid(
                "cu_seqlens_k",
                format!("{} offsets (as cu_seqlens_q)", self.cu_seqlens_q.len()),
                self.cu_seqlens_k.len(),
            ));
        }
        Ok(())
    }

    fn seq(&self, i: usize) -> Seq {
        let at = |cu: &[i32], j: usize| cu[j] as usize;
        let (q0, k0) = (at(self.cu_seqlens_q, i), at(self.cu_seqlens_k, i));
        Seq {
            q0,
            s_q: at(self.cu_seqlens_q, i + 1) - q0,
            k0,
            s_k: at(self.cu_seqlens_k, i + 1) - k0,
        }
    }

    /// `(sequence, row within it)` of every query row, in order.
    fn rows(&self) -> Vec<(Seq, usize)> {
        (0..self.batch())
            .flat_map(|i| {
                let s = self.seq(i);
                (0..s.s_q).map(move |r| (s, r))
            })
            .collect()
    }

    /// Key rows (absolute) query row `r` of `s` attends to.
    fn keys(&self, s: Seq, r: usize) -> std::ops::Range<usize> {
        let end = if self.causal {
            // c <= r + s_k - s_q, i.e. c < r + 1 + s_k - s_q (none when that is not positive).
            (r + 1 + s.s_k).saturating_sub(s.s_q).min(s.s_k)
        } else {
            s.s_k
        };
        s.k0..s.k0 + end
    }

    fn q_row(&self, t: usize, h: usize) -> &[f32] {
        let at = (t * self.h_q + h) * self.d;
        &self.q[at..at + self.d]
    }

    fn k_row(&self, c: usize, j: usize) -> &[f32] {
        let at = (c * self.h_k + j) * self.d;
        &self.k[at..at + self.d]
    }

    fn v_row(&self, c: usize, j: usize) -> &[f32] {
        let at = (c * self.h_k + j) * self.d_v;
        &self.v[at..at + self.d_v]
    }

    fn group(&self) -> usize {
        self.h_q / self.h_k
    }
}

/// Outputs of [`dense_prefill_fwd`].
#[derive(Debug, Clone, PartialEq)]
pub struct DensePrefillFwdResult<R> {
    /// `[total_q, h_q, d_v]`.
    pub out: Vec<R>,
    /// `[h_q, total_q]`, natural log; `+inf` for a row that attends to nothing.
    pub lse: Vec<R>,
}

/// The forward, one query row at a time (rows in parallel); `cancel` is polled before every row.
///
/// Allocates `out`, `lse` (and a row-major copy of it) and, per row, the logits of the keys it attends to.
pub fn dense_prefill_fwd<R: Real>(
    p: &DensePrefillProblem<'_>,
    cancel: &CancelToken,
) -> Result<DensePrefillFwdResult<R>> {
    p.check()?;
    let (h_q, d_v) = (p.h_q, p.d_v);
    let rows = p.rows();
    let total_q = rows.len();
    let mut out = try_filled("dense prefill out", total_q * h_q * d_v, R::zero())?;
    let mut lse_tq = try_filled("dense prefill lse", total_q * h_q, R::infinity())?;
    let scale = R::of(p.scale);
    out.par_chunks_mut(h_q * d_v.max(1))
        .zip(lse_tq.par_chunks_mut(h_q))
        .zip(rows.par_iter())
        .enumerate()
        .try_for_each(|(t, ((o, l), &(s, r)))| -> Result<()> {
            cancel.check()?;
            let keys = p.keys(s, r);
            if keys.is_empty() {
                return Ok(());
            }
            let mut logits = vec![R::zero(); keys.len()];
            for h in 0..h_q {
                let j = h / p.group();
                for (x, c) in logits.iter_mut().zip(keys.clone()) {
                    *x = scale * dot::<R>(p.q_row(t, h), p.k_row(c, j));
                }
                let m = logits.iter().copied().fold(R::neg_infinity(), R::max);
                let sum: R = logits.iter().map(|&x| (x - m).exp()).sum();
                let lse = m + sum.ln();
                l[h] = lse;
                let acc = &mut o[h * d_v..(h + 1) * d_v];
                for (&x, c) in logits.iter().zip(keys.clone()) {
                    let w = (x - lse).exp();
                    for (a, &vv) in acc.iter_mut().zip(p.v_row(c, j)) {
                        *a = *a + w * R::of(vv);
                    }
                }
            }
            Ok(())
        })?;
    // [total_q, h_q] -> [h_q, total_q]
    let mut lse = try_filled("dense prefill lse", total_q * h_q, R::zero())?;
    for t in 0..total_q {
        for h in 0..h_q {
            lse[h * total_q + t] = lse_tq[t * h_q + h];
        }
    }
    Ok(DensePrefillFwdResult { out, lse })
}

/// Bounds, per element of `out`, the error that comes from rounding the probabilities `P` to the element type before
/// the `P V` MMA, as the GPU forward does (like every 16-bit tensor-core attention): each product `p_j v_j` then
/// carries a relative error of at most `unit_roundoff` (`2^-8` for bf16, `2^-11` for fp16), so an element's error is
/// at most `unit_roundoff * sum_j p_j |v_j|`, which is the forward of the same problem with `|v|` in place of `v`.
///
/// The bound matters where attention is peaked (a few keys carry the row) and the output is small by cancellation;
/// a wrongly kept or dropped key is about `1 / unit_roundoff` times larger than its share of it, so judging errors
/// net of it still catches every real mistake. Allocates `|v|` and the forward's results.
pub fn dense_prefill_p_rounding(
    p: &DensePrefillProblem<'_>,
    unit_roundoff: f64,
    cancel: &CancelToken,
) -> Result<Vec<f64>> {
    let v_abs: Vec<f32> = p.v.iter().map(|x| x.abs()).collect();
    let abs_problem = DensePrefillProblem { v: &v_abs, ..*p };
    let res = dense_prefill_fwd::<f64>(&abs_problem, cancel)?;
    Ok(res.out.into_iter().map(|x| x * unit_roundoff).collect())
}

/// Outputs of [`dense_prefill_bwd`].
#[derive(Debug, Clone, PartialEq)]
pub struct DensePrefillBwdResult<R> {
    /// `[total_q, h_q, d]`.
    pub d_q: Vec<R>,
    /// `[total_k, h_k, d]`.
    pub d_k: Vec<R>,
    /// `[total_k, h_k, d_v]`.
    pub d_v: Vec<R>,
}

/// The backward from the forward's `out [total_q, h_q, d_v]`, `lse [h_q, total_q]` and `d_out` (as `out`).
///
/// `d_q` is computed per query row in parallel; `d_k` and `d_v` per key head and sequence in parallel (each key row
/// sums over its sequence's rows in order, so the result does not depend on the thread count). Allocates the three
/// gradients, `delta [total_q, h_q]`, and per (sequence, key head) its `d_k` / `d_v` rows before they are copied in.
pub fn dense_prefill_bwd<R: Real>(
    p: &DensePrefillProblem<'_>,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    cancel: &CancelToken,
) -> Result<DensePrefillBwdResult<R>> {
    bwd_sums::<R>(p, out, lse, d_out, cancel, false)
}

/// Bounds, per element of each gradient, the error that comes from rounding the MMA operands `P` (for `d_v`) and
/// `dS` (for `d_q` and `d_k`) to the element type, as the GPU backward does (like every 16-bit tensor-core attention
/// backward): each product then carries a relative error of at most `unit_roundoff`, so an element's error is at
/// most `unit_roundoff` times the sum of its products' absolute values. Same arguments as [`dense_prefill_bwd`];
/// allocates what it does.
pub fn dense_prefill_bwd_rounding(
    p: &DensePrefillProblem<'_>,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    unit_roundoff: f64,
    cancel: &CancelToken,
) -> Result<DensePrefillBwdResult<f64>> {
    let mut m = bwd_sums::<f64>(p, out, lse, d_out, cancel, true)?;
    for x in m
        .d_q
        .iter_mut()
        .chain(m.d_k.iter_mut())
        .chain(m.d_v.iter_mut())
    {
        *x *= unit_roundoff;
    }
    Ok(m)
}

/// The backward's sums, or with `magnitudes` the sums of their terms' absolute values.
fn bwd_sums<R: Real>(
    p: &DensePrefillProblem<'_>,
    out: &[f32],
    lse: &[f32],
    d_out: &[f32],
    cancel: &CancelToken,
    magnitudes: bool,
) -> Result<DensePrefillBwdResult<R>> {
    use super::sparse_fwd::expect_len;
    let term = |x: R| if magnitudes { x.abs() } else { x };
    p.check()?;
    let (h_q, h_k, d, d_v) = (p.h_q, p.h_k, p.d, p.d_v);
    let rows = p.rows();
    let (total_q, total_k) = (rows.len(), p.total_k());
    expect_len(
        "out",
        out.len(),
        &[total_q, h_q, d_v],
        "total_q * h_q * d_v",
    )?;
    expect_len(
        "d_out",
        d_out.len(),
        &[total_q, h_q, d_v],
        "total_q * h_q * d_v",
    )?;
    expect_len("lse", lse.len(), &[h_q, total_q], "h_q * total_q")?;
    let scale = R::of(p.scale);
    let row_of = |t: usize, h: usize| (t * h_q + h) * d_v;
    let delta: Vec<R> = (0..total_q * h_q)
        .map(|i| dot::<R>(&out[i * d_v..(i + 1) * d_v], &d_out[i * d_v..(i + 1) * d_v]))
        .collect();
    // (p, ds) of query row t, head h, key row c; None for a row without keys.
    let grad = |t: usize, h: usize, c: usize| -> Option<(R, R)> {
        let l = R::of(lse[h * total_q + t]);
        if l == R::infinity() {
            return None;
        }
        let j = h / p.group();
        let s = scale * dot::<R>(p.q_row(t, h), p.k_row(c, j));
        let prob = (s - l).exp();
        let dp = dot::<R>(&d_out[row_of(t, h)..row_of(t, h) + d_v], p.v_row(c, j));
        Some((prob, prob * (dp - delta[t * h_q + h])))
    };

    let mut d_q = try_filled("dense prefill d_q", total_q * h_q * d, R::zero())?;
    d_q.par_chunks_mut(h_q * d)
        .zip(rows.par_iter())
        .enumerate()
        .try_for_each(|(t, (dq, &(s, r)))| -> Result<()> {
            cancel.check()?;
            for h in 0..h_q {
                let j = h / p.group();
                for c in p.keys(s, r) {
                    if let Some((_, ds)) = grad(t, h, c) {
                        for (a, &kk) in dq[h * d..(h + 1) * d].iter_mut().zip(p.k_row(c, j)) {
                            *a = *a + term(scale * ds * R::of(kk));
                        }
                    }
                }
            }
            Ok(())
        })?;

    // d_k, d_v: one task per (sequence, key head); each writes only its sequence's key rows of that head.
    let tasks: Vec<(Seq, usize)> = (0..p.batch())
        .flat_map(|i| (0..h_k).map(move |j| (p.seq(i), j)))
        .collect();
    let parts = tasks
        .par_iter()
        .map(|&(s, j)| -> Result<(Seq, usize, Vec<R>, Vec<R>)> {
            cancel.check()?;
            let mut dk = vec![R::zero(); s.s_k * d];
            let mut dv = vec![R::zero(); s.s_k * d_v];
            for r in 0..s.s_q {
                let t = s.q0 + r;
                for h in j * p.group()..(j + 1) * p.group() {
                    for c in p.keys(s, r) {
                        let Some((prob, ds)) = grad(t, h, c) else {
                            continue;
                        };
                        let kc = c - s.k0;
                        for (a, &qq) in dk[kc * d..(kc + 1) * d].iter_mut().zip(p.q_row(t, h)) {
                            *a = *a + term(scale * ds * R::of(qq));
                        }
                        let g = &d_out[row_of(t, h)..row_of(t, h) + d_v];
                        for (a, &gg) in dv[kc * d_v..(kc + 1) * d_v].iter_mut().zip(g) {
                            *a = *a + term(prob * R::of(gg));
                        }
                    }
                }
            }
            Ok((s, j, dk, dv))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut d_k = try_filled("dense prefill d_k", total_k * h_k * d, R::zero())?;
    let mut d_vv = try_filled("dense prefill d_v", total_k * h_k * d_v, R::zero())?;
    for (s, j, dk, dv) in parts {
        for kc in 0..s.s_k {
            let c = s.k0 + kc;
            d_k[(c * h_k + j) * d..(c * h_k + j + 1) * d]
                .copy_from_slice(&dk[kc * d..(kc + 1) * d]);
            d_vv[(c * h_k + j) * d_v..(c * h_k + j + 1) * d_v]
                .copy_from_slice(&dv[kc * d_v..(kc + 1) * d_v]);
        }
    }
    Ok(DensePrefillBwdResult {
        d_q,
        d_k,
        d_v: d_vv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    struct Case {
        cu_q: Vec<i32>,
        cu_k: Vec<i32>,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        h_q: usize,
        h_k: usize,
        d: usize,
        d_v: usize,
    }

    fn case(
        lens: &[(usize, usize)],
        h_q: usize,
        h_k: usize,
        d: usize,
        d_v: usize,
        seed: u64,
    ) -> Case {
        let mut s = seed;
        let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
        for &(a, b) in lens {
            cu_q.push(cu_q.last().unwrap() + a as i32);
            cu_k.push(cu_k.last().unwrap() + b as i32);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let mut gen = |n: usize| (0..n).map(|_| lcg(&mut s)).collect::<Vec<f32>>();
        Case {
            q: gen(tq * h_q * d),
            k: gen(tk * h_k * d),
            v: gen(tk * h_k * d_v),
            cu_q,
            cu_k,
            h_q,
            h_k,
            d,
            d_v,
        }
    }

    impl Case {
        fn problem(&self, causal: bool) -> DensePrefillProblem<'_> {
            DensePrefillProblem {
                h_q: self.h_q,
                h_k: self.h_k,
                d: self.d,
                d_v: self.d_v,
                cu_seqlens_q: &self.cu_q,
                cu_seqlens_k: &self.cu_k,
                q: &self.q,
                k: &self.k,
                v: &self.v,
                scale: 0.7,
                causal,
            }
        }
    }

    /// The loss `sum(out * w)` of the forward in f64, for finite differences.
    fn loss(p: &DensePrefillProblem<'_>, w: &[f64]) -> f64 {
        let f = dense_prefill_fwd::<f64>(p, CancelToken::never()).unwrap();
        f.out.iter().zip(w).map(|(a, b)| a * b).sum()
    }

    #[test]
    fn forward_matches_a_direct_softmax_with_gqa_causal_and_empty_rows() {
        // Sequence 0: 3 queries over 5 keys (causal: row 0 sees keys 0..=2); sequence 1: 4 queries over 2 keys
        // (causal: rows 0 and 1 see nothing); sequence 2: no queries; sequence 3: 2 queries, no keys.
        let c = case(&[(3, 5), (4, 2), (0, 3), (2, 0)], 4, 2, 5, 3, 1);
        for causal in [false, true] {
            let p = c.problem(causal);
            let f = dense_prefill_fwd::<f64>(&p, CancelToken::never()).unwrap();
            let total_q = 9;
            for (t, &(s, r)) in p.rows().iter().enumerate() {
                for h in 0..4 {
                    let j = h / 2;
                    let keys: Vec<usize> = (0..s.s_k)
                        .filter(|&c| !causal || c as i64 <= r as i64 + s.s_k as i64 - s.s_q as i64)
                        .map(|c| s.k0 + c)
                        .collect();
                    let lse = f.lse[h * total_q + t];
                    let o = &f.out[(t * 4 + h) * 3..(t * 4 + h + 1) * 3];
                    if keys.is_empty() {
                        assert_eq!(lse, f64::INFINITY);
                        assert!(o.iter().all(|&x| x == 0.0));
                        continue;
                    }
                    let qr = &c.q[(t * 4 + h) * 5..(t * 4 + h + 1) * 5];
                    let logits: Vec<f64> = keys
                        .iter()
                        .map(|&kc| {
                            let kr = &c.k[(kc * 2 + j) * 5..(kc * 2 + j + 1) * 5];
                            0.7f32 as f64
                                * qr.iter()
                                    .zip(kr)
                                    .map(|(&x, &y)| x as f64 * y as f64)
                                    .sum::<f64>()
                        })
                        .collect();
                    let z: f64 = logits.iter().map(|x| x.exp()).sum();
                    assert!((lse - z.ln()).abs() < 1e-12);
                    for (e, &got) in o.iter().enumerate() {
                        let want: f64 = keys
                            .iter()
                            .zip(&logits)
                            .map(|(&kc, x)| x.exp() / z * c.v[(kc * 2 + j) * 3 + e] as f64)
                            .sum();
                        assert!((got - want).abs() < 1e-12, "t {t} h {h} e {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let c = case(&[(3, 5), (4, 2), (2, 0)], 4, 2, 4, 3, 7);
        for causal in [false, true] {
            let p = c.problem(causal);
            let f = dense_prefill_fwd::<f64>(&p, CancelToken::never()).unwrap();
            let mut s = 99u64;
            let w: Vec<f64> = (0..f.out.len()).map(|_| lcg(&mut s) as f64).collect();
            let out: Vec<f32> = f.out.iter().map(|&x| x as f32).collect();
            let lse: Vec<f32> = f.lse.iter().map(|&x| x as f32).collect();
            let d_out: Vec<f32> = w.iter().map(|&x| x as f32).collect();
            let g = dense_prefill_bwd::<f64>(&p, &out, &lse, &d_out, CancelToken::never()).unwrap();
            let eps = 1e-3f32;
            let numeric = |which: usize, i: usize| -> f64 {
                let at = |delta: f32| -> f64 {
                    let mut t = [c.q.clone(), c.k.clone(), c.v.clone()];
                    t[which][i] += delta;
                    let pp = DensePrefillProblem {
                        q: &t[0],
                        k: &t[1],
                        v: &t[2],
                        ..p
                    };
                    loss(&pp, &w)
                };
                (at(eps) - at(-eps)) / (2.0 * eps as f64)
            };
            for (which, grad) in [(0, &g.d_q), (1, &g.d_k), (2, &g.d_v)] {
                for (i, &an) in grad.iter().enumerate() {
                    let num = numeric(which, i);
                    assert!(
                        (an - num).abs() < 2e-3,
                        "causal {causal} tensor {which} element {i}: {an} vs {num}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_offsets_and_heads_are_named() {
        let c = case(&[(2, 2)], 4, 2, 4, 3, 3);
        let mut p = c.problem(false);
        let bad_q = [0, 3];
        p.cu_seqlens_q = &bad_q;
        let e = dense_prefill_fwd::<f32>(&p, CancelToken::never()).unwrap_err();
        assert!(e.to_string().contains("cu_seqlens_q[1]"), "{e}");
        let mut p = c.problem(false);
        let down = [0, 2, 1];
        let down_k = [0, 1, 2];
        p.cu_seqlens_q = &down;
        p.cu_seqlens_k = &down_k;
        let e = dense_prefill_fwd::<f32>(&p, CancelToken::never()).unwrap_err();
        assert!(e.to_string().contains("cu_seqlens_q[2]"), "{e}");
        let mut p = c.problem(false);
        p.h_k = 3;
        let e = dense_prefill_fwd::<f32>(&p, CancelToken::never()).unwrap_err();
        assert!(e.to_string().contains("h_q"), "{e}");
    }

    /// `x` rounded to bf16 (round to nearest even), as f64.
    fn bf16_round(x: f64) -> f64 {
        half::bf16::from_f64(x).to_f64()
    }

    #[test]
    fn the_rounding_bounds_cover_a_computation_that_rounds_p_and_ds_to_bf16() {
        // One sequence, one head, peaked logits (q scaled up): the GPU kernels' roundings emulated in f64.
        let mut c = case(&[(6, 40)], 1, 1, 8, 4, 7);
        c.q.iter_mut().for_each(|x| *x *= 20.0);
        let p = c.problem(false);
        let (s_q, s_k, d, d_v) = (6, 40, 8, 4);
        let u = 1.0 / 256.0;
        let fwd = dense_prefill_fwd::<f64>(&p, CancelToken::never()).unwrap();
        let allow_out = dense_prefill_p_rounding(&p, u, CancelToken::never()).unwrap();
        let mut g = 3u64;
        let d_out: Vec<f32> = (0..s_q * d_v).map(|_| lcg(&mut g)).collect();
        let lse: Vec<f32> = fwd.lse.iter().map(|&x| x as f32).collect();
        let out: Vec<f32> = fwd.out.iter().map(|&x| x as f32).collect();
        let bwd = dense_prefill_bwd::<f64>(&p, &out, &lse, &d_out, CancelToken::never()).unwrap();
        let allow =
            dense_prefill_bwd_rounding(&p, &out, &lse, &d_out, u, CancelToken::never()).unwrap();
        let scale = 0.7f64;
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(&x, &y)| x as f64 * y as f64)
                .sum::<f64>()
        };
        let mut worst = 0.0f64;
        let mut d_v_emul = vec![0.0f64; s_k * d_v];
        for r in 0..s_q {
            let qr = &c.q[r * d..(r + 1) * d];
            let logits: Vec<f64> = (0..s_k)
                .map(|j| scale * dot(qr, &c.k[j * d..(j + 1) * d]))
                .collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|&x| (x - m).exp()).collect();
            let l: f64 = e.iter().sum();
            let delta = dot(&out[r * d_v..(r + 1) * d_v], &d_out[r * d_v..(r + 1) * d_v]);
            let mut dq = vec![0.0f64; d];
            for j in 0..s_k {
                let prob = (logits[j] - lse[r] as f64).exp();
                let dp = dot(&d_out[r * d_v..(r + 1) * d_v], &c.v[j * d_v..(j + 1) * d_v]);
                let ds = bf16_round(prob * (dp - delta));
                for (a, &kk) in dq.iter_mut().zip(&c.k[j * d..(j + 1) * d]) {
                    *a += scale * ds * kk as f64;
                }
                for (a, &g) in d_v_emul[j * d_v..(j + 1) * d_v]
                    .iter_mut()
                    .zip(&d_out[r * d_v..(r + 1) * d_v])
                {
                    *a += bf16_round(prob) * g as f64;
                }
            }
            for (i, &x) in dq.iter().enumerate() {
                let at = r * d + i;
                assert!((x - bwd.d_q[at]).abs() <= allow.d_q[at] + 1e-9, "d_q[{at}]");
            }
            for i in 0..d_v {
                // The forward: P rounded for P V, the denominator from the unrounded P.
                let o: f64 = (0..s_k)
                    .map(|j| bf16_round(e[j]) * c.v[j * d_v + i] as f64)
                    .sum::<f64>()
                    / l;
                let at = r * d_v + i;
                let err = (o - fwd.out[at]).abs();
                assert!(
                    err <= allow_out[at] + 1e-12,
                    "out[{at}]: {err} > {}",
                    allow_out[at]
                );
                worst = worst.max(err / allow_out[at]);
            }
        }
        for (at, &x) in d_v_emul.iter().enumerate() {
            assert!((x - bwd.d_v[at]).abs() <= allow.d_v[at] + 1e-9, "d_v[{at}]");
        }
        // The bound is not vacuous: the emulated error uses a good part of it somewhere.
        assert!(worst > 0.05, "worst error / bound {worst}");
    }
}
