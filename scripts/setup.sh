#!/usr/bin/env bash
# Sets up what memwall's build, tests and benches need on a fresh Debian machine that has Rust.
# Idempotent. The CUDA and HIP issues extend it (nvcc from PyPI, hipcc from Debian).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (rustup) first" >&2
  exit 1
fi
# rustfmt and clippy ship with rustup's default profile; add them if this toolchain lacks them.
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy
  fi
fi
# The emulated kernels (feature `emulate`, scripts/test.sh) need a C++20 compiler and its
# AddressSanitizer runtime; Debian's g++ brings both.
if ! command -v c++ >/dev/null 2>&1 || [[ "$(c++ -print-file-name=libasan.so)" == libasan.so ]]; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq g++
  else
    echo "setup: no C++ compiler with libasan found; install g++" >&2
    exit 1
  fi
fi
# nvcc 13.0 from PyPI (matching the GPU machine's CUDA 13.0 driver), pinned, into .tools/cuda:
# build/nvcc.rs finds it there and compiles every kernels-cuda/*.cu into fatbins (SASS for sm_80
# and sm_90a, PTX for compute_90), failing on compile errors, warnings and register spills.
# NVRTC (a host library) comes with it: the CUDA backend compiles the embedded sources with it
# when a build has no fatbins, and tests/cuda_nvrtc.rs checks that path here, without a GPU.
# cuobjdump and the nvdisasm it runs disassemble the fatbins for tests/cuda_build.rs's SASS checks;
# PyPI has them from 13.2 on only, and a newer disassembler reads 13.0's machine code.
# MEMWALL_NVCC=0 skips the install and the fatbins.
CUDA_PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-cuobjdump==13.2.78
  nvidia-cuda-nvdisasm==13.2.78
)
cu13=.tools/cuda/nvidia/cu13
if [[ "${MEMWALL_NVCC:-1}" != 0 && ! ( -x $cu13/bin/nvcc && -e $cu13/lib/libnvrtc.so.13 && -x $cu13/bin/cuobjdump \
  && -x $cu13/bin/nvdisasm ) ]]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target .tools/cuda "${CUDA_PINS[@]}"
fi
# HIP (AMD MI250 / MI300X) from Debian: clang 19 with lld and the LLVM tools (gfx942 needs clang
# 17 or newer; bookworm's hipcc 5.2 drives clang 15, so build/hip.rs calls clang-19 directly),
# the HIP headers (libamdhip64-dev) and the device libraries (rocm-device-libs). build/hip.rs
# then compiles the kernels into code objects for gfx90a and gfx942, failing on errors, warnings
# and scratch use. MEMWALL_HIP=0 skips the install and the code objects.
if [[ "${MEMWALL_HIP:-1}" != 0 ]] && ! ( [[ -x /usr/lib/llvm-19/bin/clang++ && -x /usr/lib/llvm-19/bin/ld.lld \
  && -x /usr/lib/llvm-19/bin/llvm-objdump && -e /usr/include/hip/hip_runtime.h \
  && -e /usr/lib/x86_64-linux-gnu/amdgcn/bitcode/ocml.bc ]] ); then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      clang-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs
  else
    echo "setup: no apt-get; install clang 19, lld, llvm, the HIP headers and ROCm device libs, or set MEMWALL_HIP=0" >&2
    exit 1
  fi
fi
cargo fetch --locked
