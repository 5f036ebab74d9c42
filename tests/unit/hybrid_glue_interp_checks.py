"""Run the hybrid glue kernels (kernels/hybrid_glue.py) under TRITON_INTERPRET=1 on small CPU
tensors against their torch references and print one JSON object {check name: max absolute
error} on a line starting "RESULT ".

Run by `tests/unit/test_hybrid_glue_interp.py` in a subprocess (the interpreter switch is
read when triton is first imported). The dispatchers send CPU tensors to the references, so
the Triton entries are called directly. Shapes are awkward on purpose: a gate that is the
strided second half of each head of a wider projection (as the gated attention's), a head
dim and hidden size that are not powers of two, a hidden size over one 1024-column program,
a combine gate that is a column of a stacked output (row stride > 1), several rows.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import hybrid_glue  # noqa: E402


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; inf on a shape or dtype mismatch or NaN."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.isfinite(a.double()).all():
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def main() -> None:
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.float16):  # the interpreter's bf16 casts are not torch's
        name = str(dtype).removeprefix("torch.")
        # gated attention: qg [T, heads, 2 * D] (per head: q then its gate), o [T, heads * D]
        for t, heads, d in ((1, 4, 16), (3, 5, 24)):
            qg = (3 * torch.randn(t, heads, 2 * d, generator=g)).to(dtype)
            gate = qg[..., d:]
            o = torch.randn(t, heads * d, generator=g).to(dtype)
            got = hybrid_glue.sigmoid_gate_mul_triton(o, gate)
            out[f"gate_t{t}_h{heads}_d{d}_{name}"] = err(got, hybrid_glue.sigmoid_gate_mul_ref(o, gate))
        # shared expert combine: gate a column of a stacked [T, E + 2I + 1] output
        for t, h in ((1, 64), (4, 1100)):
            stacked = (3 * torch.randn(t, 7 + h, generator=g)).to(dtype)
            gate = stacked[:, 7 + h - 1:]
            moe_out, shared = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, h, generator=g).to(dtype)
            got = hybrid_glue.shared_expert_combine_triton(moe_out, gate, shared)
            out[f"combine_t{t}_h{h}_{name}"] = err(got, hybrid_glue.shared_expert_combine_ref(moe_out, gate, shared))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
