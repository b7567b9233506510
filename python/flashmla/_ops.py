"""The flashmla ops, registered with ``torch.library`` (namespace ``flashmla``).

Each op has a real implementation (validate in Rust, allocate outputs through torch, run in Rust on torch's
current stream), a fake implementation (shapes only, for ``torch.compile`` and meta tensors; it runs the same Rust
validation whenever the shapes are concrete) and, for the sparse prefill forward, an autograd formula that calls
the backward op. Outputs are allocated uninitialised (``torch.empty``): each op writes every element it returns.

| op | returns |
| --- | --- |
| ``flashmla::sparse_fwd(q, kv, indices, sm_scale, attn_sink?, topk_length?)`` | ``(out, max_logits, lse)`` |
| ``flashmla::sparse_bwd(q, kv, out, d_out, indices, lse, sm_scale, attn_sink?, topk_length?, d_kv_f32)`` | ``(d_q, d_kv, delta, d_attn_sink)`` |
| ``flashmla::decode_dense(q, k_cache, block_table, cache_seqlens, softmax_scale?, causal, attn_sink?)`` | ``(out, lse)`` |
| ``flashmla::decode_sparse(q, k_cache, indices, topk_length?, softmax_scale?, attn_sink?, extra...?)`` | ``(out, lse)`` |
| ``flashmla::kv_quantize(kv)`` / ``flashmla::kv_dequantize(cache)`` | ``cache`` / ``kv`` |

Without a sink, ``sparse_bwd`` returns an empty ``d_attn_sink`` (shape ``[0]``): custom ops return tensors only.
"""

from typing import Optional, Tuple

import torch

from . import _glue
from . import _native

Tensor = torch.Tensor

#: Value width of every op: V is the first ``D_V`` columns of each latent KV row.
D_V = 512
#: Bytes per cached token of each FP8 cache format, by ``d_qk``: V3.2 (d_qk 576) stores 512 e4m3 values, four
#: f32 scales and 64 bf16 RoPE values (512 + 4*4 + 64*2 = 656); MODEL1 (d_qk 512) stores 448 e4m3 values, 64 bf16
#: RoPE values, seven e8m0 scales and a pad byte (448 + 64*2 + 8 = 584).
FP8_BYTES_PER_TOKEN = {576: 512 + 4 * 4 + 64 * 2, 512: 448 + 64 * 2 + 8}
#: ``d_qk`` of each FP8 cache format, by bytes per token.
FP8_D_QK = {b: d for d, b in FP8_BYTES_PER_TOKEN.items()}

_F32 = torch.float32
_BF16 = torch.bfloat16


def _run(fn, anchor: Tensor, *args, **kwargs) -> None:
    """Calls a native op on ``anchor``'s device and torch's current stream there.

    Temporary tensors passed in ``args``/``kwargs`` may be freed when this returns: torch's caching allocator
    reuses their memory in stream order on the same stream, after the op's kernels.
    """
    with _glue.on_device(anchor):
        fn(*args, _glue.stream_of(anchor), **kwargs)


def _rank_at_least(t: Tensor, name: str, rank: int) -> None:
    """The shape check fake implementations need before indexing a symbolic shape."""
    if t.dim() < rank:
        raise ValueError(f"invalid argument `{name}`: expected {rank} dimensions, got {t.dim()}")


# ------------------------------------------------------------------------------------------------------------
# Sparse prefill forward


@torch.library.custom_op("flashmla::sparse_fwd", mutates_args=())
def _sparse_fwd_op(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse MLA prefill forward (docs/spec.md section 1): ``(out [s_q, h_q, 512] bf16, max_logits, lse [s_q, h_q] f32)``.

    ``q [s_q, h_q, d_qk]`` bf16, ``kv [s_kv, 1, d_qk]`` bf16, ``indices [s_q, 1, topk]`` int32 (values outside
    ``[0, s_kv)`` are ignored), optional ``attn_sink [h_q]`` float32 and ``topk_length [s_q]`` int32. ``lse`` is
    a natural log, ``+inf`` for a token without valid entries.
    """
    ins = (
        _glue.desc(q, "q"),
        _glue.desc(kv, "kv"),
        _glue.desc(indices, "indices"),
        sm_scale,
        _glue.desc_opt(attn_sink, "attn_sink"),
        _glue.desc_opt(topk_length, "topk_length"),
    )
    s_q, _s_kv, h_q, _d_qk, d_v, _topk = _native.sparse_fwd_check(*ins)
    out = torch.empty((s_q, h_q, d_v), dtype=_BF16, device=q.device)
    max_logits = torch.empty((s_q, h_q), dtype=_F32, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=_F32, device=q.device)
    outs = (_glue.desc(out, "out"), _glue.desc(max_logits, "max_logits"), _glue.desc(lse, "lse"))
    _run(_native.sparse_fwd, q, *ins, *outs)
    return out, max_logits, lse


@_sparse_fwd_op.register_fake
def _sparse_fwd_fake(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    _glue.check_same_device(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
    if _glue.is_concrete(q, kv, indices, attn_sink, topk_length):
        _native.sparse_fwd_check(
            _glue.meta_desc(q, "q"),
            _glue.meta_desc(kv, "kv"),
            _glue.meta_desc(indices, "indices"),
            sm_scale,
            _glue.meta_desc_opt(attn_sink, "attn_sink"),
            _glue.meta_desc_opt(topk_length, "topk_length"),
        )
    _rank_at_least(q, "q", 2)
    s_q, h_q = q.shape[0], q.shape[1]
    return (
        q.new_empty((s_q, h_q, D_V), dtype=_BF16),
        q.new_empty((s_q, h_q), dtype=_F32),
        q.new_empty((s_q, h_q), dtype=_F32),
    )


def _sparse_fwd_setup(ctx, inputs, output):
    q, kv, indices, sm_scale, attn_sink, topk_length = inputs
    out, max_logits, lse = output
    ctx.save_for_backward(q, kv, indices, attn_sink, topk_length, out, lse)
    ctx.sm_scale = sm_scale
    # The backward kernel differentiates `out` only; the statistics are returned for inspection and for
    # callers that run the backward themselves (they must not be part of a loss).
    ctx.mark_non_differentiable(max_logits, lse)


def _sparse_fwd_backward(ctx, d_out, _d_max_logits, _d_lse):
    q, kv, indices, attn_sink, topk_length, out, lse = ctx.saved_tensors
    # The incoming gradient can be any view (an expanded `ones` after `.sum()`); the op wants a dense last dim.
    d_q, d_kv, _delta, d_sink = _sparse_bwd_op(
        q, kv, out, d_out.contiguous(), indices, lse, ctx.sm_scale, attn_sink, topk_length
    )
    need = ctx.needs_input_grad
    return (
        d_q if need[0] else None,
        d_kv if need[1] else None,
        None,
        None,
        d_sink if attn_sink is not None and need[4] else None,
        None,
    )


_sparse_fwd_op.register_autograd(_sparse_fwd_backward, setup_context=_sparse_fwd_setup)


# ------------------------------------------------------------------------------------------------------------
# Sparse prefill backward


@torch.library.custom_op("flashmla::sparse_bwd", mutates_args=())
def _sparse_bwd_op(
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    d_out: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    d_kv_f32: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sparse MLA prefill backward (docs/spec.md section 2): ``(d_q, d_kv, delta, d_attn_sink)``.

    ``d_q [s_q, h_q, d_qk]`` bf16, ``d_kv [s_kv, 1, d_qk]`` bf16 (float32 with ``d_kv_f32``), ``delta [s_q, h_q]``
    float32 and ``d_attn_sink [h_q]`` float32 (shape ``[0]`` without a sink). ``lse`` must be the forward's.
    """
    named = ((q, "q"), (kv, "kv"), (out, "out"), (d_out, "d_out"), (indices, "indices"), (lse, "lse"))
    ins = (
        *(_glue.desc(t, n) for t, n in named),
        sm_scale,
        _glue.desc_opt(attn_sink, "attn_sink"),
        _glue.desc_opt(topk_length, "topk_length"),
    )
    s_q, s_kv, h_q, d_qk, _d_v, _topk, ws_rows, ws_cols = _native.sparse_bwd_check(
        *ins, "f32" if d_kv_f32 else "bf16"
    )
    dev = q.device
    d_q = torch.empty((s_q, h_q, d_qk), dtype=_BF16, device=dev)
    d_kv = torch.empty((s_kv, 1, d_qk), dtype=_F32 if d_kv_f32 else _BF16, device=dev)
    delta = torch.empty((s_q, h_q), dtype=_F32, device=dev)
    d_sink = torch.empty((h_q if attn_sink is not None else 0,), dtype=_F32, device=dev)
    outs = (
        _glue.desc(d_q, "d_q"),
        _glue.desc(d_kv, "d_kv"),
        _glue.desc(delta, "delta"),
        _glue.desc(d_sink, "d_attn_sink") if attn_sink is not None else None,
    )
    # A bf16 d_kv is reduced in an f32 workspace first; allocating it here lets torch's caching allocator own it.
    workspace = None
    if q.is_cuda and not d_kv_f32 and ws_rows * ws_cols > 0:
        workspace = _glue.desc(torch.empty((ws_rows, ws_cols), dtype=_F32, device=dev), "workspace")
    _run(_native.sparse_bwd, q, *ins, *outs, workspace=workspace)
    return d_q, d_kv, delta, d_sink


@_sparse_bwd_op.register_fake
def _sparse_bwd_fake(q, kv, out, d_out, indices, lse, sm_scale, attn_sink=None, topk_length=None, d_kv_f32=False):
    named = ((q, "q"), (kv, "kv"), (out, "out"), (d_out, "d_out"), (indices, "indices"), (lse, "lse"))
    _glue.check_same_device(**{n: t for t, n in named}, attn_sink=attn_sink, topk_length=topk_length)
    if _glue.is_concrete(q, kv, out, d_out, indices, lse, attn_sink, topk_length):
        _native.sparse_bwd_check(
            *(_glue.meta_desc(t, n) for t, n in named),
            sm_scale,
            _glue.meta_desc_opt(attn_sink, "attn_sink"),
            _glue.meta_desc_opt(topk_length, "topk_length"),
            "f32" if d_kv_f32 else "bf16",
        )
    _rank_at_least(q, "q", 3)
    _rank_at_least(kv, "kv", 1)
    s_q, h_q, d_qk = q.shape[0], q.shape[1], q.shape[2]
    return (
        q.new_empty((s_q, h_q, d_qk), dtype=_BF16),
        q.new_empty((kv.shape[0], 1, d_qk), dtype=_F32 if d_kv_f32 else _BF16),
        q.new_empty((s_q, h_q), dtype=_F32),
        q.new_empty((h_q if attn_sink is not None else 0,), dtype=_F32),
    )


# ------------------------------------------------------------------------------------------------------------
# Decode


def _q_rows_16b(q: Tensor) -> Tensor:
    """``q`` itself, or a contiguous copy when a CUDA ``q``'s rows are not 16-byte aligned (the decode kernels load
    q rows in 16-byte chunks)."""
    if q.is_cuda and (q.data_ptr() % 16 or any(s % 8 for s, n in zip(q.stride()[:-1], q.shape[:-1]) if n > 1)):
        return q.contiguous()
    return q


def _decode_outputs(q: Tensor, b: int, s_q: int, h_q: int, d_v: int, dtype, words: int):
    """``out``, ``lse`` and the workspace of a decode (the workspace, ``None`` on the host, holds the schedule and
    the split partials: torch allocates it, so the caching allocator reuses it in stream order and a CUDA graph
    capture takes it from the graph's private pool)."""
    out = torch.empty((b, s_q, h_q, d_v), dtype=dtype, device=q.device)
    lse = torch.empty((b, h_q, s_q), dtype=_F32, device=q.device)
    workspace = torch.empty((words,), dtype=_F32, device=q.device) if words else None
    return out, lse, workspace


def _decode_dense_impl(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    attn_sink: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """The dense decode's body: what the custom op runs, and what eager calls on CUDA tensors run directly."""
    q = _q_rows_16b(q)
    ins = (
        _glue.desc(q, "q"),
        _glue.desc(k_cache, "k_cache"),
        _glue.desc(block_table, "block_table"),
        _glue.desc(cache_seqlens, "cache_seqlens"),
        softmax_scale,
        causal,
        _glue.desc_opt(attn_sink, "attn_sink"),
    )
    b, s_q, h_q, d_v, words = _native.decode_dense_plan(*ins, batch_invariant)
    out, lse, workspace = _decode_outputs(q, b, s_q, h_q, d_v, q.dtype, words)  # workspace alive through the call
    ws = _glue.desc(workspace, "workspace") if words else None
    _run(
        _native.decode_dense,
        q,
        *ins,
        _glue.desc(out, "out"),
        _glue.desc(lse, "lse"),
        workspace=ws,
        batch_invariant=batch_invariant,
    )
    return out, lse


@torch.library.custom_op("flashmla::decode_dense", mutates_args=())
def _decode_dense_op(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    attn_sink: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Dense decode over a paged bf16/fp16 cache (docs/spec.md section 4): ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``."""
    return _decode_dense_impl(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, attn_sink, batch_invariant)


@_decode_dense_op.register_fake
def _decode_dense_fake(
    q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=False, attn_sink=None, batch_invariant=False
):
    _glue.check_same_device(
        q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens, attn_sink=attn_sink
    )
    if _glue.is_concrete(q, k_cache, block_table, cache_seqlens, attn_sink):
        _native.decode_dense_check(
            _glue.meta_desc(q, "q"),
            _glue.meta_desc(k_cache, "k_cache"),
            _glue.meta_desc(block_table, "block_table"),
            _glue.meta_desc(cache_seqlens, "cache_seqlens"),
            softmax_scale,
            causal,
            _glue.meta_desc_opt(attn_sink, "attn_sink"),
        )
    _rank_at_least(q, "q", 3)
    b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, s_q, h_q, D_V)), q.new_empty((b, h_q, s_q), dtype=_F32)


def _decode_sparse_impl(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """The sparse decode's body: what the custom op runs, and what eager calls on CUDA tensors run directly."""
    q = _q_rows_16b(q)
    args = _sparse_decode_descs(
        _glue.desc, _glue.desc_opt, q, k_cache, indices, topk_length, attn_sink,
        extra_k_cache, extra_indices, extra_topk_length,
    )
    b, s_q, h_q, d_v, words = _native.decode_sparse_plan(*args[:4], softmax_scale, *args[4:], batch_invariant)
    out, lse, workspace = _decode_outputs(q, b, s_q, h_q, d_v, _BF16, words)  # workspace alive through the call
    _run(
        _native.decode_sparse,
        q,
        *args[:4],
        softmax_scale,
        *args[4:],
        _glue.desc(out, "out"),
        _glue.desc(lse, "lse"),
        workspace=_glue.desc(workspace, "workspace") if words else None,
        batch_invariant=batch_invariant,
    )
    return out, lse


@torch.library.custom_op("flashmla::decode_sparse", mutates_args=())
def _decode_sparse_op(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Sparse decode over an FP8 cache (spec sections 3 and 4): ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q])``."""
    return _decode_sparse_impl(
        q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
        batch_invariant,
    )


def _sparse_decode_descs(
    d, d_opt, q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length
):
    """Descriptors in the native order, less ``softmax_scale`` (between the 4th and 5th)."""
    return (
        d(q, "q"),
        d(k_cache, "k_cache"),
        d(indices, "indices"),
        d_opt(topk_length, "topk_length"),
        d_opt(attn_sink, "attn_sink"),
        d_opt(extra_k_cache, "extra_k_cache"),
        d_opt(extra_indices, "extra_indices"),
        d_opt(extra_topk_length, "extra_topk_length"),
    )


@_decode_sparse_op.register_fake
def _decode_sparse_fake(
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None, batch_invariant=False,
):
    tensors = (q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length)
    _glue.check_same_device(
        q=q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
        extra_k_cache=extra_k_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
    )
    if _glue.is_concrete(*tensors):
        args = _sparse_decode_descs(_glue.meta_desc, _glue.meta_desc_opt, *tensors)
        _native.decode_sparse_check(*args[:4], softmax_scale, *args[4:])
    _rank_at_least(q, "q", 3)
    b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, s_q, h_q, D_V), dtype=_BF16), q.new_empty((b, h_q, s_q), dtype=_F32)


# ------------------------------------------------------------------------------------------------------------
# FP8 KV cache


@torch.library.custom_op("flashmla::kv_quantize", mutates_args=())
def _kv_quantize_op(kv: Tensor) -> Tensor:
    """Quantises ``kv [num_blocks, page_size, 1, d_qk]`` bf16 into a new packed uint8 FP8 cache (docs/spec.md section 3)."""
    shape = _native.kv_quantize_check(_glue.desc(kv, "kv"))
    cache = torch.empty(shape, dtype=torch.uint8, device=kv.device)
    kv_quantize_into(kv, cache)
    return cache


def kv_quantize_into(kv: Tensor, cache: Tensor) -> Tensor:
    """Quantises ``kv`` into an existing cache (uint8 or float8_e4m3fn, block stride may be padded) and returns it.

    Writes every token's bytes and nothing else (the bytes between blocks keep their values). Mutates ``cache``:
    an eager-mode helper, not a registered op.
    """
    _glue.check_tensor_args(dict(kv=kv, cache=cache))
    _run(_native.kv_quantize, kv, _glue.desc(kv, "kv"), _glue.desc(cache, "cache"))
    return cache


@_kv_quantize_op.register_fake
def _kv_quantize_fake(kv):
    if _glue.is_concrete(kv):
        _native.kv_quantize_check(_glue.meta_desc(kv, "kv"))
    _rank_at_least(kv, "kv", 4)
    bytes_per_token = _lookup_width(kv.shape[3], FP8_BYTES_PER_TOKEN, "kv.shape[3]")
    return kv.new_empty((kv.shape[0], kv.shape[1], 1, bytes_per_token), dtype=torch.uint8)


def _lookup_width(width, table: dict, arg: str) -> int:
    """``table[width]`` for a possibly symbolic ``width`` (comparing a traced size guards on it)."""
    for key, value in table.items():
        if width == key:
            return value
    raise ValueError(f"invalid argument `{arg}`: expected one of {sorted(table)}, got {width}")


@torch.library.custom_op("flashmla::kv_dequantize", mutates_args=())
def _kv_dequantize_op(cache: Tensor) -> Tensor:
    """Dequantises an FP8 cache ``[num_blocks, page_size, 1, 656 | 584]`` into bf16 ``[..., 1, 576 | 512]``."""
    shape = _native.kv_dequantize_check(_glue.desc(cache, "cache"))
    kv = torch.empty(shape, dtype=_BF16, device=cache.device)
    _run(_native.kv_dequantize, cache, _glue.desc(cache, "cache"), _glue.desc(kv, "kv"))
    return kv


@_kv_dequantize_op.register_fake
def _kv_dequantize_fake(cache):
    if _glue.is_concrete(cache):
        _native.kv_dequantize_check(_glue.meta_desc(cache, "cache"))
    _rank_at_least(cache, "cache", 4)
    d_qk = _lookup_width(cache.shape[3], FP8_D_QK, "cache.shape[3]")
    return cache.new_empty((cache.shape[0], cache.shape[1], 1, d_qk), dtype=_BF16)


# ------------------------------------------------------------------------------------------------------------
# Public entry points: argument type checks (TypeError), then the registered op.


def sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse MLA prefill forward (docs/spec.md section 1): ``(out [s_q, h_q, 512] bf16, max_logits, lse [s_q, h_q] f32)``.

    ``q [s_q, h_q, d_qk]`` bf16, ``kv [s_kv, 1, d_qk]`` bf16, ``indices [s_q, 1, topk]`` int32 (values outside
    ``[0, s_kv)`` are ignored), optional ``attn_sink [h_q]`` float32 and ``topk_length [s_q]`` int32 (token ``t``
    uses its first ``topk_length[t]`` entries, clamped to ``[0, topk]``: a larger value means all ``topk``, a
    negative one none). ``lse`` is a natural log without the sink, ``+inf`` for a token without valid entries
    (``max_logits`` is ``-inf`` and ``out`` 0 there). Differentiable in ``q``, ``kv`` and ``attn_sink`` through
    ``out``.
    """
    _glue.check_tensor_args(dict(q=q, kv=kv, indices=indices), dict(attn_sink=attn_sink, topk_length=topk_length))
    return _sparse_fwd_op(q, kv, indices, float(sm_scale), attn_sink, topk_length)


def sparse_bwd(
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    d_out: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    d_kv_f32: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sparse MLA prefill backward (docs/spec.md section 2): ``(d_q, d_kv, delta, d_attn_sink)``.

    ``d_q [s_q, h_q, d_qk]`` bf16, ``d_kv [s_kv, 1, d_qk]`` bf16 (float32 with ``d_kv_f32``), ``delta [s_q, h_q]``
    float32 and ``d_attn_sink [h_q]`` float32 (shape ``[0]`` without a sink). ``out`` and ``lse`` must be the
    forward's outputs for the same arguments.
    """
    _glue.check_tensor_args(
        dict(q=q, kv=kv, out=out, d_out=d_out, indices=indices, lse=lse),
        dict(attn_sink=attn_sink, topk_length=topk_length),
    )
    return _sparse_bwd_op(q, kv, out, d_out, indices, lse, float(sm_scale), attn_sink, topk_length, bool(d_kv_f32))


def decode_dense(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    attn_sink: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Dense decode over a paged cache (docs/spec.md section 4): ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q] f32)``.

    ``q [b, s_q, h_q, d_qk]`` bf16/fp16, ``k_cache [num_blocks, page_size, h_kv, d_qk]`` of q's dtype,
    ``block_table [b, max_blocks]`` and ``cache_seqlens [b]`` int32; ``causal`` is bottom-right aligned.
    On CUDA the whole step (schedule, split, combine) is queued on torch's current stream with no host
    synchronisation: it can be captured in a CUDA graph and replayed after ``cache_seqlens`` and ``block_table``
    changed in place. ``batch_invariant=True`` makes each request's result bitwise independent of the rest of the
    batch (fixed chunking; somewhat slower on skewed batches, more workspace).
    """
    _glue.check_tensor_args(
        dict(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens), dict(attn_sink=attn_sink)
    )
    scale = None if softmax_scale is None else float(softmax_scale)
    args = (q, k_cache, block_table, cache_seqlens, scale, bool(causal), attn_sink, bool(batch_invariant))
    if q.is_cuda and not torch.compiler.is_compiling():
        # Eager CUDA calls skip the dispatcher (~10 us of host time per call; the op has no autograd formula and
        # no other backend): the same body runs. Tracing (torch.compile) and meta tensors go through the op.
        return _decode_dense_impl(*args)
    return _decode_dense_op(*args)


def decode_sparse(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Sparse decode over an FP8 cache (spec sections 3, 4): ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q])``.

    ``q [b, s_q, h_q, d_qk]`` bf16 (576: V3.2 cache, 512: MODEL1 cache), ``k_cache [num_blocks, page_size, 1,
    656 | 584]`` uint8/float8_e4m3fn, ``indices [b, s_q, topk]`` int32 token ids ``block * page_size + offset``
    (others ignored), optional ``topk_length [b]`` (request ``b`` uses the first ``topk_length[b]`` entries of each
    row, clamped to ``[0, topk]``), ``attn_sink [h_q]`` and a second cache with its own indices and lengths.
    Any ``h_q`` (no padding of heads) and any ``topk``. On CUDA the step (schedule, dequantising split, combine) is
    queued on torch's current stream with no host synchronisation (CUDA-graph capturable and replayable after the
    indices and lengths changed in place); the caches must start on 8 bytes with block strides that are multiples
    of 8 bytes (every packed cache is). ``batch_invariant=True``: each query's result is bitwise independent of the rest of the batch.
    """
    _glue.check_tensor_args(
        dict(q=q, k_cache=k_cache, indices=indices),
        dict(
            topk_length=topk_length, attn_sink=attn_sink, extra_k_cache=extra_k_cache, extra_indices=extra_indices,
            extra_topk_length=extra_topk_length,
        ),
    )
    scale = None if softmax_scale is None else float(softmax_scale)
    args = (
        q, k_cache, indices, topk_length, scale, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
        bool(batch_invariant),
    )
    if q.is_cuda and not torch.compiler.is_compiling():
        return _decode_sparse_impl(*args)  # eager CUDA: skip the dispatcher, as decode_dense does
    return _decode_sparse_op(*args)


def kv_quantize(kv: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Quantises ``kv [num_blocks, page_size, 1, d_qk]`` bf16 to an FP8 cache (docs/spec.md section 3).

    Returns a new packed uint8 cache ``[num_blocks, page_size, 1, 656 | 584]``, or fills ``out`` (uint8 or
    float8_e4m3fn, block stride may be padded; the bytes between blocks are left as they are) and returns it.
    """
    _glue.check_tensor_args(dict(kv=kv), dict(out=out))
    if out is not None:
        return kv_quantize_into(kv, out)
    return _kv_quantize_op(kv)


def kv_dequantize(cache: Tensor) -> Tensor:
    """Dequantises an FP8 cache ``[num_blocks, page_size, 1, 656 | 584]`` to bf16 ``[..., 1, 576 | 512]``."""
    _glue.check_tensor_args(dict(cache=cache))
    return _kv_dequantize_op(cache)
