#!/usr/bin/env bash
# Issue 15, a verify step's fixed cost on the device machine (about 3 minutes): the fused rotary + KV
# write + multi-query attention kernel of verify layers (kernels/rope_verify.py, switch ROPE_VERIFY, off
# by default and not measured before this script). First its GPU tests (tests/gpu/test_rope_verify_gpu.py:
# against the two-launch path and the references, bf16 / fp16 / fp32 q, fp8 and int8 caches, the merge
# launched and in the kernel, CUDA-graph replays, the VerifyAttention backend), then
# benchmarks/spec_verify_cost.py --parts verify (k = 1 2 4 8, batch 1 / 8 / 32, Qwen3-0.6B) with the switch
# off (the rotary kernel, then the multi-query kernel) and on (one kernel plus the merge launch).
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, svc_rv_<off|on>.json, summary.txt.
# Run from the repo root:  bash scripts/gpu_roperify.sh
# Limits: the tests TEST_TIMEOUT (default 80 s: 25 tests, most of the time Triton compiles on a fresh machine and one
# 4-layer runner load with its verify graphs), each benchmark run BENCH_TIMEOUT (default 75 s: a load with verify graphs
# for k 1..8 took ~22 s on the H100; with the switch on the warm-up compiles ~21 more variants of the fused kernel, about
# 2.6 s each on the 2-core VM, fewer on the device host): 230 s at most. If svc_on times out in its load, rerun it
# alone with BENCH_TIMEOUT=120 (the Triton cache then holds most of its compiles).
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_roperify "${TEST_TIMEOUT:-80}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rope_verify_gpu.py
for v in off on; do
  run "svc_$v" "${BENCH_TIMEOUT:-75}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --rope-verify "$v" \
    --parts verify --ks 1 2 4 8 --batches 1 8 32 --out "$OUT/svc_rv_$v.json" --notes "scripts/gpu_roperify.sh --rope-verify $v"
done
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_rv_{off,on}.json 2>&1 | tee "$OUT/summary.txt"
