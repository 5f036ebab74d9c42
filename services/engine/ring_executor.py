"""The production `Executor`: plans out on the shm ring, results back on a PULL socket.

docs/ARCHITECTURE.md §2, §3. The engine writes each `StepPlan` into the ring
`kestrel-<instance>-plan` (every worker reads every plan); worker rank 0 pushes the
`StepResult` to the PULL socket bound at cfg.worker_address, and every worker pushes
`WorkerReady` once and `WorkerHeartbeat`s while it lives.

Timeouts while a result is awaited: no message from any worker for cfg.worker_timeout_s
(default 10 s), or a step running longer than cfg.step_timeout_s (default
STEP_LIMIT_FACTOR worker timeouts: a step can be stuck while the workers' heartbeat threads
still beat, e.g. a collective that never returns): TimeoutError. Before it raises, the
executor asks the supervisor's watchdog for the stacks of every live worker and waits for
them (DUMP_WAIT_S at most; shared.liveness.request_dump): dump, then kill, as the supervisor
kills the workers once the engine has exited.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from services.engine.executor import EngineStopping, WaitHook
from shared import protocol as P
from shared.config import KestrelConfig, ring_name
from shared.liveness import request_dump, take_dump_answer
from shared.procutil import pid_alive, supervisor_pid
from shared.shm_ring import ShmRingWriter
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.engine")

STEP_LIMIT_FACTOR = 6  # a step longer than this many worker timeouts is stuck
WAIT_POLL_MS = 100     # poll timeout while a result is awaited
DUMP_WAIT_S = 15.0     # the longest wait for the watchdog's dumps of stuck workers


class RingExecutor:
    """Runs plans on the worker processes (module doc).

    cfg: instance_id, runtime_dir, ring_chunks, ring_chunk_bytes, worker_address,
    worker_timeout_s, step_timeout_s. ctx: the ZMQ context of the engine process.
    num_workers: worker processes reading the ring.
    Raises FileExistsError if a live ring of this instance exists, zmq.ZMQError if the
    worker address cannot be bound.
    """

    def __init__(self, cfg: KestrelConfig, ctx: zmq.Context, num_workers: int = 1):
        self.num_workers = num_workers
        self.runtime_dir = cfg.runtime_dir
        self.worker_pids: dict[int, int] = {}      # rank -> pid, from WorkerReady
        self.worker_timeout_s = float(cfg.worker_timeout_s or 10.0)
        self.step_limit_s = float(cfg.step_timeout_s or self.worker_timeout_s * STEP_LIMIT_FACTOR)
        self.enc = P.encoder()
        self.dec = P.decoder(P.WorkerToEngine)
        self.sock = make_socket(ctx, zmq.PULL, cfg.worker_address, bind=True)
        self.ring = ShmRingWriter(ring_name(cfg.instance_id, "plan"), n_readers=num_workers,
                                  n_chunks=cfg.ring_chunks, chunk_size=cfg.ring_chunk_bytes,
                                  runtime_dir=cfg.runtime_dir, instance_id=cfg.instance_id)
        self._submitted: set[int] = set()          # step ids whose result is not taken yet
        self._early: dict[int, P.StepResult] = {}  # results that came before they were awaited

    def wait_ready(self, timeout: float, beat: Callable[[], None],
                   stopping: Callable[[], bool]) -> list[P.WorkerReady]:
        """Block until every worker sent `WorkerReady`, calling `beat` meanwhile. Raises
        TimeoutError after `timeout` seconds, or at once when stopping() turns True."""
        ready: dict[int, P.WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.num_workers:
            left = deadline - time.monotonic()
            beat()
            if left <= 0 or stopping():
                raise TimeoutError(f"{len(ready)}/{self.num_workers} workers ready after {timeout:.0f} s")
            if self.sock.poll(int(min(left, 0.5) * 1000)):
                msg = safe_decode(self.dec, self.sock.recv(), "worker")
                if isinstance(msg, P.WorkerReady):
                    ready[msg.rank] = msg
                    self.worker_pids[msg.rank] = msg.pid
                    log.info("worker %d ready: pid %d, %d KV blocks of %d tokens, %s", msg.rank,
                             msg.pid, msg.num_blocks, msg.block_size, msg.report)
        return list(ready.values())

    def submit(self, plan: P.StepPlan) -> None:
        """Write `plan` into the ring. Raises TimeoutError if the workers do not free a slot."""
        self.ring.write(self.enc.encode(plan), msg_type="step")
        self._submitted.add(plan.step_id)

    def sockets(self) -> Sequence[Any]:
        return (self.sock,)

    def _keep(self, msg: P.StepResult) -> None:
        """Keep a result that came before it was awaited (only submitted plans can have one;
        other ids are stale and dropped)."""
        if msg.step_id in self._submitted:
            self._early[msg.step_id] = msg

    def drain(self) -> None:
        """Read what the workers sent while no result was awaited: heartbeats, and with
        async scheduling the result of the plan in flight, kept for `result`."""
        while self.sock.poll(0):
            msg = safe_decode(self.dec, self.sock.recv(), "worker")
            if isinstance(msg, P.StepResult):
                self._keep(msg)

    def result(self, step_id: int, hook: WaitHook) -> P.StepResult:
        """Wait for rank 0's result of `step_id`, serving `hook` meanwhile (module doc for
        the timeouts). Raises TimeoutError, or EngineStopping when hook.stopping()."""
        early = self._early.pop(step_id, None)
        if early is not None:  # it came back while the engine was between steps
            self._submitted.discard(step_id)
            return early
        poller = self._poller(hook)
        last = started = time.monotonic()
        while True:
            hook.tick()
            if hook.stopping():
                raise EngineStopping(f"stopped while waiting for step {step_id}")
            events = dict(poller.poll(WAIT_POLL_MS))
            if hook.serve(events):  # its sockets changed (the kvstore client reconnected)
                poller = self._poller(hook)
            if self.sock in events:
                while self.sock.poll(0):
                    msg = safe_decode(self.dec, self.sock.recv(), "worker")
                    last = time.monotonic()
                    if isinstance(msg, P.StepResult):
                        if msg.step_id == step_id:
                            self._submitted.discard(step_id)
                            return msg
                        self._keep(msg)
            now = time.monotonic()
            if now - last > self.worker_timeout_s:
                why = f"no word from the workers for {self.worker_timeout_s:.0f} s in step {step_id}"
            elif now - started > self.step_limit_s:
                why = f"step {step_id} still running after {self.step_limit_s:.0f} s"
            else:
                continue
            self._dump_workers(why, hook)
            raise TimeoutError(why)

    def _dump_workers(self, why: str, hook: WaitHook) -> None:
        """Ask the supervisor's watchdog for the stacks of every live worker and wait for
        its answers (DUMP_WAIT_S at most), serving `hook` meanwhile; each dump's path is
        logged. Without a supervisor (no watchdog) nothing is asked. Never raises."""
        if supervisor_pid() is None:
            return
        asked: dict[str, int] = {}
        for rank, pid in self.worker_pids.items():
            role = f"worker-{rank}"  # the worker's Beacon role
            if pid_alive(pid):
                try:
                    request_dump(self.runtime_dir, role, pid, f"engine: {why}")
                    asked[role] = pid
                except OSError as e:
                    log.warning("could not ask for a stack dump of %s: %s", role, e)
        deadline = time.monotonic() + DUMP_WAIT_S
        poller = self._poller(hook)
        while asked and time.monotonic() < deadline and not hook.stopping():
            hook.tick()
            events = dict(poller.poll(WAIT_POLL_MS))
            if hook.serve(events):
                poller = self._poller(hook)
            if self.sock in events:
                self.drain()
            for role, pid in list(asked.items()):
                path = take_dump_answer(self.runtime_dir, role, pid)
                if path is not None:
                    log.error("%s: stacks of %s (pid %d) in %s", why, role, pid, path)
                    del asked[role]
                elif not pid_alive(pid):
                    del asked[role]
        for role, pid in asked.items():
            log.warning("no stack dump of %s (pid %d) within %.0f s", role, pid, DUMP_WAIT_S)

    def _poller(self, hook: WaitHook) -> zmq.Poller:
        poller = zmq.Poller()
        for sock in (self.sock, *hook.sockets()):
            poller.register(sock, zmq.POLLIN)
        return poller

    def shutdown(self, reason: str) -> None:
        """Send `WorkerShutdown(reason)` (1 s at most: a dead worker cannot drain the ring),
        then unlink the ring. The PULL socket closes with the context."""
        try:
            self.ring.write(self.enc.encode(P.WorkerShutdown(reason)), msg_type="shutdown", timeout=1.0)
        except Exception as e:
            log.debug("could not send shutdown to workers: %s", e)
        self.ring.close()
