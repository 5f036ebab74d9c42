"""ZMQ helpers: socket setup and safe decoding (a bad message is logged and dropped)."""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq

log = logging.getLogger("kestrel.zmq")


def ensure_ipc_dir(address: str) -> None:
    """Create the folder of an `ipc://` address with mode 0700 (no-op for tcp)."""
    if address.startswith("ipc://"):
        folder = os.path.dirname(address[len("ipc://"):])
        if folder:
            os.makedirs(folder, mode=0o700, exist_ok=True)


def restrict_ipc_file(address: str) -> None:
    """Make an `ipc://` socket file readable by its owner only (mode 0600)."""
    if address.startswith("ipc://"):
        try:
            os.chmod(address[len("ipc://"):], 0o600)
        except OSError:
            pass


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool,
                identity: bytes | None = None) -> zmq.Socket:
    """A socket with linger 0, bound or connected to `address`.

    Raises zmq.ZMQError if the bind fails (address in use).
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        host = address[len("tcp://"):].rsplit(":", 1)[0] if address.startswith("tcp://") else None
        if host is not None and host not in ("127.0.0.1", "localhost", "[::1]", "::1"):
            log.warning("binding %s: this ZMQ endpoint is reachable from other hosts (it was "
                        "configured so; the default is an ipc:// socket)", address)
        ensure_ipc_dir(address)
        sock.bind(address)
        restrict_ipc_file(address)
    else:
        sock.connect(address)
    return sock


def safe_decode(decoder: msgspec.msgpack.Decoder, data: bytes, peer: Any = "?") -> Any | None:
    """Decode one message; on failure log it with the peer's identity and return None."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("dropped undecodable message from %r (%d bytes): %s", peer, len(data), e)
        return None
