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
cargo fetch --locked
