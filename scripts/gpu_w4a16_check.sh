#!/usr/bin/env bash
# 4-bit weights (W4A16) on the device machine (issue 17, "4-bit weights (W4A16)"): their GPU
# tests, then Llama-3.1-8B (dummy weights) with bf16 and with random packed AWQ weights (group
# 128): batch-1 TPOT (benchmarks/decode_latency.py; target awq <= 0.4x bf16).
# One device call, under 260 s with the default limits; everything lands under $OUT
# (default ./gpu_out):
#   env.txt                     GPU, driver, torch and triton versions
#   tests_w4a16_gpu.txt         pytest tail of tests/gpu/test_w4a16_gpu.py
#   tests_w4a16_gpu.xml         its junit XML: the measured errors (record_property), to tighten bounds
#   decode_llama_bf16.json      TPOT and roofline, bf16 weights
#   decode_llama_awq.json       the same with --quantization awq
#   w4a16_summary.json          awq / bf16 ratio of TPOT (graphs, eager) and the rooflines
#   bench.log                   the benchmarks' output tails and exit codes
# Run from the repo root:  bash scripts/gpu_w4a16_check.sh [all|tests|decode]
# Limits (seconds, environment): TEST_TIMEOUT 120, DECODE_TIMEOUT 70 (each).
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q tests/gpu/test_w4a16_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_w4a16_gpu.xml" 2>&1 | tail -40 | tee "$OUT/tests_w4a16_gpu.txt"
fi
if [ "$PART" = all ] || [ "$PART" = decode ]; then
  for q in none awq; do
    tag=$([ "$q" = none ] && echo bf16 || echo awq)
    run "decode_llama_$tag" "${DECODE_TIMEOUT:-70}" python3 benchmarks/decode_latency.py --config llama-3.1-8b \
      --steps 48 --quantization "$q" --out "$OUT/decode_llama_$tag.json"
  done
fi
python3 - "$OUT" <<'PY' | tee "$OUT/w4a16_summary.json"
import json, os, sys
d = sys.argv[1]
def load(name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None
out = {}
db, d4 = load("decode_llama_bf16.json"), load("decode_llama_awq.json")
if db and d4:
    for mode in ("graphs", "eager"):
        if mode in db and mode in d4:
            out[f"tpot_{mode}_ms"] = {"bf16": db[mode]["tpot_ms"], "awq": d4[mode]["tpot_ms"],
                                      "awq_over_bf16": round(d4[mode]["tpot_ms"] / db[mode]["tpot_ms"], 3),
                                      "target_awq_over_bf16": 0.4}
    out["roofline_ms"] = {"bf16": db["roofline_ms"], "awq": d4["roofline_ms"]}
    out["weight_bytes_held"] = {"bf16": db["runner"]["weight_bytes_held"], "awq": d4["runner"]["weight_bytes_held"]}
print(json.dumps(out, indent=1))
PY
