"""Run the W4A16 Triton kernels (kernels/w4a16_gemv.py, kernels/w4a16_gemm.py) under
TRITON_INTERPRET=1 on small CPU tensors against `kernels.w4a16_linear.w4a16_linear_ref` and
print one JSON object {case name: relative error} on a line starting "RESULT ".

Run by `tests/unit/test_w4a16_interp.py` in a subprocess (the interpreter switch is read when
triton is first imported). Activations fp32 and fp16; bf16 only through the one-row kernel
(no tl.dot: the interpreter's tl.dot on bf16 operands gives garbage,
tests/unit/moe_interp_checks.py), where bf16 takes its own path (x read as int32 pairs).
Weights are random AWQ / GPTQ checkpoint tensors read through `W4Weight`. Also
"split_sums_equal_*": 1.0 when the in-kernel (atomic) and the second-kernel split sums give
the same bits, "sum_chunks_equal_*" when every sum_chunk (partials loaded at a time) does.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import w4a16_formats as fmt  # noqa: E402
from kernels import w4a16_gemm, w4a16_gemv  # noqa: E402
from kernels.w4a16_linear import W4Weight, w4a16_linear_ref  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# name, M, N, K, group size, format, kernel ("gemv" / "gemm"), config: one row through the
# one-row kernel (one group a tile, a forced ragged split, per channel G = K, a ragged N with
# 27 splits), through the dot kernel (a group size no power of two >= 16 divides: gathered
# scales), 2..16 rows (the dot kernel: split and not, per channel, gathered, the fp32
# dequantization instead of the 16-bit magic numbers), larger M
# through the GEMM kernel (ragged tiles)
CASES = [
    ("m1_g32_awq", 1, 40, 256, 32, "awq", "gemv", {}),
    ("m1_split3_gptq", 1, 72, 384, 64, "gptq", "gemv", {"split": 3, "block_n": 16}),
    ("m1_g24_gather", 1, 48, 192, 24, "awq", "gemv", {"split": 2}),
    ("m1_perchannel", 1, 32, 128, 128, "gptq", "gemv", {}),
    ("m1_ragged_n_split27", 1, 200, 2048, 64, "awq", "gemv", {"split": 27, "block_n": 128}),
    ("m2_perchannel_dot", 2, 48, 256, 256, "gptq", "gemv", {"block_n": 32}),
    ("m3_ragged_split3_dot", 3, 104, 384, 128, "awq", "gemv", {"split": 3, "block_n": 64, "block_k": 64}),
    ("m5_awq", 5, 40, 256, 64, "awq", "gemv", {"split": 2}),
    ("m5_fp32_dequant_dot", 5, 40, 256, 64, "awq", "gemv", {"split": 2, "magic16": False}),
    ("m8_g24_gather_dot", 8, 48, 192, 24, "gptq", "gemv", {"split": 2}),
    ("m16_gptq", 16, 24, 128, 32, "gptq", "gemv", {"split": 1}),
    ("m37_gemm_awq", 37, 72, 256, 128, "awq", "gemm", {}),
    ("m70_gemm_g24", 70, 40, 192, 24, "gptq", "gemm", {}),
]
BF16_CASES = ("m1_g32_awq", "m1_split3_gptq", "m1_perchannel", "m1_ragged_n_split27")


def weight(n: int, k: int, g: int, layout: str, seed: int) -> W4Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    q, z, s = fmt.quantize_groups(w, g, sym=layout == "gptq")
    t = fmt.to_awq(q, z, s) if layout == "awq" else fmt.to_gptq(q, z, s)
    if layout == "awq":
        return W4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"])
    return W4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])


def run(f, x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None, kw: dict) -> torch.Tensor:
    if f is w4a16_gemv.w4_gemv_triton:
        return f(x, w.qweight, w.zeros, w.scales, w.group_size, bias, config=kw)
    return f(x, w.qweight, w.zeros, w.scales, w.group_size, bias, **kw)


def main() -> None:
    out: dict[str, float] = {}
    for i, (name, m, n, k, g, layout, kern, kw) in enumerate(CASES):
        w = weight(n, k, g, layout, i)
        gen = torch.Generator().manual_seed(100 + i)
        f = w4a16_gemv.w4_gemv_triton if kern == "gemv" else w4a16_gemm.w4_gemm_triton
        assert f is not None
        dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if name in BF16_CASES else ())
        for dtype in dtypes:
            x = torch.randn(m, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype) if i % 2 else None
            y = run(f, x, w, bias, kw)
            ref = w4a16_linear_ref(x.float(), w, None if bias is None else bias.float())
            out[f"{name}_{str(dtype).removeprefix('torch.')}"] = rel(y.float(), ref.float())
            if kw.get("split", 1) > 1 and kern == "gemv":
                other = run(f, x, w, bias, {**kw, "split_sum": "kernel"})
                out[f"split_sums_equal_{name}_{str(dtype).removeprefix('torch.')}"] = float(torch.equal(y, other))
                # the summing program's loads at a time (sum_chunk): the same adds in split order
                same = all(torch.equal(y, run(f, x, w, bias, {**kw, "sum_chunk": c, "split_sum": ss}))
                           for c in (1, 4, 32) for ss in ("atomic", "kernel"))
                out[f"sum_chunks_equal_{name}_{str(dtype).removeprefix('torch.')}"] = float(same)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
