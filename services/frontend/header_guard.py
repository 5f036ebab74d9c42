"""Slow and half-sent HTTP requests: a header-read timeout and a cap on the connections
that are still sending their headers (docs/ARCHITECTURE.md §8.6).

uvicorn has a keep-alive timeout (idle connections between requests) but none for reading a
request's headers: a client that sends `GET / HTTP/1.1\\r\\nHost: x\\r\\n` and then nothing
holds its connection, and a few hundred of them hold the server's file descriptors
(slowloris). `guarded_protocol(base, ...)` subclasses uvicorn's HTTP protocol class (the
httptools one, or h11's: both keep the request being answered in `self.cycle`, which
they replace with a new cycle when a request's headers are complete):

- A connection is *waiting for headers* from its connection_made, and from the first byte
  of each next request on a kept-alive connection, until its parser starts a new request
  cycle. A connection that waits longer than `header_timeout_s` gets `408 Request Timeout`
  (`connection: close`) and is closed; one whose waiting headers pass MAX_HEADER_BYTES
  gets `431 Request Header Fields Too Large` and is closed (httptools itself has no limit).
- At most `max_pending` connections of the process wait for headers: a new one beyond that
  closes the one that has waited longest (it has had the most time: a slowloris client
  cannot lock out new clients, which send their headers in milliseconds).

Completion is checked after each `data_received` (headers only complete while the parser is
fed), so the check costs one comparison per read; the head's size is counted before the
parser is fed (up to its blank line), so a whole head past the limit in one read gets its
431 too. Bodies and responses are not limited
here (`--max-request-body-bytes` covers bodies).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("kestrel.frontend")

MAX_HEADER_BYTES = 64 * 1024  # bytes of one request's head (request line + headers); h11's default is 16 KiB


def _status(code: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _HeaderGuard(asyncio.Protocol):
    """The mixin put in front of uvicorn's protocol class (see `guarded_protocol`)."""

    # set by guarded_protocol on the subclass
    header_timeout_s: float
    max_pending: int
    pending: dict[_HeaderGuard, None]  # waiting connections of this process, oldest first
    # uvicorn's protocol attributes that this reads
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    _timer: asyncio.TimerHandle | None = None
    _armed_cycle: Any = None  # the request cycle when the wait began (a new one: headers done)
    _head_bytes = 0
    _tail = b""  # the last 3 bytes of the head so far (a "\r\n\r\n" may span two reads)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the next request on a kept-alive connection begins
        if self._timer is not None:
            # Counted before the parser sees the bytes: a whole oversized head in one read
            # would otherwise complete (and disarm) before its size was checked. Only the
            # bytes up to the blank line that ends the head count (a body may follow).
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            self._tail = seen[-3:]
            if self._head_bytes > MAX_HEADER_BYTES:
                self._refuse(431, "Request Header Fields Too Large",
                             f"Request headers over {MAX_HEADER_BYTES} bytes.")
                return
        super().data_received(data)
        if self._timer is not None and (self.cycle is not self._armed_cycle
                                        or self.transport.get_protocol() is not self):
            self._disarm()  # its headers are complete: a request is being served (or the
            # connection was upgraded and another protocol owns it now)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        pending = self.pending
        while len(pending) >= self.max_pending:
            oldest = next(iter(pending))
            log.warning("%d connections are waiting for their headers (--max-incomplete-"
                        "connections): closing the oldest", len(pending))
            oldest._refuse(408, "Request Timeout", "Too many connections waiting for headers.")
        self._armed_cycle = self.cycle
        self._head_bytes = 0
        self._tail = b""
        self._timer = self.loop.call_later(self.header_timeout_s, self._expire)
        pending[self] = None

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pending.pop(self, None)

    def _expire(self) -> None:
        self._timer = None
        self._refuse(408, "Request Timeout",
                     f"Request headers not received within {self.header_timeout_s:g} s.")

    def _refuse(self, code: int, reason: str, message: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_status(code, reason, message))
            self.transport.close()


def guarded_protocol(base: type[asyncio.Protocol], header_timeout_s: float,
                     max_pending: int) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol class `base` (HttpToolsProtocol or H11Protocol;
    pass it as uvicorn.Config(http=...)) with the header timeout and the cap of the module
    doc. header_timeout_s: seconds (> 0); max_pending: connections (>= 1). Raises
    ValueError for other values."""
    if not header_timeout_s > 0 or max_pending < 1:
        raise ValueError(f"header timeout {header_timeout_s} s and max_pending {max_pending}: "
                         "both must be positive")
    return type(f"HeaderGuarded{base.__name__}", (_HeaderGuard, base), {
        "header_timeout_s": float(header_timeout_s), "max_pending": int(max_pending),
        "pending": {}})
