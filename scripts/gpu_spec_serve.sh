#!/usr/bin/env bash
# Speculative decoding under concurrent load on the device machine (issue 15: "At 32 and 256
# concurrent, speculation on is never below 0.97x of off"): benchmarks/spec_serve.py, a plain
# and an n-gram (k = 4, adaptive policy) `kestrel serve` of Qwen3-0.6B's shape with dummy
# weights, at concurrency 1, 32 and 256. One device call (carry .whl); under $OUT (default
# ./gpu_out):
#   env.txt              GPU, driver, torch and triton versions, commit
#   spec_serve.json      the benchmark's JSON ("complete": false if the timeout cut it short)
#   spec_serve.log       its progress lines (stderr) and exit code
#   spec_serve.txt       the table: per level and prompt kind plain/spec tok/s, ratio, verdict
#   kestrel-serve-bench-*.log   the servers' logs, only when the run failed
# Run from the repo root:  bash scripts/gpu_spec_serve.sh [more spec_serve.py flags]
# Limit (seconds, environment): SERVE_TIMEOUT 540 (the device allows 600 s per command; the
# default run, 8x/4x the concurrency in requests at c32/c256 and 3 rounds, is estimated at
# about 170 s: 2 start-ups, warm-up, about 45 s a round). spec_serve.txt's last columns: the
# worker compiles after ready (plain/spec) and the spec runs' seconds per round. Uses the system python3 with PYTHONPATH=. and the carried
# wheels from .whl/ installed into /tmp/site, as scripts/gpu_spec_check.sh does.
set -u
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "$0")/gpu_env.sh"  # $OUT, PYTHONPATH, the carried wheels, env.txt
t0=$(date +%s)
timeout "${SERVE_TIMEOUT:-540}" python3 benchmarks/spec_serve.py --out "$OUT/spec_serve.json" \
  --notes "scripts/gpu_spec_serve.sh" "$@" >/dev/null 2>"$OUT/spec_serve.log"
rc=$?
echo "spec_serve: rc=$rc (124: timeout) in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/spec_serve.log"
if [ "$rc" != 0 ]; then cp /tmp/kestrel-serve-bench-*.log "$OUT/" 2>/dev/null; fi  # kept only on failure
tail -30 "$OUT/spec_serve.log"
if [ -s "$OUT/spec_serve.json" ]; then
  python3 -c 'import json, sys; from benchmarks.spec_serve import table; print(table(json.load(open(sys.argv[1]))))' \
    "$OUT/spec_serve.json" | tee "$OUT/spec_serve.txt"
fi
