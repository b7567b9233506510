#!/usr/bin/env bash
# Times several builds of flashmla against each other on one GPU: for a change that no environment switch can
# select (`flashmla bench --ab` compares switches inside one process). The builds alternate inside every round, so
# that clock, temperature and card drift fall on all of them alike; each (round, build, shape) is one
# `flashmla bench` process (`--timing TIMING --rounds 1`: full clock unless TIMING says otherwise).
#
# Usage: scripts/ab-builds.sh OUT.json NAME=BINARY [NAME=BINARY ...]
# Env:   OP (default sparse_bwd), INDICES (default random), ROUNDS (default 3), TIMING (default full-clock;
#        `sustained` compares the builds at the power cap),
#        SHAPES: `;`-separated `--shape` filters (default the V3.2 h_q 128 shapes at s_kv 8K and 32K),
#        BENCH_ARGS: more `flashmla bench` arguments for every run,
#        RUN_TIMEOUT: seconds one run may take before it is killed and reported (default 300; a kernel that hangs
#        must not take the rest of the comparison with it).
# Output: OUT.json, every record of every run with `build` (NAME) and `round` added; a table on stdout.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
out="$1"
shift
op="${OP:-sparse_bwd}"
indices="${INDICES:-random}"
rounds="${ROUNDS:-3}"
timing="${TIMING:-full-clock}"
shapes="${SHAPES:-s_q=4096 h_q=128 d_qk=576 s_kv=8192;s_q=4096 h_q=128 d_qk=576 s_kv=32768}"
names=()
bins=()
for arg in "$@"; do
  case "$arg" in
  *=*) ;;
  *)
    echo "ab-builds: expected NAME=BINARY, got '$arg'" >&2
    exit 2
    ;;
  esac
  name="${arg%%=*}"
  bin="${arg#*=}"
  if [ ! -x "$bin" ]; then
    echo "ab-builds: '$bin' (build $name) is not an executable file" >&2
    exit 2
  fi
  names+=("$name")
  bins+=("$bin")
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
IFS=';' read -r -a shape_list <<<"$shapes"
status=0
for ((r = 1; r <= rounds; r++)); do
  for i in "${!names[@]}"; do
    for s in "${!shape_list[@]}"; do
      json="$tmp/r$r-b$i-s$s.json"
      echo "round $r/$rounds, ${names[$i]}, ${shape_list[$s]}" >&2
      # shellcheck disable=SC2086
      timeout "${RUN_TIMEOUT:-300}" "${bins[$i]}" bench --op "$op" --indices "$indices" --shape "${shape_list[$s]}" \
        --timing "$timing" --rounds 1 --json "$json" ${BENCH_ARGS:-} >"$tmp/log" 2>&1 || {
        status=1
        tail -5 "$tmp/log" >&2
      }
    done
  done
done

python3 - "$tmp" "$out" "${names[@]}" <<'EOF'
import glob, json, os, re, sys
tmp, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
records = []
for f in sorted(glob.glob(os.path.join(tmp, "r*-b*-s*.json"))):
    r, b, _ = map(int, re.match(r"r(\d+)-b(\d+)-s(\d+)\.json", os.path.basename(f)).groups())
    for rec in json.load(open(f)):
        rec["build"], rec["round"] = names[b], r
        records.append(rec)
json.dump(records, open(out, "w"), indent=1)
shapes = {}
for rec in records:
    key = " ".join(f"{k}={rec[k]}" for k in ("s_q", "s_kv", "topk", "h_q", "d_qk") if k in rec)
    shapes.setdefault(key, {}).setdefault(rec["build"], []).append(rec)
def col(recs, field, fmt):
    vals = [r.get(field) for r in recs if r.get(field) is not None]
    return " / ".join(fmt.format(v) for v in vals) if vals else "-"
for key, per_build in shapes.items():
    print(key)
    for name in names:
        recs = per_build.get(name, [])
        print(f"  {name:<24} " + col(recs, "tflops", "{:.1f}") + " TFLOPS; SM MHz " +
              col(recs, "run_sm_clock_mhz", "{:.0f}") + "; J/call " + col(recs, "run_joules_per_call", "{:.2f}"))
print(f"wrote {len(records)} records to {out}")
EOF
exit $status
