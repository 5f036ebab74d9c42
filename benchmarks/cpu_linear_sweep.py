"""CPU linear layers at few rows: MKL's F.linear on the dense weight against oneDNN's inner
product on a packed weight (`kernels.cpu_linear`), on weights that do not fit in cache.

SmolLM2-135M's shapes (fp32): 30 layers of qkv [960, 576], o [576, 576], gate_up
[3072, 576], down [576, 1536] (distinct matrices, ~425 MB, as in a real forward) and the
49152x576 LM head. For each row count M (--rows) and method: the median over --reps of the
time to run x [M, K] through all 30 matrices of each shape, and through the head, ms.
Methods: `mkl_col` (F.linear, W.t() contiguous: the dense CPU layout, `to_cpu_gemm_layout`),
`mkl_row` (F.linear, W row-major), `onednn_col` (oneDNN on the dense column-major weight),
`packed` (oneDNN, weight packed with --hint rows). Outputs are checked against F.linear.
JSON to --out and stdout.

Usage: .venv/bin/python benchmarks/cpu_linear_sweep.py [--threads 1] [--rows 1,2,5,9,16] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit_json  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,5,9,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hint", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dense = {s: [0.02 * torch.randn(shape, generator=g) for _ in range(1 if s == "lm_head" else 30)]
             for s, shape in SHAPES.items()}
    col = {s: [w.t().contiguous().t() for w in ws] for s, ws in dense.items()}
    packed = {s: [torch.ops.mkldnn._reorder_linear_weight(w, args.hint) for w in ws] for s, ws in dense.items()}
    lp = torch.ops.mkldnn._linear_pointwise

    def onednn(x, w):
        return lp(x, w, None, "none", [], "")

    methods = {"mkl_col": (col, F.linear), "mkl_row": (dense, F.linear), "onednn_col": (col, onednn),
               "packed": (packed, onednn)}
    result: dict = {"threads": args.threads, "hint": args.hint, "reps": args.reps, "ms": {}}
    for m in (int(r) for r in args.rows.split(",")):
        times: dict = {}
        for _ in range(args.reps):  # methods interleaved: a shared machine's load hits all alike
            for name, (weights, fn) in methods.items():
                for s, ws in weights.items():
                    x = torch.randn(m, SHAPES[s][1], generator=g)
                    torch.testing.assert_close(fn(x, ws[0]), F.linear(x, dense[s][0]), rtol=1e-4, atol=1e-4)
                    t = time.perf_counter()
                    for w in ws:
                        fn(x, w)
                    times.setdefault(name, {}).setdefault(s, []).append((time.perf_counter() - t) * 1000)
        row = {}
        for name, per in times.items():
            ms = {s: round(statistics.median(v), 2) for s, v in per.items()}
            ms["layers"] = round(sum(v for s, v in ms.items() if s != "lm_head"), 2)
            row[name] = ms
            print(f"M={m:2d} {name:10s} layers {ms['layers']:7.2f} lm_head {ms['lm_head']:6.2f}", file=sys.stderr)
        result["ms"][m] = row
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
