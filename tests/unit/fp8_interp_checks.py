"""Run the FP8-weight Triton kernels (kernels/fp8_gemv.py) under TRITON_INTERPRET=1 on small CPU
tensors against `kernels.fp8_linear.fp8_linear_ref` (the fused one-row path against
`fp8_linear_fused_ref`) and print one JSON object {check name:
relative error, or a flag} on a line starting "RESULT ".

Run by `tests/unit/test_fp8_interp.py` in a subprocess (the interpreter switch is read when
triton is first imported). Activations fp32 and fp16 only: the interpreter's tl.dot on bf16
operands gives garbage (tests/unit/moe_interp_checks.py). Weights go through `Fp8Weight`
(padded to 16 rows and columns where the shapes are awkward, the kernels reading only the
first n rows and K columns). The activation quantizer's check runs only when the
interpreter's fp32 -> e4m3 cast rounds correctly ("quant_cast_ok": triton 3.9's rounds 31.7
to 16.0).
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import fp8_gemv  # noqa: E402
from kernels import fp8_linear as F  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# name, M, N, K, kernel overrides: one row (a tile; a forced ragged split; the plan's own
# split past max_block_k; each on kernels.gemv's kernel, ONE_ROW "gemv", and on the legacy
# one), 2..16 rows (the skinny kernel; forced and planned splits), 40 rows
CASES = [
    ("m1_tile", 1, 37, 100, {}),
    ("m1_split3", 1, 70, 300, {"split": 3, "block_n": 8}),
    ("m1_plan_split", 1, 24, 9000, {}),
    ("m1_legacy_tile", 1, 37, 100, {"one_row": "legacy"}),
    ("m1_legacy_split3", 1, 70, 300, {"split": 3, "block_n": 8, "one_row": "legacy"}),
    ("m1_legacy_plan_split", 1, 24, 9000, {"one_row": "legacy"}),
    ("m3", 3, 40, 70, {}),
    ("m7_split2", 7, 64, 300, {"split": 2}),
    ("m16_plan_split", 16, 33, 600, {}),
    ("m40", 40, 48, 200, {}),
]


# the fused one-row path (fp8_gemv_fused on kernels.gemv's kernel): name, N, K, overrides;
# each with the RMSNorm prologue, the SiLU-and-mul one, and the residual epilogue (with and
# without a bias, the norm with the residual too), against fp8_linear_fused_ref
FUSED_CASES = [
    ("fused_tile", 37, 100, {}),
    ("fused_split3", 70, 300, {"split": 3, "block_n": 8}),
    ("fused_plan_split", 24, 9000, {}),
    ("fused_padded_n", 13, 40, {"block_n": 4}),  # 13 of Fp8Weight's 16 padded rows
]


def _fused_checks(gen: torch.Generator, out: dict[str, float]) -> None:
    """FUSED_CASES in fp32 and fp16 (a padded weight: the kernel reads n rows, K columns)."""
    for name, n, k, kw in FUSED_CASES:
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        w[-1] *= 20.0
        q, s = F.quantize_fp8_rows(w)
        fw = F.Fp8Weight.from_rows(q, s)
        for dt in (torch.float32, torch.float16):
            x = (torch.randn(1, k, generator=gen) * 3).to(dt)
            x2 = torch.randn(1, 2 * k, generator=gen).to(dt)
            nw = (torch.rand(k, generator=gen) + 0.5).to(dt)
            b = torch.randn(n, generator=gen).to(dt)
            r = torch.randn(1, n, generator=gen).to(dt)
            errs = []
            for fused, xi in (({"norm_weight": nw, "eps": 1e-5}, x), ({"silu_mul": True}, x2),
                              ({"residual": r}, x), ({"norm_weight": nw, "residual": r}, x),
                              ({"silu_mul": True, "residual": r}, x2)):
                for bias in (None, b):
                    got = fp8_gemv.fp8_gemv_fused(xi, fw.qweight, fw.scale, bias, n=n, **fused, **kw)
                    ref = F.fp8_linear_fused_ref(xi, q, s, bias, **fused)
                    errs.append(rel(got, ref) if got is not None and got.dtype == dt else float("inf"))
            out[f"{name}_{str(dt).removeprefix('torch.')}"] = max(errs)


def _cast_ok() -> bool:
    """Whether the interpreter casts fp32 to e4m3 as torch does (round to nearest even)."""
    x = torch.tensor([[31.7, 116.0, 7.97, 0.3, -21.0, 1e-3]])
    q, s = fp8_gemv.quant_rows_triton(x)
    want, ws = F.quantize_fp8_rows(x)
    return bool(torch.equal(q.float() * s, want.float() * ws[:, None]))


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for name, m, n, k, kw in CASES:
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        w[0] *= 30.0  # a row of larger scale
        q, s = F.quantize_fp8_rows(w)
        fw = F.Fp8Weight.from_rows(q, s)
        for dt in (torch.float32, torch.float16):
            x = torch.randn(m, k, generator=gen).to(dt)
            b = torch.randn(n, generator=gen).to(dt)
            errs = []
            for bias in (None, b):
                ref = F.fp8_linear_ref(x.float(), q, s, None if bias is None else bias.float())
                got = fp8_gemv.fp8_gemv_triton(x, fw.qweight, fw.scale, bias, n=n, **kw)
                errs.append(rel(got, ref) if got.dtype == dt else float("inf"))
            xs = torch.randn(m, 2 * k, generator=gen).to(dt)[:, :k]  # row-strided x
            got = fp8_gemv.fp8_gemv_triton(xs, fw.qweight, fw.scale, b, n=n, **kw)
            errs.append(rel(got, F.fp8_linear_ref(xs.float(), q, s, b.float())))
            out[f"{name}_{str(dt).removeprefix('torch.')}"] = max(errs)
    _fused_checks(gen, out)
    ok = _cast_ok()
    out["quant_cast_ok"] = float(ok)
    if ok:
        x = torch.randn(5, 300, generator=gen) * torch.tensor([1.0, 1e-3, 50.0, 0.0, 3.0])[:, None]
        q, s = fp8_gemv.quant_rows_triton(x, 304)
        want, ws = F.quantize_fp8_rows(x)
        same = torch.equal(q[:, :300].float(), want.float()) and torch.equal(s[:, 0], ws)
        out["quant_rows_float32"] = 0.0 if same and bool((q[:, 300:].float() == 0).all()) else float("inf")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
