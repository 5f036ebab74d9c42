"""A request body that stalls after its headers (services/frontend/body.py, --body-timeout):
answered 408 in the route's own API envelope, and its connection closed by the server, while
the frontend serves other requests. A real frontend subprocess and the fake engine; the
stalled requests are raw sockets that send the headers with a Content-Length and then half
the body. Truths: the HTTP/1.1 byte format, each API's envelope (the `openai` and
`anthropic` SDKs' error types read the same bodies elsewhere), the server's EOF."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.unit import test_frontend_support as support
from tests.unit.test_frontend_support import HI, MODEL

BODY_TIMEOUT_S = 1
HANG_S = 120  # only bounds a hang (a busy machine): the server must answer and close first

ROUTES = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": HI},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": HI},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
}


@pytest.fixture(scope="module")
def stack():
    yield from support.running_stack("--body-timeout", str(BODY_TIMEOUT_S))


def _half_sent(port: int, path: str, body: bytes) -> tuple[bytes, list[bytes]]:
    """Send `path`'s headers (Content-Length: all of `body`) and half of `body`, then read
    until the server closes the connection. Returns (everything it sent, the reads)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"anthropic-version: 2023-06-01\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as s:
        s.sendall(head + body[:len(body) // 2])
        reads = [s.recv(65536)]
        while reads[-1]:  # b"": the server closed its side (a hang raises socket.timeout)
            reads.append(s.recv(65536))
    return b"".join(reads), reads


def _parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert len(body) == int(headers["content-length"]), raw
    return status, headers, json.loads(body)


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_body_that_stalls_is_a_408_in_the_apis_envelope_and_the_connection_is_closed(stack, path):
    body = json.dumps(ROUTES[path]).encode()
    raw, reads = _half_sent(stack.port, path, body)
    assert reads[-1] == b"" and raw.startswith(b"HTTP/1.1 408 "), raw  # answered, then closed
    status, headers, doc = _parse(raw)
    assert status == 408 and headers["connection"] == "close", raw
    if path.startswith("/v1/messages"):  # Anthropic's envelope
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
        message = doc["error"]["message"]
    else:  # OpenAI's
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert doc["error"]["code"] == "request_timeout", doc
        message = doc["error"]["message"]
    assert f"not received within {BODY_TIMEOUT_S} s ({len(body) // 2} of {len(body)} bytes" in message
    # the frontend still serves
    ok = httpx.post(f"{stack.url}/v1/chat/completions", json=ROUTES["/v1/chat/completions"],
                    timeout=HANG_S)
    assert ok.status_code == 200, ok.text


def test_stalled_bodies_do_not_hold_up_other_requests(stack):
    socks = []
    try:
        body = json.dumps(ROUTES["/v1/chat/completions"]).encode()
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", stack.port), timeout=HANG_S)
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                      f"{len(body)}\r\n\r\n".encode() + body[:5])
            socks.append(s)
        ok = httpx.post(f"{stack.url}/v1/chat/completions", json=ROUTES["/v1/chat/completions"],
                        timeout=HANG_S)
        assert ok.status_code == 200, ok.text
        for s in socks:  # each gets its 408 and its EOF
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408 "), data
    finally:
        for s in socks:
            s.close()
