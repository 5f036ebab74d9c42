#!/usr/bin/env bash
# Speculative decoding on the device machine (issue 15, "Benchmark on the H200"): the
# spec-related GPU tests, then benchmarks/spec_verify_cost.py for the Qwen3-0.6B and the
# Llama-3.1-8B shapes (dummy weights). One device call; everything lands under $OUT
# (default ./gpu_out), six files:
#   env.txt                        GPU, driver, torch and triton versions
#   tests_spec_gpu.txt             pytest tail of tests/gpu/test_spec*_gpu.py, test_rejection*_gpu.py
#   spec_verify_cost_qwen3-0.6b.json, spec_verify_cost_llama-3.1-8b.json
#                                  the benchmark's JSON ("complete": false if a timeout cut it short)
#   bench.log                      the benchmarks' output tails and exit codes
#   summary.txt                    the key figures of both JSON files
# Run from the repo root:  bash scripts/gpu_spec_check.sh [all|tests|qwen|llama]
# Limits (seconds, environment): TEST_TIMEOUT 180, QWEN_TIMEOUT 170, LLAMA_TIMEOUT 220: the
# whole run stays under the device's 600 s per command. Uses the system python3 with
# PYTHONPATH=. (the project venv does not travel); installs carried wheels from .whl/
# (msgspec, ...) into /tmp/site when present, as scripts/gpu_check.sh does.
set -u
PART=${1:-all}
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  t0=$(date +%s)
  tests=$(ls tests/gpu/test_spec*_gpu.py tests/gpu/test_rejection*_gpu.py 2>/dev/null)
  echo "tests: $tests" | tee "$OUT/tests_spec_gpu.txt"
  # shellcheck disable=SC2086  # one argument per test file
  timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q $tests -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/tests_spec_gpu.txt"
  echo "spec GPU tests took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests_spec_gpu.txt"
fi
bench() {  # bench CONFIG TIMEOUT
  local t0 rc; t0=$(date +%s)
  timeout "$2" python3 benchmarks/spec_verify_cost.py --config "$1" --out "$OUT/spec_verify_cost_$1.json" \
    --notes "scripts/gpu_spec_check.sh" >"$OUT/.bench_$1.log" 2>&1
  rc=$?
  { echo "== spec_verify_cost $1: rc=$rc (124: timeout) in $(( $(date +%s) - t0 )) s"
    grep -v '^ \|^{\|^}' "$OUT/.bench_$1.log" | tail -30; } | tee -a "$OUT/bench.log"
  rm -f "$OUT/.bench_$1.log"
}
if [ "$PART" = all ] || [ "$PART" = qwen ]; then bench qwen3-0.6b "${QWEN_TIMEOUT:-170}"; fi
if [ "$PART" = all ] || [ "$PART" = llama ]; then bench llama-3.1-8b "${LLAMA_TIMEOUT:-220}"; fi
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import glob, json, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "spec_verify_cost_*.json"))):
    r = json.load(open(p))
    print(f"== {os.path.basename(p)}: {r.get('device')} {r.get('config')} complete={r.get('complete')}")
    rows = [x for x in r.get("verify_cost", []) if "k" in x]
    for b in sorted({x["batch"] for x in rows}):
        plain = {x["mode"]: x["wall_ms"] for x in rows if x["batch"] == b and x["mode"] != "verify"}
        ver = " ".join(f"k{x['k']}:{x['wall_ms']:.2f}ms/{x['break_even_L']}" for x in rows
                       if x["batch"] == b and x["mode"] == "verify")
        print(f"verify b={b}: plain {plain} | verify ms/break-even L: {ver}")
    e = r.get("e2e_replay")
    if e:
        print(f"e2e batch 1, k={e['k']}: plain {e['plain']['output_tok_per_s']} tok/s")
        for q in e["points"]:
            print(f"  L target {q['target_L']} measured {q['measured_L']}: {q['output_tok_per_s']} tok/s, "
                  f"speedup {q['speedup']}, efficiency {q['efficiency']} (>= 0.8: {q['meets_target']}), "
                  f"identical {q['identical']}")
    d = r.get("draft_model")
    if d and "skipped" in d:
        print("draft_model: skipped:", d["skipped"])
    elif d:
        for name, v in d["variants"].items():
            for row in v["rows"]:
                print(f"draft_model {name} b={row['batch']}: plain {row['plain']['output_tok_per_s']} -> "
                      f"{row['spec']['output_tok_per_s']} tok/s (x{row['speedup']}), L "
                      f"{row['acceptance'].get('mean_acceptance_length')}, identical "
                      f"{row['identical_requests']}/{row['requests']}")
PY
