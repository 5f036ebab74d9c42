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
