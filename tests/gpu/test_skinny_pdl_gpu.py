"""The one-tile skinny kernel (`kernels.linear._skinny_pdl_kernel`, `SKINNY_PDL`: W tile
loaded before the PDL wait, the K split summed in the kernel, the RMSNorm / SiLU-and-mul
prologues and the residual epilogue) on CUDA, and the verify step that runs on it.

- rows 2, 5, 9, 16 in bf16 and 5 in fp16 x prologue x residual x K split (1, 2, 3 forced with
  ragged ranges; the plan's own) with PDL (and each prologue at 5 rows without), odd N and K
  (1031 x 1000), against `linear_ref` in fp64; the in-kernel split sum equal bit for bit to
  the `_split_sum_kernel` one over 20 repeats (a counter race shows as a mismatch); counters
  zero afterwards;
- Qwen3-0.6B's four projections at 5 rows against fp64;
- a chain of dependent one-tile launches with PDL (each reads the output of the one before,
  with norm, residual and SiLU prologues) captured in a CUDA graph: 20 replays equal the
  eager chain bit for bit (a launch that read x before the wait would differ);
- a 2-layer Qwen3-0.6B-shaped runner (dummy weights, bf16): a k = 4 verify step's logits on
  the one-tile fused path against the K-loop unfused path (the path before issue 15), and
  the fusion plan (2..16 rows fused exactly when SKINNY_PDL is on).
Tolerances (relative norm error) as tests/gpu/test_kernels_gpu.py: bf16 2e-2, fp16 5e-3.
Skipped without CUDA or triton.
"""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import linear as L  # noqa: E402
from kernels.device_info import TILE_COUNTERS  # noqa: E402
from tests.gpu.test_kernels_gpu import _seed, rel  # noqa: E402,F401  (the same check and seed)

from tests.gpu.test_fused_linear_gpu import DTYPES, ROOT, TOL  # noqa: E402  (the fused-linear tests' bounds)
QWEN3_06B = {"qkv": (4096, 1024, "norm"), "o": (1024, 2048, "res"), "gate_up": (6144, 1024, "norm"),
             "down": (1024, 3072, "silu_res")}


def _inputs(pro: str, res: bool, m: int, n: int, k: int, dtype, bias: bool = True):
    """(x, weight, bias, fused kwargs) on CUDA; x [m, 2k] for silu."""
    x = torch.randn(m, 2 * k if pro == "silu" else k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    kw: dict = {"silu_mul": pro == "silu"}
    if pro == "norm":
        kw.update(norm_weight=(1 + 0.2 * torch.randn(k, device="cuda")).to(dtype), eps=1e-6)
    if res:
        kw["residual"] = torch.randn(m, n, device="cuda", dtype=dtype)
    return x, w, b, kw


def _ref64(x, w, b, kw):
    d = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw.items()}
    return L.linear_ref(x.double(), w.double(), None if b is None else b.double(), **d)


def _counters_zero() -> bool:
    torch.cuda.synchronize()
    return all(bool((c == 0).all()) for c in TILE_COUNTERS.values())


@pytest.mark.parametrize("dtype,m", [(torch.bfloat16, 2), (torch.bfloat16, 5), (torch.bfloat16, 9),
                                     (torch.bfloat16, 16), (torch.float16, 5)],
                         ids=["bf16-m2", "bf16-m5", "bf16-m9", "bf16-m16", "fp16-m5"])
@pytest.mark.parametrize("pro", ["plain", "norm", "silu"])
@pytest.mark.parametrize("res", [False, True])
def test_one_tile_skinny_kernel_matches_reference(dtype, m, pro, res):
    _check_one_tile(dtype, pro, res, m, True)


@pytest.mark.parametrize("pro", ["plain", "norm", "silu"])
def test_one_tile_skinny_kernel_without_pdl_matches_reference(pro):
    _check_one_tile(torch.bfloat16, pro, True, 5, False)


def _check_one_tile(dtype, pro: str, res: bool, m: int, pdl: bool) -> None:
    n, k = 1031, 1000
    x, w, b, kw = _inputs(pro, res, m, n, k, dtype, bias=m != 5)
    ref = _ref64(x, w, b, kw)
    for split in (1, 2, 3, None):
        got = L.skinny_linear_triton(x, w, b, one_tile=True, split_k=split, pdl=pdl, **kw)
        assert rel(got, ref) < TOL[dtype], split
        two = L.skinny_linear_triton(x, w, b, one_tile=True, split_k=split, pdl=pdl, split_reduce="kernel", **kw)
        assert torch.equal(got, two), split
        if split != 1:
            for _ in range(20):  # a counter race would sum a partial that is not there yet
                assert torch.equal(L.skinny_linear_triton(x, w, b, one_tile=True, split_k=split, pdl=pdl, **kw),
                                   two), split
    assert _counters_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_qwen3_projections_at_five_rows(dtype, monkeypatch):
    monkeypatch.setattr(L, "SKINNY_PDL", True)
    for name, (n, k, fused) in QWEN3_06B.items():
        pro = "norm" if fused == "norm" else "silu" if fused.startswith("silu") else "plain"
        x, w, b, kw = _inputs(pro, fused.endswith("res"), 5, n, k, dtype, bias=False)
        assert L.skinny_applies(x, w), name
        assert rel(L.linear(x, w, None, **kw), _ref64(x, w, None, kw)) < TOL[dtype], name
    assert _counters_zero()


def test_a_pdl_chain_of_one_tile_launches_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(L, "SKINNY_PDL", True)
    dtype, m, hid = torch.bfloat16, 5, 1024
    ws = {name: (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype) for name, (n, k, _) in QWEN3_06B.items()}
    ln = (1 + 0.2 * torch.randn(hid, device="cuda")).to(dtype)
    h0 = torch.randn(m, hid, device="cuda", dtype=dtype)

    def layers(h):  # two fused decoder layers' projections, attention replaced by a slice
        for _ in range(2):
            qkv = L.linear(h, ws["qkv"], norm_weight=ln, eps=1e-6)
            h = L.linear(qkv[:, :2048], ws["o"], residual=h)
            gu = L.linear(h, ws["gate_up"], norm_weight=ln, eps=1e-6)
            h = L.linear(gu, ws["down"], silu_mul=True, residual=h)
        return h

    eager = layers(h0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layers(h0)
    for _ in range(20):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert _counters_zero()


@pytest.fixture(scope="module")
def two_layer_runner(tmp_path_factory):
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg.update(num_hidden_layers=2, vocab_size=4096)
    d = tmp_path_factory.mktemp("qwen3two")
    (d / "config.json").write_text(json.dumps(cfg))
    cli = {"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 8,
           "max_model_len": 1024, "gpu_memory_utilization": 0.2, "enforce_eager": True, "block_size": 16}
    runner = ModelRunner(build_config(cli=cli, env={}))
    with torch.no_grad():  # norm weights that are not 1, so a norm applied wrongly shows
        gen = torch.Generator(device="cuda").manual_seed(1)
        for name, p in runner.model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, device="cuda", generator=gen))
    return runner


def test_verify_step_on_the_one_tile_fused_path_matches_the_k_loop_unfused_path(two_layer_runner, monkeypatch):
    from services.worker.fusion import FusionPlan
    from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
    from tests.runner_driver import step_logits

    r, greedy = two_layer_runner, SamplingParams(temperature=0.0)
    proj = r.model.fusable_projections()
    prompt = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    table = list(range(4))
    step_logits(r, StepPlan(0, [ScheduledSeq("s", prompt, 0, table, True, greedy)]))
    chunk = StepPlan(0, [ScheduledSeq("s", [11, 12, 13, 14, 15], 40, table, True, greedy, 1)])  # 1 + k = 5 rows
    default = r.fusion
    try:
        monkeypatch.setattr(L, "SKINNY_PDL", True)
        r.fusion = FusionPlan.choose(proj, torch.device("cuda"), torch.bfloat16)
        assert r.fusion.fused(5) and r.fusion.fused(16) and not r.fusion.fused(17)
        new = step_logits(r, chunk)
        monkeypatch.setattr(L, "SKINNY_PDL", False)
        r.fusion = FusionPlan.choose(proj, torch.device("cuda"), torch.bfloat16)
        assert r.fusion.fused(1) and not r.fusion.fused(5)
        old = step_logits(r, chunk)  # the same step again: rewrites the same KV slots
    finally:
        r.fusion = default
    assert rel(new, old) < TOL[torch.bfloat16]
    assert _counters_zero()
