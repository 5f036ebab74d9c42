"""The worker process: reads step plans from the shm ring, runs the model, returns tokens.

Loop: attach to the engine's plan ring, load the model (`ModelRunner`), send `WorkerReady`,
then for each `StepPlan` run `ModelRunner.execute` and (rank 0) push a `StepResult` to the
engine. A background thread sends `WorkerHeartbeat` every second on its own socket, so the
engine can tell a slow step from a dead worker. An exception inside a step is reported in
the result (the engine fails that step's requests) and the worker carries on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback

import zmq

from shared import protocol as P
from shared.config import KestrelConfig, ring_name
from shared.liveness import Beacon
from shared.procutil import (CONFIG_REFUSED, EXIT_CONFIG, die_with_parent, freeze_gc, on_stop_signals, set_title,
                             setup_logging)
from shared.runtime_dir import write_private_file
from shared.shm_ring import RingClosed, ShmRingReader
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.worker")


def _attach_ring(cfg: KestrelConfig, rank: int, timeout: float) -> ShmRingReader:
    """Attach to the plan ring, waiting for the engine to create it. Raises TimeoutError."""
    name = ring_name(cfg.instance_id, "plan")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ShmRingReader(name, reader_index=rank, runtime_dir=cfg.runtime_dir)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"plan ring {name} did not appear within {timeout:.0f} s") from None
            time.sleep(0.05)


def _heartbeats(ctx: zmq.Context, address: str, rank: int, stop: threading.Event) -> None:
    sock = make_socket(ctx, zmq.PUSH, address, bind=False)
    enc = P.encoder()
    try:
        while not stop.wait(1.0):
            sock.send(enc.encode(P.WorkerHeartbeat(rank, time.time())), flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    finally:
        sock.close(0)


def device_lost(e: BaseException) -> bool:
    """Whether `e` leaves the CUDA context unusable (a device-side assert, an illegal
    address: CUDA reports them as sticky errors, so the process cannot go on)."""
    import torch

    kinds = tuple(k for k in (getattr(torch, "AcceleratorError", None),) if k is not None)
    return isinstance(e, kinds) or "CUDA error" in str(e)


def run_worker(cfg: KestrelConfig, rank: int = 0) -> int:
    """Entry point of `kestrel worker`. Returns the process exit code."""
    set_title(f"kestrel:worker:{rank}")
    die_with_parent()
    setup_logging(f"worker:{rank}", cfg.log_level)
    stopping = threading.Event()
    serving = threading.Event()

    def on_term(signum, frame):
        stopping.set()
        if not serving.is_set():  # still loading or attaching: nothing to finish, just go
            raise SystemExit(128 + signum)

    on_stop_signals(on_term)  # SIGTERM; SIGINT too unless supervised

    from services.worker.model_runner import ModelRunner  # heavy import after the title is set

    t0 = time.monotonic()
    try:
        runner = ModelRunner(cfg)
    except (ValueError, FileNotFoundError) as e:
        # a model or drafter folder, or settings, that cannot load (a bad folder, a shape, a
        # KV budget below one block): restarting gives the same answer, so it is refused like
        # the engine's refusals (the supervisor reads CONFIG_REFUSED and does not restart)
        log.error("the worker refused its configuration: %s", e)
        try:
            write_private_file(cfg.runtime_dir, CONFIG_REFUSED,
                               f"worker {rank} refused its configuration: {e}\n")
        except OSError as err:
            log.warning("could not record the refused configuration: %s", err)
        return EXIT_CONFIG
    ring = _attach_ring(cfg, rank, cfg.startup_timeout_s)
    beacon = Beacon(cfg.runtime_dir, f"worker-{rank}")  # watchdog: progress + stack dumps
    ctx = zmq.Context()
    push = make_socket(ctx, zmq.PUSH, cfg.worker_address, bind=False)
    enc = P.encoder()
    dec = P.decoder(P.EngineToWorker)
    report = dict(runner.report())
    report["startup_s"] = round(time.monotonic() - t0, 3)
    if report.get("speculative"):
        log.info("speculative decoding: %s", report["speculative"])
    push.send(enc.encode(P.WorkerReady(rank, os.getpid(), runner.num_blocks, runner.block_size,
                                       str(cfg.device), report)))
    hb = threading.Thread(target=_heartbeats, args=(ctx, cfg.worker_address, rank, stopping),
                          daemon=True, name="heartbeat")
    hb.start()
    freeze_gc()  # the model and startup's objects out of the serving loop's collections
    serving.set()
    code = 0
    try:
        while not stopping.is_set():
            beacon.beat()
            data = ring.read(timeout=0.5)
            if data is None:
                continue
            msg = safe_decode(dec, data, "engine")
            if isinstance(msg, P.WorkerShutdown):
                log.info("shutdown requested: %s", msg.reason)
                break
            if not isinstance(msg, P.StepPlan):
                continue
            c0 = time.process_time()
            lost = False
            try:
                result = runner.execute(msg)  # tokens, logprobs, prompt logprobs
            except Exception as e:
                log.error("step %d failed: %s\n%s", msg.step_id, e, traceback.format_exc())
                result = P.StepResult(msg.step_id, [], error=f"{type(e).__name__}: {e}")
                lost = device_lost(e)
            result.cpu_time = time.process_time() - c0
            if rank == 0:
                push.send(enc.encode(result))
            if lost:  # every later CUDA call fails or hangs: a new process is the way back
                log.error("the device context is broken: exiting so that the supervisor restarts")
                code = 1
                break
    except RingClosed as e:  # the engine died or closed the ring without a shutdown message
        log.error("%s: exiting", e)
        code = 1
    except Exception:
        log.exception("worker failed")
        code = 1
    finally:
        stopping.set()
        ring.close()
        ctx.destroy(linger=0)
    log.info("worker stopped")
    return code
