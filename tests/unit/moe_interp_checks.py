"""Run the fused-MoE Triton path (kernels/moe_triton.py, through `kernels.moe.fused_moe_triton`)
under TRITON_INTERPRET=1 on small CPU tensors against `kernels.moe.fused_moe_ref` and print
one JSON object {check name: relative error} on a line starting "RESULT ".

Run by `tests/unit/test_moe_interp.py` in a subprocess, because the interpreter switch is
read when triton is first imported. fp32 and fp16 only: the interpreter's tl.dot on bf16
operands gives garbage. The dispatcher sends CPU tensors to the reference, so the Triton
entry is called directly, with explicit small configs (16-wide tiles keep the interpreter's
work small; one case takes the default config).
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kernels import moe, moe_triton  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf on NaN or a shape mismatch."""
    if a.shape != b.shape or not torch.isfinite(a.double()).all():
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cfg(bm: int, bn: int, bk: int, group_m: int = 1) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": 4, "num_stages": 2}


# name, T, H, I, E, k, config (None: the default one), ids int32
CASES = [
    ("t1", 1, 48, 40, 8, 2, cfg(16, 16, 32), False),  # one token: 2 experts busy, 6 idle
    ("t3_k1", 3, 40, 24, 8, 1, cfg(16, 32, 16), True),
    ("t40", 40, 80, 48, 8, 2, cfg(16, 32, 32, 2), False),  # T*k / E > BLOCK_M: several tiles an expert
    ("t40_bm32", 40, 56, 40, 8, 2, cfg(32, 16, 64, 4), True),  # H, I not whole tiles, K in one tile
    ("t20_default", 20, 64, 48, 8, 2, None, False),
    ("t40_e2_group4", 40, 48, 32, 2, 2, cfg(16, 16, 16, 4), False),  # the last program group holds used tiles
]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    for name, t, h, inter, e, k, conf, int32 in CASES:
        x = torch.randn(t, h, generator=gen)
        w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
        w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
        ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
        if name == "t40":  # an expert that no token picks, and one that every token picks
            ids[:, 0] = 3
            ids[:, 1] = torch.where(torch.rand(t, generator=gen) < 0.5, 1, 6)
        ids = ids.int() if int32 else ids
        w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
        for dt in (torch.float32, torch.float16):
            args = (x.to(dt), w13.to(dt), w2.to(dt), w, ids)
            got = moe.fused_moe_triton(*args, config=conf)
            assert got.dtype == dt
            out[f"{name}_{str(dt).removeprefix('torch.')}"] = rel(got, moe.fused_moe_ref(*args))
    # padding rows must not write: a poisoned down-partial buffer is fully overwritten
    # (each pair's row exactly once), checked through the aligned entry at fp32
    t, h, inter, e, k = 5, 32, 16, 8, 2
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
    c = cfg(16, 16, 16)
    s, blocks, _ = moe.moe_align(ids, e, 16)
    saved = torch.empty
    torch.empty = lambda *a, **kw: saved(*a, **kw).fill_(float("nan"))  # poison the workspaces
    try:
        got = moe_triton.fused_moe_aligned(x, w13, w2, w, s, blocks, k, c)
    finally:
        torch.empty = saved
    out["poisoned_workspace_float32"] = rel(got, moe.fused_moe_ref(x, w13, w2, w, ids))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
