"""CPU decode speed through the HTTP API, against HF transformers in the same run.

Measures, for SmolLM2-135M-Instruct (fp32, CPU):
- kestrel batch 1: decode tok/s of one stream (tokens after the first / time after the first);
- kestrel 8 concurrent: aggregate output tok/s of 8 streams (all tokens / wall time);
- transformers `generate` at batch 1 and batch 8 (greedy, same token counts, same threads).
With `--quantization none int8 int4 gguf` (Kestrel's `--quantization`, weight-only on the CPU,
kernels/cpu_quant_linear.py; gguf loads the int4 groups from the GGUF the model folder records,
services/worker/gguf_loader.py: run `kestrel fetch-model` once so that the folder has its
record) one server per scheme runs in the same process, batch 1 only (`--concurrent` adds the
8-stream number), and the JSON gives each scheme's tok/s, its worker's load seconds (from the
startup report in the server log) and its ratio to the first scheme's (`none` when listed first).
Prints JSON with the ratios and writes it to benchmarks/results/ (or --out).

Usage: .venv/bin/python benchmarks/cpu_decode.py [--model DIR] [--tokens 128] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode.py --quantization none int8 int4 gguf [--no-hf]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.e2e.server import KestrelServer  # noqa: E402

PROMPT = "Write a long story about a falcon that learns to fly over the mountains."


def stream_one(base_url: str, model: str, n: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return {"start": t0, "times": times}


def worker_facts(srv: KestrelServer) -> dict:
    """The first worker's load seconds and weight bytes (held after quantization) from the
    running server's startup report (`<runtime_dir>/startup_report.json`); {} if unreadable."""
    try:
        with open(os.path.join(srv.runtime_dir, "startup_report.json")) as fh:
            w = json.load(fh)["workers"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {}
    return {k: w[k] for k in ("load_seconds", "weight_bytes", "weight_bytes_held", "gguf_tensors") if k in w}


def kestrel_numbers(model_dir: str, n: int, *extra: str, concurrent: bool = True) -> dict:
    with KestrelServer(model_dir, *extra) as srv:
        name = os.path.basename(os.path.normpath(model_dir))
        stream_one(srv.base_url, name, 8)  # warm-up
        one = stream_one(srv.base_url, name, n)
        t = one["times"]
        b1 = (len(t) - 1) / (t[-1] - t[0])
        if not concurrent:
            return {"batch1_decode_tok_s": b1, "ttft_s": t[0] - one["start"], "worker": worker_facts(srv)}
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda _: stream_one(srv.base_url, name, n), range(8)))
        wall = time.perf_counter() - t0
        chunks = sum(len(o["times"]) for o in outs)
        return {"batch1_decode_tok_s": b1, "ttft_s": t[0] - one["start"],
                "concurrent8_tok_s": 8 * n / wall, "concurrent8_wall_s": wall,
                "concurrent8_content_chunks": chunks}


def hf_numbers(model_dir: str, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    res = {}
    for bs in (1, 8):
        enc = tok([text] * bs, return_tensors="pt", padding=True)
        kw = dict(do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, **kw)
            total = time.perf_counter() - t0
        res[f"batch{bs}_decode_tok_s"] = bs * (n - 1) / max(total - prefill, 1e-9)
        res[f"batch{bs}_total_tok_s"] = bs * n / total
    return res


def quantization_run(a: argparse.Namespace) -> int:
    """One server per `--quantization` scheme, batch-1 decode tok/s (and 8 concurrent with
    --concurrent), ratios against the first scheme and transformers' fp32 batch 1."""
    import torch

    load_start = os.getloadavg()  # the machine's load before this run adds its own
    hf = None if a.no_hf else hf_numbers(a.model, a.tokens)
    runs = {q: kestrel_numbers(a.model, a.tokens, "--quantization", q, concurrent=a.concurrent)
            for q in a.quantization}
    base = runs[a.quantization[0]]["batch1_decode_tok_s"]
    result = {
        "benchmark": "cpu_decode_quantization", "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "load_avg_start": load_start,
        "load_avg": os.getloadavg(),
        "torch_threads": torch.get_num_threads(), "tokens": a.tokens, "kestrel": runs,
        "transformers": hf, "baseline": a.quantization[0],
        "ratio_batch1_vs_baseline": {q: r["batch1_decode_tok_s"] / base for q, r in runs.items()},
        **({"ratio_batch1_vs_hf": {q: r["batch1_decode_tok_s"] / hf["batch1_decode_tok_s"]
                                   for q, r in runs.items()}} if hf else {}),
    }
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"cpu_decode_quant-{result['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quantization", nargs="+", choices=("none", "int8", "int4", "gguf"), default=None,
                    help="time each weight scheme at batch 1 in this run (ratios vs the first)")
    ap.add_argument("--concurrent", action="store_true", help="with --quantization: 8 streams too")
    ap.add_argument("--no-hf", action="store_true", help="with --quantization: skip transformers")
    a = ap.parse_args()
    import torch

    if a.quantization:
        return quantization_run(a)
    hf = hf_numbers(a.model, a.tokens)
    ks = kestrel_numbers(a.model, a.tokens)
    result = {
        "benchmark": "cpu_decode", "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "tokens": a.tokens,
        "kestrel": ks, "transformers": hf,
        "ratio_batch1": ks["batch1_decode_tok_s"] / hf["batch1_decode_tok_s"],
        "ratio_concurrent8_vs_hf_batch8": ks["concurrent8_tok_s"] / hf["batch8_total_tok_s"],
        "ratio_concurrent8_vs_hf_batch1": ks["concurrent8_tok_s"] / hf["batch1_total_tok_s"],
    }
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"cpu_decode-{result['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
