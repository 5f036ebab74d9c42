#!/usr/bin/env bash
# Issue 15, where a verify step's end-to-end time goes (docs/ARCHITECTURE.md §5.5), on the device
# machine (about 2-3 minutes on the H200): the GPU test of the step kinds and the settled replay
# reference (tests/gpu/test_spec_step_kinds_gpu.py), with the runner's spec GPU tests and four
# verify-graph ones (bf16 logits, plain tokens, the proposer's view, a pending token after a graph
# verify step: the verify path's host work changed, §5.5); then benchmarks/spec_verify_cost.py
# --config qwen3-0.6b --parts e2e host --ks 4 (dummy weights, batch 1, verify graphs of k 1..4,
# the replay drafter at k = 4 with its reference settled on the speculative run's own output;
# per e2e point the steps by kind: count, wall, device span, host time before the forward and
# after the last read, the engine's gap; the host part at batch 1 and 8). Everything lands under $OUT (default ./gpu_out):
# env.txt, bench.log, svc_kinds_qwen3-0.6b.json, summary.txt.
# Run from the repo root:  bash scripts/gpu_spec_kinds.sh
# Limits (seconds, environment): TEST_TIMEOUT 140, BENCH_TIMEOUT 95: under 240 s together.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_kinds "${TEST_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_step_kinds_gpu.py \
  tests/gpu/test_spec_runner_gpu.py tests/gpu/test_verify_graphs_gpu.py::test_graph_logits_equal_eager_logits_in_bf16 \
  tests/gpu/test_verify_graphs_gpu.py::test_speculation_through_verify_graphs_emits_plain_tokens \
  tests/gpu/test_verify_graphs_gpu.py::test_the_proposer_sees_a_graph_steps_tokens_slots_and_aux \
  tests/gpu/test_verify_graphs_gpu.py::test_a_pending_token_after_a_graph_verify_step_replays_in_a_decode_graph
run svc_kinds "${BENCH_TIMEOUT:-95}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --parts e2e host --ks 4 \
  --host-batches 1 8 --out "$OUT/svc_kinds_qwen3-0.6b.json" --notes "scripts/gpu_spec_kinds.sh"
python3 benchmarks/spec_verify_summary.py "$OUT/svc_kinds_qwen3-0.6b.json" 2>&1 | tee "$OUT/summary.txt"
