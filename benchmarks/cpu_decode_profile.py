"""Where a batch-1 CPU decode step's time and ATen calls go (diagnostic, not a target).

Loads SmolLM2 (or --model) in-process as a CPU worker (`benchmarks.common.load_runner`) with
each --quantization scheme, prefills one prompt of --context tokens, then times decode steps
(`ModelRunner.execute` of one seq, one token) and profiles one with torch.profiler
(record_shapes): ms a step (median of --steps), ATen calls a step, and the top ops by self
CPU time and by count. With --ab the steps alternate between the fast path and the one
before it (`kernels.ref_fast.FEWER_OPS` off / on, step by step in this process), and the
JSON has both sides.

With --head-ab the steps alternate between the tied LM head's two quantized copies
(`LMHead.qweight_tied`: "int8", `_weight_int8pack_mm` with bf16 x, and "w8a8", oneDNN's int8
inner product with int8 activations, kernels/cpu_quant_linear.py), swapped step by step in
this process on two streams from the chat prompt of benchmarks/cpu_decode.py, in --rounds
rounds of --steps steps, the order reversed every other step: ms a step per side (median per
round and over all), the load average per round, whether the two sides decoded the same
greedy ids, and one profiled step of each.

With --int4-ab the steps rotate between the int4 layers' products (--int4-sides, default
tinygemm vnni2: kernels/cpu_quant_linear.py `INT4_VNNI` off, `_weight_int4pack_mm_for_cpu` with
bf16 x; on, the AVX-512 VNNI kernel with x in one (vnni1) or two (vnni2) int8 planes,
kernels/cpu_int4_vnni.py `X_PLANES`), swapped step by step in this process on one stream a side
from the chat prompt, as --head-ab (rounds, the order rotated every step, medians, load
averages, greedy ids and ratios against the first side, one profiled step of each side);
--int4-prefill N also times N-token prefills of each side (--int4-prefill-reps a side, rotated).

With --call-ab the steps rotate between the model modules' call through `nn.Module.__call__`
(torch's hook dispatch, "nn_call") and `services.worker.layers.module.Module`'s direct call
("direct_call"), as --int4-ab (the same JSON per side and ratios against nn_call).

With --cxx-ab the steps rotate between the torch references of the CPU decode path ("torch_ops":
`kernels.ref_fast.CPU_CXX_OPS` off) and Kestrel's C++ CPU ops ("cxx_ops": on; kernels/cpu_decode.py:
the RMS norms and the decode attention), as --int4-ab (the same JSON per side and ratios against
torch_ops).

With --levels (one --quantization scheme; benchmarks/cpu_serve_levels.py) it times batch-1
greedy decode of --tokens tokens from the chat prompt of benchmarks/cpu_decode.py at three
levels, in one run, --rounds
rounds, the order reversed every other round: (a) `runner`: the step loop above (one
`ModelRunner.execute` a token); (b) `core`: an `EngineCore` on an `InProcessExecutor` over
the same runner (`benchmarks.common.run_core`: plan, execute, finish_step, no processes);
(c) `http`: `kestrel serve` (tests/e2e/server.KestrelServer, the worker's threads as the
server derives them, standby spares off so that their start-up imports do not land in a
round) streamed over HTTP, one server per --server-variant ("name" or "name:arg,arg",
extra `kestrel serve` arguments; all started before the first round). Each level's figure is
decode tok/s: (tokens - 1) / (last token's time - first token's time), as cpu_decode.py's
batch 1; the JSON gives each round, the median / min / max per level, each level's ratio to
`runner` per round, the CPU ms per token of each server process (psutil, over the
stream), whether (a) and (b) decoded the same ids, and the load average (`uptime`) at
start, per round and at the end (the VM is shared). --busy N starts N spinning processes
for the whole run (a stand-in for a neighbour's load that is the same in every round).
--after-start S adds fresh servers with their standby spares on (benchmarks/cpu_serve_levels.py).

Usage: .venv/bin/python benchmarks/cpu_decode_profile.py [--quantization int4 int8]
       [--threads 1] [--steps 64] [--ab] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode_profile.py --head-ab --quantization int4 gguf \
           [--steps 32] [--rounds 5] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode_profile.py --int4-ab --quantization int4 gguf \
           [--int4-sides tinygemm vnni1 vnni2] [--steps 32] [--rounds 5] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode_profile.py --cxx-ab --quantization int4 gguf \
           [--threads 2] [--steps 48] [--rounds 4] [--out FILE]
       .venv/bin/python benchmarks/cpu_decode_profile.py --levels --quantization int4 \
           [--tokens 128] [--rounds 5] [--server-variant base] [--busy 0] [--concurrent]
           [--after-start 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit_json, load_runner  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class Stream:
    """One request on the runner: a prefill of ctx tokens, then one decode step per call.
    Each stream of a runner takes its own KV blocks (after the previous stream's): streams that
    shared block ids read each other's keys and values, so their greedy ids converged."""

    _next_block: dict = {}  # id(runner) -> its first block no stream holds yet

    def __init__(self, runner, ctx: int, steps: int, rid: str = "p0", prompt: list[int] | None = None):
        """prompt: the prompt's token ids (default: ctx synthetic ids; ctx is then its length)."""
        self.runner, self.rid, self.pos, self.step_id = runner, rid, 0, 0
        bs = runner.block_size
        if prompt is None:
            prompt = [(7 * i + 11) % 10000 for i in range(ctx)]
        first = Stream._next_block.get(id(runner), 0)
        n = -(-(len(prompt) + steps + 8) // bs)
        if first + n > runner.num_blocks:
            raise SystemExit(f"Stream: {first + n} KV blocks needed, the runner has {runner.num_blocks}")
        Stream._next_block[id(runner)] = first + n
        self.table = list(range(first, first + n))
        self.token = self._run(prompt, first=True)

    def _run(self, ids: list[int], first: bool = False) -> int:
        seq = ScheduledSeq(self.rid, ids, self.pos, self.table if first else [], True,
                           GREEDY if first else None, self.step_id, table_start=0 if first else len(self.table))
        self.step_id += 1
        out = self.runner.execute(StepPlan(self.step_id, [seq]))
        self.pos += len(ids)
        return out.sampled_token_ids[0]

    def step(self) -> int:
        self.token = self._run([self.token])
        return self.token


def profile_step(stream: Stream) -> dict:
    """torch.profiler over one decode step: ATen calls, self CPU ms by op, top ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        stream.step()
    ev = prof.key_averages()
    aten = [e for e in ev if e.key.startswith("aten::")]
    own = [e for e in ev if e.key.startswith("kestrel::")]  # the C++ extension's (RECORD_FUNCTION)
    calls = sum(e.count for e in aten)
    by_time = sorted(aten, key=lambda e: -e.self_cpu_time_total)[:20]
    by_count = sorted(aten, key=lambda e: -e.count)[:20]
    shapes = Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("aten::"):
            shapes[f"{e.key} {e.input_shapes}"[:140]] += e.count
    return {"aten_calls": calls,
            "aten_self_ms": round(sum(e.self_cpu_time_total for e in aten) / 1e3, 3),
            "top_self_ms": [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)}
                            for e in by_time],
            "kestrel_ops": [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)}
                            for e in own],
            "top_calls": [{"op": e.key, "calls": e.count} for e in by_count],
            "top_shapes": [{"op": k, "calls": n} for k, n in shapes.most_common(30)]}


def set_fast(on: bool) -> None:
    from kernels import ref_fast
    ref_fast.FEWER_OPS = on


def run_scheme(a: argparse.Namespace, q: str) -> dict:
    runner, load_s = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                  "num_threads": a.threads, "max_model_len": 4096})
    sides = (False, True) if a.ab else (None,)
    out: dict = {"load_seconds": round(load_s, 2)}
    ms: dict = {s: [] for s in sides}
    toks: dict = {s: [] for s in sides}
    streams = {}
    for s in sides:
        if s is not None:
            set_fast(s)
        streams[s] = Stream(runner, a.context, 2 * a.steps + 16, rid=f"p{s}")
        for _ in range(4):  # warm-up
            streams[s].step()
    for _ in range(a.steps):
        for s in sides:
            if s is not None:
                set_fast(s)
            t0 = time.perf_counter()
            toks[s].append(streams[s].step())
            ms[s].append(1e3 * (time.perf_counter() - t0))
    for s in sides:
        if s is not None:
            set_fast(s)
        key = {None: "default", False: "old", True: "fast"}[s]
        out[key] = {"ms_per_step_median": round(statistics.median(ms[s]), 3),
                    "ms_per_step_min": round(min(ms[s]), 3), "profile": profile_step(streams[s])}
    if a.ab:
        out["tokens_equal"] = toks[False] == toks[True]
        out["speedup"] = round(out["old"]["ms_per_step_median"] / out["fast"]["ms_per_step_median"], 3)
    return out


def rotated_steps(runner, sides: list[str], use, ids: list[int], a: argparse.Namespace, rid: str
                  ) -> tuple[dict, dict, dict, list]:
    """The A/B loop of --head-ab and --int4-ab: one decode stream of prompt ids per side (use(side)
    switches the runner to it; 4 warm-up steps each), then a.rounds rounds of a.steps steps, the
    sides rotated step by step. Returns (streams, ms: every step's wall ms by side, toks: each
    side's greedy ids, rounds: each round's load average and median ms by side)."""
    total = a.rounds * a.steps
    streams, ms, toks = {}, {s: [] for s in sides}, {s: [] for s in sides}
    for s in sides:
        use(s)
        streams[s] = Stream(runner, len(ids), total + 16, rid=f"{rid}{s}", prompt=ids)
        toks[s].append(streams[s].token)
        for _ in range(4):  # warm-up
            toks[s].append(streams[s].step())
    rounds = []
    for _r in range(a.rounds):
        rm: dict = {s: [] for s in sides}
        for i in range(a.steps):
            k = i % len(sides)
            for s in sides[k:] + sides[:k]:
                use(s)
                t0 = time.perf_counter()
                toks[s].append(streams[s].step())
                dt = 1e3 * (time.perf_counter() - t0)
                rm[s].append(dt)
                ms[s].append(dt)
        rounds.append({"load_avg": os.getloadavg(), **{f"{s}_ms_median": round(statistics.median(v), 3)
                                                         for s, v in rm.items()}})
    return streams, ms, toks, rounds


def run_head_ab(a: argparse.Namespace, q: str) -> dict:
    """--head-ab for scheme q (module doc)."""
    from benchmarks.cpu_decode import prompt_ids
    from kernels import cpu_quant_linear as cq
    from services.worker.layers.embedding import LMHead

    runner, load_s = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                  "num_threads": a.threads, "max_model_len": 4096})
    head = next(m for m in runner.model.modules() if isinstance(m, LMHead))
    if not head.tied or head.qweight_tied is None:
        raise SystemExit(f"--head-ab: {a.model} under {q} has no tied head's quantized copy")
    copies = {s: cq.quantize(head.weight.data, s) for s in ("int8", "w8a8")}
    ids = prompt_ids(a.model)

    def use(side: str) -> None:
        head.qweight_tied = copies[side]

    streams, ms, toks, rounds = rotated_steps(runner, list(copies), use, ids, a, "h")
    out: dict = {"load_seconds": round(load_s, 2), "rounds": rounds, "prompt_tokens": len(ids)}
    for s, c in copies.items():
        head.qweight_tied = c
        out[s] = {"ms_per_step_median": round(statistics.median(ms[s]), 3), "ms_per_step_min": round(min(ms[s]), 3),
                  "profile": profile_step(streams[s])}
    n = len(toks["int8"])
    same = next((i for i in range(n) if toks["int8"][i] != toks["w8a8"][i]), n)
    out["greedy_ids_equal"] = same == n
    out["greedy_common_prefix"] = same
    out["speedup"] = round(out["int8"]["ms_per_step_median"] / out["w8a8"]["ms_per_step_median"], 3)
    out["round_speedups"] = [round(r["int8_ms_median"] / r["w8a8_ms_median"], 3) for r in rounds]
    return out


INT4_SIDES = {"tinygemm": (False, 0), "vnni1": (True, 1), "vnni2": (True, 2)}  # (INT4_VNNI, X_PLANES)


def run_int4_ab(a: argparse.Namespace, q: str) -> dict:
    """--int4-ab for scheme q (module doc): the --int4-sides, rotated step by step."""
    from benchmarks.cpu_decode import prompt_ids
    from kernels import cpu_int4_vnni
    from kernels import cpu_quant_linear as cq

    if not cpu_int4_vnni.available():
        raise SystemExit("--int4-ab: the int4 VNNI kernel is not available here")
    cq.INT4_VNNI = cq.INT4_KEEP_TINYGEMM = True  # the weights get both copies at load
    runner, load_s = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                  "num_threads": a.threads, "max_model_len": 4096})
    sides = list(a.int4_sides)

    def use(side: str) -> None:
        cq.INT4_VNNI, planes = INT4_SIDES[side]
        cpu_int4_vnni.X_PLANES = planes or 2

    ids = prompt_ids(a.model)
    streams, ms, toks, rounds = rotated_steps(runner, sides, use, ids, a, "i")
    out: dict = {"load_seconds": round(load_s, 2), "rounds": rounds, "prompt_tokens": len(ids)}
    if a.int4_prefill:  # whole-prompt prefills of synthetic ids, rotated like the steps
        pre: dict = {s: [] for s in sides}
        for i in range(a.int4_prefill_reps):
            k = i % len(sides)
            for s in sides[k:] + sides[:k]:
                use(s)
                t0 = time.perf_counter()
                Stream(runner, a.int4_prefill, 0, rid=f"pre{s}{i}")
                pre[s].append(1e3 * (time.perf_counter() - t0))
        out["prefill"] = {"tokens": a.int4_prefill, "load_avg": os.getloadavg(),
                          **{f"{s}_ms": [round(v, 1) for v in pre[s]] for s in sides},
                          **{f"{s}_ms_median": round(statistics.median(pre[s]), 1) for s in sides}}
    return side_summary(out, sides, use, streams, ms, toks, rounds)


def side_summary(out: dict, sides: list[str], use, streams: dict, ms: dict, toks: dict, rounds: list) -> dict:
    """`rotated_steps`' results into out: per side the median and min ms a step and one profiled
    step; per side after the first, "<side>_vs_<first>": greedy ids equal (and the common
    prefix), the speedup of the medians and of each round's. Returns out."""
    for s in sides:
        use(s)
        out[s] = {"ms_per_step_median": round(statistics.median(ms[s]), 3), "ms_per_step_min": round(min(ms[s]), 3),
                  "profile": profile_step(streams[s])}
    base, n = sides[0], len(toks[sides[0]])
    for s in sides[1:]:
        same = next((i for i in range(n) if toks[base][i] != toks[s][i]), n)
        out[f"{s}_vs_{base}"] = {
            "greedy_ids_equal": same == n, "greedy_common_prefix": same, "greedy_tokens": n,
            "speedup": round(out[base]["ms_per_step_median"] / out[s]["ms_per_step_median"], 3),
            "round_speedups": [round(r[f"{base}_ms_median"] / r[f"{s}_ms_median"], 3) for r in rounds]}
    return out


def run_call_ab(a: argparse.Namespace, q: str) -> dict:
    """--call-ab for scheme q (module doc): the model modules' call through nn.Module's (hook
    dispatch) against services.worker.layers.module.Module's direct call, rotated step by step."""
    from torch import nn

    from benchmarks.cpu_decode import prompt_ids
    from services.worker.layers.module import Module

    runner, load_s = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                  "num_threads": a.threads, "max_model_len": 4096})
    direct = Module.__call__
    calls = {"nn_call": nn.Module.__call__, "direct_call": direct}

    def use(side: str) -> None:
        Module.__call__ = calls[side]  # type: ignore[method-assign]

    ids = prompt_ids(a.model)
    try:
        streams, ms, toks, rounds = rotated_steps(runner, list(calls), use, ids, a, "c")
        out: dict = {"load_seconds": round(load_s, 2), "rounds": rounds, "prompt_tokens": len(ids)}
        return side_summary(out, list(calls), use, streams, ms, toks, rounds)
    finally:
        Module.__call__ = direct  # type: ignore[method-assign]


def run_cxx_ab(a: argparse.Namespace, q: str) -> dict:
    """--cxx-ab for scheme q (module doc): the torch references against the C++ CPU decode ops
    (`kernels.ref_fast.CPU_CXX_OPS` off / on), rotated step by step."""
    from benchmarks.cpu_decode import prompt_ids
    from kernels import cpu_decode, ref_fast

    if not cpu_decode.available():
        raise SystemExit("--cxx-ab: the CPU decode ops' extension is not available here")
    runner, load_s = load_runner({"model": a.model, "device": "cpu", "quantization": q,
                                  "num_threads": a.threads, "max_model_len": 4096})
    sides = {"torch_ops": False, "cxx_ops": True}

    def use(side: str) -> None:
        ref_fast.CPU_CXX_OPS = sides[side]

    ids = prompt_ids(a.model)
    try:
        streams, ms, toks, rounds = rotated_steps(runner, list(sides), use, ids, a, "x")
        out: dict = {"load_seconds": round(load_s, 2), "rounds": rounds, "prompt_tokens": len(ids),
                     "flavour": cpu_decode.flavour()}
        return side_summary(out, list(sides), use, streams, ms, toks, rounds)
    finally:
        ref_fast.CPU_CXX_OPS = True


# flag -> (the JSON's benchmark name, the run of one scheme): the A/B modes, rotated step by step
AB_MODES = {"int4_ab": ("cpu_decode_profile --int4-ab", run_int4_ab),
            "call_ab": ("cpu_decode_profile --call-ab", run_call_ab),
            "head_ab": ("cpu_decode_profile --head-ab", run_head_ab),
            "cxx_ab": ("cpu_decode_profile --cxx-ab", run_cxx_ab)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", nargs="+", default=["int4", "int8"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--head-ab", action="store_true", help="tied head int8 vs w8a8, step by step (module doc)")
    ap.add_argument("--int4-ab", action="store_true", help="int4 tinygemm vs VNNI, step by step (module doc)")
    ap.add_argument("--call-ab", action="store_true",
                    help="nn.Module's call vs layers.module.Module's direct call, step by step (module doc)")
    ap.add_argument("--cxx-ab", action="store_true",
                    help="torch references vs the C++ CPU decode ops (ref_fast.CPU_CXX_OPS), step by step")
    ap.add_argument("--int4-sides", nargs="+", default=["tinygemm", "vnni2"], choices=sorted(INT4_SIDES),
                    help="with --int4-ab: the sides, the first the base of the ratios")
    ap.add_argument("--int4-prefill", type=int, default=0,
                    help="with --int4-ab: also time prefills of this many tokens a side, rotated")
    ap.add_argument("--int4-prefill-reps", type=int, default=3, help="with --int4-prefill: prefills a side")
    ap.add_argument("--levels", action="store_true", help="runner / core / HTTP decode rates (module doc)")
    ap.add_argument("--tokens", type=int, default=128, help="with --levels: tokens a stream")
    ap.add_argument("--rounds", type=int, default=5, help="with --levels / --head-ab: rounds")
    ap.add_argument("--server-variant", action="append", default=None,
                    help="with --levels: name[:arg,arg] extra kestrel serve args (repeatable; default base)")
    ap.add_argument("--busy", type=int, default=0, help="with --levels: spinning neighbour processes")
    ap.add_argument("--concurrent", action="store_true", help="with --levels: 8 streams at once too")
    ap.add_argument("--after-start", type=float, default=0.0,
                    help="with --levels: seconds of back-to-back streams from each fresh server's start, "
                         "standby spares on (benchmarks/cpu_serve_levels.py)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.levels:
        from benchmarks.cpu_serve_levels import levels_run

        a.server_variant = a.server_variant or ["base"]
        return levels_run(a)
    for flag, (name, run) in AB_MODES.items():
        if getattr(a, flag):
            res = {"benchmark": name, "date": time.strftime("%Y-%m-%d"), "threads": a.threads, "steps": a.steps,
                   "rounds": a.rounds, "load_avg_start": os.getloadavg(),
                   "schemes": {q: run(a, q) for q in a.quantization}, "load_avg": os.getloadavg()}
            emit_json(res, a.out)
            return 0
    res = {"benchmark": "cpu_decode_profile", "date": time.strftime("%Y-%m-%d"), "threads": a.threads,
           "context": a.context, "steps": a.steps, "load_avg_start": os.getloadavg(),
           "schemes": {q: run_scheme(a, q) for q in a.quantization}, "load_avg": os.getloadavg()}
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
