"""Stand-in for the FlashMLA Python API (``flash_mla``): same function names, signatures and return conventions.

``import flashmla.compat as flash_mla`` serves code written against FlashMLA:

* :func:`flash_mla_sparse_fwd` -> ``(out, max_logits, lse)``;
* :func:`flash_mla_sparse_bwd` -> ``(dq, dkv, delta)``;
* :func:`get_mla_metadata` -> ``(FlashMLASchedMeta, None)``: the scheduling is computed inside each decode call
  from shapes and on-device values (no host synchronisation), so the metadata object only records the call's
  configuration and checks that later calls sharing it agree (as FlashMLA's does);
* :func:`flash_mla_with_kvcache` -> ``(out, softmax_lse)``, dense (bf16/fp16 cache) or sparse (FP8 cache);
* :func:`flash_attn_varlen_func` and its packed forms -> ``(out, lse)``, dense MHA prefill (CUDA or the CPU, with autograd).

Differences: every log-sum-exp is a **natural** log (FlashMLA documented base 2 in some releases; multiply by
``math.log2(math.e)`` if your code expects that). Misuse raises ``ValueError``/``TypeError`` instead of
``AssertionError``. Ops whose kernels are not available raise ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from . import _ops

Tensor = torch.Tensor

__all__ = [
    "FlashMLASchedMeta",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_mla_sparse_bwd",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
]


def _check_d_v(d_v: int) -> None:
    if d_v != _ops.D_V:
        raise ValueError(f"invalid argument `d_v`: expected {_ops.D_V}, got {d_v}")


def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    indexer_topk: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse attention prefill forward.

    Args:
        q: ``[s_q, h_q, d_qk]`` bfloat16. kv: ``[s_kv, h_kv = 1, d_qk]`` bfloat16.
        indices: ``[s_q, h_kv, topk]`` int32; values outside ``[0, s_kv)`` are ignored.
        sm_scale: logit scale. d_v: must be 512.
        attn_sink: optional ``[h_q]`` float32. topk_length: optional ``[s_q]`` int32, clamped to ``[0, topk]``
            (token ``t`` uses its first ``topk_length[t]`` entries; a larger value means all, a negative one none).
        indexer_topk: must be 0 (the indexer LSE is not implemented).

    Returns:
        ``(out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] f32, lse [s_q, h_q] f32)``; ``lse`` is a natural log.
    """
    _check_d_v(d_v)
    if indexer_topk:
        raise NotImplementedError("flash_mla_sparse_fwd: `indexer_topk` > 0 (indexer LSE) is not implemented")
    return _ops.sparse_fwd(q, kv, indices, float(sm_scale), attn_sink, topk_length)


def flash_mla_sparse_bwd(
    q: Tensor,
    kv: Tensor,
    o: Tensor,
    do: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: Optional[float] = None,
    d_v: int = 512,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse attention prefill backward.

    Args:
        q, kv, indices, attn_sink, topk_length: as in the forward. o: the forward's output ``[s_q, h_q, d_v]``.
        do: gradient of ``o``. lse: the forward's ``lse`` (natural log). sm_scale: default ``d_qk ** -0.5``.

    Returns:
        ``(dq [s_q, h_q, d_qk] bf16, dkv [s_kv, 1, d_qk] bf16, delta [s_q, h_q] f32)``.
    """
    _check_d_v(d_v)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    dq, dkv, delta, _d_sink = _ops.sparse_bwd(q, kv, o, do, indices, lse, float(sm_scale), attn_sink, topk_length)
    return dq, dkv, delta


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Decode scheduling metadata, as FlashMLA's: filled by the first :func:`flash_mla_with_kvcache` call that uses
    it; later calls must have the same configuration (shapes, flags). Reuse one per decode step shape."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    # FlashMLA keeps its tile-scheduler tensors here; this implementation schedules inside the call.
    tile_scheduler_metadata: Optional[Tensor] = None
    num_splits: Optional[Tensor] = None
    # The shapes and flags of the last call that used it (a superset of `config`), the cheap comparison every
    # later call makes.
    _key: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """Returns ``(FlashMLASchedMeta(), None)``. Arguments are accepted and ignored (old and new call styles)."""
    return FlashMLASchedMeta(), None


def _record_or_check(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config) -> None:
    if not meta.have_initialized:
        meta.config = config
        meta.have_initialized = True
        return
    assert meta.config is not None
    for field in dataclasses.fields(config):
        had, got = getattr(meta.config, field.name), getattr(config, field.name)
        if had != got:
            raise ValueError(
                f"invalid argument `tile_scheduler_metadata`: it was initialised with {field.name}={had!r} but this "
                f"call has {field.name}={got!r}; use one FlashMLASchedMeta per decode configuration"
            )


def _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices) -> FlashMLASchedMeta.Config:
    """The configuration a decode call fixes in its FlashMLASchedMeta (FlashMLA's fields, in order)."""
    return FlashMLASchedMeta.Config(
        q.shape[0],
        q.shape[1],
        q.shape[2],
        k_cache.shape[1],
        k_cache.shape[2],
        causal,
        is_fp8_kvcache,
        indices.shape[-1] if indices is not None else None,
        extra_k_cache.shape[1] if extra_k_cache is not None else None,
        extra_indices.shape[-1] if extra_indices is not None else None,
    )


def flash_mla_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    block_table: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Optional[FlashMLASchedMeta],
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices_in_kvcache: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """MLA decode over a paged KV cache.

    Dense (``indices`` None): ``q [b, s_q, h_q, d_qk]`` bf16/fp16, ``k_cache [num_blocks, page_block_size, h_k,
    d_qk]`` of q's dtype, ``block_table [b, max_blocks]`` and ``cache_seqlens [b]`` int32, optional ``causal``
    (bottom-right aligned). Sparse (``indices [b, s_q, topk]`` int32, ``is_fp8_kvcache=True``): an FP8 cache
    ``[num_blocks, page_block_size, 1, 656 | 584]`` (uint8 or float8_e4m3fn; index = ``block * page_block_size +
    offset``, -1 for none), optional ``attn_sink [h_q]``, ``topk_length [b]`` (clamped to ``[0, topk]``) and an
    extra cache with its own indices and lengths. ``head_dim_v`` must be 512; ``softmax_scale`` defaults to ``d_qk ** -0.5``.

    Returns:
        ``(out [b, s_q, h_q, 512], softmax_lse [b, h_q, s_q] float32)``, natural-log lse (``+inf`` and ``out = 0``
        for a query without keys).
    """
    # Every check below is a comparison or two: this function runs once per layer and generated token.
    if head_dim_v != _ops.D_V:
        _check_d_v(head_dim_v)
    if num_splits is not None:
        raise ValueError("invalid argument `num_splits`: expected None (the second value get_mla_metadata returns)")
    sparse = indices is not None
    meta = tile_scheduler_metadata
    if meta is not None:
        if not isinstance(meta, FlashMLASchedMeta):
            raise TypeError(
                "invalid argument `tile_scheduler_metadata`: expected the FlashMLASchedMeta get_mla_metadata "
                f"returns, got {type(meta).__name__}"
            )
        # The shapes as they come (a superset of the configuration): only a change runs the field-by-field check.
        key = (
            q.shape,
            k_cache.shape,
            causal,
            is_fp8_kvcache,
            indices.shape if sparse else None,
            extra_k_cache.shape if extra_k_cache is not None else None,
            extra_indices_in_kvcache.shape if extra_indices_in_kvcache is not None else None,
        )
        if key != meta._key:
            _record_or_check(meta, _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache,
                                           extra_indices_in_kvcache))
            meta._key = key
    if sparse:
        if causal:
            raise ValueError("invalid argument `causal`: expected False with sparse attention (`indices` given)")
        if not is_fp8_kvcache:
            raise NotImplementedError(
                "flash_mla_with_kvcache: sparse attention over a bf16 cache is not implemented (use an FP8 cache)"
            )
        return _ops.decode_sparse(
            q,
            k_cache,
            indices,
            topk_length,
            softmax_scale,
            attn_sink,
            extra_k_cache,
            extra_indices_in_kvcache,
            extra_topk_length,
        )
    if (
        extra_k_cache is not None
        or extra_indices_in_kvcache is not None
        or topk_length is not None
        or extra_topk_length is not None
    ):
        extras = dict(
            extra_k_cache=extra_k_cache,
            extra_indices_in_kvcache=extra_indices_in_kvcache,
            topk_length=topk_length,
            extra_topk_length=extra_topk_length,
        )
        given = next(k for k, v in extras.items() if v is not None)
        raise ValueError(f"invalid argument `{given}`: expected None for dense attention (no `indices`)")
    if is_fp8_kvcache:
        raise NotImplementedError("flash_mla_with_kvcache: dense decode over an FP8 cache is not implemented")
    if block_table is None or cache_seqlens is None:
        raise ValueError("invalid argument `block_table`/`cache_seqlens`: both are required for dense attention")
    return _ops.decode_dense(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, attn_sink)


def _dense_prefill_options(dropout_p: float, is_varlen: bool) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"invalid argument `dropout_p`: expected 0.0 (no dropout), got {dropout_p}")
    if not is_varlen:
        raise ValueError("invalid argument `is_varlen`: expected True (packed sequences with cu_seqlens)")


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_qo: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_qo: int,
    max_seqlen_kv: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Dense MHA prefill over packed sequences (:func:`flashmla.dense_prefill`), differentiable in q, k and v.

    Returns ``(out [total_q, h_q, d_v], lse [total_q, h_q])`` (natural log; a transposed view of a ``[h_q, total_q]``
    tensor, as FlashMLA's). ``max_seqlen_*`` are accepted and not needed. ``deterministic`` selects the GPU
    backward's schedule without atomics (bitwise-reproducible gradients).
    """
    _dense_prefill_options(dropout_p, is_varlen)
    out, lse = _ops.dense_prefill(q, k, v, cu_seqlens_qo, cu_seqlens_kv, softmax_scale, causal, deterministic)
    return out, lse.T


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    head_dim_qk: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Tensor, Tensor]:
    """:func:`flash_attn_varlen_func` with ``qkv [total, h, 2 * head_dim_qk + d_v]`` packed along the last dim."""
    d = int(head_dim_qk)
    return flash_attn_varlen_func(
        qkv[:, :, :d], qkv[:, :, d : 2 * d], qkv[:, :, 2 * d :], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p, softmax_scale, causal, deterministic, is_varlen,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_qo: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_qo: int,
    max_seqlen_kv: int,
    head_dim_qk: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
    is_varlen: bool = True,
) -> Tuple[Tensor, Tensor]:
    """:func:`flash_attn_varlen_func` with ``kv [total_k, h_k, head_dim_qk + d_v]`` packed along the last dim."""
    d = int(head_dim_qk)
    return flash_attn_varlen_func(
        q, kv[:, :, :d], kv[:, :, d:], cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv,
        dropout_p, softmax_scale, causal, deterministic, is_varlen,
    )
