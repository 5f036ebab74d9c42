"""Helpers of the benchmarks: a model folder from a config in benchmarks/configs, the device
name, and the in-process engine (`EngineCore` on an `InProcessExecutor` over a `ModelRunner`,
no HTTP, no ZMQ) that the offline benchmarks drive.

torch and the engine are imported inside the functions that need them, so that HTTP-only
code (benchmarks/serve_bench.py's client processes) can import this module cheaply.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dir(config_name: str, tokenizer: bool = False) -> str:
    """A temporary model folder holding benchmarks/configs/<config_name>.json as its
    config.json (for `--load-format dummy`). The in-process benchmarks feed token ids and
    need no tokenizer; `tokenizer=True` adds a synthetic one (`write_synthetic_tokenizer`)
    for a server, whose frontend cannot start without tokenizer.json. The folder is removed
    when the calling process exits."""
    src = os.path.join(ROOT, "benchmarks", "configs", config_name + ".json")
    with open(src) as fh:
        cfg = json.load(fh)
    d = tempfile.mkdtemp(prefix=f"kestrel-{config_name}-")
    atexit.register(shutil.rmtree, d, True)  # removed when the benchmark's process exits
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    if tokenizer:  # a multimodal config nests its text model's fields (text_config)
        write_synthetic_tokenizer(d, int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
    return d


def write_synthetic_tokenizer(folder: str, vocab_size: int) -> str:
    """Write `<folder>/tokenizer.json`: a `tokenizers` WordLevel tokenizer whose id i is the
    token `t<i>`, for every id below vocab_size (the logits width, so that any id a model
    with dummy weights samples decodes), whitespace pre-tokenizer, no decoder (decode joins
    tokens with spaces), no special tokens. Every output token thus decodes to non-empty
    text and reaches the client as stream text; it stands in for a real tokenizer whose
    files the benchmark configs do not have. Returns the file's path."""
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
          "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
          "post_processor": None, "decoder": None,
          "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)},
                    "unk_token": "t0"}}
    path = os.path.join(folder, "tokenizer.json")
    with open(path, "w") as fh:
        json.dump(tj, fh)
    return path


def emit_json(result: dict, path: str | None, indent: int = 1) -> None:
    """Print a benchmark's result as JSON, and write it to `path` too when one is given."""
    text = json.dumps(result, indent=indent)
    print(text)
    if path:
        with open(path, "w") as fh:
            fh.write(text + "\n")


def device_name() -> str:
    """The CUDA device's name, or "cpu" without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def load_runner(cli: dict):
    """A `ModelRunner` built from settings `cli` (as `build_config(cli=cli, env={})`: the
    environment is ignored). Returns (runner, startup seconds)."""
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    t0 = time.perf_counter()
    runner = ModelRunner(build_config(cli=cli, env={}))
    return runner, time.perf_counter() - t0


def new_core(runner, max_num_seqs: int, max_num_batched_tokens: int, max_num_waiting: int,
             extra: dict | None = None):
    """A fresh `EngineCore` over the runner's KV blocks and model facts, as the engine
    process builds it (prefix caching off, no KV tiers, the structured-output compiler not
    prepared: the benchmarks use neither). max_num_waiting: room for every request at once.
    extra: more settings of the core's config (e.g. `speculative_config` and `load_format`
    for speculative decoding, benchmarks/spec_verify_cost.py); None: none."""
    from services.engine.core import EngineCore
    from shared.config import build_config

    cfg = build_config(cli={"model": runner.spec.path, "device": runner.device.type,
                            "block_size": runner.block_size, "max_num_seqs": max_num_seqs,
                            "max_num_batched_tokens": max_num_batched_tokens,
                            "max_model_len": runner.max_model_len, "max_num_waiting": max_num_waiting,
                            "enable_prefix_caching": False, **(extra or {})}, env={})
    return EngineCore(cfg, runner.spec, runner.num_blocks)


class TimedRunner:
    """The runner behind the executor, timed: the wall seconds inside `execute` (host
    prepare + launch + the wait for the sampled ids) and, on CUDA, a pair of CUDA events
    around each step with its (seqs, new tokens, context tokens), read only at the end so
    that timing adds no sync (`step_breakdown`)."""

    def __init__(self, runner):
        self.runner = runner
        self.cuda = runner.device.type == "cuda"
        self.seconds = 0.0
        self.events: list = []

    def execute(self, plan):
        import torch

        t0 = time.perf_counter()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        result = self.runner.execute(plan)
        if self.cuda:
            b.record()
            seqs = plan.seqs
            self.events.append((a, b, len(seqs), sum(len(q.token_ids) for q in seqs),
                                sum(q.start_pos + len(q.token_ids) for q in seqs)))
        self.seconds += time.perf_counter() - t0
        return result


def run_core(core, runner, requests: list, prefix: str = "r",
             tokens: dict | None = None, token_times: list | None = None) -> tuple[float, int, int, dict]:
    """Add requests ((prompt token ids, `SamplingParams`) each; ids prefix + index, distinct
    from an earlier run's: the runner keeps its last tables) to `core` and run its steps
    on an `InProcessExecutor` over `runner` until done, in the engine's synchronous order
    (`StepPipeline.advance` without async scheduling: plan, submit, result, finish), each
    verb timed. Returns (seconds, steps, output tokens, timings): the host seconds spent
    planning and applying results (`schedule_seconds`, `update_seconds`), the wall seconds
    inside `execute` (`run_step_seconds`) and, on CUDA, the GPU seconds of the steps
    (`gpu_event_seconds`, `gpu_by_step_kind`; None on CPU). Raises RuntimeError when the
    core refuses a request or a request fails (a step's fault), AssertionError when work is
    left that nothing can run. tokens: when given, each request's output token ids are
    appended to tokens[request id] (a list made on first use). token_times: when given, one
    `time.perf_counter()` (seconds) is appended per output token, taken when its step's
    outputs are out of `finish_step` (what a client of the engine could see)."""
    import torch

    from services.engine.executor import InProcessExecutor
    from shared.protocol import AddRequest

    for i, (prompt, sp) in enumerate(requests):
        refused = core.add(b"", AddRequest(f"{prefix}{i}", prompt, sp, 0.0))
        if refused is not None:
            raise RuntimeError(f"request {prefix}{i} refused: {refused.outputs()[0][1].error}")
    timed = TimedRunner(runner)
    executor = InProcessExecutor(timed)
    steps, out_tokens, t_sched, t_upd = 0, 0, 0.0, 0.0
    t0 = time.perf_counter()
    while core.has_work():
        t1 = time.perf_counter()
        out = core.plan_step()
        t_sched += time.perf_counter() - t1
        assert out is not None, "requests are left that no step can run"
        executor.submit(out.plan)  # runs the step
        result = executor.result(out.plan.step_id)
        t3 = time.perf_counter()
        emitted = core.finish_step(out, result)
        t4 = time.perf_counter()
        t_upd += t4 - t3
        for _, o in emitted.outputs():
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            out_tokens += len(o.new_token_ids)
            if token_times is not None:
                token_times.extend([t4] * len(o.new_token_ids))
            if tokens is not None:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    if timed.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    events = timed.events
    gpu = round(sum(e[0].elapsed_time(e[1]) for e in events) / 1e3, 3) if timed.cuda else None
    return seconds, steps, out_tokens, {
        "schedule_seconds": round(t_sched, 3), "update_seconds": round(t_upd, 3),
        "run_step_seconds": round(timed.seconds, 3), "gpu_event_seconds": gpu,
        "gpu_by_step_kind": step_breakdown(events, runner) if timed.cuda else None}


def step_breakdown(events, runner) -> dict:
    """GPU time of the steps grouped by kind: steps with prefill tokens, and decode-only
    steps by batch size (1-16, 17-64, 65-128, 129-256, more). Per group: steps, GPU seconds,
    mean ms per step, KV bytes read by attention (context tokens x bytes of K and V per
    token over all layers) and that over the group's GPU time in TB/s (a lower bound of
    the attention's own bandwidth: the group's time includes the rest of the step); plus
    each prefill step's sequences, tokens and ms (`prefill_steps`).
    events: (start event, end event, seqs, new tokens, context tokens) per step."""
    per_tok = runner.kv_layout.block_bytes // runner.kv_layout.block_size  # K and V, all layers
    groups: dict[str, list] = {}
    for a, b, nseq, ntok, ctx in events:
        if ntok > nseq:
            key = "prefill"
        else:
            key = next(f"decode_b{lo}-{hi}" for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256),
                                                           (257, 1 << 30)) if nseq <= hi)
        g = groups.setdefault(key, [0, 0.0, 0])
        g[0] += 1
        g[1] += a.elapsed_time(b) / 1e3
        g[2] += ctx * per_tok
    out: dict = {k: {"steps": n, "gpu_seconds": round(t, 3), "ms_per_step": round(1e3 * t / n, 3),
                     "kv_bytes": kv, "kv_TBps": round(kv / t / 1e12, 3) if t else None}
                 for k, (n, t, kv) in sorted(groups.items())}
    out["prefill_steps"] = [{"seqs": nseq, "tokens": ntok, "ms": round(a.elapsed_time(b), 2)}
                            for a, b, nseq, ntok, _ in events if ntok > nseq]
    return out


def offline_run(runner, max_num_seqs: int, max_num_batched_tokens: int,
                prompts: list[list[int]], params: list,
                warm_prompts: list[list[int]] | None = None, warm_tokens: int = 32) -> dict:
    """Warm the runner up (one request of warm_tokens output tokens per warm prompt; default
    64 random prompts of 20..1024 tokens with 1..24 output tokens each), then run one request
    per (prompt token ids, `SamplingParams` with ignore_eos) through a fresh `EngineCore` on
    an `InProcessExecutor` (`run_core`). Returns {seconds, steps, prompt_tokens,
    output_tokens, output_tok_per_s, total_tok_per_s, and run_core's timings}; seconds =
    wall time from the first plan to the last token. Raises AssertionError if a request
    ended before its max_tokens, and what `run_core` raises."""
    from shared.protocol import SamplingParams

    if warm_prompts is None:  # prefill chunks, mixed steps and decode batches of many sizes,
        wr = random.Random(1)  # so that no kernel variant compiles inside the timed run
        warm_prompts = [[wr.randint(0, 10000) for _ in range(wr.randint(20, 1024))] for _ in range(64)]
        warm_lens = [wr.randint(1, 24) for _ in warm_prompts]
    else:
        warm_lens = [warm_tokens] * len(warm_prompts)
    warm = [(p, SamplingParams(temperature=0.6, seed=i, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(warm_prompts, warm_lens))]
    run_core(new_core(runner, max_num_seqs, max_num_batched_tokens, len(warm)), runner, warm, "w")
    core = new_core(runner, max_num_seqs, max_num_batched_tokens, len(prompts))
    seconds, steps, out_tokens, timing = run_core(core, runner, list(zip(prompts, params)))
    assert out_tokens == sum(sp.max_tokens for sp in params), "a request ended early"
    n_prompt = sum(map(len, prompts))
    return {"prompt_tokens": n_prompt, "output_tokens": out_tokens,
            "seconds": round(seconds, 3), "steps": steps,
            "output_tok_per_s": round(out_tokens / seconds, 1),
            "total_tok_per_s": round((out_tokens + n_prompt) / seconds, 1), **timing}
