#!/usr/bin/env bash
# Builds the flashmla CLI once per variant of the working tree, for timing them against each other on the GPU
# machine (scripts/verify-variants.sh runs there). A variant is the tree with some patches applied (e.g. the
# prepared experiments in docs/experiments/); `base` is the tree as it is.
#
# Usage: scripts/build-variants.sh OUTDIR NAME=spec [NAME=spec ...]
#   spec: `-` for the tree as it is, or PATCH[+PATCH...] (paths relative to the repository root)
#   e.g. scripts/build-variants.sh target/exp base=- pe=docs/experiments/a.patch both=docs/experiments/a.patch+b.patch
# Output: OUTDIR/NAME.gz (stripped release binary, gzipped: carry OUTDIR to the GPU machine), OUTDIR/variants.txt.
# The patched files must have no uncommitted changes; every patch is reverted after its build, also on failure.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$1"
shift
mkdir -p "$out"
cd "$root"
# shellcheck disable=SC1091
source scripts/toolchain.sh >/dev/null 2>&1
export FLASHMLA_REQUIRE_KERNELS=1

applied=()
revert() {
  local i
  for ((i = ${#applied[@]} - 1; i >= 0; i--)); do
    git apply -R "${applied[$i]}" || echo "build-variants: could not revert ${applied[$i]}" >&2
  done
  applied=()
}
trap revert EXIT

: >"$out/variants.txt"
for arg in "$@"; do
  case "$arg" in
  *=*) ;;
  *)
    echo "build-variants: expected NAME=spec, got '$arg'" >&2
    exit 2
    ;;
  esac
  name="${arg%%=*}"
  spec="${arg#*=}"
  if [ "$spec" != "-" ]; then
    IFS='+' read -r -a patches <<<"$spec"
    for p in "${patches[@]}"; do
      git apply --check "$p" || {
        echo "build-variants: $p does not apply (variant $name)" >&2
        exit 1
      }
      git apply "$p"
      applied+=("$p")
    done
  fi
  echo "build-variants: building $name ($spec)" >&2
  cargo build --release --locked -p flashmla-cli 2>&1 | grep -E "^error|panicked" >&2 || true
  # A failed build leaves the previous binary in place: fail instead of copying it.
  cargo build --release --locked -p flashmla-cli >/dev/null 2>&1 || {
    echo "build-variants: the build of $name failed" >&2
    exit 1
  }
  # The kernels' spills and wgmma notes, from the full ptxas report of the newest kernel build.
  report="$(ls -t target/release/build/flashmla-kernels-*/out/ptxas-report.txt 2>/dev/null | head -n 1)"
  [ -n "$report" ] && grep -E "spill|C75" "$report" >&2 || true
  cp target/release/flashmla "$out/$name"
  strip "$out/$name"
  gzip -f "$out/$name"
  echo "$name $spec" >>"$out/variants.txt"
  revert
done
echo "build-variants: wrote $(wc -l <"$out/variants.txt") variants to $out" >&2
