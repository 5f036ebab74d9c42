"""Offline throughput: nano-vllm's workload through the in-process engine.

Workload (nano-vllm's bench.py): 256 sequences; python `random.seed(0)`; prompt lengths
U[100, 1024] of random ids in [0, 10000]; output lengths U[100, 1024] with ignore_eos;
temperature 0.6. Model: a config of benchmarks/configs with dummy weights (default
Qwen3-0.6B, bf16). The engine runs in this process: `Scheduler` + `BlockManager` drive
`ModelRunner.run_step` directly (no HTTP, no ZMQ). Output tok/s = sum of output lengths /
wall time from the first schedule to the last token (after a short warm-up run).
Writes JSON (settings, runner report, seconds, steps, tok/s) to --out and stdout.

Usage: python benchmarks/offline_throughput.py [--config qwen3-0.6b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, model_dir  # noqa: E402
from services.engine.block_manager import BlockManager  # noqa: E402
from services.engine.request import Request  # noqa: E402
from services.engine.scheduler import Scheduler  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


def run_engine(runner, sched, requests) -> tuple[float, int, dict]:
    """Add requests, step until done. Returns (seconds, steps, timings): the host seconds
    spent scheduling and applying results (`schedule_seconds`, `update_seconds`), the wall
    seconds inside `run_step` (`run_step_seconds`: host prepare + launch + the wait for the
    sampled ids) and the GPU seconds of the steps (`gpu_seconds`: CUDA events around each
    run_step, read at the end so that timing adds no sync)."""
    for r in requests:
        sched.add(r)
    steps, t_model, t_sched, t_upd = 0, 0.0, 0.0, 0.0
    events = []
    t0 = time.perf_counter()
    while sched.has_work():
        t1 = time.perf_counter()
        out = sched.schedule()
        t2 = time.perf_counter()
        t_sched += t2 - t1
        if out is None or not out.plan.seqs:
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        result = runner.run_step(out.plan)
        b.record()
        seqs = out.plan.seqs
        events.append((a, b, len(seqs), sum(len(q.token_ids) for q in seqs),
                       sum(q.start_pos + len(q.token_ids) for q in seqs)))
        t3 = time.perf_counter()
        t_model += t3 - t2
        sched.update(out, result.sampled_token_ids, result.logprobs, result.prompt_logprobs)
        t_upd += time.perf_counter() - t3
        steps += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gpu = sum(e[0].elapsed_time(e[1]) for e in events) / 1e3
    return seconds, steps, {"schedule_seconds": round(t_sched, 3), "update_seconds": round(t_upd, 3),
                            "run_step_seconds": round(t_model, 3), "gpu_event_seconds": round(gpu, 3),
                            "gpu_by_step_kind": step_breakdown(events, runner)}


def step_breakdown(events, runner) -> dict:
    """GPU time of the steps grouped by kind: steps with prefill tokens, and decode-only
    steps by batch size (1-16, 17-64, 65-128, 129-256, more). Per group: steps, GPU seconds,
    mean ms per step, KV bytes read by attention (context tokens x bytes of K and V per
    token over all layers) and that over the group's GPU time in TB/s (an upper bound of
    the attention's own bandwidth: the group's time includes the rest of the step).
    events: (start event, end event, seqs, new tokens, context tokens) per step."""
    layers, kvh, hd = runner.model.kv_shape()
    per_tok = 2 * layers * kvh * hd * runner.dtype.itemsize
    groups: dict[str, list] = {}
    for a, b, nseq, ntok, ctx in events:
        if ntok > nseq:
            key = "prefill"
        else:
            key = next(f"decode_b{lo}-{hi}" for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256),
                                                           (257, 1 << 30)) if nseq <= hi)
        g = groups.setdefault(key, [0, 0.0, 0])
        g[0] += 1
        g[1] += a.elapsed_time(b) / 1e3
        g[2] += ctx * per_tok
    out = {k: {"steps": n, "gpu_seconds": round(t, 3), "ms_per_step": round(1e3 * t / n, 3),
               "kv_bytes": kv, "kv_TBps": round(kv / t / 1e12, 3) if t else None}
           for k, (n, t, kv) in sorted(groups.items())}
    out["prefill_steps"] = [{"seqs": nseq, "tokens": ntok, "ms": round(a.elapsed_time(b), 2)}
                            for a, b, nseq, ntok, _ in events if ntok > nseq]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cli = {"model": model_dir(a.config), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
           "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
           "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
           "gpu_memory_utilization": 0.9, "enable_prefix_caching": False}
    cfg = build_config(cli=cli, env={})
    t0 = time.perf_counter()
    runner = ModelRunner(cfg)
    startup = time.perf_counter() - t0
    report = runner.report()
    print("runner:", json.dumps(report), flush=True)

    def scheduler():
        bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        return Scheduler(bm, a.max_num_seqs, a.max_num_batched_tokens, runner.max_model_len, [])

    # warm-up: prefill chunks, mixed steps and decode batches of several sizes, so that no
    # kernel variant compiles inside the timed run
    wr = random.Random(1)
    warm = [Request(f"w{i}", b"", [wr.randint(0, 10000) for _ in range(wr.randint(20, 1024))],
                    SamplingParams(temperature=0.6, seed=i, max_tokens=wr.randint(1, 24), ignore_eos=True))
            for i in range(64)]
    run_engine(runner, scheduler(), warm)
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(a.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024), seed=i)
              for i in range(a.num_seqs)]
    reqs = [Request(f"r{i}", b"", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    seconds, steps, timing = run_engine(runner, scheduler(), reqs)
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    assert out_tokens == sum(sp.max_tokens for sp in params), "a request ended early"
    res = {"benchmark": "offline_throughput", "device": device_name(), "config": a.config,
           "weights": "dummy", "num_seqs": a.num_seqs, "prompt_tokens": sum(map(len, prompts)),
           "output_tokens": out_tokens, "seconds": round(seconds, 3), "steps": steps,
           "output_tok_per_s": round(out_tokens / seconds, 1),
           "total_tok_per_s": round((out_tokens + sum(map(len, prompts))) / seconds, 1),
           **timing, "startup_seconds": round(startup, 2),
           "settings": {k: v for k, v in cli.items() if k != "model"}, "runner": report,
           "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
