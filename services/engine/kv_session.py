"""The engine's session with the kvstore (docs/ARCHITECTURE.md §4 "Tiers"): the hello, the
store's facts, and a new session when the old one is lost. Never blocks: the KVHello is
sent at once and its KVInfo comes back among the replies (`on_info`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from shared.kvstore_client import KVStoreClient
from shared.protocol import KVInfo

log = logging.getLogger("kestrel.engine")


class StoreSession:
    """One live `KVStoreClient` at a time, under the client name "engine" (a new session
    releases the old one's pins in the store).

    address, identity (32 bytes), block_bytes, ctx, state_identity, state_bytes: as
    `KVStoreClient`. retry_s: seconds between hellos while the store does not answer.
    Attributes: connected (the store took the hello; info is its KVInfo), connects /
    disconnects (cumulative counts).
    """

    def __init__(self, address: str, identity: bytes, block_bytes: int, ctx: zmq.Context,
                 retry_s: float, state_identity: bytes = b"", state_bytes: int = 0):
        self.address, self.identity, self.block_bytes, self.ctx = (address, identity,
                                                                   block_bytes, ctx)
        self.state_identity, self.state_bytes = state_identity, state_bytes
        self.retry_s = retry_s
        self.info: KVInfo | None = None
        self.connected = False
        self.closed = False
        self.lost_logged = False
        self.connects = self.disconnects = 0
        self.hello_sent_at = 0.0
        self.client = self._hello()

    @property
    def socket(self) -> zmq.Socket | None:
        """The socket to poll for replies (changes with each session; None once closed)."""
        return None if self.closed else self.client.socket

    def _hello(self) -> KVStoreClient:
        c = KVStoreClient(self.address, "engine", self.identity, self.block_bytes, ctx=self.ctx,
                          state_identity=self.state_identity, state_bytes=self.state_bytes)
        c.socket.send(c.enc.encode(c.hello()))
        self.hello_sent_at = time.monotonic()
        return c

    def _renew(self) -> None:
        self.client.close(bye=False)
        self.client = self._hello()

    def replies(self) -> list[Any]:
        """The replies that arrived (never waits). Raises zmq.ZMQError."""
        return self.client.poll_replies()

    def submit(self, cls: type, **fields: Any) -> int:
        """Send one request (a shared.protocol KV* class); returns its req_id."""
        return self.client.submit(cls, **fields)

    def on_info(self, msg: KVInfo) -> None:
        """The store's answer to the hello: connected, or refused (logged once)."""
        if not msg.ok:
            if not self.lost_logged:
                log.error("kvstore refused the engine: %s; running without KV tiers", msg.error)
                self.lost_logged = True
            return
        self.info, self.connected, self.lost_logged = msg, True, False
        self.connects += 1
        log.info("kvstore connected (pid %d, pool %s, %d slots%s, disk tier %s)", msg.store_pid,
                 msg.pool_name, msg.n_slots,
                 f", state pool {msg.state_pool_name}, {msg.state_n_slots} slots" if msg.state_pool_name else "",
                 "on" if msg.disk_tier else "off")

    def lost(self, why: str) -> None:
        """The store is gone (logged once): not connected, and a new hello goes out."""
        if self.connected or not self.lost_logged:
            log.warning("kvstore lost (%s): carrying on without KV tiers until it is back", why)
            self.lost_logged = True
        if self.connected:
            self.disconnects += 1
        self.connected = False
        self.info = None
        self._renew()

    def retry(self, now: float) -> None:
        """While not connected: a new hello every retry_s seconds (now: time.monotonic())."""
        if now - self.hello_sent_at > self.retry_s:
            self._renew()

    def close(self) -> None:
        """End the session (a KVBye while connected), close the socket."""
        if not self.closed:
            self.client.close(bye=self.connected)
            self.closed = True
