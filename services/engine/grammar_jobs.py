"""Structured-output grammars compiled off the engine loop (docs/ARCHITECTURE.md §7
"Structured output").

`GrammarJobs` holds the model's grammar compiler (`StructuredOutputManager`, built in a
background thread at startup by `prepare`: reading the tokenizer's vocabulary takes 0.2 s+,
and the first structured request must not stall the loop and the frontends' heartbeat
answers with it), the thread pool that compiles new grammars, and the requests waiting for
theirs (`CompilingRequest`). A schema that takes seconds to compile (an array nested 520 deep:
8.4 s) so stalls nobody; requests with the same spec share one compile. The engine core
admits a waiting request when its future is done (`EngineCore.admit_compiled`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

from services.engine.structured import RequestGrammar, StructuredOutputManager
from shared import protocol as P
from shared.model_spec import ModelSpec

log = logging.getLogger("kestrel.engine")

COMPILE_THREADS = 2  # threads that compile new grammars off the engine loop


@dataclass(slots=True)
class CompilingRequest:
    """A request parked until its grammar compiles.

    future: the compile (shared with other requests of the same spec); its result is an
        `xgrammar.CompiledGrammar`, or it raises `GrammarError` (the client's fault) or
        anything else (an internal fault).
    frontend: the ZMQ identity of the frontend that sent `msg`.
    """

    future: Future[xgr.CompiledGrammar]
    frontend: bytes
    msg: P.AddRequest


class GrammarJobs:
    """The grammar compiler of one model and the compiles in flight (module doc).

    compiling: request id -> its `CompilingRequest`, while its grammar compiles.
    jobs: (kind, spec) -> the future of its compile, while it runs.
    """

    def __init__(self, info: ModelSpec):
        self.info = info
        self.compiling: dict[str, CompilingRequest] = {}
        self.jobs: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}
        self._manager: StructuredOutputManager | None = None
        self._thread: threading.Thread | None = None  # the startup build of the manager
        self._pool: ThreadPoolExecutor | None = None  # made at the first compile

    def _build(self) -> StructuredOutputManager:
        return StructuredOutputManager(self.info.path, self.info.vocab_size,
                                       list(self.info.eos_token_ids))

    def prepare(self) -> None:
        """Start building the grammar compiler in a daemon thread (see `manager`). A failure
        is logged; the first structured request then retries and reports it."""

        def build() -> None:
            try:
                self._manager = self._build()
            except Exception as e:
                log.warning("structured output not prepared at start: %s", e)

        self._thread = threading.Thread(target=build, name="xgrammar-prepare", daemon=True)
        self._thread.start()

    def manager(self) -> StructuredOutputManager:
        """The grammar compiler: waits for the build `prepare` started, and builds it here if
        that failed or never ran. Raises FileNotFoundError without tokenizer.json."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        if self._manager is None:
            self._manager = self._build()
        return self._manager

    def cached(self, spec: P.StructuredSpec) -> RequestGrammar | None:
        """A fresh matcher when `spec`'s grammar is compiled already, else None. Raises
        like `manager`."""
        return self.manager().cached_grammar_for(spec)

    def start(self, frontend: bytes, msg: P.AddRequest) -> None:
        """Park `msg` (whose sampling.structured is set) until its grammar compiles in a
        thread; requests with the same spec share one compile."""
        spec = msg.sampling.structured
        assert spec is not None, "start() is for structured requests"
        mgr = self.manager()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, "xgrammar-compile")
        key = (spec.kind, spec.spec)
        fut = self.jobs.get(key)
        if fut is None or fut.done():
            fut = self.jobs[key] = self._pool.submit(mgr.compile, spec)
        self.compiling[msg.request_id] = CompilingRequest(fut, frontend, msg)

    def take_done(self) -> list[CompilingRequest]:
        """Remove and return the parked requests whose compile finished (either way), in
        the order they were parked; forget the finished compiles."""
        done = [c for c in self.compiling.values() if c.future.done()]
        for c in done:
            del self.compiling[c.msg.request_id]
        for key, fut in list(self.jobs.items()):
            if fut.done():
                del self.jobs[key]
        return done

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles are abandoned, queued ones cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
