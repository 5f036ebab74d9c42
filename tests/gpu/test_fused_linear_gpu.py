"""The fused skinny linear (`kernels.linear`: RMSNorm / SiLU-and-mul prologue, residual
epilogue, K-split partials summed by the last program of each N tile) on CUDA, and the
fused decoder-layer path of the models against the unfused one.

- every prologue x residual x K split (1, 2, 4 forced, K not divisible; and the dispatcher's
  own plan) x M in {1, 3, 16}, odd N, bf16 and fp16, against `linear_ref` in fp64 on the
  same inputs; the in-kernel split sum equal bit for bit to the 2-kernel path's over 20
  repeats (a race in the counter protocol shows as a mismatch), counters zero afterwards;
- Qwen3-0.6B's four projections, fused against the unfused kernel sequence they replace
  (o_proj + residual bit for bit: the same matmul, the same rounding of the sum as
  fused_add_rms_norm; the prologue ones within 1e-3, well under one bf16 ulp in norm);
- in a CUDA graph: replays equal eager, and a first call inside capture (no counter buffer
  yet) falls back to the 2-kernel sum;
- a 1-layer Qwen3-0.6B-shaped model (dummy weights): decode logits of the fused layer path
  against the unfused path, and the path choice (1..16 rows, half dtypes, CUDA).
Tolerances (relative norm error) as tests/gpu/test_kernels_gpu.py: bf16 2e-2, fp16 5e-3.
Skipped without CUDA or triton.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import activation, gemv, linear as L, norm  # noqa: E402
from kernels.device_info import TILE_COUNTERS  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = [torch.bfloat16, torch.float16]
QWEN3_06B = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}

from tests.gpu.test_kernels_gpu import _seed, rel  # noqa: E402,F401  (the same check and seed)


def _inputs(pro: str, res: bool, m: int, n: int, k: int, dtype, bias: bool = True):
    """(x, weight, bias, fused kwargs) on CUDA; x [m, 2k] for silu."""
    x = torch.randn(m, 2 * k if pro == "silu" else k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    kw = {"silu_mul": pro == "silu"}
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("pro", ["plain", "norm", "silu"])
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_gemv_with_norm_silu_and_residual_matches_reference(dtype, pro, res, pdl):
    # the one-row kernel's prologues and epilogue (kernels.gemv), split K forced 1..4 with
    # ragged splits and tiles; the residual sum bit for bit the unfused add of the same
    # matmul output (fused_add_rms_norm rounds x + residual the same way)
    n, k = 1031, 1000
    x, w, b, kw = _inputs(pro, res, 1, n, k, dtype)
    ref = _ref64(x, w, b, kw)
    assert rel(L.linear(x, w, b, **kw), ref) < TOL[dtype]  # the dispatcher takes gemv at one row
    for split in (1, 2, 4):
        got = gemv.gemv_triton(x, w, b, split=split, pdl=pdl, **kw)
        assert rel(got, ref) < TOL[dtype], split
        if res:
            plain = gemv.gemv_triton(x, w, b, split=split, pdl=pdl, **{**kw, "residual": None})
            assert torch.equal(got, plain + kw["residual"]), split
        if pro == "norm":  # the prologue against the norm kernel then the plain gemv
            xn = norm.rms_norm(x, kw["norm_weight"], kw["eps"])
            two = gemv.gemv_triton(xn, w, b, split=split, pdl=pdl, residual=kw.get("residual"))
            assert rel(got, two) < 1e-3, split
            # the normalised rows stored for the MoE experts (xn_out): the values the product used
            xn_out = torch.full_like(x, float("nan"))
            with_xn = gemv.gemv_triton(x, w, b, split=split, pdl=pdl, xn_out=xn_out, **kw)
            assert torch.equal(with_xn, got), split
            assert rel(xn_out, xn) < 1e-2, split  # a value may round to its neighbour (the sum order)
            assert torch.equal(gemv.gemv_triton(xn_out, w, b, split=split, pdl=pdl, residual=kw.get("residual")),
                               got), split
    assert _counters_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("pro", ["plain", "norm", "silu"])
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_skinny_linear_matches_reference(dtype, pro, res, m):
    n, k = 1031, 1000  # odd N; K split in 2 or 4 leaves ragged splits and tiles
    x, w, b, kw = _inputs(pro, res, m, n, k, dtype, bias=m != 1)
    ref = _ref64(x, w, b, kw)
    assert L.skinny_applies(x, w)
    assert rel(L.linear(x, w, b, **kw), ref) < TOL[dtype]  # the dispatcher's own plan
    for split in (1, 2, 4):
        got = L.skinny_linear_triton(x, w, b, split_k=split, block_k=128, split_reduce="atomic", one_tile=False, **kw)
        assert rel(got, ref) < TOL[dtype], split
        if split > 1:
            two = L.skinny_linear_triton(x, w, b, split_k=split, block_k=128, split_reduce="kernel", one_tile=False,
                                         **kw)
            assert torch.equal(got, two), split
            for _ in range(20):  # a counter race would sum a partial that is not there yet
                assert torch.equal(L.skinny_linear_triton(x, w, b, split_k=split, block_k=128, one_tile=False, **kw),
                                   two)
    assert _counters_zero()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_qwen3_projections_fused_equal_the_unfused_kernel_sequence(dtype, m, monkeypatch):
    monkeypatch.setattr(gemv, "ENABLED", False)  # the unfused skinny sequence (one row takes gemv)
    hid = 1024
    ws = {name: (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype) for name, (n, k) in QWEN3_06B.items()}
    h = torch.randn(m, hid, device="cuda", dtype=dtype)
    attn = torch.randn(m, 2048, device="cuda", dtype=dtype)
    ln = (1 + 0.2 * torch.randn(hid, device="cuda")).to(dtype)
    # norm + qkv: the norm's rstd sums in another order, so close, not always equal
    want = L.linear(norm.rms_norm(h, ln, 1e-6), ws["qkv"])
    assert rel(L.linear(h, ws["qkv"], norm_weight=ln, eps=1e-6), want) < 1e-3
    # o_proj + residual: the same matmul and rounding as the unfused add of fused_add_rms_norm
    o = L.linear(attn, ws["o"])
    _, h1 = norm.fused_add_rms_norm(o, h, ln, 1e-6)
    assert torch.equal(L.linear(attn, ws["o"], residual=h), h1)
    # norm + gate_up, then silu + down + residual
    gu = L.linear(h1, ws["gate_up"], norm_weight=ln, eps=1e-6)
    assert rel(gu, L.linear(norm.rms_norm(h1, ln, 1e-6), ws["gate_up"])) < 1e-3
    d = L.linear(activation.silu_and_mul(gu), ws["down"])
    _, h2 = norm.fused_add_rms_norm(d, h1, ln, 1e-6)
    assert rel(L.linear(gu, ws["down"], silu_mul=True, residual=h1), h2) < 1e-3
    assert _counters_zero()


@pytest.mark.parametrize("one_tile", [False, True])
def test_fused_split_linear_replays_in_a_cuda_graph_and_captures_without_counters(one_tile, monkeypatch):
    monkeypatch.setattr(L, "SKINNY_PDL", one_tile)  # the K-loop kernel, or the one-tile one
    dtype, m = torch.bfloat16, 4
    x, w, b, kw = _inputs("norm", True, m, 1024, 3072, dtype)

    def step():
        return L.linear(L.linear(x, w, b, **kw), w[:, :1024], residual=kw["residual"])

    eager = step()
    default = L.SKINNY_TUNING["split_reduce"], L.SKINNY_PDL_TUNING["split_reduce"]
    # compile the 2-kernel path outside capture too
    L.SKINNY_TUNING["split_reduce"] = L.SKINNY_PDL_TUNING["split_reduce"] = "kernel"
    try:
        assert torch.equal(step(), eager)
    finally:
        L.SKINNY_TUNING["split_reduce"], L.SKINNY_PDL_TUNING["split_reduce"] = default
    saved = dict(TILE_COUNTERS)
    assert saved, "the eager call allocated the counters"
    try:
        for counters in (saved, {}):  # with the buffer; as if the first call were in capture
            TILE_COUNTERS.clear()
            TILE_COUNTERS.update(counters)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step()
            assert list(TILE_COUNTERS) == list(counters)  # nothing allocated inside capture
            for _ in range(10):
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, eager)
            assert _counters_zero()
            del g
    finally:
        TILE_COUNTERS.clear()
        TILE_COUNTERS.update(saved)


def one_layer(tmp_path_factory, config: str, gpu_memory_utilization: float):
    """An eager CUDA ModelRunner of benchmarks/configs/<config>.json cut to one layer and a
    4,096-token vocabulary (dummy bf16 weights), with norm weights that are not 1, so a norm
    applied wrongly shows."""
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    cfg = json.loads((ROOT / f"benchmarks/configs/{config}.json").read_text())
    cfg.update(num_hidden_layers=1, vocab_size=4096)
    d = tmp_path_factory.mktemp(config.replace(".", "_") + "_1layer")
    (d / "config.json").write_text(json.dumps(cfg))
    cli = {"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 32,
           "max_model_len": 1024, "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": True,
           "block_size": 16}
    runner = ModelRunner(build_config(cli=cli, env={}))
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(1)
        for name, p in runner.model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, device="cuda", generator=g))
    return runner


@pytest.fixture(scope="module")
def one_layer_runner(tmp_path_factory):
    return one_layer(tmp_path_factory, "qwen3-0.6b", 0.2)


def test_fused_path_is_chosen_for_1_to_16_rows_of_half_dtypes_on_cuda(one_layer_runner):
    from services.worker.fusion import FusionPlan

    r = one_layer_runner
    cuda = torch.device("cuda")
    proj = r.model.fusable_projections()
    assert r.fusion.fused(1) and r.fusion.fused(2) == L.SKINNY_PDL  # the runner's default plan
    assert len(proj) == 4 and all(p.dtype == torch.bfloat16 for p in proj)
    for rows, dtype, want in ((1, torch.bfloat16, True), (16, torch.bfloat16, True), (17, torch.bfloat16, False),
                              (4, torch.float16, False), (4, torch.float32, False)):
        assert FusionPlan.choose(proj, cuda, dtype, small_batches=True).fused(rows) == want, (rows, dtype)
    assert not FusionPlan.choose(proj, torch.device("cpu"), torch.bfloat16, small_batches=True).fused(1)
    assert not FusionPlan.choose(proj, cuda, torch.bfloat16, one_row=False, small_batches=False).fused(1)


def fused_and_unfused_decode(r, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step of `batch` seqs (after their prefills) on the fused layer path,
    then the same step on the unfused one (it rewrites the same KV slots)."""
    from services.worker.fusion import FusionPlan
    from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
    from tests.runner_driver import step_logits

    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (batch,), generator=g)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(batch)]
    step_logits(r, StepPlan(0, [ScheduledSeq(f"s{i}", p, 0, tables[i], True, greedy) for i, p in enumerate(prompts)]))
    decode = StepPlan(0, [ScheduledSeq(f"s{i}", [7 + i], len(p), tables[i], True, greedy, 1)
                          for i, p in enumerate(prompts)])
    default, cuda = r.fusion, torch.device("cuda")
    proj = r.model.fusable_projections()
    try:
        r.fusion = FusionPlan.choose(proj, cuda, torch.bfloat16, one_row=True, small_batches=True)
        assert r.fusion.fused(batch)
        fused = step_logits(r, decode)
        r.fusion = FusionPlan.choose(proj, cuda, torch.bfloat16, one_row=False, small_batches=False)
        assert not r.fusion.fused(batch)
        unfused = step_logits(r, decode)
    finally:
        r.fusion = default
    return fused, unfused


@pytest.mark.parametrize("batch", [1, 7, 16])
def test_one_decoder_layer_fused_matches_unfused_at_decode(one_layer_runner, batch):
    fused, unfused = fused_and_unfused_decode(one_layer_runner, batch)
    assert rel(fused, unfused) < TOL[torch.bfloat16]
    assert _counters_zero()


@pytest.fixture(scope="module")
def one_moe_layer_runner(tmp_path_factory):
    return one_layer(tmp_path_factory, "qwen3-30b-a3b", 0.3)


@pytest.mark.parametrize("batch", [1, 2, 4, 12])
def test_one_moe_layer_fused_matches_unfused_at_decode(one_moe_layer_runner, batch, monkeypatch):
    # the MoE layer on the fused path (SparseMoeBlock.forward_fused: the norm in the router's gemv,
    # xn_out for the experts, the residual in the decode path's down kernel; 12 tokens take the
    # five-launch MoE path and the add after it) against the unfused layer, same step
    from services.worker.models import qwen3_moe

    monkeypatch.setattr(qwen3_moe, "FUSE_MOE_LAYERS", True)  # whatever the default
    assert len(one_moe_layer_runner.model.fusable_projections()) == 3  # qkv, o, the router
    xn_calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton",
                        lambda *a, **kw: xn_calls.append(kw.get("xn_out") is not None) or real(*a, **kw))
    fused, unfused = fused_and_unfused_decode(one_moe_layer_runner, batch)
    assert any(xn_calls) == (batch <= gemv.ROWS)  # the router's gemv stored the experts' input
    assert rel(fused, unfused) < TOL[torch.bfloat16]
    assert _counters_zero()
