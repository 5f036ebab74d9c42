"""The CPU cost of a speculative verify step against a plain decode step (issue 15).

SmolLM2-135M (models/SmolLM2-135M-Instruct, fp32) on the CPU, --threads torch threads: one
200-token prefill, then `ModelRunner.execute` on hand-made plans of one sequence at
--context tokens: k = 0 (a decode step, 1 token) and k = 1, 2, 4, 8 (a verify step of
k drafts: k + 1 tokens, logits at each). The same positions are rewritten each step.
Median of --reps executes per k, ms. --no-pack keeps the dense MKL weights
(`kernels.cpu_linear.PACK_WEIGHTS = False`) for an A/B in one run of the tree.
JSON (settings, ms per k, ratio to k = 0) to --out and stdout.

Usage: .venv/bin/python benchmarks/cpu_verify_cost.py [--threads 1] [--no-pack] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit_json  # noqa: E402
from kernels import cpu_linear  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-pack", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    cpu_linear.PACK_WEIGHTS = not args.no_pack
    cfg = build_config({"model": args.model, "device": "cpu", "num_threads": args.threads,
                        "kv_cache_gib": 0.2}, env={})
    runner = ModelRunner(cfg)
    ctx, bs = args.context, cfg.block_size
    table = list(range(-(-(ctx + 16) // bs)))
    sp = SamplingParams(temperature=0.0, max_tokens=1000)
    step = [0]

    def run(k: int, first: bool = False) -> float:
        step[0] += 1
        seq = ScheduledSeq(request_id="a", token_ids=list(range(100, 100 + ctx)) if first else [5] * (1 + k),
                           start_pos=0 if first else ctx, block_table=table if first else [], sample=True,
                           sampling=sp if first else None, output_index=0, num_draft=0 if first else k,
                           table_start=0 if first else len(table))
        t = time.perf_counter()
        runner.execute(StepPlan(step_id=step[0], seqs=[seq]))
        return time.perf_counter() - t

    run(0, first=True)
    ms = {k: round(statistics.median(run(k) for _ in range(args.reps)) * 1000, 2) for k in (0, 1, 2, 4, 8)}
    emit_json({"model": args.model, "threads": args.threads, "context": ctx, "reps": args.reps,
               "packed_weights": cpu_linear.PACK_WEIGHTS, "ms_per_step": ms,
               "ratio_to_decode": {k: round(v / ms[0], 2) for k, v in ms.items()}}, args.out)


if __name__ == "__main__":
    main()
