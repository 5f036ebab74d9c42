"""TTFT of one long prompt: cold, GPU-local prefix hit, kvstore CPU-tier hit, disk-tier hit.

Starts `kestrel serve` (a subprocess, as a user would) with the kvstore on, sends the same
prompt of `--tokens` token ids (max_tokens 1, greedy; TTFT = the request's wall time, which
with one output token is the time to the first token plus one HTTP round trip):
1. cold: nothing cached anywhere;
2. gpu: again (the engine's own prefix cache);
3. cpu: after POST /reset_prefix_cache (the engine's cache is empty; the kvstore's pool
   holds the prompt's blocks);
4. disk: after two filler prompts of the same length pushed the prompt's blocks out of the
   pool (sized to ~1.1 prompts) into the disk tier, and another reset.
Before 3 and 4 it waits until the engine's stores and the store's disk writes are done.
Prints one JSON object (seconds, plus the tier hit counters) and writes it to --out.

    python benchmarks/prefix_ttft.py --tokens 8192 [--model DIR] [--out FILE]
    python benchmarks/prefix_ttft.py --tokens 32768 --config qwen3-0.6b   # GPU, dummy bf16

With --config, the model is a config of benchmarks/configs with dummy weights (and a
synthetic tokenizer, `benchmarks.common.model_dir`) on CUDA in bf16; the server runs as
`python -m services.cli serve` (`benchmarks/serve_process.py`), so no console script is
needed on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit_json, model_dir  # noqa: E402
from benchmarks.serve_process import ServeProcess  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.kv_layout import kv_layout_for  # noqa: E402
from shared.model_spec import model_spec_for  # noqa: E402
from shared.state_layout import state_layout_for  # noqa: E402
from shared.kvstore_client import KVStoreClient  # noqa: E402

BS = 16
STATE_FRACTION = 0.5  # the server's default --kv-offload-state-fraction


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--config", default=None, help="a benchmarks/configs name: dummy bf16 weights on CUDA")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.config:
        a.model = model_dir(a.config, tokenizer=True)
        dtype, extra = "bfloat16", ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
                                    "--max-num-batched-tokens", "8192"]
    else:
        dtype, extra = "float32", []
    # the block size and model identity the server's kvstore derives from the same settings
    cfg = build_config(cli={"model": a.model, "dtype": dtype, "block_size": BS}, env={})
    layout = kv_layout_for(cfg)
    block_bytes, ident = layout.slot_bytes, layout.model_identity
    state = state_layout_for(cfg)  # a hybrid's state checkpoints (None: a dense model)
    n_blocks = a.tokens // BS + 1
    pool_gib = round(n_blocks * 1.1 * (block_bytes + 64) / (1 << 30) + 0.001, 4)
    if state is not None:  # --kv-offload-state-fraction (0.5 by default) of the pool holds checkpoints
        pool_gib = round(pool_gib / (1 - STATE_FRACTION) + 0.001, 4)
    disk = tempfile.mkdtemp(prefix="kestrel-bench-disk-")
    instance = "b" + os.urandom(4).hex()
    srv = ServeProcess(["--model", a.model, "--instance-id", instance, *extra,
                        "--kv-offload-cpu-gib", str(pool_gib), "--kv-offload-disk-dir", disk,
                        "--kv-offload-disk-gib", str(round(pool_gib * 4, 3)),
                        "--max-model-len", str(a.tokens + 64)])
    try:
        srv.start(timeout=600)
    except (RuntimeError, TimeoutError):
        print(srv.log_tail(), file=sys.stderr)
        srv.stop(5)
        raise
    url = srv.base_url
    model = srv.model_name()

    def stats() -> dict:
        return httpx.get(url + "/internal/stats", timeout=30).json()

    def ttft(ids: list[int]) -> float:
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=1800, json={
            "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t

    def store_stats() -> dict:
        c = KVStoreClient(f"ipc:///tmp/kestrel-{instance}/kvstore.sock", "bench", ident,
                          block_bytes, timeout_s=30,
                          state_identity=state.state_identity if state is not None else b"",
                          state_bytes=state.state_bytes if state is not None else 0)
        c.connect()
        try:
            return c.stats()
        finally:
            c.close()

    def settle() -> None:
        while stats().get("kv_tier_pending_stores"):
            time.sleep(0.05)
        while store_stats()["pending_writes"]:
            time.sleep(0.05)

    def reset() -> None:
        while httpx.post(url + "/reset_prefix_cache", timeout=30).status_code != 200:
            time.sleep(0.05)

    try:
        while not stats().get("kv_tier_connected"):
            time.sleep(0.1)
        rnd = random.Random(0)
        vocab = model_spec_for(cfg).vocab_size  # ids 1000..20000, or within a small test vocabulary
        LO, HI = min(1000, vocab // 10), min(20000, vocab)
        prompt = [rnd.randrange(LO, HI) for _ in range(a.tokens)]
        out = {"tokens": a.tokens, "pool_gib": pool_gib, "block_bytes": block_bytes,
               "state_checkpoint_bytes": state.state_bytes if state is not None else 0,
               "device": "cuda" if a.config else "cpu", "config": a.config or a.model}
        out["cold_s"] = ttft(prompt)
        out["gpu_hit_s"] = ttft(prompt)
        settle()
        reset()
        out["cpu_tier_hit_s"] = ttft(prompt)
        out["cold_again_s"] = []  # the two prompts that push the first out of the pool: cold, warm kernels
        for i in range(2):
            out["cold_again_s"].append(ttft([rnd.randrange(LO, HI) for _ in range(a.tokens)]))
            settle()
        reset()
        out["disk_tier_hit_s"] = ttft(prompt)
        s = stats()
        out.update({k: s[k] for k in ("kv_tier_hits_cpu", "kv_tier_hits_disk", "prefix_cache_hits")})
        # where a disk hit's time goes: promotions (disk -> pool) and their summed read time
        ks = store_stats()
        out["kvstore"] = {k: ks.get(k, 0) for k in ("promotions", "disk_read_us", "promotion_wait_ms",
                                                 "demotions", "demotions_skipped", "cpu_evictions",
                                                 "store_no_slot")}
    finally:
        srv.stop(10)
    emit_json(out, a.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
