"""The side-by-side benchmark without a GPU: the pure parts (bench/side_by_side_core.py: shape grids, counting,
input generators, the pair check, the regime scheduler on a fake clock, records), the command line, and the whole
per-shape flow on CPU tensors with flashmla's CPU reference standing in for both implementations."""

import math
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import side_by_side  # noqa: E402
import side_by_side_core as core  # noqa: E402
from side_by_side_core import OURS, PEER, PEER_META  # noqa: E402


def cpu_gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------
# Grids


def test_sparse_fwd_grid_is_the_standard_shapes_in_four_variants():
    shapes = core.sparse_fwd_shapes()
    base = {(s.model, s.s_q, s.s_kv, s.topk, s.h_q, s.d_qk) for s in shapes}
    expected = {("V3.2", 4096, s_kv, 2048, 128, 576) for s_kv in (8192, 32768, 65536, 131072)}
    expected.add(("V3.2", 4096, 32768, 2048, 64, 576))
    expected |= {("MODEL1", 4096, s_kv, 512, 64, 512) for s_kv in (8192, 32768, 65536)}
    expected |= {("MODEL1", 4096, s_kv, 1024, 128, 512) for s_kv in (8192, 32768, 65536)}
    expected.add(("V3.2", 1024, 2048, 512, 128, 576))
    assert base == expected
    assert len(shapes) == 4 * len(expected)
    variants = {(s.indices, s.attn_sink) for s in shapes}
    assert variants == {("random", False), ("random", True), ("local", False), ("local", True)}
    assert len({s.name for s in shapes}) == len(shapes)


def test_decode_dense_grid():
    shapes = core.decode_dense_shapes()
    batch = [s for s in shapes if s.label == "batch"]
    assert {(s.b, s.s_q, s.h_q, s.s_k, s.causal, s.page_size) for s in batch} == {
        (128, s_q, h_q, s_k, causal, 64)
        for s_q in (1, 2) for h_q in (16, 64, 128) for s_k in (4096, 16384, 32768) for causal in (False, True)
    }
    skewed = [s for s in shapes if s.seqlens == "skewed"]
    assert skewed and all(s.lengths() == [131072] + [1024] * 127 for s in skewed)
    latency = [s for s in shapes if s.label == "latency"]
    assert [(s.b, s.s_q, s.h_q, s.s_k) for s in latency] == [(1, 1, 128, 4096)]
    assert len({s.name for s in shapes}) == len(shapes)


def test_decode_sparse_grid_has_the_peer_cases_and_tp16():
    shapes = core.decode_sparse_shapes()
    v32 = [s for s in shapes if s.label == "V3.2"]
    assert sorted(s.b for s in v32) == [2, 64, 74, 128]
    assert all((s.s_q, s.h_q, s.topk, s.s_k, s.page_size, s.d_qk) == (2, 128, 2048, 32768, 64, 576) for s in v32)
    for c, (h_q, extra_topk, extra_page, extra_len) in {
        "MODEL1 c1": (64, 512, 64, False),
        "MODEL1 c2": (128, 1024, 64, False),
        "MODEL1 c3": (64, 1024, 2, True),
        "MODEL1 c4": (128, 1024, 2, True),
    }.items():
        group = [s for s in shapes if s.label == c]
        assert sorted(s.b for s in group) == [2, 64, 74, 128, 148, 256]
        for s in group:
            assert (s.h_q, s.topk, s.page_size, s.s_k, s.d_qk) == (h_q, 128, 256, 16384, 512)
            assert (s.extra_topk, s.extra_page_size, s.extra_topk_length, s.extra_s_k) == (
                extra_topk, extra_page, extra_len, 16384)
    peak = [s for s in shapes if s.label.startswith("peak")]
    assert {(s.b, s.h_q, s.d_qk, s.topk) for s in peak} == {
        (148, h, d, 16384) for h in (64, 128) for d in (512, 576)
    }
    tp16 = [s for s in shapes if s.h_q == 16]
    assert tp16 and all(s.peer_h_q == 64 and s.fields()["peer_h_q"] == 64 for s in tp16)
    assert all("peer_h_q" not in s.fields() for s in shapes if s.h_q in (64, 128))
    assert all(s.attn_sink for s in shapes)


def test_select_shapes_filters_and_quick():
    everything = core.select_shapes(core.OPS, [], False)
    assert len(everything) == sum(len(grid()) for grid in core.GRIDS.values())
    quick = core.select_shapes(core.OPS, [], True)
    assert 0 < len(quick) < 15 and {s.op for s in quick} == set(core.OPS)

    picked = core.select_shapes(["sparse_fwd"], ["s_kv=32768 h_q=128 indices=random attn_sink=false"], False)
    assert [(s.model, s.topk, s.s_kv, s.h_q, s.indices, s.attn_sink) for s in picked] == [
        ("V3.2", 2048, 32768, 128, "random", False), ("MODEL1", 1024, 32768, 128, "random", False)
    ]

    # Name substrings, comma-separated terms (all must match), repeated flags (any may match).
    skewed = core.select_shapes(["decode_dense"], ["skewed,h128"], False)
    assert [s.s_q for s in skewed] == [1, 2]
    either = core.select_shapes(["decode_dense"], ["latency", "skewed h16"], False)
    assert sorted(s.label for s in either) == ["latency", "skewed", "skewed"]
    assert core.select_shapes(["decode_dense"], ["no-such-shape"], False) == []
    with pytest.raises(ValueError, match="unknown op"):
        core.select_shapes(["sparse_bwd"], [], False)


# ------------------------------------------------------------------------------------------------------------
# Counting


def test_flop_and_byte_counts():
    v32 = core.SparseFwdShape("V3.2", 4096, 32768, 2048, 128, 576)
    assert v32.flop() == 2 * 4096 * 2048 * 128 * (576 + 512)

    assert core.dense_attended([10], 2, causal=True) == 9 + 10
    assert core.dense_attended([10], 2, causal=False) == 20
    assert core.dense_attended([1, 0], 3, causal=True) == 1  # only the last query of request 0 sees its key
    shape = core.DecodeDenseShape("batch", 128, 2, 128, 4096, causal=True)
    assert shape.flop() == 2 * 128 * (128 * (4095 + 4096)) * (576 + 512)
    dense = core.DecodeDenseShape("batch", 128, 1, 16, 4096)
    assert dense.bytes() == 2 * 128 * 1 * 16 * (576 + 512) + 128 * 4096 * 576 * 2

    assert core.sparse_decode_attended(4, 2, 2048) == 4 * 2 * 2048
    assert core.sparse_decode_attended(4, 2, 2048, topk_length_sum=100) == 200
    assert core.decode_bytes(2, 2, 64, 512, 1000, 584) == 2 * 2 * 2 * 64 * (512 + 512) + 1000 * 584


def test_fp8_layout_constants():
    assert core.FP8_BYTES_PER_TOKEN == {576: 656, 512: 584}
    assert core.fp8_block_stride(576, 64) == 64 * 656
    for page in (1, 2, 64, 256):
        stride = core.fp8_block_stride(512, page)
        assert stride % core.MODEL1_PAGE_ALIGN == 0 and 0 <= stride - page * 584 < core.MODEL1_PAGE_ALIGN
    assert core.fp8_block_stride(512, 2) == 1728


def test_input_sets_cover_three_l2_sizes():
    l2 = 50 << 20
    assert core.n_input_sets(4.9e6, l2, 64) == math.ceil(3 * l2 / 4.9e6)
    assert core.n_input_sets(1e9, l2, 64) == 1
    assert core.n_input_sets(1e3, l2, 64) == 64
    latency = core.DecodeDenseShape("latency", 1, 1, 128, 4096)
    n = core.n_input_sets(latency.bytes_per_call(), l2, 64)
    assert 1 < n < 64 and n * latency.bytes_per_call() >= 3 * l2
    assert core.n_input_sets(core.SparseFwdShape("V3.2", 4096, 8192, 2048, 128, 576).bytes_per_call(), l2, 64) == 1


# ------------------------------------------------------------------------------------------------------------
# Input generators (CPU)


def test_randn_offset_is_never_zero_mean():
    x = core.randn_offset((64, 1024), cpu_gen(1), torch.float32)
    assert x.dtype == torch.float32 and x.shape == (64, 1024)
    assert 0.08 < float(x.std()) < 0.12 and float(x.abs().min()) >= 0
    means = [float(core.randn_offset((4096,), cpu_gen(s), torch.float32).mean()) for s in range(6)]
    assert len({round(m, 3) for m in means}) > 1  # a per-tensor offset, not always the same


def test_distinct_rows_are_distinct_in_range_and_unordered():
    idx = core.distinct_rows(50, 100, 1100, 64, cpu_gen(), chunk_elems=5000)  # several chunks
    assert idx.dtype == torch.int32 and idx.shape == (50, 64)
    assert int(idx.min()) >= 100 and int(idx.max()) < 1100
    assert all(len(set(row.tolist())) == 64 for row in idx)
    assert not all(row.tolist() == sorted(row.tolist()) for row in idx)
    assert len({tuple(row.tolist()) for row in idx}) == 50

    short = core.distinct_rows(3, 0, 10, 16, cpu_gen())
    for row in short.tolist():
        assert sorted(row[:10]) == list(range(10)) and row[10:] == [-1] * 6


def test_local_rows_put_31_of_32_in_the_last_window():
    s_kv, topk = 65536, 2048
    idx = core.local_rows(8, s_kv, topk, cpu_gen())
    lo = s_kv - core.LOCAL_WINDOW
    pos = torch.arange(topk)
    far = (pos % core.LOCAL_STRIDE) == core.LOCAL_STRIDE - 1
    assert int(far.sum()) == topk // 32
    assert bool((idx[:, far] < lo).all()) and bool((idx[:, far] >= 0).all())
    assert bool((idx[:, ~far] >= lo).all()) and bool((idx[:, ~far] < s_kv).all())
    assert all(len(set(row.tolist())) == topk for row in idx)
    small = core.local_rows(4, 8192, 512, cpu_gen())  # the window covers the whole tensor: plain random rows
    assert int(small.min()) >= 0 and int(small.max()) < 8192


def test_paged_layout_and_cache_indices():
    lengths = [5, 130, 64, 1]
    table, pages = core.paged_layout(lengths, 64, cpu_gen())
    need = [1, 3, 1, 1]
    assert pages == sum(need) and table.shape == (4, 3)
    used = [p for i, n in enumerate(need) for p in table[i, :n].tolist()]
    assert sorted(used) == list(range(pages))

    abs_idx = torch.tensor([[[0, 4, -1]], [[129, 64, 63]], [[-1, -1, 10]], [[0, -1, -1]]], dtype=torch.int32)
    got = core.cache_indices(abs_idx, table, 64)
    for b in range(4):
        for j in range(3):
            a = int(abs_idx[b, 0, j])
            want = -1 if a < 0 else int(table[b, a // 64]) * 64 + a % 64
            assert int(got[b, 0, j]) == want

    assert core.distinct_valid(torch.tensor([[[3, 3, -1, 7]], [[7, 9, 2, -1]]])) == 4
    lengths_t = torch.tensor([1, 2])
    assert core.distinct_valid(torch.tensor([[[3, 3, -1, 7]], [[7, 9, 2, -1]]]), lengths_t) == 3


def test_varlen_lengths():
    lengths = core.varlen_lengths(512, 32768, 2, cpu_gen())
    assert len(lengths) == 512 and min(lengths) >= 2
    assert 28000 < sum(lengths) / len(lengths) < 37000


# ------------------------------------------------------------------------------------------------------------
# Pair check


def test_pair_check_accepts_rounding_and_flags_wrong_results():
    gen = cpu_gen(3)
    ref = torch.randn(4096, generator=gen) / 10
    tol = core.TOL["prefill_out"]
    same = core.pair_check(ref.bfloat16(), ref.bfloat16(), tol)
    assert same["ok"] and same["failed"] == 0 and same["max_abs_diff"] == 0
    rounded = core.pair_check(ref.bfloat16(), ref, tol, chunk=1000)
    assert rounded["ok"], rounded

    wrong = ref.clone()
    wrong[17] += 0.05
    bad = core.pair_check(wrong, ref, tol)
    assert not bad["ok"] and bad["failed"] == 1 and bad["max_abs_diff"] == pytest.approx(0.05, rel=1e-3)
    assert not core.pair_check(ref * 1.1, ref, tol)["ok"]

    lse = torch.tensor([1.0, float("inf"), 3.0])
    assert core.pair_check(lse, lse.clone(), core.TOL["decode_lse"])["ok"]
    moved = torch.tensor([1.0, 2.0, float("inf")])
    assert not core.pair_check(lse, moved, core.TOL["decode_lse"])["ok"]
    nan = torch.tensor([1.0, float("nan"), 3.0])
    assert not core.pair_check(nan, torch.tensor([1.0, 2.0, 3.0]), core.TOL["decode_lse"])["ok"]
    shape = core.pair_check(torch.zeros(2, 3), torch.zeros(3, 2), tol)
    assert not shape["ok"] and "shapes differ" in shape["error"]


# ------------------------------------------------------------------------------------------------------------
# Scheduler on a fake clock


class FakeRunner(core.Runner):
    """A device whose implementations take fixed per-call times; logs every sleep and block."""

    def __init__(self, call_ms, issue_ms=None):
        self.call_ms = call_ms
        self.issue_ms = issue_ms or {}
        self.t = 0.0
        self.log = []

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.log.append(("sleep", seconds, self.t))
        self.t += seconds

    def block(self, name, calls):
        ms = self.call_ms[name] * calls
        self.log.append((name, calls, self.t))
        self.t += ms / 1000
        return core.Block(ms, self.issue_ms.get(name, 0.01) * calls, 1980.0)


def test_calls_for_and_calibrate():
    assert core.calls_for(3.6, 25) == 7
    assert core.calls_for(100, 25) == 2
    assert core.calls_for(0.001, 25, max_calls=500) == 500
    runner = FakeRunner({OURS: 3.6, PEER: 0.02})
    calls = core.calibrate(runner, [OURS, PEER], 25.0)
    assert calls == {OURS: 7, PEER: 1250}
    probes = [entry for entry in runner.log if entry[0] == PEER]
    assert len(probes) == 2 and probes[0][1] == 3 and probes[1][1] > 3  # a longer second probe for tiny calls


def test_round_orders_alternate_who_goes_first():
    assert core.round_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert core.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert core.round_orders(["a"], 2) == [["a"], ["a"]]
    assert core.round_orders([], 2) == []


def test_short_regime_idles_before_every_block_and_alternates():
    runner = FakeRunner({OURS: 2.0, PEER: 2.5})
    calls = {OURS: 12, PEER: 10}
    blocks = core.run_short(runner, [OURS, PEER], calls, rounds=4, idle_s=1.0)
    kinds = [entry[0] for entry in runner.log]
    rounds = [[OURS, PEER], [PEER, OURS], [OURS, PEER], [PEER, OURS]]
    assert kinds == [kind for order in rounds for name in order for kind in ("sleep", name)]
    assert all(entry[1] == 1.0 for entry in runner.log if entry[0] == "sleep")
    assert all(entry[1] == calls[entry[0]] for entry in runner.log if entry[0] != "sleep")
    assert [len(blocks[n]) for n in (OURS, PEER)] == [4, 4]
    stats = core.summarize(blocks[OURS], calls[OURS])
    assert stats.time_us == pytest.approx(2000.0) and stats.calls == 12 and stats.sm_clock_mhz == 1980.0
    assert not stats.host_bound


def test_sustained_regime_loads_first_and_never_idles():
    runner = FakeRunner({OURS: 5.0, PEER: 5.0, PEER_META: 5.5})
    names = [OURS, PEER, PEER_META]
    calls = {n: 5 for n in names}
    blocks = core.run_sustained(runner, names, calls, rounds=3, load_s=1.5)
    assert all(entry[0] != "sleep" for entry in runner.log)
    timed = runner.log[-9:]
    assert [e[0] for e in timed] == [OURS, PEER, PEER_META, PEER, PEER_META, OURS, PEER_META, OURS, PEER]
    assert timed[0][2] >= 1.5  # the first timed block starts after the load
    loaded = runner.log[:-9]
    assert {e[0] for e in loaded} == set(names)  # every implementation runs during the load
    assert [len(blocks[n]) for n in names] == [3, 3, 3]


def test_summarize_median_and_host_bound():
    blocks = [core.Block(10.0, 1.0, None), core.Block(30.0, 1.0, 1800.0), core.Block(20.0, 19.5, 1900.0)]
    stats = core.summarize(blocks, 10)
    assert stats.time_us == pytest.approx(2000.0)
    assert stats.samples_us == [1000.0, 3000.0, 2000.0]
    assert stats.sm_clock_mhz == 1850.0 and not stats.host_bound
    issued_slowly = [core.Block(10.0, 9.5), core.Block(10.0, 9.8), core.Block(10.0, 1.0)]
    assert core.summarize(issued_slowly, 5).host_bound


def test_estimate_seconds():
    short = core.estimate_seconds([2], ["short"], 5, 8, 1.0, 1.5, 25.0, setup_s=0.0)
    assert short == pytest.approx(0.05 + 5 * 2 * 1.025)
    both = core.estimate_seconds([2, 3], ["short", "sustained"], 5, 8, 1.0, 1.5, 25.0, setup_s=0.0)
    assert both > short * 2


# ------------------------------------------------------------------------------------------------------------
# Records


def stats(time_us, calls=10, host_bound=False):
    return core.ImplStats(time_us, [time_us], calls, 1980.0, host_bound)


ENV = dict(gpu="NVIDIA H100 80GB HBM3", commit="abc1234", date="2026-11-27", driver="580.1", torch="2.11.0")


def test_make_record_ratios_rates_and_fields():
    shape = core.DecodeDenseShape("batch", 128, 1, 16, 4096)
    rec = core.make_record(
        shape.op, shape.name, shape.fields(), "short",
        {OURS: stats(100.0), PEER: stats(110.0), PEER_META: stats(115.0)},
        shape.flop(), shape.bytes(), ENV, check={"ok": True}, notes=["n"], input_sets=2,
    )
    for key in ("b", "s_q", "s_k", "h_q", "h_kv", "d_qk", "d_v", "causal", "page_size"):
        assert key in rec
    assert rec["op"] == "decode_dense" and rec["regime"] == "short" and rec["timing"] == "full-clock"
    assert rec["harness"] == core.HARNESS == 2
    assert rec["reps"] == 10 and rec["run_sm_clock_mhz"] == 1980.0 and rec["peer_run_sm_clock_mhz"] == 1980.0
    assert rec["time_us"] == 100.0 and rec["peer_time_us"] == 110.0 and rec["vs_peer"] == pytest.approx(1.1)
    assert rec["tflops"] == pytest.approx(round(shape.flop() / 100e-6 / 1e12, 1))
    assert rec["peer_tflops"] == pytest.approx(round(shape.flop() / 110e-6 / 1e12, 1))
    assert rec["gb_per_s"] == pytest.approx(round(shape.bytes() / 100e-6 / 1e9, 1))
    assert rec["peer_with_metadata_time_us"] == 115.0 and rec["vs_peer_with_metadata"] == pytest.approx(1.15)
    assert rec["input_sets"] == 2 and rec["check"] == {"ok": True} and rec["notes"] == ["n"]
    assert all(rec[k] == v for k, v in ENV.items())


def test_make_record_with_one_side_missing():
    shape = core.SparseFwdShape("V3.2", 4096, 32768, 2048, 128, 576)
    rec = core.make_record(shape.op, shape.name, shape.fields(), "sustained", {PEER: stats(3600.0)},
                           shape.flop(), None, ENV, regime_fields={"load_ms": 1500})
    assert rec["timing"] == "sustained" and rec["load_ms"] == 1500 and "reps" not in rec
    assert rec["time_us"] is None and rec["vs_peer"] is None and rec["tflops"] is None
    assert rec["peer_tflops"] == pytest.approx(round(shape.flop() / 3600e-6 / 1e12, 1))
    assert "gb_per_s" not in rec and "indices" in rec and "attn_sink" in rec


def test_host_record_and_table():
    shape = core.HOST_COST_SHAPES[0]
    rec = core.make_host_record(shape, "flashmla.sparse_fwd", core.HostCost(40.0, 41.0, 39.0, 15.0),
                                core.HostCost(20.0, 21.0, 19.0, 12.5), 2000, ENV)
    assert rec["op"] == "host_cost" and rec["call"] == "sparse_fwd" and rec["api"] == "flashmla.sparse_fwd"
    assert rec["regime"] == "host" and rec["vs_peer"] == pytest.approx(0.5) and rec["peer_wall_us"] == 21.0
    assert rec["burst_issue_us"] == 15.0 and rec["peer_burst_issue_us"] == 12.5
    assert rec["s_q"] == 1 and rec["topk"] == 128 and rec["h_q"] == 64

    good = core.make_record("sparse_fwd", "shape A", {}, "short", {OURS: stats(90.0), PEER: stats(100.0)},
                            1e9, None, ENV, check={"ok": True})
    bad = core.make_record("sparse_fwd", "shape B", {}, "short", {OURS: stats(90.0, host_bound=True)},
                           1e9, None, ENV, check={"ok": False})
    table = core.format_table([good, bad, rec])
    lines = table.splitlines()
    assert "shape A" in lines[2] and "1.111" in lines[2] and "ok" in lines[2]
    assert "shape B" in lines[3] and "MISMATCH" in lines[3] and "90.0*" in lines[3]
    assert "host-bound" in lines[-1]


# ------------------------------------------------------------------------------------------------------------
# Command line (no GPU needed for these)


def test_command_line_defaults_and_list(capsys):
    args = side_by_side.parse_args(["--quick", "--ops", "sparse_fwd,decode_dense", "--regime", "short"])
    assert args.ops == ["sparse_fwd", "decode_dense"] and args.regimes == ["short"]
    assert (args.rounds_short, args.rounds_sustained) == (3, 4)
    full = side_by_side.parse_args([])
    assert full.regimes == ["short", "sustained"] and (full.rounds_short, full.rounds_sustained) == (5, 8)
    assert (full.idle_s, full.load_s, full.block_ms, full.host_calls) == (1.0, 1.5, 25.0, 2000)

    assert side_by_side.main(["--list", "--quick", "--ops", "decode_sparse_fp8"]) == 0
    out = capsys.readouterr().out
    assert "V3.2 tp16" in out and "shapes, about" in out
    assert side_by_side.main(["--list", "--ops", "nope"]) == 2


# ------------------------------------------------------------------------------------------------------------
# The whole flow on the CPU: flashmla's CPU reference on both sides (flashmla.compat has the peer's signatures),
# tiny shapes, a wall-clock runner instead of CUDA events.


class WallRunner(core.Runner):
    def __init__(self, calls, sets, nvml):
        self.calls, self.sets = calls, sets

    def now(self):
        return time.perf_counter()

    def sleep(self, seconds):
        pass

    def block(self, name, calls):
        t0 = time.perf_counter()
        for k in range(calls):
            self.calls[name](k % self.sets)
        ms = (time.perf_counter() - t0) * 1e3
        return core.Block(ms, 0.0, None)


TINY_SHAPES = [
    core.SparseFwdShape("V3.2", 8, 300, 64, 64, 576, attn_sink=True),
    core.SparseFwdShape("MODEL1", 8, 2000, 64, 64, 512, indices="local"),
    core.DecodeDenseShape("batch", 3, 2, 16, 100, causal=True, page_size=16),
    core.DecodeDenseShape("skewed", 3, 1, 8, 200, seqlens="skewed", s_k_short=20),
    core.DecodeSparseShape("V3.2", 3, 2, 64, 300, 64, 576, 64),
    core.DecodeSparseShape(
        "MODEL1", 3, 2, 64, 200, 32, 512, 16, extra_s_k=100, extra_topk=48, extra_page_size=2, extra_topk_length=True
    ),
    core.DecodeSparseShape("V3.2 tp16", 2, 1, 16, 300, 64, 576, 64),
]


@pytest.fixture(scope="module")
def cpu_libs():
    flashmla = pytest.importorskip("flashmla")
    compat = pytest.importorskip("flashmla.compat")
    return side_by_side.Libs(fm=flashmla, fm_compat=compat, peer=compat)


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda s: f"{s.op}-{s.name}")
def test_time_shape_on_cpu(shape, cpu_libs):
    args = side_by_side.parse_args(["--rounds-short", "1", "--rounds-sustained", "1", "--idle-s", "0",
                                    "--load-s", "0.01", "--block-ms", "1", "--max-sets", "2"])
    with torch.inference_mode():
        records = side_by_side.time_shape(shape, cpu_libs, args, ENV, None, cpu_gen(5), 1 << 20, WallRunner)
    assert [r["regime"] for r in records] == ["short", "sustained"]
    for rec in records:
        assert rec["check"]["ok"] and rec["check"]["out_max_abs_diff"] == 0.0, rec["check"]
        assert rec["time_us"] > 0 and rec["peer_time_us"] > 0 and rec["vs_peer"] > 0
        assert rec["input_sets"] == 2 and rec["flop"] > 0 and rec["tflops"] is not None
        assert (rec.get("peer_with_metadata_time_us") is not None) == shape.op.startswith("decode")
        assert (rec.get("gb_per_s") is not None) == shape.op.startswith("decode")
        assert len(rec["samples_us"]) == 1 and rec["rounds"] == 1
        assert rec["timing"] == {"short": "full-clock", "sustained": "sustained"}[rec["regime"]]
    if getattr(shape, "peer_h_q", shape.h_q) != shape.h_q:
        assert any("padded" in note for note in records[0]["notes"])


def test_a_failing_implementation_is_dropped_with_its_reason(cpu_libs, capsys):
    class Broken:
        @staticmethod
        def flash_mla_sparse_fwd(*args, **kwargs):
            raise AssertionError("h_q must be 64 or 128")

    libs = side_by_side.Libs(fm=cpu_libs.fm, fm_compat=cpu_libs.fm_compat, peer=Broken)
    args = side_by_side.parse_args(["--regime", "short", "--rounds-short", "1", "--idle-s", "0", "--block-ms", "1"])
    with torch.inference_mode():
        records = side_by_side.time_shape(TINY_SHAPES[0], libs, args, ENV, None, cpu_gen(), 1 << 20, WallRunner)
    assert len(records) == 1 and records[0]["peer_time_us"] is None and records[0]["time_us"] > 0
    assert records[0]["check"] is None
    assert any("peer skipped: AssertionError: h_q must be 64 or 128" in n for n in records[0]["notes"])
    assert "[skip]" in capsys.readouterr().out


def test_host_cost_on_cpu(cpu_libs):
    args = side_by_side.parse_args(["--host-cost", "--host-calls", "3", "--host-rounds", "1"])
    with torch.inference_mode():
        records = side_by_side.host_cost(cpu_libs, args, ENV, cpu_gen())
    apis = [r["api"] for r in records]
    assert "flashmla.sparse_fwd" in apis and "flashmla.compat.flash_mla_with_kvcache" in apis
    assert all(r["regime"] == "host" and r["time_us"] > 0 and r["peer_time_us"] > 0 for r in records)
