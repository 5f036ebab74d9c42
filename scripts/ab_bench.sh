#!/usr/bin/env bash
# A/B benchmarks on the GPU machine: the same benchmarks on two source trees, interleaved
# (A, B, A, B, ...) in one call, so that both see the same machine. Results land in $OUT as
# one tarball of the JSON files (results.tgz), one log and one summary (summary.json).
#
#   bash scripts/ab_bench.sh A_DIR B_DIR PART [REPS]
#
# A_DIR, B_DIR: repo trees (e.g. `git archive <commit> | tar -x -C .before`, and `.`).
# PART: decode (decode_latency.py, Qwen3-0.6B and Llama-3.1-8B shapes), throughput
#   (offline_throughput.py, serve_bench.py at 256 concurrent), or all. REPS: rounds (default 2).
# Uses the system python3; carried wheels in .whl/ go to /tmp/site (see the device notes).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); PART=${3:-all}; REPS=${4:-2}
OUT=${OUT:-ab_out}; mkdir -p "$OUT/json"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
LOG=$OUT/ab.log
run() {  # run TAG DIR NAME TIMEOUT SCRIPT ARGS...
  local tag=$1 dir=$2 name=$3 limit=$4; shift 4
  local t0; t0=$(date +%s)
  (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout "$limit" python3 "$@" --out "$OUT/json/${name}_${tag}.json") \
    >"$OUT/json/${name}_${tag}.log" 2>&1
  echo "$name $tag rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  tail -4 "$OUT/json/${name}_${tag}.log" >>"$LOG"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$LOG"
for r in $(seq 1 "$REPS"); do
  for side in A B; do
    dir=$A; [ $side = B ] && dir=$B
    if [ "$PART" = decode ] || [ "$PART" = all ]; then
      run "$side$r" "$dir" decode_qwen 150 benchmarks/decode_latency.py --steps 128
      run "$side$r" "$dir" decode_llama 150 benchmarks/decode_latency.py --config llama-3.1-8b --steps 64
    fi
    if [ "$PART" = throughput ] || [ "$PART" = all ]; then
      run "$side$r" "$dir" offline 200 benchmarks/offline_throughput.py
      run "$side$r" "$dir" serve256 300 benchmarks/serve_bench.py --concurrency 256 --no-offline
    fi
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.json"
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for p in sorted(glob.glob(os.path.join(out, "json", "*.json"))):
    name, tag = os.path.basename(p)[:-5].rsplit("_", 1)
    r = json.load(open(p))
    if "levels" in r:
        v = {"out_tok_s": r["levels"][0]["output_tok_per_s"], "errors": r["levels"][0]["errors"],
             "tpot_p50_ms": r["levels"][0]["tpot_ms"]["p50"]}
    else:
        v = {k: r[k] for k in ("output_tok_per_s", "seconds", "roofline_ms", "graphs", "tpot_ms")
             if k in r}
    rows.setdefault(name, {})[tag] = v
print(json.dumps(rows, indent=1))
PY
tar czf "$OUT/results.tgz" -C "$OUT" json && rm -rf "$OUT/json"
