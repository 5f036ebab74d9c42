"""Structured output end to end inside one process: the engine's add path (`EngineCore._on_add`
with its sockets stubbed), the real scheduler and block manager, xgrammar over the real
SmolLM2 tokenizer, and a ModelRunner on the real SmolLM2 weights (CPU, fp32).

Checks against independent parsers: `json.loads` + `jsonschema.validate` for 20 completions
sampled at temperature 1 under a schema; `re.fullmatch` for a regex constraint; and a bad
schema fails only its own request (error_kind "invalid") while the others complete.
Also: the waiting-queue bound answers "overloaded", and max_tokens 0 with prompt_logprobs
scores the prompt and finishes with "length" without sampling.
"""

from __future__ import annotations

import json
import random
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from services.engine.block_manager import BlockManager  # noqa: E402
from services.engine.core import EngineCore  # noqa: E402
from services.engine.scheduler import Scheduler  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared import protocol as P  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.model_info import load_model_info  # noqa: E402

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
    """EngineCore's add/step/output logic without sockets: `add` calls `_on_add`, `run`
    steps the scheduler against a ModelRunner until idle, outputs are collected per id."""

    def __init__(self, model_dir: str, max_num_waiting: int = 256):
        cfg = build_config(cli={"model": model_dir, "device": "cpu", "dtype": "float32",
                                "kv_cache_gib": 0.25, "max_num_waiting": max_num_waiting,
                                "max_num_seqs": 32, "max_num_batched_tokens": 1024}, env={})
        self.runner = ModelRunner(cfg)
        core = EngineCore.__new__(EngineCore)  # no sockets, no ring
        core.cfg, core.info = cfg, load_model_info(model_dir)
        core.max_model_len = 2048
        core.rng = random.Random(0)
        core._structured = None
        core.frontends = {b"fe": None}
        bm = BlockManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=True)
        core.scheduler = Scheduler(bm, 32, 1024, core.max_model_len, list(core.info.eos_token_ids))
        self.outputs: dict[str, list[P.RequestOutput]] = {}
        core._send = lambda ident, msg: [self.outputs.setdefault(o.request_id, []).append(o)
                                         for o in msg.outputs]
        self.core = core

    def add(self, rid: str, prompt: list[int], sp: P.SamplingParams) -> None:
        self.core._on_add(b"fe", P.AddRequest(rid, prompt, sp, 0.0))

    def run(self, max_steps: int = 2000) -> None:
        s = self.core.scheduler
        for _ in range(max_steps):
            if not s.has_work():
                return
            out = s.schedule()
            res = self.runner.run_step(out.plan)
            changed = s.update(out, res.sampled_token_ids, res.logprobs, res.prompt_logprobs)
            self.core._emit(changed)
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
    for rid in ("bad", "badjson"):
        out = engine.final(rid)
        assert out.finish_reason == "error" and out.error_kind == "invalid" and out.error
    engine.run()
    eos = set(load_model_info(engine.core.info.path).eos_token_ids)
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
    old = core.cfg.max_num_waiting
    core.cfg.set("max_num_waiting", 2, "test")
    try:
        for i in range(3):
            engine.add(f"q{i}", [1, 2, 3], P.SamplingParams(max_tokens=1))
        assert engine.final("q2").error_kind == "overloaded"
        assert "q0" not in engine.outputs and "q1" not in engine.outputs
        engine.add("oob", [1, 10**9], P.SamplingParams())
        assert engine.final("oob").error_kind == "invalid"
    finally:
        core.cfg.set("max_num_waiting", old, "test")
    engine.run()
    assert engine.final("q0").finish_reason == "length"
