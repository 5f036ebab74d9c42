"""The cost of speculative verification on the device (issue 15, "Benchmark on the H200"):
dummy weights of a benchmarks/configs shape (default Qwen3-0.6B; --config llama-3.1-8b),
bf16 on CUDA, or `--tiny` (tiny-qwen3, fp32, CPU, small settings) to try it anywhere.

1. Verify step vs decode step (`verify_cost`): `ModelRunner.execute` on hand-made plans
   of `batch` seqs at --context tokens of context each: a plain decode step ([last token],
   with the runner's CUDA graphs and eager) against a verify step of k random drafts per
   seq ([last token, d1..dk], num_draft = k: logits at k + 1 positions, expanded rows,
   point-mass verification), k = 1..8, batch 1, 8, 32. Median over --reps of the wall time
   of one execute (host prepare, forward, verify, tokens back: execute returns host ints,
   so it is synchronous) and of its CUDA-event time. The same positions are rewritten each
   step. break_even_L = verify ms / plain ms: the acceptance length a verify step of that
   k needs to pay for itself.
2. End to end at batch 1 with a replay drafter (`e2e_replay`, benchmarks/spec_replay.py):
   one request (--e2e-prompt-len random ids, --e2e-tokens greedy output tokens,
   ignore_eos) through an `EngineCore` on an `InProcessExecutor` (benchmarks/common.py
   `run_core`: the engine's scheduler, the fixed policy with k = --e2e-k, the runner).
   The plain run gives the plain tok/s (the runner's proposer removed, in this process)
   and the first reference; then for each target acceptance length L the replay drafter
   proposes a reference with a share of drafts corrupted (`accept_for_length`). The
   reference is settled first (`spec_replay.settle_reference`, at most --e2e-ref-rounds
   untimed runs): in bf16 the verify kernels round differently from the plain decode path,
   so on random weights a speculative run's greedy output leaves the plain run's, and
   after that a drafter replaying the plain run has nothing to propose (no-draft steps: the
   measured L falls below the set share's). So the reference is the speculative run's own
   output at that point's acceptance and seed, run again until a run reproduces it; every
   proposal is then the set share of the target's own continuation, and the measured L
   reflects the corruption share. (Re-anchoring the drafter on the emitted tokens instead
   would need the target's continuation from there, which only a run gives.) Reported:
   measured L (1 + accepted / drafts, the core's spec_decode counters), tok/s, speedup over
   plain, efficiency = speedup / L (target >= 0.8 for L <= 4), `identical` (output = the
   plain run's: true on the CPU's fp32, not expected in bf16), `on_reference` (= the
   settled reference), `reference_rounds` / `reference_settled` /
   `reference_differs_from_plain_at` (the first index, None: nowhere),
   `off_track_proposals` of the timed runs (0 once settled). Per point and for plain, one
   more run behind a `StepKindTimer` (benchmarks/spec_step_kinds.py): `step_kinds`, per
   kind of step (prefill, decode graph / eager, verify graph / eager, no-draft graph /
   eager) its count, median and total wall ms of `execute`, the host time before the
   forward's first launch and after the step's last device read, the engine's gap before
   it, and on CUDA the device span by events; `kinds_run_tok_per_s` that run's own tok/s
   (its hooks cost a few us a step). --e2e-stand-in (CPU): verify steps through the
   verify-graph path over the stand-in graphs of tests/unit/verify_graphs_rig.py.
3. The draft-model proposer (`draft_model`, when services/worker/spec/draft_model.py
   exists; skipped otherwise): dummy drafts of the target's shape, its full depth (the
   target as its own draft: acceptance 100% up to numerics) and 2 layers, k = --e2e-k,
   fixed policy, at batch 1 and 32 (--dm-batches) through `run_core`, against plain runs
   of the same runner. tok/s, speedup, measured L, identical outputs.
4. `--parts profile` (CUDA only): per-kernel device time of batch-1 decode and verify steps
   (`profile_steps`), to see where a verify step's time goes.
5. `--parts host`: the host side of a verify step (`host_cost`): time outside the model
   forward, ATen ops and host reads of a decode step and of a k = --e2e-k greedy verify step
   with the fast path (`spec.step.FAST_VERIFY`) on and off in the same run (--host-batches,
   --host-reps), and cProfile's top worker functions. --fast-verify on|off sets the path of
   the other parts (the A/B of the verify and e2e parts runs them twice).
--skinny one_tile|k_loop picks the 2..16-row projection kernel for the whole run
(kernels/linear.py SKINNY_PDL; scripts/gpu_verifyk.sh runs both).
--mq-merge launch|fused picks how verify steps' split-K attention merges its partitions
(kernels/attention_multi_query.py MQ_DEFAULTS "fused_merge": a `_merge_kernel` launch after
the kernel, the default, or in the kernel by the last live split; set before the runner loads,
so its warm-up and graphs take it; decode steps are unaffected; scripts/gpu_mqfuse.sh runs both).
--gemv-rows N sends projections of 2..N rows (verify steps at batch 1 up to k = N - 1) to the
one-row gemv kernel run over each row in turn (kernels/gemv.py ROWS, default the module's 2) in
place of the one-tile skinny kernel; 1 keeps the skinny kernel; set before the runner loads, so
its graphs take it (scripts/gpu_gemvrows.sh runs 1 and 8). --skinny-tuning JSON updates the
one-tile kernel's plan knobs (kernels/linear.py SKINNY_PDL_TUNING) for the run.
Prefill is included in the end-to-end tok/s (one --e2e-prompt-len prefill per request).
JSON (settings, device, runner report, the three parts) to --out and stdout.

Usage:
  python benchmarks/spec_verify_cost.py [--config qwen3-0.6b|llama-3.1-8b] [--out FILE]
  .venv/bin/python benchmarks/spec_verify_cost.py --tiny            # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import spec_stats as st  # noqa: E402
from benchmarks.common import device_name, emit_json, load_runner, model_dir, new_core, run_core  # noqa: E402
from benchmarks.spec_replay import (ReplayProposer, accept_for_length, registered, settle_reference,  # noqa: E402
                                    without_proposer)
from benchmarks.spec_step_kinds import StepKindTimer  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
EFFICIENCY_TARGET = 0.8  # speedup >= 0.8 x L for L <= 4 (issue 15)


def spec_json(k: int, **extra) -> str:
    """`speculative_config` of a fixed-policy draft_model run (the replay drafter takes
    that registry slot, benchmarks/spec_replay.py)."""
    return json.dumps({"method": "draft_model", "num_speculative_tokens": k, "policy": "fixed", **extra})


def timed_execute(runner, plan: StepPlan, cuda: bool) -> tuple[float, float | None]:
    """(wall seconds, CUDA-event seconds or None on CPU) of one `runner.execute(plan)`."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    res = runner.execute(plan)
    wall = time.perf_counter() - t0
    if res.error:
        raise RuntimeError(f"step {plan.step_id}: {res.error}")
    if not cuda:
        return wall, None
    b.record()
    b.synchronize()
    return wall, a.elapsed_time(b) / 1e3


def verify_plan(step: int, seqs: list[tuple[str, int, list[int], list[int]]], context: int, k: int) -> StepPlan:
    """A step of one seq per (request id, last token, drafts, block table): [last, d1..dk]
    at position `context` with num_draft = k (k = 0: a plain decode step), greedy."""
    return StepPlan(step, [ScheduledSeq(rid, [tok, *d[:k]], context, table, True, GREEDY, 1, num_draft=k)
                           for rid, tok, d, table in seqs])


def verify_cost(runner, batches: list[int], ks: list[int], context: int, reps: int, cuda: bool) -> list[dict]:
    """Part 1 (module doc): one row per (batch, k), k = 0 the plain decode (graphs and eager)."""
    g = torch.Generator().manual_seed(0)
    kmax, bs = max(ks), runner.block_size
    need = -(-(context + kmax + 2) // bs)
    rows, step = [], 0
    for b in batches:
        if b * need > runner.num_blocks:
            rows.append({"batch": b, "skipped": f"needs {b * need} KV blocks, the runner has {runner.num_blocks}"})
            continue
        ids = [f"v{b}_{j}" for j in range(b)]
        tables = [list(range(j * need, (j + 1) * need)) for j in range(b)]
        last = []
        for j in range(b):  # prefill, one seq per step
            prompt = torch.randint(3, 10000, (context,), generator=g).tolist()
            res = runner.execute(StepPlan(step, [ScheduledSeq(ids[j], prompt, 0, tables[j], True, GREEDY)]))
            last.append(res.sampled_token_ids[0])
            step += 1
        drafts = [torch.randint(3, 10000, (kmax,), generator=g).tolist() for _ in range(b)]
        seqs = [(ids[j], last[j], drafts[j], tables[j]) for j in range(b)]

        graphs = runner.graphs
        base: dict[str, float] = {}
        for mode, k in ([("graphs", 0)] if graphs is not None else []) + [("eager", 0)] + [("verify", k) for k in ks]:
            runner.graphs = graphs if mode == "graphs" else None
            times = []
            for i in range(3 + reps):  # 3 warm-up steps
                step += 1
                t = timed_execute(runner, verify_plan(step, seqs, context, k), cuda)
                if i >= 3:
                    times.append(t)
            wall = statistics.median(t[0] for t in times)
            gpus = [t[1] for t in times if t[1] is not None]
            gpu = statistics.median(gpus) if gpus else None
            row = {"batch": b, "k": k, "mode": mode, "tokens": b * (k + 1), "wall_ms": round(wall * 1e3, 4),
                   "gpu_ms": round(gpu * 1e3, 4) if gpu is not None else None}
            if mode != "verify":
                base[mode] = wall
            else:
                ref = base.get("graphs", base["eager"])
                row.update(break_even_L=round(wall / ref, 3), vs_plain_eager=round(wall / base["eager"], 3))
            rows.append(row)
        runner.graphs = graphs
        runner.execute(StepPlan(step + 1, [], forget=ids))
        step += 2
    return rows


def profile_steps(runner, k: int, context: int, steps: int = 5, top: int = 14) -> dict:
    """Part 4 (--parts profile): per-kernel device time (torch.profiler) of `steps` batch-1
    decode steps (the runner's CUDA graph) and of `steps` verify steps of k drafts (its
    verify graph when one serves), at `context` tokens: the top kernels of each in us a step."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(3)
    need = -(-(context + k + 2) // runner.block_size)
    table = list(range(need))
    prompt = torch.randint(3, 10000, (context,), generator=g).tolist()
    res = runner.execute(StepPlan(9000, [ScheduledSeq("prof", prompt, 0, table, True, GREEDY)]))
    seqs = [("prof", res.sampled_token_ids[0], torch.randint(3, 10000, (k,), generator=g).tolist(), table)]
    out: dict = {"k": k, "context": context, "steps": steps}
    for name, kk in (("decode", 0), ("verify", k)):
        for i in range(3):  # warm-up
            runner.execute(verify_plan(9001 + i, seqs, context, kk))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                runner.execute(verify_plan(9010 + i, seqs, context, kk))
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                rows.append((us / steps, ev.count // steps, ev.key[:90]))
        rows.sort(reverse=True)
        out[name] = {"total_us": round(sum(r[0] for r in rows), 1),
                     "top": [{"us": round(u, 1), "calls": c, "kernel": n} for u, c, n in rows[:top]]}
    runner.execute(StepPlan(9100, [], forget=["prof"]))
    return out


# the model's own trees, left out of host_cost's profile (their time is the forward's)
_FORWARD_TREES = ("services/worker/models", "services/worker/layers")


class _HostCounter:
    """Per step: seconds inside the model forward (`run_model`, `compute_logits`), ATen ops
    outside and inside it (a TorchDispatchMode), and host reads (`Tensor.tolist` / `item`
    calls: each is a device sync on CUDA) while `on`. Patches the runner's instance and
    torch.Tensor's two methods only inside `with`."""

    def __init__(self, runner):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.runner, self.fwd_s, self.ops_out, self.ops_in, self.reads, self.depth = runner, 0.0, 0, 0, 0, 0
        self.by_op: dict[str, int] = {}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.depth:
                    counter.ops_in += 1
                else:
                    counter.ops_out += 1
                    name = str(func.overloadpacket.__name__)
                    counter.by_op[name] = counter.by_op.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def reset(self) -> None:
        self.fwd_s, self.ops_out, self.ops_in, self.reads, self.by_op = 0.0, 0, 0, 0, {}
        self.fwd_first = self.fwd_last = self.read_start = self.read_end = None

    def _timed(self, fn):
        def call(*a, **kw):
            self.depth += 1
            t0 = time.perf_counter()
            if self.fwd_first is None:
                self.fwd_first = t0
            try:
                return fn(*a, **kw)
            finally:
                self.fwd_last = t1 = time.perf_counter()
                self.fwd_s += t1 - t0
                self.depth -= 1
        return call

    def _reading(self, fn):
        def call(t, *a, **kw):
            if self.depth:
                return fn(t, *a, **kw)
            self.reads += 1
            t0 = time.perf_counter()
            try:
                return fn(t, *a, **kw)
            finally:
                if t.device.type != "cpu" or not torch.cuda.is_available():  # the step's device reads
                    self.read_start, self.read_end = t0, time.perf_counter()
        return call

    def __enter__(self):
        r = self.runner
        self._saved = (r.run_model, r.model.compute_logits, torch.Tensor.tolist, torch.Tensor.item)
        r.run_model, r.model.compute_logits = self._timed(r.run_model), self._timed(r.model.compute_logits)
        torch.Tensor.tolist, torch.Tensor.item = self._reading(torch.Tensor.tolist), self._reading(torch.Tensor.item)
        return self

    def __exit__(self, *exc):
        r = self.runner
        r.run_model, r.model.compute_logits, torch.Tensor.tolist, torch.Tensor.item = self._saved
        del r.__dict__["run_model"], r.model.__dict__["compute_logits"]  # back to the class methods


def host_cost(runner, batches: list[int], k: int, context: int, reps: int, cuda: bool, top: int = 16) -> dict:
    """Part 5 (--parts host): the host side of a verify step against a decode step.
    Per batch: `execute` of a plain decode plan (k = 0), and of a greedy verify plan of k
    random drafts with the fast path (`spec.step.FAST_VERIFY`) on and off, interleaved step
    by step in this process (the A/B). Median over reps of: wall ms, ms inside the model
    forward (run_model + compute_logits; on CUDA their launches, the device work is waited
    for at the host read, so it lands in `outside`), ms outside it, the host reads
    (tolist/item: device syncs on CUDA); and the ATen ops outside and inside the forward of
    one more step (a TorchDispatchMode, kept out of the timed steps); before_forward_ms (execute's start to the first forward launch) and
    after_last_read_ms (the end of the step's last device read, on the CPU its last host read
    of a tensor, to execute's end): on CUDA together the host time the device sits idle.
    `identical`: both verify paths gave the same tokens every step. `profile`: the
    top functions of the services/ and shared/ trees (the model's own left out) by
    cumulative ms a step (cProfile, its own steps, overhead included) of each mode at the
    largest batch. On the CPU the
    verify-graph path's host side runs too (`verify_fast_graph`, `verify_full_graph`:
    `replay_verify` over tests/unit/verify_graphs_rig.py's stand-in, whose "replay" is the
    eager forward of the padded buffers, timed as forward, plus one torch.where outside)."""
    import cProfile
    import pstats

    from services.worker.spec import step as spec_step

    g = torch.Generator().manual_seed(5)
    bs = runner.block_size
    need = -(-(context + k + 2) // bs)
    out: dict = {"k": k, "context": context, "reps": reps, "rows": []}
    step = 20000
    modes = [("decode", 0, True), ("verify_fast", k, True), ("verify_full", k, False)]
    graphs_of = {"decode": runner.verify_graphs, "verify_fast": runner.verify_graphs,
                 "verify_full": runner.verify_graphs}
    if not cuda:  # the verify-graph path's host side, over the CPU stand-in of the graphs
        from tests.unit.verify_graphs_rig import EagerReplayGraphs

        stand_in = EagerReplayGraphs(runner._verify_graph_forward, max(batches), k, runner.max_model_len, bs,
                                     (runner.num_blocks - 1) * bs)
        modes += [("verify_fast_graph", k, True), ("verify_full_graph", k, False)]
        graphs_of.update(verify_fast_graph=stand_in, verify_full_graph=stand_in)
    saved_graphs = runner.verify_graphs
    for b in batches:
        if b * need > runner.num_blocks:
            out["rows"].append({"batch": b, "skipped": f"needs {b * need} KV blocks"})
            continue
        ids = [f"h{b}_{j}" for j in range(b)]
        tables = [list(range(j * need, (j + 1) * need)) for j in range(b)]
        last = []
        for j in range(b):
            prompt = torch.randint(3, 10000, (context,), generator=g).tolist()
            res = runner.execute(StepPlan(step, [ScheduledSeq(ids[j], prompt, 0, tables[j], True, GREEDY)]))
            last.append(res.sampled_token_ids[0])
            step += 1
        drafts = [torch.randint(3, 10000, (k,), generator=g).tolist() for _ in range(b)]
        seqs = [(ids[j], last[j], drafts[j], tables[j]) for j in range(b)]
        stats: dict[str, list[tuple]] = {m: [] for m, _, _ in modes}
        ops: dict[str, tuple] = {}
        toks: dict[str, list] = {m: [] for m, _, _ in modes}
        counter = _HostCounter(runner)
        try:
            for i in range(4 + reps):  # 3 warm-up steps, the timed ones, a last one counting ATen ops
                count_ops = i == 3 + reps
                for name, kk, fast in modes:
                    spec_step.FAST_VERIFY = fast
                    runner.verify_graphs = graphs_of[name]
                    step += 1
                    plan = verify_plan(step, seqs, context, kk)
                    if cuda:
                        torch.cuda.synchronize()
                    counter.reset()
                    with counter, (counter.mode if count_ops else contextlib.nullcontext()):
                        t0 = time.perf_counter()
                        res = runner.execute(plan)
                        t1 = time.perf_counter()
                    c = counter
                    if count_ops:
                        ops[name] = (c.ops_out, c.ops_in, dict(c.by_op))
                    elif i >= 3:
                        pre = (c.fwd_first or t1) - t0
                        read_end = c.read_end if c.read_end is not None and c.read_end > (c.fwd_last or t0) else t1
                        stats[name].append((t1 - t0, c.fwd_s, c.reads, pre, t1 - read_end))
                        toks[name].append((res.sampled_token_ids, res.num_sampled))
            prof_rows: dict[str, list] = {}
            for name, kk, fast in modes if b == max(batches) else []:
                spec_step.FAST_VERIFY = fast
                runner.verify_graphs = graphs_of[name]
                pr = cProfile.Profile()
                n_prof = max(3, reps // 2)
                for _ in range(n_prof):
                    step += 1
                    plan = verify_plan(step, seqs, context, kk)
                    pr.enable()
                    runner.execute(plan)
                    pr.disable()
                ps = pstats.Stats(pr)
                fns = []
                for (fname, line, fn), (_cc, nc, _tt, ct, _callers) in ps.stats.items():  # type: ignore[attr-defined]
                    rel = os.path.relpath(fname, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                    if rel.startswith(("services", "shared")) and not rel.startswith(_FORWARD_TREES):
                        fns.append((ct / n_prof * 1e3, nc // n_prof, f"{rel}:{line}({fn})"))
                fns.sort(reverse=True)
                prof_rows[name] = [{"ms": round(ms, 4), "calls": c, "fn": f} for ms, c, f in fns[:top]]
        finally:
            spec_step.FAST_VERIFY = True
            runner.verify_graphs = saved_graphs
        row: dict = {"batch": b}
        for name, _, _ in modes:
            xs = stats[name]
            med = statistics.median
            ops_out, ops_in, by_op = ops[name]
            row[name] = {"wall_ms": round(med(x[0] for x in xs) * 1e3, 4),
                         "forward_ms": round(med(x[1] for x in xs) * 1e3, 4),
                         "outside_ms": round(med(x[0] - x[1] for x in xs) * 1e3, 4),
                         "aten_ops_outside": ops_out, "aten_ops_forward": ops_in,
                         "host_reads": int(med(x[2] for x in xs)),
                         "before_forward_ms": round(med(x[3] for x in xs) * 1e3, 4),
                         "after_last_read_ms": round(med(x[4] for x in xs) * 1e3, 4),
                         "ops_outside_top": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:12])}
        row["identical"] = all(toks[m] == toks["verify_full"] for m, _, _ in modes if m != "decode")
        row["outside_ms_saved"] = round(row["verify_full"]["outside_ms"] - row["verify_fast"]["outside_ms"], 4)
        if "verify_full_graph" in row:
            row["outside_ms_saved_graph"] = round(row["verify_full_graph"]["outside_ms"]
                                                  - row["verify_fast_graph"]["outside_ms"], 4)
        if prof_rows:
            row["profile"] = prof_rows
        out["rows"].append(row)
        runner.execute(StepPlan(step + 1, [], forget=ids))
        step += 2
    return out


def _one_run(runner, prompts: list[list[int]], n: int, prefix: str, spec: str | None,
             max_num_batched_tokens: int, kinds: bool = False) -> tuple[dict, dict, dict]:
    """prompts (one request each, greedy, n tokens, ignore_eos) through a fresh core
    (speculative with `spec`, plain with None). Returns (speed, tokens by request index,
    the core's spec counters or {}). kinds: the run behind a `StepKindTimer`
    (benchmarks/spec_step_kinds.py), its summary in speed["step_kinds"]."""
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    extra = {"speculative_config": spec, "load_format": "dummy"} if spec else None
    core = new_core(runner, max(8, len(prompts)), max_num_batched_tokens, len(prompts), extra)
    toks: dict[str, list[int]] = {}
    timer = StepKindTimer(runner) if kinds else None
    with timer if timer is not None else contextlib.nullcontext():
        seconds, steps, out, timing = run_core(core, timer or runner, [(p, sp) for p in prompts], prefix, toks)
    counters = st.spec_counters_from_stats(core.stats()) if spec else None
    speed = {"seconds": round(seconds, 4), "steps": steps, "output_tokens": out,
             "output_tok_per_s": round(out / seconds, 2), "run_step_seconds": timing["run_step_seconds"],
             "schedule_seconds": timing["schedule_seconds"], "update_seconds": timing["update_seconds"]}
    if timer is not None:
        speed["step_kinds"] = timer.summary()
    return speed, {int(r[len(prefix):]): t for r, t in toks.items()}, (st.acceptance_summary(counters) if counters else {})


def _median_run(runner, prompts, n, tag: str, spec, mbt, reps: int, before=None) -> tuple[dict, dict, dict]:
    """`_one_run` reps times (ids tag<rep>_<i>); the run of median tok/s (the upper middle
    one for an even count), with its tokens and counters, and every run's tok/s.
    before(prefix): called before each run (the replay drafter's references)."""
    runs = []
    for rep in range(reps):
        prefix = f"{tag}{rep}_"
        if before is not None:
            before(prefix)
        runs.append(_one_run(runner, prompts, n, prefix, spec, mbt))
    runs.sort(key=lambda r: r[0]["output_tok_per_s"])
    speed, toks, acc = runs[len(runs) // 2]
    return {**speed, "tok_per_s_all": [r[0]["output_tok_per_s"] for r in runs]}, toks, acc


def e2e_replay(runner, k: int, lengths: list[float], prompt_len: int, n: int, reps: int, mbt: int,
               ref_rounds: int = 8) -> dict:
    """Part 2 (module doc). Per point the replay reference is settled first
    (`spec_replay.settle_reference`, at most ref_rounds untimed speculative runs at the
    point's acceptance and seed), then the timed runs, then one run behind a
    `StepKindTimer` (`step_kinds`, its own tok/s `kinds_run_tok_per_s`)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 10000, (prompt_len,), generator=g).tolist()
    proposer = runner.proposer
    assert isinstance(proposer, ReplayProposer), "the runner was not built with the replay drafter"
    with without_proposer(runner):
        _one_run(runner, [prompt], n, "pw_", None, mbt)  # warm-up
        plain, ref_toks, _ = _median_run(runner, [prompt], n, "p", None, mbt, reps)
        kinds_plain, _, _ = _one_run(runner, [prompt], n, "pk_", None, mbt, kinds=True)
    plain.update(step_kinds=kinds_plain["step_kinds"], kinds_run_tok_per_s=kinds_plain["output_tok_per_s"])
    ref = ref_toks[0]

    def use(tokens: list[int], accept: float, seed: int):
        def before(prefix: str) -> None:
            proposer.refs, proposer.accept, proposer.seed = {prefix + "0": tokens}, accept, seed
        return before

    for a in (1.0, 0.5):  # warm-up of the verify shapes
        use(ref, a, 99)("sw_")
        _one_run(runner, [prompt], n, "sw_", spec_json(k), mbt)
    points = []
    for li, length in enumerate(lengths):
        accept = accept_for_length(min(length, k + 1), k)
        rounds = [0]

        def spec_tokens(tokens: list[int], li=li, accept=accept, rounds=rounds) -> list[int]:
            rounds[0] += 1
            prefix = f"sr{li}_{rounds[0]}_"
            use(tokens, accept, li)(prefix)
            return _one_run(runner, [prompt], n, prefix, spec_json(k), mbt)[1][0]

        settled, used, converged = settle_reference(ref, spec_tokens, ref_rounds)
        proposer.off_track = 0
        speed, toks, acc = _median_run(runner, [prompt], n, f"s{li}_", spec_json(k), mbt, reps,
                                       use(settled, accept, li))
        off_track = proposer.off_track
        use(settled, accept, li)(f"sk{li}_")
        kinds_run, _, _ = _one_run(runner, [prompt], n, f"sk{li}_", spec_json(k), mbt, kinds=True)
        measured = acc.get("mean_acceptance_length") or 1.0
        speedup = speed["output_tok_per_s"] / plain["output_tok_per_s"]
        eff = speedup / measured
        points.append({"target_L": length, "accept": round(accept, 4), "measured_L": measured,
                       "acceptance": acc, **speed, "speedup": round(speedup, 3), "efficiency": round(eff, 3),
                       "meets_target": eff >= EFFICIENCY_TARGET if measured <= 4.0 else None,
                       "identical": toks.get(0) == ref, "on_reference": toks.get(0) == settled,
                       "reference_rounds": used, "reference_settled": converged,
                       "reference_differs_from_plain_at": next((i for i, (x, y) in enumerate(zip(settled, ref))
                                                                if x != y), None),
                       "off_track_proposals": off_track, "step_kinds": kinds_run["step_kinds"],
                       "kinds_run_tok_per_s": kinds_run["output_tok_per_s"]})
    return {"k": k, "prompt_len": prompt_len, "output_tokens": n, "plain": plain, "points": points,
            "target": f"speedup >= {EFFICIENCY_TARGET} x L for L <= 4"}


def draft_model_part(cli: dict, k: int, batches: list[int], prompt_len: int, n: int, reps: int, mbt: int) -> dict:
    """Part 3 (module doc); {"skipped": why} without the draft-model proposer."""
    if importlib.util.find_spec("services.worker.spec.draft_model") is None:
        return {"skipped": "services/worker/spec/draft_model.py is not in this tree (spec-draft not merged)"}
    g = torch.Generator().manual_seed(2)
    out: dict = {"k": k, "prompt_len": prompt_len, "output_tokens": n, "variants": {}}
    for name, layers in (("target_as_draft", 0), ("2_layer_draft", 2)):
        spec = spec_json(k, draft_num_layers=layers)
        runner, startup = load_runner({**cli, "speculative_config": spec})
        rows = []
        for b in batches:
            prompts = [torch.randint(3, 10000, (prompt_len,), generator=g).tolist() for _ in range(b)]
            with without_proposer(runner):
                _one_run(runner, prompts, min(n, 16), f"dpw{b}_", None, mbt)
                plain, ref, _ = _median_run(runner, prompts, n, f"dp{b}_", None, mbt, reps)
            _one_run(runner, prompts, min(n, 16), f"dsw{b}_", spec, mbt)
            speed, toks, acc = _median_run(runner, prompts, n, f"ds{b}_", spec, mbt, reps)
            rows.append({"batch": b, "plain": plain, "spec": speed, "acceptance": acc,
                         "speedup": round(speed["output_tok_per_s"] / plain["output_tok_per_s"], 3),
                         "identical_requests": sum(toks.get(i) == ref.get(i) for i in range(b)), "requests": b})
        out["variants"][name] = {"draft_num_layers": layers or "target's depth", "startup_seconds": round(startup, 2),
                                 "speculative": runner.report().get("speculative"), "rows": rows}
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="benchmarks/configs name (default qwen3-0.6b; tiny-qwen3 with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny-qwen3, fp32, small settings")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--e2e-k", type=int, default=4)
    ap.add_argument("--e2e-lengths", type=float, nargs="+", default=None)
    ap.add_argument("--e2e-prompt-len", type=int, default=None)
    ap.add_argument("--e2e-tokens", type=int, default=None)
    ap.add_argument("--e2e-reps", type=int, default=None)
    ap.add_argument("--e2e-ref-rounds", type=int, default=8,
                    help="untimed speculative runs at most per e2e point to settle its replay reference "
                         "(benchmarks/spec_replay.py settle_reference; 0: the plain run's tokens, as before)")
    ap.add_argument("--dm-batches", type=int, nargs="+", default=None)
    ap.add_argument("--dm-reps", type=int, default=1, help="timed runs per draft-model point (after a warm-up)")
    ap.add_argument("--parts", nargs="+", choices=["verify", "e2e", "draft_model", "profile", "host"],
                    default=["verify", "e2e", "draft_model"])
    ap.add_argument("--attention", choices=["multi_query", "prefill"], default="multi_query",
                    help="the kernel of verify steps' attention: the split-K multi-query kernel "
                         "(kernels/attention_multi_query.py, the default) or the varlen prefill kernel")
    ap.add_argument("--e2e-stand-in", action="store_true",
                    help="CPU only: the e2e part's verify steps through the verify-graph path over the stand-in "
                         "graphs of tests/unit/verify_graphs_rig.py (as the host part's *_graph modes)")
    ap.add_argument("--host-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--host-reps", type=int, default=None)
    ap.add_argument("--fast-verify", choices=["on", "off"], default="on",
                    help="the greedy fast path of verification (services/worker/spec/step.py FAST_VERIFY) for the "
                         "verify and e2e parts (the host part measures both)")
    ap.add_argument("--skinny", choices=["one_tile", "k_loop"], default="one_tile",
                    help="the 2..16-row projection kernel (kernels/linear.py SKINNY_PDL): the one-tile kernel "
                         "with PDL, the in-kernel split sum and the fused layer path at 2..16 rows (default), or "
                         "the K-loop kernel with its 2-kernel split sum and those steps unfused (before issue 15)")
    ap.add_argument("--mq-merge", choices=["launch", "fused"], default="launch",
                    help="the split merge of the multi-query (verify) attention kernel: a second launch "
                         "(default) or in the kernel (kernels/attention_multi_query.py MQ_DEFAULTS fused_merge)")
    ap.add_argument("--skinny-tuning", default=None,
                    help="JSON: entries of kernels/linear.py SKINNY_PDL_TUNING for the whole run (the one-tile "
                         "kernel's plan), e.g. '{\"max_block_k\": 512}'")
    ap.add_argument("--gemv-rows", type=int, default=None,
                    help="projections of 2..N rows on the gemv kernel, each row over the loaded W tile "
                         "(kernels/gemv.py ROWS; default: the module's); 1: the skinny kernel")
    ap.add_argument("--notes", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.attention == "prefill":
        from kernels import attention_triton
        attention_triton.DECODE_DEFAULTS["multi_query"] = False
    from kernels import linear as linear_kernels
    linear_kernels.SKINNY_PDL = a.skinny == "one_tile"  # read by the runner's FusionPlan at load
    if a.skinny_tuning:
        linear_kernels.SKINNY_PDL_TUNING.update(json.loads(a.skinny_tuning))
    from kernels import attention_multi_query
    attention_multi_query.MQ_DEFAULTS["fused_merge"] = a.mq_merge == "fused"  # before the warm-up and graphs
    from kernels import gemv as gemv_kernels
    if a.gemv_rows is not None:
        gemv_kernels.ROWS = a.gemv_rows  # read by linear() at every call, before the warm-up and graphs
    tiny = a.tiny
    d = dict(config="tiny-qwen3", batches=[1, 4], ks=[1, 2, 4], context=64, reps=5, e2e_lengths=[1, 2, 3],
             e2e_prompt_len=32, e2e_tokens=40, e2e_reps=1, dm_batches=[1, 4]) if tiny else \
        dict(config="qwen3-0.6b", batches=[1, 8, 32], ks=list(range(1, 9)), context=1024, reps=20,
             e2e_lengths=[1, 1.5, 2, 2.5, 3, 3.5, 4, 5], e2e_prompt_len=512, e2e_tokens=256, e2e_reps=2,
             dm_batches=[1, 32])
    for key, v in d.items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    cuda = not tiny
    mbt = 4096
    cli = {"model": model_dir(a.config), "load_format": "dummy", "device": "cuda" if cuda else "cpu",
           "dtype": "bfloat16" if cuda else "float32", "max_num_seqs": max(32, *a.batches, *a.dm_batches),
           "max_num_batched_tokens": mbt, "max_model_len": max(2048, a.context + 64, a.e2e_prompt_len + a.e2e_tokens + 64),
           "enable_prefix_caching": False}
    cli.update({"gpu_memory_utilization": 0.35} if cuda else {"kv_cache_gib": 0.25})
    res: dict = {"benchmark": "spec_verify_cost", "device": device_name() if cuda else "cpu", "config": a.config,
                 "weights": "dummy", "dtype": cli["dtype"], "torch": torch.__version__,
                 "mq_merge": a.mq_merge, "gemv_rows": gemv_kernels.ROWS,
                 "skinny_pdl_tuning": dict(linear_kernels.SKINNY_PDL_TUNING),
                 "settings": {k: v for k, v in vars(a).items() if k not in ("out", "notes")}, "notes": a.notes}
    def save_partial() -> None:  # a run cut short (a timeout) keeps the parts already done
        if a.out:
            with open(a.out, "w") as fh:
                json.dump({**res, "complete": False}, fh, indent=1)

    from services.worker.spec import step as spec_step
    spec_step.FAST_VERIFY = a.fast_verify == "on"
    if a.host_reps is None:
        a.host_reps = 10 if tiny else 50
    if "host" in a.parts and "verify" not in a.parts and "e2e" not in a.parts:
        a.ks = [a.e2e_k]
    if any(p in a.parts for p in ("verify", "e2e", "profile", "host")):
        with registered():
            runner, startup = load_runner({**cli, "speculative_config": spec_json(max(max(a.ks), a.e2e_k))})
        res.update(runner=runner.report(), startup_seconds=round(startup, 2))
        if "verify" in a.parts:
            with without_proposer(runner):
                res["verify_cost"] = verify_cost(runner, a.batches, a.ks, a.context, a.reps, cuda)
            save_partial()
        if "profile" in a.parts and cuda:
            with without_proposer(runner):
                res["profile"] = profile_steps(runner, a.e2e_k, a.context)
            save_partial()
        if "host" in a.parts:
            with without_proposer(runner):
                res["host_cost"] = host_cost(runner, a.host_batches, a.e2e_k, a.context, a.host_reps, cuda)
            spec_step.FAST_VERIFY = a.fast_verify == "on"
            save_partial()
        if "e2e" in a.parts:
            if a.e2e_stand_in and not cuda:
                from tests.unit.verify_graphs_rig import EagerReplayGraphs

                runner.verify_graphs = EagerReplayGraphs(runner._verify_graph_forward, 1, a.e2e_k,
                                                         runner.max_model_len, runner.block_size,
                                                         (runner.num_blocks - 1) * runner.block_size)
            res["e2e_replay"] = e2e_replay(runner, a.e2e_k, a.e2e_lengths, a.e2e_prompt_len, a.e2e_tokens,
                                           a.e2e_reps, mbt, a.e2e_ref_rounds)
            save_partial()
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "draft_model" in a.parts:
        res["draft_model"] = draft_model_part(cli, a.e2e_k, a.dm_batches, a.e2e_prompt_len, a.e2e_tokens,
                                              a.dm_reps, mbt)
    res["complete"] = True
    shutil.rmtree(cli["model"], ignore_errors=True)  # the temporary config-only model folder
    emit_json(res, a.out)


if __name__ == "__main__":
    main()
