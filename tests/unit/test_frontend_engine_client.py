"""The frontend's engine client against a fake engine and a raw ZMQ ROUTER."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import msgspec
import pytest
import zmq

from services.frontend.engine_client import EngineClient, EngineUnavailable
from shared import protocol as p
from tests.unit.test_frontend_support import MAX_MODEL_LEN, FakeEngine, build_model_dir


@pytest.fixture()
def workdir():
    d = tempfile.mkdtemp(prefix="kfe-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _hang_request(tok_dir: str) -> list[int]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    return tok.encode("<|im_start|>user\nplease hang<|im_end|>\n").ids


def test_handshake_utility_call_and_outputs(workdir):
    model = build_model_dir(os.path.join(workdir, "model"))
    engine = FakeEngine(f"ipc://{workdir}/e.sock", model).start()

    async def main():
        client = EngineClient(f"ipc://{workdir}/e.sock", "fe-test")
        try:
            info = await client.connect(10)
            assert (info.max_model_len, info.model_path) == (MAX_MODEL_LEN, model)
            assert await client.call_utility("stats") == {"method": "stats"}
            stream = client.open_request("r1", [1, 2, 3], p.SamplingParams(max_tokens=4))
            outs = [o async for o in stream]
            assert sum(len(o.new_token_ids) for o in outs) == 4
            assert outs[-1].finish_reason == "length"
            assert client.is_healthy()
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_requests_in_flight_fail_when_the_engine_goes_silent(workdir):
    model = build_model_dir(os.path.join(workdir, "model"))
    engine = FakeEngine(f"ipc://{workdir}/e.sock", model).start()

    async def main():
        client = EngineClient(f"ipc://{workdir}/e.sock", "fe-test", heartbeat_s=0.1,
                              healthy_within_s=0.5, dead_after_s=1.0)
        try:
            await client.connect(10)
            stream = client.open_request("r1", _hang_request(model), p.SamplingParams())
            engine.stop()
            out = await stream.get(timeout=10)
            assert out.finish_reason == "error" and "not responding" in out.error
            assert not client.is_healthy()
            with pytest.raises(EngineUnavailable):
                await client.call_utility("stats", timeout=0.5)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_undecodable_message_is_dropped_and_engine_restart_fails_requests(workdir):
    address = f"ipc://{workdir}/raw.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    enc = p.encoder()
    dec = p.decoder(p.FrontendToEngine)

    def info(engine_id: str) -> bytes:
        return enc.encode(p.EngineInfo(engine_id, "m", "/nowhere", 64, 16, 8, [0]))

    async def recv_until(kind):
        while True:
            ident, payload = await asyncio.to_thread(router.recv_multipart)
            msg = dec.decode(payload)
            if isinstance(msg, kind):
                return ident, msg

    async def main():
        client = EngineClient(address, "fe-test")
        try:
            connecting = asyncio.ensure_future(client.connect(10))
            ident, hello = await recv_until(p.Hello)
            assert hello.frontend_id == "fe-test" and ident == client.identity.encode()
            router.send_multipart([ident, b"\xc1 not msgpack"])
            router.send_multipart([ident, msgspec.msgpack.encode(["add", "wrong", "shape"])])
            router.send_multipart([ident, info("engine-a")])
            assert (await connecting).engine_id == "engine-a"
            stream = client.open_request("r1", [1], p.SamplingParams())
            await recv_until(p.AddRequest)
            router.send_multipart([ident, info("engine-b")])  # a new engine answered
            out = await stream.get(timeout=5)
            assert out.finish_reason == "error" and "restarted" in out.error
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        router.close(0)
        ctx.term()


def test_queued_outputs_reach_the_consumer_merged_and_equal_to_one_by_one():
    """A consumer that fell behind gets every queued output in one merged RequestOutput;
    tokens, logprobs, prompt logprobs and the end equal those of the outputs taken singly."""
    from services.frontend.engine_client import RequestStream, merge_outputs

    def lp(t):
        return p.TokenLogprob(t, -0.5 * t, 1, [t], [-0.5 * t])
    outs = [p.RequestOutput("r", [5, 6], 7, num_cached_tokens=3, logprobs=[lp(5), lp(6)],
                            prompt_logprobs=[None, lp(1)]),
            p.RequestOutput("r", [8], 7, num_cached_tokens=3, logprobs=[lp(8)]),
            p.RequestOutput("r", [9, 2], 7, "stop", 2, num_cached_tokens=3, logprobs=[lp(9), lp(2)])]

    async def main():
        s = RequestStream("r", merge=True)
        s.put(outs[0])
        first = await s.get(1.0)  # alone in the queue: unchanged
        for o in outs[1:]:
            s.put(o)
        rest = await s.get(1.0)  # the two queued behind: one merged output
        return first, rest, s.finished
    first, rest, finished = asyncio.run(main())
    assert first == outs[0] and finished
    assert rest.new_token_ids == [8, 9, 2] and rest.logprobs == [lp(8), lp(9), lp(2)]
    assert (rest.finish_reason, rest.stop_token_id, rest.prompt_logprobs) == ("stop", 2, [])
    whole = merge_outputs(outs)
    assert whole.new_token_ids == [t for o in outs for t in o.new_token_ids]
    assert whole.prompt_logprobs == outs[0].prompt_logprobs and whole.num_cached_tokens == 3
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(whole), type=p.RequestOutput) == whole


def test_stream_get_times_out_only_when_nothing_is_queued():
    from services.frontend.engine_client import RequestStream

    async def main():
        s = RequestStream("r")
        with pytest.raises(TimeoutError):
            await s.get(0.05)
        s.put(p.RequestOutput("r", [1], 3))
        return await s.get(0.0)  # already queued: returned even with a zero timeout
    assert asyncio.run(main()).new_token_ids == [1]


def test_an_error_output_is_not_merged_into_the_tokens_before_it():
    from services.frontend.engine_client import RequestStream

    async def main():
        s = RequestStream("r", merge=True)
        for o in (p.RequestOutput("r", [1], 3), p.RequestOutput("r", [2], 3),
                  p.RequestOutput("r", [], 3, "error", error="boom")):
            s.put(o)
        return await s.get(1.0), await s.get(1.0)
    tokens, end = asyncio.run(main())
    assert tokens.new_token_ids == [1, 2] and tokens.finish_reason is None
    assert (end.new_token_ids, end.finish_reason, end.error) == ([], "error", "boom")


def test_a_stream_opened_without_merge_hands_outputs_over_one_by_one():
    """Requests with stop strings: each output stays separate, so that a stop string found
    in the text ends the token count at the output that completed it."""
    from services.frontend.engine_client import RequestStream

    async def main():
        s = RequestStream("r")  # merge off (the default)
        for o in (p.RequestOutput("r", [1], 3), p.RequestOutput("r", [2], 3), p.RequestOutput("r", [3], 3)):
            s.put(o)
        return [(await s.get(1.0)).new_token_ids for _ in range(3)]
    assert asyncio.run(main()) == [[1], [2], [3]]
