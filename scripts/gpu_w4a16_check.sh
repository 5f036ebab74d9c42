#!/usr/bin/env bash
# 4-bit weights (W4A16) on the device machine (issue 17, "4-bit weights (W4A16)"): their GPU
# tests, the decode kernels' launch-config sweep on Llama-3.1-8B's shapes against bf16
# (benchmarks/w4a16_sweep.py), then Llama-3.1-8B (dummy weights) with bf16 and with random
# packed AWQ weights (group 128): batch-1 TPOT (benchmarks/decode_latency.py; target awq <=
# 0.4x bf16), with the kernels' heuristic configs and (decode_tuned) with the sweep's best.
# Parts: all = tests + sweep + decode (~300 s with the default limits); full = all +
# decode_tuned (~360 s); or one of tests | sweep | decode | decode_tuned (decode_tuned reads
# $OUT/w4a16_sweep.json). Everything lands under $OUT (default ./gpu_out):
#   env.txt                     GPU, driver, torch and triton versions
#   tests_w4a16_gpu.txt         pytest tail of tests/gpu/test_w4a16_gpu.py
#   tests_w4a16_gpu.xml         its junit XML: the measured errors (record_property), to tighten bounds
#   w4a16_sweep.json            per shape and M: bf16 and every W4A16 variant's us, GB/s, w4 / bf16,
#                               error; the best config per shape ("plans"), one layer's sums
#   decode_llama_bf16.json      TPOT and roofline, bf16 weights
#   decode_llama_awq.json       the same with --quantization awq (heuristic configs)
#   decode_llama_awq_tuned.json the same with the sweep's plans (--w4-plans)
#   w4a16_summary.json          awq / bf16 ratio of TPOT (graphs, eager), the rooflines, the sweep's layer sums
#   bench.log                   the benchmarks' output tails and exit codes
# Run from the repo root:  bash scripts/gpu_w4a16_check.sh [all|full|tests|sweep|decode|decode_tuned]
# Limits (seconds, environment): TEST_TIMEOUT 150, SWEEP_TIMEOUT 110 (SWEEP_BUDGET 80: the sweep
# stops adding variants then), DECODE_TIMEOUT 70 (each).
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
in_part() {  # in_part NAME: whether this call runs part NAME
  case "$PART" in
    all) [ "$1" != decode_tuned ] ;;
    full) true ;;
    *) [ "$PART" = "$1" ] ;;
  esac
}
if in_part tests; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q tests/gpu/test_w4a16_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_w4a16_gpu.xml" 2>&1 | tail -40 | tee "$OUT/tests_w4a16_gpu.txt"
fi
if in_part sweep; then
  run w4a16_sweep "${SWEEP_TIMEOUT:-110}" python3 benchmarks/w4a16_sweep.py --budget-s "${SWEEP_BUDGET:-80}" \
    --out "$OUT/w4a16_sweep.json"
fi
if in_part decode; then
  for q in none awq; do
    tag=$([ "$q" = none ] && echo bf16 || echo awq)
    run "decode_llama_$tag" "${DECODE_TIMEOUT:-70}" python3 benchmarks/decode_latency.py --config llama-3.1-8b \
      --steps 48 --quantization "$q" --out "$OUT/decode_llama_$tag.json"
  done
fi
if in_part decode_tuned && [ -f "$OUT/w4a16_sweep.json" ]; then
  run decode_llama_awq_tuned "${DECODE_TIMEOUT:-70}" python3 benchmarks/decode_latency.py --config llama-3.1-8b \
    --steps 48 --quantization awq --w4-plans "$OUT/w4a16_sweep.json" --out "$OUT/decode_llama_awq_tuned.json"
fi
python3 - "$OUT" <<'PY' | tee "$OUT/w4a16_summary.json"
import json, os, sys
d = sys.argv[1]
def load(name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None
out = {}
db, d4, dt = load("decode_llama_bf16.json"), load("decode_llama_awq.json"), load("decode_llama_awq_tuned.json")
if db and d4:
    for mode in ("graphs", "eager"):
        if mode in db and mode in d4:
            out[f"tpot_{mode}_ms"] = {"bf16": db[mode]["tpot_ms"], "awq": d4[mode]["tpot_ms"],
                                      "awq_over_bf16": round(d4[mode]["tpot_ms"] / db[mode]["tpot_ms"], 3),
                                      "target_awq_over_bf16": 0.4}
            if dt and mode in dt:
                out[f"tpot_{mode}_ms"].update(awq_tuned=dt[mode]["tpot_ms"],
                                              awq_tuned_over_bf16=round(dt[mode]["tpot_ms"] / db[mode]["tpot_ms"], 3))
    out["roofline_ms"] = {"bf16": db["roofline_ms"], "awq": d4["roofline_ms"]}
    out["weight_bytes_held"] = {"bf16": db["runner"]["weight_bytes_held"], "awq": d4["runner"]["weight_bytes_held"]}
sw = load("w4a16_sweep.json")
if sw:
    out["sweep_layer_us"] = sw.get("layer_us")
    out["sweep_best"] = {f"{name}_{m}": {k: r[m].get(k) for k in ("bf16_us", "default_us", "best", "best_us",
                                                                  "best_w4_over_bf16")}
                         for name, r in sw["shapes"].items() for m in r if m.startswith("m")}
print(json.dumps(out, indent=1))
PY
