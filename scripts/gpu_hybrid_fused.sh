#!/usr/bin/env bash
# Issue 16, Qwen3.5-35B-A3B batch-1 decode (about 6 minutes on a fresh device machine): the hybrid's
# layers on the fused layer path (qwen3_next.FUSE_LAYERS: the zero-centred norms in the first
# projections' gemv prologues, which store the normalised input (xn_out) where a second projection or
# the experts read it; the residual adds in the mixers' output projections and the MoE down kernel;
# two launches fewer a layer).
#   1. its GPU tests (tests/gpu/test_hybrid_fused_gpu.py), with the fused-linear gemv and MoE ones it
#      builds on (tests/gpu/test_fused_linear_gpu.py -k "moe or gemv_with_norm")
#   2. benchmarks/decode_latency.py --ab hybrid_unfused hybrid_fused, two rounds in one process (the
#      graphs captured again before each; the JSON's fused_one_row says which path each took)
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, tests_hybrid_fused_gpu.xml,
# decode_ab_hybrid_qwen3.5-35b-a3b.json. Run from the repo root:  bash scripts/gpu_hybrid_fused.sh [all|ab|tests]
# (SKIP_TESTS=1 is ab)
set -u
PART=${1:-all}
[ "${SKIP_TESTS:-0}" = 1 ] && PART=ab
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
# the 67 GB of Qwen3.5-35B-A3B's weights: 0.75 of an H200, 0.92 of an H100 (80 GB)
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
UTIL=$([ "${MEM_MIB:-0}" -gt 100000 ] && echo 0.75 || echo 0.92)
if [ "$PART" != ab ]; then
  run tests_hybrid_fused "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -s \
    tests/gpu/test_hybrid_fused_gpu.py --junitxml "$OUT/tests_hybrid_fused_gpu.xml"
  run tests_fused_linear "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_fused_linear_gpu.py -k "moe or gemv_with_norm"
fi
[ "$PART" = tests ] && exit 0
run decode_ab_hybrid "${AB_TIMEOUT:-300}" python3 benchmarks/decode_latency.py --config qwen3.5-35b-a3b \
  --gpu-memory-utilization "$UTIL" --ab hybrid_unfused hybrid_fused --ab-rounds 2 \
  --out "$OUT/decode_ab_hybrid_qwen3.5-35b-a3b.json"
