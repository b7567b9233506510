#!/usr/bin/env bash
# On the GPU machine: checks and times the variants that scripts/build-variants.sh built. Every variant but `base`
# runs `flashmla check --filter CHECK` and compute-sanitizer racecheck on the RACE cases; then all variants are
# timed against each other with scripts/ab-builds.sh (its OP, INDICES, ROUNDS, SHAPES, BENCH_ARGS apply).
#
# Usage: scripts/verify-variants.sh DIR RESULTS
#   DIR: what build-variants.sh wrote (NAME.gz, variants.txt); RESULTS: a folder for the outputs ($OUT)
# Env:   CHECK (default sparse_bwd), RACE (`;`-separated check filters; default the three small backward cases:
#        pair d576, pair d512, solo), SKIP_CHECK=1 to time only.
# Output: RESULTS/check-NAME.json, RESULTS/racecheck.txt, RESULTS/ab.json; a summary on stdout.
set -uo pipefail
if [ $# -ne 2 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
dir="$1"
res="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$res"
bin="$(mktemp -d)"
trap 'rm -rf "$bin"' EXIT
check="${CHECK:-sparse_bwd}"
race="${RACE:-sparse_bwd/h128/d576/skv1521/topk512/sq1;sparse_bwd/h128/d512/skv1840/topk256/sq1;sparse_bwd/h64/d576/skv1592/topk384/sq1}"
cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"

names=()
while read -r name _; do
  [ -n "$name" ] || continue
  zcat "$dir/$name.gz" >"$bin/$name" && chmod +x "$bin/$name" || {
    echo "verify-variants: cannot unpack $dir/$name.gz" >&2
    exit 2
  }
  names+=("$name")
done <"$dir/variants.txt"
[ "${#names[@]}" -gt 0 ] || {
  echo "verify-variants: no variants in $dir/variants.txt" >&2
  exit 2
}

status=0
if [ "${SKIP_CHECK:-0}" != "1" ]; then
  IFS=';' read -r -a race_cases <<<"$race"
  : >"$res/racecheck.txt"
  for name in "${names[@]}"; do
    [ "$name" = "base" ] && continue
    echo "== $name: check --filter $check"
    "$bin/$name" check --filter "$check" --json "$res/check-$name.json" 2>&1 | tail -1 || status=1
    for c in "${race_cases[@]}"; do
      line="$("$cs" --tool racecheck "$bin/$name" check --filter "$c" 2>&1 |
        grep -E 'cases passed|failed|RACECHECK SUMMARY' | tr '\n' ' ')"
      echo "racecheck $name $c: $line" | tee -a "$res/racecheck.txt"
    done
  done
fi

args=()
for name in "${names[@]}"; do args+=("$name=$bin/$name"); done
echo "== timing: ${names[*]}"
"$root/scripts/ab-builds.sh" "$res/ab.json" "${args[@]}" 2>/dev/null || status=1
exit $status
