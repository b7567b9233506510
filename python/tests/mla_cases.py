"""Shared test helpers: docs/spec.md section 6 input generators and acceptance checks (CPU and GPU tests use both)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

#: Invalid index values the peer's tests use (docs/spec.md section 6); `s_kv` itself is added per case.
INVALID_INDEX_VALUES = (-(2**31), -123456, -1, 114514, 1919810, 2147480000, 2**31 - 1)

#: docs/spec.md section 6 tolerances: (abs_tol, rel_tol, cos_tol).
TOL_PREFILL_OUT = (8e-4, 3.01 / 128, 7e-6)
TOL_PREFILL_STATS = (1e-6, 2.01 / 65536, None)
TOL_DECODE_OUT = (1e-3, 2.01 / 128, 5e-6)
TOL_DECODE_LSE = (1e-6, 8.01 / 65536, None)
TOL_BWD = (1e-3, 8.01 / 128, 7e-6)


def assert_spec_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol, context: str = "", allowance=None) -> None:
    """docs/spec.md section 6: every element within abs or rel tolerance, same inf/NaN positions, cosine distance small.

    ``allowance`` (same shape as ``ref``, >= 0): judge each element's error net of it, ``max(0, |a - r| - allowance)``,
    for errors a kernel makes by design and that are bounded per element (the backward's bf16 MMA operands).
    """
    abs_tol, rel_tol, cos_tol = tol
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)} {context}"
    a = got.detach().to(torch.float64)
    r = ref.detach().to(a.device, torch.float64)
    for what, f in (("+inf", torch.isposinf), ("-inf", torch.isneginf), ("NaN", torch.isnan)):
        fa, fr = f(a), f(r)
        if not torch.equal(fa, fr):
            bad = (fa != fr).nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {what} positions differ, e.g. at {bad} {context}")
    fin = torch.isfinite(r)
    a, r = a[fin], r[fin]
    err = (a - r).abs()
    if allowance is not None:
        err = (err - allowance.detach().to(a.device, torch.float64)[fin]).clamp(min=0)
    ok = (err < abs_tol) | (err / (r.abs() + 1e-6) < rel_tol)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {ok.numel()} elements out of tolerance (abs {abs_tol}, rel {rel_tol}); "
            f"first: got {a[i].item()!r} want {r[i].item()!r}; max abs err {err.max().item():.3g} {context}"
        )
    if cos_tol is not None and a.numel() > 0:
        # Against an exactly zero reference the cosine is undefined: the element rule alone judges.
        denom = (a * a + r * r).sum()
        cos_diff = 0.0 if denom == 0 or (r * r).sum() == 0 else float(1 - 2 * (a * r).sum() / denom)
        assert cos_diff < cos_tol, f"{name}: cos_diff {cos_diff:.3g} >= {cos_tol} {context}"


def padded(t: torch.Tensor, fill: float | int) -> torch.Tensor:
    """The same values in a non-contiguous layout: last dim padded by 128, every other dim by 1 (docs/spec.md section 6)."""
    big_shape = [n + 1 for n in t.shape[:-1]] + [t.shape[-1] + 128]
    big = torch.full(big_shape, fill, dtype=t.dtype, device=t.device)
    view = big[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


@dataclasses.dataclass
class SparseCase:
    """One sparse prefill problem, with the seed that made it."""

    seed: int
    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    attn_sink: Optional[torch.Tensor]
    topk_length: Optional[torch.Tensor]

    def args(self):
        return (self.q, self.kv, self.indices, self.sm_scale, self.attn_sink, self.topk_length)

    def describe(self) -> str:
        q, kv, idx = self.q, self.kv, self.indices
        return (
            f"[seed {self.seed}: s_q {q.shape[0]} s_kv {kv.shape[0]} h_q {q.shape[1]} d_qk {q.shape[2]} "
            f"topk {idx.shape[2]} sink {self.attn_sink is not None} topk_length {self.topk_length is not None}]"
        )


def make_sparse_case(
    seed: int,
    s_q: int,
    s_kv: int,
    h_q: int,
    d_qk: int,
    topk: int,
    *,
    sink: Optional[str] = None,
    topk_length: bool = False,
    invalid_frac: float = 0.1,
    empty_rows: int = 0,
    noncontig: bool = False,
    nan_unreferenced: bool = False,
    device: str = "cpu",
) -> SparseCase:
    """A docs/spec.md section 6 case: inputs ``randn/10`` plus a per-tensor offset, some invalid index values, optionally
    rows with no valid entry, ``topk_length`` (including 0), sinks (``"random"``, ``"inf"``, ``"-inf"``,
    ``"mixed"``), non-contiguous layouts and NaN in every KV row no valid entry references."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        offset = (torch.rand((), generator=g, device=dev) - 0.5) / 10
        return torch.randn(*shape, generator=g, device=dev) / 10 + offset

    def randint(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=g, device=dev, dtype=torch.int64)

    q = randn(s_q, h_q, d_qk).to(torch.bfloat16)
    kv = randn(s_kv, 1, d_qk).to(torch.bfloat16)
    idx = randint(0, s_kv, (s_q, 1, topk)) if s_kv > 0 else torch.full((s_q, 1, topk), -1, device=dev)
    bad_values = torch.tensor(INVALID_INDEX_VALUES + (s_kv,), dtype=torch.int64, device=dev)
    bad = torch.rand(idx.shape, generator=g, device=dev) < invalid_frac
    idx = torch.where(bad, bad_values[randint(0, len(bad_values), idx.shape)], idx)
    if empty_rows:
        rows = torch.randperm(s_q, generator=g, device=dev)[:empty_rows]
        idx[rows] = bad_values[randint(0, len(bad_values), (len(rows), 1, topk))]
    idx = idx.to(torch.int32)
    lengths = None
    if topk_length:
        lengths = randint(0, topk + 1, (s_q,)).to(torch.int32)
        lengths[0] = 0
        if s_q > 1:
            lengths[1] = topk
    attn_sink = None
    if sink is not None:
        attn_sink = torch.randn(h_q, generator=g, device=dev)
        if sink == "inf":
            attn_sink.fill_(float("inf"))
        elif sink == "-inf":
            attn_sink.fill_(float("-inf"))
        elif sink == "mixed":
            attn_sink[0::3] = float("inf")
            attn_sink[1::3] = float("-inf")
    if nan_unreferenced and s_kv > 0:
        from flashmla.reference import valid_mask

        valid = valid_mask(idx, s_kv, lengths)
        used = torch.zeros(s_kv, dtype=torch.bool, device=dev)
        used[idx[:, 0, :].long()[valid]] = True
        kv[~used] = float("nan")
    case = SparseCase(seed, q, kv, idx, d_qk**-0.5, attn_sink, lengths)
    if noncontig:
        case.q = padded(case.q, float("nan"))
        case.kv = padded(case.kv, float("nan"))
        case.indices = padded(case.indices, 0)
        if case.attn_sink is not None:
            case.attn_sink = padded(case.attn_sink, float("nan"))
        if case.topk_length is not None:
            case.topk_length = padded(case.topk_length, 0)
    return case


class SparseBwdSpy:
    """Stands in for `flashmla._ops._native` (monkeypatched in) and records the `deterministic` flag of every
    `sparse_bwd` call that reaches the native module."""

    def __init__(self, real):
        self._real = real
        self.deterministic = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def sparse_bwd(self, *args):
        self.deterministic.append(args[10])
        return self._real.sparse_bwd(*args)
