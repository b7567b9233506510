#!/usr/bin/env bash
# Builds the peer (FlashMLA, Hopper kernels only) in place on the GPU machine, for bench/side_by_side.py.
#
# Usage: scripts/build-peer.sh [PEER_DIR]     (default: .peer at the repository root)
#
# PEER_DIR holds FlashMLA's source with CUTLASS's headers under csrc/cutlass (include/ and tools/util/include/);
# bench/README.md says how to bring it there. The build (~2 min on 16 cores) leaves flash_mla/cuda*.so
# inside PEER_DIR and a stamp beside it; a second run skips the build while the stamp is newer than the peer's
# own sources. Then: `python3 bench/side_by_side.py --peer PEER_DIR ...`.
# Env: MAX_JOBS (default 16) parallel compile jobs; PYTHON (default python3), the Python whose torch builds it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${1:-$root/.peer}"
if [ ! -d "$peer" ]; then
  echo "build-peer: no folder $peer (bring the peer's source there first; see bench/README.md)" >&2
  exit 2
fi
peer="$(cd "$peer" && pwd)"
stamp="$peer/.build-peer-stamp"

if [ ! -f "$peer/setup.py" ] || [ ! -d "$peer/flash_mla" ]; then
  echo "build-peer: $peer does not hold FlashMLA's source (setup.py, flash_mla/)" >&2
  exit 2
fi
if [ ! -f "$peer/csrc/cutlass/include/cutlass/cutlass.h" ]; then
  echo "build-peer: CUTLASS headers missing: expected $peer/csrc/cutlass/include/cutlass/cutlass.h" >&2
  exit 2
fi

built() {
  compgen -G "$peer/flash_mla/cuda*.so" >/dev/null
}

# The stamp is stale when any of the peer's own sources (CUTLASS excluded) changed after it.
stale_source() {
  find "$peer/setup.py" "$peer/flash_mla" "$peer/csrc" -path "$peer/csrc/cutlass" -prune -o \
    -type f ! -name '*.so' -newer "$stamp" -print -quit
}

if [ -f "$stamp" ] && built && [ -z "$(stale_source)" ]; then
  echo "build-peer: already built ($(basename "$(compgen -G "$peer/flash_mla/cuda*.so" | head -n 1)")); skipping" >&2
  exit 0
fi

echo "build-peer: building FlashMLA (sm_90a only) in $peer" >&2
start=$(date +%s)
(
  cd "$peer"
  CPLUS_INCLUDE_PATH="/usr/local/cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    FLASH_MLA_DISABLE_SM100=1 MAX_JOBS="${MAX_JOBS:-16}" \
    "${PYTHON:-python3}" setup.py build_ext --inplace
)
if ! built; then
  echo "build-peer: the build finished but left no flash_mla/cuda*.so in $peer" >&2
  exit 1
fi
touch "$stamp"
echo "build-peer: built in $(( $(date +%s) - start )) s" >&2
