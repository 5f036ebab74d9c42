#!/usr/bin/env bash
# Issue 15, the verify step's kernel chain on the device machine (about 5 minutes on the H200):
# the GPU tests of the one-tile skinny kernel (kernels/linear.py SKINNY_PDL) and of the verify
# paths it serves, then benchmarks/spec_verify_cost.py (verify cost at k = 4, batch 1 / 8 / 32,
# batch-1 replay end to end, the per-kernel profile) for the K-loop kernel (the path before,
# k_loop) and the one-tile one (one_tile). Everything lands under $OUT (default ./gpu_out):
# env.txt, bench.log, svc_qwen3-0.6b_<variant>.json, summary.txt.
# Run from the repo root:  bash scripts/gpu_verifyk.sh   (SWEEP=1 adds benchmarks/kernel_sweep.py --only fused
# for both kernels, about a minute more)
# Limits: the kernel tests 240 s (TEST_TIMEOUT; on 2026-12-03 the one-tile file and the bf16 verify-logits test
# took ~150 s on a fresh machine, the K-loop fused-linear file on top of it did not fit 110 s), GRAPH_TEST_TIMEOUT 45.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_kernels "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_skinny_pdl_gpu.py \
  tests/gpu/test_fused_linear_gpu.py tests/gpu/test_spec_runner_gpu.py::test_verify_logits_equal_decode_logits_in_bf16
run tests_verify_graphs "${GRAPH_TEST_TIMEOUT:-45}" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_verify_graphs_gpu.py -k bf16
if [ "${SWEEP:-0}" = 1 ]; then  # opt-in: the fused linear stack alone, one graph, both kernels
  for v in k_loop one_tile; do
    run "sweep_$v" 60 python3 benchmarks/kernel_sweep.py --only fused --quick --skinny "$v" --out "$OUT/sweep_fused_$v.json"
  done
fi
for v in k_loop one_tile; do
  run "svc_$v" "${BENCH_TIMEOUT:-60}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --skinny "$v" \
    --parts verify e2e profile --ks 4 --batches 1 8 32 --out "$OUT/svc_qwen3-0.6b_$v.json" \
    --notes "scripts/gpu_verifyk.sh --skinny $v"
done
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_qwen3-0.6b_{k_loop,one_tile}.json 2>&1 | tee "$OUT/summary.txt"
