"""Registers and spills of the skinny linear kernels (`kernels/linear.py`) per tile shape, without
a GPU: Triton compiles each variant to PTX for sm_90 (GPUTarget), and the ptxas that ships
with Triton (`ptxas-blackwell`, which reads the PTX version this Triton writes) reports
`Used N registers` and spill bytes for sm_90a. This is how the one-tile kernel's plan
(`SKINNY_PDL_TUNING`: K ranges of at most 256 columns) was chosen: its x tile and both dot
operands sit in registers, so [16, 1024] tiles spilled (20 KB with the SiLU prologue).

Variants: plain, norm, res_split (residual + in-kernel split sum), silu_res_split, bf16, no
bias, PDL on; the K-loop kernel at its default tiles for comparison (--k-loop).

Usage: .venv/bin/python benchmarks/skinny_regs.py [--tiles 32x256 16x1024 ...] [--warps 4 8] [--k-loop]
Prints one line per (tile, warps, variant).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import linear as L  # noqa: E402

PTR = "*bf16"
SIG = {"x_ptr": PTR, "w_ptr": PTR, "b_ptr": PTR, "y_ptr": PTR, "ws_ptr": "*fp32", "nw_ptr": PTR, "r_ptr": PTR,
       "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "sx_m": "i32", "sw_n": "i32", "sy_m": "i32",
       "sr_m": "i32", "k_per_split": "i32", "eps": "fp32"}
VARIANTS = {"plain": (0, 0, 0, 0), "norm": (1, 0, 0, 0), "res_split": (0, 0, 1, 1), "silu_res_split": (0, 1, 1, 1)}


def ptxas_info(fn, constexprs: dict, warps: int, stages: int = 3) -> str:
    """'regs R spill S smem B' of `fn` compiled with `constexprs` for sm_90."""
    src = ASTSource(fn=fn, signature={**SIG, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    r = re.search(r"Used (\d+) registers", err)
    s = re.search(r"(\d+) bytes spill stores", err)
    return f"regs {r.group(1) if r else '?'} spill {s.group(1) if s else 0} smem {k.metadata.shared}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="+", default=["32x256", "64x256", "16x1024"], help="BLOCK_NxBLOCK_K")
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--k-loop", action="store_true", help="also the K-loop kernel at BLOCK_N 16, BLOCK_K 256")
    a = ap.parse_args()
    for tile, warps, (name, (norm, silu, res, split)) in itertools.product(a.tiles, a.warps, VARIANTS.items()):
        bn, bk = map(int, tile.split("x"))
        c = dict(HAS_BIAS=False, NORM=bool(norm), SILU=bool(silu), HAS_RES=bool(res), SPLIT=bool(split),
                 ATOMIC=bool(split), USE_PDL=True, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, NORM_BLOCK=256)
        print(f"one_tile {bn}x{bk} warps {warps} {name}: {ptxas_info(L._skinny_pdl_kernel, c, warps)}", flush=True)
    if a.k_loop:
        for name, (norm, silu, res, split) in VARIANTS.items():
            c = dict(HAS_BIAS=False, NORM=bool(norm), SILU=bool(silu), HAS_RES=bool(res), SPLIT=bool(split),
                     ATOMIC=bool(split), BLOCK_M=16, BLOCK_N=16, BLOCK_K=256)
            print(f"k_loop 16x256 warps 4 {name}: {ptxas_info(L._skinny_kernel, c, 4)}", flush=True)


if __name__ == "__main__":
    main()
