"""Torch glue of the registered ops: argument type checks, device agreement of fake calls, concrete shapes.

The native module (``flashmla._native``) takes torch tensors as they are: it reads their metadata, allocates the
outputs through torch and runs on torch's current stream of the tensors' device (see
``crates/flashmla-py/src/tensor.rs``). What remains here is what the registered ops and their fake
implementations need before they reach it.
"""

from __future__ import annotations

from typing import Optional

import torch


def _expect_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"invalid argument `{name}`: expected a torch.Tensor, got {type(t).__name__}")
    return t


def is_concrete(*tensors: Optional[torch.Tensor]) -> bool:
    """True when every shape and stride is a plain int (not a symbolic size being traced)."""
    for t in tensors:
        if t is None:
            continue
        if not all(type(s) is int for s in t.shape) or not all(type(s) is int for s in t.stride()):
            return False
    return True


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """ValueError naming the first tensor whose device differs from the first tensor's (``None`` ones skipped).

    Fake implementations run this first. The dispatcher sends a call with any ``meta`` tensor to the fake
    implementation, which computes nothing: a call mixing meta and real tensors must be refused there, or it would
    return uninitialised memory on the real tensors' device. Real implementations need no such check: the
    library refuses a tensor that is not where the first one is (CPU or a CUDA device).
    """
    first_name, first = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise ValueError(
                f"invalid argument `{name}.device`: expected {first.device} (the device of `{first_name}`), "
                f"got {t.device}"
            )


def check_tensor_args(required: dict, optional: dict = None) -> None:
    """TypeError naming the first argument that is not a tensor (``None`` is allowed for the optional ones).

    Public wrappers run this before the registered op, whose dispatcher would raise a RuntimeError instead.
    """
    for name, t in required.items():
        _expect_tensor(t, name)
    for name, t in (optional or {}).items():
        if t is not None:
            _expect_tensor(t, name)
