#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler set (from PyPI) into .toolchain/ (git-ignored).
# Idempotent: re-running it with everything present does nothing.
# Usage: source scripts/toolchain.sh   (exports CUDA_HOME and NVCC), or bash scripts/toolchain.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.toolchain/cuda"
stamp="$dest/.installed-13.0.88"
py="${PYTHON:-python3}"
if [ ! -f "$stamp" ]; then
  echo "toolchain: installing nvcc 13.0.88 into $dest" >&2
  rm -rf "$dest"
  "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --target "$dest" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  touch "$stamp"
fi
export CUDA_HOME="$dest/nvidia/cu13"
export NVCC="$CUDA_HOME/bin/nvcc"
"$NVCC" --version | tail -n 2 >&2
