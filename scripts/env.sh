# Sourced by scripts/test.sh and scripts/lint.sh after scripts/setup.sh: the environment and the
# cargo features (`$features`) of a build with every backend the setup installed.
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
