//! CPU reference of MLA decode over a paged KV cache (docs/spec.md section 4): dense (bf16/f16 cache, block table)
//! and sparse (FP8 cache, per-token indices, optional "extra" cache), plus the split-KV pieces a GPU uses:
//! the pure [`decode_schedule`], the per-chunk partial results and their [`combine`].
//!
//! Rows are `(request b, query i, head h)`. Each row attends to a set of *keys*; `out` is the
//! softmax-weighted sum of the keys' first `d_v` columns (V is part of the K row), `lse` the natural-log
//! log-sum-exp of the logits `softmax_scale * dot(q, k)`. A row without any key gives `out = 0`,
//! `lse = +inf`. The optional sink is an extra logit with a zero value vector: it damps `out` and leaves
//! `lse` unchanged (docs/spec.md section 1).
//!
//! Which keys exist (rules the GPU kernels follow too, so that no kernel ever reads outside its buffers):
//! * Dense: request `b` has `s_k = clamp(cache_seqlens[b], 0, max_blocks * page_size)` key positions; key
//!   `p` lives in block `block_table[b][p / page_size]`, slot `p % page_size`. A block id outside
//!   `0..num_blocks` makes that key **not exist** (it is skipped, like a masked key). The ops reject such
//!   values on the host before running ([`crate::ops::decode`]); a GPU kernel cannot read device memory to
//!   validate, so it applies the same skip rule. Causal masking is bottom-right aligned: query `i` of `s_q`
//!   sees positions `< s_k - s_q + i + 1` (ignored when `s_q == 1`).
//! * Sparse: request `b`'s key positions are its `n_main = clamp(topk_length[b], 0, topk)` (or `topk`)
//!   entries of `indices[b, i, :]` followed by its `n_extra` entries of `extra_indices[b, i, :]`. An index is
//!   `block * page_size + offset`; any value `< 0` or `>= num_blocks * page_size` (not only -1) is invalid
//!   and takes no part. Keys are the dequantised cache tokens ([`dequantize_token`]).
//!
//! Memory past `s_k` (dense) or behind invalid indices (sparse) is never read, so NaN there cannot leak.

use super::Real;
use crate::alloc::{try_clear_for, try_collect, try_filled, try_from_fn, try_with_capacity};
use crate::cancel::CancelToken;
use crate::error::{Error, Result};
use crate::reference::kv_quant::{dequantize_token, CacheLayout};
use rayon::prelude::*;
use std::ops::Range;

// The schedule lives in its own file (the GPU launcher shares its constants and tests its rule against it); its
// items are re-exported below.
mod schedule;
pub use schedule::{
    aligned_budget, balanced_budget, decode_schedule, DecodeSchedule, KvChunk, ScheduleConfig,
    ScheduleShape, CHUNK_OVERHEAD_TILES, KEYS_PER_TILE, MAX_BUDGET_FLOOR, MAX_REQUEST_PARTS,
    ROWS_PER_CTA,
};

/// Outputs of a full decode: `out [b, s_q, h_q, d_v]` and `lse [b, h_q, s_q]` (natural log, `+inf` for
/// rows without keys).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeResult<R> {
    /// `[b, s_q, h_q, d_v]`.
    pub out: Vec<R>,
    /// `[b, h_q, s_q]`.
    pub lse: Vec<R>,
}

/// The result of one request over one chunk of its keys, before [`combine`]: per row, `out` normalised
/// within the chunk and the chunk's log-sum-exp. A row with no key in the chunk has `lse = -inf` (so that it
/// gets weight 0 in the combine) and `out = 0`. No sink is applied here.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePartial<R> {
    /// `[s_q, h_q, d_v]`.
    pub out: Vec<R>,
    /// `[s_q, h_q]`.
    pub lse: Vec<R>,
}

/// Row geometry of one request: `s_q` queries of `h_q` heads, `d_v` output columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowShape {
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Output (value) width.
    pub d_v: usize,
}

/// Dimensions of a dense decode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DenseDecodeProblem {
    /// Requests `b`.
    pub batch: usize,
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key heads; `h_q % h_kv == 0` and head `h` reads key head `h / (h_q / h_kv)`.
    pub h_kv: usize,
    /// Query/key width.
    pub d_qk: usize,
    /// Value width: the first `d_v <= d_qk` columns of a key row.
    pub d_v: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Logit scale.
    pub softmax_scale: f32,
    /// Bottom-right causal masking (ignored when `s_q == 1`).
    pub causal: bool,
}

/// Inputs of a dense decode: contiguous slices holding the input values.
#[derive(Debug, Clone, Copy)]
pub struct DenseDecodeInputs<'a> {
    /// `[b, s_q, h_q, d_qk]`.
    pub q: &'a [f32],
    /// `[num_blocks, page_size, h_kv, d_qk]`.
    pub k_cache: &'a [f32],
    /// `[b, max_blocks]`.
    pub block_table: &'a [i32],
    /// `[b]`.
    pub cache_seqlens: &'a [i32],
    /// `[h_q]`, optional.
    pub attn_sink: Option<&'a [f32]>,
}

/// Checks that a slice has the length its shape implies.
fn expect_len(arg: &str, len: usize, want: usize, shape: &str) -> Result<()> {
    if len == want {
        return Ok(());
    }
    Err(Error::invalid(arg, format!("{want} values ({shape})"), len))
}

impl DenseDecodeProblem {
    /// Checks the problem's consistency and the inputs' lengths.
    pub fn check(&self, x: &DenseDecodeInputs<'_>) -> Result<()> {
        if self.h_kv == 0 || self.h_q % self.h_kv != 0 {
            return Err(Error::invalid(
                "h_q",
                format!("a multiple of h_kv = {}", self.h_kv),
                self.h_q,
            ));
        }
        if self.d_v > self.d_qk {
            return Err(Error::invalid(
                "d_v",
                format!("at most d_qk = {}", self.d_qk),
                self.d_v,
            ));
        }
        if self.page_size == 0 {
            return Err(Error::invalid("page_size", "at least 1", 0));
        }
        let (b, s_q, h_q, d) = (self.batch, self.s_q, self.h_q, self.d_qk);
        expect_len("q", x.q.len(), b * s_q * h_q * d, "b * s_q * h_q * d_qk")?;
        let cache = self.num_blocks * self.page_size * self.h_kv * d;
        expect_len(
            "k_cache",
            x.k_cache.len(),
            cache,
            "num_blocks * page_size * h_kv * d_qk",
        )?;
        expect_len(
            "block_table",
            x.block_table.len(),
            b * self.max_blocks,
            "b * max_blocks",
        )?;
        expect_len("cache_seqlens", x.cache_seqlens.len(), b, "b")?;
        if let Some(s) = x.attn_sink {
            expect_len("attn_sink", s.len(), h_q, "h_q")?;
        }
        Ok(())
    }

    /// Key positions of request `b`: `cache_seqlens[b]` clamped to `0..=max_blocks * page_size`.
    pub fn num_keys(&self, x: &DenseDecodeInputs<'_>, b: usize) -> usize {
        let cap = self.max_blocks * self.page_size;
        usize::try_from(x.cache_seqlens[b]).map_or(0, |n| n.min(cap))
    }

    /// Key positions of every request (the schedule's input).
    pub fn key_counts(&self, x: &DenseDecodeInputs<'_>) -> Vec<usize> {
        (0..self.batch).map(|b| self.num_keys(x, b)).collect()
    }

    /// Positions query `i` may see in a request of `s_k` keys: `0..s_k - s_q + i + 1` when causal.
    pub fn visible_keys(&self, s_k: usize, i: usize) -> usize {
        if self.causal && self.s_q > 1 {
            (s_k + i + 1).saturating_sub(self.s_q).min(s_k)
        } else {
            s_k
        }
    }

    /// The key row at position `pos` of request `b`, head `kv_head`, or `None` when its block id is out of range.
    fn key<'a>(
        &self,
        x: &DenseDecodeInputs<'a>,
        b: usize,
        pos: usize,
        kv_head: usize,
    ) -> Option<&'a [f32]> {
        let block = x.block_table[b * self.max_blocks + pos / self.page_size];
        let block = usize::try_from(block)
            .ok()
            .filter(|&k| k < self.num_blocks)?;
        let token = block * self.page_size + pos % self.page_size;
        let at = (token * self.h_kv + kv_head) * self.d_qk;
        Some(&x.k_cache[at..at + self.d_qk])
    }

    /// Fills one `(b, i)` row group (`h_q` heads) over the key positions `keys`; writes per-head lse
    /// (`empty_lse` where no key exists). Fails only when its scratch cannot be allocated.
    fn rows<R: Real>(
        &self,
        x: &DenseDecodeInputs<'_>,
        (b, i): (usize, usize),
        keys: &Range<usize>,
        finish: Finish<'_, R>,
        out: &mut [R],
        lse: &mut [R],
    ) -> Result<()> {
        let heads_per_kv = self.h_q / self.h_kv;
        let end = keys.end.min(self.visible_keys(self.num_keys(x, b), i));
        let scale = R::of(self.softmax_scale);
        let mut rows: Vec<&[f32]> = Vec::new();
        for g in 0..self.h_kv {
            try_clear_for(
                &mut rows,
                "decode row scratch",
                end.saturating_sub(keys.start),
            )?;
            rows.extend((keys.start..end).filter_map(|p| self.key(x, b, p, g)));
            for h in g * heads_per_kv..(g + 1) * heads_per_kv {
                let qo = ((b * self.s_q + i) * self.h_q + h) * self.d_qk;
                let q = &x.q[qo..qo + self.d_qk];
                let o = &mut out[h * self.d_v..(h + 1) * self.d_v];
                lse[h] = attend_row(q, &rows, scale, finish.sink.map(|s| s[h]), o)?
                    .unwrap_or(finish.empty_lse);
            }
        }
        Ok(())
    }
}

/// How rows are finished: a whole decode applies the sink and gives rows without keys `lse = +inf` (the
/// spec convention); a partial applies no sink and gives them `-inf`, so the combine weighs them 0.
#[derive(Clone, Copy)]
struct Finish<'a, R> {
    sink: Option<&'a [f32]>,
    empty_lse: R,
}

impl<'a, R: Real> Finish<'a, R> {
    fn whole(sink: Option<&'a [f32]>) -> Self {
        Finish {
            sink,
            empty_lse: R::infinity(),
        }
    }
    fn partial() -> Self {
        Finish {
            sink: None,
            empty_lse: R::neg_infinity(),
        }
    }
}

/// Softmax over `keys` for one query row: writes `out` (`d_v` values) and returns the log-sum-exp of the
/// logits without the sink, or `None` (and `out = 0`) when there is no key. Fails only when its scratch cannot
/// be allocated.
fn attend_row<R: Real>(
    q: &[f32],
    keys: &[&[f32]],
    scale: R,
    sink: Option<f32>,
    out: &mut [R],
) -> Result<Option<R>> {
    out.iter_mut().for_each(|o| *o = R::zero());
    if keys.is_empty() {
        return Ok(None);
    }
    let logits: Vec<R> = try_collect(
        "decode row scratch",
        keys.len(),
        keys.iter().map(|k| {
            scale
                * q.iter()
                    .zip(k.iter())
                    .map(|(&a, &c)| R::of(a) * R::of(c))
                    .sum::<R>()
        }),
    )?;
    let max = logits.iter().fold(R::neg_infinity(), |m, &s| m.max(s));
    let weights: Vec<R> = try_collect(
        "decode row scratch",
        logits.len(),
        logits.iter().map(|&s| (s - max).exp()),
    )?;
    let sum: R = weights.iter().copied().sum();
    // The sink adds exp(sink - max) to the denominator only: it has no value vector.
    let denom = sum + sink.map_or(R::zero(), |s| (R::of(s) - max).exp());
    for (k, &w) in keys.iter().zip(&weights) {
        let p = w / denom;
        for (o, &v) in out.iter_mut().zip(k.iter()) {
            *o = *o + p * R::of(v);
        }
    }
    Ok(Some(max + sum.ln()))
}

/// Runs `fill(b, i, out_rows, lse_rows)` for every `(b, i)` in parallel and returns `out [b, s_q, h_q, d_v]`
/// and `lse [b, h_q, s_q]` (transposed from the per-row layout). Polls `cancel` before every `(b, i)`.
fn run_rows<R: Real>(
    (batch, s_q, h_q, d_v): (usize, usize, usize, usize),
    cancel: &CancelToken,
    fill: impl Fn(usize, usize, &mut [R], &mut [R]) -> Result<()> + Sync,
) -> Result<DecodeResult<R>> {
    let rows = batch * s_q * h_q;
    let mut out = try_filled("decode out", rows * d_v, R::zero())?;
    let mut lse_rows = try_filled("decode lse", rows, R::zero())?;
    if !out.is_empty() {
        out.par_chunks_mut(h_q * d_v)
            .zip(lse_rows.par_chunks_mut(h_q))
            .enumerate()
            .try_for_each(|(r, (o, l))| {
                cancel.check()?;
                fill(r / s_q, r % s_q, o, l)
            })?;
    }
    // lse[b, h, i] = lse_rows[b, i, h].
    let lse = try_from_fn("decode lse", rows, |k| {
        let (b, h, i) = (k / (h_q * s_q), k / s_q % h_q, k % s_q);
        lse_rows[(b * s_q + i) * h_q + h]
    })?;
    Ok(DecodeResult { out, lse })
}

/// Dense decode over the whole key range of every request (no split). Allocates the outputs.
pub fn decode_dense<R: Real>(
    p: &DenseDecodeProblem,
    x: &DenseDecodeInputs<'_>,
) -> Result<DecodeResult<R>> {
    decode_dense_with(p, x, CancelToken::never())
}

/// [`decode_dense`], stopping with [`Error::Interrupted`] soon after `cancel` is cancelled (it is polled
/// before every query row).
pub fn decode_dense_with<R: Real>(
    p: &DenseDecodeProblem,
    x: &DenseDecodeInputs<'_>,
    cancel: &CancelToken,
) -> Result<DecodeResult<R>> {
    p.check(x)?;
    let all = 0..usize::MAX;
    run_rows((p.batch, p.s_q, p.h_q, p.d_v), cancel, |b, i, o, l| {
        p.rows(x, (b, i), &all, Finish::whole(x.attn_sink), o, l)
    })
}

/// The partial result of request `request` over its key positions `keys` (clamped to the request's keys;
/// any range is allowed, including an empty one). No sink: it is applied once, in [`combine`].
pub fn decode_dense_partial<R: Real>(
    p: &DenseDecodeProblem,
    x: &DenseDecodeInputs<'_>,
    request: usize,
    keys: Range<usize>,
) -> Result<DecodePartial<R>> {
    p.check(x)?;
    check_request(request, p.batch)?;
    partial(p.s_q, p.h_q, p.d_v, |i, o, l| {
        p.rows(x, (request, i), &keys, Finish::partial(), o, l)
    })
}

fn check_request(request: usize, batch: usize) -> Result<()> {
    if request < batch {
        return Ok(());
    }
    Err(Error::invalid(
        "request",
        format!("an index below b = {batch}"),
        request,
    ))
}

fn partial<R: Real>(
    s_q: usize,
    h_q: usize,
    d_v: usize,
    fill: impl Fn(usize, &mut [R], &mut [R]) -> Result<()> + Sync,
) -> Result<DecodePartial<R>> {
    let mut out = try_filled("decode partial out", s_q * h_q * d_v, R::zero())?;
    let mut lse = try_filled("decode partial lse", s_q * h_q, R::zero())?;
    if !out.is_empty() {
        out.par_chunks_mut(h_q * d_v)
            .zip(lse.par_chunks_mut(h_q))
            .enumerate()
            .try_for_each(|(i, (o, l))| fill(i, o, l))?;
    }
    Ok(DecodePartial { out, lse })
}

/// Merges the partial results of one request's chunks, as the GPU combine kernel does, in `R`:
/// per row, `m = max_c lse_c`, weights `w_c = exp(lse_c - m)`, `lse = m + ln(sum_c w_c)`, and
/// `out = sum_c w_c * out_c / (sum_c w_c + exp(sink - m))`. Chunks with `lse = -inf` (no key) get weight 0.
/// The sink is applied here, once. A row whose chunks are all empty gets `out = 0`, `lse = +inf`.
///
/// Returns `out [s_q, h_q, d_v]` and `lse [h_q, s_q]` (this request's slices of the spec outputs).
pub fn combine<R: Real>(
    partials: &[DecodePartial<R>],
    shape: RowShape,
    attn_sink: Option<&[f32]>,
) -> Result<(Vec<R>, Vec<R>)> {
    let RowShape { s_q, h_q, d_v } = shape;
    for (c, part) in partials.iter().enumerate() {
        expect_len(
            &format!("partials[{c}].out"),
            part.out.len(),
            s_q * h_q * d_v,
            "s_q * h_q * d_v",
        )?;
        expect_len(
            &format!("partials[{c}].lse"),
            part.lse.len(),
            s_q * h_q,
            "s_q * h_q",
        )?;
    }
    if let Some(s) = attn_sink {
        expect_len("attn_sink", s.len(), h_q, "h_q")?;
    }
    let mut out = vec![R::zero(); s_q * h_q * d_v];
    let mut lse = vec![R::infinity(); s_q * h_q];
    for row in 0..s_q * h_q {
        let (i, h) = (row / h_q, row % h_q);
        let max = partials
            .iter()
            .fold(R::neg_infinity(), |m, c| m.max(c.lse[row]));
        if max == R::neg_infinity() {
            continue; // every chunk empty: out stays 0, lse +inf
        }
        let weights: Vec<R> = partials.iter().map(|c| (c.lse[row] - max).exp()).collect();
        let sum: R = weights.iter().copied().sum();
        let denom = sum + attn_sink.map_or(R::zero(), |s| (R::of(s[h]) - max).exp());
        let o = &mut out[row * d_v..(row + 1) * d_v];
        for (c, &w) in partials.iter().zip(&weights) {
            let scale = w / denom;
            for (a, &v) in o.iter_mut().zip(&c.out[row * d_v..(row + 1) * d_v]) {
                *a = *a + scale * v;
            }
        }
        lse[h * s_q + i] = max + sum.ln();
    }
    Ok((out, lse))
}

/// Runs `partial_of(request, keys)` for every chunk of `schedule` (in parallel) and combines each request's
/// partials. Shared by the dense and sparse split paths.
fn run_split<R: Real>(
    (batch, s_q, h_q, d_v): (usize, usize, usize, usize),
    schedule: &DecodeSchedule,
    attn_sink: Option<&[f32]>,
    partial_of: impl Fn(usize, Range<usize>) -> Result<DecodePartial<R>> + Sync,
) -> Result<DecodeResult<R>> {
    if schedule.request_chunks.len() != batch + 1 {
        return Err(Error::invalid(
            "schedule",
            format!("a schedule for b = {batch} requests"),
            schedule.request_chunks.len().saturating_sub(1),
        ));
    }
    let partials: Vec<DecodePartial<R>> = schedule
        .chunks
        .par_iter()
        .map(|c| partial_of(c.request, c.start..c.end))
        .collect::<Result<_>>()?;
    let shape = RowShape { s_q, h_q, d_v };
    let mut res = DecodeResult {
        out: Vec::with_capacity(batch * s_q * h_q * d_v),
        lse: Vec::with_capacity(batch * h_q * s_q),
    };
    for b in 0..batch {
        let mine = &partials[schedule.request_chunks[b]..schedule.request_chunks[b + 1]];
        let (o, l) = combine(mine, shape, attn_sink)?;
        res.out.extend(o);
        res.lse.extend(l);
    }
    Ok(res)
}

/// Dense decode the split-KV way: one partial per chunk of `schedule` (built by [`decode_schedule`] from
/// [`DenseDecodeProblem::key_counts`]), then [`combine`] per request. Equals [`decode_dense`] up to rounding.
pub fn decode_dense_split<R: Real>(
    p: &DenseDecodeProblem,
    x: &DenseDecodeInputs<'_>,
    schedule: &DecodeSchedule,
) -> Result<DecodeResult<R>> {
    p.check(x)?;
    run_split(
        (p.batch, p.s_q, p.h_q, p.d_v),
        schedule,
        x.attn_sink,
        |b, keys| decode_dense_partial(p, x, b, keys),
    )
}

/// Dimensions of a sparse (FP8 cache) decode. `d_qk` comes from the cache format.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseDecodeProblem {
    /// Requests `b`.
    pub batch: usize,
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads (all read the one latent key head).
    pub h_q: usize,
    /// Value width: the first `d_v <= d_qk` columns of a dequantised token.
    pub d_v: usize,
    /// Logit scale.
    pub softmax_scale: f32,
}

/// One FP8 cache with the indices that select its tokens.
#[derive(Debug, Clone, Copy)]
pub struct SparseKv<'a> {
    /// Geometry (format, blocks, page size, block stride in bytes).
    pub layout: CacheLayout,
    /// The cache bytes, block `k` starting at `k * layout.block_stride`; the last block need not be padded.
    pub cache: &'a [u8],
    /// `[b, s_q, topk]` token indices `block * page_size + offset`; invalid when `< 0` or `>= num_tokens`.
    pub indices: &'a [i32],
    /// Entries per query row.
    pub topk: usize,
    /// `[b]`, optional: entries at positions `>= topk_length[b]` are ignored (clamped to `0..=topk`).
    pub topk_length: Option<&'a [i32]>,
}

impl SparseKv<'_> {
    /// Bytes a cache of this layout must hold (the last block's padding excluded).
    fn span(&self) -> usize {
        let l = &self.layout;
        match l.num_blocks {
            0 => 0,
            n => (n - 1) * l.block_stride + l.page_size * l.format.bytes_per_token(),
        }
    }

    fn check(&self, names: [&str; 3], p: &SparseDecodeProblem, d_qk: usize) -> Result<()> {
        let [cache, indices, topk_length] = names;
        self.layout.check()?;
        if self.layout.format.d_qk() != d_qk {
            return Err(Error::invalid(
                format!("{cache}.format"),
                format!("a format with d_qk = {d_qk}"),
                self.layout.format.name(),
            ));
        }
        if self.cache.len() < self.span() {
            return Err(Error::invalid(
                cache,
                format!("at least {} bytes", self.span()),
                self.cache.len(),
            ));
        }
        let rows = p.batch * p.s_q;
        expect_len(
            indices,
            self.indices.len(),
            rows * self.topk,
            "b * s_q * topk",
        )?;
        if let Some(t) = self.topk_length {
            expect_len(topk_length, t.len(), p.batch, "b")?;
        }
        Ok(())
    }

    /// Entries of request `b`'s rows that take part: `clamp(topk_length[b], 0, topk)` or `topk`.
    fn len(&self, b: usize) -> usize {
        self.topk_length.map_or(self.topk, |t| {
            usize::try_from(t[b]).map_or(0, |n| n.min(self.topk))
        })
    }

    /// Dequantises entry `j` of row `row` into `dst`, or returns false when its index is invalid.
    fn token(&self, row: usize, j: usize, dst: &mut Vec<f32>) -> bool {
        let l = &self.layout;
        let idx = self.indices[row * self.topk + j];
        let Some(tok) = usize::try_from(idx).ok().filter(|&t| t < l.num_tokens()) else {
            return false;
        };
        let d = l.format.d_qk();
        let at = dst.len();
        dst.resize(at + d, 0.0);
        let block = &self.cache[(tok / l.page_size) * l.block_stride..];
        dequantize_token(
            l.format,
            block,
            l.page_size,
            tok % l.page_size,
            &mut dst[at..],
        );
        true
    }
}

/// Inputs of a sparse decode.
#[derive(Debug, Clone, Copy)]
pub struct SparseDecodeInputs<'a> {
    /// `[b, s_q, h_q, d_qk]` (bf16 values).
    pub q: &'a [f32],
    /// The main cache and its indices.
    pub kv: SparseKv<'a>,
    /// The optional second cache, attended in the same softmax (same format; own layout and indices).
    pub extra: Option<SparseKv<'a>>,
    /// `[h_q]`, optional.
    pub attn_sink: Option<&'a [f32]>,
}

impl SparseDecodeProblem {
    /// Checks the problem's consistency and the inputs' lengths.
    pub fn check(&self, x: &SparseDecodeInputs<'_>) -> Result<()> {
        let d_qk = x.kv.layout.format.d_qk();
        if self.d_v > d_qk {
            return Err(Error::invalid(
                "d_v",
                format!("at most d_qk = {d_qk}"),
                self.d_v,
            ));
        }
        expect_len(
            "q",
            x.q.len(),
            self.batch * self.s_q * self.h_q * d_qk,
            "b * s_q * h_q * d_qk",
        )?;
        x.kv.check(["k_cache", "indices", "topk_length"], self, d_qk)?;
        if let Some(e) = &x.extra {
            e.check(
                ["extra_k_cache", "extra_indices", "extra_topk_length"],
                self,
                d_qk,
            )?;
        }
        if let Some(s) = x.attn_sink {
            expect_len("attn_sink", s.len(), self.h_q, "h_q")?;
        }
        Ok(())
    }

    /// Key positions of request `b`: its main entries followed by its extra entries.
    pub fn num_keys(&self, x: &SparseDecodeInputs<'_>, b: usize) -> usize {
        x.kv.len(b) + x.extra.as_ref().map_or(0, |e| e.len(b))
    }

    /// Key positions of every request (the schedule's input).
    pub fn key_counts(&self, x: &SparseDecodeInputs<'_>) -> Vec<usize> {
        (0..self.batch).map(|b| self.num_keys(x, b)).collect()
    }

    fn rows<R: Real>(
        &self,
        x: &SparseDecodeInputs<'_>,
        (b, i): (usize, usize),
        keys: &Range<usize>,
        finish: Finish<'_, R>,
        out: &mut [R],
        lse: &mut [R],
    ) -> Result<()> {
        let d = x.kv.layout.format.d_qk();
        let row = b * self.s_q + i;
        let n_main = x.kv.len(b);
        let end = keys.end.min(self.num_keys(x, b));
        // Every head reads the same latent tokens: dequantise each valid one once per row.
        let n = end.saturating_sub(keys.start);
        let mut tokens = try_with_capacity("decode row scratch", n.saturating_mul(d))?;
        for pos in keys.start..end {
            match &x.extra {
                Some(e) if pos >= n_main => e.token(row, pos - n_main, &mut tokens),
                _ => x.kv.token(row, pos, &mut tokens),
            };
        }
        let rows: Vec<&[f32]> = try_collect("decode row scratch", n, tokens.chunks(d))?;
        let scale = R::of(self.softmax_scale);
        for h in 0..self.h_q {
            let q = &x.q[(row * self.h_q + h) * d..(row * self.h_q + h + 1) * d];
            let o = &mut out[h * self.d_v..(h + 1) * self.d_v];
            lse[h] = attend_row(q, &rows, scale, finish.sink.map(|s| s[h]), o)?
                .unwrap_or(finish.empty_lse);
        }
        Ok(())
    }
}

/// Sparse FP8 decode over every request's full key list (no split). Allocates the outputs.
pub fn decode_sparse<R: Real>(
    p: &SparseDecodeProblem,
    x: &SparseDecodeInputs<'_>,
) -> Result<DecodeResult<R>> {
    decode_sparse_with(p, x, CancelToken::never())
}

/// [`decode_sparse`], stopping with [`Error::Interrupted`] soon after `cancel` is cancelled (it is polled
/// before every query row).
pub fn decode_sparse_with<R: Real>(
    p: &SparseDecodeProblem,
    x: &SparseDecodeInputs<'_>,
    cancel: &CancelToken,
) -> Result<DecodeResult<R>> {
    p.check(x)?;
    let all = 0..usize::MAX;
    run_rows((p.batch, p.s_q, p.h_q, p.d_v), cancel, |b, i, o, l| {
        p.rows(x, (b, i), &all, Finish::whole(x.attn_sink), o, l)
    })
}

/// The partial result of request `request` over its key positions `keys` (main entries first, then extra;
/// clamped to the request's keys). No sink.
pub fn decode_sparse_partial<R: Real>(
    p: &SparseDecodeProblem,
    x: &SparseDecodeInputs<'_>,
    request: usize,
    keys: Range<usize>,
) -> Result<DecodePartial<R>> {
    p.check(x)?;
    check_request(request, p.batch)?;
    partial(p.s_q, p.h_q, p.d_v, |i, o, l| {
        p.rows(x, (request, i), &keys, Finish::partial(), o, l)
    })
}

/// Sparse decode the split-KV way (see [`decode_dense_split`]); `schedule` comes from
/// [`SparseDecodeProblem::key_counts`].
pub fn decode_sparse_split<R: Real>(
    p: &SparseDecodeProblem,
    x: &SparseDecodeInputs<'_>,
    schedule: &DecodeSchedule,
) -> Result<DecodeResult<R>> {
    p.check(x)?;
    run_split(
        (p.batch, p.s_q, p.h_q, p.d_v),
        schedule,
        x.attn_sink,
        |b, keys| decode_sparse_partial(p, x, b, keys),
    )
}
