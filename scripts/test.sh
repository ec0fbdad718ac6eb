#!/usr/bin/env bash
# Sets up and runs memwall's tests: unit, proptest and CLI suites of every crate, with the kernels
# of kernels-cuda/ emulated on the CPU (feature `emulate`: the SIMT layer of simt/), then the
# emulated suites (tests/simt.rs, tests/gpu_*.rs) a second time with the kernels compiled under
# AddressSanitizer, so an out-of-bounds read or write in a kernel fails a test.
# GPU suites are #[ignore]d here; a GPU run adds `-- --ignored` with MEMWALL_REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# setup.sh installed the pinned nvcc (unless MEMWALL_NVCC=0): the fatbins must then exist.
# NVRTC, installed beside it, is loaded at run time by tests/cuda_nvrtc.rs.
if [[ "${MEMWALL_NVCC:-1}" != 0 ]]; then
  export MEMWALL_REQUIRE_NVCC=1 MEMWALL_REQUIRE_NVRTC=1
  export LD_LIBRARY_PATH="$PWD/.tools/cuda/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# `cuda` builds the CUDA backend too (cudarc, loaded at run time): its GPU suites are #[ignore]d
# here, its host-side paths (NVRTC, no-device errors) run.
features=memwall/emulate,memwall/cuda
# setup.sh installed clang 19, the HIP headers and libamdhip64 (unless MEMWALL_HIP=0): the code
# objects must then exist (tests/hip_build.rs), and `hip` builds the HIP backend (linked against
# libamdhip64): its GPU suites are #[ignore]d here, its no-device path runs.
if [[ "${MEMWALL_HIP:-1}" != 0 ]]; then
  export MEMWALL_REQUIRE_HIPCC=1
  # hip-runtime-sys looks for include/hip/hip_runtime_api.h under `hipconfig -p`, $HIP_PATH, then
  # /opt/rocm; Debian puts it under /usr (and libamdhip64 in a directory the linker searches).
  if ! command -v hipconfig >/dev/null 2>&1 && [[ ! -e /opt/rocm/include/hip/hip_runtime_api.h ]]; then
    export HIP_PATH="${HIP_PATH:-/usr}"
  fi
  features+=,memwall/hip
fi
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
# Line tables are enough for ASan reports and halve the debug info of the second build.
MEMWALL_SIMT_ASAN=1 CARGO_PROFILE_TEST_DEBUG=line-tables-only cargo test --locked -p memwall --features emulate --target-dir target/asan "${suites[@]}" "$@"
