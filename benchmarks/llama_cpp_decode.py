"""llama.cpp's CPU decode speed on one GGUF file, for benchmarks/cpu_decode.py --llama-cpp.

Benchmark-only: run by the interpreter of a separate venv that has llama-cpp-python (never a
Kestrel dependency; README "Benchmarks"). It imports nothing from this repository.

Reads the prompt's token ids (the chat template already applied by the caller, so both
engines decode from the same ids), loads the GGUF with `llama_cpp.Llama` and decodes
greedily (`Llama.generate` with temperature 0; it does not stop at EOS, like Kestrel's
`ignore_eos`):
- batch 1: one stream of --tokens tokens; decode tok/s = (tokens - 1) / (time of the last
  token - time of the first), the first token coming after the prefill (the same definition
  as cpu_decode.py's HTTP numbers);
- 8 sequential: --sequential streams one after another from a cleared cache, aggregate tok/s
  = all tokens / wall time including each prefill (what cpu_decode.py's 8 concurrent streams
  are set against; llama-cpp-python's `Llama` decodes one sequence).
Prints one JSON object on stdout.

Usage: /work/llamacpp-venv/bin/python benchmarks/llama_cpp_decode.py --gguf FILE
       --prompt-ids 1,2,3 --tokens 128 [--threads 1] [--sequential 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def decode(llm, ids: list[int], n: int) -> tuple[list[float], list[int]]:
    """One greedy stream of n tokens from a cleared cache: (token times, token ids)."""
    llm.reset()  # n_tokens 0: the next eval drops the cache from position 0
    times, out = [], []
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == n:
            break
    return times, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequential", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=1024)
    a = ap.parse_args()
    import llama_cpp

    ids = [int(x) for x in a.prompt_ids.split(",")]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(a.gguf, n_ctx=a.n_ctx, n_batch=512, n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)
    load_s = time.perf_counter() - t0
    decode(llm, ids, 8)  # warm-up
    t0 = time.perf_counter()
    times, toks = decode(llm, ids, a.tokens)
    res = {"llama_cpp_python": llama_cpp.__version__, "threads": a.threads, "load_seconds": load_s,
           "prompt_tokens": len(ids), "batch1_decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
           "ttft_s": times[0] - t0, "batch1_token_ids": toks}
    if a.sequential > 0:
        t0 = time.perf_counter()
        for _ in range(a.sequential):
            decode(llm, ids, a.tokens)
        wall = time.perf_counter() - t0
        res.update({f"sequential{a.sequential}_tok_s": a.sequential * a.tokens / wall,
                    f"sequential{a.sequential}_wall_s": wall})
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
