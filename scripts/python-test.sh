#!/usr/bin/env bash
# Builds the Python wheel (abi3, CPython 3.9+, cubins embedded), installs it into a virtual environment under
# .toolchain/pyvenv (git-ignored; created once, with torch, maturin and pytest from PyPI) and runs the Python tests
# (python/tests) on the CPU; test_gpu.py skips itself without a GPU.
#
# Usage: scripts/python-test.sh [pytest args...]
#        scripts/python-test.sh --bundle   # also put pytest's wheels into .whl/ for a GPU machine without network
# Env:   PYTHON (default python3) creates the venv; FLASHMLA_SKIP_INDUCTOR=1 skips the inductor compile test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Versions: torch as on the GPU machine (its import needs the CUDA runtime wheels it depends on, ~4.5 GB, ~2 min;
# `--no-deps` does not import); maturin >= 1.9.4 builds PyO3 0.30 extension modules without the deprecated feature.
TORCH_VERSION=2.11.0
MATURIN_VERSION=1.16.0
PYTEST_VERSION=9.2.0
NUMPY_VERSION=2.4.6

bundle=0
if [ "${1:-}" = "--bundle" ]; then
  bundle=1
  shift
fi

source scripts/toolchain.sh       # nvcc: the wheel embeds the cubins
export FLASHMLA_REQUIRE_KERNELS=1 # a missing nvcc or a kernel that fails to compile fails the build

venv="$root/.toolchain/pyvenv"
stamp="$venv/.installed-torch-$TORCH_VERSION-maturin-$MATURIN_VERSION-pytest-$PYTEST_VERSION"
if [ ! -f "$stamp" ]; then
  echo "python-test: creating $venv (torch $TORCH_VERSION, maturin $MATURIN_VERSION, pytest $PYTEST_VERSION)" >&2
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    "torch==$TORCH_VERSION" "maturin==$MATURIN_VERSION" "pytest==$PYTEST_VERSION" "numpy==$NUMPY_VERSION"
  touch "$stamp"
fi
py="$venv/bin/python"

echo "== build the wheel" >&2
rm -f .whl/flashmla-*.whl
"$venv/bin/maturin" build --release --locked --out .whl
wheel="$(ls .whl/flashmla-*.whl)"
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"

if [ "$bundle" = 1 ]; then
  "$py" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
    --dest .whl "pytest==$PYTEST_VERSION"
  echo "python-test: .whl/ holds the wheel and pytest for the GPU machine:" >&2
  ls .whl >&2
fi

echo "== pytest (installed wheel, CPU)" >&2
# Run from python/tests' parent with the installed package: the source tree's python/ is not on sys.path.
FLASHMLA_TEST_INSTALLED=1 FLASHMLA_EXPECT_KERNELS=1 "$py" -m pytest -q -rs "$@"
