"""Torch glue: tensor descriptors for the native module, streams, device guards.

The native module (``flashmla._native``) knows nothing of torch. It takes each tensor as a descriptor tuple
``(data_ptr, dtype, shape, strides, device)`` and runs on the raw memory: CPU tensors through the CPU reference,
CUDA tensors through the GPU kernels, launched on the stream this module hands over (torch's current stream of
the tensor's device). Callers keep the tensors alive for the duration of the native call, which they do by
holding the arguments.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

Desc = Tuple[int, str, Tuple[int, ...], Tuple[int, ...], int]

#: The dtypes the native module computes on, by the names it uses.
_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.int32: "i32",
    torch.uint8: "u8",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_NAMES[torch.float8_e4m3fn] = "f8e4m3"

#: Device index of host tensors in descriptors.
_HOST = -1


def _device_index(t: torch.Tensor, name: str) -> int:
    dev = t.device
    if dev.type == "cpu":
        return _HOST
    if dev.type == "cuda":
        return dev.index if dev.index is not None else torch.cuda.current_device()
    raise ValueError(f"invalid argument `{name}.device`: expected a cpu or cuda tensor, got {dev}")


def _dtype_name(t: torch.Tensor) -> str:
    # An unknown dtype is passed by its torch name; the native side raises TypeError naming the argument.
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _expect_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"invalid argument `{name}`: expected a torch.Tensor, got {type(t).__name__}")
    return t


def desc(t: torch.Tensor, name: str) -> Desc:
    """The descriptor of a real tensor (its data is read or written by the native call)."""
    _expect_tensor(t, name)
    index = _device_index(t, name)
    ptr = t.data_ptr() if t.numel() > 0 else 0
    return (ptr, _dtype_name(t), tuple(t.shape), tuple(t.stride()), index)


def desc_opt(t: Optional[torch.Tensor], name: str) -> Optional[Desc]:
    return None if t is None else desc(t, name)


def meta_desc(t: torch.Tensor, name: str) -> Desc:
    """A metadata-only descriptor (null pointer) for validation, usable on fake and meta tensors."""
    _expect_tensor(t, name)
    dev = t.device
    index = _HOST if dev.type in ("cpu", "meta") else _device_index(t, name)
    return (0, _dtype_name(t), tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), index)


def meta_desc_opt(t: Optional[torch.Tensor], name: str) -> Optional[Desc]:
    return None if t is None else meta_desc(t, name)


def is_concrete(*tensors: Optional[torch.Tensor]) -> bool:
    """True when every shape and stride is a plain int (not a symbolic size being traced)."""
    for t in tensors:
        if t is None:
            continue
        if not all(type(s) is int for s in t.shape) or not all(type(s) is int for s in t.stride()):
            return False
    return True


#: torch's accessor of the current stream as a raw pointer (what its own generated code calls): a fraction of a
#: microsecond, where building a ``torch.cuda.Stream`` object costs ~20 us of host time per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(t: torch.Tensor) -> int:
    """The raw ``CUstream`` of torch's current stream on ``t``'s device (0 for host tensors)."""
    if t.device.type != "cuda":
        return 0
    if _raw_stream is not None:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _raw_stream(index)
    return torch.cuda.current_stream(t.device).cuda_stream


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Makes ``t``'s device current for the native call when it is not already.

    The native side binds the device's primary context (the one torch uses) to the calling thread; entering
    torch's device guard first keeps torch's idea of the current device and the thread's context in agreement,
    and restores both afterwards.
    """
    if t.device.type == "cuda" and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


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
