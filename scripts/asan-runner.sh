#!/usr/bin/env bash
# Cargo runner for the AddressSanitizer pass of scripts/test.sh: runs a test binary with gcc's ASan
# runtime preloaded. Only the C++ of the SIMT images is instrumented (MEMWALL_SIMT_ASAN=1); the
# Rust code is not, so the runtime must be loaded first, and it then also interposes malloc, which
# gives the emulated device buffers (Rust allocations) their redzones.
set -euo pipefail
lib="$("${CXX:-c++}" -print-file-name=libasan.so)"
export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
# Leak checking is off: the target is out-of-bounds access in the kernels, not Rust's
# deliberate leaks (statics) in the harness.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=0}"
exec "$@"
