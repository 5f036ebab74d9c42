"""`cpu_decode_profile.py --levels`: where batch-1 CPU decode time goes between the model
runner's step and the client's tokens (the module doc of benchmarks/cpu_decode_profile.py
says what each level is and what the JSON holds).

With --after-start S the same run also starts, per round and per --server-variant (order
reversed every other round), a fresh `kestrel serve` with its standby spares on (the
default) and streams batch-1 requests back to back for S seconds from its /health 200: each
stream's start (seconds after /health), decode tok/s, and whether the spares were up when
it ended (`kestrel:*-standby*` children). It shows what the spares' imports cost a serving
group (services/supervisor/standby.py: made STANDBY_DELAY_S after the group starts, then
only once the group is idle; `--standby-idle-wait-s 0` for the old timing).
With --concurrent each round also runs 8 streams at once on every server (`http8:<variant>`:
output tok/s of all 8, 8 x tokens / wall seconds, as cpu_decode.py's concurrent8).

The servers run this checkout's code (PYTHONPATH is set to the repo root before they start:
`.venv/bin/kestrel` alone imports the checkout the venv was installed from).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.common import ROOT, emit_json, load_runner
from benchmarks.cpu_decode_profile import Stream
from shared.protocol import SamplingParams


def _decode_rate(times: list[float]) -> float:
    """tok/s after the first token: (len - 1) / (last - first), seconds from perf_counter."""
    return (len(times) - 1) / (times[-1] - times[0])


def level_runner(runner, prompt: list[int], n: int, rid: str) -> tuple[float, list[int]]:
    """(a) n greedy tokens by the bare step loop: (tok/s, ids)."""
    s = Stream(runner, len(prompt), n + 8, rid=rid, prompt=prompt)
    times, ids = [time.perf_counter()], [s.token]
    for _ in range(n - 1):
        ids.append(s.step())
        times.append(time.perf_counter())
    return _decode_rate(times), ids


def level_core(runner, prompt: list[int], n: int, prefix: str) -> tuple[float, list[int]]:
    """(b) n greedy tokens through an in-process EngineCore: (tok/s, ids)."""
    from benchmarks.common import new_core, run_core

    core = new_core(runner, 8, 2048, 1)
    times: list[float] = []
    toks: dict = {}
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    run_core(core, runner, [(prompt, sp)], prefix, tokens=toks, token_times=times)
    return _decode_rate(times), toks[f"{prefix}0"]


def level_http(srv, name: str, n: int) -> dict:
    """(c) one HTTP stream of n tokens: tok/s and CPU ms per token of each server process."""
    import psutil

    from benchmarks.cpu_decode import stream_one

    procs = [psutil.Process(srv.proc.pid), *srv.children()]

    def cpu() -> dict:
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.name()] = t.user + t.system
            except psutil.Error:
                pass
        return out

    c0 = cpu()
    o = stream_one(srv.base_url, name, n)
    c1 = cpu()
    return {"tok_s": _decode_rate(o["times"]), "chunks": len(o["times"]),
            "cpu_ms_per_token": {k: round(1e3 * (c1[k] - c0[k]) / n, 3) for k in c1 if k in c0}}


def concurrent8(srv, name: str, n: int) -> float:
    """8 HTTP streams of n tokens at once: output tok/s of all (8 n / wall seconds)."""
    import concurrent.futures as cf

    from benchmarks.cpu_decode import stream_one

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: stream_one(srv.base_url, name, n), range(8)))
    return 8 * n / (time.perf_counter() - t0)


def _spin() -> None:
    while True:
        pass


def levels_run(a: argparse.Namespace) -> int:
    """--levels (module doc)."""
    import multiprocessing as mp
    from contextlib import ExitStack

    from benchmarks.cpu_decode import prompt_ids, spread, stream_one
    from tests.e2e.server import KestrelServer

    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    q = a.quantization[0]
    res: dict = {"benchmark": "cpu_decode_levels", "date": time.strftime("%Y-%m-%d"),
                 "cpu_count": os.cpu_count(), "quantization": q, "tokens": a.tokens, "rounds": a.rounds,
                 "busy_procs": a.busy, "load_avg_start": os.getloadavg()}
    busy = [mp.Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    prompt = prompt_ids(a.model)
    name = os.path.basename(os.path.normpath(a.model))
    variants = {}
    for v in a.server_variant:
        key, _, args = v.partition(":")
        variants[key] = [x for x in args.split(",") if x]
    with ExitStack() as stack:
        srvs = {k: stack.enter_context(KestrelServer(a.model, "--quantization", q, "--no-engine-standby", *extra))
                for k, extra in variants.items()}
        runner, _ = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                 "num_threads": a.threads, "max_model_len": 4096})
        runner_threads = torch.get_num_threads()
        level_runner(runner, prompt, 16, "warm-a")
        level_core(runner, prompt, 16, "warm-b")
        for srv in srvs.values():
            stream_one(srv.base_url, name, 16)
        levels = ["runner", "core", *(f"http:{k}" for k in srvs),
                  *(f"http8:{k}" for k in srvs if a.concurrent)]
        rounds = []
        for r in range(a.rounds):
            row: dict = {"load_avg": os.getloadavg()}
            for lv in (levels if r % 2 == 0 else levels[::-1]):
                if lv == "runner":
                    row[lv], ids_a = level_runner(runner, prompt, a.tokens, f"a{r}")
                elif lv == "core":
                    row[lv], ids_b = level_core(runner, prompt, a.tokens, f"b{r}-")
                elif lv.startswith("http8:"):
                    row[lv] = concurrent8(srvs[lv[6:]], name, a.tokens)
                else:
                    h = level_http(srvs[lv[5:]], name, a.tokens)
                    row[lv], row[lv + ":cpu_ms_per_token"] = h["tok_s"], h["cpu_ms_per_token"]
            row["runner_core_same_ids"] = ids_a == ids_b
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if a.after_start > 0:
        res["after_start"] = after_start(a, variants, name, q)
    for p in busy:
        p.terminate()
    res["runner_threads"] = runner_threads
    res["server_variants"] = variants
    res["rounds_data"] = rounds
    res["summary_tok_s"] = {lv: spread([row[lv] for row in rounds]) for lv in levels}
    res["ratio_to_runner"] = {lv: spread([row[lv] / row["runner"] for row in rounds]) for lv in levels[1:]}
    res["load_avg"] = os.getloadavg()
    emit_json(res, a.out)
    return 0


def after_start(a: argparse.Namespace, variants: dict, name: str, q: str) -> dict:
    """--after-start (module doc): per variant, the streams of every round and a summary:
    median / min / max tok/s of all streams, the seconds after /health at which a stream
    first saw the spares (per round), and the tok/s of the streams that ran while they were
    being made (starting from 1.5 s before that first sight to 10 s after it)."""
    from benchmarks.cpu_decode import spread, stream_one
    from tests.e2e.server import KestrelServer

    streams: dict = {k: [] for k in variants}
    for r in range(a.rounds):
        for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            with KestrelServer(a.model, "--quantization", q, *variants[k]) as srv:
                t0 = time.perf_counter()
                rows = []
                while time.perf_counter() - t0 < a.after_start:
                    o = stream_one(srv.base_url, name, a.tokens)
                    spares = sum("standby" in p.name() for p in srv.children())
                    rows.append({"round": r, "start_s": round(o["start"] - t0, 2),
                                 "tok_s": round(_decode_rate(o["times"]), 1), "spares": spares})
                streams[k].extend(rows)
                print(json.dumps({k: rows}), file=sys.stderr, flush=True)
    out: dict = {"seconds": a.after_start, "streams": streams, "summary_tok_s": {}}
    for k, rows in streams.items():
        first: dict = {}
        for row in rows:
            if row["spares"] and row["round"] not in first:
                first[row["round"]] = row["start_s"]
        near = [row["tok_s"] for row in rows if row["round"] in first
                and first[row["round"]] - 1.5 <= row["start_s"] <= first[row["round"]] + 10]
        out["summary_tok_s"][k] = {"all": spread([row["tok_s"] for row in rows]),
                                   "spares_first_seen_s": first,
                                   "while_spares_made": spread(near) if near else None}
    return out
