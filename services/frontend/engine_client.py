"""The frontend's async client of the engine (docs/ARCHITECTURE.md §2), on zmq.asyncio.

Socket: one DEALER, connected to the engine's ROUTER at `engine_address`, with a fresh ZMQ
identity per process start. Each message is one frame: a msgspec MessagePack encoding of
`shared.protocol.FrontendToEngine` (frontend -> engine) or `EngineToFrontend` (engine ->
frontend; if the engine sends several frames, the last one is decoded).

What the client expects of the engine:
- `Hello` is answered with `EngineInfo`. Hello may be sent more than once with the same
  frontend_id and identity (while waiting for the engine, and after the engine has been
  silent): the engine treats a repeat from the same identity as harmless.
- Every `Heartbeat` (about one a second) is answered with a `Heartbeat`. Any message from
  the engine counts as a sign of life.
- `AddRequest` is answered by `Outputs` with the request's `RequestOutput`s; the last one
  has a finish_reason. `Abort` of an unknown id is ignored.
- `UtilityCall` is answered by a `UtilityResult` with the same call_id.
- A request the engine ends on its own (it dropped this frontend after a silence) gets an
  output with finish_reason "abort" and an error: its client gets an error, not a hang.
- A message from an identity the engine does not know is answered with `NotAttached`: the
  client then fails every request in flight (the engine has none of them) and says Hello
  again.
If the engine is silent for `dead_after_s`, every request in flight is finished with an
error, so that no client hangs (silence measured while this process's own event loop ran:
a tick that comes late because the loop was blocked does not count the engine dead). The
engine's Heartbeat answer carries its step count and whether it is busy: a busy engine
whose count stands still for `stuck_after_s` is unhealthy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from typing import Any
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from shared import protocol as p
from services.frontend.mailbox import Mailbox

log = logging.getLogger("kestrel.frontend.engine_client")

HEARTBEAT_INTERVAL_S = 0.5
HEALTHY_WITHIN_S = 3.0    # /health is 200 only if the engine spoke within this many seconds
DEAD_AFTER_S = 3.0        # silence after which requests in flight fail (engine died or hung)
STUCK_AFTER_S = 10.0      # a busy engine whose step count stands still this long is stuck
REHELLO_AFTER_S = 1.5     # silence after which Hello is re-sent (a restarted engine)
HELLO_RETRY_S = 2.0       # Hello is re-sent this often while no EngineInfo has come
CONNECT_POLL_S = 0.1      # retry interval while the engine's socket is not there yet


class EngineCallError(Exception):
    """A utility call failed on the engine (its `UtilityResult.error`)."""


class EngineUnavailable(Exception):
    """The engine cannot take a request now (not connected, or silent too long)."""


_FAILED = (p.FinishReason.ABORT, p.FinishReason.ERROR)


def merge_outputs(outs: list[p.RequestOutput]) -> p.RequestOutput:
    """One RequestOutput equal to `outs` (consecutive outputs of one request, in order)
    applied one after another: the new tokens and their logprobs concatenated, the prompt
    logprobs of whichever carried them, and the end (finish_reason, stop_token_id, error,
    error_kind) and num_cached_tokens of the last."""
    last = outs[-1]
    merged = p.RequestOutput(last.request_id, [t for o in outs for t in o.new_token_ids],
                             last.num_prompt_tokens, last.finish_reason, last.stop_token_id,
                             last.error, last.num_cached_tokens, last.error_kind)
    merged.logprobs = [lp for o in outs for lp in o.logprobs]
    merged.prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), [])
    return merged


class RequestStream:
    """The outputs of one request, in engine order. Iterate with `async for`; iteration
    ends after the output that carries a finish_reason."""

    def __init__(self, request_id: str, merge: bool = False):
        self.request_id = request_id
        self.merge = merge
        self.created = time.monotonic()  # submission time (metrics: TTFT, e2e)
        self.finished = False
        self._box: Mailbox[p.RequestOutput] = Mailbox()

    def put(self, out: p.RequestOutput) -> None:
        """Queue one output (called by the client's reader task)."""
        self._box.put(out)

    async def get(self, timeout: float | None = None) -> p.RequestOutput:
        """The next output; with `merge`, merged with the outputs queued behind it
        (`merge_outputs`): a consumer that fell behind (many streams on one event loop)
        catches up in one iteration instead of one per engine step. Streams of requests
        with stop strings do not merge: a stop string found in the text must cut the
        tokens (usage, logprobs) at the output that completed it. An output that ends the request with an
        error or abort is never merged into the tokens before it, which are delivered
        first, as they were produced. Raises TimeoutError if none comes within `timeout`
        seconds."""
        out = await self._box.get(timeout)
        box = self._box
        if self.merge and box and out.finish_reason is None and box.peek().finish_reason not in _FAILED:
            more = [out]
            while box and more[-1].finish_reason is None and box.peek().finish_reason not in _FAILED:
                more.append(box.take())
            out = merge_outputs(more)
        if out.finish_reason is not None:
            self.finished = True
        return out

    async def __aiter__(self) -> AsyncIterator[p.RequestOutput]:
        while not self.finished:
            yield await self.get()


class EngineClient:
    """Talks to the engine for one frontend process.

    address: the engine's ZMQ address (cfg.engine_address). name: this frontend's stable
    name (the Hello's frontend_id; a new process with the same name replaces the old one).
    Use: `info = await client.connect(deadline_s)`, then `open_request`, `abort`,
    `call_utility`; `close()` at shutdown.
    """

    def __init__(self, address: str, name: str, *, heartbeat_s: float = HEARTBEAT_INTERVAL_S,
                 healthy_within_s: float = HEALTHY_WITHIN_S, dead_after_s: float = DEAD_AFTER_S,
                 stuck_after_s: float = STUCK_AFTER_S):
        self.address = address
        self.name = name
        self.identity = f"{name}-{uuid.uuid4().hex[:12]}"
        self.info: p.EngineInfo | None = None
        self.last_seen = 0.0  # time.monotonic() of the engine's last message
        self._heartbeat_s = heartbeat_s
        self._healthy_within_s = healthy_within_s
        self._dead_after_s = dead_after_s
        self._stuck_after_s = stuck_after_s
        self.engine_progress = 0       # the engine's step count, from its Heartbeat answers
        self.engine_busy = False       # whether it had requests to run at that answer
        self._progress_at = time.monotonic()  # when engine_progress last changed
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.connect(address)
        self._encoder = p.encoder()
        self._decoder = p.decoder(p.EngineToFrontend)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._info_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._reattach_at: float | None = None  # monotonic time of a Hello sent on NotAttached
        self._closed_reason: str | None = None  # set by end_requests: new requests refused

    # ------------------------------------------------------------ lifecycle

    async def connect(self, deadline_s: float) -> p.EngineInfo:
        """Handshake: send Hello until EngineInfo arrives; start the reader and heartbeat
        tasks. Logs while waiting. Raises TimeoutError after `deadline_s` seconds."""
        self._tasks.append(asyncio.create_task(self._reader(), name="engine-reader"))
        start = last_log = time.monotonic()
        while True:
            sent = self._send(p.Hello(frontend_id=self.name, pid=os.getpid()))
            try:
                await asyncio.wait_for(self._info_event.wait(),
                                       HELLO_RETRY_S if sent else CONNECT_POLL_S)
                break
            except TimeoutError:
                now = time.monotonic()
                if now - start >= deadline_s:
                    raise TimeoutError(f"no answer from the engine at {self.address} "
                                       f"after {now - start:.0f} s") from None
                if now - last_log >= HELLO_RETRY_S:
                    last_log = now
                    log.info("waiting for the engine at %s (%.0f s)", self.address, now - start)
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="engine-heartbeat"))
        assert self.info is not None
        return self.info

    async def close(self) -> None:
        """Stop the tasks, fail requests in flight, close the socket."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all("the frontend is shutting down")
        self._sock.close(0)
        self._ctx.term()

    def is_healthy(self) -> bool:
        """True when the handshake is done, the engine's socket is connected now (a
        Heartbeat probe can be sent: the same check a new request meets, so /health turns
        503 at once when the engine process is gone), the engine spoke within
        healthy_within_s, and it is idle or its step count moved within stuck_after_s."""
        now = time.monotonic()
        return (self.info is not None
                and self._send(p.Heartbeat(time=time.time()))
                and now - self.last_seen < self._healthy_within_s
                and not (self.engine_busy and now - self._progress_at >= self._stuck_after_s))

    def is_dead(self) -> bool:
        """True when the engine has been silent for dead_after_s (or never answered)."""
        return self.info is None or time.monotonic() - self.last_seen >= self._dead_after_s

    # ------------------------------------------------------------ requests

    def open_request(self, request_id: str, prompt_token_ids: list[int],
                     sampling: p.SamplingParams, merge: bool = False) -> RequestStream:
        """Send an AddRequest; return the stream its outputs arrive on. merge: let the
        stream merge queued outputs (`RequestStream.get`); only for requests without stop
        strings, whose end is found in the text and must cut the token count there.

        Raises EngineUnavailable if the engine is not connected or not answering, or once
        `end_requests` was called."""
        if self._closed_reason is not None:
            raise EngineUnavailable(self._closed_reason)
        if self.is_dead():
            raise EngineUnavailable("the engine is not responding")
        stream = RequestStream(request_id, merge)
        self._streams[request_id] = stream
        if not self._send(p.AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                       sampling=sampling, arrival_time=time.time())):
            del self._streams[request_id]
            raise EngineUnavailable("the engine is not connected")
        return stream

    def end_requests(self, reason: str) -> int:
        """End every request in flight now with an error output of error_kind "unavailable"
        and `reason` (each API then answers its own way: a 503 in its envelope, or its
        stream's error event), abort them in the engine, and refuse new requests from now on
        (EngineUnavailable(reason)). The drain of a stopping frontend calls it when its time
        is up (lifecycle.py). Returns the number of requests ended."""
        self._closed_reason = reason
        n = len(self._streams)
        self._fail_all(reason)
        return n

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, stop string): forget its stream and send Abort.
        Safe to call from a finally block of a cancelled task (it does not await)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send(p.Abort(request_ids=[request_id]))

    def release(self, request_id: str) -> None:
        """Forget a finished request's stream (no message is sent)."""
        self._streams.pop(request_id, None)

    async def call_utility(self, method: str, args: dict[str, Any] | None = None,
                           timeout: float = 10.0) -> dict[str, Any]:
        """Run a control method on the engine and return its result dict.

        Raises TimeoutError after `timeout` seconds, EngineCallError if the engine reports
        an error, EngineUnavailable if it is not connected."""
        if self.is_dead():
            raise EngineUnavailable("the engine is not responding")
        call_id = next(self._call_ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        if not self._send(p.UtilityCall(call_id=call_id, method=method, args=args or {})):
            del self._calls[call_id]
            raise EngineUnavailable("the engine is not connected")
        try:
            res: p.UtilityResult = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if res.error is not None:
            raise EngineCallError(res.error)
        return res.result

    # ------------------------------------------------------------ internals

    def _send(self, msg: Any) -> bool:
        """Send one message without waiting. False when the engine is not connected or the
        send queue is full (IMMEDIATE is set, so nothing piles up for an absent engine)."""
        fut = self._sock.send(self._encoder.encode(msg), flags=zmq.DONTWAIT)
        # zmq.asyncio returns an asyncio.Future; pyzmq's stubs say only Awaitable
        if fut.done() and fut.exception() is not None:  # type: ignore[attr-defined]
            return False
        return True

    async def _reader(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = self._decoder.decode(frames[-1])
            except msgspec.DecodeError as e:
                log.warning("dropped an undecodable message from the engine (%d bytes): %s",
                            len(frames[-1]), e)
                continue
            self.last_seen = time.monotonic()
            try:
                self._dispatch(msg)
            except Exception:  # a bug in dispatch must not stop the reader
                log.exception("failed to handle a %s from the engine", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, p.Outputs):
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted or unknown: the engine may still send a last output
                if out.finish_reason is not None:
                    del self._streams[out.request_id]
                stream.put(out)
        elif isinstance(msg, p.UtilityResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, p.EngineInfo):
            self._reattach_at = None
            self._on_info(msg)
        elif isinstance(msg, p.NotAttached):
            self._on_not_attached(msg)
        elif isinstance(msg, p.Heartbeat):
            if msg.progress != self.engine_progress or not msg.busy:
                self._progress_at = time.monotonic()
            self.engine_progress, self.engine_busy = msg.progress, msg.busy

    def _on_info(self, info: p.EngineInfo) -> None:
        if self.info is not None and info.engine_id != self.info.engine_id:
            log.warning("engine restarted (%s -> %s); failing %d requests in flight",
                        self.info.engine_id, info.engine_id, len(self._streams))
            self._fail_all("the engine restarted")
        elif self.info is None:
            log.info("connected to engine %s: model %s, max_model_len %d",
                     info.engine_id, info.model_name, info.max_model_len)
        self.info = info
        self._info_event.set()

    def _on_not_attached(self, msg: p.NotAttached) -> None:
        """The engine does not know this identity: fail what is in flight and re-attach.
        Repeats within HELLO_RETRY_S of the last re-attach Hello are answers to messages
        sent before that Hello reached the engine, and are ignored."""
        now = time.monotonic()
        if self._reattach_at is not None and now - self._reattach_at < HELLO_RETRY_S:
            return
        log.warning("the engine does not know this frontend (%s); failing %d requests in "
                    "flight and attaching again", msg.reason, len(self._streams))
        self._fail_all(f"the engine dropped this frontend ({msg.reason})")
        self._reattach_at = now
        self._send(p.Hello(frontend_id=self.name, pid=os.getpid()))

    async def _heartbeats(self) -> None:
        while True:
            due = time.monotonic() + self._heartbeat_s
            await asyncio.sleep(self._heartbeat_s)
            self._send(p.Heartbeat(time=time.time()))
            if time.monotonic() - due > self._heartbeat_s:
                # This loop was blocked: the engine's answers may be waiting unread in the
                # socket. Judge its silence at the next tick, once the reader has run.
                continue
            silent = time.monotonic() - self.last_seen
            if silent >= min(REHELLO_AFTER_S, self._healthy_within_s):
                # Perhaps a new engine that does not know us: say hello again.
                self._send(p.Hello(frontend_id=self.name, pid=os.getpid()))
            if silent >= self._dead_after_s and self._streams:
                log.error("engine silent for %.0f s; failing %d requests in flight",
                          silent, len(self._streams))
                self._fail_all("the engine is not responding")

    def _fail_all(self, reason: str) -> None:
        """End every request in flight with an error output of error_kind "unavailable" (the
        engine is gone or restarted, or this frontend stops: a retry may succeed, 503 +
        Retry-After) and Abort them in the engine, in case it still runs them; fail pending
        utility calls."""
        streams, self._streams = self._streams, {}
        if streams:
            self._send(p.Abort(request_ids=list(streams)))
        for rid, stream in streams.items():
            stream.put(p.RequestOutput(request_id=rid, new_token_ids=[], num_prompt_tokens=0,
                                       finish_reason=p.FinishReason.ERROR, error=reason,
                                       error_kind=p.ErrorKind.UNAVAILABLE))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineCallError(reason))
