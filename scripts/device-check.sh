#!/usr/bin/env bash
# The one-shot GPU check, in two halves:
#
#   bash scripts/device-check.sh build      # here (Rust, nvcc): builds and packs what runs there
#   bash scripts/device-check.sh run [DIR]  # on the GPU machine (no Rust): runs it, results in DIR
#
# `build` compiles, with the pinned nvcc (fatbins for sm_80 and sm_90a), the GPU test executables
# (feature `cuda`) and the `memwall` command, strips them and packs them into
# target/device-check/ (xz -9, whose 64 MiB window finds the kernel images every executable
# embeds: about 10 MB where xz's default made 61 MB of the 64 MiB a device run may carry). `run` unpacks them and,
# with MEMWALL_REQUIRE_GPU=1 so a missing device fails instead of skipping:
#   1. records the device (nvidia-smi) and what the build holds (`memwall info`);
#   2. runs every GPU suite's #[ignore]d CUDA tests (tests/gpu_*.rs: every kernel against the
#      f64 reference at the CPU suites' shapes and tolerances; tests/gpu_model.rs: the parity
#      fixtures through the unchanged graph) and the host-side CUDA tests (tests/cuda_*.rs);
#   3. runs `memwall peak --backend cuda` (the SM read and copy kernels of stream.cu and the copy
#      engine over 4 GiB, against the datasheet) and `memwall run --backend cuda` on a parity
#      fixture;
#   4. runs benches/gpu/: the copy peak, then GEMV at the Llama 3.1 8B shapes (bf16, e4m3fn
#      per-channel; batch 1, and 4 and 16 rows at the gate/up matrix) and decode attention at 8192 positions (32 q / 8 kv heads x 128, bf16 paged
#      cache, batch 1, 4 and 16) as a percentage of it, and prefill GEMM (512 and 2048 rows,
#      bf16) in TFLOP/s; each against cuBLAS where it has a peer, each checked against an f64
#      host reference before it is timed;
#   5. the end-to-end decode: `memwall peak --backend cuda --json` measures the copy peak (and
#      without a device stops it there), `memwall synth` writes a Llama-3.1-8B-shaped checkpoint
#      of random bf16 weights (16 GB) on that machine (the RAM disk when it has room, else local
#      disk; never carried), `memwall run --backend cuda` decodes 256 tokens after a 16-token
#      prompt at batch 1 (decode steps replayed as CUDA graphs), and scripts/decode_wall.py puts
#      the decode tokens/s beside `memwall wall`'s wall: measured copy peak / bytes read per token
#      (src/wall); then the same decode with `--eager` (op by op), against the same wall;
#   6. prints one line per step (pass/fail, seconds), then the results: one line per kernel and
#      shape (GB/s, % of the copy peak, vs cuBLAS; GEMM in TFLOP/s, vs cuBLAS) and the decode's
#      tokens/s against its wall. Every log goes to DIR (default $OUT, else
#      target/device-check/results).
# Each step has its own time limit, and no step runs past the run's budget
# (MEMWALL_CHECK_BUDGET_S, default 510 s: a step's limit is cut to what is left, and with under
# 5 s left it is skipped), so the summary comes back inside a 540 s call. The tests (step 2)
# share at most MEMWALL_CHECK_TEST_BUDGET_S of it (default 240 s), so the measurements of steps
# 3-5 always get the rest. Expected on one H200
# (estimates: no run has happened yet): the tests 2-4 min, peak and the parity run 10 s, the
# bench 1-2 min (limit 240 s; it stops starting shapes after 200 s), the end-to-end about 1 min
# (synth 15-40 s for 16 GB, load and decode 15-40 s, peak 5 s).
#
# From a session with the device tool:
#   bash scripts/device-check.sh build
#   run(command="bash scripts/device-check.sh run", carry=["target/device-check"], timeout_s=540)
#
# `bash scripts/device-check.sh e2e BIN_DIR BACKEND SHAPE [DIR]` runs only the end-to-end steps,
# with the `memwall` of BIN_DIR on BACKEND (cpu or cuda) and SHAPE (a preset or a config.json):
# `e2e target/debug cpu tests/fixtures/configs/tiny-llama.json` tries them here (a config.json
# gets the prompt ids modulo its vocabulary).
set -euo pipefail
cd "$(dirname "$0")/.."
pack=target/device-check
suites=(gpu_stream gpu_linear gpu_qkv gpu_select gpu_attention gpu_elementwise gpu_rows experts gpu_model gpu_graphs cuda_nvrtc cuda_build)

build() {
  bash scripts/setup.sh
  export MEMWALL_REQUIRE_NVCC=1
  local features=memwall/cuda
  local args=(--locked --features "$features")
  for s in "${suites[@]}"; do args+=(--test "$s"); done
  # benches/gpu/, built by the same command (test profile: opt-level 3, as the suites).
  args+=(--bench gpu)
  # The executables cargo built, from its JSON messages (test profile, as scripts/test.sh).
  mkdir -p target
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
  XZ_OPT=-9 tar -C "$pack" -cJf "$pack/bin.tar.xz" bin && rm -rf "${pack:?}/bin"
  git rev-parse HEAD >"$pack/commit"
  ls -l "$pack"
}

# step NAME LIMIT_S CMD...: runs CMD with its output in $results/NAME.log, one summary line. The
# limit is cut to what is left of the run's budget; with under 5 s left the step is skipped.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - run_start))) over="budget ${budget}s"
  # Inside a stage (`stage`), also what is left of the stage's own share.
  if [[ -n $stage_end ]] && ((stage_end - SECONDS < left)); then
    left=$((stage_end - SECONDS)) over=$stage_what
  fi
  if ((left < 5)); then
    printf '%-28s %-24s %4ds\n' "$name" "SKIP ($over)" 0 | tee -a "$results/summary.txt"
    failed=$((failed + 1))
    return 0
  fi
  ((limit <= left)) || limit=$left
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$results/$name.log" 2>&1 || rc=$?
  local verdict=pass
  if ((rc == 124)); then
    verdict="FAIL (over ${limit}s)"
  elif ((rc != 0)); then
    verdict="FAIL (exit $rc)"
  fi
  ((rc == 0)) || failed=$((failed + 1))
  printf '%-28s %-24s %4ds\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$results/summary.txt"
  grep -E '^test result:|panicked at|^error|skipping' "$results/$name.log" | head -5 | sed 's/^/    /' | tee -a "$results/summary.txt" || true
}

# stage NAME SECONDS: the steps after it, until `stage_done`, share at most SECONDS of the budget
# (each step's limit is cut to what is left of both).
stage() {
  stage_end=$((SECONDS + $2)) stage_what="$1 ${2}s"
}
stage_done() {
  stage_end='' stage_what=''
}

# show SED_SCRIPT NAME: the lines of step NAME's log that `sed -n SED_SCRIPT` prints; nothing if
# the step was skipped (no log).
show() {
  [[ -f $results/$2.log ]] || return 0
  sed -n "$1" "$results/$2.log"
}

# checkpoint_dir NEED_GB: a writable directory with NEED_GB (decimal) free: the RAM disk when it
# has room, else the temporary directory, else target/.
checkpoint_dir() {
  local need=$(($1 * 1000000000)) d avail
  for d in /dev/shm "${TMPDIR:-/tmp}" "$PWD/target"; do
    [[ -d $d && -w $d ]] || continue
    avail=$(df -P -B1 "$d" 2>/dev/null | awk 'NR == 2 { print $4 }')
    if [[ $avail =~ ^[0-9]+$ ]] && ((avail >= need)); then
      echo "$d"
      return 0
    fi
  done
  return 1
}

# e2e BIN BACKEND SHAPE NEED_GB SYNTH_LIMIT_S: the end-to-end decode, batch 1, of a random bf16
# checkpoint of SHAPE (a preset or a config.json) on BACKEND, against its wall at the copy peak
# BACKEND measures (first: no device, nothing written); the result line goes to
# $results/results.txt. The checkpoint is removed once decoded.
e2e() {
  local bin=$1 backend=$2 shape=$3 need_gb=$4 synth_limit=$5
  # 16 prompt ids below every vocabulary the presets have (Llama 3.1's BOS first).
  local prompt=128000,791,1176,14198,39935,35308,927,279,16053,5679,13,578,4062,374,264,1296
  # A config.json of a smaller vocabulary (a test config): the same ids modulo its size.
  if [[ -f $shape ]]; then
    prompt=$(python3 -c 'import json, sys
v = json.load(open(sys.argv[1]))["vocab_size"]
print(",".join(str(int(t) % v) for t in sys.argv[2].split(",")))' "$shape" "$prompt")
  fi
  local root ckpt
  # The peak first: without the device it fails at once, and nothing is written.
  step "peak-$backend-json" 60 "$bin/memwall" peak --backend "$backend" --json
  if ! grep -qs '^\[' "$results/peak-$backend-json.log"; then
    echo "e2e: skipped: no peak measured on $backend" | tee -a "$results/summary.txt"
    return 0
  fi
  if ! root=$(checkpoint_dir "$need_gb"); then
    echo "e2e: FAIL: no directory with ${need_gb} GB free (/dev/shm, ${TMPDIR:-/tmp}, target/)" | tee -a "$results/summary.txt"
    failed=$((failed + 1))
    return 0
  fi
  ckpt=$root/memwall-e2e-$(basename "$shape" .json)-bf16
  rm -rf "$ckpt"
  step synth "$synth_limit" "$bin/memwall" synth --shape "$shape" --dtype bf16 --out "$ckpt"
  show 's/^wrote/    wrote/p' synth | tee -a "$results/summary.txt"
  step "decode-$backend" 180 "$bin/memwall" run --backend "$backend" --model "$ckpt" \
    --tokens "$prompt" --max-new-tokens 256 --kv-dtype bf16 --json
  step decode-wall 30 python3 scripts/decode_wall.py "$bin/memwall" "$results/decode-$backend.log" \
    "$results/peak-$backend-json.log" "$shape" "$results/decode-wall.json"
  show '/^decode /p' decode-wall >>"$results/results.txt"
  # The same decode op by op (--eager: no graph replay), for what the graphs save.
  step "decode-$backend-eager" 120 "$bin/memwall" run --backend "$backend" --model "$ckpt" \
    --tokens "$prompt" --max-new-tokens 256 --kv-dtype bf16 --json --eager
  rm -rf "$ckpt"
  step decode-wall-eager 30 python3 scripts/decode_wall.py "$bin/memwall" \
    "$results/decode-$backend-eager.log" "$results/peak-$backend-json.log" "$shape" \
    "$results/decode-wall-eager.json"
  show '/^decode /p' decode-wall-eager >>"$results/results.txt"
}

run() {
  start_results "${1:-${OUT:-$pack/results}}"
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
  # The tests share at most MEMWALL_CHECK_TEST_BUDGET_S (default 240 s) of the budget, so that
  # the measurements after them (peak, bench, end-to-end: 2-4 min expected)
  # always get theirs; a suite cut short fails (SKIP or over its limit) and is named.
  stage tests "${MEMWALL_CHECK_TEST_BUDGET_S:-240}"
  # The host-side CUDA tests (NVRTC needs libnvrtc there; a missing one fails, as in CI).
  step cuda_build 60 "$bin/cuda_build"
  step cuda_nvrtc 180 "$bin/cuda_nvrtc" --test-threads=2
  for s in gpu_stream gpu_elementwise gpu_rows gpu_select gpu_linear gpu_qkv gpu_attention experts gpu_model gpu_graphs; do
    step "$s" 240 "$bin/$s" --ignored --test-threads=1
  done
  stage_done
  # The SM-driven ceiling (stream.cu read and copy, 4 GiB) and the copy engine, vs the datasheet.
  step peak-cuda 60 "$bin/memwall" peak --backend cuda
  # shellcheck disable=SC2016 # sed's $, not the shell's
  show '/^kernel/,$p' peak-cuda | tee -a "$results/summary.txt"
  step run-cuda 60 "$bin/memwall" run --model tests/parity/fixtures/llama_tied_f32 --tokens 1,2,3 \
    --max-new-tokens 4 --backend cuda --json
  # GEMV, decode attention and GEMM against the copy peak of the same run and cuBLAS.
  export CRITERION_HOME=$results/criterion MEMWALL_BENCH_BUDGET_S=200
  step bench-gpu 240 "$bin/gpu" --bench
  # shellcheck disable=SC2016
  show '/^summary/,$p' bench-gpu >>"$results/results.txt"
  # The end-to-end decode of a Llama-3.1-8B-shaped checkpoint (16 GB written there).
  e2e "$bin" cuda llama-3.1-8b 18 150
  rm -rf "$work"
  finish_results
}

# start_results DIR: the results directory, the run's clock and budget.
start_results() {
  results=$1
  mkdir -p "$results"
  : >"$results/summary.txt"
  : >"$results/results.txt"
  run_start=$SECONDS
  budget=${MEMWALL_CHECK_BUDGET_S:-510}
  failed=0
  stage_done
}

# The results after the steps: each kernel and shape, then the end-to-end decode; fails (exit 1)
# if a step failed or was skipped.
finish_results() {
  {
    echo
    echo "results (GB/s and % of the copy peak measured in the same run; GEMM in TFLOP/s; a ratio"
    echo "to cuBLAS above 1 means ours is faster; decode tokens/s against the wall):"
    if [[ -s $results/results.txt ]]; then cat "$results/results.txt"; else echo "    none: see the failed steps above"; fi
    echo "total $((SECONDS - run_start)) s of a ${budget} s budget; $failed step(s) failed or skipped"
  } | tee -a "$results/summary.txt"
  ((failed == 0))
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  e2e)
    shift
    (($# >= 3)) || { echo "usage: $0 e2e BIN_DIR BACKEND SHAPE [RESULTS_DIR]" >&2; exit 2; }
    start_results "${4:-$pack/e2e-results}"
    e2e "$1" "$2" "$3" 0 60
    finish_results
    ;;
  *) echo "usage: $0 build | run [RESULTS_DIR] | e2e BIN_DIR BACKEND SHAPE [RESULTS_DIR]" >&2; exit 2 ;;
esac
