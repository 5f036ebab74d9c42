"""The soak benchmark's pure parts: RSS growth and the verdict (benchmarks/soak_report.py)
against numbers worked out by hand, and the stream checks (benchmarks/soak_requests.py)
against streams written out by hand in the OpenAI and Anthropic wire formats."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak_report import MIB, rss_report, verdict
from benchmarks.soak_requests import KINDS, BadAnswer, StreamCheck


def test_rss_growth_is_end_over_baseline_and_max_ignores_warmup():
    samples = [{"phase": "warmup", "rss": {"e": 500 * MIB}},   # warm-up peak: not the max
               {"phase": "measure", "rss": {"e": 110 * MIB}}]
    r = rss_report({"e": 100 * MIB}, {"e": 102 * MIB}, samples, max_growth_pct=2.0)["e"]
    assert r["growth_pct"] == pytest.approx(2.0) and r["ok"]
    assert r["max_mib"] == 110.0 and r["baseline_mib"] == 100.0 and r["end_mib"] == 102.0
    r = rss_report({"e": 100 * MIB}, {"e": 103 * MIB}, [], max_growth_pct=2.0)["e"]
    assert r["growth_pct"] == pytest.approx(3.0) and not r["ok"]


def test_a_process_gone_at_the_end_fails_the_rss_target():
    r = rss_report({"kestrel:worker:0": 10 * MIB}, {}, [], max_growth_pct=2.0)
    assert r["kestrel:worker:0"]["end_mib"] is None and not r["kestrel:worker:0"]["ok"]
    assert not verdict(r, {"ok": 3}, {"baseline_in_use": 0, "end_in_use": 0}, [])["passed"]


def test_verdict_needs_every_target():
    rss = rss_report({"e": 100}, {"e": 101}, [], 2.0)
    good = {"baseline_in_use": 0, "end_in_use": 0}
    assert verdict(rss, {"ok": 5, "aborted": 3}, good, [])["passed"]
    assert not verdict(rss, {"ok": 5, "failed": 1}, good, [])["no_failures"]
    v = verdict(rss, {"ok": 5}, {"baseline_in_use": 0, "end_in_use": 4}, [])
    assert not v["blocks_back_to_baseline"] and not v["passed"]
    assert not verdict(rss, {"ok": 5}, good, [{"process": "kestrel:engine"}])["passed"]


def _kind(name: str):
    return next(k for k in KINDS if k.name == name)


def _chunk(content: str | None, finish: str | None, usage: bool = False) -> str:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [] if usage else [{"index": 0, "delta": {"content": content},
                                                     "finish_reason": finish}],
                       **({"usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
                          if usage else {})})


def test_a_chat_stream_needs_its_done_and_usage():
    body = {"stream": True, "n": 1}
    full = [_chunk("Hi", None), _chunk("!", "stop"), _chunk(None, None, usage=True), "[DONE]"]
    c = StreamCheck(_kind("chat_stream"), body)
    for ev in full:
        c.feed(ev)
    c.finish()
    for cut in (full[:-1], [full[0], full[1], full[3]]):  # no [DONE]; no usage chunk
        c = StreamCheck(_kind("chat_stream"), body)
        for ev in cut:
            c.feed(ev)
        with pytest.raises(BadAnswer):
            c.finish()


def test_an_error_event_and_a_broken_json_schema_answer_fail():
    with pytest.raises(BadAnswer, match="error event"):
        StreamCheck(_kind("chat_stream"), {"stream": True}).feed(
            json.dumps({"error": {"message": "boom", "type": "internal_error"}}))
    c = StreamCheck(_kind("chat_json_schema_stream"), {"stream": True, "response_format": {}})
    c.feed(_chunk('{"answer": "x"', None))
    with pytest.raises(BadAnswer, match="json_schema"):
        c.feed(_chunk("}", "stop"))


def test_completion_chunks_with_a_null_finish_reason_pass():
    c = StreamCheck(_kind("completions_stream"), {"stream": True})
    for ev in ({"choices": [{"index": 0, "text": " Paris", "finish_reason": None}]},
               {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}):
        c.feed(json.dumps({"id": "x", "object": "text_completion", "created": 1, "model": "m", **ev}))
    c.feed("[DONE]")
    c.finish()


def test_an_anthropic_stream_must_start_with_message_start_and_end_with_message_stop():
    with pytest.raises(BadAnswer, match="message_start"):
        StreamCheck(_kind("messages_stream"), {"stream": True}).feed(
            json.dumps({"type": "content_block_stop", "index": 0}))
    c = StreamCheck(_kind("messages_stream"), {"stream": True})
    c.feed(json.dumps({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}}))
    c.feed(json.dumps({"type": "ping"}))
    with pytest.raises(BadAnswer, match="end event"):
        c.finish()
