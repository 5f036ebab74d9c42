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
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import glob, json, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "svc_*.json"))):
    r = json.load(open(p))
    print(f"== {os.path.basename(p)} complete={r.get('complete')}")
    for x in r.get("verify_cost", []):
        if x.get("mode") == "verify":
            print(f"  b={x['batch']} k={x['k']}: {x['wall_ms']:.3f} ms, break-even L {x['break_even_L']}")
        else:
            print(f"  b={x['batch']} {x.get('mode')}: {x['wall_ms']:.3f} ms")
    for x in (r.get("host_cost") or {}).get("rows", []):
        for m in ("decode", "verify_fast", "verify_full"):
            y = x.get(m)
            if y:
                print(f"  host b={x['batch']} {m}: wall {y['wall_ms']:.3f} ms, outside the forward "
                      f"{y['outside_ms']:.3f} ms (before {y['before_forward_ms']:.3f}, after the read "
                      f"{y['after_last_read_ms']:.3f}), {y['aten_ops_outside']} ops, {y['host_reads']} reads")
        if "identical" in x:
            print(f"  host b={x['batch']}: identical {x['identical']}, saved {x.get('outside_ms_saved')} ms")
    pr = r.get("profile")
    for part in ("decode", "verify") if pr else ():
        print(f"  profile {part}: {pr[part]['total_us']} us of kernels a step; top:")
        for x in pr[part]["top"][:8]:
            print(f"    {x['us']:8.1f} us x{x['calls']:3d} {x['kernel']}")
    e = r.get("e2e_replay")
    if e:
        print(f"  e2e plain {e['plain']['output_tok_per_s']} tok/s")
        for q in e["points"]:
            print(f"  L {q['measured_L']}: {q['output_tok_per_s']} tok/s x{q['speedup']} eff {q['efficiency']} "
                  f"identical {q['identical']}")
PY
