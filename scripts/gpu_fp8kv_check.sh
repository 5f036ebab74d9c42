#!/usr/bin/env bash
# The fp8_e4m3 KV cache on the device machine (issue 17, "KV cache dtypes"): its GPU tests,
# then decode attention with bf16 against fp8 KV (benchmarks/kv_quant_attention.py: contexts
# 8K and 32K, batch 1 and 64, Llama-3.1-8B's attention shape; target bf16 / fp8 >= 1.6x at
# 32K) and the KV capacity in tokens. One device call, well under 300 s with the default
# limits (tests 140 s, benchmark 100 s: 240 s at most); everything lands under $OUT (default ./gpu_out):
#   env.txt                   GPU, driver, torch and triton versions, the commit
#   tests_fp8kv_gpu.txt       pytest tail of tests/gpu/test_fp8_kv_gpu.py
#   tests_fp8kv_gpu.xml       its junit XML: the measured errors (record_property), to tighten bounds
#   tests_int8kv_gpu.txt/.xml the same for tests/gpu/test_int8_kv_gpu.py (the int8 KV kernels; up to
#                             TEST_TIMEOUT more seconds)
#   kv_quant_attention.json   the benchmark's figures (us per call, GB/s, ratios, capacity)
#   bench.log                 the benchmark's output tail and exit code
# Part `sweep` (a call of its own, not in `all`): the same benchmark with --variants, bf16 and
# every fp8 variant of the two decode kernels (dot format x key tiles) in one run, and the best
# variant per kernel and launch class, for kernels' DECODE_FP8_DEFAULTS / ROPE_DECODE_FP8_DEFAULTS:
#   variants/kv_quant_attention.json, sweep.log
# Run from the repo root:  bash scripts/gpu_fp8kv_check.sh [all|tests|bench|sweep]
# Limits (seconds, environment): TEST_TIMEOUT 140, BENCH_TIMEOUT 100, SWEEP_TIMEOUT 200.
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${TEST_TIMEOUT:-140}" python3 -m pytest -q tests/gpu/test_fp8_kv_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_fp8kv_gpu.xml" 2>&1 | tail -40 | tee "$OUT/tests_fp8kv_gpu.txt"
  # the int8 KV kernels (per-token scales): all 18 passed on an H100 (2026-12-07)
  timeout "${TEST_TIMEOUT:-140}" python3 -m pytest -q tests/gpu/test_int8_kv_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_int8kv_gpu.xml" 2>&1 | tail -40 | tee "$OUT/tests_int8kv_gpu.txt"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-100}" python3 benchmarks/kv_quant_attention.py --out "$OUT" >"$OUT/.bench.log" 2>&1
  rc=$?
  { echo "== kv_quant_attention: rc=$rc (124: timeout) in $(( $(date +%s) - t0 )) s"; tail -30 "$OUT/.bench.log"; } \
    | tee -a "$OUT/bench.log"
  rm -f "$OUT/.bench.log"
fi
if [ "$PART" = sweep ]; then
  t0=$(date +%s)
  timeout "${SWEEP_TIMEOUT:-200}" python3 benchmarks/kv_quant_attention.py --variants --out "$OUT/variants" \
    >"$OUT/.sweep.log" 2>&1
  rc=$?
  { echo "== kv_quant_attention --variants: rc=$rc (124: timeout) in $(( $(date +%s) - t0 )) s"; \
    grep -v '^ ' "$OUT/.sweep.log" | tail -12; } | tee -a "$OUT/sweep.log"
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])).get('best'), indent=1))" \
    "$OUT/variants/kv_quant_attention.json" 2>&1 | tee -a "$OUT/sweep.log"
  rm -f "$OUT/.sweep.log"
fi
