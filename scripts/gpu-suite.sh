#!/usr/bin/env bash
# The GPU suite, on a machine with an sm_90 GPU: info, the full correctness check, then the standard benchmarks twice:
# at full clock (`--timing full-clock`: blocks too short to reach the board's power cap) and at the cap
# (`--timing sustained`: what long runs such as training get).
# Uses a prebuilt binary when given (FLASHMLA_BIN), else builds one (needs Rust + scripts/toolchain.sh).
# Results: $RESULTS_DIR (default bench/results)/check-<date>-<commit>.json, bench-fullclock-<date>-<commit>.json and
# bench-sustained-<date>-<commit>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${FLASHMLA_BIN:-}"
if [ -z "$bin" ]; then
  source scripts/toolchain.sh
  FLASHMLA_REQUIRE_KERNELS=1 cargo build --release --locked -p flashmla-cli
  bin=target/release/flashmla
fi
dir="${RESULTS_DIR:-bench/results}"
mkdir -p "$dir"
# `flashmla --version` prints "flashmla 0.1.0 (commit <hash>)": name the files by the binary's own commit.
commit="$("$bin" --version | sed -n 's/.*(commit \(.*\))/\1/p')"
stamp="$(date -u +%Y-%m-%d)"
"$bin" info
status=0
"$bin" check --suite "${SUITE:-full}" --json "$dir/check-$stamp-$commit.json" || status=$?
"$bin" bench --suite standard --timing full-clock --json "$dir/bench-fullclock-$stamp-$commit.json" ${BENCH_ARGS:-} ||
  status=$?
"$bin" bench --suite standard --timing sustained --json "$dir/bench-sustained-$stamp-$commit.json" ${BENCH_ARGS:-} ||
  status=$?
exit $status
