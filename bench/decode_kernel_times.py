"""Where a dense decode step's GPU time goes, kernel by kernel, for flashmla and (optionally) the peer.

For each shape it runs a few untimed calls, then ``--calls`` back-to-back calls under ``torch.profiler`` (CUDA
activity only) and prints, per implementation, the mean duration of every kernel the call launched and the mean span
per call (first kernel start to last kernel end over the run, divided by the calls: it includes the gaps between
kernels, and host time where the call is host-bound), then where each kernel starts and ends within its call
(means). It is a diagnostic, not a benchmark: no clock control and no alternation; the side-by-side benchmark
(``side_by_side.py``) makes the claims. docs/decode.md cites its output for the split/combine breakdown. flashmla's
split and combine kernels are programmatic launches: each starts while the kernel before it still runs and waits for
it inside, so its duration includes that wait (the combine's nearly the whole split kernel's); compare spans, or the
peer's kernels with ours where they do not overlap.

Usage (on the GPU machine, flashmla on PYTHONPATH; the peer built with scripts/build-peer.sh)::

    python3 bench/decode_kernel_times.py [--peer .peer] [--calls 20] [SHAPE ...]

Shapes (all page 64, bf16, d_qk 576): see ``SHAPES`` (default: all). ``--sparse PREFIX`` profiles instead the sparse
FP8 decode shapes of ``side_by_side.py`` whose names start with PREFIX (e.g. ``"MODEL1 c4 b128"``), on its inputs.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import flashmla.compat as compat
import side_by_side_core as core

PAGE = 64
D_V = 512
#: name -> (batch, s_q, h_q, per-request cache lengths)
SHAPES = {
    "b128 h16 4K": (128, 1, 16, [4096] * 128),
    "b128 h16 16K": (128, 1, 16, [16384] * 128),
    "b128 h64 16K": (128, 1, 64, [16384] * 128),
    "b128 h128 4K": (128, 1, 128, [4096] * 128),
    "b128 s_q2 h128 4K": (128, 2, 128, [4096] * 128),
    "b128 s_q2 h128 16K": (128, 2, 128, [16384] * 128),
    "skewed h16": (128, 1, 16, [131072] + [1024] * 127),
    "skewed h128": (128, 1, 128, [131072] + [1024] * 127),
    "b1 h128 4K": (1, 1, 128, [4096]),
    "b1 h128 16K": (1, 1, 128, [16384]),
    "b4 h128 4K": (4, 1, 128, [4096] * 4),
}


def inputs(b: int, s_q: int, h_q: int, lengths: list, gen: torch.Generator):
    """q, a paged cache with every request's pages at random places (side_by_side_core.paged_layout), the block
    table and the lengths."""
    table, pages = core.paged_layout(lengths, PAGE, gen)
    cache = core.randn_offset((pages, PAGE, 1, 576), gen)
    q = core.randn_offset((b, s_q, h_q, 576), gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=gen.device)
    return q, cache, table, seqlens


def profile_calls(fn, calls: int):
    """Mean duration per kernel name (with launches per call) and the mean span per call, in us."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not events:
        # CUPTI serves one subscriber: under Nsight Compute (or another profiler) torch's profiler records nothing.
        raise SystemExit("decode_kernel_times: the profiler recorded no CUDA kernels (is another profiler, e.g. ncu, "
                         "attached? it takes CUPTI's only subscription)")
    events.sort(key=lambda e: e.time_range.start)
    per = collections.defaultdict(list)
    for e in events:
        per[e.name].append(e.time_range.end - e.time_range.start)
    span = (events[-1].time_range.end - events[0].time_range.start) / calls
    # Where each kernel sits in its call (mean start and end after the call's first kernel started), where every call
    # launched the same number of kernels: the overlap of programmatic launches and the gaps between kernels.
    offsets = collections.defaultdict(list)
    if len(events) % calls == 0:
        per_call = len(events) // calls
        for i in range(calls):
            call = events[i * per_call:(i + 1) * per_call]
            t0 = call[0].time_range.start
            for e in call:
                offsets[e.name].append((e.time_range.start - t0, e.time_range.end - t0))
    timeline = {name: (sum(a for a, _ in v) / len(v), sum(b for _, b in v) / len(v)) for name, v in offsets.items()}
    return {name: (sum(v) / len(v), len(v) // calls) for name, v in per.items()}, span, timeline


def report(name: str, impl: str, fn, calls: int) -> None:
    kernels, span, timeline = profile_calls(fn, calls)
    parts = "  ".join(f"{k[:32]}={t:.1f}" + (f"x{n}" if n != 1 else "") for k, (t, n) in kernels.items())
    print(f"{name:18s} {impl:8s} span/call {span:8.1f} us  {parts}", flush=True)
    if timeline:
        when = "  ".join(f"{k[:32]} {a:.1f}..{b:.1f}" for k, (a, b) in sorted(timeline.items(), key=lambda x: x[1]))
        print(f"{'':18s} {'':8s} timeline (us after the call's first kernel started): {when}", flush=True)


def profile_sparse(prefixes: list, peer_path, calls: int) -> int:
    """The sparse FP8 decode shapes of side_by_side.py named by ``prefixes``, on its first input set."""
    import side_by_side as sbs

    if not torch.cuda.is_available():
        print("decode_kernel_times: needs a CUDA GPU (it profiles the GPU kernels)", file=sys.stderr)
        return 2
    libs = sbs.import_libs(peer_path)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [s for s in core.decode_sparse_shapes() if any(s.name.startswith(p) for p in prefixes)]
    if not shapes:
        print(f"no sparse decode shape starts with {prefixes}", file=sys.stderr)
        return 2
    for shape in shapes:
        case = sbs.decode_sparse_case(shape, libs, gen, 0, 1)
        for impl in (core.OURS, core.PEER):
            if impl in case.calls:
                report(shape.name, impl, lambda: case.calls[impl](0), calls)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", help=f"shape names (default all): {', '.join(SHAPES)}")
    ap.add_argument("--peer", help="folder of a built FlashMLA checkout (its kernels are profiled too)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--sparse", action="append", default=[], metavar="PREFIX",
                    help="profile the side-by-side sparse FP8 decode shapes whose names start with PREFIX")
    args = ap.parse_args()
    if args.sparse:
        return profile_sparse(args.sparse, args.peer, args.calls)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; known: {list(SHAPES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("decode_kernel_times: needs a CUDA GPU (it profiles the GPU kernels)", file=sys.stderr)
        return 2
    peer = None
    if args.peer:
        sys.path.insert(0, str(Path(args.peer).resolve()))
        import flash_mla as peer  # noqa: E402 (the peer's module lives in its checkout)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes or list(SHAPES):
        b, s_q, h_q, lengths = SHAPES[name]
        q, cache, table, seqlens = inputs(b, s_q, h_q, lengths, gen)
        meta = compat.get_mla_metadata()[0]
        impls = {"flashmla": lambda: compat.flash_mla_with_kvcache(q, cache, table, seqlens, D_V, meta, None)}
        if peer is not None:
            peer_meta = peer.get_mla_metadata()[0]
            impls["peer"] = lambda: peer.flash_mla_with_kvcache(q, cache, table, seqlens, D_V, peer_meta, None)
        for impl, fn in impls.items():
            report(name, impl, fn, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
