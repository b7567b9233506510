"""bench/plot.py on a small fixture of side-by-side and bench records: well-formed SVG, one bar per drawable
record with the right value, ceilings from the run's GEMM records, A/B and host-cost records left out."""

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "plot.py"
FIXTURE = Path(__file__).resolve().parent / "data" / "bench-side-by-side.json"
SVG = "{http://www.w3.org/2000/svg}"


def load_plot_module():
    spec = importlib.util.spec_from_file_location("bench_plot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_plot(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def bars(svg_path: Path):
    """``(regime, value)`` of every bar of a chart; parsing fails on malformed SVG."""
    root = ET.parse(svg_path).getroot()
    assert root.tag == SVG + "svg"
    return [(r.get("data-regime"), float(r.get("data-value"))) for r in root.iter(SVG + "rect") if r.get("class") == "bar"]


@pytest.fixture(scope="module")
def charts(tmp_path_factory):
    out = tmp_path_factory.mktemp("charts")
    res = run_plot("--out-dir", out, "--name", "t", FIXTURE)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


@pytest.fixture(scope="module")
def records():
    return json.loads(FIXTURE.read_text())


def drawable(records):
    return [r for r in records if not r.get("variant") and r.get("regime") != "host"]


def test_vs_peer_chart_has_one_bar_per_side_by_side_record(charts, records):
    got = sorted(bars(charts / "t-vs-peer.svg"))
    want = sorted((r["regime"], r["peer_time_us"] / r["time_us"]) for r in drawable(records) if r.get("peer_time_us"))
    assert len(got) == len(want) == 8
    for (g_regime, g), (w_regime, w) in zip(got, want):
        assert g_regime == w_regime and g == pytest.approx(w, rel=1e-5)
    assert {regime for regime, _ in got} == {"short", "sustained"}


def test_tflops_chart_sets_kernels_against_the_run_s_gemm_ceilings(charts, records):
    got = sorted(v for _, v in bars(charts / "t-tflops.svg"))
    want = sorted(r["tflops"] for r in drawable(records) if r["op"] != "gemm_bf16" and r.get("tflops"))
    assert got == pytest.approx(want)
    text = (charts / "t-tflops.svg").read_text()
    # The fixture's GEMM records (790 short, 680 sustained), not the defaults, and each kernel's share of them.
    assert "790 TFLOPS (measured in this run)" in text and "680 TFLOPS (measured in this run)" in text
    assert "411.2 (52%)" in text
    root = ET.parse(charts / "t-tflops.svg").getroot()
    assert len([ln for ln in root.iter(SVG + "line") if ln.get("class") == "ref"]) == 2
    # A tick for the peer's rate where the record has one.
    with_peer = [r for r in drawable(records) if r.get("tflops") and r.get("peer_tflops")]
    assert len([ln for ln in root.iter(SVG + "line") if ln.get("class") == "peer"]) == len(with_peer) == 6


def test_bandwidth_chart_draws_the_memory_bound_records(charts, records):
    got = sorted(v for _, v in bars(charts / "t-bandwidth.svg"))
    want = sorted(r["gb_per_s"] for r in drawable(records) if r.get("gb_per_s"))
    assert len(want) == 2 and got == pytest.approx(want)
    assert "3000 GB/s" in (charts / "t-bandwidth.svg").read_text()


def test_labels_and_text_are_escaped(tmp_path):
    rec = dict(op="sparse_fwd", name="a <b> & \"c\"", regime="short", time_us=10.0, peer_time_us=11.0, tflops=1.0)
    path = tmp_path / "r.json"
    path.write_text(json.dumps([rec]))
    res = run_plot("--out-dir", tmp_path, "--name", "e", path)
    assert res.returncode == 0, res.stderr
    assert len(bars(tmp_path / "e-vs-peer.svg")) == 1


def test_nothing_to_draw_is_an_error(tmp_path):
    path = tmp_path / "checks.json"
    path.write_text(json.dumps([{"name": "case", "passed": True}, {"op": "sparse_fwd", "time_us": 1.0}]))
    res = run_plot("--out-dir", tmp_path, path)
    assert res.returncode == 1 and "none of the 1 records" in res.stderr
    assert not list(tmp_path.glob("*.svg"))


def test_regimes_labels_and_speedup_direction():
    plot = load_plot_module()
    assert plot.regime_of({"timing": "full-clock"}) == "short"
    assert plot.regime_of({"timing": "sustained"}) == "sustained"
    assert plot.regime_of({"regime": "sustained", "timing": "full-clock"}) == "sustained"
    assert plot.regime_of({}) == "back-to-back"
    # peer 110 us against our 100 us: 1.1, ours faster, whatever `vs_peer` says.
    assert plot.speedup({"time_us": 100.0, "peer_time_us": 110.0, "vs_peer": 0.5}) == pytest.approx(1.1)
    assert plot.speedup({"time_us": 100.0, "peer_time_us": None, "vs_peer": None}) is None
    label = plot.shape_label(dict(op="sparse_fwd", s_q=4096, s_kv=32768, topk=2048, h_q=128, d_qk=576, indices="random"))
    assert label == "V3.2 s_q 4K h128 topk 2K s_kv 32K random"
    # The last record of an (op, shape, regime) counts.
    a = dict(op="sparse_fwd", name="x", regime="short", tflops=1.0)
    b = dict(op="sparse_fwd", name="x", regime="short", tflops=2.0)
    assert list(plot.latest([a, b]).values()) == [b]


def test_ops_selects_records_and_keeps_the_ceilings(tmp_path):
    res = run_plot("--out-dir", tmp_path, "--name", "o", "--ops", "sparse_bwd", FIXTURE)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("*.svg")) == ["o-tflops.svg"]
    assert [v for _, v in bars(tmp_path / "o-tflops.svg")] == [411.2]
    assert "790 TFLOPS (measured in this run)" in (tmp_path / "o-tflops.svg").read_text()
