"""The parts of ``side_by_side.py`` that need no GPU: shape grids, FLOP/byte counting, input generators, the
regime scheduler and record building. ``python/tests/test_side_by_side.py`` checks them on the CPU.

Counting follows the project's conventions (the standard shapes and formulas of the benchmarking notes):

* sparse prefill forward: ``FLOP = 2 * s_q * topk * h_q * (d_qk + d_v)``;
* decode: ``FLOP = 2 * h_q * attended * (d_qk + d_v)`` where ``attended`` sums, over every (request, query token),
  the cache entries that token attends (dense: its visible keys, causal masks included; sparse: ``topk``, or
  ``topk_length`` where given, main and extra caches); bytes = Q + every distinct cache token read once
  (576 * 2 B for bf16, 656 or 584 B for FP8) + O.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

#: Value width of every op.
D_V = 512
#: Bytes per cached token of each FP8 cache format, by ``d_qk`` (V3.2: 512 e4m3 + 4 f32 scales + 64 bf16 RoPE;
#: MODEL1: 448 e4m3 + 64 bf16 RoPE + 7 e8m0 scales + 1 pad byte).
FP8_BYTES_PER_TOKEN = {576: 512 + 4 * 4 + 64 * 2, 512: 448 + 64 * 2 + 8}
#: MODEL1 pages are padded to a multiple of this many bytes in FlashMLA's own cache builder (576 = 16 * 36 keeps
#: every page 16-byte aligned whatever its token count); we lay our MODEL1 caches out the same way.
MODEL1_PAGE_ALIGN = 576
#: Bytes of one dense (bf16) cache token: ``h_kv * d_qk * 2``.
BF16_BYTES = 2

#: "local" indices: 31 of 32 entries of every row fall in the last ``LOCAL_WINDOW`` rows of the KV tensor.
LOCAL_WINDOW = 20000
#: Every ``LOCAL_STRIDE``-th entry (positions ``LOCAL_STRIDE - 1``, ``2 * LOCAL_STRIDE - 1``, ...) is a far row.
LOCAL_STRIDE = 32

#: Acceptance tolerances of docs/spec.md section 6: ``(abs_tol, rel_tol, cos_tol)``.
TOL = {
    "prefill_out": (8e-4, 3.01 / 128, 7e-6),
    "prefill_lse": (1e-6, 2.01 / 65536, None),
    "decode_out": (1e-3, 2.01 / 128, 5e-6),
    "decode_lse": (1e-6, 8.01 / 65536, None),
}
#: The two implementations are compared with each other, not with an f32 reference: each may be off the truth by
#: the spec tolerance, so the pair may be up to twice that apart (triangle inequality). A wrong kernel is off by
#: orders of magnitude more.
PAIR_TOL_FACTOR = 2.0

#: Input sets are rotated until the bytes one call touches, summed over the sets, reach this many L2 sizes.
L2_MULTIPLE = 3
#: A timed block counts as host-bound when issuing its calls took at least this fraction of its GPU time.
HOST_BOUND_FRACTION = 0.9


def k_label(n: int) -> str:
    """``32768 -> "32K"``, ``2048 -> "2K"``, ``1000 -> "1000"``."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------------------------------------------
# Counting


def sparse_fwd_flop(s_q: int, topk: float, h_q: int, d_qk: int, d_v: int = D_V) -> float:
    """``2 * s_q * topk * h_q * (d_qk + d_v)``; ``topk`` may be a mean ``topk_length``."""
    return 2.0 * s_q * topk * h_q * (d_qk + d_v)


def dense_attended(seqlens: Sequence[int], s_q: int, causal: bool) -> int:
    """Cache entries attended, summed over every (request, query token) of a dense decode step.

    Causal masks are bottom-right aligned: query ``i`` of ``s_q`` sees keys ``< L - s_q + i + 1`` of a request of
    ``L`` keys. Example: ``L = 10, s_q = 2``: 19 causal (9 + 10), 20 without.
    """
    total = 0
    for length in seqlens:
        if causal:
            total += sum(min(length, max(0, length - s_q + i + 1)) for i in range(s_q))
        else:
            total += length * s_q
    return total


def decode_flop(h_q: int, attended: int, d_qk: int, d_v: int = D_V) -> float:
    """``2 * h_q * attended * (d_qk + d_v)`` (``attended`` as :func:`dense_attended` counts it)."""
    return 2.0 * h_q * attended * (d_qk + d_v)


def sparse_decode_attended(b: int, s_q: int, topk: int, topk_length_sum: Optional[int] = None) -> int:
    """Entries attended by a sparse decode step over one cache: ``s_q * sum(topk_length)`` where lengths are given,
    else ``b * s_q * topk`` (``-1`` padding included, as FlashMLA's own benchmark counts)."""
    return s_q * (topk_length_sum if topk_length_sum is not None else b * topk)


def decode_bytes(b: int, s_q: int, h_q: int, d_qk: int, cache_tokens: int, bytes_per_token: int) -> float:
    """Q (bf16) + every distinct cache token read once + O (bf16)."""
    return 2.0 * b * s_q * h_q * (d_qk + D_V) + float(cache_tokens) * bytes_per_token


def n_input_sets(bytes_per_call: float, l2_bytes: int, max_sets: int) -> int:
    """Input sets to rotate so that the sets together touch ``L2_MULTIPLE`` L2 sizes (1 for big shapes).

    Example: a 4.9 MB decode step on a 50 MB L2 -> ceil(150 / 4.9) = 31 sets.
    """
    if bytes_per_call <= 0:
        return max_sets
    return max(1, min(max_sets, math.ceil(L2_MULTIPLE * l2_bytes / bytes_per_call)))


def fp8_block_stride(d_qk: int, page_size: int) -> int:
    """Bytes between two pages of an FP8 cache: packed for V3.2, padded to ``MODEL1_PAGE_ALIGN`` for MODEL1."""
    raw = page_size * FP8_BYTES_PER_TOKEN[d_qk]
    if d_qk == 576:
        return raw
    return -(-raw // MODEL1_PAGE_ALIGN) * MODEL1_PAGE_ALIGN


# ----------------------------------------------------------------------------------------------------------------
# Shapes


def _matches(fields: dict, name: str, terms: Iterable[str]) -> bool:
    """Every term matches: ``key=value`` compares a field (as lower-case text), any other term is a substring of
    the name (case-insensitive)."""
    for term in terms:
        term = term.strip()
        if not term:
            continue
        if "=" in term:
            key, value = term.split("=", 1)
            if key not in fields or str(fields[key]).lower() != value.strip().lower():
                return False
        elif term.lower() not in name.lower():
            return False
    return True


@dataclasses.dataclass(frozen=True)
class SparseFwdShape:
    """A sparse prefill forward shape (``h_kv = 1``, ``d_v = 512``)."""

    op: ClassVar[str] = "sparse_fwd"
    model: str  # "V3.2" or "MODEL1"
    s_q: int
    s_kv: int
    topk: int
    h_q: int
    d_qk: int
    indices: str = "random"  # "random" or "local"
    attn_sink: bool = False
    quick: bool = False

    @property
    def name(self) -> str:
        sink = " sink" if self.attn_sink else ""
        return (
            f"{self.model} s_q {k_label(self.s_q)} h{self.h_q} topk {k_label(self.topk)} s_kv {k_label(self.s_kv)}"
            f" {self.indices}{sink}"
        )

    def fields(self) -> dict:
        return dict(
            s_q=self.s_q, s_kv=self.s_kv, topk=self.topk, h_q=self.h_q, h_kv=1, d_qk=self.d_qk, d_v=D_V,
            indices=self.indices, attn_sink=self.attn_sink,
        )

    def flop(self) -> float:
        return sparse_fwd_flop(self.s_q, self.topk, self.h_q, self.d_qk)

    def bytes_per_call(self) -> float:
        """Q, O, indices and the KV rows a call can touch (at most the whole KV tensor)."""
        kv = min(self.s_kv, self.s_q * self.topk) * self.d_qk * BF16_BYTES
        return self.s_q * self.h_q * (self.d_qk + D_V) * BF16_BYTES + self.s_q * self.topk * 4 + kv


@dataclasses.dataclass(frozen=True)
class DecodeDenseShape:
    """A dense decode step over a paged bf16 cache (``h_kv = 1``, ``d_qk = 576``).

    ``seqlens`` "uniform": every request holds ``s_k`` tokens; "skewed": request 0 holds ``s_k``, the others
    ``s_k_short`` (a long request among short ones: the schedule's balancing case).
    """

    op: ClassVar[str] = "decode_dense"
    label: str
    b: int
    s_q: int
    h_q: int
    s_k: int
    causal: bool = False
    seqlens: str = "uniform"
    s_k_short: Optional[int] = None
    page_size: int = 64
    d_qk: int = 576
    quick: bool = False

    @property
    def name(self) -> str:
        causal = " causal" if self.causal else ""
        if self.seqlens == "skewed":
            kv = f"1x{k_label(self.s_k)}+{self.b - 1}x{k_label(self.s_k_short or 0)}"
        else:
            kv = f"s_k {k_label(self.s_k)}"
        return f"{self.label} b{self.b} s_q {self.s_q} h{self.h_q} {kv}{causal}"

    def lengths(self) -> List[int]:
        if self.seqlens == "skewed":
            return [self.s_k] + [int(self.s_k_short or 0)] * (self.b - 1)
        return [self.s_k] * self.b

    def fields(self) -> dict:
        fields = dict(
            b=self.b, s_q=self.s_q, s_k=self.s_k, h_q=self.h_q, h_kv=1, d_qk=self.d_qk, d_v=D_V,
            causal=self.causal, page_size=self.page_size, seqlens=self.seqlens,
        )
        if self.seqlens == "skewed":
            fields["s_k_short"] = self.s_k_short
        return fields

    def attended(self) -> int:
        return dense_attended(self.lengths(), self.s_q, self.causal)

    def flop(self) -> float:
        return decode_flop(self.h_q, self.attended(), self.d_qk)

    def bytes(self) -> float:
        return decode_bytes(self.b, self.s_q, self.h_q, self.d_qk, sum(self.lengths()), self.d_qk * BF16_BYTES)

    def bytes_per_call(self) -> float:
        return self.bytes()


@dataclasses.dataclass(frozen=True)
class DecodeSparseShape:
    """A sparse decode step over an FP8 cache (``h_kv = 1``), as FlashMLA's own decode benchmark builds them:
    request lengths drawn around ``s_k`` (normal, sd ``s_k / 2``, at least ``s_q``), ``topk`` distinct random
    tokens of its request per query token (``-1`` pads a request shorter than ``topk``), an optional extra cache
    with its own lengths and indices, and an attention sink.

    The peer serves ``h_q`` 64 and 128 only: smaller head counts are padded (``peer_h_q``), as its users must.
    """

    op: ClassVar[str] = "decode_sparse_fp8"
    label: str
    b: int
    s_q: int
    h_q: int
    s_k: int
    topk: int
    d_qk: int
    page_size: int
    extra_s_k: Optional[int] = None
    extra_topk: Optional[int] = None
    extra_page_size: Optional[int] = None
    extra_topk_length: bool = False
    attn_sink: bool = True
    quick: bool = False

    @property
    def name(self) -> str:
        topk = k_label(self.topk)
        if self.extra_topk:
            topk += f"+{k_label(self.extra_topk)}/p{self.extra_page_size}"
            if self.extra_topk_length:
                topk += " len"
        return f"{self.label} b{self.b} s_q {self.s_q} h{self.h_q} topk {topk}"

    @property
    def peer_h_q(self) -> int:
        """The head count the peer runs: 64 or 128."""
        return 64 if self.h_q <= 64 else 128

    def fields(self) -> dict:
        fields = dict(
            b=self.b, s_q=self.s_q, s_k=self.s_k, topk=self.topk, h_q=self.h_q, h_kv=1, d_qk=self.d_qk, d_v=D_V,
            indices="random", page_size=self.page_size, attn_sink=self.attn_sink,
            cache_format="v32" if self.d_qk == 576 else "model1",
        )
        if self.extra_topk:
            fields.update(
                extra_s_k=self.extra_s_k, extra_topk=self.extra_topk, extra_page_size=self.extra_page_size,
                extra_topk_length=self.extra_topk_length,
            )
        if self.peer_h_q != self.h_q:
            fields["peer_h_q"] = self.peer_h_q
        return fields

    def bytes_per_call(self) -> float:
        """Upper bound before the indices exist: every index distinct."""
        tokens = self.b * self.s_q * (self.topk + (self.extra_topk or 0))
        return decode_bytes(self.b, self.s_q, self.h_q, self.d_qk, tokens, FP8_BYTES_PER_TOKEN[self.d_qk])


@dataclasses.dataclass(frozen=True)
class DensePrefillShape:
    """A dense varlen prefill forward (bf16, ``h_q = h_kv``, ``d_v = 128``). Its "peer" is torch's
    ``scaled_dot_product_attention`` with the cuDNN backend (the fastest dense attention in a plain torch install that
    takes ``(d, d_v) = (192, 128)``), on ``[b, h, s, d]`` views of the same packed tensors; it has no varlen path, so
    batches of mixed lengths time flashmla alone."""

    op: ClassVar[str] = "dense_prefill"
    backward: ClassVar[bool] = False
    label: str
    lens: Tuple[int, ...]
    h: int = 128
    d: int = 192
    causal: bool = True
    quick: bool = False

    @property
    def name(self) -> str:
        return f"{self.label} h{self.h} d{self.d} {'causal' if self.causal else 'full'}"

    @property
    def uniform(self) -> bool:
        return len(set(self.lens)) == 1

    def fields(self) -> dict:
        return dict(
            b=len(self.lens), total=sum(self.lens), lens=list(self.lens), h_q=self.h, h_kv=self.h, d_qk=self.d,
            d_v=DENSE_D_V, causal=self.causal,
        )

    def flop(self) -> float:
        """``2 * sum(s^2) * h * (d + d_v)``, halved under the causal mask; the backward counts 2.5 times that."""
        full = 2.0 * sum(s * s for s in self.lens) * self.h * (self.d + DENSE_D_V)
        fwd = full / 2 if self.causal else full
        return 2.5 * fwd if self.backward else fwd

    def bytes_per_call(self) -> float:
        """q, k, v and out."""
        return sum(self.lens) * self.h * (2 * self.d + 2 * DENSE_D_V) * BF16_BYTES


@dataclasses.dataclass(frozen=True)
class DensePrefillBwdShape(DensePrefillShape):
    """The dense prefill backward (gradients of q, k and v from the forward's out and lse) on the same shapes; torch's
    side is the cuDNN backend's backward (``torch.autograd.grad`` through ``scaled_dot_product_attention``)."""

    op: ClassVar[str] = "dense_prefill_bwd"
    backward: ClassVar[bool] = True


#: Value width of the dense prefill.
DENSE_D_V = 128
#: The mixed-length batch of the dense prefill grid: 16K tokens in sequences of 512 to 4K.
DENSE_MIXED_LENS = (4096, 512, 2048, 1024, 3072, 1536, 2560, 1024, 512)


def dense_prefill_shapes() -> List[DensePrefillShape]:
    """h 128, (192, 128), causal: 4 x 4K, 2 x 8K, 1 x 16K and the mixed 16K batch; 4 x 4K without the mask and with
    (128, 128) heads."""
    shapes = [
        DensePrefillShape("4x4K", (4096,) * 4, quick=True),
        DensePrefillShape("2x8K", (8192,) * 2),
        DensePrefillShape("1x16K", (16384,), quick=True),
        DensePrefillShape("mixed16K", DENSE_MIXED_LENS),
        DensePrefillShape("4x4K", (4096,) * 4, causal=False),
        DensePrefillShape("4x4K", (4096,) * 4, d=128),
    ]
    return shapes


#: The ops this benchmark times, in the order it times them.
OPS = ("sparse_fwd", "decode_dense", "decode_sparse_fp8", "dense_prefill", "dense_prefill_bwd")


def sparse_fwd_shapes() -> List[SparseFwdShape]:
    """The standard sparse prefill shapes, each with random and local indices, without and with a sink."""
    base = [SparseFwdShape("V3.2", 4096, s_kv, 2048, 128, 576) for s_kv in (8192, 32768, 65536, 131072)]
    base.append(SparseFwdShape("V3.2", 4096, 32768, 2048, 64, 576))
    for h_q, topk in ((64, 512), (128, 1024)):
        base += [SparseFwdShape("MODEL1", 4096, s_kv, topk, h_q, 512) for s_kv in (8192, 32768, 65536)]
    base.append(SparseFwdShape("V3.2", 1024, 2048, 512, 128, 576))
    quick = {("V3.2", 128, 32768, 2048), ("MODEL1", 64, 32768, 512), ("V3.2", 128, 2048, 512)}
    shapes = []
    for shape in base:
        for indices in ("random", "local"):
            for sink in (False, True):
                is_quick = (shape.model, shape.h_q, shape.s_kv, shape.topk) in quick and indices == "random"
                shapes.append(
                    dataclasses.replace(shape, indices=indices, attn_sink=sink, quick=is_quick and not sink)
                )
    return shapes


def decode_dense_shapes() -> List[DecodeDenseShape]:
    """b 128 x s_q {1, 2} x h_q {16, 64, 128} x s_k {4K, 16K, 32K} x causal off/on, page 64; the skewed batch
    (1 x 131072 + 127 x 1024) at s_q {1, 2} x h_q {16, 64, 128}; the b 1 latency shape."""
    shapes = []
    quick = {(1, 64, 16384, False), (2, 128, 4096, False)}
    for s_q in (1, 2):
        for h_q in (16, 64, 128):
            for s_k in (4096, 16384, 32768):
                for causal in (False, True):
                    is_quick = (s_q, h_q, s_k, causal) in quick
                    shapes.append(DecodeDenseShape("batch", 128, s_q, h_q, s_k, causal, quick=is_quick))
    for s_q in (1, 2):
        for h_q in (16, 64, 128):
            shapes.append(
                DecodeDenseShape(
                    "skewed", 128, s_q, h_q, 131072, seqlens="skewed", s_k_short=1024, quick=(s_q, h_q) == (1, 128)
                )
            )
    shapes.append(DecodeDenseShape("latency", 1, 1, 128, 4096, quick=True))
    return shapes


def decode_sparse_shapes() -> List[DecodeSparseShape]:
    """FlashMLA's own sparse decode performance cases (all ``s_q = 2``) plus ``h_q = 16`` (tensor parallelism)."""
    shapes = []
    for b in (2, 64, 74, 128):
        shapes.append(DecodeSparseShape("V3.2", b, 2, 128, 32768, 2048, 576, 64, quick=b == 128))
    model1 = (
        ("MODEL1 c1", 64, 512, 64, False),
        ("MODEL1 c2", 128, 1024, 64, False),
        ("MODEL1 c3", 64, 1024, 2, True),
        ("MODEL1 c4", 128, 1024, 2, True),
    )
    for label, h_q, extra_topk, extra_page, extra_len in model1:
        for b in (2, 64, 74, 128, 148, 256):
            shapes.append(
                DecodeSparseShape(
                    label, b, 2, h_q, 16384, 128, 512, 256, extra_s_k=16384, extra_topk=extra_topk,
                    extra_page_size=extra_page, extra_topk_length=extra_len, quick=label == "MODEL1 c1" and b == 128,
                )
            )
    for h_q in (64, 128):
        for d_qk in (512, 576):
            model = "V3.2" if d_qk == 576 else "MODEL1"
            shapes.append(DecodeSparseShape(f"peak {model}", 148, 2, h_q, 32768, 16384, d_qk, 64))
    for s_q in (1, 2):
        shapes.append(DecodeSparseShape("V3.2 tp16", 128, s_q, 16, 32768, 2048, 576, 64, quick=s_q == 1))
    return shapes


GRIDS: Dict[str, Callable[[], list]] = {
    "sparse_fwd": sparse_fwd_shapes,
    "decode_dense": decode_dense_shapes,
    "decode_sparse_fp8": decode_sparse_shapes,
    "dense_prefill": dense_prefill_shapes,
    "dense_prefill_bwd": lambda: [
        DensePrefillBwdShape(s.label, s.lens, s.h, s.d, s.causal, s.quick) for s in dense_prefill_shapes()
    ],
}


def select_shapes(ops: Sequence[str], filters: Sequence[str], quick: bool) -> list:
    """The shapes of ``ops`` (in ``OPS`` order) that pass ``filters`` (any of them; each a comma- or
    space-separated list of terms that must all match, see :func:`_matches`) and, with ``quick``, the quick subset."""
    unknown = [op for op in ops if op not in GRIDS]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}: expected some of {', '.join(OPS)}")
    shapes = []
    for op in OPS:
        if op not in ops:
            continue
        for shape in GRIDS[op]():
            if quick and not shape.quick:
                continue
            if filters and not any(
                _matches(shape.fields(), shape.name, f.replace(",", " ").split()) for f in filters
            ):
                continue
            shapes.append(shape)
    return shapes


@dataclasses.dataclass(frozen=True)
class HostCostShape:
    """A tiny call whose time is all host work."""

    op: str
    fields_: Tuple[Tuple[str, object], ...]

    def fields(self) -> dict:
        return dict(self.fields_)


#: `--host-cost`: a sparse prefill of one token (s_q 1, topk 128, h 64, s_kv 1024), a sparse FP8 decode of one
#: token over 64 of 256 cached ones (b 1, s_q 1, h 64, V3.2 cache) and a dense decode of one token over 64 cached
#: ones (b 1, s_q 1, h 128, page 64).
HOST_COST_SHAPES = (
    HostCostShape(
        "sparse_fwd",
        (("s_q", 1), ("s_kv", 1024), ("topk", 128), ("h_q", 64), ("h_kv", 1), ("d_qk", 576), ("d_v", D_V),
         ("indices", "random"), ("attn_sink", False)),
    ),
    HostCostShape(
        "decode_sparse",
        (("b", 1), ("s_q", 1), ("h_q", 64), ("topk", 64), ("d_qk", 576), ("d_v", D_V), ("blocks", 4),
         ("page_size", 64)),
    ),
    HostCostShape(
        "decode_dense",
        (("b", 1), ("s_q", 1), ("s_k", 64), ("h_q", 128), ("h_kv", 1), ("d_qk", 576), ("d_v", D_V),
         ("causal", False), ("page_size", 64)),
    ),
)


# ----------------------------------------------------------------------------------------------------------------
# Input generators (any device; `gen` is a torch.Generator on that device)


def randn_offset(shape, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """``randn / 10`` plus a random per-tensor offset in ``[-0.05, 0.05)``: never zeros, never symmetric."""
    device = gen.device
    offset = (torch.rand((), generator=gen, device=device).item() - 0.5) / 10
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).div_(10).add_(offset)
    return x.to(dtype)


def distinct_rows(n: int, lo: int, hi: int, k: int, gen: torch.Generator, chunk_elems: int = 1 << 25) -> torch.Tensor:
    """``[n, k]`` int32: each row ``k`` distinct random values of ``[lo, hi)`` in random order; when the range
    holds fewer than ``k`` values, all of them (shuffled) followed by ``-1``."""
    device = gen.device
    span = max(0, hi - lo)
    take = min(k, span)
    out = torch.full((n, k), -1, dtype=torch.int32, device=device)
    if take == 0 or n == 0:
        return out
    rows = max(1, chunk_elems // span)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        keys = torch.rand((stop - start, span), generator=gen, device=device)
        out[start:stop, :take] = keys.topk(take, dim=1, sorted=True).indices.to(torch.int32) + lo
    return out


def local_rows(n: int, s_kv: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int32 "local" indices: distinct rows of the last ``LOCAL_WINDOW`` rows, except every
    ``LOCAL_STRIDE``-th entry, a row before that window (all rows random when ``s_kv <= LOCAL_WINDOW``)."""
    lo = max(0, s_kv - LOCAL_WINDOW)
    idx = distinct_rows(n, lo, s_kv, k, gen)
    n_far = k // LOCAL_STRIDE
    if lo == 0 or n_far == 0:
        return idx
    if lo >= n_far:
        far = distinct_rows(n, 0, lo, n_far, gen)
    else:
        far = torch.randint(0, lo, (n, n_far), generator=gen, device=gen.device, dtype=torch.int32)
    idx[:, LOCAL_STRIDE - 1 :: LOCAL_STRIDE] = far
    return idx


def varlen_lengths(b: int, s_k: int, s_q: int, gen: torch.Generator) -> List[int]:
    """Request lengths around ``s_k``: normal with sd ``s_k / 2``, at least ``s_q`` (drawn on ``gen``'s device)."""
    x = torch.randn((b,), generator=gen, device=gen.device, dtype=torch.float64) * (s_k / 2) + s_k
    return [max(int(v), s_q) for v in x.tolist()]


def paged_layout(lengths: Sequence[int], page_size: int, gen: torch.Generator) -> Tuple[torch.Tensor, int]:
    """A block table ``[b, max_pages]`` int32 giving every request its own pages in random order over a cache of
    exactly as many pages as the requests need; entries past a request's last page hold a valid page (0) that is
    never needed. Returns ``(block_table, num_pages)``."""
    pages = [-(-length // page_size) for length in lengths]
    total = max(1, sum(pages))
    perm = torch.randperm(total, generator=gen, device=gen.device).to(torch.int32)
    width = max(1, max(pages))
    table = torch.zeros((len(lengths), width), dtype=torch.int32, device=gen.device)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[start : start + n]
        start += n
    return table, total


def cache_indices(abs_idx: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token positions within each request ``[b, s_q, topk]`` -> cache indices ``page * page_size + offset``
    through the block table; ``-1`` stays ``-1``."""
    valid = abs_idx >= 0
    safe = torch.where(valid, abs_idx, torch.zeros_like(abs_idx)).long()
    pages = torch.gather(block_table.long(), 1, (safe // page_size).flatten(1)).view_as(safe)
    idx = pages * page_size + safe % page_size
    return torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)


def distinct_valid(idx: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> int:
    """Distinct non-negative values of ``idx [b, s_q, topk]``, counting only entries before ``lengths[b]``."""
    if lengths is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device).view(1, 1, -1)
        idx = torch.where(pos < lengths.view(-1, 1, 1), idx, torch.full_like(idx, -1))
    valid = idx[idx >= 0]
    return int(valid.unique().numel())


# ----------------------------------------------------------------------------------------------------------------
# Comparing the two implementations


def pair_check(ours: torch.Tensor, peer: torch.Tensor, tol, chunk: int = 1 << 24) -> dict:
    """Compares two outputs of the same computation with docs/spec.md section 6's criterion at
    ``PAIR_TOL_FACTOR`` times ``tol``: each element within the absolute or the relative tolerance, infinities in
    the same places, no NaN, and (where ``tol`` has one) the cosine distance under its bound.

    Returns ``{"max_abs_diff", "failed", "cos_diff", "ok"}`` (``failed``: elements out of tolerance)."""
    abs_tol, rel_tol, cos_tol = tol
    abs_tol, rel_tol = abs_tol * PAIR_TOL_FACTOR, rel_tol * PAIR_TOL_FACTOR
    if ours.shape != peer.shape:
        return dict(max_abs_diff=None, failed=None, cos_diff=None, ok=False,
                    error=f"shapes differ: {tuple(ours.shape)} vs {tuple(peer.shape)}")
    a_all, r_all = ours.reshape(-1), peer.reshape(-1)
    max_abs, failed, dot, norm = 0.0, 0, 0.0, 0.0
    for start in range(0, a_all.numel(), chunk):
        a = a_all[start : start + chunk].double()
        r = r_all[start : start + chunk].double()
        nan = torch.isnan(a) | torch.isnan(r)
        inf_mismatch = (torch.isinf(a) | torch.isinf(r)) & (a != r)
        finite = torch.isfinite(a) & torch.isfinite(r)
        diff = torch.where(finite, (a - r).abs(), torch.zeros_like(a))
        bad = (diff >= abs_tol) & (diff / (r.abs() + 1e-6) >= rel_tol)
        failed += int((bad | nan | inf_mismatch).sum())
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        a0, r0 = torch.where(finite, a, torch.zeros_like(a)), torch.where(finite, r, torch.zeros_like(r))
        dot += float((a0 * r0).sum())
        norm += float((a0 * a0 + r0 * r0).sum())
    cos_diff = 1.0 - 2.0 * dot / norm if norm > 0 else 0.0
    ok = failed == 0 and (cos_tol is None or cos_diff < cos_tol * PAIR_TOL_FACTOR)
    return dict(max_abs_diff=max_abs, failed=failed, cos_diff=cos_diff, ok=ok)


# ----------------------------------------------------------------------------------------------------------------
# The regime scheduler


@dataclasses.dataclass
class Block:
    """One timed block of back-to-back calls of one implementation."""

    gpu_ms: float  # CUDA events around the whole block
    issue_ms: float  # host time spent issuing the calls
    sm_clock_mhz: Optional[float] = None  # read right after the block


class Runner:
    """What the scheduler needs from the device; ``side_by_side.CudaRunner`` times CUDA events, the tests fake it."""

    def now(self) -> float:
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def block(self, name: str, calls: int) -> Block:
        raise NotImplementedError


def calls_for(call_ms: float, block_ms: float, min_calls: int = 2, max_calls: int = 20000) -> int:
    """Calls that fill a block of ``block_ms``: ``25 ms / 3.6 ms -> 7``; at least ``min_calls``."""
    if call_ms <= 0:
        return max_calls
    return max(min_calls, min(max_calls, round(block_ms / call_ms)))


def calibrate(runner: Runner, names: Sequence[str], block_ms: float, probe_calls: int = 3) -> Dict[str, int]:
    """Calls per block for each implementation, from a probe block (a second, longer probe for calls so short
    that three of them mostly measure launch latency)."""
    calls = {}
    for name in names:
        n = probe_calls
        probe = runner.block(name, n)
        if probe.gpu_ms < block_ms / 10:
            n = calls_for(probe.gpu_ms / n, block_ms / 5)
            probe = runner.block(name, n)
        calls[name] = calls_for(probe.gpu_ms / n, block_ms)
    return calls


def round_orders(names: Sequence[str], rounds: int) -> List[List[str]]:
    """Round ``r`` starts with implementation ``r mod len(names)`` (so with two, they alternate going first)."""
    names = list(names)
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)] if names else []


def run_short(runner: Runner, names: Sequence[str], calls: Dict[str, int], rounds: int, idle_s: float):
    """Short blocks at full clock: per round one block of each implementation, each after ``idle_s`` of idle, so
    that every block starts on a cool card whatever ran before it. (With one idle per round, the block that came
    last in a round ran up to 18% slower than the same implementation's first block on an H200 at 1.7-2 ms calls.)"""
    blocks: Dict[str, List[Block]] = {name: [] for name in names}
    for order in round_orders(names, rounds):
        for name in order:
            runner.sleep(idle_s)
            blocks[name].append(runner.block(name, calls[name]))
    return blocks


def run_sustained(runner: Runner, names: Sequence[str], calls: Dict[str, int], rounds: int, load_s: float):
    """At the power cap: ``load_s`` of untimed back-to-back blocks (all implementations), then the timed rounds
    with no idle between blocks."""
    start = runner.now()
    while names and runner.now() - start < load_s:
        for name in names:
            runner.block(name, calls[name])
    blocks: Dict[str, List[Block]] = {name: [] for name in names}
    for order in round_orders(names, rounds):
        for name in order:
            blocks[name].append(runner.block(name, calls[name]))
    return blocks


@dataclasses.dataclass
class ImplStats:
    """One implementation's timing in one regime."""

    time_us: float  # median over blocks of (block time / calls)
    samples_us: List[float]
    calls: int
    sm_clock_mhz: Optional[float]
    host_bound: bool  # most blocks were issued about as slowly as the GPU ran them


def summarize(blocks: Sequence[Block], calls: int) -> ImplStats:
    samples = [b.gpu_ms * 1000.0 / calls for b in blocks]
    clocks = [b.sm_clock_mhz for b in blocks if b.sm_clock_mhz is not None]
    host_bound = sum(b.issue_ms >= HOST_BOUND_FRACTION * b.gpu_ms for b in blocks) * 2 > len(blocks)
    return ImplStats(
        time_us=statistics.median(samples),
        samples_us=[round(s, 2) for s in samples],
        calls=calls,
        sm_clock_mhz=round(statistics.fmean(clocks), 1) if clocks else None,
        host_bound=host_bound,
    )


def impl_count(op: str) -> int:
    """Implementations timed per shape: flashmla and the peer; decode adds the peer computing its metadata."""
    return 3 if op.startswith("decode") else 2


def estimate_seconds(impl_counts: Sequence[int], regimes: Sequence[str], rounds_short: int, rounds_sustained: int,
                     idle_s: float, load_s: float, block_ms: float, setup_s: float = 2.0) -> float:
    """Rough wall time of a run (one entry of ``impl_counts`` per shape), for ``--list``."""
    total = 0.0
    for n in impl_counts:
        total += setup_s + n * block_ms / 1000  # inputs, warm-up, the calibration probes
        if "short" in regimes:
            total += rounds_short * n * (idle_s + block_ms / 1000)
        if "sustained" in regimes:
            total += load_s + rounds_sustained * n * block_ms / 1000
    return total


# ----------------------------------------------------------------------------------------------------------------
# Records

#: Implementation names used by the scheduler and in records.
OURS, PEER, PEER_META = "flashmla", "peer", "peer+metadata"
#: The timing method's version, written into every timing record as ``harness``, so that records taken with
#: different methods are not compared as if they were one: 1 (records without the field), the short regime idled once
#: per round, before its first block; 2, it idles before every block.
HARNESS = 2
#: Each regime's name in the ``timing`` field of bench records (docs/benchmarking.md, section 7).
TIMING = {"short": "full-clock", "sustained": "sustained"}


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return round(num / den, 4) if num and den else None


def _rate(amount: Optional[float], time_us: Optional[float], scale: float) -> Optional[float]:
    return round(amount / (time_us * 1e-6) / scale, 1) if amount and time_us else None


def make_record(
    op: str,
    name: str,
    fields: dict,
    regime: str,
    stats: Dict[str, ImplStats],
    flop: Optional[float],
    nbytes: Optional[float],
    env: dict,
    check: Optional[dict] = None,
    notes: Sequence[str] = (),
    input_sets: int = 1,
    regime_fields: Optional[dict] = None,
) -> dict:
    """One JSON record for (op, shape, regime): both times, ``vs_peer = peer_time_us / time_us``, TFLOPS (and
    GB/s where ``nbytes`` is given) for each, per-block samples, clocks, the pair check and the environment.

    Besides ``regime`` and ``harness`` (the timing method's version, ``HARNESS``), the record carries the fields
    docs/benchmarking.md gives every bench record: ``timing`` (``full-clock`` for short blocks, ``sustained``) and
    what ``regime_fields`` adds (``cooldown_ms``...), ``reps`` (timed calls) and ``run_sm_clock_mhz`` (the SM clock
    read after each timed block, mean); the peer's figures carry the prefix ``peer_`` (``peer_with_metadata_`` for
    the variant computing its metadata)."""
    ours, peer, meta = stats.get(OURS), stats.get(PEER), stats.get(PEER_META)
    t_ours = round(ours.time_us, 2) if ours else None
    t_peer = round(peer.time_us, 2) if peer else None
    rec = dict(op=op, name=name)
    rec.update(fields)
    rec.update(regime=regime, timing=TIMING[regime], harness=HARNESS)
    rec.update(regime_fields or {})
    rec.update(
        time_us=t_ours,
        peer_time_us=t_peer,
        vs_peer=_ratio(t_peer, t_ours),
        tflops=_rate(flop, t_ours, 1e12),
        peer_tflops=_rate(flop, t_peer, 1e12),
    )
    if nbytes is not None:
        rec.update(gb_per_s=_rate(nbytes, t_ours, 1e9), peer_gb_per_s=_rate(nbytes, t_peer, 1e9))
    if meta:
        t_meta = round(meta.time_us, 2)
        rec.update(peer_with_metadata_time_us=t_meta, vs_peer_with_metadata=_ratio(t_meta, t_ours))
    for key, st in ((OURS, ours), (PEER, peer), (PEER_META, meta)):
        if st is None:
            continue
        prefix = "" if key == OURS else ("peer_" if key == PEER else "peer_with_metadata_")
        rec[prefix + "samples_us"] = st.samples_us
        rec[prefix + "calls_per_block"] = st.calls
        rec[prefix + "reps"] = st.calls * len(st.samples_us)
        rec[prefix + "run_sm_clock_mhz"] = st.sm_clock_mhz
        rec[prefix + "host_bound"] = st.host_bound
    rec.update(flop=flop, bytes=nbytes, input_sets=input_sets, check=check, notes=list(notes))
    rec.update(env)
    return rec


@dataclasses.dataclass
class HostCost:
    """Per-call host figures of ``calls`` back-to-back calls, microseconds: CPU time of the process over the loop
    and the final synchronisation, wall time of the same, wall time of issuing the calls alone, and wall time of
    issuing them in short bursts on an idle stream (the host's own cost, even where the GPU is the limit of a
    back-to-back loop)."""

    cpu_us: float
    wall_us: float
    issue_us: float
    burst_issue_us: float


def make_host_record(
    shape: HostCostShape, api: str, ours: Optional[HostCost], peer: Optional[HostCost], calls: int, env: dict,
    notes: Sequence[str] = (),
) -> dict:
    """A ``--host-cost`` record (``op`` ``host_cost``, ``call`` the op called): ``time_us`` / ``peer_time_us``
    are CPU microseconds per call through ``api`` and the peer's entry point; ``vs_peer = peer_time_us /
    time_us``."""
    t_ours = round(ours.cpu_us, 2) if ours else None
    t_peer = round(peer.cpu_us, 2) if peer else None
    rec = dict(op="host_cost", call=shape.op, name=f"{shape.op} via {api}")
    rec.update(shape.fields())
    rec.update(regime="host", api=api, time_us=t_ours, peer_time_us=t_peer, vs_peer=_ratio(t_peer, t_ours))
    for prefix, cost in (("", ours), ("peer_", peer)):
        if cost is not None:
            rec[prefix + "wall_us"] = round(cost.wall_us, 2)
            rec[prefix + "issue_us"] = round(cost.issue_us, 2)
            rec[prefix + "burst_issue_us"] = round(cost.burst_issue_us, 2)
    rec.update(calls=calls, notes=list(notes))
    rec.update(env)
    return rec


def fmt(value, digits: int = 1) -> str:
    """A table cell: ``-`` for None, floats to ``digits`` places."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(records: Sequence[dict]) -> str:
    """A compact text table: one line per record."""
    header = ("op", "shape", "regime", "ours us", "peer us", "vs peer", "ours TF", "peer TF", "ours GB/s", "check")
    rows = [header]
    for r in records:
        check = r.get("check")
        verdict = "-" if not check else ("ok" if check.get("ok") else "MISMATCH")
        ours_mark = "*" if r.get("host_bound") else ""
        peer_mark = "*" if r.get("peer_host_bound") else ""
        rows.append((
            r["op"], r["name"], r["regime"], fmt(r.get("time_us")) + ours_mark,
            fmt(r.get("peer_time_us")) + peer_mark, fmt(r.get("vs_peer"), 3), fmt(r.get("tflops")),
            fmt(r.get("peer_tflops")), fmt(r.get("gb_per_s"), 0), verdict,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any(r.get("host_bound") or r.get("peer_host_bound") for r in records):
        lines.append("* a block was issued about as slowly as the GPU ran it: host-bound, not a kernel time")
    return "\n".join(lines)
