"""Structured output end to end inside one process: the engine core (`EngineCore.add`, its
grammar compiles off the loop, the real scheduler and block manager) on an in-process executor, xgrammar over the real
SmolLM2 tokenizer, and a ModelRunner on the real SmolLM2 weights (CPU, fp32).

Checks against independent parsers: `json.loads` + `jsonschema.validate` for 20 completions
sampled at temperature 1 under a schema; `re.fullmatch` for a regex constraint; and a bad
schema fails only its own request (error_kind "invalid") while the others complete.
Also: the waiting-queue bound answers "overloaded", and max_tokens 0 with prompt_logprobs
scores the prompt and finishes with "length" without sampling.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from services.engine.core import EngineCore  # noqa: E402
from services.engine.executor import InProcessExecutor  # noqa: E402
from services.engine.grammar_jobs import GrammarJobs  # noqa: E402
from services.engine.pipeline import StepPipeline  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared import protocol as P  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.model_spec import load_model_spec, model_spec_for  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


class InProcessEngine:
    """An EngineCore on a ModelRunner in this process: `add` calls `EngineCore.add`, `run`
    advances the (synchronous) step pipeline until idle; outputs are collected per id.
    grammars: the core's compile jobs (built here, so tests can watch the compiles)."""

    def __init__(self, model_dir: str, max_num_waiting: int = 256):
        cfg = build_config(cli={"model": model_dir, "device": "cpu", "dtype": "float32",
                                "kv_cache_gib": 0.25, "max_num_waiting": max_num_waiting,
                                "max_num_seqs": 32, "max_num_batched_tokens": 1024,
                                "max_model_len": 2048, "enable_prefix_caching": True}, env={})
        self.runner = ModelRunner(cfg)
        assert self.runner.block_size == cfg.block_size
        info = model_spec_for(cfg)
        self.grammars = GrammarJobs(info)
        self.core = EngineCore(cfg, info, self.runner.num_blocks, grammars=self.grammars, seed=0)
        self.pipeline = StepPipeline(self.core, InProcessExecutor(self.runner),
                                     async_scheduling=False)
        self.outputs: dict[str, list[P.RequestOutput]] = {}

    def take(self, em) -> None:
        for _, o in em.outputs() if em is not None else ():
            self.outputs.setdefault(o.request_id, []).append(o)

    def add(self, rid: str, prompt: list[int], sp: P.SamplingParams) -> None:
        self.take(self.core.add(b"fe", P.AddRequest(rid, prompt, sp, 0.0)))

    def abort(self, rid: str) -> None:
        self.core.abort([rid])
        self.take(self.core.apply_aborts())

    def run(self, max_steps: int = 2000, wait_compiles: bool = True) -> None:
        """Step until idle; while grammars compile (threads) and nothing runs, wait for them
        (as the engine loop polls), unless wait_compiles is False."""
        core = self.core
        for _ in range(max_steps):
            self.take(core.admit_compiled({b"fe"}))
            if not self.pipeline.busy():
                if not core.num_compiling or not wait_compiles:
                    return
                time.sleep(0.005)
                continue
            self.take(self.pipeline.advance())
        raise AssertionError("engine did not finish")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> P.RequestOutput:
        return self.outputs[rid][-1]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return InProcessEngine(str(smollm2_dir))


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def _prompt(tok, text: str) -> list[int]:
    chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(chat, add_special_tokens=False).ids


def test_twenty_sampled_json_completions_all_validate_and_bad_schema_fails_alone(engine, tokenizer):
    prompt = _prompt(tokenizer, "Describe a person as JSON with name, age and pet.")
    spec = P.StructuredSpec("json_schema", json.dumps(SCHEMA))
    for i in range(20):
        engine.add(f"js{i}", prompt, P.SamplingParams(temperature=1.0, seed=100 + i, max_tokens=60,
                                                      structured=spec))
    engine.add("bad", prompt, P.SamplingParams(structured=P.StructuredSpec("json_schema", '{"type": "nosuch"}')))
    engine.add("badjson", prompt, P.SamplingParams(structured=P.StructuredSpec("json_schema", "{oops")))
    engine.run()
    for rid in ("bad", "badjson"):
        out = engine.final(rid)
        assert out.finish_reason == "error" and out.error_kind == "invalid" and out.error
    eos = set(load_model_spec(engine.core.info.path).eos_token_ids)
    for i in range(20):
        final = engine.final(f"js{i}")
        assert final.finish_reason == "stop", (final, tokenizer.decode(engine.tokens(f"js{i}")))
        ids = [t for t in engine.tokens(f"js{i}") if t not in eos]
        doc = json.loads(tokenizer.decode(ids))
        jsonschema.validate(doc, SCHEMA)


def test_regex_constraint_is_matched(engine, tokenizer):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    prompt = _prompt(tokenizer, "Give me a product code.")
    for i in range(4):
        engine.add(f"re{i}", prompt, P.SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                                                      structured=P.StructuredSpec("regex", pattern)))
    engine.run()
    eos = set(engine.core.info.eos_token_ids)
    for i in range(4):
        assert engine.final(f"re{i}").finish_reason == "stop"
        text = tokenizer.decode([t for t in engine.tokens(f"re{i}") if t not in eos])
        assert re.fullmatch(pattern, text), text


def test_score_only_request_returns_prompt_logprobs_and_no_tokens(engine, tokenizer):
    prompt = _prompt(tokenizer, "The capital of France is Paris.")
    engine.add("score", prompt, P.SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2))
    engine.run()
    outs = engine.outputs["score"]
    assert engine.tokens("score") == []
    assert outs[-1].finish_reason == "length"
    plp = [lp for o in outs for lp in o.prompt_logprobs]
    assert len(plp) == len(prompt) and plp[0] is None
    assert [lp.token_id for lp in plp[1:]] == prompt[1:]
    assert all(lp.logprob <= 0 and len(lp.top_ids) == 2 for lp in plp[1:])


def test_waiting_queue_bound_answers_overloaded(smollm2_dir, engine):
    core = engine.core
    old = core.cfg
    core.cfg = dataclasses.replace(old, max_num_waiting=2)
    try:
        for i in range(3):
            engine.add(f"q{i}", [1, 2, 3], P.SamplingParams(max_tokens=1))
        assert engine.final("q2").error_kind == "overloaded"
        assert "q0" not in engine.outputs and "q1" not in engine.outputs
        engine.add("oob", [1, 10**9], P.SamplingParams())
        assert engine.final("oob").error_kind == "invalid"
    finally:
        core.cfg = old
    engine.run()
    assert engine.final("q0").finish_reason == "length"


def test_a_grammar_that_compiles_for_seconds_does_not_stall_the_engine_loop(engine, tokenizer, monkeypatch):
    # a new grammar compiles in a thread: the add returns at once, other requests run
    # meanwhile, and the request joins when its grammar is ready; one aborted while its
    # grammar compiles ends "abort" and never runs (a deep schema took 8.4 s to compile)
    from services.engine.structured import StructuredOutputManager

    gate = threading.Event()
    real = StructuredOutputManager.compile

    def slow(self, spec):
        if "slowmarker" in spec.spec:
            assert gate.wait(30)
        return real(self, spec)

    monkeypatch.setattr(StructuredOutputManager, "compile", slow)
    prompt = _prompt(tokenizer, "Describe a person as JSON with name, age and pet.")
    schema = dict(SCHEMA, description="slowmarker")
    spec = P.StructuredSpec("json_schema", json.dumps(schema))
    t0 = time.monotonic()
    engine.add("slow0", prompt, P.SamplingParams(temperature=0.0, max_tokens=60, structured=spec))
    engine.add("slow1", prompt, P.SamplingParams(temperature=0.0, max_tokens=60, structured=spec))
    engine.add("gone", prompt, P.SamplingParams(temperature=0.0, max_tokens=60, structured=spec))
    assert time.monotonic() - t0 < 5
    assert {"slow0", "slow1", "gone"} <= set(engine.grammars.compiling)
    assert len(engine.grammars.jobs) == 1  # one compile for the three
    engine.add("slow0", prompt, P.SamplingParams(temperature=0.0, max_tokens=4))  # its id is taken
    assert engine.final("slow0").error == "duplicate request id"
    engine.add("plain", prompt, P.SamplingParams(temperature=0.0, max_tokens=8))
    engine.abort("gone")
    assert engine.final("gone").finish_reason == "abort" and "gone" not in engine.grammars.compiling
    engine.run(wait_compiles=False)  # only "plain" can run: the compile waits on the gate
    assert engine.final("plain").finish_reason == "length" and len(engine.tokens("plain")) == 8
    assert "slow0" in engine.grammars.compiling and "slow0" not in engine.core.requests
    gate.set()
    engine.run()
    eos = set(engine.core.info.eos_token_ids)
    for rid in ("slow0", "slow1"):
        assert engine.final(rid).finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode([t for t in engine.tokens(rid) if t not in eos])), SCHEMA)
    assert engine.tokens("slow0") == engine.tokens("slow1")  # greedy: one grammar, two matchers
    assert [o.finish_reason for o in engine.outputs["gone"]] == ["abort"]
    assert not engine.grammars.compiling and not engine.grammars.jobs


def test_sampling_values_the_worker_cannot_hold_fail_only_their_request(engine, tokenizer):
    # top_k 2**63 once failed the whole step: the worker's int64 tensor overflowed
    prompt = _prompt(tokenizer, "Hi")
    bad = {"k": P.SamplingParams(top_k=2 ** 63), "seed": P.SamplingParams(seed=2 ** 64),
           "nan": P.SamplingParams(temperature=float("nan")), "inf": P.SamplingParams(presence_penalty=float("inf")),
           "p0": P.SamplingParams(top_p=0.0)}
    for rid, sp in bad.items():
        engine.add(rid, prompt, sp)
        out = engine.final(rid)
        assert out.finish_reason == "error" and out.error_kind == "invalid", (rid, out)
    engine.add("fine", prompt, P.SamplingParams(temperature=0.0, max_tokens=3, top_k=2 ** 31 - 1))
    engine.run()
    assert engine.final("fine").finish_reason == "length"
