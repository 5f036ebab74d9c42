#!/usr/bin/env bash
# fp8_e4m3 KV decode attention against bf16 KV (issue 17: bf16 / fp8 >= 1.6x at 32K), one device
# call of at most ~4 minutes on an H200 (TEST_TIMEOUT 130 + SWEEP_TIMEOUT 100 s, plus setup):
#   1. tests/gpu/test_fp8_kv_gpu.py: the fp8 KV kernels against the torch references, every dot
#      format (kernels.kv_quant_triton.FP8_DOTS) and every variant the sweep times (they compile
#      here first: the sweep then finds them in Triton's cache);
#   2. benchmarks/kv_quant_attention.py --variants: bf16 KV, the fp8 defaults and every fp8
#      variant (dot format x key tile x split count: SWEEP_DOTS, TILES, REFERENCE there) of the
#      split-K decode kernel and the fused rotary decode, at 8K / 32K context x batch 1 / 64,
#      and the best variant per kernel and launch class ("best", for DECODE_FP8_DEFAULTS /
#      ROPE_DECODE_FP8_DEFAULTS).
# Everything lands under $OUT (default ./gpu_out):
#   env.txt                  GPU, driver, clocks, torch and triton versions, the commit
#   tests_fp8kv.txt / .xml   pytest tail; junit XML with the measured errors (record_property)
#   kv_quant_attention.json  the sweep's figures (us per call, GB/s, ratios, rel. errors, best)
#   summary.txt              one line per kernel and variant: bf16 / fp8 at each context x batch and
#                            its largest output error against bf16 KV (~0.04: the e4m3 rounding)
#   bench.log                each part's exit code, time and output tail
# Run from the repo root:  bash scripts/gpu_fp8kv.sh [all|tests|sweep]
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run()
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${TEST_TIMEOUT:-130}" python3 -m pytest -q tests/gpu/test_fp8_kv_gpu.py -p no:cacheprovider \
    --junitxml "$OUT/tests_fp8kv.xml" 2>&1 | tail -40 | tee "$OUT/tests_fp8kv.txt"
fi
if [ "$PART" = all ] || [ "$PART" = sweep ]; then
  # 32K first (the issue's target), so a time limit cuts 8K; the JSON holds the cases so far
  run kv_quant_attention_variants "${SWEEP_TIMEOUT:-100}" \
    python3 benchmarks/kv_quant_attention.py --variants --contexts 32768 8192 --out "$OUT"
  python3 - "$OUT/kv_quant_attention.json" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys

d = json.load(open(sys.argv[1]))
cases = d.get("cases", [])
for kname in ("decode_kernel", "rope_decode_kernel"):
    rows = {"(defaults)": {f"{c['context']}x{c['batch']}": c[kname]["bf16_over_fp8"] for c in cases}}
    errs: dict = {}
    for c in cases:
        for v, r in c[kname].get("variants", {}).items():
            rows.setdefault(v, {})[f"{c['context']}x{c['batch']}"] = r.get("bf16_over_fp8", r.get("error", "?"))
            errs[v] = max(errs.get(v, 0.0), r.get("rel_err_vs_bf16", float("inf")))
    for v, r in rows.items():
        err = f" max_rel_err_vs_bf16={errs[v]:.4f}" if v in errs else ""
        print(f"{kname:18s} {v:24s} " + " ".join(f"{k}={x}" for k, x in r.items()) + err)
print("partial (a time limit cut the run):", d.get("partial", False), "wall_s:", d.get("wall_s"))
print("best:", json.dumps(d.get("best"), indent=1))
EOF
fi
