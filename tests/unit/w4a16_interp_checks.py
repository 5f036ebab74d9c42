"""Run the W4A16 Triton kernels (kernels/w4a16_gemm.py) under TRITON_INTERPRET=1 on small CPU
tensors against `kernels.w4a16_linear.w4a16_linear_ref` and print one JSON object {case name:
relative error} on a line starting "RESULT ".

Run by `tests/unit/test_w4a16_interp.py` in a subprocess (the interpreter switch is read when
triton is first imported). Activations fp32 and fp16 only (the interpreter's tl.dot on bf16
operands gives garbage: tests/unit/moe_interp_checks.py). Weights are random AWQ / GPTQ
checkpoint tensors read through `W4Weight`.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import w4a16_formats as fmt  # noqa: E402
from kernels import w4a16_gemm  # noqa: E402
from kernels.w4a16_linear import W4Weight, w4a16_linear_ref  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# name, M, N, K, group size, format, kernel ("gemv" / "gemm"), overrides: one row (one group a
# tile; a forced ragged split; gathered scales of a group size no power of two divides past 8;
# per-channel G = K), 2..16 rows (split and not), larger M through the GEMM kernel (ragged tiles)
CASES = [
    ("m1_g32_awq", 1, 40, 256, 32, "awq", "gemv", {}),
    ("m1_split3_gptq", 1, 72, 384, 64, "gptq", "gemv", {"split": 3, "block_n": 16}),
    ("m1_g24_gather", 1, 48, 192, 24, "awq", "gemv", {"split": 2}),
    ("m1_perchannel", 1, 32, 128, 128, "gptq", "gemv", {}),
    ("m5_awq", 5, 40, 256, 64, "awq", "gemv", {"split": 2}),
    ("m16_gptq", 16, 24, 128, 32, "gptq", "gemv", {"split": 1}),
    ("m37_gemm_awq", 37, 72, 256, 128, "awq", "gemm", {}),
    ("m70_gemm_g24", 70, 40, 192, 24, "gptq", "gemm", {}),
]


def weight(n: int, k: int, g: int, layout: str, seed: int) -> W4Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    q, z, s = fmt.quantize_groups(w, g, sym=layout == "gptq")
    t = fmt.to_awq(q, z, s) if layout == "awq" else fmt.to_gptq(q, z, s)
    if layout == "awq":
        return W4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"])
    return W4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])


def main() -> None:
    out: dict[str, float] = {}
    for i, (name, m, n, k, g, layout, kern, kw) in enumerate(CASES):
        w = weight(n, k, g, layout, i)
        gen = torch.Generator().manual_seed(100 + i)
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(m, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype) if i % 2 else None
            f = w4a16_gemm.w4_gemv_triton if kern == "gemv" else w4a16_gemm.w4_gemm_triton
            assert f is not None
            y = f(x, w.qweight, w.zeros, w.scales, w.group_size, bias, **kw)
            out[f"{name}_{str(dtype).removeprefix('torch.')}"] = rel(y.float(), w4a16_linear_ref(x.float(), w, None if bias is None else bias.float()).float())
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
