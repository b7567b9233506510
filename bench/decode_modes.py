"""What the dense decode's options and the shapes only flashmla serves cost, measured in one process on one card.

Each case times two variants of one decode step on the same inputs, alternating inside every round (short regime:
``--idle-s`` of idle, then a block of ~``--block-ms`` of back-to-back calls per variant, CUDA events around the
block); the record holds the median over rounds and ``ratio`` = reference time / variant time (below 1: the variant
is slower).

* ``batch_invariant``: ``flashmla.decode_dense(..., batch_invariant=True)`` against the default schedule, on uniform,
  skewed and single-request batches (docs/decode.md, "Batch-invariant mode").
* ``page``: page sizes the peer does not take (16, 1) against page 64, same keys and lengths.
* ``s_q``: 16 query tokens per request (speculative decoding; the peer stops below) against 2 tokens of the same
  batch, per query token (the reference time is scaled by 16 / 2 before the ratio).
* ``dtype``: fp16 queries and cache (every head ratio runs the same kernels with f16 MMAs) against bf16, same
  shape and values.
* ``graph_replay``: one decode step captured in a CUDA graph, replayed after ``cache_seqlens`` changed in place
  (two tiny device-side updates before each step, in both variants), against the same step called eagerly.

Usage (on the GPU machine, flashmla on PYTHONPATH)::

    python3 bench/decode_modes.py --json out.json [--cases batch_invariant,page,s_q,dtype,graph_replay]

Records (benchmark records of op ``decode_dense``, docs/benchmarking.md section 7, regime ``short``, for the
variant's shape): ``case``, ``name``, ``variant``, ``reference``, ``time_us``, ``ref_time_us``, ``ratio``,
``tflops`` (attended keys), ``reps`` (calls per block), ``run_sm_clock_mhz`` (NVML, after each block),
``samples_us``, ``ref_samples_us``, ``gpu``, ``commit``, ``date``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

import flashmla
from gemm_ceiling import Nvml

D_QK = 576
D_V = 512


def make_inputs(b, s_q, h_q, seqlens, page, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [(n + page - 1) // page for n in seqlens]
    max_blocks = max(blocks)
    total = sum(blocks)
    k = (torch.randn(total, page, 1, D_QK, device="cuda", generator=g) / 10).to(dtype)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros(b, max_blocks, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at : at + n]
        at += n
    q = (torch.randn(b, s_q, h_q, D_QK, device="cuda", generator=g) / 10).to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    return q, k, table, lens


def time_block(fn, block_ms, nvml):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    calls = max(3, min(2000, int(block_ms / 1e3 / one)))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / calls, calls, nvml.sm_clock_mhz()


def compare(ref, var, rounds, idle_s, block_ms, nvml):
    a, b, calls, clocks = [], [], [], []
    for r in range(rounds):
        order = [(ref, a), (var, b)] if r % 2 == 0 else [(var, b), (ref, a)]
        for fn, out in order:
            time.sleep(idle_s)
            us, n, mhz = time_block(fn, block_ms, nvml)
            out.append(us)
            if out is b:
                calls.append(n)
                clocks.append(mhz)
    return statistics.median(a), statistics.median(b), a, b, min(calls), clocks


def cases(selected):
    skew = [1024] * 128
    skew[0] = 131072
    if "batch_invariant" in selected:
        for name, b, s_q, h_q, lens in [
            ("b128 s_q 1 h128 4K", 128, 1, 128, [4096] * 128),
            ("b128 s_q 1 h128 16K", 128, 1, 128, [16384] * 128),
            ("b128 s_q 2 h64 16K", 128, 2, 64, [16384] * 128),
            ("skewed b128 s_q 1 h128 1x128K+127x1K", 128, 1, 128, skew),
            ("b1 s_q 1 h128 4K", 1, 1, 128, [4096]),
        ]:
            q, k, t, n = make_inputs(b, s_q, h_q, lens, 64)
            yield ("batch_invariant", name, "batch_invariant=True", "default",
                   lambda q=q, k=k, t=t, n=n: flashmla.decode_dense(q, k, t, n),
                   lambda q=q, k=k, t=t, n=n: flashmla.decode_dense(q, k, t, n, batch_invariant=True), 1.0,
                   (b, s_q, h_q, 64, s_q * sum(lens)))
    if "page" in selected:
        for page in (16, 1):
            lens = [4096] * 128
            ref = make_inputs(128, 1, 128, lens, 64)
            var = make_inputs(128, 1, 128, lens, page)
            yield ("page", f"b128 s_q 1 h128 4K page {page}", f"page {page}", "page 64",
                   lambda x=ref: flashmla.decode_dense(*x), lambda x=var: flashmla.decode_dense(*x), 1.0,
                   (128, 1, 128, page, sum(lens)))
    if "s_q" in selected:
        lens = [4096] * 32
        ref = make_inputs(32, 2, 128, lens, 64)
        var = make_inputs(32, 16, 128, lens, 64)
        yield ("s_q", "b32 h128 4K causal, per query token", "s_q 16", "s_q 2",
               lambda x=ref: flashmla.decode_dense(*x, causal=True),
               lambda x=var: flashmla.decode_dense(*x, causal=True), 16 / 2,
               (32, 16, 128, 64, 32 * sum(4096 - 15 + i for i in range(16))))
    if "dtype" in selected:
        for name, h_q, s_k in [("b128 s_q 1 h128 4K", 128, 4096), ("b128 s_q 1 h16 16K", 16, 16384)]:
            lens = [s_k] * 128
            ref = make_inputs(128, 1, h_q, lens, 64)
            var = make_inputs(128, 1, h_q, lens, 64, dtype=torch.float16)
            yield ("dtype", name, "fp16", "bf16",
                   lambda x=ref: flashmla.decode_dense(*x), lambda x=var: flashmla.decode_dense(*x), 1.0,
                   (128, 1, h_q, 64, sum(lens)))
    if "graph_replay" in selected:
        for name, b, h_q, s_k in [("b128 s_q 1 h128 4K", 128, 128, 4096), ("b1 s_q 1 h128 4K", 1, 128, 4096)]:
            q, k, t, n = make_inputs(b, 1, h_q, [s_k - 1] * b, 64)
            delta = torch.ones((), dtype=torch.int32, device="cuda")
            flashmla.decode_dense(q, k, t, n)  # kept workspace, warm caches
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flashmla.decode_dense(q, k, t, n)

            # Both variants change the lengths in place before each step (s_k - 1 and s_k in turn: two tiny kernels).
            def replay(n=n, graph=graph, delta=delta):
                n.add_(delta)
                delta.neg_()
                graph.replay()

            def eager(q=q, k=k, t=t, n=n, delta=delta):
                n.add_(delta)
                delta.neg_()
                flashmla.decode_dense(q, k, t, n)

            yield ("graph_replay", name, "graph replay, lengths changed in place", "eager", eager, replay, 1.0,
                   (b, 1, h_q, 64, b * s_k))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="batch_invariant,page,s_q,dtype,graph_replay")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=0.5)
    p.add_argument("--block-ms", type=float, default=25.0)
    p.add_argument("--commit", default=None)
    p.add_argument("--json")
    a = p.parse_args()
    selected = set(a.cases.split(","))
    records = []
    gpu = torch.cuda.get_device_name()
    nvml = Nvml(torch.cuda.current_device())
    with torch.inference_mode():
        for case, name, variant, reference, ref_fn, var_fn, scale, shape in cases(selected):
            ref_us, var_us, ra, rb, calls, clocks = compare(ref_fn, var_fn, a.rounds, a.idle_s, a.block_ms, nvml)
            ratio = ref_us * scale / var_us
            b, s_q, h_q, page, keys = shape
            tflops = 2.0 * h_q * keys * (D_QK + D_V) / (var_us * 1e-6) / 1e12
            print(f"{case:16s} {name:42s} {variant:40s} {var_us:9.1f} us  {reference:8s} {ref_us:9.1f} us  ratio {ratio:.3f}",
                  flush=True)
            known = [c for c in clocks if c]
            records.append(dict(op="decode_dense", case=case, name=name, variant=variant, reference=reference,
                                b=b, s_q=s_q, h_q=h_q, d_qk=D_QK, d_v=D_V, page_size=page, regime="short",
                                time_us=var_us, ref_time_us=ref_us, ratio=ratio, tflops=tflops, reps=calls,
                                samples_us=rb, ref_samples_us=ra,
                                run_sm_clock_mhz=statistics.median(known) if known else None,
                                gpu=gpu, commit=a.commit, date=datetime.date.today().isoformat()))
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
