#!/usr/bin/env bash
# Issue 15, the verify step's attention merge on the device machine (about 3-4 minutes on the H200):
# the GPU tests of the multi-query kernel's in-kernel split merge (tests/gpu/test_mq_fused_gpu.py) and,
# in bf16 only ("dtype1": DTYPES[1] of test_kernels_gpu.py), of the kernels sharing its merge code
# (kernels/decode_merge.py: decode and verify attention, the fused rotary decode's graph replays), then
# benchmarks/spec_verify_cost.py --parts verify (k = 4, batch 1 / 8 / 32) with the merge launched after the
# kernel (launch, the default) and in the kernel (fused).
# Everything lands under $OUT (default ./gpu_out): env.txt, bench.log, svc_mq_<variant>.json, summary.txt.
# Run from the repo root:  bash scripts/gpu_mqfuse.sh
# Limits: the tests TEST_TIMEOUT (default 120 s), each benchmark run BENCH_TIMEOUT (default 55 s): 230 s at most.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt, run
run tests_mqfuse "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -k "mq_fused or dtype1 or graph_replays" \
  tests/gpu/test_mq_fused_gpu.py \
  tests/gpu/test_kernels_gpu.py::test_paged_verify_attention_matches_reference \
  tests/gpu/test_kernels_gpu.py::test_paged_decode_attention_matches_reference \
  tests/gpu/test_decode_path_gpu.py::test_rope_decode_graph_replays_merge_splits_and_zero_padding_rows
for v in launch fused; do
  run "svc_$v" "${BENCH_TIMEOUT:-55}" python3 benchmarks/spec_verify_cost.py --config qwen3-0.6b --mq-merge "$v" \
    --parts verify --ks 4 --batches 1 8 32 --out "$OUT/svc_mq_$v.json" --notes "scripts/gpu_mqfuse.sh --mq-merge $v"
done
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_mq_{launch,fused}.json 2>&1 | tee "$OUT/summary.txt"
