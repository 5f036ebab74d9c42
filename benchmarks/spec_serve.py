"""Speculative decoding under concurrent load: n-gram speculation (adaptive policy) against
no speculation, through the HTTP API of two real `kestrel serve` processes of one run, or of
one with its speculation switched per run (--one-server, below) (issue 15: "At 32 and 256
concurrent, speculation on is never below 0.97x of off").

Servers: two `kestrel serve` subprocesses of the same model and settings, one plain and one
with `--speculative-config '{"method": "ngram", "num_speculative_tokens": K}'` (K = --k,
default 4; the adaptive policy unless --policy fixed). Both stay up for the whole run and
the runs alternate between them, so that both see the same drift of a shared machine (an
idle server costs next to nothing). On CUDA they share the GPU: the plain server starts
first with gpu_memory_utilization --gpu-share (0.44), then the spec server with twice that,
which leaves it the same share (the KV budget is utilization x total minus the memory
already in use, other processes included: docs/ARCHITECTURE.md §4.2); each one's
num_blocks is in the JSON. Model: a config of benchmarks/configs (default Qwen3-0.6B) with
dummy weights and a synthetic tokenizer (as benchmarks/serve_bench.py), bf16 on CUDA, or
`--model DIR` (a real folder: its weights, tokenizer and chat template); `--tiny`: the
tiny-qwen3 config on the CPU with small levels, a smoke run.
`--one-server`: only the spec server is started (with --debug-utilities; on CUDA at
gpu_memory_utilization --gpu-share, the share each server has in the two-server mode), and
each run first switches its speculation off for the "plain" side or on for the "spec" side
(POST /debug/speculation, the engine's set_speculation utility: switched off, the policy
gives every request k = 0 and looks nothing up, proposes and probes nothing, so the engine
does the plain work; switched on, it goes on from its learned state, docs/ARCHITECTURE.md
§5.5). Why: at c256 two servers doing the same work differed by +-10% a round on the H200
(the spec server's policy had switched speculation off: 0 lookups, 0 verify steps), more
than the 3% the check has to resolve; one process has no such difference between its sides.
The plain side's `rounds` then count its speculative work too (lookups, probes,
spec_steps: 0 where the switch held). The JSON says "one_server": true. Default: two servers.

Workload: the "copy" and "nocopy" prompt sets of benchmarks/spec_prompts.py (repeat a text
or code with a small edit, where n-gram lookup can draft; open questions, where it cannot),
each its own row. With a real model: chat completions of the texts. With a config-only
folder: /v1/completions of token ids, the text through `hashed_token_ids` (one id per
word, punctuation mark and line break, equal pieces equal ids) after --prefix-len (8)
random ids that make every request distinct. Per level c (--concurrency, default 1 32
256; 1 is a sanity point), max(c x R, --min-requests (8)) requests per kind, R =
--requests-per-concurrency, by default 8 up to c = 32 and 4 above (`requests_for`: a round
of c32 was 64 requests, 0.6-1.2 s on the H200, so one compile stall of 0.2-0.5 s halved
it; at 8x and 4x a round lasts about 2-3 s at c32 and 4-5 s at c256), the same set for both servers, c in flight (benchmarks/serve_client.py),
max_tokens --max-tokens (128) with ignore_eos (every request emits exactly that many),
temperature --temperature (0: greedy, as n-gram speculation is mostly used).
What dummy weights mean: the output is garbage whatever the prompt, so "copy" is not
copied. A greedy random model mostly follows its own short loops, which n-gram lookup may
still find (in its output, or by chance in the prompt); acceptance is whatever that gives,
reported per row, and the rows test the policy's promise (speculation that does not pay
is switched off, so spec >= 0.97x plain) at that acceptance, not n-gram's gain on real text.
Order: first a warm-up per server (one-server: per side, its speculation switched for it;
every level once, both kinds mixed, --warmup-tokens (32) each; not measured; it also gives
the adaptive policy its step-cost measurements), then --repeats (3) rounds of every level
and kind, each a pair of runs back to back on the two servers (one-server: on the one
server, speculation off then on, or on then off), plain first or spec first alternately (by
round and by row). Each run
records its wall time and the Triton compiles / CUDA graph captures its server's worker
met during it (`worker_jit_compiles` of the engine stats, services/worker/jit_watch.py),
so that a stall shows in the JSON: per row `rounds` {plain, spec}: [{output_tok_per_s,
wall_s, jit_compiles, steps, sync_plans (plans the pipeline waited for), spec_steps (with a
seq that verified), probes, lookups (n-gram)}, ...] in round order, and per server `jit_compiles_warmup`
(during the warm-up; 0 from the first run on is the startup warm-ups' promise); a server
whose worker compiled keeps its log (its warnings name the kernels), listed in `server_logs`, and those
warnings themselves are in `jit_serving_compiles` (each names what differs from the closest earlier compile).

Per level and kind (benchmarks/spec_stats.py `serve_row`): per side, the medians over
rounds of output tok/s, TTFT p50 and TPOT p50 (benchmarks/serve_stats.py), requests and
errors; ratio = median over rounds of spec / plain output tok/s (a round's two runs are
adjacent in time), meets_0.97 = ratio >= --threshold (0.97); the acceptance (mean
acceptance length 1 + accepted / drafts, per-draft rate) from the spec server's
spec_decode counters read around each spec run (GET /metrics `kestrel:spec_decode_*`, else
GET /internal/stats); per side the engine's steps, generated tokens, and for spec its
proposals, probes and k histogram over the rounds. verdict: whether every row of the
--check-levels (32 256) that ran meets the threshold.
Cost on an H200 (default settings): two server start-ups (about 10 s each) plus warm-up,
then 3 rounds x 3 levels x 2 kinds x 2 sides, about 45 s a round (estimated from the
2-round c32/c256 run of 2026-12-02: 67 s in all with 2x requests); see
scripts/gpu_spec_serve.sh for the device command.
JSON (settings, device, levels, verdict, the spec policy's final stats, --notes; "complete":
false when SIGTERM or Ctrl-C cut the rounds short) to --out and stdout, a table last. Exit
status 1 if a request failed or the run was cut short.

Usage:
  python benchmarks/spec_serve.py [--config qwen3-0.6b] [--concurrency 1 32 256] [--out FILE]
  python benchmarks/spec_serve.py --tiny                                 # CPU smoke run
  python benchmarks/spec_serve.py --tiny --one-server --repeats 1       # the same on one server
  .venv/bin/python benchmarks/spec_serve.py --model models/SmolLM2-135M-Instruct --device cpu \\
      --concurrency 1 4 --max-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import spec_stats as st  # noqa: E402
from benchmarks.common import device_name, emit_json, model_dir  # noqa: E402
from benchmarks.serve_client import default_client_procs, run_level, start_pool  # noqa: E402
from benchmarks.serve_process import ServeProcess, serve_flags  # noqa: E402
from benchmarks.serve_stats import summarize  # noqa: E402
from benchmarks.spec_prompts import SETS, hashed_token_ids  # noqa: E402

SIDES = ("plain", "spec")
ENGINE_KEYS = ("num_steps", "num_generated_tokens", "num_preemptions", "spec_decode_num_proposals",
               "spec_decode_num_empty_proposals", "spec_decode_num_probes", "spec_decode_k_hist",
               "worker_jit_compiles", "num_sync_plans", "spec_decode_num_spec_steps", "spec_ngram_lookups",
               "spec_ngram_lookup_waits")
TINY = {"config": "tiny-qwen3", "device": "cpu", "concurrency": [1, 4], "max_tokens": 16,
        "repeats": 2, "warmup_tokens": 8, "check_levels": [4], "requests_per_concurrency": 2.0}


def requests_for(c: int, per_concurrency: float | None, min_requests: int) -> int:
    """Requests per kind at concurrency c: c x per_concurrency, by default 8 up to c = 32 and
    4 above (module doc), at least min_requests."""
    r = per_concurrency if per_concurrency is not None else (8.0 if c <= 32 else 4.0)
    return max(int(c * r + 0.5), min_requests)


def request_set(kind: str, n: int, chat: bool, vocab_size: int, prefix_len: int, seed: int) -> list:
    """n requests of one prompt kind, cycling through its texts: chat messages, or token ids
    (prefix_len random ids from random.Random(seed), then the text's `hashed_token_ids`)."""
    texts = SETS[kind]
    if chat:
        return [{"messages": [{"role": "user", "content": texts[i % len(texts)]}]} for i in range(n)]
    rng = random.Random(seed)
    ids = [hashed_token_ids(t, vocab_size) for t in texts]
    return [[rng.randint(100, min(vocab_size, 30000) - 1) for _ in range(prefix_len)] + ids[i % len(ids)]
            for i in range(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module doc); --tiny changes the defaults of what is not given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: " + json.dumps(TINY))
    ap.add_argument("--config", default="qwen3-0.6b", help="benchmarks/configs name (dummy weights)")
    ap.add_argument("--model", default=None, help="a real model folder instead of --config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the server's (bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--check-levels", type=int, nargs="*", default=[32, 256], help="levels of the verdict")
    ap.add_argument("--threshold", type=float, default=0.97)
    ap.add_argument("--requests-per-concurrency", type=float, default=None,
                    help="requests per kind / concurrency; default 8 up to c=32, 4 above")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--kinds", nargs="+", choices=sorted(SETS), default=["copy", "nocopy"])
    ap.add_argument("--api", choices=["auto", "chat", "completions"], default="auto",
                    help="auto: chat with --model, token-id completions with --config")
    ap.add_argument("--prefix-len", type=int, default=8, help="random ids before a token-id prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-tokens", type=int, default=32, help="0: no warm-up")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--policy", choices=["adaptive", "fixed"], default="adaptive")
    ap.add_argument("--gpu-share", type=float, default=0.44, help="GPU memory share of each server")
    ap.add_argument("--one-server", action="store_true",
                    help="one spec server, speculation switched off/on per run (module doc)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the highest concurrency")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--client-procs", type=int, default=0, help="0: auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="more `kestrel serve` flags for both servers")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    ap.add_argument("--notes", default="")
    ap.add_argument("--out", default=None)
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        ap.set_defaults(**TINY)
    return ap.parse_args(argv)


def table(res: dict) -> str:
    """The human-readable summary printed last."""
    sc = res["speculative_config"]
    lines = [f"spec_serve: {res['model']} ({res['weights']} weights) on {res['device']}, ngram "
             f"k={sc['num_speculative_tokens']} {sc.get('policy', 'adaptive')}, {res['settings']['api']}, "
             f"{res['settings']['max_tokens']} tokens, {res['settings']['repeats']} rounds"
             + (", one server (speculation switched per run)" if res.get("one_server") else ""),
             f"{'conc':>5} {'kind':>7} {'plain tok/s':>11} {'spec tok/s':>11} {'ratio':>6} {'>=thr':>6} "
             f"{'L':>6} {'TTFT p50 ms':>15} {'TPOT p50 ms':>15} {'err':>5} {'jit p/s':>9}  spec s/round"]
    for lv in res["levels"]:
        for kind, r in lv["kinds"].items():
            p, s = r["plain"], r["spec"]
            acc = (r["acceptance"] or {}).get("mean_acceptance_length")
            lines.append(f"{lv['concurrency']:>5} {kind:>7} {p['output_tok_per_s']!s:>11} "
                         f"{s['output_tok_per_s']!s:>11} {r['ratio']!s:>6} {r['meets_' + str(r['threshold'])]!s:>6} "
                         f"{acc!s:>6} {p['ttft_p50_ms']!s:>7}/{s['ttft_p50_ms']!s:<7} "
                         f"{p['tpot_p50_ms']!s:>7}/{s['tpot_p50_ms']!s:<7} {p['errors'] + s['errors']:>5} "
                         f"{_jit(r, 'plain')!s:>4}/{_jit(r, 'spec')!s:<4} "
                         + " ".join(str(x.get("wall_s")) for x in r.get("rounds", {}).get("spec", [])))
    v = res["verdict"]
    lines.append(f"verdict: spec >= {v['threshold']} x plain at {v['levels']}: {v['meets']}"
                 + (f" (failing {v['failing']})" if v["failing"] else "")
                 + ("" if res["complete"] else " [run cut short]"))
    return "\n".join(lines)


def _serving_compile_lines(path: str, limit: int = 16) -> list[str]:
    """The worker's "compiled ... while serving" / "captured while serving" warnings in a
    server log (services/worker/jit_watch.py: each names what differs from the kernel's
    closest earlier compile), at most `limit`; [] where the log is gone."""
    try:
        with open(path, errors="replace") as f:
            return [ln.strip()[-600:] for ln in f if "while serving" in ln][:limit]
    except OSError:
        return []


def _jit(row: dict, side: str) -> int | None:
    """Worker compiles over a row's rounds on one side (None: the server did not report them)."""
    return row.get("engine", {}).get(side, {}).get("worker_jit_compiles")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    top = max(a.concurrency)
    folder = os.path.abspath(a.model) if a.model else model_dir(a.config, tokenizer=True)
    with open(os.path.join(folder, "config.json")) as fh:
        vocab = int(json.load(fh)["vocab_size"])
    chat = a.api == "chat" or (a.api == "auto" and a.model is not None)
    spec = {"method": "ngram", "num_speculative_tokens": a.k, **({"policy": a.policy} if a.policy != "adaptive" else {})}
    settings = {"model": folder, "load_format": "auto" if a.model else "dummy", "device": a.device,
                "dtype": a.dtype, "max_num_seqs": a.max_num_seqs or top,
                "max_num_batched_tokens": a.max_num_batched_tokens, "max_model_len": a.max_model_len,
                "enforce_eager": a.enforce_eager, "enable_prefix_caching": False}
    common = [*serve_flags(settings), "--max-num-waiting", str(max(256, top)), "--shutdown-timeout", "5",
              *a.server_args.split()]
    cuda = a.device != "cpu"
    # two servers: the plain one starts first, the spec one gets twice the share, which leaves
    # it the same (module doc); one server: alone, it gets one share
    share = {"spec": a.gpu_share} if a.one_server else {"plain": a.gpu_share, "spec": min(1.0, 2 * a.gpu_share)}
    servers = {name: ServeProcess([*common, *(["--gpu-memory-utilization", str(share[name])] if cuda else []),
                                   *(["--speculative-config", json.dumps(spec)] if name == "spec" else []),
                                   *(["--debug-utilities"] if a.one_server else [])])
               for name in share}
    serve = {side: servers["spec" if a.one_server else side] for side in SIDES}  # the server of each side

    def switch(side: str) -> None:
        """One server: speculation off for the plain side, on for the spec side."""
        if a.one_server:
            serve[side].set_speculation(side == "spec")

    nreq = {c: requests_for(c, a.requests_per_concurrency, a.min_requests) for c in a.concurrency}
    reqs = {c: {kind: request_set(kind, nreq[c], chat, vocab, a.prefix_len, a.seed * 1000003 + 10 * c + i)
                for i, kind in enumerate(a.kinds)} for c in a.concurrency}
    runs: dict = {c: {k: {s: [] for s in SIDES} for k in a.kinds} for c in a.concurrency}
    counters: dict = {c: {k: [] for k in a.kinds} for c in a.concurrency}
    engine: dict = {c: {k: {s: [] for s in SIDES} for k in a.kinds} for c in a.concurrency}
    rounds: dict = {c: {k: {s: [] for s in SIDES} for k in a.kinds} for c in a.concurrency}
    jit_warmup: dict = {}
    body = {"max_tokens": a.max_tokens, "temperature": a.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    url_path = "/v1/chat/completions" if chat else "/v1/completions"
    procs = a.client_procs or default_client_procs(top)
    source, complete, final_stats, blocks = "none", False, {}, {}
    t0 = time.monotonic()
    pool = start_pool(procs)
    try:
        for name, srv in servers.items():  # one after the other: each measures the GPU memory left to it
            srv.start(a.startup_timeout)
            blocks[name] = srv.engine_stats().get("num_blocks")
        body["model"] = servers["spec"].model_name()
        if a.warmup_tokens > 0:
            for side in SIDES:
                switch(side)
                for c in sorted(a.concurrency):
                    mixed = [r for pair in zip(*(request_set(k, c, chat, vocab, a.prefix_len, -1 - c)
                                                 for k in a.kinds)) for r in pair][:max(c, 2)]
                    run_level(pool, procs, serve[side].base_url + url_path,
                              {**body, "max_tokens": a.warmup_tokens}, mixed, c, a.request_timeout)
        jit_warmup = {name: srv.engine_stats().get("worker_jit_compiles") for name, srv in servers.items()}
        print(f"servers up and warm after {time.monotonic() - t0:.1f} s (worker compiles since ready: "
              f"{jit_warmup})", file=sys.stderr, flush=True)
        for rnd in range(a.repeats):
            for row, (c, kind) in enumerate((c, k) for c in a.concurrency for k in a.kinds):
                order = SIDES if (rnd + row) % 2 == 0 else SIDES[::-1]
                for side in order:
                    srv = serve[side]
                    switch(side)
                    before = srv.engine_stats()
                    c_before = srv.spec_counters()[0] if side == "spec" else None
                    w0 = time.monotonic()
                    recs = run_level(pool, procs, srv.base_url + url_path, body, reqs[c][kind], c, a.request_timeout)
                    wall = time.monotonic() - w0
                    after = srv.engine_stats()
                    if side == "spec":
                        c_after, source = srv.spec_counters()
                        if c_before is not None and c_after is not None:
                            counters[c][kind].append(st.counters_delta(c_after, c_before))
                    runs[c][kind][side].append(summarize(recs))
                    delta = st.stats_delta(after, before, ENGINE_KEYS)
                    engine[c][kind][side].append(delta)
                    s = runs[c][kind][side][-1]
                    rounds[c][kind][side].append({"output_tok_per_s": s["output_tok_per_s"], "wall_s": round(wall, 3),
                                                  "jit_compiles": delta.get("worker_jit_compiles"),
                                                  "steps": delta.get("num_steps"),
                                                  "sync_plans": delta.get("num_sync_plans"),
                                                  "spec_steps": delta.get("spec_decode_num_spec_steps"),
                                                  "probes": delta.get("spec_decode_num_probes"),
                                                  "lookups": delta.get("spec_ngram_lookups")})
                    print(f"round {rnd} c={c} {kind} {side}: {s['output_tok_per_s']} tok/s in {wall:.2f} s, "
                          f"{s['errors']} errors, {delta.get('worker_jit_compiles')} worker compiles "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        final_stats = {k: v for k, v in servers["spec"].engine_stats().items() if k.startswith("spec")}
        complete = True
    except BaseException as e:
        for name, srv in servers.items():
            if srv.proc is not None:
                print(f"--- {name} server log tail ({srv.log_path}):\n{srv.log_tail()}", file=sys.stderr)
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
    finally:
        for srv in servers.values():
            srv.stop()  # first: requests still in flight then fail at once and the pool can end
        pool.shutdown(wait=True, cancel_futures=True)
    compiled = {name: (jit_warmup.get(name) or 0)  # per server: its warm-up's and its sides' runs'
                + sum(x.get("jit_compiles") or 0 for side in SIDES if serve[side] is srv
                      for c in rounds for k in rounds[c] for x in rounds[c][k][side])
                for name, srv in servers.items()}
    jit_lines = {name: _serving_compile_lines(srv.log_path) for name, srv in servers.items() if compiled[name]}
    if complete:
        for name, srv in servers.items():  # a run that got here needs no server log, unless its
            if not compiled[name]:         # worker compiled after ready (the warnings name the kernels)
                os.unlink(srv.log_path)
    levels = []
    rows: dict = {}
    for c in a.concurrency:
        kinds = {}
        for kind in a.kinds:
            n = min(len(runs[c][kind]["plain"]), len(runs[c][kind]["spec"]))  # whole rounds only
            if n == 0:
                continue
            kinds[kind] = {**st.serve_row(runs[c][kind]["plain"][:n], runs[c][kind]["spec"][:n],
                                          counters[c][kind][:n], a.threshold),
                           "engine": {s: st.stats_sum(engine[c][kind][s][:n]) for s in SIDES},
                           "rounds": {s: rounds[c][kind][s][:n] for s in SIDES}}
        if kinds:
            rows[c] = kinds
            levels.append({"concurrency": c, "requests": nreq[c], "kinds": kinds})
    res = {"benchmark": "spec_serve", "date": time.strftime("%Y-%m-%d"),
           "device": device_name() if cuda else "cpu", "cpu_count": os.cpu_count(),
           "model": a.model or a.config, "weights": settings["load_format"], "speculative_config": spec,
           "one_server": a.one_server,
           "settings": {**{k: v for k, v in settings.items() if k != "model"}, "api": url_path,
                        "gpu_memory_utilization": share if cuda else None, "num_blocks": blocks,
                        "concurrency": a.concurrency, "requests": nreq, "max_tokens": a.max_tokens,
                        "temperature": a.temperature, "ignore_eos": True, "kinds": a.kinds,
                        "prefix_len": None if chat else a.prefix_len, "repeats": a.repeats,
                        "warmup_tokens": a.warmup_tokens, "client_procs": procs, "seed": a.seed,
                        "server_args": a.server_args,
                        "order": ("one spec server (--debug-utilities); per round and row speculation off "
                                  "(plain) / on (spec) back to back (POST /debug/speculation before each run), "
                                  "alternating which goes first" if a.one_server else
                                  "both servers up; per round and row plain/spec back to back, alternating "
                                  "which goes first")},
           "counter_source": source, "levels": levels,
           "verdict": st.verdict(rows, a.check_levels, a.threshold), "policy_final_stats": final_stats,
           "server_startup_seconds": {k: s.startup_seconds for k, s in servers.items()},
           "jit_compiles_warmup": jit_warmup, "jit_serving_compiles": jit_lines or None,
           "server_logs": {k: s.log_path for k, s in servers.items() if not complete or compiled[k]} or None,
           "wall_seconds": round(time.monotonic() - t0, 1), "complete": complete, "notes": a.notes}
    emit_json(res, a.out)
    print(table(res))
    errors = any(r[s]["errors"] for k in rows.values() for r in k.values() for s in SIDES)
    return 1 if errors or not complete else 0


if __name__ == "__main__":
    sys.exit(main())
