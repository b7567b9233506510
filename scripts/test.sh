#!/usr/bin/env bash
# The project's test command: builds everything (kernels included) and runs every CPU test: the Rust workspace,
# then the Python package (wheel built and installed in .toolchain/pyvenv, pytest on CPU tensors).
# GPU tests are #[ignore]d / skipped here; run them on a GPU machine with scripts/gpu-suite.sh.
# Usage: scripts/test.sh [--rust-only]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --workspace --locked --release --bins
cargo test --workspace --locked
if [ "${1:-}" != "--rust-only" ]; then
  scripts/python-test.sh
fi
