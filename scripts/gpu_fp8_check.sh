#!/usr/bin/env bash
# FP8 weights on the device machine (issue 17, "FP8 weights (W8A8)"): their GPU tests, then
# Llama-3.1-8B (dummy weights) with bf16 and with fp8 weights quantized at load: batch-1 TPOT
# (benchmarks/decode_latency.py; target fp8 <= 0.6x bf16) and offline throughput
# (benchmarks/offline_throughput.py, 64 sequences; target fp8 >= 1.4x bf16).
# One device call, under 400 s with the default limits; everything lands under $OUT
# (default ./gpu_out):
#   env.txt                     GPU, driver, torch and triton versions
#   tests_fp8_gpu.txt           pytest tail of tests/gpu/test_fp8_linear_gpu.py
#   tests_fp8_gpu.xml           its junit XML: the measured errors (record_property), to tighten bounds
#   decode_llama_bf16.json      TPOT and roofline, bf16 weights
#   decode_llama_fp8.json       the same with --quantization fp8
#   offline_llama_bf16.json     offline throughput, bf16
#   offline_llama_fp8.json      offline throughput, fp8
#   fp8_summary.json            fp8 / bf16 ratios of TPOT (graphs) and output tok/s
#   bench.log                   the benchmarks' output tails and exit codes
# Run from the repo root:  bash scripts/gpu_fp8_check.sh [all|tests|decode|offline]
# Limits (seconds, environment): TEST_TIMEOUT 120, DECODE_TIMEOUT 75 (each), OFFLINE_TIMEOUT 60 (each).
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q tests/gpu/test_fp8_linear_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_fp8_gpu.xml" 2>&1 | tail -40 | tee "$OUT/tests_fp8_gpu.txt"
fi
if [ "$PART" = all ] || [ "$PART" = decode ]; then
  for q in none fp8; do
    tag=$([ "$q" = none ] && echo bf16 || echo fp8)
    run "decode_llama_$tag" "${DECODE_TIMEOUT:-75}" python3 benchmarks/decode_latency.py --config llama-3.1-8b \
      --steps 48 --quantization "$q" --out "$OUT/decode_llama_$tag.json"
  done
fi
if [ "$PART" = all ] || [ "$PART" = offline ]; then
  for q in none fp8; do
    tag=$([ "$q" = none ] && echo bf16 || echo fp8)
    run "offline_llama_$tag" "${OFFLINE_TIMEOUT:-60}" python3 benchmarks/offline_throughput.py --config llama-3.1-8b \
      --num-seqs 64 --max-num-seqs 64 --quantization "$q" --out "$OUT/offline_llama_$tag.json"
  done
fi
python3 - "$OUT" <<'PY' | tee "$OUT/fp8_summary.json"
import json, os, sys
d = sys.argv[1]
def load(name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None
out = {}
db, d8 = load("decode_llama_bf16.json"), load("decode_llama_fp8.json")
if db and d8:
    for mode in ("graphs", "eager"):
        if mode in db and mode in d8:
            out[f"tpot_{mode}_ms"] = {"bf16": db[mode]["tpot_ms"], "fp8": d8[mode]["tpot_ms"],
                                      "fp8_over_bf16": round(d8[mode]["tpot_ms"] / db[mode]["tpot_ms"], 3)}
    out["roofline_ms"] = {"bf16": db["roofline_ms"], "fp8": d8["roofline_ms"]}
ob, o8 = load("offline_llama_bf16.json"), load("offline_llama_fp8.json")
if ob and o8:
    out["offline_tok_per_s"] = {"bf16": ob["output_tok_per_s"], "fp8": o8["output_tok_per_s"],
                                "fp8_over_bf16": round(o8["output_tok_per_s"] / ob["output_tok_per_s"], 3)}
print(json.dumps(out, indent=1))
PY
