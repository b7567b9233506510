"""The flashmla ops, registered with ``torch.library`` (namespace ``flashmla``).

Each op has a real implementation (one native call: it validates, allocates the outputs through torch and runs on
torch's current stream), a fake implementation (shapes only, for ``torch.compile`` and meta tensors; it runs the
same Rust validation whenever the shapes are concrete) and, for the sparse prefill forward, an autograd formula
that calls the backward op. Outputs are allocated uninitialised (``new_empty``): each op writes every element it
returns.

Eager calls on CUDA tensors that need no autograd call the native function directly: the dispatcher adds ~10 us
of host time per call and these ops have no other backend. Tracing (``torch.compile``), meta tensors, CPU tensors
and calls that record autograd go through the registered op.

| op | returns |
| --- | --- |
| ``flashmla::sparse_fwd(q, kv, indices, sm_scale, attn_sink?, topk_length?)`` | ``(out, max_logits, lse)`` |
| ``flashmla::sparse_bwd(q, kv, out, d_out, indices, lse, sm_scale, attn_sink?, topk_length?, d_kv_f32, deterministic)`` | ``(d_q, d_kv, delta, d_attn_sink)`` |
| ``flashmla::decode_dense(q, k_cache, block_table, cache_seqlens, softmax_scale?, causal, attn_sink?)`` | ``(out, lse)`` |
| ``flashmla::decode_sparse(q, k_cache, indices, topk_length?, softmax_scale?, attn_sink?, extra...?)`` | ``(out, lse)`` |
| ``flashmla::dense_prefill_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale?, causal)`` | ``(out, lse)`` |
| ``flashmla::dense_prefill_bwd(q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale?, causal, deterministic)`` | ``(d_q, d_k, d_v)`` |
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
    return _native.sparse_fwd(q, kv, indices, sm_scale, attn_sink, topk_length)


@_sparse_fwd_op.register_fake
def _sparse_fwd_fake(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    _glue.check_same_device(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
    if _glue.is_concrete(q, kv, indices, attn_sink, topk_length):
        _native.sparse_fwd_check(q, kv, indices, sm_scale, attn_sink, topk_length)
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
    # `torch.use_deterministic_algorithms(True)` selects the bitwise-reproducible reduction of `d_kv`.
    d_q, d_kv, _delta, d_sink = _sparse_bwd_op(
        q,
        kv,
        out,
        d_out.contiguous(),
        indices,
        lse,
        ctx.sm_scale,
        attn_sink,
        topk_length,
        False,
        torch.are_deterministic_algorithms_enabled(),
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
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sparse MLA prefill backward (docs/spec.md section 2): ``(d_q, d_kv, delta, d_attn_sink)``.

    ``d_q [s_q, h_q, d_qk]`` bf16, ``d_kv [s_kv, 1, d_qk]`` bf16 (float32 with ``d_kv_f32``), ``delta [s_q, h_q]``
    float32 and ``d_attn_sink [h_q]`` float32 (shape ``[0]`` without a sink). ``lse`` must be the forward's.
    ``deterministic``: bitwise-reproducible ``d_kv`` on the GPU (the other outputs always are).
    """
    return _native.sparse_bwd(
        q, kv, out, d_out, indices, lse, sm_scale, attn_sink, topk_length, d_kv_f32, deterministic
    )


@_sparse_bwd_op.register_fake
def _sparse_bwd_fake(
    q, kv, out, d_out, indices, lse, sm_scale, attn_sink=None, topk_length=None, d_kv_f32=False, deterministic=False
):
    named = ((q, "q"), (kv, "kv"), (out, "out"), (d_out, "d_out"), (indices, "indices"), (lse, "lse"))
    _glue.check_same_device(**{n: t for t, n in named}, attn_sink=attn_sink, topk_length=topk_length)
    if _glue.is_concrete(q, kv, out, d_out, indices, lse, attn_sink, topk_length):
        _native.sparse_bwd_check(q, kv, out, d_out, indices, lse, sm_scale, attn_sink, topk_length, d_kv_f32)
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
    """Dense decode over a paged bf16/fp16 cache (docs/spec.md section 4): ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``.

    On CUDA the workspace (the schedule and the split partials) is allocated through torch for the call, so the
    caching allocator reuses it in stream order and a CUDA graph capture takes it from the graph's private pool.
    """
    return _native.decode_dense(
        q, k_cache, block_table, cache_seqlens, softmax_scale, causal, attn_sink, batch_invariant
    )


@_decode_dense_op.register_fake
def _decode_dense_fake(
    q, k_cache, block_table, cache_seqlens, softmax_scale=None, causal=False, attn_sink=None, batch_invariant=False
):
    _glue.check_same_device(
        q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens, attn_sink=attn_sink
    )
    if _glue.is_concrete(q, k_cache, block_table, cache_seqlens, attn_sink):
        _native.decode_dense_check(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, attn_sink)
    _rank_at_least(q, "q", 3)
    b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, s_q, h_q, D_V)), q.new_empty((b, h_q, s_q), dtype=_F32)


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
    return _native.decode_sparse(
        q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
        batch_invariant,
    )


@_decode_sparse_op.register_fake
def _decode_sparse_fake(
    q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None, batch_invariant=False,
):
    _glue.check_same_device(
        q=q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
        extra_k_cache=extra_k_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
    )
    if _glue.is_concrete(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices, extra_topk_length):
        _native.decode_sparse_check(
            q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache, extra_indices,
            extra_topk_length,
        )
    _rank_at_least(q, "q", 3)
    b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, s_q, h_q, D_V), dtype=_BF16), q.new_empty((b, h_q, s_q), dtype=_F32)


# ------------------------------------------------------------------------------------------------------------
# Dense varlen prefill (docs/spec.md section 5): forward and backward on CUDA or the CPU


@torch.library.custom_op("flashmla::dense_prefill_fwd", mutates_args=())
def _dense_prefill_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Dense varlen prefill forward: ``(out [total_q, h_q, d_v], lse [h_q, total_q] f32)``. ``deterministic`` only
    selects the autograd backward's schedule."""
    return _native.dense_prefill_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


@_dense_prefill_fwd_op.register_fake
def _dense_prefill_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, deterministic=False):
    _glue.check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if _glue.is_concrete(q, k, v, cu_seqlens_q, cu_seqlens_k):
        _native.dense_prefill_fwd_check(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    _rank_at_least(q, "q", 3)
    _rank_at_least(v, "v", 3)
    total_q, h_q = q.shape[0], q.shape[1]
    return q.new_empty((total_q, h_q, v.shape[2])), q.new_empty((h_q, total_q), dtype=_F32)


def _dense_prefill_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _dense_prefill_backward(ctx, d_out, _d_lse):
    q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse = ctx.saved_tensors
    # The schedule without atomics when asked for, or when `torch.use_deterministic_algorithms(True)` is in effect.
    deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
    d_q, d_k, d_v = _dense_prefill_bwd_op(
        q, k, v, out, d_out.contiguous(), lse, cu_seqlens_q, cu_seqlens_k, ctx.softmax_scale, ctx.causal,
        deterministic,
    )
    need = ctx.needs_input_grad
    return (
        d_q if need[0] else None, d_k if need[1] else None, d_v if need[2] else None, None, None, None, None, None
    )


_dense_prefill_fwd_op.register_autograd(_dense_prefill_backward, setup_context=_dense_prefill_setup)


@torch.library.custom_op("flashmla::dense_prefill_bwd", mutates_args=())
def _dense_prefill_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    d_out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Dense varlen prefill backward from the forward's ``out`` and ``lse``: ``(d_q, d_k, d_v)`` in q's dtype;
    ``deterministic`` picks the schedule without atomics."""
    return _native.dense_prefill_bwd(
        q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, deterministic
    )


@_dense_prefill_bwd_op.register_fake
def _dense_prefill_bwd_fake(
    q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, deterministic=False
):
    _glue.check_same_device(
        q=q, k=k, v=v, out=out, d_out=d_out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k
    )
    if _glue.is_concrete(q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k):
        _native.dense_prefill_bwd_check(
            q, k, v, out, d_out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------------------------------------------------
# FP8 KV cache


@torch.library.custom_op("flashmla::kv_quantize", mutates_args=())
def _kv_quantize_op(kv: Tensor) -> Tensor:
    """Quantises ``kv [num_blocks, page_size, 1, d_qk]`` bf16 into a new packed uint8 FP8 cache (docs/spec.md section 3)."""
    return _native.kv_quantize(kv)


def kv_quantize_into(kv: Tensor, cache: Tensor) -> Tensor:
    """Quantises ``kv`` into an existing cache (uint8 or float8_e4m3fn, block stride may be padded) and returns it.

    Writes every token's bytes and nothing else (the bytes between blocks keep their values). Mutates ``cache``:
    an eager-mode helper, not a registered op.
    """
    _glue.check_tensor_args(dict(kv=kv, cache=cache))
    return _native.kv_quantize(kv, cache)


@_kv_quantize_op.register_fake
def _kv_quantize_fake(kv):
    if _glue.is_concrete(kv):
        _native.kv_quantize_check(kv)
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
    return _native.kv_dequantize(cache)


@_kv_dequantize_op.register_fake
def _kv_dequantize_fake(cache):
    if _glue.is_concrete(cache):
        _native.kv_dequantize_check(cache)
    _rank_at_least(cache, "cache", 4)
    d_qk = _lookup_width(cache.shape[3], FP8_D_QK, "cache.shape[3]")
    return cache.new_empty((cache.shape[0], cache.shape[1], 1, d_qk), dtype=_BF16)


# ------------------------------------------------------------------------------------------------------------
# Public entry points: eager CUDA calls go straight to the native function; every other call checks its
# argument types (TypeError) and goes through the registered op.


def _direct(q) -> bool:
    """Whether a call may skip the dispatcher: a plain CUDA tensor, not being traced.

    Subclasses (fake, functional and other wrapper tensors) and ``torch.compile`` tracing take the registered op,
    whose fake implementation and dispatch they rely on.
    """
    return type(q) is Tensor and q.is_cuda and not torch.compiler.is_compiling()


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    if _direct(q) and not _needs_grad(q, kv, attn_sink):
        return _native.sparse_fwd(q, kv, indices, float(sm_scale), attn_sink, topk_length)
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
    deterministic: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sparse MLA prefill backward (docs/spec.md section 2): ``(d_q, d_kv, delta, d_attn_sink)``.

    ``d_q [s_q, h_q, d_qk]`` bf16, ``d_kv [s_kv, 1, d_qk]`` bf16 (float32 with ``d_kv_f32``), ``delta [s_q, h_q]``
    float32 and ``d_attn_sink [h_q]`` float32 (shape ``[0]`` without a sink). ``out`` and ``lse`` must be the
    forward's outputs for the same arguments. ``deterministic``: reduce ``d_kv`` bitwise-reproducibly on the GPU
    (int64 fixed point, about twice the time; ``d_q``, ``delta`` and ``d_attn_sink`` always are); ``None`` follows
    ``torch.are_deterministic_algorithms_enabled()``, as the autograd backward of :func:`sparse_mla` does.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    args = (q, kv, out, d_out, indices, lse, float(sm_scale), attn_sink, topk_length)
    args += (bool(d_kv_f32), bool(deterministic))
    if _direct(q):
        return _native.sparse_bwd(*args)
    _glue.check_tensor_args(
        dict(q=q, kv=kv, out=out, d_out=d_out, indices=indices, lse=lse),
        dict(attn_sink=attn_sink, topk_length=topk_length),
    )
    return _sparse_bwd_op(*args)


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
    scale = None if softmax_scale is None else float(softmax_scale)
    args = (q, k_cache, block_table, cache_seqlens, scale, bool(causal), attn_sink, bool(batch_invariant))
    if _direct(q):
        return _native.decode_dense(*args)
    _glue.check_tensor_args(
        dict(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens), dict(attn_sink=attn_sink)
    )
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
    scale = None if softmax_scale is None else float(softmax_scale)
    args = (
        q, k_cache, indices, topk_length, scale, attn_sink, extra_k_cache, extra_indices, extra_topk_length,
        bool(batch_invariant),
    )
    if _direct(q):
        return _native.decode_sparse(*args)
    _glue.check_tensor_args(
        dict(q=q, k_cache=k_cache, indices=indices),
        dict(
            topk_length=topk_length, attn_sink=attn_sink, extra_k_cache=extra_k_cache, extra_indices=extra_indices,
            extra_topk_length=extra_topk_length,
        ),
    )
    return _decode_sparse_op(*args)


def dense_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Dense MHA prefill over packed sequences (docs/spec.md section 5): ``(out [total_q, h_q, d_v], lse [h_q, total_q])``.

    ``q [total_q, h_q, d]``, ``k [total_k, h_k, d]``, ``v [total_k, h_k, d_v]`` bf16/fp16 with ``(d, d_v)`` (192, 128)
    or (128, 128) and ``h_q % h_k == 0``; ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[b + 1]`` int32 sequence offsets
    (0, non-decreasing, ending at the row counts); ``softmax_scale`` defaults to ``d ** -0.5``; ``causal`` is
    bottom-right aligned. A row that attends to no key gets ``out`` 0 and ``lse`` ``+inf``. Differentiable in ``q``,
    ``k`` and ``v``. On CUDA tensors both directions run the sm_90a kernels (no host synchronisation: the offsets are
    read on the device, so calls can be captured in a CUDA graph). At ``d`` 128 the GPU backward adds dQ into an f32
    accumulator with bulk reductions (its low bits vary from run to run) and allocates about ``4 (d + 1)`` bytes per
    query row and head of workspace; ``deterministic`` (or ``torch.use_deterministic_algorithms(True)``) selects the
    schedule without atomics, bitwise-reproducible, with a ``[h_q, total_q]`` f32 workspace (about 1.14x the time at
    ``d`` 128; at ``d`` 192 the default already is that schedule; docs/dense-prefill.md).
    """
    _glue.check_tensor_args(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    scale = None if softmax_scale is None else float(softmax_scale)
    if _direct(q) and not _needs_grad(q, k, v):
        return _native.dense_prefill_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal))
    return _dense_prefill_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), bool(deterministic))


def kv_quantize(kv: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Quantises ``kv [num_blocks, page_size, 1, d_qk]`` bf16 to an FP8 cache (docs/spec.md section 3).

    Returns a new packed uint8 cache ``[num_blocks, page_size, 1, 656 | 584]``, or fills ``out`` (uint8 or
    float8_e4m3fn, block stride may be padded; the bytes between blocks are left as they are) and returns it.
    """
    if out is not None:
        return kv_quantize_into(kv, out)
    if _direct(kv):
        return _native.kv_quantize(kv)
    _glue.check_tensor_args(dict(kv=kv))
    return _kv_quantize_op(kv)


def kv_dequantize(cache: Tensor) -> Tensor:
    """Dequantises an FP8 cache ``[num_blocks, page_size, 1, 656 | 584]`` to bf16 ``[..., 1, 576 | 512]``."""
    if _direct(cache):
        return _native.kv_dequantize(cache)
    _glue.check_tensor_args(dict(cache=cache))
    return _kv_dequantize_op(cache)
