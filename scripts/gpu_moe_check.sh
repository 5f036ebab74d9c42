#!/usr/bin/env bash
# MoE and gated DeltaNet on the device machine (issue 16, "Benchmark on the H200"): their
# GPU tests, the fused MoE kernel against a per-expert cuBLAS loop (benchmarks/moe_kernel.py)
# and batch-1 decode of the Qwen3-30B-A3B shape against its roofline
# (benchmarks/decode_latency.py --config qwen3-30b-a3b; dummy bf16 weights, 61 GB).
# One device call; everything lands under $OUT (default ./gpu_out):
#   env.txt               GPU, driver, torch and triton versions
#   tests_moe_gpu.txt     pytest tail of the MoE and GDN GPU tests
#   moe_kernel.json       the kernel benchmark's JSON
#   decode_qwen3-30b-a3b.json  TPOT and roofline
#   bench.log             the benchmarks' output tails and exit codes
#   tests_hybrid_graphs_gpu.txt, decode_qwen3.5-35b-a3b.json   with part "hybrid" (or all): the hybrid
#                         decode-graph GPU tests, and batch-1 decode of the Qwen3.5-35B-A3B shape (graphs and
#                         eager TPOT, roofline with active experts and the recurrent state; 69 GB of bf16)
#   moe_tune/*.json       with part "tune" only: benchmarks/moe_tune.py's tuned configs (copy them
#                         into kernels/moe_configs/ to use them), then moe_kernel_tuned.json and
#                         decode_qwen3-30b-a3b_tuned.json timed with them in place
#   decode_ab_qwen3-30b-a3b.json  with part "ab" only: batch-1 decode TPOT in graphs, old path / new path
#                         (kernels.moe.DECODE_FUSED and decode attention's fused_merge off / on) in one
#                         process, A B A B, the graphs captured again before each (decode_latency.py --ab)
#   step_profile_qwen3-30b-a3b.json  with part "ab": the kernel table of one batch-1 step on the new path
#                         (step_profile.py --parts b1 --pdl off --decode-fusion on: each kernel's own time)
#                         (both new paths are off by default; --ab's "new" and --decode-fusion on turn them on)
#   decode_ab_qwen3-0.6b.json  with part "ab_dense" only: the same A/B on a dense model (there only the
#                         attention merge differs)
# Run from the repo root:  bash scripts/gpu_moe_check.sh [all|tests|kernel|decode|hybrid|tune|ab|ab_dense]
# (parts may be combined in one call: for p in decode tune; do bash scripts/gpu_moe_check.sh $p; done)
# Limits (seconds, environment): TEST_TIMEOUT 150, KERNEL_TIMEOUT 120, DECODE_TIMEOUT 300; part ab:
# AB_TIMEOUT 130, PROFILE_TIMEOUT 100 (the part within 240 s); ab_dense: AB_TIMEOUT 130.
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  tests=$(ls tests/gpu/test_*moe*_gpu.py tests/gpu/test_*delta*_gpu.py tests/gpu/test_hybrid_gpu.py 2>/dev/null)
  echo "tests: $tests" | tee "$OUT/tests_moe_gpu.txt"
  # shellcheck disable=SC2086  # one argument per test file
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q $tests -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/tests_moe_gpu.txt"
fi
if [ "$PART" = all ] || [ "$PART" = kernel ]; then
  run moe_kernel "${KERNEL_TIMEOUT:-120}" python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel.json"
fi
if [ "$PART" = all ] || [ "$PART" = decode ]; then
  run decode_qwen3-30b-a3b "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode_latency.py --config qwen3-30b-a3b --gpu-memory-utilization 0.75 \
    --steps 64 --out "$OUT/decode_qwen3-30b-a3b.json"
fi
if [ "$PART" = all ] || [ "$PART" = hybrid ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q tests/gpu/test_hybrid_graphs_gpu.py -p no:cacheprovider 2>&1 \
    | tail -40 | tee "$OUT/tests_hybrid_graphs_gpu.txt"
  run decode_qwen3.5-35b-a3b "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode_latency.py --config qwen3.5-35b-a3b \
    --gpu-memory-utilization 0.8 --steps 64 --out "$OUT/decode_qwen3.5-35b-a3b.json"
fi
if [ "$PART" = tune ]; then
  # tune for at most TUNE_BUDGET s (the file keeps the buckets done), then time decode again
  # with the tuned configs in place (decode_qwen3-30b-a3b_tuned.json: the A/B of one call)
  mkdir -p "$OUT/moe_tune"
  name="$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')_E128_N1536_K2048_bf16.json"
  run moe_tune "${TUNE_TIMEOUT:-500}" python3 benchmarks/moe_tune.py --budget-s "${TUNE_BUDGET:-200}" \
    --tokens ${TUNE_TOKENS:-1 2 4 8 16 32 64 128 256 512} --reps 10 --out "$OUT/moe_tune/$name"
  if [ -f "$OUT/moe_tune/$name" ]; then
    cp "$OUT/moe_tune/$name" kernels/moe_configs/
    run moe_kernel_tuned "${KERNEL_TIMEOUT:-120}" python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel_tuned.json"
    run decode_qwen3-30b-a3b_tuned "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode_latency.py --config qwen3-30b-a3b \
      --gpu-memory-utilization 0.75 --steps 64 --out "$OUT/decode_qwen3-30b-a3b_tuned.json"
  fi
fi
if [ "$PART" = ab ]; then
  # the A/B writes its JSON after every round, so a timeout still leaves the rounds done
  run decode_ab_qwen3-30b-a3b "${AB_TIMEOUT:-130}" python3 benchmarks/decode_latency.py --config qwen3-30b-a3b \
    --gpu-memory-utilization 0.75 --steps 64 --ab old new --ab-rounds 2 --out "$OUT/decode_ab_qwen3-30b-a3b.json"
  run step_profile_qwen3-30b-a3b "${PROFILE_TIMEOUT:-100}" python3 benchmarks/step_profile.py --config qwen3-30b-a3b \
    --gpu-memory-utilization 0.75 --parts b1 --pdl off --decode-fusion on --out "$OUT/step_profile_qwen3-30b-a3b.json"
fi
if [ "$PART" = ab_dense ]; then
  run decode_ab_qwen3-0.6b "${AB_TIMEOUT:-130}" python3 benchmarks/decode_latency.py --config qwen3-0.6b \
    --steps 64 --ab old new --ab-rounds 2 --out "$OUT/decode_ab_qwen3-0.6b.json"
fi
