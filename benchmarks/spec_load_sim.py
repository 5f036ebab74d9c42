"""Speculation at a large batch on a simulated device (issue 15, docs/ARCHITECTURE.md §5.5).

The engine core (`EngineCore`, the real scheduler, policy, n-gram drafter and step pipeline)
runs in process against `ScriptWorker`, a worker without a model: request r's i-th output
token is `script(r, i)`, whatever the context (as a dummy-weight model's output ignores the
prompt), and a verify accepts drafts while they equal the script. A share of the requests
falls into a loop of a few tokens after a while (a random model's output has such loops), so
n-gram lookup finds matches there and nowhere else. `SimDevice` is the executor: one device
that runs the plans in order, each taking `h200_like(plan)` seconds of a simulated clock,
and an engine that spends `engine_s(plan)` of it before each submit; under async scheduling
the device's step overlaps the engine's work for the next one, so a step the pipeline must
wait for (a verify, a `lookup_due`) costs the engine's time on top. The clock is also the
engine core's, so the policy's cost curves are the simulated ones.

`h200_like`: the H200 figures of benchmarks/results/2026-12-03_h200_spec_serve_engine_ngram.json
(Qwen3-0.6B, dummy weights): a decode-only step replays a CUDA graph, 1.0 ms + 8.5 us a seq
(3.2 ms at 256); a step with a prefill chunk runs eagerly, 14 ms + 3 us a token; a verify
step replays a verify graph only at <= 32 seqs all verifying the same k (1.5 ms + 40 us a
seq), else it runs eagerly (docs/ARCHITECTURE.md §6.5, MIXED_K off).

Reported per variant (plain, spec): simulated seconds and output tok/s, steps, synchronous
plans, verify steps, probe steps, lookups, the engine's real CPU time per step (the
worker's own time excluded; indicative on a shared machine), of it the speculation's
(`Scheduler._choose_drafts`: the policy and the lookups), and the requests whose output
differs from their script (`wrong_outputs`, 0: token for token the plain decoding). `ratio` = spec / plain
simulated throughput. Usage:
  .venv/bin/python benchmarks/spec_load_sim.py [--concurrency 256] [--requests 1024]
      [--loops 0.4] [--prompt 24] [--max-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit_json  # noqa: E402
from services.engine.core import EngineCore  # noqa: E402
from services.engine.pipeline import StepPipeline  # noqa: E402
from shared import protocol as P  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.model_spec import ModelSpec  # noqa: E402
from shared.procutil import freeze_gc  # noqa: E402

VOCAB = 30000


class SimClock:
    """Simulated seconds (the engine core's clock and the device's)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _is_decode(s: P.ScheduledSeq) -> bool:
    return s.sample and len(s.token_ids) == 1 + s.num_draft and s.start_pos > 0


def h200_like(plan: P.StepPlan) -> float:
    """Seconds a step takes on the simulated device (module doc)."""
    seqs = plan.seqs
    b = len(seqs)
    tokens = sum(len(s.token_ids) for s in seqs)
    ks = {s.num_draft for s in seqs}
    if not all(_is_decode(s) for s in seqs):
        return 14e-3 + 3e-6 * tokens
    if ks == {0}:
        return 1.0e-3 + 8.5e-6 * b
    if b <= 32 and len(ks) == 1:
        return 1.5e-3 + 40e-6 * b
    return 14e-3 + 3e-6 * tokens


def cheap_verify(plan: P.StepPlan) -> float:
    """A device where every step replays a graph (no eager steps): 1.0 ms + 2.5 us a token
    (a verify of 256 seqs x 5 tokens, 4.2 ms, against 1.64 ms for their decode): drafts
    that are right pay even at 256 seqs."""
    return 1.0e-3 + 2.5e-6 * sum(len(s.token_ids) for s in plan.seqs)


def engine_s(plan: P.StepPlan) -> float:
    """The engine's simulated time per step (schedule, update, outputs): 0.2 ms + 2.5 us a
    seq (0.84 ms at 256, the H200 run's measured `engine_overhead_s` 0.79 ms)."""
    return 0.2e-3 + 2.5e-6 * len(plan.seqs)


class ScriptWorker:
    """The worker: outputs follow a per-request script (module doc). loops: the share of
    requests whose output turns into a loop of 2..12 tokens after 8..80 outputs."""

    def __init__(self, loops: float, seed: int = 0):
        self.loops, self.seed = loops, seed
        self._scripts: dict[str, tuple[random.Random, list[int], int, int]] = {}
        self.seconds = 0.0  # real time spent here (excluded from the engine's)
        self.verified = 0
        self.accepted = 0

    def script(self, rid: str, i: int) -> int:
        """The i-th output token of request rid."""
        st = self._scripts.get(rid)
        if st is None:
            rng = random.Random(f"{self.seed}/{rid}")
            looping = rng.random() < self.loops
            onset = rng.randrange(8, 80) if looping else 1 << 30
            st = self._scripts[rid] = (rng, [], onset, rng.randrange(2, 13))
        rng, toks, onset, period = st
        while len(toks) <= i:
            n = len(toks)
            toks.append(toks[n - period] if n >= onset + period else rng.randrange(100, VOCAB))
        return toks[i]

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        t0 = time.perf_counter()
        sampled: list[int] = []
        counts: list[int] = []
        spec = False
        for s in plan.seqs:
            if not s.sample:
                continue
            k = s.num_draft
            drafts = s.token_ids[len(s.token_ids) - k:] if k else []
            n = 0
            for j in range(k + 1):
                t = self.script(s.request_id, s.output_index + j)
                sampled.append(t)
                n += 1
                if j == k or t != drafts[j]:
                    break
            if k:
                spec = True
                self.verified += k
                self.accepted += n - 1
            counts.append(n)
        self.seconds += time.perf_counter() - t0
        return P.StepResult(plan.step_id, sampled, num_sampled=counts if spec else [])


class SimDevice:
    """The executor: one simulated device running plans in order (module doc)."""

    def __init__(self, worker: ScriptWorker, clock: SimClock, cost=h200_like, engine=engine_s):
        self.worker, self.clock, self.cost, self.engine = worker, clock, cost, engine
        self._free = 0.0
        self._done: dict[int, tuple[float, P.StepResult]] = {}

    def submit(self, plan: P.StepPlan) -> None:
        self.clock.t += self.engine(plan)
        start = max(self.clock.t, self._free)
        self._free = start + self.cost(plan)
        self._done[plan.step_id] = (self._free, self.worker.execute(plan))

    def result(self, step_id: int, hook=None) -> P.StepResult:
        at, res = self._done.pop(step_id)
        self.clock.t = max(self.clock.t, at)
        return res

    def sockets(self):
        return ()

    def drain(self) -> None:
        pass

    def shutdown(self, reason: str) -> None:
        self._done.clear()


def sim_info(max_model_len: int) -> ModelSpec:
    """Model facts of the simulated model (no folder)."""
    return ModelSpec(path="/nonexistent/sim", architecture="Toy", model_type="toy", num_layers=1,
                     hidden_size=8, intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=8,
                     vocab_size=VOCAB, max_position_embeddings=max_model_len,
                     tie_word_embeddings=False, num_experts=1, moe_intermediate_size=16,
                     eos_token_ids=(1,), bos_token_id=None, dtype="float32", kv_dtype="float32",
                     max_model_len=max_model_len, hf_config={})


def run_load(spec: str | None, concurrency: int, requests: int, loops: float, prompt: int = 24,
             max_tokens: int = 128, seed: int = 0, cost=h200_like, budget: int = 16384,
             async_scheduling: bool = True, client_delay_s: float = 0.005) -> dict:
    """One variant: `requests` requests of `prompt` random tokens and max_tokens / 2 ..
    3 max_tokens / 2 outputs (uniform),
    `concurrency` of them at a time (a closed-loop client: a finished one is replaced
    `client_delay_s` simulated seconds later, the client's own turn). Returns the counters (module doc) and the engine's stats."""
    max_model_len = prompt + 2 * max_tokens + 64
    cfg = build_config(cli={"model": "models/SmolLM2-135M-Instruct", "device": "cpu",
                            "max_num_seqs": concurrency, "max_num_batched_tokens": budget,
                            "max_model_len": max_model_len, "block_size": 16,
                            "async_scheduling": async_scheduling, "enable_prefix_caching": False,
                            "speculative_config": spec}, env={})
    clock = SimClock()
    blocks = concurrency * (-(-max_model_len // 16) + 2)
    core = EngineCore(cfg, sim_info(max_model_len), num_blocks=blocks, clock=clock)
    worker = ScriptWorker(loops, seed)
    dev = SimDevice(worker, clock, cost)
    pipe = StepPipeline(core, dev, async_scheduling)
    rng = random.Random(seed)
    sent = finished = 0
    out_tokens = 0
    due: list[float] = [0.0] * min(concurrency, requests)  # when the client sends its next requests
    spec_time = [0.0]
    got: dict[str, list[int]] = {}  # output tokens per request
    lengths: dict[str, int] = {}
    sched = core.scheduler
    if sched.drafts is not None:  # the engine's speculation work per step, timed apart
        choose = sched._choose_drafts

        def timed(*args):
            t = time.perf_counter()
            try:
                return choose(*args)
            finally:
                spec_time[0] += time.perf_counter() - t
        sched._choose_drafts = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    while finished < requests:
        if not pipe.busy() and due:
            clock.t = max(clock.t, min(due))
        keep = []
        for at in due:
            if at <= clock.t and sent < requests:
                ids = [rng.randrange(100, VOCAB) for _ in range(prompt)]
                mt = max_tokens // 2 + rng.randrange(max_tokens + 1)  # spread, so requests end apart
                sp = P.SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
                assert core.add(b"fe", P.AddRequest(f"q{sent}", ids, sp, float(sent))) is None
                lengths[f"q{sent}"] = mt
                sent += 1
            elif at > clock.t:
                keep.append(at)
        due = keep
        em = pipe.advance()
        if em is not None:
            for _, o in em.outputs():
                out_tokens += len(o.new_token_ids)
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished += 1
                    due.append(clock.t + client_delay_s)
    while pipe.busy():
        pipe.advance()
    real = time.perf_counter() - t0 - worker.seconds
    # the truth: each request's script (the worker's plain decoding), token for token
    wrong = sum(got.get(rid, []) != [worker.script(rid, i) for i in range(n)] for rid, n in lengths.items())
    s = core.stats()
    return {"sim_s": clock.t, "tok_per_s": out_tokens / clock.t, "steps": s["num_steps"],
            "sync_plans": s.get("num_sync_plans"), "engine_us_per_step": 1e6 * real / max(1, s["num_steps"]),
            "spec_us_per_step": 1e6 * spec_time[0] / max(1, s["num_steps"]),
            "verify_steps": s.get("spec_decode_num_spec_steps", 0), "probes": s.get("spec_decode_num_probes", 0),
            "lookups": s.get("spec_ngram_lookups", 0), "lookup_waits": s.get("spec_ngram_lookup_waits", 0),
            "drafts": s.get("spec_decode_num_draft_tokens", 0),
            "accepted": s.get("spec_decode_num_accepted_tokens", 0),
            "k_hist": s.get("spec_decode_k_hist"), "wrong_outputs": wrong, "stats": s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--requests-per", type=int, default=4, help="requests per level: this x the concurrency")
    ap.add_argument("--loops", type=float, nargs="+", default=[0.0, 0.4, 1.0])
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out")
    a = ap.parse_args()
    freeze_gc()  # garbage collection as in the engine process (a lookup's tuples otherwise trigger passes)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": a.k})
    rows = []
    for c in a.concurrency:
        for loops in a.loops:
            n = a.requests_per * c
            plain = run_load(None, c, n, loops, a.prompt, a.max_tokens)
            sp = run_load(spec, c, n, loops, a.prompt, a.max_tokens)
            for r in (plain, sp):
                r.pop("stats")
            row = {"concurrency": c, "loops": loops, "ratio": round(sp["tok_per_s"] / plain["tok_per_s"], 4),
                   "plain": plain, "spec": sp}
            rows.append(row)
            print(f"c{c} loops {loops}: ratio {row['ratio']:.3f}  plain {plain['tok_per_s']:.0f} tok/s "
                  f"{plain['engine_us_per_step']:.0f} us/step  spec {sp['tok_per_s']:.0f} tok/s "
                  f"{sp['engine_us_per_step']:.0f} us/step steps {plain['steps']}/{sp['steps']} "
                  f"sync {plain['sync_plans']}/{sp['sync_plans']} verify {sp['verify_steps']} "
                  f"probes {sp['probes']} lookups {sp['lookups']} waits {sp['lookup_waits']} "
                  f"drafts {sp['drafts']} acc {sp['accepted']} k {sp['k_hist']}", file=sys.stderr)
    emit_json({"benchmark": "spec_load_sim", "cost": "h200_like", "rows": rows}, a.out)


if __name__ == "__main__":
    main()
