"""Gated DeltaNet's recurrent decode step (kernels/gdn_decode.py, `_gdr_decode_kernel`) by launch
config on one GPU, for choosing `gdn_decode.REC_LAUNCH` (issue 16: the step's state traffic at
large batch; docs/ARCHITECTURE.md §6.4).

Shape: the gated-DeltaNet layers of a config in benchmarks/configs (default Qwen3.5-35B-A3B:
16 key heads and 32 value heads of 128, fp32 state [S, Hv, K, V], 2 MiB a sequence and layer),
bf16 q/k/v as views of one convolution output and a/b of one projection, as the layer hands
them over; every row continues its sequence (has_initial True, the flags staged as a graph
stages them) on a random permutation of the slots. For each row count n of --rows: L layers'
state caches (each set at least 160 MB, past the H200's 60 MB L2, so the states stream from
HBM as in a decode step), one launch a layer back to back in one CUDA graph; time per launch
= median replay time / L (`kernel_sweep.graph_time`) of
- "fixed": the config before the launch table (TUNING's block_v 8, 1 warp, the 3-D "grid3"
  order), the baseline of the same run;
- "table": what `rec_launch(n)` picks now;
- every (block_v, num_warps) of `gdn_decode.REC_CANDIDATES` in both orders ("grid3", "flat"),
  one tile a program, and every `REC_LOOP_CANDIDATES` (block_v, num_warps, items, stages): flat
  programs looping over items tiles in a pipelined loop.
Per variant: us, effective GB/s (state read + written, q/k/v/a/b read, o written; over the
time), the fraction of the device's copy bandwidth, us / fixed, and the max abs error of the
output and of the state against `gated_delta_rule_decode_slots_ref` from the same slots (a
variant over twice the fixed config's error plus one bf16 rounding of the largest output, or
1e-4 on the fp32 state, or one that fails, is reported and not picked). "suggested_rec_launch" is the table the timings argue for (per n the fastest
correct variant, kept at the current table's pick unless 3% faster; consecutive row counts
with one config merged; max_rows = the largest n measured with it, None for the last; a row
count left unmeasured keeps the current table's launch), also
printed as Python to paste over REC_LAUNCH. Row counts are swept largest first; stops adding
variants once --budget-s is spent (the JSON says which were skipped).

Usage: python benchmarks/gdn_decode_sweep.py [--out FILE] [--config qwen3.5-35b-a3b]
       [--rows 1 8 32 64 128 256] [--reps 20] [--budget-s 100]
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

from benchmarks.common import ROOT, device_name, emit_json  # noqa: E402
from benchmarks.decode_latency import copy_bandwidth  # noqa: E402
from benchmarks.kernel_sweep import graph_time  # noqa: E402
from kernels import gdn_decode  # noqa: E402

DT = torch.bfloat16
DEV = torch.device("cuda")
SET_BYTES = 160 << 20  # each set of layer states at least this large (2.5x the L2)
FIXED = (8, 1, "grid3", 1, 1)  # the launch before the table (TUNING's fixed config)


def gdn_shape(config: str) -> dict:
    """Hk, Hv, K, V and the number of gated-DeltaNet layers of benchmarks/configs/<config>.json
    (a multimodal config's text_config)."""
    with open(os.path.join(ROOT, "benchmarks", "configs", config + ".json")) as fh:
        cfg = json.load(fh)
    cfg = cfg.get("text_config", cfg)
    return {"hk": int(cfg["linear_num_key_heads"]), "hv": int(cfg["linear_num_value_heads"]),
            "k": int(cfg["linear_key_head_dim"]), "v": int(cfg["linear_value_head_dim"]),
            "gdn_layers": sum(t == "linear_attention" for t in cfg.get("layer_types", []))}


def variants(n: int) -> list[tuple[str, tuple]]:
    """(name, (block_v, num_warps, order, items, stages)): the fixed config, the current table's
    pick, every `REC_CANDIDATES` tile in both orders (one tile a program), every
    `REC_LOOP_CANDIDATES` loop (flat); duplicates of the first two left out."""
    out: list[tuple[str, tuple]] = [("fixed", FIXED), ("table", gdn_decode.rec_launch(n))]
    cfgs = [(bv, w, order, 1, 1) for bv, w in gdn_decode.REC_CANDIDATES for order in gdn_decode.REC_ORDERS]
    cfgs += [(bv, w, "flat", it, st) for bv, w, it, st in gdn_decode.REC_LOOP_CANDIDATES]
    for cfg in cfgs:
        if cfg not in (FIXED, out[1][1]):
            bv, w, order, it, st = cfg
            out.append((f"bv{bv}_w{w}_{order}" + (f"_i{it}_s{st}" if it > 1 else ""), cfg))
    return out


def layer_inputs(n: int, shp: dict, gen: torch.Generator, cpu_gen: torch.Generator) -> dict:
    """One layer's step inputs at n rows: q/k/v views of one [n, C] bf16 buffer, a/b of one
    [n, 2 Hv] projection, A_log/dt_bias, the fp32 state cache of n slots, a random slot
    permutation and staged has_initial flags (all True)."""
    hk, hv, kd, vd = shp["hk"], shp["hv"], shp["k"], shp["v"]
    mixed = torch.randn(n, 2 * hk * kd + hv * vd, device=DEV, generator=gen).to(DT)
    ba = (torch.randn(n, 2 * hv, device=DEV, generator=gen) * 2).to(DT)
    return {"q": mixed[:, :hk * kd].view(n, hk, kd), "k": mixed[:, hk * kd:2 * hk * kd].view(n, hk, kd),
            "v": mixed[:, 2 * hk * kd:].view(n, hv, vd), "a": ba[:, hv:], "b": ba[:, :hv],
            "A_log": torch.empty(hv, device=DEV).uniform_(0.05, 1.0, generator=gen).log().to(DT),
            "dt_bias": torch.randn(hv, device=DEV, generator=gen).to(DT),
            "state": 0.1 * torch.randn(n, hv, kd, vd, device=DEV, generator=gen),
            "slots": torch.randperm(n, generator=cpu_gen).to(DEV),
            "flags": torch.ones(n, dtype=torch.int64, device=DEV).view(torch.bool)[::8]}


def step(x: dict, state: torch.Tensor, launch) -> torch.Tensor:
    return gdn_decode.gated_delta_rule_decode_slots_triton(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"],
                                                           x["dt_bias"], state, x["slots"], x["flags"],
                                                           launch=launch)


def sweep_rows(n: int, shp: dict, reps: int, deadline: float, copy_bps: float) -> dict:
    hk, hv, kd, vd = shp["hk"], shp["hv"], shp["k"], shp["v"]
    state_bytes = 2 * n * hv * kd * vd * 4  # read + written
    io_bytes = n * (2 * hk * kd + hv * vd + hv * vd + 2 * hv) * 2  # q, k, v, o, a, b (bf16)
    layers = max(2, math.ceil(SET_BYTES / (n * hv * kd * vd * 4)))
    gen = torch.Generator(device=DEV).manual_seed(n)
    cpu_gen = torch.Generator().manual_seed(n)
    xs = [layer_inputs(n, shp, gen, cpu_gen) for _ in range(layers)]
    x0 = xs[0]
    start = x0["state"].clone()  # the timed replays update the layers' states: each check starts here
    want_state = start.clone()
    want_o = gdn_decode.gated_delta_rule_decode_slots_ref(x0["q"], x0["k"], x0["v"], x0["a"], x0["b"], x0["A_log"],
                                                          x0["dt_bias"], want_state, x0["slots"],
                                                          x0["flags"].clone()).float()
    out_ulp = float(want_o.abs().max()) * 2.0 ** -7  # one bf16 rounding of the largest output
    work = torch.empty_like(x0["state"])
    row: dict = {"layers": layers, "state_bytes": state_bytes, "io_bytes": io_bytes,
                 "table_launch": list(gdn_decode.rec_launch(n)), "variants": {}}
    for name, launch in variants(n):
        if time.monotonic() > deadline:
            row["variants"][name] = "skipped: --budget-s spent"
            continue
        try:
            work.copy_(start)
            o = step(x0, work, launch).float()
            torch.cuda.synchronize()
            out_err = float((o - want_o).abs().max())
            state_err = float((work - want_state).abs().max())
            us = graph_time(lambda launch=launch, xs=xs: [step(x, x["state"], launch) for x in xs], reps) * 1e6 / layers
            row["variants"][name] = {
                "launch": list(launch), "us": round(us, 2), "GBps": round((state_bytes + io_bytes) / us / 1e3, 1),
                "of_copy_bw": round((state_bytes + io_bytes) / (us * 1e-6) / copy_bps, 3),
                "out_max_abs_err": float(f"{out_err:.3g}"), "state_max_abs_err": float(f"{state_err:.3g}")}
        except Exception as e:  # a variant that fails to compile or run is reported, not fatal
            row["variants"][name] = f"error: {type(e).__name__}: {str(e)[:160]}"
    fixed = row["variants"].get("fixed")
    if isinstance(fixed, dict):
        for r in row["variants"].values():
            if isinstance(r, dict):
                r["over_fixed"] = round(r["us"] / fixed["us"], 3)
                r["ok"] = (r["out_max_abs_err"] <= 2 * fixed["out_max_abs_err"] + out_ulp
                           and r["state_max_abs_err"] <= 2 * fixed["state_max_abs_err"] + 1e-4)
        ok = {v: r for v, r in row["variants"].items() if isinstance(r, dict) and r["ok"]}
        best = min(ok, key=lambda v: ok[v]["us"])
        table = ok.get("table")
        pick = "table" if table and ok[best]["us"] >= 0.97 * table["us"] else best
        row.update(best=best, best_us=ok[best]["us"], best_GBps=ok[best]["GBps"], best_over_fixed=ok[best]["over_fixed"],
                   pick=pick, pick_launch=ok[pick]["launch"])
        if shp["gdn_layers"]:
            row["step_ms_all_gdn_layers"] = {v: round(ok[v]["us"] * shp["gdn_layers"] / 1e3, 3)
                                             for v in ("fixed", "table", best) if v in ok}
    else:  # not measured (budget spent or the baseline failed): the suggestion keeps the table's launch
        row.update(pick="table (not measured)", pick_launch=list(gdn_decode.rec_launch(n)))
    del xs, x0, start, want_state, work
    torch.cuda.empty_cache()
    us = {v: r["us"] for v, r in row["variants"].items() if isinstance(r, dict)}
    print("rows", n, "fixed_us", us.get("fixed"), "table_us", us.get("table"), "best", row.get("best"),
          row.get("best_us"), "us", row.get("best_GBps"), "GB/s", flush=True)
    return row


def suggest(rows: dict) -> list:
    """[max_rows, block_v, num_warps, order, items, stages] entries from each row count's pick, ascending,
    consecutive equal configs merged, the last one's max_rows None."""
    picks = [(int(k[1:]), r["pick_launch"]) for k, r in rows.items() if "pick_launch" in r]
    table: list = []
    for n, launch in sorted(picks):
        if table and table[-1][1:] == launch:
            table[-1][0] = n
        else:
            table.append([n, *launch])
    if table:
        table[-1][0] = None
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--config", default="qwen3.5-35b-a3b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop adding variants after this many seconds")
    a = ap.parse_args()
    t0 = time.monotonic()
    deadline = t0 + a.budget_s
    shp = gdn_shape(a.config)
    copy_bps = copy_bandwidth()
    res: dict = {"benchmark": "gdn_decode_sweep", "device": device_name(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "triton": triton.__version__, "config": a.config, "shape": shp,
                 "dtype": "bfloat16", "state_dtype": "float32", "copy_bandwidth_TBps": round(copy_bps / 1e12, 3),
                 "rec_launch_now": [list(e) for e in gdn_decode.REC_LAUNCH], "rows": {}}
    for n in sorted(a.rows, reverse=True):  # the large batches first: the budget's point
        res["rows"][f"n{n}"] = sweep_rows(n, shp, a.reps, deadline, copy_bps)
    res["rows"] = dict(sorted(res["rows"].items(), key=lambda kv: int(kv[0][1:])))
    table = suggest(res["rows"])
    res.update(suggested_rec_launch=table, seconds=round(time.monotonic() - t0, 1))
    emit_json(res, a.out)
    print("suggested REC_LAUNCH (kernels/gdn_decode.py):")
    print("REC_LAUNCH: list[tuple[int | None, int, int, str, int, int]] = [")
    for e in table:
        print(f"    ({e[0]}, {e[1]}, {e[2]}, {e[3]!r}, {e[4]}, {e[5]}),")
    print("]")


if __name__ == "__main__":
    main()
