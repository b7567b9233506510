#!/usr/bin/env bash
# The project's test command: builds everything (kernels included when nvcc is available) and runs every
# CPU test. GPU tests are #[ignore]d here; run them on a GPU machine with scripts/gpu-suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --workspace --locked --release --bins
cargo test --workspace --locked
