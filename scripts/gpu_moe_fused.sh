#!/usr/bin/env bash
# Issue 16, Qwen3-30B-A3B batch-1 decode (about 7 minutes on a fresh device machine): the MoE layers
# on the fused layer path (the post-attention norm in the router's gemv, which stores the experts'
# input, xn_out; the residual add in the MoE down kernel) and the two-launch MoE decode path
# (kernels.moe_decode_triton.GATE_UP "gemv": gate_up and down kernels that route each token themselves).
#   1. their GPU tests (tests/gpu/test_fused_linear_gpu.py -k "moe or gemv_with_norm", tests/gpu/test_moe_gpu.py)
#   2. benchmarks/decode_latency.py --ab layers_unfused layers_fused layers_fused_gemv, two rounds in one
#      process (the graphs captured again before each): the old path, the new default, and the two-launch MoE
#   3. benchmarks/moe_decode_sweep.py --stages gemv at T = 1: the two-launch path's plans
#   4. PART=all: the int8 KV GPU tests too (tests/gpu/test_int8_kv_gpu.py, as scripts/gpu_fp8kv_check.sh tests)
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, decode_ab_layers_qwen3-30b-a3b.json,
# moe_decode_sweep_gemv_qwen3-30b-a3b.json. Run from the repo root:  bash scripts/gpu_moe_fused.sh [all|moe|ab]
# (ab: 1 and 2 only, about 5 minutes; SKIP_TESTS=1 leaves out step 1)
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
# the 61 GB of Qwen3-30B-A3B's weights: 0.75 of an H200, 0.92 of an H100 (80 GB)
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
UTIL=$([ "${MEM_MIB:-0}" -gt 100000 ] && echo 0.75 || echo 0.92)
[ "${SKIP_TESTS:-0}" = 1 ] || run tests_moe_fused "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_fused_linear_gpu.py -k "moe or gemv_with_norm" tests/gpu/test_moe_gpu.py
run decode_ab_layers "${AB_TIMEOUT:-200}" python3 benchmarks/decode_latency.py --config qwen3-30b-a3b \
  --gpu-memory-utilization "$UTIL" --ab layers_unfused layers_fused layers_fused_gemv --ab-rounds 2 \
  --out "$OUT/decode_ab_layers_qwen3-30b-a3b.json"
[ "$PART" = ab ] && exit 0
run moe_sweep_gemv "${SWEEP_TIMEOUT:-90}" python3 benchmarks/moe_decode_sweep.py --config qwen3-30b-a3b --tokens 1 \
  --stages gemv --out "$OUT/moe_decode_sweep_gemv_qwen3-30b-a3b.json"
if [ "$PART" = all ]; then
  run tests_int8kv "${KV_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_int8_kv_gpu.py \
    --junitxml "$OUT/tests_int8kv_gpu.xml"
fi
