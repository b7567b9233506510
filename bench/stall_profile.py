#!/usr/bin/env python3
"""Where a kernel's warps wait: Nsight Compute's warp-stall sampling per SASS instruction, summarised.

Two steps, on the GPU machine (ncu reads the hardware counters there) or the second alone anywhere:

  python3 bench/stall_profile.py run --kernel decode_split_fp8_v32_pair --out /tmp/prof -- \\
      ./target/release/flashmla bench --op decode_sparse --shape b=128,s_q=2,h_q=128,fmt=v32 --warmup 1 --reps 2
  python3 bench/stall_profile.py show /tmp/prof-src.csv [--block 250] [--top 40]

`run` profiles one launch of the kernel (the third whose name matches `--kernel`, a regular expression) with the
SourceCounters section and clocks left alone, and exports the per-instruction table as `OUT-src.csv`. `show` prints
the share of all samples per stall reason, then per block of `--block` consecutive SASS instructions (the warp roles
of a warp-specialised kernel sit in separate blocks of code; each block names the instruction kinds it holds), then the
`--top` instructions with the most samples and their main reasons. A stall is charged to the instruction that waits:
a `BRA` after `SYNCS.PHASECHK` spinning on `long_sb` is an mbarrier wait, the instruction after `BAR.SYNC` with
`barrier` a named-barrier wait. docs/decode.md ("Where a tile waits, sampled") reads one such profile.
"""
import argparse
import csv
import glob
import os
import shutil
import subprocess
import sys

MARKS = {
    "HGMMA": "HGMMA",
    "MUFU.EX2": "MUFU",
    "LDGSTS": "LDGSTS",
    "LDG.": "LDG",
    "STS": "STS",
    "LDS": "LDS",
    "F2FP": "F2FP",
    "BAR.SYNC": "BAR",
    "SYNCS.ARRIVE": "ARRIVE",
    "SYNCS.PHASECHK": "WAIT",
    "UTMALDG": "TMA",
    "UBLKCP": "BULK",
    "STAS": "STAS",
}


def find_ncu():
    for cand in [shutil.which("ncu"), "/usr/local/cuda/bin/ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))]:
        if cand and os.path.exists(cand):
            return cand
    sys.exit("stall_profile: ncu not found")


def run(args):
    ncu = find_ncu()
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{args.kernel}", "--launch-skip",
           str(args.skip), "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats",
           "-o", args.out, "-f", *args.command]
    subprocess.run(cmd, check=True)
    with open(f"{args.out}-src.csv", "w") as f:
        subprocess.run([ncu, "-i", f"{args.out}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                       check=True, stdout=f)
    print(f"wrote {args.out}-src.csv")


def load(path):
    rows = list(csv.reader(open(path)))
    # The first line names the kernel; the header follows.
    start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr = rows[start]
    body = [r for r in rows[start + 1:] if len(r) == len(hdr)]
    return hdr, body


def show(args):
    hdr, body = load(args.csv)
    col = {h: i for i, h in enumerate(hdr)}
    total_col = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def val(r, c):
        try:
            return float(r[col[c]] if isinstance(c, str) else r[c])
        except ValueError:
            return 0.0

    total = sum(val(r, total_col) for r in body) or 1.0
    pct = lambda v: 100.0 * v / total  # noqa: E731
    print(f"{len(body)} instructions, {total:.0f} samples")
    overall = sorted(((sum(val(r, s) for r in body), s[6:]) for s in reasons), reverse=True)
    print("all: " + " ".join(f"{n} {pct(v):.1f}" for v, n in overall if pct(v) >= 0.5))
    print(f"\nper block of {args.block} instructions (% of all samples):")
    for b in range(0, len(body), args.block):
        seg = body[b:b + args.block]
        s = sum(val(r, total_col) for r in seg)
        if pct(s) < 0.5:
            continue
        top = sorted(((sum(val(r, x) for r in seg), x[6:]) for x in reasons), reverse=True)[:4]
        kinds = sorted({name for r in seg for key, name in MARKS.items() if key in r[col["Source"]]})
        print(f"  {b:6d}-{b + len(seg):6d} {pct(s):5.1f}%  " + " ".join(f"{n} {pct(v):.1f}" for v, n in top if v)
              + f"  [{','.join(kinds)}]")
    print(f"\ntop {args.top} instructions:")
    order = sorted(range(len(body)), key=lambda i: -val(body[i], total_col))[:args.top]
    for i in sorted(order):
        r = body[i]
        top = sorted(((val(r, s), s[6:]) for s in reasons), reverse=True)[:2]
        print(f"  {i:6d} {pct(val(r, total_col)):5.1f}%  {r[col['Source']].strip()[:64]:64s} "
              + " ".join(f"{n} {pct(v):.1f}" for v, n in top if v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile one launch with ncu and export the per-instruction table")
    r.add_argument("--kernel", required=True, help="regular expression of the kernel's name")
    r.add_argument("--skip", type=int, default=2, help="matching launches to skip first (warm-up)")
    r.add_argument("--out", required=True, help="report path without extension")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program to profile")
    s = sub.add_parser("show", help="summarise an exported per-instruction table")
    s.add_argument("csv")
    s.add_argument("--block", type=int, default=250)
    s.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    if args.cmd == "run":
        if args.command and args.command[0] == "--":
            args.command = args.command[1:]
        if not args.command:
            ap.error("run: give the program after --")
        run(args)
    else:
        show(args)


if __name__ == "__main__":
    main()
