#!/usr/bin/env bash
# A/B of verify-step variants on the device machine (issue 15): the GPU tests of the kernels
# and of speculative decoding, then benchmarks/spec_verify_cost.py (verify cost and batch-1
# replay end to end) once per variant, in this one call. VARIANTS: space-separated
# name=flags pairs, flags joined by commas (default: the varlen prefill kernel as the
# baseline against the split-K multi-query kernel). Everything lands under $OUT (default
# ./gpu_out): env.txt, tests.txt, svc_<config>_<variant>.json, bench.log, summary.txt.
# Run from the repo root:  bash scripts/gpu_spec_ab.sh [CONFIG ...]   (default qwen3-0.6b)
#   VARIANTS="base=--attention,multi_query p=--attention,prefill" BENCH_ARGS="--parts verify profile" bash scripts/gpu_spec_ab.sh
#   VARIANTS="off=--fast-verify,off on=--fast-verify,on" BENCH_ARGS="--parts host verify e2e --ks 4 --batches 1 32" \
#     bash scripts/gpu_spec_ab.sh   (the greedy fast path of verification; the host part A/Bs it within each run)
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_spec_runner_gpu.py tests/gpu/test_verify_graphs_gpu.py tests/gpu/test_spec_heads_gpu.py tests/gpu/test_fused_linear_gpu.py tests/gpu/test_decode_path_gpu.py \
    2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
[ $# -gt 0 ] || set -- qwen3-0.6b
for cfg in "$@"; do
  for var in ${VARIANTS:-prefill=--attention,prefill multi_query=--attention,multi_query}; do
    name=${var%%=*}
    flags=${var#*=}
    t0=$(date +%s)
    # shellcheck disable=SC2086  # BENCH_ARGS and the variant's flags: one word each
    timeout "${BENCH_TIMEOUT:-170}" python3 benchmarks/spec_verify_cost.py --config "$cfg" ${flags//,/ } \
      --parts verify e2e ${BENCH_ARGS:-} --out "$OUT/svc_${cfg}_${name}.json" --notes "scripts/gpu_spec_ab.sh $var" \
      >"$OUT/.log" 2>&1
    echo "== $cfg $name rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
    grep -v '^ \|^{\|^}' "$OUT/.log" | tail -8 | tee -a "$OUT/bench.log"
  done
done
rm -f "$OUT/.log"
python3 benchmarks/spec_verify_summary.py "$OUT"/svc_*.json 2>&1 | tee "$OUT/summary.txt"
