#!/usr/bin/env bash
# The one-shot GPU check, in two halves:
#
#   bash scripts/device-check.sh build      # here (Rust, nvcc): builds and packs what runs there
#   bash scripts/device-check.sh run [DIR]  # on the GPU machine (no Rust): runs it, results in DIR
#
# `build` compiles, with the pinned nvcc (fatbins for sm_80 and sm_90a), the GPU test executables
# (feature `cuda`) and the `memwall` command, strips them and packs them into
# target/device-check/ (xz, well under the 64 MiB a device run may carry). `run` unpacks them and,
# with MEMWALL_REQUIRE_GPU=1 so a missing device fails instead of skipping:
#   1. records the device (nvidia-smi) and what the build holds (`memwall info`);
#   2. runs every GPU suite's #[ignore]d CUDA tests (tests/gpu_*.rs: every kernel against the
#      f64 reference at the CPU suites' shapes and tolerances; tests/gpu_model.rs: the parity
#      fixtures through the unchanged graph) and the host-side CUDA tests (tests/cuda_*.rs);
#   3. runs `memwall peak --backend cuda` (the SM read and copy kernels of stream.cu and the copy
#      engine over 4 GiB, against the datasheet) and `memwall run --backend cuda` on a parity
#      fixture;
#   4. runs benches/gpu.rs: the copy peak, then GEMV at the Llama 3.1 8B shapes (bf16, e4m3fn
#      per-channel) as a percentage of it;
#   5. prints one line per step (pass/fail, seconds) and writes every log to DIR (default $OUT,
#      else target/device-check/results).
# Each step has its own time limit; the whole run fits in about 8 minutes on one H200.
#
# From a session with the device tool:
#   bash scripts/device-check.sh build
#   run(command="bash scripts/device-check.sh run", carry=["target/device-check"], timeout_s=540)
#
# Not yet here (issue 5): attention benches and the 8B-shaped end-to-end
# decode; the summary says so rather than pretending.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=target/device-check
suites=(gpu_stream gpu_linear gpu_select gpu_attention gpu_elementwise gpu_rows gpu_model cuda_nvrtc cuda_build)

build() {
  bash scripts/setup.sh
  export MEMWALL_REQUIRE_NVCC=1
  local features=memwall/cuda
  local args=(--locked --features "$features")
  for s in "${suites[@]}"; do args+=(--test "$s"); done
  # benches/gpu.rs, built by the same command (test profile: opt-level 3, as the suites).
  args+=(--bench gpu)
  # The executables cargo built, from its JSON messages (test profile, as scripts/test.sh).
  cargo test "${args[@]}" --no-run --message-format=json >target/device-check.json
  cargo build --locked --profile test --features "$features" --bin memwall
  rm -rf "$pack" && mkdir -p "$pack/bin"
  python3 - "$pack/bin" "${suites[@]}" gpu <<'EOF'
import json, shutil, sys
dest, wanted = sys.argv[1], set(sys.argv[2:])
for line in open("target/device-check.json"):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in wanted:
        shutil.copy(m["executable"], f"{dest}/{m['target']['name']}")
EOF
  cp target/debug/memwall "$pack/bin/memwall"
  strip "$pack"/bin/*
  for s in "${suites[@]}" gpu; do [[ -x "$pack/bin/$s" ]] || { echo "device-check: $s was not built" >&2; exit 1; }; done
  tar -C "$pack" -cJf "$pack/bin.tar.xz" bin && rm -rf "$pack/bin"
  git rev-parse HEAD >"$pack/commit"
  ls -l "$pack"
}

# step NAME LIMIT_S CMD...: runs CMD with its output in $results/NAME.log, one summary line.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$results/$name.log" 2>&1 || rc=$?
  local verdict=pass
  if ((rc == 124)); then
    verdict="FAIL (over ${limit}s)"
  elif ((rc != 0)); then
    verdict="FAIL (exit $rc)"
  fi
  printf '%-28s %-24s %4ds\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$results/summary.txt"
  grep -E '^test result:|panicked at|^error' "$results/$name.log" | head -5 | sed 's/^/    /' | tee -a "$results/summary.txt" || true
}

run() {
  results=${1:-${OUT:-$pack/results}}
  mkdir -p "$results"
  : >"$results/summary.txt"
  local work
  work=$(mktemp -d)
  tar -C "$work" -xJf "$pack/bin.tar.xz"
  local bin=$work/bin
  export MEMWALL_REQUIRE_GPU=1 MEMWALL_FIXTURES=$PWD/tests/parity/fixtures
  # CUDA libraries shipped in Python packages (PyTorch's cuBLAS and NVRTC), when the system has
  # none on the loader path: the bench's cuBLAS peer and the NVRTC test load them at run time.
  local nv
  if nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null); then
    for d in "$nv"/*/lib; do [[ -d $d ]] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; done
    export LD_LIBRARY_PATH
  fi
  echo "memwall device check of $(cat "$pack/commit" 2>/dev/null || echo '?') on $(hostname), $(date -u +%FT%TZ)" | tee -a "$results/summary.txt"
  step nvidia-smi 30 nvidia-smi -q
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader 2>/dev/null | tee -a "$results/summary.txt" || true
  step memwall-info 30 "$bin/memwall" info
  # The host-side CUDA tests (NVRTC needs libnvrtc there; a missing one fails, as in CI).
  step cuda_build 60 "$bin/cuda_build"
  step cuda_nvrtc 180 "$bin/cuda_nvrtc" --test-threads=2
  for s in gpu_stream gpu_elementwise gpu_rows gpu_select gpu_linear gpu_attention gpu_model; do
    step "$s" 240 "$bin/$s" --ignored --test-threads=1
  done
  # The SM-driven ceiling (stream.cu read and copy, 4 GiB) and the copy engine, vs the datasheet.
  step peak-cuda 60 "$bin/memwall" peak --backend cuda
  sed -n '/^kernel/,$p' "$results/peak-cuda.log" | tee -a "$results/summary.txt"
  step run-cuda 60 "$bin/memwall" run --model tests/parity/fixtures/llama_tied_f32 --tokens 1,2,3 \
    --max-new-tokens 4 --backend cuda --json
  # GEMV at the Llama 3.1 8B shapes against the copy peak of the same run; its closing lines.
  export CRITERION_HOME=$results/criterion
  step bench-gpu 240 "$bin/gpu" --bench
  sed -n '/^summary/,$p' "$results/bench-gpu.log" | tee -a "$results/summary.txt"
  echo "not run yet: attention benches, the 8B-shaped end-to-end decode (issue 5)" | tee -a "$results/summary.txt"
  rm -rf "$work"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run [RESULTS_DIR]" >&2; exit 2 ;;
esac
