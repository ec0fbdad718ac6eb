#!/usr/bin/env bash
# Sets up and runs memwall's main job: the criterion benches (on the CPU where no GPU exists),
# ending with one line per kernel: achieved GB/s and its share of the memory ceiling measured in
# the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo bench --workspace --locked "$@"
