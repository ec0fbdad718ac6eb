#!/usr/bin/env bash
# Fuzzes the safetensors header parsing (model/fuzz, target checkpoint_header) with libFuzzer,
# coverage-guided, on the stable toolchain (no cargo-fuzz or nightly needed):
#   bash scripts/fuzz.sh [SECONDS]   (default 60; corpus kept in model/fuzz/corpus, ignored by git)
# The sanitizer-coverage flags go through --target so they reach the fuzzed crates, not build
# scripts.
set -euo pipefail
cd "$(dirname "$0")/../model/fuzz"
seconds=${1:-60}
triple=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks" \
  cargo build --release --target "$triple" --target-dir target/cov
mkdir -p corpus
"target/cov/$triple/release/checkpoint_header" corpus -max_total_time="$seconds" -rss_limit_mb=4096
