#!/usr/bin/env bash
# GPU check for the device machine: environment, tests/gpu, then the benchmarks; every
# result lands under $OUT (default ./gpu_out). Run from the repo root:
#   bash scripts/gpu_check.sh
# Uses the system python3 with PYTHONPATH=. (the project venv does not travel); installs
# carried wheels from .whl/ (msgspec) into /tmp/site when present.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/tests_gpu.txt"
echo "tests/gpu took $(( $(date +%s) - t0 )) s"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/decode_latency.py --out "$OUT/decode_latency.json" 2>&1 | tail -40 | tee "$OUT/decode_latency.txt"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/offline_throughput.py --out "$OUT/offline_throughput.json" 2>&1 | tail -30 | tee "$OUT/offline_throughput.txt"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/decode_latency.py --config llama-3.1-8b --steps 64 --out "$OUT/decode_latency_llama.json" 2>&1 | tail -40 | tee "$OUT/decode_latency_llama.txt"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/gemv_sweep.py --out "$OUT/gemv_sweep.json" 2>&1 | grep -v '^ \|^{\|^}' | tail -20 | tee "$OUT/gemv_sweep.txt"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/step_profile.py --out "$OUT/step_profile.json" 2>&1 | tail -60 | tee "$OUT/step_profile.txt"
timeout ${SERVE_BENCH_TIMEOUT:-420} python3 benchmarks/serve_bench.py --out "$OUT/serve_bench.json" 2>&1 | tail -30 | tee "$OUT/serve_bench.txt"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/prefix_ttft.py --tokens 32768 --config qwen3-0.6b --out "$OUT/prefix_ttft.json" 2>&1 | tail -30 | tee "$OUT/prefix_ttft.txt"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/kv_disk_read.py --out "$OUT/kv_disk_read.json" 2>&1 | tail -20 | tee "$OUT/kv_disk_read.txt"
echo "== summary"
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
for f in ("decode_latency.json", "offline_throughput.json", "decode_latency_llama.json"):
    p = os.path.join(d, f)
    if os.path.exists(p):
        r = json.load(open(p))
        keep = {k: r[k] for k in r if k in ("output_tok_per_s", "seconds", "steps", "run_step_seconds",
                "copy_bandwidth_TBps", "roofline_ms", "graphs", "eager",
                "schedule_seconds", "update_seconds", "gpu_event_seconds")}
        print(f, json.dumps(keep))
    else:
        print(f, "missing")
p = os.path.join(d, "serve_bench.json")
if os.path.exists(p):
    r = json.load(open(p))
    levels = {lv["concurrency"]: {"out_tok_s": lv["output_tok_per_s"], "errors": lv["errors"],
              "ttft_p50_ms": lv["ttft_ms"]["p50"], "tpot_p50_ms": lv["tpot_ms"]["p50"]} for lv in r["levels"]}
    print("serve_bench.json", json.dumps({"levels": levels, "offline_tok_s": (r["offline"] or {}).get("output_tok_per_s"),
          "ratio": r["ratio"], "ratio_concurrency": r["ratio_concurrency"]}))
else:
    print("serve_bench.json missing")
PY
