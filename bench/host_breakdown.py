"""Where a small call's host time goes: the public call, the native call and their parts, each timed alone.

``side_by_side.py --host-cost`` says how long a tiny call takes on the host against the peer; this script splits
that time into its steps, so that a change to the call path can be aimed at the step that costs. Every row is the
median over ``--rounds`` loops of ``--calls`` back-to-back calls of one step (CPU time per call, the stream
synchronised once after each loop; a loop of a step that launches is host-bound at these shapes):

* the public function and the native call it makes (``flashmla._native``), and the native metadata check
  (``*_check``: the tensors read without their addresses, and validation);
* the pieces the native call is made of as far as Python can reach them: one output allocation
  (``new_empty``), torch's current stream, the attribute reads that describe one tensor, the dispatch test;
* torch's own cost for one small kernel (``add_``), and the peer's public call and its extension call, when
  ``--peer`` names a FlashMLA checkout built by scripts/build-peer.sh.

The rest of a native call (its launches, lowering and context handling) is the native time less its check and
allocations; ``crates/flashmla/examples/launch_cost.rs`` times that part without Python.

Usage (on the GPU machine)::

    python3 bench/host_breakdown.py [--peer .peer] [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.process_time() - t0) * 1e6 / calls)
    return statistics.median(times)


def describe(t: torch.Tensor) -> tuple:
    """What the native call reads of one tensor, read from Python."""
    return (t.is_cuda, t.get_device(), t.shape, t.stride(), t.dtype, t.data_ptr())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", help="a FlashMLA checkout built in place")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import flashmla
    from flashmla import _native, compat

    peer = peer_ext = None
    if args.peer:
        sys.path.insert(0, str(Path(args.peer).resolve()))
        import flash_mla as peer
        import flash_mla.cuda as peer_ext

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, device=dev) / 10).to(bf16)

    rows: List[Tuple[str, str, Callable[[], object]]] = []

    # Sparse prefill forward: s_q 1, h_q 64, topk 128 over 1024 rows.
    q = randn(1, 64, 576)
    kv = randn(1024, 1, 576)
    idx = torch.randperm(1024, device=dev, generator=gen)[:128].to(torch.int32).view(1, 1, 128)
    scale = 576**-0.5
    rows += [
        ("sparse_fwd", "flashmla.sparse_fwd", lambda: flashmla.sparse_fwd(q, kv, idx, scale)),
        ("sparse_fwd", "compat.flash_mla_sparse_fwd", lambda: compat.flash_mla_sparse_fwd(q, kv, idx, scale)),
        ("sparse_fwd", "_native.sparse_fwd", lambda: _native.sparse_fwd(q, kv, idx, scale)),
        ("sparse_fwd", "_native.sparse_fwd_check", lambda: _native.sparse_fwd_check(q, kv, idx, scale)),
    ]
    if peer is not None:
        rows += [
            ("sparse_fwd", "peer flash_mla_sparse_fwd", lambda: peer.flash_mla_sparse_fwd(q, kv, idx, scale, 512)),
            (
                "sparse_fwd",
                "peer extension sparse_prefill_fwd",
                lambda: peer_ext.sparse_prefill_fwd(q, kv, idx, scale, 512, None, None),
            ),
        ]

    # Dense decode: b 1, s_q 1, h_q 128, 4096 tokens in pages of 64.
    b, h_q, s_k, page = 1, 128, 4096, 64
    qd = randn(b, 1, h_q, 576)
    cache = randn(s_k // page, page, 1, 576)
    table = torch.arange(s_k // page, dtype=torch.int32, device=dev).view(1, -1)
    seqlens = torch.full((b,), s_k, dtype=torch.int32, device=dev)
    meta = compat.get_mla_metadata()[0]
    rows += [
        ("decode_dense", "flashmla.decode_dense", lambda: flashmla.decode_dense(qd, cache, table, seqlens, scale)),
        (
            "decode_dense",
            "compat.flash_mla_with_kvcache",
            lambda: compat.flash_mla_with_kvcache(qd, cache, table, seqlens, 512, meta, None, softmax_scale=scale),
        ),
        ("decode_dense", "_native.decode_dense", lambda: _native.decode_dense(qd, cache, table, seqlens, scale)),
        (
            "decode_dense",
            "_native.decode_dense_check",
            lambda: _native.decode_dense_check(qd, cache, table, seqlens, scale),
        ),
    ]
    if peer is not None:
        peer_meta = peer.get_mla_metadata()[0]
        rows.append(
            (
                "decode_dense",
                "peer flash_mla_with_kvcache",
                lambda: peer.flash_mla_with_kvcache(qd, cache, table, seqlens, 512, peer_meta, None, softmax_scale=scale),
            )
        )

    # The pieces, as far as Python reaches them.
    small = torch.zeros(64, device=dev)
    rows += [
        ("pieces", "q.new_empty (one output)", lambda: q.new_empty((1, 64, 512), dtype=bf16)),
        ("pieces", "torch.empty (one output)", lambda: torch.empty((1, 64, 512), dtype=bf16, device=dev)),
        ("pieces", "current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("pieces", "describe one tensor (6 reads)", lambda: describe(q)),
        ("pieces", "q.data_ptr()", lambda: q.data_ptr()),
        ("pieces", "q.stride()", lambda: q.stride()),
        ("pieces", "torch.compiler.is_compiling()", lambda: torch.compiler.is_compiling()),
        ("pieces", "torch.is_grad_enabled()", lambda: torch.is_grad_enabled()),
        ("pieces", "torch add_ on 64 floats (one launch)", lambda: small.add_(1.0)),
    ]

    shim = "on" if _native.torch_shim() else "off (FLASHMLA_TORCH_SHIM=0 or not in this torch)"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashmla {flashmla.__version__}, C shim {shim}")
    print(f"median of {args.rounds} loops of {args.calls} calls, CPU us per call")
    with torch.inference_mode():
        for group, name, fn in rows:
            us = per_call_us(fn, args.calls, args.rounds)
            print(f"{group:13s} {name:40s} {us:8.2f}", flush=True)


if __name__ == "__main__":
    main()
