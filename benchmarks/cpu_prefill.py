"""CPU prefill: time to the first token's logits of long prompts, Kestrel's model runner against
one transformers forward in the same run (issue 17, "CPU prefill": target <= 1.0x).

Model: SmolLM2-135M-Instruct (fp32, CPU) by default. Per prompt length of --tokens (default
1024 4096 8192, random token ids): Kestrel's `ModelRunner` (in process, no HTTP) prefills it in
chunks of --chunk tokens (default 1024, the cpu profile's max_num_batched_tokens), each chunk
one step over the paged KV cache, with the attention of chunks after a prefix split into
prefix + causal parts (`kernels.attention.SPLIT_MIN_Q`) and, as a baseline in the same run,
with that split off (one masked call); then transformers' `AutoModelForCausalLM` (sdpa) runs the
whole prompt in one forward (logits of the last position only). Both on the same threads
(--threads, default the worker's: torch's current count). Median of --repeats. Writes JSON
(seconds and ratios to transformers) to --out and stdout.

Usage: .venv/bin/python benchmarks/cpu_prefill.py [--tokens 1024 4096 8192] [--chunk 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels import attention  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.runner_driver import step_logits  # noqa: E402


def kestrel_prefill_s(runner: ModelRunner, ids: list[int], chunk: int) -> float:
    """Seconds to prefill `ids` in chunks (the last chunk's logits computed)."""
    table = list(range(-(-len(ids) // runner.block_size)))
    g = SamplingParams(temperature=0.0)
    t0 = time.perf_counter()
    for s in range(0, len(ids), chunk):
        e = min(len(ids), s + chunk)
        step_logits(runner, StepPlan(0, [ScheduledSeq("r", ids[s:e], s, table, True, g)]))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: keep the default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    longest = max(a.tokens)
    runner = ModelRunner(build_config(cli={"model": a.model, "device": "cpu", "max_model_len": longest,
                                           "kv_cache_gib": 2.0, "num_threads": threads}, env={}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    rows = []
    split_min = attention.SPLIT_MIN_Q
    for n in a.tokens:
        ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        times: dict[str, list[float]] = {"kestrel": [], "kestrel_masked": [], "transformers": []}
        for _ in range(a.repeats):
            attention.SPLIT_MIN_Q = split_min
            times["kestrel"].append(kestrel_prefill_s(runner, ids, a.chunk))
            attention.SPLIT_MIN_Q = 1 << 30  # the baseline: one masked call a chunk
            times["kestrel_masked"].append(kestrel_prefill_s(runner, ids, a.chunk))
            attention.SPLIT_MIN_Q = split_min
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf(torch.tensor([ids]), logits_to_keep=1)
                times["transformers"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"tokens": n, **{f"{k}_s": round(v, 3) for k, v in med.items()},
                     "ratio_vs_transformers": round(med["kestrel"] / med["transformers"], 3),
                     "masked_ratio_vs_transformers": round(med["kestrel_masked"] / med["transformers"], 3)})
        print(rows[-1], flush=True)
    res = {"benchmark": "cpu_prefill", "model": a.model, "chunk": a.chunk, "threads": threads,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "target_ratio": 1.0, "rows": rows}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
