#!/usr/bin/env bash
# Batch-1 decode with quantized weights on the device machine (issue 17: Llama-3.1-8B batch-1
# TPOT, FP8 weights <= 0.6x bf16, W4A16 <= 0.4x bf16): the FP8-linear and W4A16 GPU tests, the
# one-row launch sweeps at M = 1 on Llama-3.1-8B's shapes (benchmarks/qgemv_sweep.py for FP8,
# benchmarks/w4a16_sweep.py --ms 1 for W4A16: JSON with the plan each would pick), then
# Llama-3.1-8B (dummy weights) batch-1 TPOT (benchmarks/decode_latency.py): bf16, then fp8 and awq
# each as an A/B in one process (--ab, graphs recaptured per variant): q_old (the FP8 legacy
# one-row kernel, unfused layers, heuristic plans, W4A16 split sums 8 partials a load), q_unfused
# (the new kernels and the sweeps' plans, layers unfused), q_new (the same with FP8 layers on the
# fused path). Everything lands under $OUT (default ./gpu_out):
#   env.txt                      GPU, driver, torch and triton versions, commit
#   tests_{fp8,w4a16}_gpu.xml    junit XML of tests/gpu/test_fp8_linear_gpu.py / test_w4a16_gpu.py
#                                (measured errors as record_property); their tails in bench.log
#   qgemv_sweep.json             FP8 one-row plans per shape: us, GB/s, fp8 / bf16, error; "plans"
#   w4a16_sweep_m1.json          W4A16 one-row variants per shape; "plans" (M = 1)
#   decode_llama_bf16.json       TPOT and roofline, bf16 weights (graphs and eager)
#   decode_llama_{fp8,awq}_ab.json  the A/B rounds ("ab", "ab_median") with the sweeps' plans
#   qgemv_summary.json           each variant's TPOT over bf16's against the targets, the sweeps'
#                                layer sums and plans
#   bench.log                    every step's exit code, time and output tail
# Run from the repo root:  bash scripts/gpu_qgemv.sh      (the limits sum to 410 s)
# Limits (seconds, environment): FP8_TEST_TIMEOUT 70, W4_TEST_TIMEOUT 120, SWEEP_TIMEOUT 35 / 30
# (SWEEP_BUDGET 20 / 15: the sweeps stop adding variants then), DECODE_TIMEOUT 45 (bf16),
# AB_TIMEOUT 60 / 50 (fp8 / awq; the A/B JSON is written after every round).
# (W4_TEST_TIMEOUT was 55 until 2026-12-03: test_w4a16_gpu.py got 30 tests through in 45 s on a fresh machine.)
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
run tests_fp8_gpu "${FP8_TEST_TIMEOUT:-70}" python3 -m pytest -q tests/gpu/test_fp8_linear_gpu.py -p no:cacheprovider \
  --junitxml "$OUT/tests_fp8_gpu.xml"
run tests_w4a16_gpu "${W4_TEST_TIMEOUT:-120}" python3 -m pytest -q tests/gpu/test_w4a16_gpu.py -p no:cacheprovider \
  --junitxml "$OUT/tests_w4a16_gpu.xml"
run qgemv_sweep "${SWEEP_TIMEOUT:-35}" python3 benchmarks/qgemv_sweep.py --budget-s "${SWEEP_BUDGET:-20}" --out "$OUT/qgemv_sweep.json"
run w4a16_sweep_m1 "${SWEEP_TIMEOUT:-30}" python3 benchmarks/w4a16_sweep.py --ms 1 --budget-s "${SWEEP_BUDGET:-15}" --out "$OUT/w4a16_sweep_m1.json"
DL="python3 benchmarks/decode_latency.py --config llama-3.1-8b --steps 48"
run decode_llama_bf16 "${DECODE_TIMEOUT:-45}" $DL --out "$OUT/decode_llama_bf16.json"
FP8_PLANS=(); [ -f "$OUT/qgemv_sweep.json" ] && FP8_PLANS=(--fp8-plans "$OUT/qgemv_sweep.json")
W4_PLANS=(); [ -f "$OUT/w4a16_sweep_m1.json" ] && W4_PLANS=(--w4-plans "$OUT/w4a16_sweep_m1.json")
run decode_llama_fp8_ab "${AB_TIMEOUT:-60}" $DL --quantization fp8 "${FP8_PLANS[@]}" --ab q_old q_unfused q_new --ab-rounds 2 --out "$OUT/decode_llama_fp8_ab.json"
run decode_llama_awq_ab "${AB_TIMEOUT:-50}" $DL --quantization awq "${W4_PLANS[@]}" --ab q_old q_new --ab-rounds 2 --out "$OUT/decode_llama_awq_ab.json"
python3 - "$OUT" <<'PY' | tee "$OUT/qgemv_summary.json"
import json, os, sys
d = sys.argv[1]
def load(name):
    p = os.path.join(d, name)
    try:
        return json.load(open(p)) if os.path.exists(p) else None
    except ValueError:
        return None
out = {}
bf = load("decode_llama_bf16.json")
bf_ms = bf["graphs"]["tpot_ms"] if bf and "graphs" in bf else None
out["bf16_tpot_graphs_ms"] = bf_ms
for q, target in (("fp8", 0.6), ("awq", 0.4)):
    ab = load(f"decode_llama_{q}_ab.json")
    if not ab or "ab_median" not in ab:
        continue
    row = {"target_over_bf16": target, "roofline_ms": ab.get("roofline_ms"), "plans": ab.get(f"{'fp8' if q == 'fp8' else 'w4'}_plans")}
    for v, m in ab["ab_median"].items():
        row[v] = {**m, **({"over_bf16": round(m["tpot_ms"] / bf_ms, 3)} if bf_ms else {})}
    row["fused_one_row"] = {r["variant"]: r.get("fused_one_row") for r in ab["ab"]}
    row["argmax_same"] = all(r.get("check_argmax_same", True) for r in ab["ab"])
    row["max_logits_rel_vs_first"] = max((r.get("check_logits_rel_vs_first", 0.0) for r in ab["ab"]), default=None)
    out[q] = row
for name, key in (("qgemv_sweep.json", "fp8_sweep"), ("w4a16_sweep_m1.json", "w4a16_sweep")):
    sw = load(name)
    if sw:
        out[key] = {"layer_us": sw.get("layer_us"), "plans": sw.get("plans"), "seconds": sw.get("seconds")}
print(json.dumps(out, indent=1))
PY
