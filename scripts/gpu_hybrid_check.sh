#!/usr/bin/env bash
# A hybrid's decode on the device machine (issue 16, gated DeltaNet in place): the GPU tests of
# the in-place decode kernels and of the hybrid end to end, batch-1 decode of the
# Qwen3.5-35B-A3B shape with the earlier (gathered) path and the in-place one alternately in one
# runner (benchmarks/decode_latency.py --variants: A B A B, then in place with the earlier
# projection routing and in place with 32-column recurrent tiles), and the per-kernel profile of the in-place path (benchmarks/step_profile.py).
# One device call; everything lands under $OUT (default ./gpu_out):
#   env.txt                      GPU, driver, torch and triton versions
#   tests_hybrid_gpu.txt         pytest tail of tests/gpu/test_gdn_decode_gpu.py, test_gated_delta_rule_gpu.py,
#                                test_hybrid_gpu.py, test_hybrid_graphs_gpu.py
#   decode_ab_qwen3.5-35b-a3b.json   graphs TPOT per variant (gathered, in_place, gathered, in_place,
#                                in_place_cublas, in_place_bv32; benchmarks/decode_latency.py VARIANTS) and the roofline
#   step_profile_qwen3.5-35b-a3b.json   kernel tables of the in-place path (graph b1 / b256, eager b1, prefill)
#   decode_ab_llama-3.1-8b.json  with part "routing" (or all): Llama-3.1-8B batch-1 TPOT with its qkv
#                                projection (25M weights) on cuBLAS and on the gemv, alternately
#   with part "glue" (or all): the stacked projections and fused decode glue (qwen3_next.STACK_PROJECTIONS,
#   qwen3_next_blocks.FUSED_GLUE; docs/ARCHITECTURE.md §6.3):
#   tests_glue_gpu.txt           pytest tail of tests/gpu/test_hybrid_glue_gpu.py, test_moe_gpu.py, test_hybrid_graphs_gpu.py
#   decode_glue_qwen3.5-35b-a3b.json        stacked: graphs TPOT per variant (glue off / on twice, with the MoE
#                                decode path, its default; on with the shared combine apart)
#   decode_glue_nostack_qwen3.5-35b-a3b.json  the same runner built with the projections apart (--stack off)
#   step_profile_glue_qwen3.5-35b-a3b.json  the b1 kernel tables with the MoE decode path and the glue on
#   gdn_sweep.json               with part "sweep" (or all): the recurrent decode step by launch config at
#                                1..256 rows (benchmarks/gdn_decode_sweep.py, its suggested REC_LAUNCH),
#                                then tests_gdn_decode_gpu.txt: tests/gpu/test_gdn_decode_gpu.py's tail
#   bench.log                    the benchmarks' output tails and exit codes
# Run from the repo root:  bash scripts/gpu_hybrid_check.sh [default|all|tests|decode|profile|routing|glue|sweep]
# ("default": tests, decode and profile, about 400 s; "all" adds routing, glue and sweep)
# Limits (seconds, environment): TEST_TIMEOUT 150, DECODE_TIMEOUT 150, PROFILE_TIMEOUT 150, ROUTING_TIMEOUT 90,
# GLUE_TIMEOUT 200 (each of the glue part's four commands), SWEEP_TIMEOUT 150 (the sweep's --budget-s 100 and
# the GPU tests' 150 apart).
set -u
PART=${1:-default}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
want() { [ "$PART" = "$1" ] || { [ "$PART" = default ] && [ "$1" != routing ] && [ "$1" != glue ] \
  && [ "$1" != sweep ]; } || [ "$PART" = all ]; }
if want tests; then
  tests="tests/gpu/test_gdn_decode_gpu.py tests/gpu/test_gated_delta_rule_gpu.py tests/gpu/test_hybrid_gpu.py tests/gpu/test_hybrid_graphs_gpu.py"
  echo "tests: $tests" | tee "$OUT/tests_hybrid_gpu.txt"
  # shellcheck disable=SC2086  # one argument per test file
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q $tests -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/tests_hybrid_gpu.txt"
fi
if want decode; then
  run decode_ab_qwen3.5-35b-a3b "${DECODE_TIMEOUT:-150}" python3 benchmarks/decode_latency.py --config qwen3.5-35b-a3b \
    --gpu-memory-utilization 0.8 --steps 64 --variants gathered in_place gathered in_place in_place_cublas in_place_bv32 \
    --out "$OUT/decode_ab_qwen3.5-35b-a3b.json"
fi
if want profile; then
  run step_profile_qwen3.5-35b-a3b "${PROFILE_TIMEOUT:-150}" python3 benchmarks/step_profile.py --config qwen3.5-35b-a3b \
    --gpu-memory-utilization 0.8 --out "$OUT/step_profile_qwen3.5-35b-a3b.json"
fi
if want routing; then
  run decode_ab_llama-3.1-8b "${ROUTING_TIMEOUT:-90}" python3 benchmarks/decode_latency.py --config llama-3.1-8b \
    --steps 64 --variants in_place_cublas in_place in_place_cublas in_place --out "$OUT/decode_ab_llama-3.1-8b.json"
fi
if want glue; then
  tests="tests/gpu/test_hybrid_glue_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_hybrid_graphs_gpu.py"
  echo "tests: $tests" | tee "$OUT/tests_glue_gpu.txt"
  # shellcheck disable=SC2086  # one argument per test file
  timeout "${GLUE_TIMEOUT:-200}" python3 -m pytest -q $tests -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/tests_glue_gpu.txt"
  run decode_glue_qwen3.5-35b-a3b "${GLUE_TIMEOUT:-200}" python3 benchmarks/decode_latency.py --config qwen3.5-35b-a3b \
    --gpu-memory-utilization 0.8 --steps 64 --variants glue_off glue_on glue_off glue_on \
    moe_fused_glue_on_apart --out "$OUT/decode_glue_qwen3.5-35b-a3b.json"
  run decode_glue_nostack_qwen3.5-35b-a3b "${GLUE_TIMEOUT:-200}" python3 benchmarks/decode_latency.py \
    --config qwen3.5-35b-a3b --gpu-memory-utilization 0.8 --steps 64 --stack off \
    --variants glue_off glue_on glue_off glue_on \
    --out "$OUT/decode_glue_nostack_qwen3.5-35b-a3b.json"
  run step_profile_glue_qwen3.5-35b-a3b "${GLUE_TIMEOUT:-200}" python3 benchmarks/step_profile.py \
    --config qwen3.5-35b-a3b --gpu-memory-utilization 0.8 --parts b1 --decode-fusion on --glue on \
    --out "$OUT/step_profile_glue_qwen3.5-35b-a3b.json"
fi
if want sweep; then
  run gdn_sweep "${SWEEP_TIMEOUT:-150}" python3 benchmarks/gdn_decode_sweep.py --budget-s 100 --out "$OUT/gdn_sweep.json"
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q tests/gpu/test_gdn_decode_gpu.py -p no:cacheprovider 2>&1 \
    | tail -15 | tee "$OUT/tests_gdn_decode_gpu.txt"
fi
