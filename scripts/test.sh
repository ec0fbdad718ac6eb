#!/usr/bin/env bash
# Sets up and runs memwall's tests: unit, proptest and CLI suites of every crate, with the kernels
# of kernels-cuda/ emulated on the CPU (feature `emulate`: the SIMT layer of simt/), then the
# emulated suites (tests/simt.rs, tests/gpu_*.rs) a second time with the kernels compiled under
# AddressSanitizer, so an out-of-bounds read or write in a kernel fails a test.
# GPU suites are #[ignore]d here; a GPU run adds `-- --ignored` with MEMWALL_REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cargo test --workspace --locked --features "$features" "$@"

# The ASan pass: its own target dir (the instrumented images would otherwise replace the plain
# ones and force a rebuild on every switch), test binaries run through scripts/asan-runner.sh.
suites=()
for f in tests/simt.rs tests/gpu_*.rs; do
  [[ -e "$f" ]] && suites+=(--test "$(basename "$f" .rs)")
done
host="$(rustc -vV | sed -n 's/^host: //p')"
runner_var="CARGO_TARGET_$(echo "$host" | tr 'a-z-' 'A-Z_')_RUNNER"
export "$runner_var=$PWD/scripts/asan-runner.sh"
MEMWALL_SIMT_ASAN=1 cargo test --locked -p memwall --features emulate --target-dir target/asan "${suites[@]}" "$@"
