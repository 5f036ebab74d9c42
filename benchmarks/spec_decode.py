"""Speculative decoding on the CPU: n-gram prompt lookup against no speculation, batch 1,
through the HTTP API of a real `kestrel serve` (issue 15, "Real speedup on the CPU").

Servers: two `kestrel serve` subprocesses of the same model and settings (default
models/SmolLM2-135M-Instruct, fp32 on CPU, prefix caching off), started in this run, one
without and one with `--speculative-config '{"method": "ngram", "num_speculative_tokens":
K}'` (K = --k, default 4; the adaptive policy unless --policy fixed; --lookup-min/max set
prompt_lookup_min/max). Both are up for the whole run and the requests alternate between
them (off/on for one prompt, then on/off for the next ...), so that both see the same load
of a shared machine; an idle server costs next to nothing.

Workload (benchmarks/spec_prompts.py): the "copy" set (a text or code of 100-300 tokens to
repeat with a small edit) and the "nocopy" set (open questions, short stories), chat
completions, one request at a time, greedy (temperature 0), streamed with usage,
--max-tokens each (EOS ends a request earlier). --warmup requests per server first (not
measured; they also give the adaptive policy its step-cost measurements), then --repeats
rounds over every prompt of both sets.

Per set: output tok/s off and on (tokens / sum of request durations, prefill included),
decode tok/s (after the first chunk), their ratios on/off, the per-pair speedups; the mean
acceptance length 1 + accepted / drafts and the per-draft acceptance rate from the
server's spec_decode counters (benchmarks/spec_stats.py), read before and after every
request of the speculative server from GET /metrics (`kestrel:spec_decode_num_drafts`, ...)
or, where /metrics has none, from the engine's stats (GET /internal/stats, the same
counters: `counter_source` says which); and every output of the speculative server
compared with the plain one's for the same prompt and round (greedy: they must be equal;
mismatches are listed with the first differing character). Targets: copy >= 1.8x, nocopy
>= 0.97x. JSON (settings, machine, per-set results, the policy's final stats, --notes) to
--out (default benchmarks/results/<date>_cpu<N>_spec_decode.json) and stdout; a table last.
Exit status 1 if a request failed or an output differed.

Usage:
  .venv/bin/python benchmarks/spec_decode.py [--k 4] [--policy adaptive|fixed] [--max-tokens 256]
      [--repeats 3] [--prompts N] [--warmup 2] [--notes TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks import spec_stats as st  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402
from benchmarks.serve_process import ServeProcess  # noqa: E402
from benchmarks.spec_prompts import SETS  # noqa: E402

TARGETS = {"copy": 1.8, "nocopy": 0.97}


def chat(base_url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> st.Timed:
    """One streamed greedy chat completion. Returns its timing, token count and text.
    Raises RuntimeError for an HTTP error, an error event or a stream without usage."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first, parts, tokens, reason = None, [], None, None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=timeout,
                      trust_env=False) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200].decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error'].get('message')}")
            if ev.get("usage") and not ev.get("choices"):
                tokens = ev["usage"]["completion_tokens"]
            for c in ev.get("choices") or ():
                text = (c.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.monotonic()
                    parts.append(text)
                reason = c.get("finish_reason") or reason
    end = time.monotonic()
    if tokens is None:
        raise RuntimeError("stream had no usage chunk")
    return st.Timed(sent, first if first is not None else end, end, tokens, "".join(parts), reason)


def set_result(name: str, off: list[st.Timed], on: list[st.Timed], counters: list[dict],
               mismatches: list[dict]) -> dict:
    """One prompt set's results (module doc)."""
    s_off, s_on = st.speed(off), st.speed(on)
    r = st.ratio(s_on["output_tok_per_s"], s_off["output_tok_per_s"])
    return {"off": s_off, "on": s_on, "ratio": r,
            "ratio_decode": st.ratio(s_on["decode_tok_per_s"], s_off["decode_tok_per_s"]),
            "pair_speedup": st.pair_ratios(off, on),
            "acceptance": st.acceptance_summary(st.counters_sum(counters)) if counters else None,
            "identical_outputs": not mismatches, "mismatches": mismatches,
            "target": TARGETS[name], "meets_target": r is not None and r >= TARGETS[name]}


def table(res: dict) -> str:
    """The human-readable summary printed last."""
    lines = [f"spec_decode: {res['model']} on {res['device']} ({res['machine']['cpu_count']} cores), "
             f"ngram k={res['speculative_config']['num_speculative_tokens']} policy "
             f"{res['speculative_config'].get('policy', 'adaptive')}, counters from {res['counter_source']}",
             f"{'set':>7} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} {'decode ratio':>13} "
             f"{'accept len':>11} {'target':>7} {'identical':>10}"]
    for name, r in res["sets"].items():
        acc = (r["acceptance"] or {}).get("mean_acceptance_length")
        lines.append(f"{name:>7} {r['off']['output_tok_per_s']:>10} {r['on']['output_tok_per_s']:>10} "
                     f"{r['ratio']:>7} {r['ratio_decode']!s:>13} {acc!s:>11} {r['target']:>7} "
                     f"{r['identical_outputs']!s:>10}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--policy", choices=["adaptive", "fixed"], default="adaptive")
    ap.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min (default: the server's)")
    ap.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max (default: the server's)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=0, help="first N prompts of each set (0: all)")
    ap.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["copy", "nocopy"])
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per server and set")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--server-args", default="", help="more `kestrel serve` flags for both servers")
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--notes", default="", help="free text for the JSON (e.g. the machine's load)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    spec = {"method": "ngram", "num_speculative_tokens": a.k}
    if a.policy != "adaptive":
        spec["policy"] = a.policy
    if a.lookup_min is not None:
        spec["prompt_lookup_min"] = a.lookup_min
    if a.lookup_max is not None:
        spec["prompt_lookup_max"] = a.lookup_max
    common = ["--model", os.path.abspath(a.model), "--device", a.device, "--max-num-seqs", "4",
              "--max-model-len", str(a.max_model_len), "--enable-prefix-caching", "false",
              "--shutdown-timeout", "5", *a.server_args.split()]
    servers = {"off": ServeProcess(common),
               "on": ServeProcess([*common, "--speculative-config", json.dumps(spec)])}
    sets = {n: SETS[n][:a.prompts or None] for n in a.sets}
    runs: dict[str, dict[str, list[st.Timed]]] = {n: {"off": [], "on": []} for n in sets}
    counters: dict[str, list[dict]] = {n: [] for n in sets}
    mismatches: dict[str, list[dict]] = {n: [] for n in sets}
    source = "none"
    t_start = time.monotonic()
    try:
        for s in servers.values():
            s.start(a.startup_timeout)
        model = servers["off"].model_name()
        for s in servers.values():
            for prompts in sets.values():
                for i in range(a.warmup):
                    chat(s.base_url, model, prompts[i % len(prompts)], min(64, a.max_tokens), a.request_timeout)
        flip = False
        for rep in range(a.repeats):
            for n, prompts in sets.items():
                for i, prompt in enumerate(prompts):
                    flip = not flip
                    got: dict[str, st.Timed] = {}
                    for side in (("off", "on") if flip else ("on", "off")):
                        before = servers["on"].spec_counters()[0] if side == "on" else None
                        got[side] = chat(servers[side].base_url, model, prompt, a.max_tokens, a.request_timeout)
                        if side == "on":
                            after, source = servers["on"].spec_counters()
                            if before is not None and after is not None:
                                counters[n].append(st.counters_delta(after, before))
                        runs[n][side].append(got[side])
                    at = st.first_mismatch(got["off"].text, got["on"].text)
                    if at is not None:
                        mismatches[n].append({
                            "prompt": i, "repeat": rep, "first_diff_char": at,
                            "off_tokens": got["off"].tokens, "on_tokens": got["on"].tokens,
                            "off": got["off"].text[max(0, at - 40):at + 80],
                            "on": got["on"].text[max(0, at - 40):at + 80]})
                    print(f"rep {rep} {n}[{i}]: off {got['off'].tokens} tok {got['off'].end - got['off'].sent:.2f} s, "
                          f"on {got['on'].tokens} tok {got['on'].end - got['on'].sent:.2f} s"
                          f"{'' if at is None else f', DIFFERS at char {at}'}", file=sys.stderr, flush=True)
        final_stats = {k: v for k, v in servers["on"].engine_stats().items() if k.startswith("spec")}
    except BaseException:
        for side, s in servers.items():
            if s.proc is not None:
                print(f"--- {side} server log tail ({s.log_path}):\n{s.log_tail()}", file=sys.stderr)
        raise
    finally:
        for s in servers.values():
            s.stop()
    for s in servers.values():  # a run that got here needs no server log
        os.unlink(s.log_path)
    import torch

    date = time.strftime("%Y-%m-%d")
    res = {"benchmark": "spec_decode", "date": date, "device": a.device,
           "machine": {"node": platform.node(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "python": platform.python_version(), "torch": torch.__version__},
           "model": a.model, "speculative_config": spec,
           "settings": {"max_tokens": a.max_tokens, "repeats": a.repeats, "warmup": a.warmup,
                        "temperature": 0.0, "stream": True, "batch": 1, "server_flags": common[2:],
                        "order": "interleaved: both servers up, off/on alternating per prompt"},
           "counter_source": source,
           "counter_note": {"metrics": "read from GET /metrics",
                            "engine_stats": "GET /metrics has no kestrel:spec_decode_* yet: read from the engine's "
                                            "stats (GET /internal/stats), the same counters (SpecPolicy.stats)",
                            "none": "no spec_decode counters found: acceptance not measured"}[source],
           "sets": {n: set_result(n, runs[n]["off"], runs[n]["on"], counters[n], mismatches[n]) for n in sets},
           "policy_final_stats": final_stats,
           "server_startup_seconds": {k: s.startup_seconds for k, s in servers.items()},
           "wall_seconds": round(time.monotonic() - t_start, 1), "notes": a.notes}
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"{date}_cpu{os.cpu_count()}_spec_decode.json")
    emit_json(res, out)
    print(table(res))
    return 1 if any(mismatches.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
