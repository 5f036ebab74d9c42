"""KV tiers end to end (issue 6): `kestrel serve` with the kvstore, real SmolLM2 on the CPU.

The reference for every output is the same prompt's cold run (no cache anywhere); tier
hits are forced by emptying the engine's GPU-local prefix cache (POST /reset_prefix_cache)
and, for the disk tier, by a pool of 14 slots that later prompts overflow.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import tempfile
import time

import httpx
import psutil
import pytest

from shared.kvstore_client import KVStoreClient
from shared.hashing import model_identity_hash
from tests.e2e.server import KestrelServer

BS = 16
BLOCK_BYTES = 737280   # SmolLM2-135M fp32: 2 * 30 layers * 16 * 3 heads * 64 * 4 bytes
MODEL = "SmolLM2-135M-Instruct"


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 20000) for _ in range(n)]


P_EXACT = _prompt(1, 6 * BS)        # ends exactly on a block boundary
P_PLUS1 = _prompt(2, 6 * BS + 1)    # one token past it
FILLERS = [_prompt(10 + i, 8 * BS) for i in range(2)]


class Api:
    def __init__(self, srv: KestrelServer):
        self.srv, self.url = srv, srv.base_url

    def complete(self, ids: list[int], max_tokens: int = 6) -> list[str]:
        r = httpx.post(self.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": ids, "max_tokens": max_tokens,
                             "temperature": 0, "logprobs": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["logprobs"]["tokens"]

    def stats(self) -> dict:
        return httpx.get(self.url + "/internal/stats", timeout=10).json()

    def wait(self, pred, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                s = self.stats()
                if pred(s):
                    return s
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.srv.log_tail()}")

    def settle(self) -> None:
        """Every store of the engine finished (and, when given, the store's disk writes)."""
        self.wait(lambda s: s.get("kv_tier_pending_stores") == 0, "stores to finish")
        c = _store_client(self.srv)
        try:
            deadline = time.monotonic() + 30
            while c.stats()["pending_writes"] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            c.close()

    def reset(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if httpx.post(self.url + "/reset_prefix_cache", timeout=10).status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError("reset_prefix_cache kept refusing")


def _store_client(srv: KestrelServer) -> KVStoreClient:
    ident = model_identity_hash(os.path.abspath(srv.argv[srv.argv.index("--model") + 1]),
                                "float32", "float32", BS, 1)
    c = KVStoreClient(f"ipc:///tmp/kestrel-{srv.instance_id}/kvstore.sock", "test", ident,
                      BLOCK_BYTES, timeout_s=10)
    c.connect()
    return c


def _proc(srv: KestrelServer, title: str) -> psutil.Process:
    for p in srv.children():
        try:
            if title in " ".join(p.cmdline()) or p.name() == title:
                return p
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no {title} process")


@pytest.fixture(scope="module")
def api(smollm2_dir):
    disk = tempfile.mkdtemp(prefix="kvt-disk-")
    srv = KestrelServer(str(smollm2_dir), "--kv-offload-cpu-gib", "0.0099",   # 14 slots
                        "--kv-offload-disk-dir", disk, "--kv-offload-disk-gib", "0.05",
                        "--max-model-len", "1024").start()
    a = Api(srv)
    a.wait(lambda s: s.get("kv_tier_connected"), "the kvstore connection")
    yield a
    srv.stop()


@pytest.fixture(scope="module")
def cold(api):
    """Cold outputs of the prompts (the first run of each: nothing cached anywhere)."""
    return {}


def test_gpu_cpu_and_disk_tier_hits_equal_the_cold_run(api, cold):
    for name, p in (("exact", P_EXACT), ("plus1", P_PLUS1)):
        s0 = api.stats()
        cold[name] = api.complete(p)
        s1 = api.stats()
        assert s1["kv_tier_hits_cpu"] + s1["kv_tier_hits_disk"] == s0["kv_tier_hits_cpu"] + s0["kv_tier_hits_disk"]
        assert api.complete(p) == cold[name]                     # GPU-local hit
        s2 = api.stats()
        assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] == (len(p) - 1) // BS * BS
        api.settle()
        api.reset()
        assert api.complete(p) == cold[name]                     # CPU-tier hit
        s3 = api.stats()
        assert s3["kv_tier_hits_cpu"] - s2["kv_tier_hits_cpu"] == (len(p) - 1) // BS * BS
    for f in FILLERS:                     # 16 blocks through a 14-slot pool: both to disk
        api.complete(f, max_tokens=1)
        api.settle()
    for name, p in (("exact", P_EXACT), ("plus1", P_PLUS1)):
        api.reset()
        s0 = api.stats()
        assert api.complete(p) == cold[name]                     # disk-tier hit
        s1 = api.stats()
        assert s1["kv_tier_hits_disk"] - s0["kv_tier_hits_disk"] > 0
        api.settle()
    m = httpx.get(api.url + "/metrics", timeout=10).text
    assert f'kestrel:kv_tier_hits_total{{model_name="{MODEL}",tier="disk"}}' in m


def test_engine_restart_keeps_the_tiers_warm(api, cold):
    assert cold, "runs after the tier-hit test"
    api.settle()
    old = _proc(api.srv, "kestrel:engine")
    old.send_signal(signal.SIGKILL)
    api.wait(lambda s: s.get("kv_tier_connected") and s.get("num_steps", 1) == 0
             and s.get("kv_tier_hits_cpu", 1) == 0, "a new engine with the kvstore", 120)
    assert api.complete(P_PLUS1) == cold["plus1"]
    s = api.stats()
    assert s["kv_tier_hits_cpu"] + s["kv_tier_hits_disk"] == 6 * BS


def test_requests_complete_through_a_kvstore_kill_and_hits_resume(api, cold):
    assert cold, "runs after the tier-hit test"
    store = _proc(api.srv, "kestrel:kvstore")
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(api.complete, p) for p in (P_EXACT, P_PLUS1, P_EXACT, P_PLUS1)]
        api.reset()
        time.sleep(0.2)   # let some requests reach the store before it dies
        store.send_signal(signal.SIGKILL)
        outs = [f.result(timeout=120) for f in futs]
    assert outs == [cold["exact"], cold["plus1"], cold["exact"], cold["plus1"]]
    s = api.wait(lambda s: s.get("kv_tier_connects", 0) >= 2 and s.get("kv_tier_connected"),
                 "the restarted kvstore", 60)
    p = _prompt(99, 5 * BS + 3)
    ref = api.complete(p)
    api.settle()
    api.reset()
    assert api.complete(p) == ref
    assert api.stats()["kv_tier_hits_cpu"] - s["kv_tier_hits_cpu"] == 5 * BS


def test_concurrent_shared_prefix_with_preemption_equals_sequential(smollm2_dir):
    shared = _prompt(50, 5 * BS)
    prompts = [shared + _prompt(60 + i, 7 + i) for i in range(8)]
    # 21 KV blocks; 8 requests of ~130 tokens need 5 shared + 8 x 3..4 own blocks: some are preempted
    srv = KestrelServer(str(smollm2_dir), "--kv-offload-cpu-gib", "0.05", "--kv-cache-gib", "0.015",
                        "--max-model-len", "256").start()
    try:
        a = Api(srv)
        a.wait(lambda s: s.get("kv_tier_connected"), "the kvstore connection")
        seq = [a.complete(p, max_tokens=40) for p in prompts]
        a.settle()
        a.reset()
        with cf.ThreadPoolExecutor(8) as ex:
            conc = list(ex.map(lambda p: a.complete(p, max_tokens=40), prompts))
        assert conc == seq
        s = a.stats()
        assert s["kv_tier_hits_cpu"] > 0 and s["num_preemptions"] > 0
    finally:
        srv.stop()


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_kv_tier_hits_equal_the_cold_run(smollm2_dir, kv):
    # int8 blocks move with their per-token scales (services/worker/kv_transfer.py); fp8's
    # per-layer scales are the model's. Block bytes: 1 byte an element (+ 4 per token and
    # head for int8's two scales), the identity names the KV dtype.
    srv = KestrelServer(str(smollm2_dir), "--kv-cache-dtype", kv, "--kv-offload-cpu-gib", "0.01",
                        "--max-model-len", "1024").start()
    try:
        a = Api(srv)
        a.wait(lambda s: s.get("kv_tier_connected"), "the kvstore connection")
        for p in (P_EXACT, P_PLUS1):
            cold = a.complete(p, max_tokens=8)
            assert a.complete(p, max_tokens=8) == cold                  # GPU-local hit
            a.wait(lambda s: s.get("kv_tier_pending_stores") == 0, "stores to finish")  # no disk tier
            a.reset()
            s0 = a.stats()
            assert a.complete(p, max_tokens=8) == cold                  # CPU-tier hit
            s1 = a.stats()
            assert s1["kv_tier_hits_cpu"] - s0["kv_tier_hits_cpu"] == (len(p) - 1) // BS * BS
    finally:
        srv.stop()
