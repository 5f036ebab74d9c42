#!/usr/bin/env bash
# Issue 15, the one-tile skinny kernel's plan (kernels/linear.py SKINNY_PDL_TUNING) for verify steps at batch 1
# (5 rows at k = 4; docs/ARCHITECTURE.md §5.5), one device call of about 3 minutes:
#   1. benchmarks/kernel_sweep.py --only linear --skinny one_tile --shapes qwen3-0.6b --ms 5 --limit LIMIT (8):
#      the 28 layers' four projections at 5 rows in one CUDA graph per variant (K range, tile elements,
#      programs per SM, warps), cuBLAS beside them;
#   2. benchmarks/spec_verify_cost.py --parts verify --ks 4 --batches 1 8 with the default plan and with the
#      sweep's best at 5 rows (--skinny-tuning), verify graphs end to end.
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, kernel_sweep.json, svc_{default,best}.json,
# summary.txt. Run from the repo root:  bash scripts/gpu_skinnytune.sh
# Limits (seconds, environment): SWEEP_TIMEOUT 100, BENCH_TIMEOUT 40 each.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run sweep "${SWEEP_TIMEOUT:-100}" python3 benchmarks/kernel_sweep.py --only linear --skinny one_tile \
  --shapes qwen3-0.6b --ms 5 --limit "${LIMIT:-8}" --out "$OUT/kernel_sweep.json"
best=$(python3 - "$OUT/kernel_sweep.json" <<'PY'
import json, re, sys
row = json.load(open(sys.argv[1]))["linear"]["qwen3-0.6b_m5"]
m = re.fullmatch(r"mbk(\d+)_te(\d+)_pp(\d+)_w(\d+)", row["best"])
print(json.dumps(dict(zip(("max_block_k", "tile_elems", "programs_per_sm", "num_warps"), map(int, m.groups())))))
PY
)
echo "best at 5 rows: $best" | tee -a "$OUT/bench.log"
run svc_default "${BENCH_TIMEOUT:-40}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --parts verify \
  --ks 4 --batches 1 8 --out "$OUT/svc_default.json" --notes "scripts/gpu_skinnytune.sh default"
if [ -n "$best" ]; then
  run svc_best "${BENCH_TIMEOUT:-40}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --parts verify \
    --ks 4 --batches 1 8 --skinny-tuning "$best" --out "$OUT/svc_best.json" --notes "scripts/gpu_skinnytune.sh $best"
fi
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_{default,best}.json 2>&1 | tee "$OUT/summary.txt"
