"""flashmla: Multi-head Latent Attention kernels for NVIDIA Hopper, for PyTorch.

Every op takes torch tensors on the CPU (the Rust CPU reference: slow, for testing) or on a CUDA device (the
sm_90a kernels, launched on torch's current stream with outputs from torch's caching allocator, with no
synchronisation). Ops are registered with ``torch.library`` (``torch.ops.flashmla.*``), so ``torch.compile``
traces them without graph breaks.

Main entry point for training: :func:`sparse_mla` (differentiable in ``q``, ``kv`` and ``attn_sink``).
Drop-in replacements for the FlashMLA Python API are in :mod:`flashmla.compat`; pure-torch references are in
:mod:`flashmla.reference`.

Memory: each call allocates its outputs through torch. The CUDA decodes also need a workspace (the split-KV
schedule and partial results), and the dense prefill forward one word of it (its work counter): each CUDA stream
keeps the largest one a call has needed there and later calls on that stream reuse it (they are ordered behind each
other); a call captured into a CUDA graph takes its own from the graph's pool. :func:`release_workspaces` gives the
kept ones back to torch's caching allocator.

Errors: invalid arguments raise ``ValueError`` (``TypeError`` for a wrong dtype), valid requests this build
cannot serve raise ``NotImplementedError`` naming the op, CUDA failures raise ``RuntimeError``, a CPU call that
needs more host memory than there is raises ``MemoryError``; Ctrl-C stops a long CPU call (``KeyboardInterrupt``).
"""

from typing import Optional, Tuple, Union

import torch

from . import _native
from ._ops import (
    D_V,
    decode_dense,
    decode_sparse,
    dense_prefill,
    kv_dequantize,
    kv_quantize,
    kv_quantize_into,
    sparse_bwd,
    sparse_fwd,
)

__version__ = _native.__version__

__all__ = [
    "D_V",
    "decode_dense",
    "decode_sparse",
    "dense_prefill",
    "kernels_built",
    "kv_dequantize",
    "kv_quantize",
    "kv_quantize_into",
    "release_workspaces",
    "sparse_bwd",
    "sparse_fwd",
    "sparse_mla",
    "__version__",
]


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Sparse MLA attention (DeepSeek V3.2 / V4 prefill), differentiable in ``q``, ``kv`` and ``attn_sink``.

    Args:
        q: ``[s_q, h_q, d_qk]`` bfloat16, ``d_qk`` 576 (V3.2) or 512 (V4).
        kv: ``[s_kv, 1, d_qk]`` bfloat16; V is ``kv[..., :512]``.
        indices: ``[s_q, 1, topk]`` int32 rows of ``kv`` per query token; values outside ``[0, s_kv)`` are ignored.
        sm_scale: logit scale; default ``d_qk ** -0.5``.
        attn_sink: optional ``[h_q]`` float32 per-head sink logit (damps ``out``; ``+inf`` gives 0).
        topk_length: optional ``[s_q]`` int32: token ``t`` uses only its first ``topk_length[t]`` entries, clamped to
            ``[0, topk]`` (a larger value uses all ``topk`` entries, a negative one none).
        return_lse: also return ``lse [s_q, h_q]`` float32 (natural log, sink excluded; not differentiable).

    Returns:
        ``out [s_q, h_q, 512]`` bfloat16, or ``(out, lse)``.

    The backward reduces ``kv``'s gradient bitwise-reproducibly (at about twice its time) while
    ``torch.use_deterministic_algorithms(True)`` is in effect; every other gradient always is.
    """
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    out, _max_logits, lse = sparse_fwd(q, kv, indices, float(sm_scale), attn_sink, topk_length)
    return (out, lse) if return_lse else out


def kernels_built() -> dict:
    """``{family: bool}``: which GPU kernel families are embedded in this build."""
    return dict(_native.kernels_built())


def release_workspaces() -> int:
    """Gives the workspaces kept per CUDA stream (decodes, dense prefill) back to torch's caching allocator; returns
    their bytes.

    Later calls allocate a new one as they need it. Call ``torch.cuda.empty_cache()`` afterwards to return the
    memory to the driver as well.
    """
    return _native.release_workspaces()
