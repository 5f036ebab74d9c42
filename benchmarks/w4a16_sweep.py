"""W4A16 decode products (kernels/w4a16_gemv.py) against the bf16 ones on one GPU, by launch
config, for choosing the kernels' defaults (issue 17: Llama-3.1-8B batch-1 TPOT with awq
weights <= 0.4x bf16).

For each projection shape of Llama-3.1-8B (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 ->
28672, down 14336 -> 4096) at M = 1, 4, 16 rows (--ms: a subset, e.g. 1 for batch-1 decode): L distinct weights (each set larger than
the H200's 60 MB L2, so they stream from HBM as in decode), launched back to back in one CUDA
graph; time per launch = median replay time / L (`kernel_sweep.graph_time`) of
- bf16: `kernels.linear.linear` (the model's dispatcher: `kernels.gemv` at one row, the
  skinny kernel or cuBLAS beyond), the baseline of the same run;
- W4A16: `w4a16_gemv.w4_gemv_triton` with each launch variant (a config of
  `w4a16_gemv.CONFIG_KEYS`: tiles, warps, pipeline stages, K split, split sum and its loads
  at a time, PDL, the dot kernel's dequantization), the
  heuristic default ("default") first; random packed weights, group 128
  (`W4Weight.random`, as the decode benchmark's dummy awq weights).
Per row: us, GB/s (the bytes a launch must read: packed values, scales and zeros for W4A16,
the bf16 weight for bf16; over time), w4 / bf16, and each variant's relative error against
`w4a16_linear_ref` on one weight (a variant over 1e-2, or one that fails, is reported and
not picked). The best variant per (shape, M) goes to "plans" ({"M,N,K": config}, for
`decode_latency.py --w4-plans` and kernels.w4a16_gemv.PLANS), and "layer_us" sums one
decoder layer's four products at each M (bf16, W4A16 default, W4A16 best). Stops adding
variants when --budget-s is spent (the JSON says which were skipped).

Usage: python benchmarks/w4a16_sweep.py [--out FILE] [--quick] [--budget-s 100] [--ms 1,4,16]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import device_name, emit_json  # noqa: E402
from benchmarks.decode_latency import copy_bandwidth  # noqa: E402
from benchmarks.kernel_sweep import SHAPES, graph_time  # noqa: E402
from kernels import linear, w4a16_gemv  # noqa: E402
from kernels.w4a16_linear import W4Weight, w4a16_linear_ref  # noqa: E402

DT = torch.bfloat16
DEV = torch.device("cuda")
G = 128
MS = (1, 4, 16)
NAMES = ("qkv", "o", "gate_up", "down")
SET_BYTES = 160 << 20  # each weight set at least this large (2.5x the L2)
# one-row kernel: (block_n, block_k, num_warps, num_stages); the first is GEMV1_DEFAULTS'
GEMV1_TILES = [(128, 64, 1, 3), (128, 128, 1, 3), (256, 64, 1, 3), (256, 32, 1, 3), (64, 128, 1, 3),
               (128, 64, 1, 1), (512, 64, 4, 3), (256, 128, 2, 2), (128, 128, 1, 1), (64, 64, 1, 3)]
# dot kernel (2..16 rows); the first is DOT_DEFAULTS'
DOT_TILES = [(128, 128, 4, 2), (128, 64, 4, 1), (64, 128, 4, 2), (256, 64, 8, 2), (64, 64, 2, 2),
             (128, 128, 8, 3)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def per_launch_us(fn, items: list) -> float:
    """Microseconds a call of fn(item), over items launched back to back in one CUDA graph."""
    return graph_time(lambda: [fn(it) for it in items]) * 1e6 / len(items)


def variants(m: int, n: int, k: int, quick: bool) -> list[tuple[str, dict]]:
    """(name, config) launch variants of w4_gemv_triton for x [m, k], W [n, k]: the default
    first, then each tile config at the heuristic's split, half and twice it; for the
    default tiles also the second-kernel split sum, no PDL, 8 and 32 partials summed at a time
    (sum_chunk) and (2+ rows) the dot kernel's fp32 dequantization instead of the 16-bit
    magic numbers."""
    out: list[tuple[str, dict]] = [("default", {})]
    tiles = GEMV1_TILES if m == 1 else DOT_TILES
    for i, (bn, bk, nw, ns) in enumerate(tiles[:2] if quick else tiles):
        base = {"block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": ns}
        auto = w4a16_gemv.gemv_plan(m, n, k, G, DEV, base)["split"]
        splits = sorted({max(1, auto // 2), auto, min(auto * 2, k // bk)})
        for sp in splits:
            out.append((f"bn{bn}_bk{bk}_w{nw}_s{ns}_sp{sp}", {**base, "split": sp}))
        tag = f"bn{bn}_bk{bk}_w{nw}_s{ns}_sp{auto}"
        if i == 0 and auto > 1:
            out.append((f"{tag}_sumkernel", {**base, "split": auto, "split_sum": "kernel"}))
            out.append((f"{tag}_nopdl", {**base, "split": auto, "pdl": False}))
            for chunk in (8, 32):  # the summing program's partials loaded at a time (default 16 / 8)
                out.append((f"{tag}_chunk{chunk}", {**base, "split": auto, "sum_chunk": chunk}))
        if i == 0 and m > 1:
            out.append((f"{tag}_fp32dequant", {**base, "split": auto, "magic16": False}))
    return out


def sweep_shape(name: str, n: int, k: int, quick: bool, deadline: float, ms: tuple[int, ...] = MS) -> dict:
    w4_bytes = n * k // 2 + (k // G) * n * 3  # packed values, fp16 scales, uint8 zeros
    bf_bytes = n * k * 2
    layers = max(2, math.ceil(SET_BYTES / w4_bytes))
    gen = torch.Generator(device=DEV).manual_seed(0)
    w4s = [W4Weight.random(n, k, G, DEV, generator=gen) for _ in range(layers)]
    bfs = [torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5
           for _ in range(min(layers, max(2, math.ceil(SET_BYTES / bf_bytes))))]
    res: dict = {"n": n, "k": k, "w4_layers": layers, "bf16_layers": len(bfs), "w4_bytes": w4_bytes,
                 "bf16_bytes": bf_bytes}
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=DT)
        want = w4a16_linear_ref(x, w4s[0]).float()
        bf_us = per_launch_us(lambda w, x=x: linear.linear(x, w), bfs)
        row: dict = {"bf16_us": round(bf_us, 2), "bf16_GBps": round(bf_bytes / bf_us / 1e3, 1), "variants": {},
                     "default_config": {kk: v for kk, v in w4a16_gemv.gemv_plan(m, n, k, G, x.device).items()
                                        if kk in w4a16_gemv.CONFIG_KEYS + ("kernel",)}}
        for vname, cfg in variants(m, n, k, quick):
            if time.monotonic() > deadline:
                row["variants"][vname] = "skipped: --budget-s spent"
                continue
            try:
                err = rel(w4a16_gemv.w4_gemv_triton(x, w4s[0].qweight, w4s[0].zeros, w4s[0].scales, G,
                                                     config=cfg).float(), want)
                us = per_launch_us(lambda w, x=x, cfg=cfg: w4a16_gemv.w4_gemv_triton(x, w.qweight, w.zeros, w.scales,
                                                                                       G, config=cfg), w4s)
                row["variants"][vname] = {"us": round(us, 2), "GBps": round(w4_bytes / us / 1e3, 1),
                                          "w4_over_bf16": round(us / bf_us, 3), "rel_err": float(f"{err:.3g}"),
                                          "config": cfg}
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                row["variants"][vname] = f"error: {type(e).__name__}: {str(e)[:160]}"
        ok = {v: r for v, r in row["variants"].items() if isinstance(r, dict) and r["rel_err"] < 1e-2}
        if ok:
            best = min(ok, key=lambda v: ok[v]["us"])
            row.update(best=best, best_us=ok[best]["us"], best_GBps=ok[best]["GBps"],
                       best_w4_over_bf16=ok[best]["w4_over_bf16"], best_config=ok[best]["config"])
            d = ok.get("default")
            if d:
                row.update(default_us=d["us"], default_w4_over_bf16=d["w4_over_bf16"])
        res[f"m{m}"] = row
        print(name, n, k, "m", m, "bf16", row["bf16_us"], "default", row.get("default_us"), "best", row.get("best"),
              row.get("best_us"), "x", row.get("best_w4_over_bf16"), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="two tile configs per kernel")
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop adding variants after this many seconds")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows to sweep, comma-separated (1: decode batch 1)")
    a = ap.parse_args()
    ms = tuple(int(v) for v in a.ms.split(","))
    t0 = time.monotonic()
    deadline = t0 + a.budget_s
    _, mats, _ = SHAPES["llama-3.1-8b"]
    res: dict = {"benchmark": "w4a16_sweep", "device": device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "config": "llama-3.1-8b", "group_size": G,
                 "copy_bandwidth_TBps": round(copy_bandwidth() / 1e12, 3), "shapes": {}}
    for name, (n, k) in zip(NAMES, mats):
        res["shapes"][name] = sweep_shape(name, n, k, a.quick, deadline, ms)
        torch.cuda.empty_cache()  # the shape's weights are gone
    plans, layer = {}, {}
    for m in ms:
        rows = [res["shapes"][nm][f"m{m}"] for nm in NAMES]
        for nm, r in zip(NAMES, rows):
            if "best_config" in r:
                plans[f"{m},{res['shapes'][nm]['n']},{res['shapes'][nm]['k']}"] = r["best_config"]
        if all("best_us" in r and "default_us" in r for r in rows):
            bf, de, be = (round(sum(r[key] for r in rows), 2) for key in ("bf16_us", "default_us", "best_us"))
            layer[f"m{m}"] = {"bf16_us": bf, "w4_default_us": de, "w4_best_us": be,
                              "w4_default_over_bf16": round(de / bf, 3), "w4_best_over_bf16": round(be / bf, 3)}
    res.update(plans=plans, layer_us=layer, seconds=round(time.monotonic() - t0, 1))
    print("layer_us", layer, flush=True)
    emit_json(res, a.out)


if __name__ == "__main__":
    main()
