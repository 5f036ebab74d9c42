"""HTTP serving benchmark: streamed /v1/completions against a real `kestrel serve`, at
several concurrency levels, against the offline throughput of the same prompts.

Server: `python -m services.cli serve` (this interpreter, PYTHONPATH passed through, KESTREL_*
variables not: only this script's settings apply) as a subprocess in its own session, on a
free port, torn down at the end, also on error or SIGTERM (SIGTERM, then SIGKILL of its
process group). Its log goes to a temp file (path in the JSON; tail printed on failure).
Model: a config of benchmarks/configs (default Qwen3-0.6B) with dummy weights, bf16 on CUDA,
or `--model DIR`, a real folder (its weights and tokenizer). A config-only folder gets a
synthetic tokenizer (benchmarks/common.py `write_synthetic_tokenizer`: id i <-> "t<i>"),
because the frontend needs tokenizer.json; prompts are token-id lists, so only output
detokenization uses it. Settings shared by server and offline run: max_num_seqs (default
the highest concurrency), max_num_batched_tokens 16384, max_model_len 4096, prefix caching
off, gpu_memory_utilization 0.9 (as benchmarks/offline_throughput.py).

Workload: per level, max(concurrency * 2, 8) requests (--requests-per-concurrency,
--min-requests), each a prompt of --prompt-len (1024) random token ids in [0, 10000]
(`random.Random(seed * 1000003 + concurrency)`: every level its own prompts), max_tokens
--output-len (128), ignore_eos, temperature 0.6, `stream: true` with
`stream_options.include_usage`. Each level keeps `concurrency` requests in flight, from
--client-procs processes (benchmarks/serve_client.py: asyncio + httpx each; auto: one per
32 streams, at most a quarter of the cores) so that parsing the stream never limits the
server; all start at one instant.
Before the levels, and again before the offline run, --warmup-requests (8) requests of
the same lengths (not measured) warm the server, then the in-process engine, up.
Metrics per level (definitions in benchmarks/serve_stats.py): TTFT (sent -> first content
chunk), TPOT ((last - first content chunk) / (output tokens - 1)), ITL (gaps between
content chunks; a chunk may hold several tokens, so tokens are counted from the stream's
usage, never from chunks), p50/p99/mean in ms; output tok/s (usage.completion_tokens of the
successful requests / level wall time); requests and errors (HTTP errors, error events,
no usage, fewer tokens than asked).
Offline (--offline, default on): after the server stopped, the highest level's prompts with
the same output length and temperature through the in-process engine
(benchmarks/common.py `offline_run`, as benchmarks/offline_throughput.py); ratio = HTTP
output tok/s at the highest concurrency / offline output tok/s (issue #5: >= 0.85 at 256 on
an H200).
Writes JSON (settings, device, per-level results, offline result, ratio) to --out and
prints a table last. Exit status 1 if any request failed.

Usage:
  python benchmarks/serve_bench.py [--config qwen3-0.6b] [--concurrency 1 16 64 256] [--out FILE]
  python benchmarks/serve_bench.py --model models/SmolLM2-135M-Instruct --device cpu \\
      --prompt-len 64 --output-len 8 --concurrency 1 4 --offline        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_name, load_runner, model_dir, offline_run  # noqa: E402
from benchmarks.serve_client import default_client_procs, make_prompts, run_level, start_pool  # noqa: E402
from benchmarks.serve_process import ServeProcess, serve_flags  # noqa: E402
from benchmarks.serve_stats import summarize  # noqa: E402


def server_cpu(server: ServeProcess) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of the server, by process
    title (e.g. "kestrel:engine"; processes that share a title are summed)."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for pr in procs:
        try:
            title = (pr.cmdline() or ["?"])[0].strip().split(" ")[0]
            t = pr.cpu_times()
            out[title] = out.get(title, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return out


def engine_steps(server: ServeProcess) -> int:
    """The engine's step count (its `stats` utility through the frontend)."""
    return int(server.engine_stats().get("num_steps", 0))


def _row(c, r: dict) -> str:
    def pair(m):
        return f"{m['p50']:.1f} / {m['p99']:.1f}" if m["p50"] is not None else "-"
    tps = f"{r['output_tok_per_s']:.1f}" if r["output_tok_per_s"] else "-"
    return (f"{c:>7} {r['requests']:>5} {r['errors']:>4} {tps:>11} {pair(r['ttft_ms']):>17} "
            f"{pair(r['tpot_ms']):>17} {pair(r['itl_ms']):>17}")


def table(res: dict) -> str:
    """The short human-readable summary printed last."""
    w = res["workload"]
    lines = [f"serve_bench: {res['model']} ({res['weights']} weights) on {res['device']}, "
             f"prompt {w['prompt_len']}, output {w['output_len']} tokens",
             f"{'conc':>7} {'reqs':>5} {'err':>4} {'out tok/s':>11} {'TTFT p50/p99 ms':>17} "
             f"{'TPOT p50/p99 ms':>17} {'ITL p50/p99 ms':>17}"]
    lines += [_row(lv["concurrency"], lv) for lv in res["levels"]]
    if res["offline"]:
        lines.append(f"{'offline':>7} {res['offline']['requests']:>5} {'':>4} "
                     f"{res['offline']['output_tok_per_s']:>11.1f}")
        lines.append(f"HTTP / offline output tok/s at concurrency {res['ratio_concurrency']}: "
                     f"{res['ratio']} (issue #5 target >= 0.85 at 256 on an H200)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3-0.6b", help="benchmarks/configs name (dummy weights)")
    ap.add_argument("--model", default=None, help="a real model folder instead of --config")
    ap.add_argument("--load-format", default=None, help="default: dummy for --config, auto for --model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the server's (bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests-per-concurrency", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--client-procs", type=int, default=0, help="0: auto")
    ap.add_argument("--frontends", type=int, default=1, help="frontend processes sharing the port")
    ap.add_argument("--server-args", default="", help="more `kestrel serve` flags, one string "
                    "(e.g. --server-args=--no-async-scheduling)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # SIGTERM (e.g. from `timeout`) unwinds like an exception, so the server is torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    top = max(a.concurrency)
    settings = {
        "model": os.path.abspath(a.model) if a.model else model_dir(a.config, tokenizer=True),
        "load_format": a.load_format or ("auto" if a.model else "dummy"),
        "device": a.device, "dtype": a.dtype, "max_num_seqs": a.max_num_seqs or top,
        "max_num_batched_tokens": a.max_num_batched_tokens, "max_model_len": a.max_model_len,
        "enforce_eager": a.enforce_eager, "gpu_memory_utilization": a.gpu_memory_utilization,
        "enable_prefix_caching": False}
    procs = a.client_procs or default_client_procs(top)
    body = {"max_tokens": a.output_len, "temperature": a.temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    prompts = {c: make_prompts(max(c * a.requests_per_concurrency, a.min_requests), a.prompt_len,
                               a.seed * 1000003 + c) for c in a.concurrency}
    # Shutdown drains in-flight requests; only a failed run has any, and it needs no drain.
    server = ServeProcess([*serve_flags(settings), "--max-num-waiting", str(max(256, top)),
                           "--shutdown-timeout", "5", "--frontends", str(a.frontends),
                           *a.server_args.split()])
    # The same warm-up, not measured, before the levels and before the offline run.
    warm = make_prompts(a.warmup_requests, a.prompt_len, a.seed * 1000003 - 1)
    levels = []
    pool = start_pool(procs)
    try:
        server.start(a.startup_timeout)
        body["model"] = server.model_name()
        url = server.base_url + "/v1/completions"
        if warm:
            run_level(pool, procs, url, body, warm, min(a.warmup_requests, top), a.request_timeout)
        for c in a.concurrency:
            cpu0, steps0 = server_cpu(server), engine_steps(server)
            records = run_level(pool, procs, url, body, prompts[c], c, a.request_timeout)
            lv = {"concurrency": c, "client_procs": min(procs, c), **summarize(records)}
            lv["engine_steps"] = engine_steps(server) - steps0
            lv["server_cpu_ms_per_step"] = {k: round(1e3 * (v - cpu0.get(k, 0.0)) / max(lv["engine_steps"], 1), 3)
                                            for k, v in server_cpu(server).items()}
            levels.append(lv)
            print(json.dumps(lv), flush=True)
    except BaseException:
        print(f"serve_bench failed; server log {server.log_path}:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()  # first: requests still in flight then fail at once and the pool can end
        pool.shutdown(wait=True, cancel_futures=True)
    offline = None
    if a.offline:
        from shared.protocol import SamplingParams

        runner, startup = load_runner(settings)
        params = [SamplingParams(temperature=a.temperature, ignore_eos=True, max_tokens=a.output_len,
                                 seed=i) for i in range(len(prompts[top]))]
        offline = {"concurrency": top, "requests": len(params),
                   **offline_run(runner, settings["max_num_seqs"], a.max_num_batched_tokens,
                                 prompts[top], params, warm, a.output_len),
                   "startup_seconds": round(startup, 2), "runner": runner.report()}
    http_top = next(lv for lv in levels if lv["concurrency"] == top)["output_tok_per_s"]
    res = {"benchmark": "serve_bench",
           "device": device_name() if a.device != "cpu" else "cpu",
           "model": a.model or a.config, "weights": settings["load_format"],
           "settings": {**{k: v for k, v in settings.items() if k != "model"},
                        "frontends": a.frontends, "server_args": a.server_args},
           "workload": {"prompt_len": a.prompt_len, "output_len": a.output_len,
                        "temperature": a.temperature, "seed": a.seed, "concurrency": a.concurrency,
                        "requests": {c: len(p) for c, p in prompts.items()},
                        "warmup_requests": a.warmup_requests, "client_procs": procs},
           "server_startup_seconds": server.startup_seconds, "server_log": server.log_path,
           "levels": levels, "offline": offline, "ratio_concurrency": top,
           "ratio": round(http_top / offline["output_tok_per_s"], 3) if offline and http_top else None}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(table(res))
    return 1 if any(lv["errors"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
