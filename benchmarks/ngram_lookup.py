"""The engine's per-step cost of n-gram drafting (issue 15, docs/ARCHITECTURE.md §5.5).

--requests requests (`services.engine.request.Request`) with random prompts of --prompt
tokens over a --vocab vocabulary (a repeated span in every other one, so half of them
match); then --steps decode steps, each appending 1 to 5 tokens per request (a decode, or
a verify's accepted drafts) and looking every request up for k = --k drafts:
- `NgramDrafter.propose` (the engine's, `shared.ngram.NgramIndex` kept on the request);
- `shared.ngram.ngram_lookup` over the whole context as a numpy array (the stateless form,
  which the worker's proposer ran), for comparison.
The first lookup of a request indexes its prompt (reported apart: `first_ms`). Reported:
microseconds per step for all requests (median over the steps), and per request.
JSON to --out and stdout. CPU only; indicative on a shared machine.

Usage: .venv/bin/python benchmarks/ngram_lookup.py [--requests 256] [--prompt 1000] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit_json  # noqa: E402
from services.engine.ngram_drafts import NgramDrafter  # noqa: E402
from services.engine.request import Request  # noqa: E402
from shared.ngram import ngram_lookup  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(0)
    reqs = []
    for i in range(a.requests):
        p = [rng.randrange(a.vocab) for _ in range(a.prompt)]
        if i % 2:
            p[-50:] = p[100:150]  # the prompt's tail repeats an earlier span: a match
        reqs.append(Request(f"r{i}", b"fe", p, SamplingParams(max_tokens=a.steps * 5)))
    drafter = NgramDrafter(a.min_n, a.max_n)
    t0 = time.perf_counter()
    for r in reqs:
        drafter.propose(r, a.k)
    first = time.perf_counter() - t0
    idx_us, np_us, hits = [], [], 0
    for _ in range(a.steps):
        for r in reqs:
            r.output_token_ids.extend(rng.randrange(a.vocab) for _ in range(rng.randint(1, 5)))
        t0 = time.perf_counter()
        for r in reqs:
            hits += bool(drafter.propose(r, a.k))
        idx_us.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        for r in reqs:
            ngram_lookup(np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int64), a.min_n, a.max_n, a.k)
        np_us.append((time.perf_counter() - t0) * 1e6)
    res = {"settings": vars(a), "first_ms": first * 1e3,
           "index_us_per_step": statistics.median(idx_us),
           "index_us_per_request": statistics.median(idx_us) / a.requests,
           "numpy_us_per_step": statistics.median(np_us),
           "numpy_us_per_request": statistics.median(np_us) / a.requests,
           "hit_share": hits / (a.steps * a.requests)}
    emit_json(res, a.out)


if __name__ == "__main__":
    main()
