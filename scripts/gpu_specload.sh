#!/usr/bin/env bash
# Issue 15's re-measure (speculation on >= 0.97x of off at 32 and 256 concurrent requests):
# scripts/gpu_spec_serve.sh at c32 and c256, copy and nocopy rows, REPEATS (3) rounds, without
# the compile-watch GPU test (JIT_TEST=1 adds it, ~30 s). One device call (carry .whl), about
# 2.5-3.5 minutes (the 2026-12-03 run of these levels took 117 s of benchmark after the start-ups).
# Each row's `rounds` now carry per run the engine's synchronous plans, verify steps, probes and
# n-gram lookups (benchmarks/spec_serve.py), so a spec run that pays for nothing shows it.
# With --one-server (2026-12-07) one spec server measures both sides, speculation switched off for
# each plain run (POST /debug/speculation): two servers differed by +-10% a round at c256, more than
# the 3% the target resolves. Run from the repo root:  bash scripts/gpu_specload.sh [more spec_serve.py flags]
set -u
JIT_TEST="${JIT_TEST:-0}" exec bash "$(dirname "$0")/gpu_spec_serve.sh" --concurrency 32 256 \
  --repeats "${REPEATS:-3}" "$@"
