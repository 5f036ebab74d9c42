"""Speculative decoding with structured output (docs/ARCHITECTURE.md §5.5): the engine's
grammar masks of every verified position, on a toy vocabulary (a tokenizer.json written
here, xgrammar over it) and the scripted oracle worker (tests/unit/spec_oracle_rig.py), which draws
under each position's mask.

Independent truths: the same requests without speculation (outputs token for token), the
regex itself (`re.fullmatch` on the decoded text), and for every verify seq a fresh
xgrammar matcher advanced over the request's outputs and the drafts, position by position,
which must give the masks the engine sent. The drafts replay the plain run's outputs with
mistakes, some of which the grammar rejects: the engine must cut the drafts before those
(and before a draft that would terminate the grammar).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

xgr = pytest.importorskip("xgrammar")

from services.engine.core import EngineCore  # noqa: E402
from services.engine.executor import InProcessExecutor  # noqa: E402
from shared import protocol as P  # noqa: E402
from tests.unit.engine_rig import Outbox, core_config, drive, toy_info  # noqa: E402
from tests.unit.spec_oracle_rig import OracleDrafter, OracleWorker, allowed_ids  # noqa: E402

TOKENS = ["</s>", *"0123456789", "[", "]", ",", " ", "a", "b", ", ", "12", "x"]
V, EOS, BS = len(TOKENS), 0, 4
PATTERN = r"\[[0-9]{1,2}(, [0-9]{1,2}){2,5}\]"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy-grammar-model")
    tj = {"model": {"vocab": {t: i for i, t in enumerate(TOKENS) if i}},
          "added_tokens": [{"id": 0, "content": "</s>", "special": True}]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def _core(model_dir, spec: str | None, async_scheduling: bool) -> EngineCore:
    cfg = core_config(async_scheduling=async_scheduling, block_size=BS, max_num_seqs=6,
                      max_num_batched_tokens=32, max_model_len=200, speculative_config=spec)
    info = dataclasses.replace(toy_info(V, EOS, cfg.max_model_len), path=str(model_dir))
    return EngineCore(cfg, info, num_blocks=500)


def _requests() -> list[P.AddRequest]:
    rng = random.Random(4)
    spec = P.StructuredSpec("regex", PATTERN)
    return [P.AddRequest(f"g{i}", [rng.randrange(1, V) for _ in range(rng.randrange(2, 12))],
                         P.SamplingParams(temperature=0, max_tokens=60, structured=spec), float(i))
            for i in range(8)]


def _run(core: EngineCore, worker: OracleWorker, async_scheduling: bool) -> Outbox:
    for r in _requests():
        assert core.add(b"fe", r) is None
    outbox = Outbox()
    drive(core, InProcessExecutor(worker), async_scheduling, outbox, timeout_s=120.0)
    assert not core.requests
    return outbox


def _fresh_masks(compiled, outputs: list[int], drafts: list[int]) -> list[bytes]:
    """The masks after outputs + drafts[:i], i = 0..len(drafts), each from a matcher
    advanced from scratch (no rollback)."""
    masks = []
    for i in range(len(drafts) + 1):
        m = xgr.GrammarMatcher(compiled)
        for t in outputs + drafts[:i]:
            assert m.accept_token(t)
        buf = xgr.allocate_token_bitmask(1, V)
        m.fill_next_token_bitmask(buf)
        masks.append(buf.numpy().astype("<i4").tobytes())
    return masks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_masks_per_verified_position(model_dir, async_scheduling):
    plain = _run(_core(model_dir, None, async_scheduling), OracleWorker(BS, V),
                 async_scheduling)
    ref = {r.request_id: plain.tokens(r.request_id) for r in _requests()}
    for rid, toks in ref.items():
        assert plain.final(rid).finish_reason == "stop" and toks[-1] == EOS
        assert re.fullmatch(PATTERN, "".join(TOKENS[t] for t in toks[:-1]))

    def replay(rid: str, ctx: list[int], output_index: int, n: int) -> list[int]:
        return ref[rid][output_index:output_index + n]

    def wrong(rid: str, i: int) -> bool:
        return random.Random(f"{rid}/{i}").random() < 0.25

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    core = _core(model_dir, spec, async_scheduling)
    worker = OracleWorker(BS, V, proposer=replay, mistake=wrong, bm=core.scheduler.bm)
    OracleDrafter.install(core, worker)
    out = _run(core, worker, async_scheduling)
    for rid, toks in ref.items():
        assert out.tokens(rid) == toks and out.final(rid).finish_reason == "stop"

    info = xgr.TokenizerInfo(TOKENS, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_regex(PATTERN)
    verifies = [(rid, oi, d, m) for rid, oi, d, m in worker.masks if d]
    assert len(verifies) > 10
    for rid, oi, drafts, masks in verifies:
        assert masks == _fresh_masks(compiled, ref[rid][:oi], drafts), (rid, oi, drafts)
        for i, d in enumerate(drafts):  # every draft verified is one its position allows
            assert d in allowed_ids(masks[i], V)
        assert EOS not in drafts  # a draft that would terminate the grammar is never verified

    # The engine cut proposals at the first draft the grammar rejects or that ends it.
    verified = {(rid, oi): d for rid, oi, d, _ in verifies}
    cut = 0
    for rid, oi, proposal in worker.proposals:
        room = len(ref[rid]) - oi - 1  # drafts still useful before the last output
        d = verified.get((rid, oi), [])
        assert proposal[:len(d)] == d
        if len(d) < min(len(proposal), 4, room):
            nxt = proposal[len(d)]
            m = xgr.GrammarMatcher(compiled)
            for t in ref[rid][:oi] + d:
                assert m.accept_token(t)
            assert not m.accept_token(nxt) or m.is_terminated(), (rid, oi, proposal, d)
            cut += 1
    assert cut > 3, "the test did not exercise grammar cuts"
