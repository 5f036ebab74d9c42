"""The load generator of the HTTP benchmarks (benchmarks/serve_bench.py, spec_serve.py):
streamed completions at a fixed concurrency, from client processes.

A level keeps `concurrency` requests in flight, split over client processes (asyncio +
httpx each, so that parsing the streams never limits the server), all starting at one
instant. The pool is spawned and warmed (`start_pool`) before any level is timed. A prompt
is a list of token ids (sent as `"prompt"`, for /v1/completions) or a dict of request
fields (e.g. `{"messages": [...]}` for /v1/chat/completions) merged into the body. Each
request's record (benchmarks/serve_stats.py `RequestRecord`) holds the arrival of every
content chunk (completion `text` or chat `delta.content`), the stream's
usage.completion_tokens and the error, if any: an HTTP error, an error event, a stream
without usage, or a token count other than max_tokens (callers send ignore_eos).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor

import httpx

from benchmarks.serve_stats import RequestRecord

try:
    from orjson import loads
except ImportError:  # the stdlib parser is fine, only slower
    from json import loads


def _content(choice: dict) -> str | None:
    """The text a streamed choice carries: completion `text` or chat `delta.content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content")


async def stream_request(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord) -> None:
    """Send one streamed request; fill rec (chunk arrival times, usage, error, end)."""
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return
            async for line in r.aiter_lines():
                now = time.monotonic()
                if not line.startswith("data: "):
                    continue  # blank separators, keep-alive comments
                if line == "data: [DONE]":
                    break
                ev = loads(line[6:])
                if "error" in ev:
                    rec.error = f"error event: {ev['error'].get('message')}"
                    return
                if ev.get("usage") and not ev.get("choices"):
                    rec.output_tokens = ev["usage"]["completion_tokens"]
                if any(_content(c) for c in ev.get("choices") or ()):
                    rec.chunks.append(now)
    except Exception as e:  # connection refused/reset, timeout, bad JSON: this request failed
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = time.monotonic()
    want = body["max_tokens"]
    if rec.output_tokens is None:
        rec.error = "stream had no usage chunk"
    elif rec.output_tokens != want or not rec.chunks:
        rec.error = f"{rec.output_tokens} output tokens in {len(rec.chunks)} chunks, asked {want}"


def request_fields(prompt: list[int] | dict) -> dict:
    """The body fields of one prompt: a dict as it is, token ids as {"prompt": ids}."""
    return prompt if isinstance(prompt, dict) else {"prompt": prompt}


def client_worker(url: str, body: dict, prompts: list, concurrency: int,
                  start_at: float, timeout: float) -> list[RequestRecord]:
    """Stream one request per prompt (body + `request_fields(prompt)`) to url, keeping
    `concurrency` in flight, starting at monotonic time start_at (seconds). Runs in a
    client process. Returns one record per prompt, in prompt order."""

    async def run() -> list[RequestRecord]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0),
                                     trust_env=False) as client:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            records: list[RequestRecord | None] = [None] * len(prompts)
            todo = iter(range(len(prompts)))

            async def loop() -> None:
                for i in todo:  # one shared iterator: each index is taken once
                    rec = records[i] = RequestRecord(sent=time.monotonic())
                    await stream_request(client, url, {**body, **request_fields(prompts[i])}, rec)

            await asyncio.gather(*(loop() for _ in range(concurrency)))
            return records  # type: ignore[return-value]

    return asyncio.run(run())


def _ready() -> float:
    """A no-op task: makes the pool start its processes before any level is timed."""
    time.sleep(0.2)
    return time.monotonic()


def default_client_procs(top_concurrency: int) -> int:
    """Client processes for a run whose highest concurrency is top_concurrency: one per 32
    streams, at most a quarter of the cores, at least one."""
    return max(1, min(-(-top_concurrency // 32), (os.cpu_count() or 1) // 4))


def start_pool(procs: int) -> ProcessPoolExecutor:
    """A pool of `procs` spawned client processes, all started (each ran a no-op task)."""
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    for f in [pool.submit(_ready) for _ in range(procs)]:
        f.result()
    return pool


def run_level(pool: ProcessPoolExecutor, procs: int, url: str, body: dict,
              prompts: list, concurrency: int, timeout: float) -> list[RequestRecord]:
    """Run one level: `concurrency` streams split over min(procs, concurrency) client
    processes, prompts split in proportion to each process's streams. Returns the records,
    in prompt order."""
    p = min(procs, concurrency)
    streams = [concurrency // p + (i < concurrency % p) for i in range(p)]
    counts = [len(prompts) * s // concurrency for s in streams]
    for i in range(len(prompts) - sum(counts)):
        counts[i] += 1
    start_at = time.monotonic() + 0.2  # every process starts sending at the same instant
    futures, k = [], 0
    for s, n in zip(streams, counts):
        futures.append(pool.submit(client_worker, url, body, prompts[k:k + n], s, start_at, timeout))
        k += n
    return [r for f in futures for r in f.result()]


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids in [0, 10000], from random.Random(seed)."""
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in range(length)] for _ in range(n)]
