"""Kernel-only A/B of one SmolLM2-135M layer's int4 products: `_weight_int4pack_mm_for_cpu`
(bf16 x, the tinygemm copy; x's bf16 copy and the output's fp32 cast included, as
`QuantWeight.matmul` does them) against the VNNI kernel (kernels/cpu_int4_vnni.py, fp32 x
quantized in the kernel to one (vnni1) or two (vnni2) int8 planes), alternating call by call,
one thread.

Shapes (N, K): qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 (group 32). For each
shape and M in --rows: us per call (median of --iters), and GB/s of the weight bytes each side
reads (packed codes + scales). To read the weights from memory rather than cache, --copies
distinct copies of each weight are cycled (default: enough for ~64 MB a side).

Usage: .venv/bin/python benchmarks/cpu_int4_kernel_micro.py [--rows 1 4 16 64] [--iters 200]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import emit_json  # noqa: E402
from kernels import cpu_int4_vnni as vnni  # noqa: E402
from kernels import cpu_quant_linear as cq  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mb", type=float, default=64.0, help="weight bytes cycled a side (MB)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not vnni.available():
        raise SystemExit("the VNNI kernel is not available here")
    torch.manual_seed(0)
    res: dict = {"benchmark": "cpu_int4_kernel_micro", "date": time.strftime("%Y-%m-%d"),
                 "threads": a.threads, "load_avg_start": os.getloadavg(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        q, s, z = cq.quantize_int4(w, 32)
        cq.INT4_VNNI = False  # tinygemm's copy alone
        old = cq.pack_int4(q, s, z)
        new = vnni.pack(q, s, z)
        old_b = old.packed.numel() + old.scales.numel() * 2
        new_b = new.numel()
        copies = max(1, int(a.mb * 1e6 // old_b))
        olds = [(old.packed.clone(), old.scales.clone()) for _ in range(copies)]
        news = [new.clone() for _ in range(copies)]
        for m in a.rows:
            x = torch.randn(m, k)
            xb = torch.empty(m, k, dtype=torch.bfloat16)
            to, t1s, t2s = [], [], []
            for i in range(a.iters + 10):
                p, sz = olds[i % copies]
                t0 = time.perf_counter()
                xb.copy_(x)
                torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, sz).float()
                t1 = time.perf_counter()
                vnni.mm(x, news[i % copies], n, 1)
                t2 = time.perf_counter()
                vnni.mm(x, news[(i + 1) % copies], n, 2)
                t3 = time.perf_counter()
                if i >= 10:
                    to.append(t1 - t0)
                    t1s.append(t2 - t1)
                    t2s.append(t3 - t2)
            mo, m1, m2 = statistics.median(to), statistics.median(t1s), statistics.median(t2s)
            res["shapes"][f"{name} {n}x{k} M={m}"] = {
                "tinygemm_us": round(mo * 1e6, 1), "vnni1_us": round(m1 * 1e6, 1), "vnni2_us": round(m2 * 1e6, 1),
                "speedup_vnni1": round(mo / m1, 2), "speedup_vnni2": round(mo / m2, 2),
                "tinygemm_GBps": round(old_b / mo / 1e9, 1), "vnni1_GBps": round(new_b / m1 / 1e9, 1),
                "vnni2_GBps": round(new_b / m2 / 1e9, 1), "tinygemm_bytes": old_b, "vnni_bytes": new_b,
                "copies": copies}
    res["load_avg"] = os.getloadavg()
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
