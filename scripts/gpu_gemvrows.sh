#!/usr/bin/env bash
# Issue 15, verify steps' projections on the gemv kernel (kernels/gemv.py ROWS, docs/ARCHITECTURE.md §5.5), one
# device call (about 3-4 minutes): the GPU tests of the gemv kernel over M rows and of the batch-1 decode path
# (tests/gpu/test_decode_path_gpu.py -k gemv), then benchmarks/spec_verify_cost.py --parts verify e2e (Qwen3-0.6B
# shape, dummy weights; verify k = 1, 2, 4, 8 and plain decode graphs at batch 1 and 8; the replay drafter at
# k = 4, L 2 and 4) with --gemv-rows 1 (the one-tile skinny kernel at 2+ rows) and 8 (the gemv
# kernel up to 8 rows: verify steps at batch 1 up to k = 7, and plain decode steps of 2..8 seqs).
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, svc_gemvrows_<n>.json, summary.txt.
# Run from the repo root:  bash scripts/gpu_gemvrows.sh
# Limits (seconds, environment): TEST_TIMEOUT 60, BENCH_TIMEOUT 100 each.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_gemvrows "${TEST_TIMEOUT:-60}" python3 -m pytest -q -p no:cacheprovider -k "gemv" tests/gpu/test_decode_path_gpu.py
for r in 1 8; do  # 1: the skinny kernel at 2+ rows; 8: the gemv kernel up to 8 rows
  run "svc_$r" "${BENCH_TIMEOUT:-100}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --gemv-rows "$r" \
    --parts verify e2e --ks 1 2 4 8 --batches 1 8 --e2e-lengths 2 4 --out "$OUT/svc_gemvrows_$r.json" \
    --notes "scripts/gpu_gemvrows.sh --gemv-rows $r"
done
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_gemvrows_{1,8}.json 2>&1 | tee "$OUT/summary.txt"
