"""Offline throughput: nano-vllm's workload through the in-process engine.

Workload (nano-vllm's bench.py): 256 sequences; python `random.seed(0)`; prompt lengths
U[100, 1024] of random ids in [0, 10000]; output lengths U[100, 1024] with ignore_eos;
temperature 0.6. Model: a config of benchmarks/configs with dummy weights (default
Qwen3-0.6B, bf16). The engine runs in this process: an `EngineCore` runs its steps on an
`InProcessExecutor` over the `ModelRunner` (benchmarks/common.py `offline_run`; no HTTP, no
ZMQ). Output tok/s = sum of output lengths / wall time from the first plan to the last token
(after a short warm-up run).
Writes JSON (settings, runner report, seconds, steps, tok/s) to --out and stdout.

--quantization fp8 quantizes the dummy bf16 weights at load (kernels/fp8_linear.py).

Usage: python benchmarks/offline_throughput.py [--config qwen3-0.6b] [--out FILE] [--num-seqs N]
       [--quantization none|fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, load_runner, model_dir, offline_run  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none",
                    help="weights: bf16 (none) or fp8 e4m3 quantized at load (kernels/fp8_linear.py)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "int8"],
                    help="the KV cache's dtype (auto: the model's; docs/ARCHITECTURE.md §4.6)")
    a = ap.parse_args()
    cli = {"model": model_dir(a.config), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
           "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
           "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
           "gpu_memory_utilization": 0.9, "enable_prefix_caching": False, "quantization": a.quantization,
           "kv_cache_dtype": a.kv_cache_dtype}
    runner, startup = load_runner(cli)
    report = runner.report()
    print("runner:", json.dumps(report), flush=True)
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(a.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024), seed=i)
              for i in range(a.num_seqs)]
    run = offline_run(runner, a.max_num_seqs, a.max_num_batched_tokens, prompts, params)
    res = {"benchmark": "offline_throughput", "device": device_name(), "config": a.config,
           "weights": "dummy", "num_seqs": a.num_seqs, **run, "startup_seconds": round(startup, 2),
           "settings": {k: v for k, v in cli.items() if k != "model"}, "runner": report,
           "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
