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

With `--llama-cpp` (and --quantization) the same run also decodes with llama.cpp on the GGUF
file that `--quantization gguf` serves (the model folder's record, or --gguf), in a subprocess
of a separate interpreter that has llama-cpp-python (--llama-cpp-python; benchmark-only, never
a Kestrel dependency: benchmarks/llama_cpp_decode.py), greedy, from the same prompt token ids
(the tokenizer's chat template) and token count: batch 1 and 8 streams one after another.
Every Kestrel scheme runs batch 1 and 8 concurrent. `--repeats R` runs R rounds, the engines'
order reversed every other round (the machine is shared); the JSON gives each round, the
median / min / max of each figure, and the ratios Kestrel / llama.cpp per round (median and
spread) against the targets (batch 1 >= 1.0x, 8 concurrent >= 2.0x llama.cpp's 8 sequential).

Usage: .venv/bin/python benchmarks/cpu_decode.py [--model DIR] [--tokens 128] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode.py --quantization none int8 int4 gguf [--no-hf]
       .venv/bin/python benchmarks/cpu_decode.py --quantization int8 int4 gguf --llama-cpp \
           --llama-cpp-python /work/llamacpp-venv/bin/python --repeats 3 --out FILE
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
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


TARGETS = {"batch1": 1.0, "concurrent8_vs_sequential8": 2.0}  # Kestrel / llama.cpp (issue 17)


def prompt_ids(model_dir: str) -> list[int]:
    """PROMPT's token ids after the tokenizer's chat template (generation prompt added): what
    the chat endpoint decodes from."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def gguf_file(model_dir: str) -> str:
    """The GGUF file the model folder records (kestrel_gguf.json, written by `kestrel
    fetch-model`). Raises FileNotFoundError without one."""
    rec = os.path.join(model_dir, "kestrel_gguf.json")
    with open(rec) as fh:
        path = json.load(fh)["gguf_file"]
    path = path if os.path.isabs(path) else os.path.normpath(os.path.join(model_dir, path))
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


def llama_cpp_numbers(a: argparse.Namespace, gguf: str, ids: list[int]) -> dict:
    """One benchmarks/llama_cpp_decode.py run under a.llama_cpp_python (its JSON)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_decode.py")
    cmd = [a.llama_cpp_python, script, "--gguf", gguf, "--prompt-ids", ",".join(map(str, ids)),
           "--tokens", str(a.tokens), "--threads", str(a.llama_cpp_threads), "--sequential", "8"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def llama_cpp_run(a: argparse.Namespace) -> int:
    """Kestrel's schemes and llama.cpp in one run, a.repeats rounds interleaved (module doc)."""
    import torch

    load_start = os.getloadavg()
    gguf = a.gguf or gguf_file(a.model)
    ids = prompt_ids(a.model)
    extra = ("--num-threads", str(a.kestrel_threads)) if a.kestrel_threads else ()
    engines = [*a.quantization, "llama.cpp"]
    rounds = []
    for r in range(a.repeats):
        rnd: dict = {}
        for eng in (engines if r % 2 == 0 else engines[::-1]):
            if eng == "llama.cpp":
                rnd[eng] = llama_cpp_numbers(a, gguf, ids)
            else:
                rnd[eng] = kestrel_numbers(a.model, a.tokens, "--quantization", eng, *extra)
            print(f"round {r} {eng}: b1 {rnd[eng]['batch1_decode_tok_s']:.1f} tok/s", file=sys.stderr)
        rounds.append(rnd)
    llama_ids = rounds[0]["llama.cpp"].get("batch1_token_ids", [])
    for rnd in rounds:
        rnd["llama.cpp"].pop("batch1_token_ids", None)
    summary: dict = {}
    ratios: dict = {}
    for eng in engines:
        keys = ["batch1_decode_tok_s", "sequential8_tok_s" if eng == "llama.cpp" else "concurrent8_tok_s"]
        summary[eng] = {k: spread([rnd[eng][k] for rnd in rounds]) for k in keys}
    for q in a.quantization:
        b1 = [rnd[q]["batch1_decode_tok_s"] / rnd["llama.cpp"]["batch1_decode_tok_s"] for rnd in rounds]
        c8 = [rnd[q]["concurrent8_tok_s"] / rnd["llama.cpp"]["sequential8_tok_s"] for rnd in rounds]
        ratios[q] = {"batch1": spread(b1), "concurrent8_vs_sequential8": spread(c8),
                     "batch1_target_met": statistics.median(b1) >= TARGETS["batch1"],
                     "concurrent8_target_met": statistics.median(c8) >= TARGETS["concurrent8_vs_sequential8"]}
    result = {
        "benchmark": "cpu_decode_llama_cpp", "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "load_avg_start": load_start,
        "load_avg": os.getloadavg(), "torch_threads_here": torch.get_num_threads(),
        "kestrel_threads": a.kestrel_threads or "derived", "llama_cpp_threads": a.llama_cpp_threads,
        "tokens": a.tokens, "prompt_tokens": len(ids), "gguf": os.path.basename(gguf),
        "repeats": a.repeats, "targets": TARGETS, "ratios_kestrel_over_llama_cpp": ratios,
        "summary": summary, "llama_cpp_batch1_first_ids": llama_ids[:16], "rounds": rounds,
    }
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"cpu_decode_llama_cpp-{result['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: result[k] for k in ("ratios_kestrel_over_llama_cpp", "summary")}, indent=2))
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
    ap.add_argument("--llama-cpp", action="store_true",
                    help="with --quantization: llama.cpp on the same GGUF in the same run")
    ap.add_argument("--llama-cpp-python", default="/work/llamacpp-venv/bin/python",
                    help="an interpreter with llama-cpp-python (benchmark-only)")
    ap.add_argument("--llama-cpp-threads", type=int, default=1)
    ap.add_argument("--kestrel-threads", type=int, default=0, help="kestrel serve --num-threads (0: derived)")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: the model folder's record)")
    ap.add_argument("--repeats", type=int, default=1, help="with --llama-cpp: rounds, order alternating")
    a = ap.parse_args()
    import torch

    if a.llama_cpp:
        if not a.quantization:
            ap.error("--llama-cpp needs --quantization")
        return llama_cpp_run(a)
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
