"""SVG charts from benchmark JSON (``flashmla bench --json`` records and side-by-side records), plain Python.

Charts, each written only when the inputs hold records for it:

* ``NAME-vs-peer.svg``: ours against the peer per shape, one bar per regime, ``vs_peer = peer_time_us /
  time_us`` drawn from the 1.0 line (right of it: ours is faster); from records that carry the peer's time.
* ``NAME-tflops.svg``: each kernel's TFLOPS against the bf16 GEMM ceiling of its regime (short blocks at full
  clock, sustained at the power cap); the ceilings come from ``gemm_bf16`` records among the inputs (``python3
  bench/gemm_ceiling.py``, the same card and run), else from ``--gemm-short`` / ``--gemm-sustained``.
* ``NAME-bandwidth.svg``: GB/s of the memory-bound ops (decode, FP8 cache) against ``--hbm-gb-per-s``.

A record's regime is its ``regime`` field, else its ``timing`` (``full-clock``: short, ``sustained``), else
``back-to-back``. A/B records (``variant``) and host-cost records (regime ``host``) are left out; where several
records have the same op, shape and regime, the last one read counts (files in the order given). Figures from
different cards or runs do not compare (docs/perf-log.md): give the files of one run.

Usage::

    python3 bench/plot.py --out-dir docs/charts --name h100-standard bench/results/<run>.json [<run>.json ...]
    python3 bench/plot.py --ops kv_quantize,kv_dequantize --name h100-kv-cache FILE.json   # some ops only

Needs only the standard library (no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape, quoteattr

#: The H100 figures of docs/perf-log.md used when the inputs carry no ceiling of their own: the 8192^3 bf16 GEMM in
#: short blocks and at the 700 W power cap, and a device-to-device copy (read + write).
GEMM_SHORT_TFLOPS = 798.0
GEMM_SUSTAINED_TFLOPS = 690.0
HBM_GB_PER_S = 3000.0

REGIME_ORDER = ("short", "sustained", "back-to-back")
REGIME_COLOUR = {"short": "#2f6db5", "sustained": "#e07b1a", "back-to-back": "#7f7f7f"}
REGIME_TEXT = {
    "short": "short blocks (full clock)",
    "sustained": "sustained (at the power cap)",
    "back-to-back": "back to back",
}
TIMING_REGIME = {"full-clock": "short", "sustained": "sustained"}

FONT_PX = 12
#: Average width of a character of the 12 px sans-serif font, for laying out labels without a font engine.
CHAR_PX = 6.6
BAR_PX = 12
BAR_GAP_PX = 2
ROW_PAD_PX = 6
GROUP_HEAD_PX = 24
PLOT_PX = 520
VALUE_TEXT_PX = 120
MARGIN_PX = 16


# ------------------------------------------------------------------------------------------------------------
# Records


def load_records(paths: Iterable[Path]) -> List[dict]:
    """Every record of the files, in order: a file holds a JSON list of records or ``{"records": [...]}``."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):
            data = data.get("records", [])
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        out.extend(r for r in data if isinstance(r, dict) and "op" in r)
    return out


def regime_of(r: dict) -> str:
    if r.get("regime"):
        return str(r["regime"])
    return TIMING_REGIME.get(r.get("timing") or "", "back-to-back")


def k_label(n: int) -> str:
    """``32768 -> "32K"``, ``2048 -> "2K"``, ``1000 -> "1000"``."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def shape_label(r: dict) -> str:
    """The record's ``name`` when it has one, else a label built from its shape fields."""
    if r.get("name"):
        return str(r["name"])
    parts = []
    if r.get("d_qk") in (576, 512) and r.get("op", "").startswith(("sparse", "decode")):
        parts.append("V3.2" if r["d_qk"] == 576 else "MODEL1")
    if r.get("op") == "gemm_bf16" and r.get("m"):
        parts.append(f"{r['m']}x{r.get('n')}x{r.get('k')}")
    if r.get("b") is not None:
        parts.append(f"b{r['b']}")
    if r.get("s_q") is not None:
        parts.append(f"s_q {k_label(r['s_q'])}")
    if r.get("h_q") is not None:
        parts.append(f"h{r['h_q']}")
    if r.get("topk") is not None:
        parts.append(f"topk {k_label(r['topk'])}")
    for key, name in (("s_kv", "s_kv"), ("s_k", "s_k")):
        if r.get(key) is not None:
            parts.append(f"{name} {k_label(r[key])}")
    if r.get("causal"):
        parts.append("causal")
    for key in ("indices", "format"):
        if r.get(key):
            parts.append(str(r[key]))
    if r.get("tokens") is not None:
        parts.append(f"{k_label(r['tokens'])} tokens")
    return " ".join(parts) or "-"


def latest(records: Iterable[dict]) -> "OrderedDict[Tuple[str, str, str], dict]":
    """One record per (op, shape, regime): the last one read, in first-seen order; A/B and host records dropped."""
    out: "OrderedDict[Tuple[str, str, str], dict]" = OrderedDict()
    for r in records:
        regime = regime_of(r)
        if r.get("variant") or regime == "host":
            continue
        key = (str(r["op"]), shape_label(r), regime)
        out[key] = r
    return out


def speedup(r: dict) -> Optional[float]:
    """``peer_time_us / time_us`` (> 1: ours is faster), from the times when both are there, else ``vs_peer``."""
    t, tp = r.get("time_us"), r.get("peer_time_us")
    if t and tp:
        return float(tp) / float(t)
    v = r.get("vs_peer")
    return float(v) if v else None


def provenance(records: Sequence[dict]) -> str:
    """GPU, commits and dates of the records, for the subtitle."""

    def distinct(key, width=None):
        seen = []
        for r in records:
            v = r.get(key)
            if v and (str(v)[:width] if width else str(v)) not in seen:
                seen.append(str(v)[:width] if width else str(v))
        return seen

    parts = [", ".join(distinct("gpu")) or "GPU not recorded"]
    commits = distinct("commit", 7)
    if commits:
        parts.append("commit " + ", ".join(commits))
    dates = distinct("date")
    if dates:
        parts.append(", ".join(dates))
    return " · ".join(parts)


def ceilings(records: Sequence[dict], short: float, sustained: float) -> Dict[str, Tuple[float, str]]:
    """GEMM ceiling per regime, TFLOPS, with where it comes from: the mean of the inputs' ``gemm_bf16`` records of
    that regime, else the given figure."""
    out = {}
    for regime, default in (("short", short), ("sustained", sustained)):
        got = [float(r["tflops"]) for r in records if r.get("op") == "gemm_bf16" and r.get("tflops")
               and regime_of(r) == regime]
        if got:
            out[regime] = (sum(got) / len(got), "measured in this run")
        else:
            out[regime] = (default, "H100 figure")
    return out


# ------------------------------------------------------------------------------------------------------------
# SVG


class Bar:
    """One bar: a value drawn from ``origin``, its regime (colour), the text after it and a tooltip."""

    def __init__(self, value: float, regime: str, text: str, tooltip: str, marker: Optional[float] = None):
        self.value, self.regime, self.text, self.tooltip, self.marker = value, regime, text, tooltip, marker


class RefLine:
    """A vertical reference line across the plot with its caption."""

    def __init__(self, x: float, caption: str, colour: str, dashed: bool = True):
        self.x, self.caption, self.colour, self.dashed = x, caption, colour, dashed


def nice_step(span: float, target_ticks: int = 8) -> float:
    """A 1/2/5 x 10^k step giving about ``target_ticks`` ticks over ``span``."""
    raw = span / max(target_ticks, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def fmt_tick(v: float, step: float) -> str:
    decimals = max(0, -int(math.floor(math.log10(step)))) if step < 1 else 0
    return f"{v:.{decimals}f}"


def hbar_svg(
    title: str,
    subtitle: str,
    axis_caption: str,
    groups: Sequence[Tuple[str, Sequence[Tuple[str, Sequence[Bar]]]]],
    x_min: float,
    x_max: float,
    origin: float,
    ref_lines: Sequence[RefLine],
    legend: Sequence[Tuple[str, str]],
    notes: Sequence[str] = (),
) -> str:
    """Horizontal bar chart: groups of rows, each row a label and one bar per regime."""
    labels = [label for _, rows in groups for label, _ in rows] + [g for g, _ in groups]
    label_px = int(max((len(s) for s in labels), default=10) * CHAR_PX) + 2 * MARGIN_PX
    plot_x0 = label_px
    width = plot_x0 + PLOT_PX + VALUE_TEXT_PX + MARGIN_PX
    header_px = 62 + 18 * len(ref_lines)
    legend_px = 22

    def x_of(v: float) -> float:
        return plot_x0 + (min(max(v, x_min), x_max) - x_min) / (x_max - x_min) * PLOT_PX

    body = []
    y = header_px + legend_px
    plot_y0 = y
    for group_title, rows in groups:
        body.append(f'<text x="{MARGIN_PX}" y="{y + 16}" font-weight="bold">{escape(group_title)}</text>')
        y += GROUP_HEAD_PX
        for label, bars in rows:
            row_h = ROW_PAD_PX * 2 + len(bars) * BAR_PX + (len(bars) - 1) * BAR_GAP_PX
            text_y = y + row_h / 2 + FONT_PX / 3
            body.append(f'<text x="{plot_x0 - 8}" y="{text_y:.1f}" text-anchor="end">{escape(label)}</text>')
            by = y + ROW_PAD_PX
            for bar in bars:
                x0, x1 = sorted((x_of(origin), x_of(bar.value)))
                colour = REGIME_COLOUR.get(bar.regime, "#555555")
                body.append(
                    f'<rect class="bar" data-regime={quoteattr(bar.regime)} data-value="{bar.value:.6g}" '
                    f'x="{x0:.1f}" y="{by}" width="{max(x1 - x0, 1):.1f}" height="{BAR_PX}" fill="{colour}">'
                    f"<title>{escape(bar.tooltip)}</title></rect>"
                )
                if bar.marker is not None:
                    mx = x_of(bar.marker)
                    body.append(
                        f'<line class="peer" x1="{mx:.1f}" x2="{mx:.1f}" y1="{by - 1}" y2="{by + BAR_PX + 1}" '
                        f'stroke="#000000" stroke-width="2"><title>peer {bar.marker:.1f}</title></line>'
                    )
                ends = [x1, x_of(origin)] + ([x_of(bar.marker) + 1] if bar.marker is not None else [])
                tx = max(ends) + 6
                body.append(f'<text x="{tx:.1f}" y="{by + BAR_PX - 2}" font-size="11">{escape(bar.text)}</text>')
                by += BAR_PX + BAR_GAP_PX
            y += row_h
        y += 4
    plot_y1 = y
    height = int(plot_y1 + 48 + 16 * len(notes))

    grid = []
    step = nice_step(x_max - x_min)
    tick = math.ceil(x_min / step) * step
    while tick <= x_max + 1e-9:
        gx = x_of(tick)
        grid.append(f'<line x1="{gx:.1f}" x2="{gx:.1f}" y1="{plot_y0}" y2="{plot_y1}" stroke="#e3e3e3"/>')
        grid.append(
            f'<text x="{gx:.1f}" y="{plot_y1 + 16}" text-anchor="middle" font-size="11">{fmt_tick(tick, step)}</text>'
        )
        tick += step
    grid.append(
        f'<text x="{plot_x0 + PLOT_PX / 2:.1f}" y="{plot_y1 + 34}" text-anchor="middle">{escape(axis_caption)}</text>'
    )

    refs = []
    for i, ref in enumerate(ref_lines):
        rx = x_of(ref.x)
        dash = ' stroke-dasharray="6 4"' if ref.dashed else ""
        refs.append(
            f'<line class="ref" x1="{rx:.1f}" x2="{rx:.1f}" y1="{plot_y0 - 4}" y2="{plot_y1}" stroke="{ref.colour}" '
            f'stroke-width="1.5"{dash}/>'
        )
        cy = 60 + 18 * i
        refs.append(f'<line x1="{MARGIN_PX}" x2="{MARGIN_PX + 24}" y1="{cy - 4}" y2="{cy - 4}" stroke="{ref.colour}" '
                    f'stroke-width="1.5"{dash}/>')
        refs.append(f'<text x="{MARGIN_PX + 30}" y="{cy}">{escape(ref.caption)}</text>')

    leg = []
    lx = MARGIN_PX
    ly = header_px + 4
    for regime, text in legend:
        leg.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{REGIME_COLOUR.get(regime, "#555555")}"/>')
        leg.append(f'<text x="{lx + 16}" y="{ly + 10}">{escape(text)}</text>')
        lx += 16 + int(len(text) * CHAR_PX) + 20

    foot = [
        f'<text x="{MARGIN_PX}" y="{plot_y1 + 52 + 16 * i}" font-size="11" fill="#444444">{escape(n)}</text>'
        for i, n in enumerate(notes)
    ]

    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="{FONT_PX}">',
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
            f'<text x="{MARGIN_PX}" y="22" font-size="16" font-weight="bold">{escape(title)}</text>',
            f'<text x="{MARGIN_PX}" y="40" fill="#444444">{escape(subtitle)}</text>',
            *grid,
            *body,
            *refs,
            *leg,
            *foot,
            "</svg>",
            "",
        ]
    )


def rows_by_op(recs: Dict[Tuple[str, str, str], dict], make_bar) -> List[Tuple[str, List[Tuple[str, List[Bar]]]]]:
    """Groups (one per op) of rows (one per shape) of bars (one per regime, in ``REGIME_ORDER``)."""
    groups: "OrderedDict[str, OrderedDict[str, Dict[str, Bar]]]" = OrderedDict()
    for (op, label, regime), r in recs.items():
        bar = make_bar(r, regime)
        if bar is not None:
            groups.setdefault(op, OrderedDict()).setdefault(label, {})[regime] = bar
    order = {reg: i for i, reg in enumerate(REGIME_ORDER)}
    return [
        (op, [(label, [bars[k] for k in sorted(bars, key=lambda k: (order.get(k, 99), k))])
              for label, bars in rows.items()])
        for op, rows in groups.items()
    ]


def regimes_in(groups) -> List[str]:
    seen = {bar.regime for _, rows in groups for _, bars in rows for bar in bars}
    return [r for r in REGIME_ORDER if r in seen] + sorted(seen - set(REGIME_ORDER))


# ------------------------------------------------------------------------------------------------------------
# The three charts


def vs_peer_chart(records: Sequence[dict], title: str) -> Optional[str]:
    recs = latest(records)

    def bar(r, regime):
        s = speedup(r)
        if s is None:
            return None
        tip = f"{r['op']} {shape_label(r)} ({regime}): ours {r.get('time_us')} us, peer {r.get('peer_time_us')} us"
        return Bar(s, regime, f"{s:.3f}x", tip)

    groups = rows_by_op(recs, bar)
    if not groups:
        return None
    values = [b.value for _, rows in groups for _, bars in rows for b in bars]
    step = 0.05
    lo = min(0.9, math.floor((min(values) - 0.02) / step) * step)
    hi = max(1.1, math.ceil((max(values) + 0.02) / step) * step)
    used = [r for r in recs.values() if speedup(r) is not None]
    return hbar_svg(
        title=f"{title}: ours against the peer, side by side",
        subtitle=provenance(used),
        axis_caption="peer time / our time (right of 1.0: ours is faster)",
        groups=groups,
        x_min=lo,
        x_max=hi,
        origin=1.0,
        ref_lines=[RefLine(1.0, "1.0: as fast as the peer", "#000000", dashed=False)],
        legend=[(r, REGIME_TEXT.get(r, r)) for r in regimes_in(groups)],
        notes=["Both implementations timed in one process on one card, alternating, on the same inputs."],
    )


def tflops_chart(records: Sequence[dict], title: str, gemm_short: float, gemm_sustained: float) -> Optional[str]:
    ceil = ceilings(records, gemm_short, gemm_sustained)
    recs = OrderedDict((k, r) for k, r in latest(records).items() if k[0] != "gemm_bf16")

    def bar(r, regime):
        t = r.get("tflops")
        if not t:
            return None
        c = ceil.get(regime)
        share = f" ({100 * float(t) / c[0]:.0f}%)" if c else ""
        peer = r.get("peer_tflops")
        tip = f"{r['op']} {shape_label(r)} ({regime}): {float(t):.1f} TFLOPS{share}, {r.get('time_us')} us"
        return Bar(float(t), regime, f"{float(t):.1f}{share}", tip, marker=float(peer) if peer else None)

    groups = rows_by_op(recs, bar)
    if not groups:
        return None
    shown = regimes_in(groups)
    lines = [
        RefLine(ceil[reg][0], f"bf16 GEMM 8192^3, {REGIME_TEXT[reg]}: {ceil[reg][0]:.0f} TFLOPS ({ceil[reg][1]})",
                REGIME_COLOUR[reg])
        for reg in ("short", "sustained")
        if reg in shown or "back-to-back" in shown
    ]
    values = [b.value for _, rows in groups for _, bars in rows for b in bars] + [line.x for line in lines]
    notes = ["Percentages: share of the GEMM ceiling of the same regime."]
    if any(b.marker is not None for _, rows in groups for _, bars in rows for b in bars):
        notes.append("Black ticks: the peer's TFLOPS, timed side by side.")
    used = [r for k, r in recs.items() if r.get("tflops")]
    return hbar_svg(
        title=f"{title}: achieved TFLOPS against the bf16 GEMM ceiling",
        subtitle=provenance(used),
        axis_caption="TFLOPS",
        groups=groups,
        x_min=0.0,
        x_max=max(values) * 1.05,
        origin=0.0,
        ref_lines=lines,
        legend=[(r, REGIME_TEXT.get(r, r)) for r in shown],
        notes=notes,
    )


def bandwidth_chart(records: Sequence[dict], title: str, hbm_gb_per_s: float) -> Optional[str]:
    recs = latest(records)

    def bar(r, regime):
        g = r.get("gb_per_s")
        if not g:
            return None
        share = 100 * float(g) / hbm_gb_per_s
        peer = r.get("peer_gb_per_s")
        tip = f"{r['op']} {shape_label(r)} ({regime}): {float(g):.0f} GB/s ({share:.0f}%), {r.get('time_us')} us"
        return Bar(float(g), regime, f"{float(g):.0f} ({share:.0f}%)", tip, marker=float(peer) if peer else None)

    groups = rows_by_op(recs, bar)
    if not groups:
        return None
    values = [b.value for _, rows in groups for _, bars in rows for b in bars] + [hbm_gb_per_s]
    used = [r for r in recs.values() if r.get("gb_per_s")]
    return hbar_svg(
        title=f"{title}: achieved bandwidth against HBM",
        subtitle=provenance(used),
        axis_caption="GB/s of compulsory traffic",
        groups=groups,
        x_min=0.0,
        x_max=max(values) * 1.05,
        origin=0.0,
        ref_lines=[RefLine(hbm_gb_per_s, f"HBM, device-to-device copy: {hbm_gb_per_s:.0f} GB/s", "#b22222")],
        legend=[(r, REGIME_TEXT.get(r, r)) for r in regimes_in(groups)],
        notes=["Percentages: share of the HBM copy rate."],
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="benchmark JSON files (records of one run)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/charts"), help="default docs/charts")
    ap.add_argument("--name", default="bench", help="file name prefix of the charts (default bench)")
    ap.add_argument("--title", default="flashmla", help="title prefix (default flashmla)")
    ap.add_argument("--ops", type=lambda v: [o for o in v.split(",") if o],
                    help="only these ops (comma-separated, e.g. kv_quantize,kv_dequantize); gemm_bf16 is always read")
    ap.add_argument("--gemm-short", type=float, default=GEMM_SHORT_TFLOPS,
                    help=f"GEMM ceiling in short blocks without gemm_bf16 records (default {GEMM_SHORT_TFLOPS:.0f})")
    ap.add_argument("--gemm-sustained", type=float, default=GEMM_SUSTAINED_TFLOPS,
                    help=f"GEMM ceiling at the power cap without gemm_bf16 records (default {GEMM_SUSTAINED_TFLOPS:.0f})")
    ap.add_argument("--hbm-gb-per-s", type=float, default=HBM_GB_PER_S,
                    help=f"memory ceiling, GB/s (default {HBM_GB_PER_S:.0f})")
    args = ap.parse_args(argv)

    try:
        records = load_records(args.files)
    except (OSError, ValueError) as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    if args.ops:
        records = [r for r in records if r["op"] in args.ops or r["op"] == "gemm_bf16"]
    charts = {
        "vs-peer": vs_peer_chart(records, args.title),
        "tflops": tflops_chart(records, args.title, args.gemm_short, args.gemm_sustained),
        "bandwidth": bandwidth_chart(records, args.title, args.hbm_gb_per_s),
    }
    written = 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for kind, svg in charts.items():
        if svg is None:
            print(f"plot: no records for the {kind} chart")
            continue
        path = args.out_dir / f"{args.name}-{kind}.svg"
        path.write_text(svg)
        print(f"plot: wrote {path}")
        written += 1
    if not written:
        print(f"plot: none of the {len(records)} records can be drawn", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
