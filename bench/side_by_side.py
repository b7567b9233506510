"""flashmla and FlashMLA (the peer) side by side: one process, one card, the same inputs, the two implementations
alternating inside every round, in two regimes.

* ``short``: per round, one block of ~``--block-ms`` (25 ms) of back-to-back calls of each implementation, each
  block after ``--idle-s`` (1 s) of idle; which one goes first alternates per round. The card starts every block
  cool, at full clock.
* ``sustained``: ``--load-s`` (1.5 s) of back-to-back calls first (the card reaches its power cap), then the same
  alternating blocks with no idle.

A block is timed with CUDA events around it and divided by its number of calls; the reported time is the median
over rounds. Inputs are ``randn / 10`` plus an offset; shapes whose call touches less than 3x the L2 rotate several
input sets (every call uses the next set). Before timing, both implementations run once on the same set and their
outputs are compared (docs/spec.md section 6 criterion at twice its tolerance: each side may be that far off the
truth); a mismatch is flagged in the record and the table, so that a fast wrong result cannot pass unnoticed.

Ops (``--ops``): ``sparse_fwd`` (the standard sparse prefill shapes, random and local indices, with and without a
sink), ``decode_dense`` (b 128 grid, skewed batch, b 1 latency), ``decode_sparse_fp8`` (FlashMLA's own decode
performance cases plus h_q 16, which the peer runs with heads padded to 64), ``dense_prefill`` (the varlen MHA
prefill forward, h 128, against torch's cuDNN attention, which needs no ``--peer``). ``--host-cost`` instead measures the
host time per call of tiny calls. Every op runs under ``torch.inference_mode()``.

For the peer's decode, its scheduling metadata is computed once per input set before timing (as servers do); the
``peer+metadata`` variant passes a fresh metadata object each call, so each call computes it again. flashmla decode
goes through ``flashmla.compat.flash_mla_with_kvcache`` (FlashMLA's signature); its sparse prefill through
``flashmla.sparse_fwd`` (no autograd). FP8 caches are written by ``flashmla.kv_quantize`` and the same bytes go to
both implementations.

Usage (on the GPU machine; flashmla installed on PYTHONPATH, the peer built by scripts/build-peer.sh)::

    python3 bench/side_by_side.py --peer .peer --ops sparse_fwd --regime both --json out.json
    python3 bench/side_by_side.py --peer .peer --quick --list      # the shapes and an estimated duration
    python3 bench/side_by_side.py --peer .peer --host-cost --json host.json

Records: a JSON array (rewritten after every record), one per (op, shape, regime); see ``make_record`` in
``side_by_side_core.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import side_by_side_core as core  # noqa: E402
from gemm_ceiling import Nvml  # noqa: E402
from side_by_side_core import OURS, PEER, PEER_META  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: Pages of FP8 cache quantised per `kv_quantize` call (bounds the bf16 staging buffer).
QUANT_CHUNK_TOKENS = 1 << 18
#: Elements of a random tensor generated per step (bounds the f32 staging buffer).
RANDN_CHUNK = 1 << 26
#: Untimed host-cost calls before the measured loop.
HOST_WARMUP_CALLS = 20
#: Calls per burst of the issue-time measurement (at most 3 launches each: ~100 queued launches, far from the
#: driver's queue depth).
HOST_BURST_CALLS = 32


# ----------------------------------------------------------------------------------------------------------------
# Environment


@dataclasses.dataclass
class Libs:
    """The two implementations' modules (None where missing, with the reason)."""

    fm: object = None
    fm_compat: object = None
    peer: object = None
    missing: Dict[str, str] = dataclasses.field(default_factory=dict)


def import_libs(peer_path: Optional[str]) -> Libs:
    libs = Libs()
    try:
        import flashmla
        import flashmla.compat

        libs.fm, libs.fm_compat = flashmla, flashmla.compat
    except Exception as e:  # an import can fail in many ways (missing wheel, ABI); report and go on
        libs.missing[OURS] = f"import flashmla failed: {type(e).__name__}: {e}"
    if peer_path is None:
        libs.missing[PEER] = "no --peer given"
    else:
        sys.path.insert(0, str(Path(peer_path).resolve()))
        try:
            import flash_mla

            libs.peer = flash_mla
        except Exception as e:
            libs.missing[PEER] = f"import flash_mla from {peer_path} failed: {type(e).__name__}: {e}"
    for name, reason in libs.missing.items():
        print(f"[skip] {name}: {reason}", flush=True)
    return libs


def nvml_text(nvml: Nvml, fn: str, *args) -> Optional[str]:
    if nvml.lib is None:
        return None
    buf = ctypes.create_string_buffer(96)
    if getattr(nvml.lib, fn)(*args, buf, ctypes.c_uint(len(buf))) != 0:
        return None
    return buf.value.decode()


def nvml_uint(nvml: Nvml, fn: str, *args) -> Optional[int]:
    if nvml.lib is None:
        return None
    value = ctypes.c_uint()
    if getattr(nvml.lib, fn)(nvml.handle, *args, ctypes.byref(value)) != 0:
        return None
    return value.value


def git_commit(path: Path) -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def environment(args, nvml: Nvml, libs: Libs) -> dict:
    """What every record carries: card, clocks, driver, versions, commits, date."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    commit = args.commit
    if commit is None and args.commit_file:
        commit = Path(args.commit_file).read_text().strip() or None
    if commit is None:
        commit = git_commit(ROOT)
    limit_mw = nvml_uint(nvml, "nvmlDeviceGetEnforcedPowerLimit")
    return dict(
        gpu=props.name,
        sm_count=props.multi_processor_count,
        sm_clock_mhz=nvml_uint(nvml, "nvmlDeviceGetMaxClockInfo", ctypes.c_uint(1)),
        power_limit_w=limit_mw / 1000 if limit_mw else None,
        driver=nvml_text(nvml, "nvmlSystemGetDriverVersion"),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        commit=commit,
        flashmla_version=getattr(libs.fm, "__version__", None),
        peer_commit=args.peer_commit,
        date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    )


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def randn_offset(shape, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """``core.randn_offset`` generated in chunks (a multi-GB cache never needs its f32 copy)."""
    out = torch.empty(shape, dtype=dtype, device=gen.device)
    flat = out.view(-1)
    offset = (torch.rand((), generator=gen, device=gen.device).item() - 0.5) / 10
    for start in range(0, flat.numel(), RANDN_CHUNK):
        stop = min(flat.numel(), start + RANDN_CHUNK)
        chunk = torch.randn((stop - start,), generator=gen, device=gen.device, dtype=torch.float32)
        flat[start:stop] = chunk.div_(10).add_(offset).to(dtype)
    return out


def sink(h_q: int, gen: torch.Generator) -> torch.Tensor:
    """An attention sink: one finite logit per head."""
    return torch.randn((h_q,), generator=gen, device=gen.device, dtype=torch.float32)


@dataclasses.dataclass
class Case:
    """One shape's inputs and the calls of each implementation on input set ``i``; each call returns
    ``(out, lse)`` shaped alike for both (the peer's padded heads sliced off)."""

    sets: int
    calls: Dict[str, Callable[[int], tuple]]
    flop: float
    nbytes: Optional[float]
    tol_out: tuple
    tol_lse: tuple
    notes: List[str]


def sparse_fwd_case(shape: core.SparseFwdShape, libs: Libs, gen, l2: int, max_sets: int) -> Case:
    n = core.n_input_sets(shape.bytes_per_call(), l2, max_sets)
    sets = []
    for _ in range(n):
        q = randn_offset((shape.s_q, shape.h_q, shape.d_qk), gen)
        kv = randn_offset((shape.s_kv, 1, shape.d_qk), gen)
        if shape.indices == "local":
            idx = core.local_rows(shape.s_q, shape.s_kv, shape.topk, gen)
        else:
            idx = core.distinct_rows(shape.s_q, 0, shape.s_kv, shape.topk, gen)
        sets.append((q, kv, idx.view(shape.s_q, 1, shape.topk), sink(shape.h_q, gen) if shape.attn_sink else None))
    scale = shape.d_qk**-0.5
    calls = {}
    if libs.fm is not None:
        fm = libs.fm

        def ours(i):
            q, kv, idx, s = sets[i]
            out, _max_logits, lse = fm.sparse_fwd(q, kv, idx, scale, s)
            return out, lse

        calls[OURS] = ours
    if libs.peer is not None:
        peer = libs.peer

        def theirs(i):
            q, kv, idx, s = sets[i]
            out, _max_logits, lse = peer.flash_mla_sparse_fwd(q, kv, idx, scale, core.D_V, s)
            return out, lse

        calls[PEER] = theirs
    return Case(n, calls, shape.flop(), None, core.TOL["prefill_out"], core.TOL["prefill_lse"], [])


def decode_dense_case(shape: core.DecodeDenseShape, libs: Libs, gen, l2: int, max_sets: int) -> Case:
    n = core.n_input_sets(shape.bytes_per_call(), l2, max_sets)
    lengths = shape.lengths()
    sets = []
    for _ in range(n):
        q = randn_offset((shape.b, shape.s_q, shape.h_q, shape.d_qk), gen)
        table, pages = core.paged_layout(lengths, shape.page_size, gen)
        cache = randn_offset((pages, shape.page_size, 1, shape.d_qk), gen)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=gen.device)
        sets.append((q, cache, table, seqlens))
    scale = shape.d_qk**-0.5
    calls = {}
    if libs.fm_compat is not None:
        compat = libs.fm_compat
        metas = [compat.get_mla_metadata()[0] for _ in range(n)]

        def ours(i):
            q, cache, table, seqlens = sets[i]
            return compat.flash_mla_with_kvcache(
                q, cache, table, seqlens, core.D_V, metas[i], None, softmax_scale=scale, causal=shape.causal
            )

        calls[OURS] = ours
    if libs.peer is not None:
        peer = libs.peer
        metas_peer = [peer.get_mla_metadata()[0] for _ in range(n)]

        def theirs(i, fresh=False):
            q, cache, table, seqlens = sets[i]
            meta = peer.get_mla_metadata()[0] if fresh else metas_peer[i]
            return peer.flash_mla_with_kvcache(
                q, cache, table, seqlens, core.D_V, meta, None, softmax_scale=scale, causal=shape.causal
            )

        calls[PEER] = theirs
        calls[PEER_META] = lambda i: theirs(i, fresh=True)
    return Case(n, calls, shape.flop(), shape.bytes(), core.TOL["decode_out"], core.TOL["decode_lse"], [])


@dataclasses.dataclass
class Fp8Scope:
    """One FP8 cache with its indices (a main or an extra cache of a sparse decode step)."""

    cache: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    attended: int
    distinct: int


def fp8_scope(fm, b, s_q, s_k, topk, d_qk, page, with_length, gen) -> Fp8Scope:
    lengths = core.varlen_lengths(b, s_k, s_q, gen)
    table, pages = core.paged_layout(lengths, page, gen)
    abs_idx = torch.stack([core.distinct_rows(s_q, 0, length, topk, gen) for length in lengths])
    idx = core.cache_indices(abs_idx, table, page)
    topk_length = None
    if with_length:
        topk_length = torch.randint(0, topk + 1, (b,), generator=gen, device=gen.device, dtype=torch.int32)
    bpt, stride = core.FP8_BYTES_PER_TOKEN[d_qk], core.fp8_block_stride(d_qk, page)
    storage = torch.empty((pages, stride), dtype=torch.uint8, device=gen.device)
    cache = storage.as_strided((pages, page, 1, bpt), (stride, bpt, bpt, 1))
    step = max(1, QUANT_CHUNK_TOKENS // page)
    for p0 in range(0, pages, step):
        p1 = min(pages, p0 + step)
        fm.kv_quantize(randn_offset((p1 - p0, page, 1, d_qk), gen), out=cache[p0:p1])
    length_sum = int(topk_length.sum()) if topk_length is not None else None
    return Fp8Scope(
        cache, idx, topk_length, core.sparse_decode_attended(b, s_q, topk, length_sum),
        core.distinct_valid(idx, topk_length),
    )


def decode_sparse_case(shape: core.DecodeSparseShape, libs: Libs, gen, l2: int, max_sets: int) -> Case:
    if libs.fm is None:
        raise RuntimeError("the FP8 caches are written by flashmla.kv_quantize, and flashmla is missing")
    n = core.n_input_sets(shape.bytes_per_call(), l2, max_sets)
    b, s_q, h_q, d_qk = shape.b, shape.s_q, shape.h_q, shape.d_qk
    pad = shape.peer_h_q - h_q
    sets = []
    attended = distinct = 0
    for _ in range(n):
        q = randn_offset((b, s_q, h_q, d_qk), gen)
        s = sink(h_q, gen) if shape.attn_sink else None
        main = fp8_scope(libs.fm, b, s_q, shape.s_k, shape.topk, d_qk, shape.page_size, False, gen)
        extra = None
        if shape.extra_topk:
            extra = fp8_scope(
                libs.fm, b, s_q, shape.extra_s_k, shape.extra_topk, d_qk, shape.extra_page_size,
                shape.extra_topk_length, gen,
            )
        # The peer's users pad the heads themselves; the padded copies are made here, outside the timed calls.
        q_peer = torch.cat([q, randn_offset((b, s_q, pad, d_qk), gen)], dim=2) if pad else q
        s_peer = torch.cat([s, sink(pad, gen)]) if pad and s is not None else s
        sets.append((q, s, q_peer, s_peer, main, extra))
        attended += main.attended + (extra.attended if extra else 0)
        distinct += main.distinct + (extra.distinct if extra else 0)
    flop = core.decode_flop(h_q, attended // n, d_qk)
    nbytes = core.decode_bytes(b, s_q, h_q, d_qk, distinct // n, core.FP8_BYTES_PER_TOKEN[d_qk])
    scale = d_qk**-0.5

    def call(module, meta, q, s, main, extra):
        return module.flash_mla_with_kvcache(
            q, main.cache, None, None, core.D_V, meta, None, softmax_scale=scale, causal=False, is_fp8_kvcache=True,
            indices=main.indices, attn_sink=s,
            extra_k_cache=extra.cache if extra else None,
            extra_indices_in_kvcache=extra.indices if extra else None,
            topk_length=main.topk_length,
            extra_topk_length=extra.topk_length if extra else None,
        )

    calls = {}
    compat = libs.fm_compat
    metas = [compat.get_mla_metadata()[0] for _ in range(n)]

    def ours(i):
        q, s, _qp, _sp, main, extra = sets[i]
        return call(compat, metas[i], q, s, main, extra)

    calls[OURS] = ours
    notes = ["FP8 caches written by flashmla.kv_quantize; the same bytes go to both implementations"]
    if libs.peer is not None:
        peer = libs.peer
        metas_peer = [peer.get_mla_metadata()[0] for _ in range(n)]

        def theirs(i, fresh=False):
            _q, _s, q, s, main, extra = sets[i]
            meta = peer.get_mla_metadata()[0] if fresh else metas_peer[i]
            out, lse = call(peer, meta, q, s, main, extra)
            return (out[:, :, :h_q], lse[:, :h_q]) if pad else (out, lse)

        calls[PEER] = theirs
        calls[PEER_META] = lambda i: theirs(i, fresh=True)
        if pad:
            notes.append(f"the peer runs {shape.peer_h_q} heads (q and sink padded before timing); FLOPs count {h_q}")
    return Case(n, calls, flop, nbytes, core.TOL["decode_out"], core.TOL["decode_lse"], notes)


def dense_prefill_case(shape: core.DensePrefillShape, libs: Libs, gen, l2: int, max_sets: int) -> Case:
    n = core.n_input_sets(shape.bytes_per_call(), l2, max_sets)
    total, h, d, b = sum(shape.lens), shape.h, shape.d, len(shape.lens)
    offsets = [0]
    for s in shape.lens:
        offsets.append(offsets[-1] + s)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    sets = [
        (randn_offset((total, h, d), gen), randn_offset((total, h, d), gen), randn_offset((total, h, core.DENSE_D_V), gen))
        for _ in range(n)
    ]
    calls = {}
    notes = []
    s0 = shape.lens[0]
    if libs.fm is not None:
        fm = libs.fm

        def ours(i):
            q, k, v = sets[i]
            with torch.no_grad():
                out, lse = fm.dense_prefill(q, k, v, cu, cu, None, shape.causal)
            # [b, s, h, d_v] for the comparison with the peer's layout (a view).
            return (out.view(b, s0, h, core.DENSE_D_V) if shape.uniform else out), None

        calls[OURS] = ours
    if shape.uniform:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        def theirs(i):
            q, k, v = (t.view(b, s0, h, t.shape[-1]).transpose(1, 2) for t in sets[i])
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
            return out.transpose(1, 2), None

        calls[PEER] = theirs
        notes.append("peer: torch scaled_dot_product_attention, cuDNN backend, [b, h, s, d] views of the packed tensors")
    else:
        notes.append("peer: not timed (torch scaled_dot_product_attention has no varlen path)")
    return Case(n, calls, shape.flop(), None, core.TOL["prefill_out"], core.TOL["prefill_lse"], notes)


def dense_prefill_bwd_case(shape: core.DensePrefillBwdShape, libs: Libs, gen, l2: int, max_sets: int) -> Case:
    n = core.n_input_sets(shape.bytes_per_call() * 2, l2, max_sets)
    total, h, d, b = sum(shape.lens), shape.h, shape.d, len(shape.lens)
    offsets = [0]
    for s in shape.lens:
        offsets.append(offsets[-1] + s)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    s0 = shape.lens[0]
    sets = []
    for _ in range(n):
        q, k, v = (randn_offset((total, h, w), gen) for w in (d, d, core.DENSE_D_V))
        d_out = randn_offset((total, h, core.DENSE_D_V), gen)
        item = dict(q=q, k=k, v=v, d_out=d_out)
        if libs.fm is not None:
            with torch.no_grad():
                item["out"], item["lse"] = libs.fm.dense_prefill(q, k, v, cu, cu, None, shape.causal)
        if shape.uniform:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            import torch.nn.functional as F

            # Leaves made outside inference mode (the harness runs in it), so autograd records the forward.
            with torch.inference_mode(False), torch.enable_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                views = [t.view(b, s0, h, t.shape[-1]).transpose(1, 2) for t in leaves]
                out = F.scaled_dot_product_attention(*views, is_causal=shape.causal)
                item["peer"] = (leaves, out, d_out.clone().view(b, s0, h, core.DENSE_D_V).transpose(1, 2))
        sets.append(item)
    calls = {}
    notes = []
    if libs.fm is not None:

        def ours(i):
            x = sets[i]
            d_q, d_k, d_v = torch.ops.flashmla.dense_prefill_bwd(
                x["q"], x["k"], x["v"], x["out"], x["d_out"], x["lse"], cu, cu, None, shape.causal
            )
            return d_q, None

        calls[OURS] = ours
    if shape.uniform:

        def theirs(i):
            leaves, out, d_out = sets[i]["peer"]
            with torch.inference_mode(False), torch.enable_grad():
                d_q, _d_k, _d_v = torch.autograd.grad(out, leaves, d_out, retain_graph=True)
            return d_q, None

        calls[PEER] = theirs
        notes.append("peer: torch scaled_dot_product_attention backward, cuDNN backend (torch.autograd.grad)")
    else:
        notes.append("peer: not timed (torch scaled_dot_product_attention has no varlen path)")
    tol_grad = (1e-3, 8.01 / 128, 7e-6)
    return Case(n, calls, shape.flop(), None, tol_grad, core.TOL["prefill_lse"], notes)


CASE_BUILDERS = {
    "sparse_fwd": sparse_fwd_case,
    "decode_dense": decode_dense_case,
    "decode_sparse_fp8": decode_sparse_case,
    "dense_prefill": dense_prefill_case,
    "dense_prefill_bwd": dense_prefill_bwd_case,
}


# ----------------------------------------------------------------------------------------------------------------
# Timing


class CudaRunner(core.Runner):
    """Times blocks of calls with CUDA events; every call takes the next input set."""

    def __init__(self, calls: Dict[str, Callable[[int], tuple]], sets: int, nvml: Nvml):
        self.calls, self.sets, self.nvml = calls, sets, nvml
        self.cursor = {name: 0 for name in calls}
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def block(self, name: str, calls: int) -> core.Block:
        fn, first = self.calls[name], self.cursor[name]
        t0 = time.perf_counter()
        self.start.record()
        for k in range(calls):
            fn((first + k) % self.sets)
        self.end.record()
        issue_ms = (time.perf_counter() - t0) * 1e3
        self.end.synchronize()
        self.cursor[name] = (first + calls) % self.sets
        return core.Block(self.start.elapsed_time(self.end), issue_ms, self.nvml.sm_clock_mhz())


def sync() -> None:
    """Waits for the device (a no-op where the inputs live on the CPU, as in the CPU test of the case builders)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def probe(case: Case) -> Dict[str, str]:
    """Runs each implementation once on set 0; drops (and returns the reasons for) those that fail."""
    failed = {}
    for name in list(case.calls):
        try:
            case.calls[name](0)
            sync()
        except Exception as e:  # NotImplementedError, the peer's asserts and TORCH_CHECKs, CUDA errors
            failed[name] = first_line(e)
            del case.calls[name]
    return failed


def compare(case: Case) -> Optional[dict]:
    """Both implementations' outputs on set 0, compared."""
    if OURS not in case.calls or PEER not in case.calls:
        return None
    out_a, lse_a = case.calls[OURS](0)
    out_b, lse_b = case.calls[PEER](0)
    sync()
    out = core.pair_check(out_a, out_b, case.tol_out)
    # An implementation that returns no lse (torch's attention) is compared on out alone.
    lse = core.pair_check(lse_a, lse_b, case.tol_lse) if lse_a is not None and lse_b is not None else None
    return dict(
        ok=bool(out["ok"] and (lse is None or lse["ok"])),
        out_max_abs_diff=out["max_abs_diff"], out_failed=out["failed"], out_cos_diff=out["cos_diff"],
        lse_max_abs_diff=lse and lse["max_abs_diff"], lse_failed=lse and lse["failed"],
        tolerance_factor=core.PAIR_TOL_FACTOR,
    )


def time_shape(shape, libs: Libs, args, env: dict, nvml: Nvml, gen, l2: int, runner_cls=None) -> List[dict]:
    """Builds the shape's inputs, checks the two outputs against each other, times every regime of ``args``
    (with ``runner_cls``, default :class:`CudaRunner`) and returns one record per regime."""
    try:
        case = CASE_BUILDERS[shape.op](shape, libs, gen, l2, args.max_sets)
    except Exception as e:
        print(f"[skip] {shape.op} {shape.name}: inputs: {first_line(e)}", flush=True)
        return []
    notes = list(case.notes)
    for name, reason in probe(case).items():
        print(f"[skip] {shape.op} {shape.name}: {name}: {reason}", flush=True)
        notes.append(f"{name} skipped: {reason}")
    if not case.calls:
        return []
    check = None if args.no_check else compare(case)
    if check is not None and not check["ok"]:
        print(f"[MISMATCH] {shape.op} {shape.name}: {check}", flush=True)
    for fn in case.calls.values():  # warm-up: every set once
        for i in range(case.sets):
            fn(i)
    sync()
    runner = (runner_cls or CudaRunner)(case.calls, case.sets, nvml)
    names = list(case.calls)
    calls = core.calibrate(runner, names, args.block_ms)
    records = []
    for regime in args.regimes:
        if regime == "short":
            blocks = core.run_short(runner, names, calls, args.rounds_short, args.idle_s)
            regime_fields = dict(cooldown_ms=round(args.idle_s * 1000), rounds=args.rounds_short)
        else:
            blocks = core.run_sustained(runner, names, calls, args.rounds_sustained, args.load_s)
            regime_fields = dict(load_ms=round(args.load_s * 1000), rounds=args.rounds_sustained)
        stats = {name: core.summarize(blocks[name], calls[name]) for name in names}
        rec = core.make_record(
            shape.op, shape.name, shape.fields(), regime, stats, case.flop, case.nbytes, env, check, notes, case.sets,
            regime_fields,
        )
        records.append(rec)
        print(
            f"{shape.op:18} {shape.name:48} {regime:9} ours {core.fmt(rec['time_us'])} us, "
            f"peer {core.fmt(rec['peer_time_us'])} us, vs peer {core.fmt(rec['vs_peer'], 3)}",
            flush=True,
        )
    del case, runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


# ----------------------------------------------------------------------------------------------------------------
# Host cost


def host_loop(fn: Callable[[], object], calls: int) -> core.HostCost:
    for _ in range(HOST_WARMUP_CALLS):
        fn()
    sync()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    scale = 1e6 / calls
    # The same calls in bursts short enough that the launch queue never fills, each started on an idle stream and
    # synchronised untimed: the host's own time per call, whatever the GPU time of a call.
    burst_s = 0.0
    for _ in range(max(1, calls // HOST_BURST_CALLS)):
        sync()
        t0 = time.perf_counter()
        for _ in range(HOST_BURST_CALLS):
            fn()
        burst_s += time.perf_counter() - t0
    sync()
    burst_us = burst_s * 1e6 / (max(1, calls // HOST_BURST_CALLS) * HOST_BURST_CALLS)
    return core.HostCost((cpu1 - cpu0) * scale, (wall1 - wall0) * scale, (issued - wall0) * scale, burst_us)


def median_cost(costs: Optional[List[core.HostCost]]) -> Optional[core.HostCost]:
    """The loop with the median CPU time (None without loops)."""
    if not costs:
        return None
    return sorted(costs, key=lambda c: c.cpu_us)[len(costs) // 2]


def host_apis(shape: core.HostCostShape, libs: Libs, gen) -> Dict[str, Callable[[], object]]:
    f = shape.fields()
    apis: Dict[str, Callable[[], object]] = {}
    fm, compat, peer = libs.fm, libs.fm_compat, libs.peer
    if shape.op == "sparse_fwd":
        q = randn_offset((f["s_q"], f["h_q"], f["d_qk"]), gen)
        kv = randn_offset((f["s_kv"], 1, f["d_qk"]), gen)
        idx = core.distinct_rows(f["s_q"], 0, f["s_kv"], f["topk"], gen).view(f["s_q"], 1, f["topk"])
        scale = f["d_qk"] ** -0.5
        if fm is not None:
            apis["flashmla.sparse_fwd"] = lambda: fm.sparse_fwd(q, kv, idx, scale)
            apis["flashmla.sparse_mla"] = lambda: fm.sparse_mla(q, kv, idx, scale, return_lse=True)
            apis["flashmla.compat.flash_mla_sparse_fwd"] = lambda: compat.flash_mla_sparse_fwd(q, kv, idx, scale)
        if peer is not None:
            apis[PEER] = lambda: peer.flash_mla_sparse_fwd(q, kv, idx, scale, core.D_V)
    elif shape.op == "decode_sparse":
        d_qk = f["d_qk"]
        kv = randn_offset((f["blocks"], f["page_size"], 1, d_qk), gen)
        cache = fm.kv_quantize(kv) if fm is not None else None
        q = randn_offset((f["b"], f["s_q"], f["h_q"], d_qk), gen)
        idx = core.distinct_rows(f["b"] * f["s_q"], 0, f["blocks"] * f["page_size"], f["topk"], gen)
        idx = idx.view(f["b"], f["s_q"], f["topk"])
        scale = d_qk**-0.5

        def sparse_call(module, meta):
            return module.flash_mla_with_kvcache(
                q, cache, None, None, core.D_V, meta, None, softmax_scale=scale, is_fp8_kvcache=True, indices=idx
            )

        if fm is not None:
            meta = compat.get_mla_metadata()[0]
            apis["flashmla.compat.flash_mla_with_kvcache"] = lambda: sparse_call(compat, meta)
            apis["flashmla.decode_sparse"] = lambda: fm.decode_sparse(q, cache, idx, softmax_scale=scale)
        if peer is not None and cache is not None:
            peer_meta = peer.get_mla_metadata()[0]
            apis[PEER] = lambda: sparse_call(peer, peer_meta)
    else:
        lengths = [f["s_k"]] * f["b"]
        q = randn_offset((f["b"], f["s_q"], f["h_q"], f["d_qk"]), gen)
        table, pages = core.paged_layout(lengths, f["page_size"], gen)
        cache = randn_offset((pages, f["page_size"], 1, f["d_qk"]), gen)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=gen.device)
        scale = f["d_qk"] ** -0.5
        if fm is not None:
            meta = compat.get_mla_metadata()[0]
            apis["flashmla.compat.flash_mla_with_kvcache"] = lambda: compat.flash_mla_with_kvcache(
                q, cache, table, seqlens, core.D_V, meta, None, softmax_scale=scale
            )
            apis["flashmla.decode_dense"] = lambda: fm.decode_dense(q, cache, table, seqlens, scale, False)
        if peer is not None:
            peer_meta = peer.get_mla_metadata()[0]
            apis[PEER] = lambda: peer.flash_mla_with_kvcache(
                q, cache, table, seqlens, core.D_V, peer_meta, None, softmax_scale=scale
            )
    return apis


def pin_host_cpu(cpu: int) -> Optional[int]:
    """Pins this process to one CPU (``-1``: the lowest it may run on; ``None`` where the OS has no affinity call), so
    that both libraries' loops run on the same core without migrations; returns the CPU."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    target = allowed[0] if cpu < 0 else cpu
    os.sched_setaffinity(0, {target})
    return target


def paired_ratios(ours: Sequence[core.HostCost], peer: Sequence[core.HostCost]) -> List[float]:
    """Per round, the peer's CPU time over ours: the two loops of a round ran back to back, so a host's drift
    between rounds cancels in each ratio."""
    return [round(p.cpu_us / o.cpu_us, 4) for o, p in zip(ours, peer) if o.cpu_us > 0]


def host_cost(libs: Libs, args, env: dict, gen) -> List[dict]:
    records = []
    pinned = pin_host_cpu(args.host_cpu) if args.host_cpu is not None else None
    for shape in core.HOST_COST_SHAPES:
        apis = host_apis(shape, libs, gen)
        for name in list(apis):
            try:
                apis[name]()
                sync()
            except Exception as e:
                print(f"[skip] host cost {shape.op} {name}: {first_line(e)}", flush=True)
                del apis[name]
        samples: Dict[str, List[core.HostCost]] = {name: [] for name in apis}
        for order in core.round_orders(list(apis), args.host_rounds):
            for name in order:
                samples[name].append(host_loop(apis[name], args.host_calls))
        peer = median_cost(samples.get(PEER))
        ours_apis = [name for name in apis if name != PEER] or ["flashmla (missing)"]
        for api in ours_apis:
            rec = core.make_host_record(
                shape, api, median_cost(samples.get(api)), peer, args.host_calls, env,
                [
                    f"median of {args.host_rounds} loops of {args.host_calls} calls; CPU time includes the final sync "
                    "(a loop is GPU-bound when a call's GPU time exceeds its host time)",
                    f"burst_issue_us: wall time of issuing the same calls in bursts of {HOST_BURST_CALLS} on an idle "
                    "stream, synchronised untimed (the host's own time per call)",
                    "vs_peer_rounds: the peer's CPU time over ours in each round (the two loops back to back); "
                    + (f"process pinned to CPU {pinned}" if pinned is not None else "process not pinned"),
                ],
            )
            if PEER in samples and api in samples:
                ratios = paired_ratios(samples[api], samples[PEER])
                rec["vs_peer_rounds"] = ratios
                rec["vs_peer_rounds_median"] = sorted(ratios)[len(ratios) // 2] if ratios else None
            records.append(rec)
            print(
                f"host cost {shape.op:13} {api:40} ours {core.fmt(rec['time_us'])} us CPU/call "
                f"({core.fmt(rec.get('burst_issue_us'))} issued in bursts), peer {core.fmt(rec['peer_time_us'])} us "
                f"({core.fmt(rec.get('peer_burst_issue_us'))})",
                flush=True,
            )
    return records


# ----------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", help="folder holding the built FlashMLA checkout (its flash_mla package)")
    p.add_argument("--ops", default=",".join(core.OPS), help="comma-separated subset of: " + ", ".join(core.OPS))
    p.add_argument(
        "--shapes", action="append", default=[],
        help="keep shapes matching all of these terms (comma/space separated; key=value compares a record field, "
        "anything else is a substring of the shape name); repeat the flag for alternatives",
    )
    p.add_argument("--regime", choices=("short", "sustained", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="a few shapes per op and fewer rounds")
    p.add_argument("--list", action="store_true", help="print the selected shapes and an estimated duration, then exit")
    p.add_argument("--json", help="write the records here (rewritten after every record)")
    p.add_argument("--commit", help="flashmla commit recorded in every record (default: --commit-file, then git)")
    p.add_argument("--commit-file", help="a file holding the commit")
    p.add_argument("--peer-commit", help="the peer's commit, recorded as given")
    p.add_argument("--rounds-short", type=int, help="rounds in the short regime (default 5; 3 with --quick)")
    p.add_argument("--rounds-sustained", type=int, help="rounds in the sustained regime (default 8; 4 with --quick)")
    p.add_argument("--idle-s", type=float, default=1.0, help="idle seconds before each short block")
    p.add_argument("--load-s", type=float, default=1.5, help="seconds of load before the sustained rounds")
    p.add_argument("--block-ms", type=float, default=25.0, help="GPU time of one timed block")
    p.add_argument("--max-sets", type=int, default=64, help="most input sets rotated for small shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the comparison of the two outputs")
    p.add_argument("--host-cost", action="store_true", help="measure host time per tiny call instead")
    p.add_argument("--host-calls", type=int, default=2000)
    p.add_argument("--host-rounds", type=int, default=7)
    p.add_argument(
        "--host-cpu", type=int, default=None,
        help="pin the process to this CPU for --host-cost (-1: the lowest allowed one; default: not pinned)",
    )
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    args.regimes = ["short", "sustained"] if args.regime == "both" else [args.regime]
    if args.rounds_short is None:
        args.rounds_short = 3 if args.quick else 5
    if args.rounds_sustained is None:
        args.rounds_sustained = 4 if args.quick else 8
    return args


def write_json(path: Optional[str], records: List[dict]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shapes = core.select_shapes(args.ops, args.shapes, args.quick)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for shape in shapes:
            print(f"{shape.op:18} {shape.name}")
        seconds = core.estimate_seconds(
            [core.impl_count(shape.op) for shape in shapes], args.regimes, args.rounds_short, args.rounds_sustained,
            args.idle_s, args.load_s, args.block_ms,
        )
        print(f"{len(shapes)} shapes, about {seconds / 60:.1f} min")
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    libs = import_libs(args.peer)
    if libs.fm is None and libs.peer is None:
        print("error: neither flashmla nor the peer could be imported", file=sys.stderr)
        return 2
    nvml = Nvml(args.device)
    env = environment(args, nvml, libs)
    print(
        f"{env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['torch_cuda']}), flashmla "
        f"{env['flashmla_version']} at {env['commit']}, SM max {env['sm_clock_mhz']} MHz, "
        f"power limit {env['power_limit_w']} W",
        flush=True,
    )
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    l2 = getattr(torch.cuda.get_device_properties(args.device), "L2_cache_size", 50 << 20)
    records: List[dict] = []
    with torch.inference_mode():
        if args.host_cost:
            records = host_cost(libs, args, env, gen)
            write_json(args.json, records)
        else:
            for shape in shapes:
                try:
                    records += time_shape(shape, libs, args, env, nvml, gen, l2)
                except torch.cuda.OutOfMemoryError as e:
                    print(f"[skip] {shape.op} {shape.name}: {first_line(e)}", flush=True)
                    torch.cuda.empty_cache()
                except Exception:
                    traceback.print_exc()
                    print(f"[stop] {shape.op} {shape.name} failed; the records so far are written", flush=True)
                    write_json(args.json, records)
                    break
                write_json(args.json, records)
    print()
    print(core.format_table(records))
    mismatches = [r for r in records if r.get("check") and not r["check"]["ok"]]
    if mismatches:
        print(f"{len(mismatches)} records whose outputs differ beyond tolerance (check = MISMATCH)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
