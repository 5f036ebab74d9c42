"""The fused MoE kernel against a per-expert cuBLAS loop, on the GPU (issue 16's benchmark).

Shape: one MoE layer of a config in benchmarks/configs (default Qwen3-30B-A3B: E = 128
experts, k = 8 a token, H = 2048, I = 768), bf16, random weights and random routing
(softmax top-k of random logits), at T = 1, 16, 256 tokens (--tokens). Per T: the median
GPU time (CUDA events, --reps replays of a CUDA graph of 10 calls, so launches do not count
twice) of `kernels.moe.fused_moe` (the Triton path) and of `fused_moe_ref` on the same CUDA
tensors (a loop over the experts with tokens, two cuBLAS GEMMs each: the per-expert
baseline; eager, it syncs to find the experts), their ratio, the relative error between
them, and the roofline: the bytes of the distinct experts the step touches (w13 + w2 of each,
counted from the routing) plus activations, over the copy bandwidth measured in this run;
and the alignment alone, graphed the same way: torch ops (`moe.moe_align`) against the one
Triton program (`moe_triton.moe_align_triton`, what fused_moe runs up to ALIGN_MAX_PAIRS).
Writes JSON to --out and stdout.

Usage: python benchmarks/moe_kernel.py [--config qwen3-30b-a3b] [--tokens 1 16 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name  # noqa: E402
from benchmarks.decode_latency import copy_bandwidth  # noqa: E402
from kernels import moe  # noqa: E402
from kernels import moe_triton as mt  # noqa: E402
from services.worker.layers.moe import topk_softmax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _time_graph(fn, reps: int) -> float:
    """Median GPU seconds of one fn() call, replayed in a CUDA graph of 10 calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / 10)
    return statistics.median(times)


def _time_eager(fn, reps: int) -> float:
    """Median GPU seconds of one eager fn() call (it may sync inside)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with open(os.path.join(ROOT, "benchmarks", "configs", a.config + ".json")) as fh:
        cfg = json.load(fh)
    e, k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    h, i = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02).to(dt)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * 0.02).to(dt)
    bw = copy_bandwidth()
    rows = []
    for t in a.tokens:
        x = torch.randn(t, h, device="cuda", generator=gen).to(dt)
        weights, ids = topk_softmax(torch.randn(t, e, device="cuda", generator=gen), k, True)
        fused_s = _time_graph(lambda x=x, w=weights, i=ids: moe.fused_moe(x, w13, w2, w, i), a.reps)
        loop_s = _time_eager(lambda x=x, w=weights, i=ids: moe.fused_moe_ref(x, w13, w2, w, i), a.reps)
        bm = mt.pick_config(t, e, k, 2 * i, h)["BLOCK_M"]
        align_torch_s = _time_graph(lambda i=ids, b=bm: moe.moe_align(i, e, b), a.reps)
        align_triton_s = (_time_graph(lambda i=ids, b=bm: mt.moe_align_triton(i, e, b), a.reps)
                          if ids.numel() <= mt.ALIGN_MAX_PAIRS else None)
        ours, ref = moe.fused_moe(x, w13, w2, weights, ids).float(), moe.fused_moe_ref(x, w13, w2, weights, ids).float()
        err = float((ours - ref).norm() / ref.norm().clamp_min(1e-30))
        touched = int(torch.unique(ids).numel())
        nbytes = touched * (w13[0].numel() + w2[0].numel()) * 2 + 2 * t * h * 2
        roof = nbytes / bw
        rows.append({"tokens": t, "experts_touched": touched, "fused_us": round(fused_s * 1e6, 2),
                     "loop_us": round(loop_s * 1e6, 2), "speedup_vs_loop": round(loop_s / fused_s, 3),
                     "roofline_us": round(roof * 1e6, 2), "fused_of_roofline": round(roof / fused_s, 3),
                     "rel_err_vs_loop": err, "align_torch_us": round(align_torch_s * 1e6, 2),
                     "align_triton_us": None if align_triton_s is None else round(align_triton_s * 1e6, 2)})
        print(rows[-1], flush=True)
    res = {"benchmark": "moe_kernel", "device": device_name(), "config": a.config, "dtype": "bfloat16",
           "num_experts": e, "top_k": k, "hidden": h, "moe_intermediate": i,
           "copy_bandwidth_GBps": round(bw / 1e9, 1), "rows": rows}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
