#!/usr/bin/env bash
# Issue 15, verify steps' projections at batch 1 on the gemv kernel's rows as one tile (kernels/gemv.py
# ROWS_TILE, docs/ARCHITECTURE.md §5.5), one device call (about 5-7 minutes):
#   1. the GPU tests of the tile path and of the gemv rows (tests/gpu/test_decode_path_gpu.py -k gemv_rows);
#   2. benchmarks/kernel_sweep.py --only rows: Qwen3-0.6B's and Llama-3.1-8B's projection stacks at 2, 5 and 9
#      rows on the skinny kernel, the gemv a row at a time and the tile over a grid of ROWS_TUNING, against the
#      one-row gemv;
#   3. benchmarks/spec_verify_cost.py --parts verify e2e (Qwen3-0.6B, verify k = 1, 2, 4, 8 at batch 1 and 8, the
#      replay drafter at k = 4 and L 2, 3, 4) with the skinny kernel (default) and with --gemv-rows 9 and the
#      tile at the sweep's best plan for 5 rows (SKIP_SWEEP=1: ROWS_TUNING's defaults).
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, rows_sweep.json, svc_{skinny,tile}.json,
# summary.txt. Run from the repo root:  bash scripts/gpu_rowstile.sh
# Limits (seconds, environment): TEST_TIMEOUT 120, SWEEP_TIMEOUT 180, BENCH_TIMEOUT 120 each. A shorter call
# (environment): SHAPES, MS (the sweep's shapes and rows), KS, BATCHES, LENGTHS (spec_verify_cost's).
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_rows "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -k "gemv_rows" \
  tests/gpu/test_decode_path_gpu.py
best='{}'
if [ -z "${SKIP_SWEEP:-}" ]; then
  # shellcheck disable=SC2086
  run sweep "${SWEEP_TIMEOUT:-180}" python3 benchmarks/kernel_sweep.py --only rows --shapes ${SHAPES:-qwen3-0.6b llama-3.1-8b} \
    --ms ${MS:-2 5 9} --out "$OUT/rows_sweep.json"
  best=$(python3 - "$OUT/rows_sweep.json" <<'PY'
import json, re, sys
try:
    key = json.load(open(sys.argv[1]))["rows"]["qwen3-0.6b_m5"]["best"]
    m = re.fullmatch(r"tile_te(\d+)_w(\d+)_pp(\d+)", key)
    print(json.dumps(dict(zip(("tile_elems", "num_warps", "programs_per_sm"), map(int, m.groups())))) if m else "{}")
except Exception:
    print("{}")
PY
)
fi
echo "tile plan: $best" | tee -a "$OUT/bench.log"
# shellcheck disable=SC2206
common=(--config qwen3-0.6b --parts verify e2e --ks ${KS:-1 2 4 8} --batches ${BATCHES:-1 8} --e2e-lengths ${LENGTHS:-2 3 4})
run svc_skinny "${BENCH_TIMEOUT:-120}" python3 benchmarks/spec_verify_cost.py "${common[@]}" \
  --out "$OUT/svc_skinny.json" --notes "scripts/gpu_rowstile.sh skinny"
run svc_tile "${BENCH_TIMEOUT:-120}" python3 benchmarks/spec_verify_cost.py "${common[@]}" --gemv-rows 9 \
  --gemv-rows-tile "$best" --out "$OUT/svc_tile.json" --notes "scripts/gpu_rowstile.sh tile $best"
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_{skinny,tile}.json 2>&1 | tee "$OUT/summary.txt"
