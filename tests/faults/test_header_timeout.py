"""Half-sent requests under `kestrel serve` (issue 14, item 11): connections that never finish
their headers are closed with 408 after --header-timeout, and the server keeps serving
normal requests meanwhile. The cap on such connections and the other cases are
tests/unit/test_header_guard.py."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from tests.e2e.server import KestrelServer
from tests.faults.helpers import chat_ok

HALF = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
N = 50
HEADER_TIMEOUT_S = 2


@pytest.fixture
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--header-timeout", str(HEADER_TIMEOUT_S))
    try:
        yield srv.start(timeout=300)
    finally:
        srv.stop(signal.SIGKILL)


def _closed_by_server(s: socket.socket, got: bytearray) -> bool:
    """Read what has arrived on `s` into `got` (no wait); True once the server has closed it.
    A 408 and the FIN that follows it may arrive in separate reads, so the bytes are kept
    across calls."""
    s.setblocking(False)
    try:
        while chunk := s.recv(65536):
            got += chunk
    except BlockingIOError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_half_sent_connections_are_closed_after_the_header_timeout(server):
    socks = []
    try:
        for _ in range(N):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(HALF)
            socks.append(s)
        t0 = time.monotonic()
        # normal requests are served meanwhile
        assert chat_ok(server.base_url, timeout=120), server.log_tail()
        received = [bytearray() for _ in socks]
        answers: dict[int, bytes] = {}
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 120  # generous: a busy machine
        while len(answers) < N and time.monotonic() < deadline:
            for i, s in enumerate(socks):
                if i not in answers and _closed_by_server(s, received[i]):
                    answers[i] = bytes(received[i])
            time.sleep(0.1)
        print(f"{len(answers)}/{N} half-sent connections closed after "
              f"{time.monotonic() - t0:.1f} s (--header-timeout {HEADER_TIMEOUT_S})")
        assert len(answers) == N, f"{N - len(answers)} half-sent connections still open"
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers.values()), set(answers.values())
        assert chat_ok(server.base_url, timeout=120)
    finally:
        for s in socks:
            s.close()
