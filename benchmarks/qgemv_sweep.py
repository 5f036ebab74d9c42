"""FP8-weight one-row decode products (kernels/fp8_gemv.py) on one GPU, by launch plan, for
filling kernels.fp8_gemv.PLANS (issue 17: Llama-3.1-8B batch-1 TPOT with FP8 weights <= 0.6x
bf16). The W4A16 one-row plans have their own sweep (benchmarks/w4a16_sweep.py --ms 1).

For each projection of Llama-3.1-8B (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
down 14336 -> 4096) at M = 1: L distinct weights (each set larger than the H200's 60 MB L2, so
they stream from HBM as in decode), launched back to back in one CUDA graph; time per launch =
median replay time / L (`kernel_sweep.graph_time`; with PDL, as the decode graph chains them) of
- bf16: `kernels.linear.linear` on bf16 weights (`kernels.gemv` at one row), the baseline;
- legacy: `fp8_gemv_triton(one_row="legacy")`, the kernel before (no PDL, a second kernel for
  a K split), the plain product;
- default: `fp8_gemv_fused` with the heuristic plan and the fused steps the fused layer path
  gives this projection (qkv and gate_up: the RMSNorm prologue; o: the residual epilogue;
  down: the SiLU-and-mul prologue and the residual), and "default_plain" without them;
- each plan (block_n, split, num_warps) around the heuristic's, with the same fused steps.
Per variant: us, GB/s (the fp8 bytes and scales a launch must read, over time), fp8 / bf16
and the relative error against `fp8_linear_fused_ref` on one weight (over MAX_ERR, or failing:
reported, not picked). The fastest plan per shape goes to "plans" ({"NxK": [block_n, split,
num_warps]}, for `decode_latency.py --fp8-plans` and kernels.fp8_gemv.PLANS); "layer_us" sums
one decoder layer's four products (bf16, legacy, default, best). Stops adding plans when
--budget-s is spent (the JSON says which were skipped).

Usage: python benchmarks/qgemv_sweep.py [--out FILE] [--budget-s 40]
"""

from __future__ import annotations

import argparse
import json
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
from kernels import fp8_gemv, linear  # noqa: E402
from kernels.fp8_linear import Fp8Weight, fp8_linear_fused_ref  # noqa: E402

DT = torch.bfloat16
DEV = torch.device("cuda")
NAMES = ("qkv", "o", "gate_up", "down")
SET_BYTES = 160 << 20  # each weight set at least this large (2.5x the L2)
MAX_ERR = 5e-2  # bf16 outputs against a bf16 reference: ~1e-2 at small sizes; a broken plan is ~1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def plan_space(n: int, k: int) -> list[tuple[int, int, int]]:
    """Plans (block_n, split, num_warps) around the heuristic's (h_bn, h_split): block_n
    h_bn / 2 .. 4 h_bn, split h_split .. 8 h_split (whole powers of two), 4 or 8 warps; tiles
    of 2K .. 32K elements (registers), the heuristic's first."""
    hbn, hsp, hw = fp8_gemv.heuristic_plan(n, k, DEV, fp8_gemv.GEMV_TUNING)
    out = [(hbn, hsp, hw)]
    for sp in (hsp, 2 * hsp, 4 * hsp, 8 * hsp):
        bk = _pow2(-(-k // sp))
        for bn in (hbn // 2, hbn, 2 * hbn, 4 * hbn):
            for w in (4, 8):
                if bn >= 1 and 2048 <= bn * bk <= 32768 and (bn, sp, w) not in out:
                    out.append((bn, sp, w))
    return out


def fused_steps(name: str, k: int, n: int) -> tuple[dict, int]:
    """The fused keywords the fused layer path gives projection `name` (tensors made here), and
    x's width."""
    if name in ("qkv", "gate_up"):
        return {"norm_weight": (torch.rand(k, device=DEV) + 0.5).to(DT), "eps": 1e-5}, k
    r = torch.randn(1, n, device=DEV, dtype=DT)
    if name == "down":
        return {"silu_mul": True, "residual": r}, 2 * k
    return {"residual": r}, k


def per_launch_us(fn, items: list) -> float:
    """Microseconds a call of fn(item), over items launched back to back in one CUDA graph."""
    return graph_time(lambda: [fn(it) for it in items]) * 1e6 / len(items)


def sweep_shape(name: str, n: int, k: int, deadline: float) -> dict:
    fp8_bytes = n * k + n * 4
    bf_bytes = n * k * 2
    layers = max(2, math.ceil(SET_BYTES / fp8_bytes))
    fws = [Fp8Weight.quantize(torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5) for _ in range(layers)]
    bfs = [torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5
           for _ in range(max(2, math.ceil(SET_BYTES / bf_bytes)))]
    fused, width = fused_steps(name, k, n)
    x = torch.randn(1, width, device=DEV, dtype=DT)
    xp = x[:, :k].contiguous()
    w0 = fws[0]
    want = fp8_linear_fused_ref(x, w0.qweight[:n, :k], w0.scale[:n], **fused)
    bf_us = per_launch_us(lambda w: linear.linear(xp, w), bfs)
    row: dict = {"n": n, "k": k, "fp8_layers": layers, "fp8_bytes": fp8_bytes, "bf16_bytes": bf_bytes,
                 "fused_steps": sorted(fused), "bf16_us": round(bf_us, 2),
                 "bf16_GBps": round(bf_bytes / bf_us / 1e3, 1),
                 "heuristic_plan": list(fp8_gemv.heuristic_plan(n, k, DEV, fp8_gemv.GEMV_TUNING)), "variants": {}}

    def entry(us: float, err: float | None, plan=None) -> dict:
        e = {"us": round(us, 2), "GBps": round(fp8_bytes / us / 1e3, 1), "fp8_over_bf16": round(us / bf_us, 3)}
        if err is not None:
            e["rel_err"] = float(f"{err:.3g}")
        if plan is not None:
            e["plan"] = list(plan)
        return e

    legacy = per_launch_us(lambda w: fp8_gemv.fp8_gemv_triton(xp, w.qweight, w.scale, n=n, one_row="legacy"), fws)
    row["variants"]["legacy"] = entry(legacy, None)
    plain = per_launch_us(lambda w: fp8_gemv.fp8_gemv_fused(xp, w.qweight, w.scale, n=n), fws)
    row["variants"]["default_plain"] = entry(plain, None)
    saved, fp8_gemv.USE_PLANS = fp8_gemv.USE_PLANS, False  # "default": the heuristic, not PLANS
    try:
        for plan in [None, *plan_space(n, k)]:
            key = "default" if plan is None else "bn{}_s{}_w{}".format(*plan)
            if plan is not None and time.monotonic() > deadline:
                row["variants"][key] = "skipped: --budget-s spent"
                continue
            kw = {} if plan is None else {"block_n": plan[0], "split": plan[1], "num_warps": plan[2]}
            try:
                got = fp8_gemv.fp8_gemv_fused(x, w0.qweight, w0.scale, n=n, **fused, **kw)
                err = rel(got, want) if got is not None else float("inf")
                us = per_launch_us(lambda w, kw=kw: fp8_gemv.fp8_gemv_fused(x, w.qweight, w.scale, n=n, **fused,
                                                                            **kw), fws)
                row["variants"][key] = entry(us, err, plan or row["heuristic_plan"])
            except Exception as e:  # a plan that fails to compile or run is reported, not fatal
                row["variants"][key] = f"error: {type(e).__name__}: {str(e)[:160]}"
    finally:
        fp8_gemv.USE_PLANS = saved
    ok = {v: r for v, r in row["variants"].items()
          if isinstance(r, dict) and "plan" in r and r.get("rel_err", 1.0) < MAX_ERR}
    if ok:
        best = min(ok, key=lambda v: ok[v]["us"])
        row.update(best=best, best_us=ok[best]["us"], best_plan=ok[best]["plan"],
                   best_fp8_over_bf16=ok[best]["fp8_over_bf16"])
    print(name, n, k, "bf16", row["bf16_us"], "legacy", round(legacy, 2), "default",
          row["variants"].get("default"), "best", row.get("best"), row.get("best_us"), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=40.0, help="stop adding plans after this many seconds")
    a = ap.parse_args()
    t0 = time.monotonic()
    _, mats, _ = SHAPES["llama-3.1-8b"]
    res: dict = {"benchmark": "qgemv_sweep", "device": device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "config": "llama-3.1-8b", "m": 1,
                 "copy_bandwidth_TBps": round(copy_bandwidth() / 1e12, 3), "shapes": {}}
    # the budget is shared out: each shape may spend its part plus what the ones before left
    for i, (name, (n, k)) in enumerate(zip(NAMES, mats)):
        share = (a.budget_s - (time.monotonic() - t0)) / (len(NAMES) - i)
        res["shapes"][name] = sweep_shape(name, n, k, time.monotonic() + share)
        torch.cuda.empty_cache()  # the shape's weights are gone
        summarize(res, t0)
        if a.out:  # after each shape: a run cut short by its time limit keeps the plans so far
            _write(res, a.out)
    print("layer_us", res["layer_us"], "plans", res["plans"], flush=True)
    emit_json(res, a.out)


def _write(res: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)


def summarize(res: dict, t0: float) -> None:
    """res["plans"] (the best plan of each shape swept so far), res["layer_us"] (one layer's
    four products summed, once all four are there) and res["seconds"]."""
    rows = [res["shapes"][nm] for nm in NAMES if nm in res["shapes"]]
    plans = {f"{r['n']}x{r['k']}": r["best_plan"] for r in rows if "best_plan" in r}
    res.update(plans=plans, layer_us={}, seconds=round(time.monotonic() - t0, 1))
    if len(rows) < len(NAMES):
        return
    layer: dict = {"bf16_us": round(sum(r["bf16_us"] for r in rows), 2),
                   "legacy_us": round(sum(r["variants"]["legacy"]["us"] for r in rows), 2)}
    if all(isinstance(r["variants"].get("default"), dict) for r in rows):
        layer["default_us"] = round(sum(r["variants"]["default"]["us"] for r in rows), 2)
    if all("best_us" in r for r in rows):
        layer["best_us"] = round(sum(r["best_us"] for r in rows), 2)
    for key in ("legacy_us", "default_us", "best_us"):
        if key in layer:
            layer[key.replace("_us", "_over_bf16")] = round(layer[key] / layer["bf16_us"], 3)
    res["layer_us"] = layer


if __name__ == "__main__":
    main()
