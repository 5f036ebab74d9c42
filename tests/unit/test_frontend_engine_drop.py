"""Requests the engine ends on its own, and a frontend the engine no longer knows: every
request in flight ends with an error (never a stream of keep-alives), and the frontend
attaches again. Against the fake engine (tests/unit/test_frontend_support.py) and the
engine's frontend link (`FrontendLink`) over a real engine core, without sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import httpx
import pytest

from services.engine.core import EngineCore
from services.engine.frontend_link import FrontendLink, FrontendState
from services.frontend.engine_client import EngineClient
from shared import protocol as p
from shared.grammar_errors import grammar_error_text
from tests.unit.engine_rig import core_config, toy_info
from tests.unit import test_frontend_support as support
from tests.unit.test_frontend_support import MODEL, FakeEngine, build_model_dir

stack = support.stack  # the module-scoped fixture


def _sse_events(raw: bytes) -> list[bytes]:
    """SSE events (spec framing: a blank line ends each), keep-alive comments left out."""
    return [e for e in raw.split(b"\n\n") if e and not e.startswith(b":")]


def test_stream_whose_request_the_engine_aborts_unasked_ends_with_error_then_done(stack):
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "please drop"}]}
    started = time.monotonic()
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                      timeout=httpx.Timeout(10)) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    assert time.monotonic() - started < 10
    events = _sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    assert events[-2].startswith(b'data: {"error":')
    assert b"dropped this frontend" in events[-2]
    assert stack.engine.aborted.count(stack.engine.added[-1].request_id) == 0  # not asked


def test_non_streaming_request_the_engine_aborts_unasked_is_a_5xx(stack):
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "please drop"}]})
    assert r.status_code >= 500
    assert "dropped this frontend" in r.json()["error"]["message"]


@pytest.fixture()
def workdir():
    d = tempfile.mkdtemp(prefix="kfe-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_not_attached_fails_requests_in_flight_and_the_client_says_hello_again(workdir):
    model = build_model_dir(os.path.join(workdir, "model"))
    engine = FakeEngine(f"ipc://{workdir}/e.sock", model).start()
    from tokenizers import Tokenizer
    hang = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).encode(
        "<|im_start|>user\nplease hang<|im_end|>\n").ids

    async def main():
        client = EngineClient(f"ipc://{workdir}/e.sock", "fe-test", heartbeat_s=0.1)
        try:
            await client.connect(10)
            assert engine.hellos == [client.identity.encode()]
            stream = client.open_request("r1", hang, p.SamplingParams())
            engine.forget()
            out = await stream.get(timeout=5)
            assert out.finish_reason == "error" and "dropped this frontend" in out.error
            deadline = time.monotonic() + 5
            while len(engine.hellos) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.hellos[1:] == [client.identity.encode()]
            assert "r1" in engine.aborted  # in case the engine still ran it
            again = client.open_request("r2", [1, 2, 3], p.SamplingParams(max_tokens=3))
            outs = [o async for o in again]
            assert outs[-1].finish_reason == "length"
            assert client.is_healthy()
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


# ---------------------------------------------------------------- the engine core's side


def _link() -> tuple[FrontendLink, list[tuple[bytes, object]]]:
    """A FrontendLink over an EngineCore (16 blocks of 16 tokens, EOS 0), no sockets;
    returns it and the list its sends go to."""
    cfg = core_config(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    core = EngineCore(cfg, toy_info(vocab_size=100, eos=0, max_model_len=cfg.max_model_len), num_blocks=16)
    sent: list[tuple[bytes, object]] = []
    return FrontendLink(core, lambda ident, msg: sent.append((ident, msg)), cfg, "engine-0"), sent


def test_engine_sends_the_final_abort_to_a_frontend_it_drops_for_silence():
    link, sent = _link()
    link.frontends[b"fe-a"] = FrontendState("frontend-0", time.monotonic() - 7)
    # admitted 7 s ago (a message now would count as a sign of life)
    assert link.core.add(b"fe-a", p.AddRequest("r1", [1, 2, 3], p.SamplingParams(max_tokens=4), 0.0)) is None
    assert "r1" in link.core.requests
    link.check_frontends()
    link.apply_aborts()
    assert b"fe-a" not in link.frontends and "r1" not in link.core.requests
    [(ident, msg)] = sent
    out = msg.outputs[0]
    assert ident == b"fe-a" and out.request_id == "r1" and out.finish_reason == "abort"
    assert out.error == "the engine dropped this frontend after 7 s of silence"


def test_engine_answers_an_unknown_identity_with_not_attached():
    link, sent = _link()
    link.on_message(b"ghost", p.Heartbeat(time.time()))
    link.on_message(b"ghost", p.AddRequest("r9", [1, 2], p.SamplingParams(), 0.0))
    link.on_message(b"ghost", p.UtilityCall(3, "stats"))
    kinds = [type(m).__name__ for _, m in sent]
    assert kinds == ["NotAttached", "Outputs", "NotAttached", "UtilityResult", "NotAttached"]
    refused = sent[1][1].outputs[0]
    assert (refused.request_id, refused.finish_reason, refused.error_kind) == (
        "r9", "error", "overloaded")
    assert sent[3][1].error and all(ident == b"ghost" for ident, _ in sent)
    assert not link.core.requests and not link.frontends  # nothing was admitted
    # The frontend decodes the new message with its one typed decoder.
    dec = p.decoder(p.EngineToFrontend)
    assert isinstance(dec.decode(p.encoder().encode(sent[0][1])), p.NotAttached)


def test_xgrammar_errors_lose_their_time_and_source_prefix():
    raw = '[15:39:31] /project/cpp/json_schema_converter.cc:5082: Unsupported type "bogus"\n'
    assert grammar_error_text(RuntimeError(raw)) == 'Unsupported type "bogus"'
    assert grammar_error_text("plain: reason") == "plain: reason"
    assert grammar_error_text(ValueError("")) == "ValueError"

