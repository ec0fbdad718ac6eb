#!/usr/bin/env bash
# Sets up and runs memwall's tests: unit, proptest and CLI suites of every crate.
# GPU suites are #[ignore]d here; a GPU run adds `-- --ignored` with MEMWALL_REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace --locked "$@"
