"""Pure-torch references of the sparse MLA prefill (spec sections 1 and 2), for tests and for checking results.

Written with plain torch ops so that autograd differentiates them and ``torch.autograd.gradcheck`` can verify
them in float64. They accept any floating dtype and any ``d_qk >= d_v`` (the flashmla ops need bf16 inputs and
``d_qk`` in {512, 576}; tests feed these references the same values upcast). Work is split over chunks of query
tokens so that large problems fit in memory (``chunk`` tokens gather ``chunk * topk * d_qk`` elements at a time).

Conventions follow spec: an index is valid when it lies in ``[0, s_kv)`` and, with ``topk_length``, its position
is below ``topk_length[t]``; invalid entries take no part (their KV rows are never used, so NaN there cannot
leak); a token with no valid entry gives ``out = 0``, ``lse = +inf``, ``max_logits = -inf``; ``lse`` is a natural
log and excludes the sink.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def valid_mask(indices: Tensor, s_kv: int, topk_length: Optional[Tensor] = None) -> Tensor:
    """``[s_q, topk]`` bool: which index entries take part (``indices`` is ``[s_q, 1, topk]``)."""
    idx = indices[:, 0, :]
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid = valid & (pos[None, :] < topk_length.to(idx.device)[:, None].long())
    return valid


def _gather_rows(kv: Tensor, indices: Tensor, valid: Tensor) -> Tensor:
    """``[s_q, topk, d_qk]``: the KV row of every valid entry, zeros for the invalid ones (never read)."""
    if kv.shape[0] == 0:
        return kv.new_zeros((*indices[:, 0, :].shape, kv.shape[-1]))
    safe = torch.where(valid, indices[:, 0, :].long(), torch.zeros_like(indices[:, 0, :]).long())
    rows = kv[:, 0, :][safe]
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _fwd_chunk(q, kv, indices, sm_scale, attn_sink, topk_length, d_v):
    s_kv = kv.shape[0]
    valid = valid_mask(indices, s_kv, topk_length)
    rows = _gather_rows(kv, indices, valid)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    s = torch.einsum("thd,tjd->thj", q, rows) * sm_scale
    v3 = valid[:, None, :]
    s0 = torch.where(v3, s, zero)
    s_masked = torch.where(v3, s, torch.full((), float("-inf"), dtype=q.dtype, device=q.device))
    max_logits = s_masked.detach().amax(dim=-1) if s.shape[-1] > 0 else torch.full(
        s.shape[:2], float("-inf"), dtype=q.dtype, device=q.device
    )
    any_valid = v3.any(dim=-1)
    # Every transcendental below sees finite arguments only, so autograd produces no NaN through masked entries.
    m = torch.where(any_valid, max_logits, zero)
    e = torch.where(v3, torch.exp(s0 - m[..., None]), zero)
    sumexp = e.sum(dim=-1)
    lse_finite = m + torch.log(torch.where(any_valid, sumexp, torch.ones((), dtype=q.dtype, device=q.device)))
    if attn_sink is not None:
        sink = attn_sink.to(q.dtype)[None, :].expand_as(lse_finite)
        denom = torch.where(any_valid, torch.logaddexp(lse_finite, sink), sink)
    else:
        denom = lse_finite
    denom_finite = torch.where(torch.isfinite(denom), denom, zero)
    p = torch.where(v3, torch.exp(s0 - denom_finite[..., None]), zero)
    if attn_sink is not None:
        # A +inf sink takes all the probability mass: out = 0 exactly.
        p = torch.where(torch.isposinf(denom)[..., None], zero, p)
    out = torch.einsum("thj,tjc->thc", p, rows[..., :d_v])
    lse = torch.where(any_valid, lse_finite, torch.full((), float("inf"), dtype=q.dtype, device=q.device))
    return out, max_logits, lse


def sparse_mla_reference(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    d_v: int = 512,
    chunk: int = 256,
) -> Tuple[Tensor, Tensor, Tensor]:
    """docs/spec.md section 1 in q's dtype: ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``.

    Differentiable in ``q``, ``kv`` and ``attn_sink`` (``max_logits`` and ``lse`` are not meant to be).
    """
    outs, maxes, lses = [], [], []
    for t0 in range(0, max(q.shape[0], 1), chunk):
        t1 = min(t0 + chunk, q.shape[0])
        o, m, l = _fwd_chunk(
            q[t0:t1],
            kv,
            indices[t0:t1],
            sm_scale,
            attn_sink,
            None if topk_length is None else topk_length[t0:t1],
            d_v,
        )
        outs.append(o)
        maxes.append(m)
        lses.append(l)
    return torch.cat(outs), torch.cat(maxes), torch.cat(lses)


def sparse_mla_backward_reference(
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    d_out: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    chunk: int = 256,
    magnitudes: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """docs/spec.md section 2 written out (not autograd), in float32 or q's dtype when wider.

    Returns ``(d_q [s_q, h_q, d_qk], d_kv [s_kv, 1, d_qk], delta [s_q, h_q], d_attn_sink [h_q] or None)``.
    Uses the given ``out`` and ``lse`` as the kernels do (``lse = +inf`` marks a token without entries).

    With ``magnitudes=True``, ``d_q`` and ``d_kv`` are instead the sums of the absolute values of their products
    (``sum |ds| |k|`` and ``sum |ds| |q| + |p| |d_out|``, scaled as the gradients are): times ``2**-8`` they bound
    what rounding the MMA operands ``P`` and ``dS`` to bf16 (as the GPU backward does) can change.
    """
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, kv, out, d_out, lse = (x.to(dt) for x in (q, kv, out, d_out, lse))
    s_q, h_q, d_qk = q.shape
    s_kv, d_v = kv.shape[0], out.shape[-1]
    d_q = torch.zeros_like(q)
    d_kv = torch.zeros((s_kv, d_qk), dtype=dt, device=q.device)
    delta = (d_out * out).sum(dim=-1)
    d_sink = torch.zeros(h_q, dtype=dt, device=q.device) if attn_sink is not None else None
    zero = torch.zeros((), dtype=dt, device=q.device)
    for t0 in range(0, s_q, chunk):
        t1 = min(t0 + chunk, s_q)
        idx = indices[t0:t1]
        valid = valid_mask(idx, s_kv, None if topk_length is None else topk_length[t0:t1])
        rows = _gather_rows(kv, idx, valid)
        v3 = valid[:, None, :]
        l = lse[t0:t1]
        finite = torch.isfinite(l)
        if attn_sink is not None:
            sink = attn_sink.to(dt)[None, :].expand_as(l)
            l_prime = torch.where(finite, torch.logaddexp(l, sink), sink)
        else:
            l_prime = l
        lp = torch.where(torch.isfinite(l_prime), l_prime, zero)
        s = torch.einsum("thd,tjd->thj", q[t0:t1], rows) * sm_scale
        p = torch.where(v3, torch.exp(torch.where(v3, s, zero) - lp[..., None]), zero)
        if attn_sink is not None:
            p = torch.where(torch.isposinf(l_prime)[..., None], zero, p)
        dp = torch.einsum("thc,tjc->thj", d_out[t0:t1], rows[..., :d_v])
        ds = p * (dp - delta[t0:t1, :, None])
        qc, gc = q[t0:t1], d_out[t0:t1]
        if magnitudes:
            p, ds, rows, qc, gc = p.abs(), ds.abs(), rows.abs(), qc.abs(), gc.abs()
        d_q[t0:t1] = sm_scale * torch.einsum("thj,tjd->thd", ds, rows)
        contrib = sm_scale * torch.einsum("thj,thd->tjd", ds, qc)
        contrib[..., :d_v] += torch.einsum("thj,thc->tjc", p, gc)
        safe = torch.where(valid, idx[:, 0, :].long(), torch.zeros_like(idx[:, 0, :]).long())
        contrib = torch.where(valid[..., None], contrib, zero)
        d_kv.index_add_(0, safe.reshape(-1), contrib.reshape(-1, d_qk))
        if attn_sink is not None:
            # exp(sink - lse'): the sink's probability. Tokens without entries (lse = +inf) have out = 0, so
            # delta = 0 and they contribute nothing; a +inf sink has probability 1 (and out = 0 again).
            w = torch.where(finite, torch.exp(sink - l_prime), zero)
            w = torch.where(finite & torch.isposinf(sink), torch.ones((), dtype=dt, device=q.device), w)
            d_sink -= (w * delta[t0:t1]).sum(dim=0)
    return d_q, d_kv[:, None, :], delta, d_sink


def dense_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    attn_sink: Optional[Tensor] = None,
    d_v: int = 512,
) -> Tuple[Tensor, Tensor]:
    """docs/spec.md section 4, dense: ``(out [b, s_q, h_q, d_v], lse [b, h_q, s_q])`` in float64 (f32 inputs upcast).

    Request ``b`` sees its first ``cache_seqlens[b]`` tokens, token ``p`` at ``k_cache[block_table[b, p //
    page_size], p % page_size]``; query head ``h`` reads KV head ``h // (h_q / h_kv)``; ``causal`` is bottom-right
    aligned (query ``i`` sees keys ``< s_k - s_q + i + 1``).
    """
    dt = torch.float64
    b, s_q, h_q, d_qk = q.shape
    page = k_cache.shape[1]
    h_kv = k_cache.shape[2]
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros((b, s_q, h_q, d_v), dtype=dt, device=q.device)
    lse = torch.full((b, h_q, s_q), float("inf"), dtype=dt, device=q.device)
    group = h_q // h_kv
    for r in range(b):
        n = int(cache_seqlens[r])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        blocks = block_table[r].long()[pos // page]
        keys = k_cache[blocks, pos % page].to(dt)  # [n, h_kv, d_qk]
        keys = keys.repeat_interleave(group, dim=1)  # [n, h_q, d_qk]
        s = torch.einsum("ihd,nhd->hin", q[r].to(dt), keys) * scale  # [h_q, s_q, n]
        if causal and s_q > 1:
            limit = n - s_q + torch.arange(s_q, device=q.device) + 1  # [s_q]
            visible = pos[None, :] < limit[:, None]
            s = s.masked_fill(~visible[None], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [h_q, s_q]; -inf when nothing is visible
        has = torch.isfinite(row_lse)
        denom = row_lse
        if attn_sink is not None:
            denom = torch.logaddexp(row_lse, attn_sink.to(dt)[:, None])
        p = torch.exp(s - torch.where(torch.isfinite(denom), denom, 0.0)[..., None])
        p = torch.where(has[..., None] & torch.isfinite(denom)[..., None], p, 0.0)
        out[r] = torch.einsum("hin,nhc->ihc", p, keys[..., :d_v])
        lse[r] = torch.where(has, row_lse, float("inf"))
    return out, lse


def sparse_decode_reference(
    q: Tensor,
    values: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[Tensor] = None,
    extra_values: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    d_v: int = 512,
) -> Tuple[Tensor, Tensor]:
    """docs/spec.md section 4, sparse: ``(out [b, s_q, h_q, d_v], lse [b, h_q, s_q])`` in float64.

    ``values [num_tokens, d_qk]`` are the (dequantised) cache tokens in index order (``block * page_size +
    offset``); an index outside ``[0, num_tokens)`` is ignored, as are positions ``>= topk_length[b]``. The extra
    cache (its own values, indices and lengths) joins the same softmax.
    """
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale

    def masked(idx: Tensor, n_tokens: int, lengths: Optional[Tensor], offset: int) -> Tensor:
        idx = idx.long()
        keep = (idx >= 0) & (idx < n_tokens)
        if lengths is not None:
            pos = torch.arange(idx.shape[-1], device=idx.device)
            keep = keep & (pos[None, None, :] < lengths.to(idx.device).long()[:, None, None])
        return torch.where(keep, idx + offset, torch.full_like(idx, -1))

    rows = values.to(torch.float64)
    idx = masked(indices, values.shape[0], topk_length, 0)
    if extra_values is not None:
        idx = torch.cat([idx, masked(extra_indices, extra_values.shape[0], extra_topk_length, rows.shape[0])], -1)
        rows = torch.cat([rows, extra_values.to(torch.float64)])
    out, _max, lse = sparse_mla_reference(
        q.reshape(b * s_q, h_q, d_qk).to(torch.float64),
        rows[:, None, :],
        idx.reshape(b * s_q, 1, -1).to(torch.int64),
        scale,
        attn_sink,
        None,
        d_v,
    )
    return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(1, 2)
