"""The end-to-end decode against its memory wall, for scripts/device-check.sh (python3, no packages).

    python3 scripts/decode_wall.py MEMWALL RUN_LOG PEAK_LOG SHAPE OUT_JSON

RUN_LOG holds the JSON line of `memwall run --json`, PEAK_LOG the JSON array of `memwall peak
--json` (CUDA or CPU). The wall is `memwall wall`'s, for SHAPE (preset or config.json) in bf16 at
batch 1, at the mean context of the decode steps, with the bandwidth the highest copy figure of
the peak (SM copy or copy engine, bytes read + written): its bytes per token come from src/wall.
Prints one line, `decode <model> bf16 batch 1 context <L> on <backend>, <graphs or op by op>:
<tok/s> tok/s = <pct>% of the wall <wall> tok/s (...)`, and writes the inputs and the wall's row to OUT_JSON.
"""

import json
import subprocess
import sys


def last_json(path, start):
    with open(path) as f:
        lines = [line for line in f if line.startswith(start)]
    if not lines:
        sys.exit(f"{path}: no JSON line starting with {start!r}")
    return json.loads(lines[-1])


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    memwall, run_log, peak_log, shape, out = sys.argv[1:]
    run = last_json(run_log, "{")
    peak = last_json(peak_log, "[")
    timing = run["timing"]
    tok_s = timing["decode_tokens_per_s"]
    if not tok_s > 0:
        sys.exit(f"{run_log}: no decode rate ({timing})")
    # Decode step i (1..N) runs with the prompt and i - 1 generated tokens in the cache.
    context = len(run["prompt_tokens"]) + timing["decode_tokens"] // 2
    copy = max(r["gb_per_s"] for r in peak if r["kernel"] in ("copy", "copy-engine"))
    read = max((r["gb_per_s"] for r in peak if r["kernel"] == "read"), default=float("nan"))
    wall_cmd = [memwall, "wall", "--model", shape, "--dtype", "bf16", "--bandwidth-gbs", f"{copy}",
                "--achieved-tok-s", f"{tok_s}", "--context", f"{context}", "--json"]
    rows = json.loads(subprocess.run(wall_cmd, check=True, capture_output=True, text=True).stdout)
    row = next(r for r in rows if r["device_source"] == "measured")
    gb = row["bytes_per_token"] / 1e9
    graphs = run.get("graphs", {})
    how = (f"{graphs.get('replayed_steps', 0)} of {timing['decode_steps']} steps replayed as graphs"
           if graphs.get("enabled") else "op by op (--eager)")
    print(
        f"decode {row['model']} bf16 batch 1 context {context} on {run['backend']}, {how}: {tok_s:.1f} tok/s = "
        f"{100 * row['achieved_fraction_of_wall']:.1f}% of the wall {row['wall_tokens_per_s']:.1f} tok/s "
        f"(measured copy peak {copy:.1f} GB/s / {gb:.3f} GB read per token; {100 * tok_s * gb / read:.1f}% "
        f"of the read peak {read:.1f} GB/s; {timing['decode_tokens']} tokens in {timing['decode_s']:.2f} s, "
        f"load {timing['load_s']:.1f} s)"
    )
    with open(out, "w") as f:
        json.dump({"run": run, "peak": peak, "context": context, "wall": row}, f, indent=1)


if __name__ == "__main__":
    main()
