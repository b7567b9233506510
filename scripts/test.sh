#!/usr/bin/env bash
# The project's test command: builds everything (kernels included) and runs every CPU test: the Rust workspace,
# then the Rust examples, then the Python package (wheel built and installed in .toolchain/pyvenv, pytest on CPU
# tensors, the Python examples included).
# GPU tests are #[ignore]d / skipped here; run them on a GPU machine with scripts/gpu-suite.sh.
# Usage: scripts/test.sh [--rust-only]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --workspace --locked --release --bins
cargo test --workspace --locked
# The API docs build without a warning (broken or private intra-doc links fail here). The CLI is left out: its binary
# is also called `flashmla`, and its docs would overwrite the library's.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --exclude flashmla-cli --no-deps --locked
# The Rust examples (the Python ones run in python/tests/test_examples.py): on a GPU machine they also run on the GPU.
for example in crates/flashmla/examples/*.rs; do
  cargo run --release --locked -p flashmla --example "$(basename "$example" .rs)"
done
if [ "${1:-}" != "--rust-only" ]; then
  scripts/python-test.sh
fi
