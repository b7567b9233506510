#!/usr/bin/env bash
# Builds the `flashmla` CLI at one or more revisions, for scripts/ab-builds.sh on the GPU machine. Each NAME=REV is
# checked out in a temporary git worktree (the working tree and its checkout are left alone) and built in release
# mode with every kernel required (FLASHMLA_REQUIRE_KERNELS=1, so a ptxas spill the build does not expect fails it);
# all builds share one target directory (target/build-at), so a second revision recompiles only what differs. The
# stripped binary goes to OUTDIR/fm_NAME and a gzipped copy to OUTDIR/fm_NAME.gz (what the GPU machine is sent).
#
# Usage: scripts/build-at.sh OUTDIR NAME=REV [NAME=REV ...]
#   e.g. scripts/build-at.sh .dev main=main new=exp/branch
# Then, on the GPU machine: gunzip the binaries and run scripts/ab-builds.sh OUT.json main=.dev/fm_main ...
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$1"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# shellcheck source=scripts/toolchain.sh
source "$root/scripts/toolchain.sh"
export FLASHMLA_REQUIRE_KERNELS=1
export CARGO_TARGET_DIR="$root/target/build-at"
for arg in "$@"; do
  case "$arg" in
  *=*) ;;
  *)
    echo "build-at: expected NAME=REV, got '$arg'" >&2
    exit 2
    ;;
  esac
  name="${arg%%=*}"
  rev="${arg#*=}"
  commit="$(git -C "$root" rev-parse --verify --quiet "$rev^{commit}")" || {
    echo "build-at: '$rev' names no commit" >&2
    exit 2
  }
  tree="$(mktemp -d)"
  git -C "$root" worktree add --quiet --detach "$tree" "$commit"
  # The toolchain is git-ignored: the worktree uses this checkout's.
  ln -s "$root/.toolchain" "$tree/.toolchain"
  echo "build-at: $name = $rev (${commit:0:12})" >&2
  status=0
  (cd "$tree" && cargo build --release --locked -p flashmla-cli) || status=$?
  if [ "$status" -eq 0 ]; then
    cp "$CARGO_TARGET_DIR/release/flashmla" "$out/fm_$name"
    strip "$out/fm_$name"
    gzip -c "$out/fm_$name" >"$out/fm_$name.gz"
  fi
  git -C "$root" worktree remove --force "$tree"
  if [ "$status" -ne 0 ]; then
    echo "build-at: the build of $name failed" >&2
    exit "$status"
  fi
done
ls -l "$out"/fm_* >&2
