"""Sweep the MoE decode path's launch choices on this GPU (issue 16: batch-1 TPOT of the MoE
shapes against their roofline; docs/ARCHITECTURE.md §6.4).

`kernels.moe_decode_triton.fused_moe_decode` (router + align, gate_up grouped GEMM, down with
the sum over k) for one expert shape of benchmarks/configs (default Qwen3.5-35B-A3B; its
`text_config` when nested), bf16, random weights and router logits, at --tokens (default 1 2
4 8). Two stages per token count, each timed on the whole three-launch call replayed in a
CUDA graph of 10 calls (`benchmarks.moe_kernel._time_graph`, median of --reps):
1. gate_up: every config of `benchmarks.moe_tune.GRID` with BLOCK_M 16 (the decode path
   pads each expert's few rows to BLOCK_M; larger BLOCK_M only reads more padding), the down
   plan at its default (`down_plan`);
2. down: with stage 1's best gate_up config, every (BLOCK_N, BLOCK_K, num_warps) of
   BLOCK_N 2..16, BLOCK_K 128..min(1024, next_pow2(I)), num_warps 2..8;
3. the two-launch path (`moe_decode_triton.GATE_UP` "gemv": `moe_gate_up_gemv` then
   `moe_down_routed_triton`): gate_up plans of BLOCK_N 1..16 x num_warps 2..8 (one K tile up to
   2,048) with the default down plan, then down plans of BLOCK_N 1..8 x num_warps 2..8 with the
   best of those (`--stages gemv`: this stage only, beside the default three-launch call).
A choice whose output differs from `kernels.moe.fused_moe_ref` by more than 2e-2 (relative
norm) is dropped. Reported per token count: the defaults' time, the best of each stage, and
the bytes the call must read (k distinct experts' w13 and w2 rows at T = 1: an upper bound on
bandwidth use, T * k experts at most) over the time, in TB/s. JSON to --out and stdout;
nothing is written into kernels/ (the lead puts measured choices into
kernels/moe_configs/ and `moe_decode_triton.DOWN_TUNING` by hand, with the figures).

Usage: python benchmarks/moe_decode_sweep.py [--config qwen3.5-35b-a3b] [--tokens 1 2 4 8] [--reps 20]
       [--budget-s S] [--stages all|gemv] [--out FILE]
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
import triton  # noqa: E402

from benchmarks.common import device_name, emit_json  # noqa: E402
from benchmarks.moe_kernel import _time_graph  # noqa: E402
from benchmarks.moe_tune import GRID  # noqa: E402
from kernels import moe  # noqa: E402
from kernels import moe_decode_triton as mdt  # noqa: E402
from kernels import moe_triton as mt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def sweep_tokens(t: int, w13, w2, e: int, k: int, h: int, reps: int, gen, stages: str = "all") -> dict:
    """The stages (module doc) for t tokens; returns the row of the JSON. stages "gemv": only
    stage 3 (and the default three-launch call as its baseline)."""
    i = w2.shape[2]
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(t, e, device="cuda", generator=gen)
    ref = moe.fused_moe_ref(x, w13, w2, *moe.topk_softmax_ref(logits, k, True)).float()

    def timed(cfg=None, down=None, gate_up=None) -> float | None:
        def call():
            if gate_up is not None:  # stage 3: the two launches of GATE_UP "gemv"
                act = mdt.moe_gate_up_gemv(x, logits, w13, k, True, plan=gate_up)
                return mdt.moe_down_routed_triton(act, w2, logits, k, True, down)
            return mdt.fused_moe_decode(x, logits, w13, w2, k, True, config=cfg, down=down)
        try:
            if _rel(call(), ref) > 2e-2:
                return None
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a choice that does not compile or fit is skipped
            return None
        return _time_graph(call, reps)

    default_cfg = mt.pick_config(t, e, k, w13.shape[1], h, 2)
    default_down = mdt.down_plan(t, h, i, x.device)
    default_s = timed()
    best_cfg, best_cfg_s = default_cfg, default_s if default_s is not None else float("inf")
    for cfg in (c for c in GRID if c["BLOCK_M"] == 16 and stages == "all"):
        s = timed(cfg=cfg)
        if s is not None and s < best_cfg_s:
            best_cfg, best_cfg_s = cfg, s
    best_down, best_down_s = default_down, best_cfg_s
    bks = [b for b in (128, 256, 512, 1024) if b <= triton.next_power_of_2(i)]
    for bn, bk, warps in itertools.product((2, 4, 8, 16), bks, (2, 4, 8)) if stages == "all" else ():
        s = timed(cfg=best_cfg, down=(bn, bk, warps))
        if s is not None and s < best_down_s:
            best_down, best_down_s = (bn, bk, warps), s
    # stage 3: the two-launch path, gate_up plans (BLOCK_N 1..16, one K tile up to 2,048, warps)
    # with the down kernel at down_plan's, then that down kernel's plans with the best gate_up
    gu_default = mdt.gate_up_plan(t, k, i, h, x.device)
    gemv_default_s = timed(gate_up=gu_default, down=default_down)
    best_gu, best_gu_s = gu_default, gemv_default_s if gemv_default_s is not None else float("inf")
    bk_gu = min(triton.next_power_of_2(h), 2048)
    for bn, warps in itertools.product((1, 2, 4, 8, 16), (2, 4, 8)):
        s = timed(gate_up=(bn, bk_gu, warps), down=default_down)
        if s is not None and s < best_gu_s:
            best_gu, best_gu_s = (bn, bk_gu, warps), s
    best_gdown, best_gdown_s = default_down, best_gu_s
    for bn, warps in itertools.product((1, 2, 4, 8), (2, 4, 8)):
        plan = (bn, min(triton.next_power_of_2(i), 2048), warps)
        s = timed(gate_up=best_gu, down=plan)
        if s is not None and s < best_gdown_s:
            best_gdown, best_gdown_s = plan, s
    experts = min(t * k, e)
    nbytes = experts * (w13.shape[1] * h + h * i) * 2
    us = lambda s: None if s is None else round(s * 1e6, 2)  # noqa: E731
    tbps = lambda s: None if not s else round(nbytes / s / 1e12, 3)  # noqa: E731
    return {"tokens": t, "default_us": us(default_s), "default_config": default_cfg,
            "default_down": list(default_down), "best_gate_up_us": us(best_cfg_s), "best_config": best_cfg,
            "best_us": us(best_down_s), "best_down": list(best_down), "bytes_upper": nbytes,
            "default_TBps": tbps(default_s), "best_TBps": tbps(best_down_s),
            "gemv_default_us": us(gemv_default_s), "gemv_default_gate_up": list(gu_default),
            "gemv_best_gate_up_us": us(best_gu_s), "gemv_best_gate_up": list(best_gu),
            "gemv_best_us": us(best_gdown_s), "gemv_best_down": list(best_gdown), "gemv_best_TBps": tbps(best_gdown_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3.5-35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=None, help="stop before a token count past this")
    ap.add_argument("--stages", choices=["all", "gemv"], default="all",
                    help="gemv: only stage 3 (the two-launch path of GATE_UP 'gemv'), against the default call")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with open(os.path.join(ROOT, "benchmarks", "configs", a.config + ".json")) as fh:
        cfg = json.load(fh)
    cfg = cfg.get("text_config", cfg)
    e, k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    h, i = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    res = {"benchmark": "moe_decode_sweep", "device": device_name(), "config": a.config, "experts": e,
           "top_k": k, "hidden": h, "intermediate": i, "torch": torch.__version__, "rows": [], "complete": False}
    t0 = time.monotonic()
    for t in a.tokens:
        if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
            print(f"budget of {a.budget_s} s spent: stopping before T={t}", flush=True)
            break
        row = sweep_tokens(t, w13, w2, e, k, h, a.reps, gen, a.stages)
        res["rows"].append(row)
        print(f"T={t}: default {row['default_us']} us ({row['default_TBps']} TB/s), gate_up best "
              f"{row['best_gate_up_us']} {row['best_config']}, +down best {row['best_us']} us "
              f"{row['best_down']} ({row['best_TBps']} TB/s); two launches: default {row['gemv_default_us']} us "
              f"{row['gemv_default_gate_up']}, best {row['gemv_best_us']} us gate_up {row['gemv_best_gate_up']} "
              f"down {row['gemv_best_down']} ({row['gemv_best_TBps']} TB/s)", flush=True)
    res["complete"] = len(res["rows"]) == len(a.tokens)
    emit_json(res, a.out)


if __name__ == "__main__":
    main()
