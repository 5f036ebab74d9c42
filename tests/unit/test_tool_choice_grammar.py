"""The forced-call constraint as the engine compiles it (`StructuredOutputManager`, xgrammar
over the real SmolLM2 tokenizer): a named tool choice admits exactly one call and then only
a stop token (so the request ends with "stop", never by running to max_tokens), while
"required" admits several. xgrammar's own matcher is the judge of what the grammar allows."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

import xgrammar as xgr  # noqa: E402

from services.engine.structured import StructuredOutputManager  # noqa: E402
from services.frontend.parsers.tool_choice import forced_call_constraint  # noqa: E402
from shared.model_spec import load_model_spec  # noqa: E402

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]},
         "get_time": {"type": "object"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def manager(smollm2_dir):
    spec = load_model_spec(str(smollm2_dir))
    return StructuredOutputManager(str(smollm2_dir), spec.vocab_size, list(spec.eos_token_ids)), spec


def _matcher(manager, only, parallel=True) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(manager.compile(forced_call_constraint(TOOLS, only, parallel)))


def _allowed(manager, m: xgr.GrammarMatcher) -> set[int]:
    mask = xgr.allocate_token_bitmask(1, manager.vocab_size)
    m.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    return {t for t in range(manager.vocab_size) if (words[t // 32] >> (t % 32)) & 1}


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_choice_allows_one_call_then_only_a_stop_token(manager, parallel):
    mgr, spec = manager
    m = _matcher(mgr, "get_weather", parallel)
    assert m.accept_string("[" + CALL)
    probe = _matcher(mgr, "get_weather", parallel)
    probe.accept_string("[" + CALL)
    assert not probe.accept_string(", ")  # no second call
    assert m.accept_string("]")
    assert _allowed(mgr, m) <= set(spec.eos_token_ids) and _allowed(mgr, m)
    assert m.accept_token(spec.eos_token_ids[0]) and m.is_terminated()
    other = _matcher(mgr, "get_weather", parallel)
    assert not other.accept_string('[{"name": "get_time"')  # only the named tool


def test_required_still_allows_several_calls(manager):
    mgr, spec = manager
    m = _matcher(mgr, None)
    assert m.accept_string(f'[{CALL}, {{"name": "get_time", "arguments": {{}}}}, {CALL}]')
    assert m.accept_token(spec.eos_token_ids[0]) and m.is_terminated()
    single = _matcher(mgr, None, parallel=False)  # parallel_tool_calls false: one
    assert single.accept_string("[" + CALL) and not single.accept_string(", ")
