#!/usr/bin/env bash
# Formatting and lints: `cargo fmt --check`, then clippy over every crate and target with the
# features scripts/test.sh builds (emulate, cuda, hip: the backends' code is linted too).
# MEMWALL_CHECK_ONLY=1 keeps the build script from compiling kernels a second time (nvcc, clang,
# the SIMT images): clippy only type-checks, and test.sh's build made and tested the images.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cargo fmt --all --check
MEMWALL_CHECK_ONLY=1 cargo clippy --workspace --all-targets --locked --features "$features" -- -D warnings
