"""Interpreter checks of the one-tile skinny kernel (`kernels.linear._skinny_pdl_kernel`,
`SKINNY_PDL`), run by tests/unit/test_skinny_pdl_interp.py in a subprocess with
TRITON_INTERPRET=1 (tests/interp_runner.py).

Kernel cases: rows 2, 5, 9, 16 x prologue (plain, norm, silu) x residual x K split (1, 2, 3
forced; the plan's own) x fp32 / fp16, N = 37 and K = 300 (multiples of no tile), against
`linear_ref` in the input dtype and in fp64 (the larger relative error counts). Recorded per
case: that error, the split count, whether the tile counters are zero afterwards, whether
the in-kernel split sum equals the `_split_sum_kernel` one (split_reduce="kernel", the
path of a first call inside graph capture) bit for bit, whether
the residual output is bit for bit round(round(x @ W.T + b) + r) of the kernel's own plain
output (the rounding of fused_add_rms_norm), and which kernels launched (the K-loop kernel
and the split-sum kernel must not).
Model cases: a tiny Qwen3 and a Llama with biases whose fused layer path (forced at every row
count, the gemv kernel off so that one row takes the skinny kernel too) runs through the
one-tile kernel, against their unfused path (a 9-token prefill and 3 decode steps).
Prints `RESULT <json>`.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

ROWS = (2, 5, 9, 16)
PROLOGUES = ("plain", "norm", "silu")
SPLITS = (1, 2, 3, None)  # None: skinny_pdl_plan's split
DTYPES = ("float32", "float16")
N, K = 37, 300
CASES = [f"{p}_{'res' if r else 'nores'}_s{s or 'plan'}_m{m}_{d}"
         for p, r, s, m, d in itertools.product(PROLOGUES, (False, True), SPLITS, ROWS, DTYPES)]
MODELS = [f"model_{arch}_{d}" for arch in ("llama_bias", "qwen3") for d in DTYPES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _kernel_checks(out: dict) -> None:
    from kernels import linear as L
    from kernels.device_info import TILE_COUNTERS

    launched = {"old": 0}

    class _Forbidden:  # the one-tile path launches neither the K-loop kernel nor the split sum
        def __getitem__(self, grid):
            launched["old"] += 1
            raise AssertionError("a kernel of the K-loop path launched on the one-tile path")

    real = (L._skinny_kernel, L._split_sum_kernel)
    g = torch.Generator().manual_seed(0)
    for pro, res, split, m, dname in itertools.product(PROLOGUES, (False, True), SPLITS, ROWS, DTYPES):
        dt = getattr(torch, dname)
        cols = 2 * K if pro == "silu" else K
        x = torch.randn(m, cols + 6, generator=g).to(dt)[:, 3:cols + 3]  # a row-strided view
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
        kw: dict = {"silu_mul": pro == "silu"}
        if pro == "norm":
            kw["norm_weight"] = (1 + 0.3 * torch.randn(K, generator=g)).to(dt)
            kw["eps"] = 1e-5
        bias = torch.randn(N, generator=g).to(dt) if m != 5 else None
        r = torch.randn(m, N, generator=g).to(dt)
        tiles = {"block_n": 16, "split_k": split} if split is not None else {}
        launched["old"] = 0
        L._skinny_kernel, L._split_sum_kernel = _Forbidden(), _Forbidden()
        try:
            got = L.skinny_linear_triton(x, w, bias, one_tile=True, residual=r if res else None, **tiles, **kw)
            plain = L.skinny_linear_triton(x, w, bias, one_tile=True, **tiles, **kw) if res else got
        finally:
            L._skinny_kernel, L._split_sum_kernel = real
        counters_zero = all(bool((c == 0).all()) for c in TILE_COUNTERS.values())
        two = L.skinny_linear_triton(x, w, bias, one_tile=True, split_reduce="kernel",
                                     residual=r if res else None, **tiles, **kw)
        kw_ref = {**kw, "residual": r if res else None}
        ref = L.linear_ref(x, w, bias, **kw_ref)
        d64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw_ref.items()}
        ref64 = L.linear_ref(x.double(), w.double(), None if bias is None else bias.double(), **d64)
        bn, sp, _ = L.skinny_pdl_plan(N, K, x.device)
        k_per = -(-K // (split or sp))
        out[f"{pro}_{'res' if res else 'nores'}_s{split or 'plan'}_m{m}_{dname}"] = {
            "err": max(_rel(got, ref), _rel(got, ref64)), "counters_zero": counters_zero,
            "residual_exact": bool(torch.equal(got, (plain.float() + r.float()).to(dt))) if res else True,
            "splits": -(-K // k_per), "old_kernels": launched["old"],
            "equal_to_split_sum_kernel": bool(torch.equal(got, two))}


def _model_checks(out: dict, tmp: pathlib.Path) -> None:
    from kernels import gemv
    from kernels import linear as L
    from services.worker.fusion import FusionPlan
    from services.worker.layers.linear import Linear, unpack_cpu_weights
    from tests.unit.test_fused_linear import run_steps, tiny_runner

    calls = {"one_tile": 0, "split": 0}
    real_pdl = L._skinny_pdl

    def counting(x, weight, *a, **kw):
        calls["one_tile"] += 1
        calls["split"] += L.skinny_pdl_plan(*weight.shape, x.device)[1] > 1
        return real_pdl(x, weight, *a, **kw)

    # K ranges of at most 32 columns: every projection of the tiny models splits K
    L.SKINNY_PDL_TUNING.update(max_block_k=32)
    for arch, dname in itertools.product(("llama_bias", "qwen3"), DTYPES):
        runner = tiny_runner(tmp / f"{arch}_{dname}", arch, dname)
        unpack_cpu_weights(runner.model)  # the kernel wants dense row-major weights (as on the GPU)
        for mod in runner.model.modules():
            if isinstance(mod, Linear):
                mod.weight.data = mod.weight.data.contiguous()
        unfused = run_steps(runner)
        saved = (L.skinny_applies, L._skinny_pdl, runner.fusion, gemv.ENABLED, L.SKINNY_PDL)
        L.skinny_applies = lambda x, w: x.dim() == 2 and 0 < x.shape[0] <= L.SKINNY_MAX_ROWS
        L._skinny_pdl, gemv.ENABLED, L.SKINNY_PDL = counting, False, True
        runner.fusion = FusionPlan(frozenset(range(1, L.SKINNY_MAX_ROWS + 1)))
        calls.update(one_tile=0, split=0)
        try:
            fused = run_steps(runner)
        finally:
            L.skinny_applies, L._skinny_pdl, runner.fusion, gemv.ENABLED, L.SKINNY_PDL = saved
        out[f"model_{arch}_{dname}"] = {"err": max(_rel(a, b) for a, b in zip(fused, unfused)),
                                        "one_tile_calls": calls["one_tile"], "split_calls": calls["split"]}


def main() -> None:
    import tempfile

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    out: dict = {}
    _kernel_checks(out)
    with tempfile.TemporaryDirectory() as tmp:
        _model_checks(out, pathlib.Path(tmp))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
