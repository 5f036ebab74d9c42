"""Tune the fused MoE kernel's launch configs for one expert shape on this GPU and write them
where `kernels/moe_triton.py` reads them (kernels/moe_configs/, issue 16: "tuned launch
configs per shape kept in the repo with the script that tunes them").

Shape: a config of benchmarks/configs (default Qwen3-30B-A3B: E experts, k a token, w13 per
expert [2I, H]), bf16, random weights, random softmax top-k routing. For each token count of
--tokens (default kernels.moe_triton.M_BUCKETS up to 4096): every config of the grid below
that compiles is timed on the whole `fused_moe` call (both launches share BLOCK_M), replayed
in a CUDA graph of 10 calls, median of --reps; a config whose output differs from
`fused_moe_ref` by more than 2e-2 relative is dropped; the fastest is kept, with the
default's time beside it. Writes kernels/moe_configs/<device>_E<E>_N<2I>_K<H>_bf16.json (or
--out) and prints a table. The grid: BLOCK_M 16/32/64, BLOCK_N 32/64/128, BLOCK_K 64/128,
GROUP_M 1/8, num_warps 4/8, num_stages 3/4 (144 configs; those whose tiles need more shared
memory than the device has fail to compile and are skipped).

Usage: python benchmarks/moe_tune.py [--config qwen3-30b-a3b] [--tokens 1 16 256] [--reps 20] [--out FILE]
       [--budget-s S]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name  # noqa: E402
from benchmarks.moe_kernel import _time_graph  # noqa: E402
from kernels import moe  # noqa: E402
from kernels import moe_triton as mt  # noqa: E402
from services.worker.layers.moe import topk_softmax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=kk, GROUP_M=g, num_warps=w, num_stages=st)
        for m, n, kk, g, w, st in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (1, 8), (4, 8), (3, 4))]


def tune_one(x, w13, w2, weights, ids, reps: int) -> tuple[dict | None, float, float]:
    """(best config, its seconds, the default's seconds) for one token count."""
    t, n, kdim = x.shape[0], w13.shape[1], w13.shape[2]
    key = (mt.m_bucket(t), n, kdim)
    ref = moe.fused_moe_ref(x, w13, w2, weights, ids).float()
    mt.TUNED_CONFIGS.pop(key, None)
    default_s = _time_graph(lambda: moe.fused_moe(x, w13, w2, weights, ids), reps)
    best, best_s = None, float("inf")
    for cfg in GRID:
        mt.TUNED_CONFIGS[key] = cfg
        try:
            out = moe.fused_moe(x, w13, w2, weights, ids).float()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a config that does not compile or fit is skipped
            continue
        if float((out - ref).norm() / ref.norm().clamp_min(1e-30)) > 2e-2:
            continue
        s = _time_graph(lambda: moe.fused_moe(x, w13, w2, weights, ids), reps)
        if s < best_s:
            best, best_s = cfg, s
    mt.TUNED_CONFIGS.pop(key, None)
    return best, best_s, default_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(mt.M_BUCKETS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop before a token count once this many seconds have passed (the file keeps "
                         "the buckets tuned so far; the others take the default)")
    a = ap.parse_args()
    with open(os.path.join(ROOT, "benchmarks", "configs", a.config + ".json")) as fh:
        cfg = json.load(fh)
    e, k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    h, i = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    dev = device_name()
    configs, timings = {}, {}
    out = a.out or os.path.join(mt.CONFIG_DIR, f"{dev.replace(' ', '_')}_E{e}_N{2 * i}_K{h}_bf16.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    t0 = time.monotonic()
    for t in a.tokens:
        if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
            print(f"budget of {a.budget_s} s spent: stopping before T={t}", flush=True)
            break
        x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = topk_softmax(torch.randn(t, e, device="cuda", generator=gen), k, True)
        best, best_s, default_s = tune_one(x, w13, w2, weights, ids, a.reps)
        bucket = str(mt.m_bucket(t))
        if best is not None and best_s < default_s:
            configs[bucket] = best
        timings[bucket] = {"tuned": round(best_s * 1e6, 2), "default": round(default_s * 1e6, 2)}
        print(f"T={t:5d}: default {default_s * 1e6:9.2f} us, best {best_s * 1e6:9.2f} us {best}", flush=True)
        with open(out, "w") as fh:  # after every bucket, so a timeout keeps what was tuned
            json.dump({"N": 2 * i, "K": h, "device": dev, "dtype": "bfloat16", "config": a.config,
                       "configs": configs, "timings_us": timings}, fh, indent=2)
            fh.write("\n")
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
