"""The fused skinny linear of `kernels/linear.py` (RMSNorm or SiLU-and-mul prologue, residual
epilogue, K-split partials summed by the last program of each tile) and the fused decoder
layer path of the Llama / Qwen3 models that uses it.

1. Under the Triton interpreter on CPU tensors (this file run as a script in a subprocess
   with TRITON_INTERPRET=1, as in test_kernels_triton_interp.py): each prologue x residual
   x K split (1, 2, 4; K = 300 divides by none of them) x M in {1, 3, 16}, N = 37 (odd,
   tiles of 16), fp32 and fp16, against `linear_ref` in the input dtype and in fp64 (the
   larger error counts); the in-kernel split sum equal bit for bit to the 2-kernel one and
   the tile counters zero after every launch (the K-loop kernel, `one_tile=False`; the
   one-tile kernel has test_skinny_pdl_interp.py); a tiny Llama (with biases), Qwen3 and
   Qwen3-MoE (a MoE and a dense layer; the router's gemv stores the experts' normalised input)
   whose fused layer path runs through the kernel, against their unfused path.
2. In this process: the dispatcher's argument errors, its CPU path against `linear_ref`, and
   the fused layer path forced on the CPU (reference ops) equal to the unfused path bit for
   bit, prefill and decode, every architecture.
Tolerances (relative norm error) as in test_kernels_triton_interp.py: fp32 1e-5, fp16 3e-3.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib

import pytest
import torch

from tests.interp_runner import run_interp_checks

TOL = {"float32": 1e-5, "float16": 3e-3}
DTYPES = ("float32", "float16")
PROLOGUES = ("plain", "norm", "silu")
N, K = 37, 300
SPLITS = (1, 2, 4)  # with BLOCK_K 32: k per split 300 / 160+140 / 96+96+96+12
ROWS = (1, 3, 16)
KERNEL_CASES = [f"{p}_{'res' if r else 'nores'}_s{s}_m{m}_{d}"
                for p, r, s, m, d in itertools.product(PROLOGUES, (False, True), SPLITS, ROWS, DTYPES)]
ARCHS = ("llama_bias", "qwen3", "qwen3_moe")
MODEL_CASES = [f"model_{arch}_{d}" for arch in ARCHS for d in DTYPES]
# projection launches a step on the fused path: 4 a dense layer; a MoE layer's qkv, o and router
# (its experts are kernels.moe's), so qwen3_moe (layer 0 MoE, layer 1 dense) has 3 + 4
PROJECTIONS = {"llama_bias": 8, "qwen3": 8, "qwen3_moe": 7}


def tiny_config(arch: str) -> dict:
    """config.json of a 2-layer model: GQA, odd-sized MLP; llama_bias has q/k/v/o and MLP biases;
    qwen3_moe's layer 0 is a MoE layer (6 experts of width 40, top 2, renormalised) and layer 1
    a dense one (mlp_only_layers)."""
    c = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "qwen3":
        return {**c, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    if arch == "qwen3_moe":
        return {**c, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 6,
                "num_experts_per_tok": 2, "moe_intermediate_size": 40, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    return {**c, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True,
            "mlp_bias": True}


def tiny_runner(folder: pathlib.Path, arch: str, dtype: str):
    """A CPU ModelRunner of tiny_config(arch) with seeded weights, norm weights and biases
    that are not 1 and 0 (so that a norm or bias applied twice, or not at all, shows)."""
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(tiny_config(arch)))
    runner = ModelRunner(build_config(cli={"model": str(folder), "device": "cpu", "dtype": dtype,
                                           "load_format": "dummy", "seed": 3, "kv_cache_gib": 0.01,
                                           "block_size": 4}, env={}))
    from services.worker.loader import dense_weights

    g = torch.Generator().manual_seed(5)
    with torch.no_grad(), dense_weights(runner.model):
        for name, p in runner.model.named_parameters():
            if p.dim() == 1:
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return runner


def run_steps(runner) -> list[torch.Tensor]:
    """Logits of a 9-token prefill and 3 greedy decode steps of one sequence (fresh KV writes)."""
    from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
    from tests.runner_driver import step_logits

    greedy = SamplingParams(temperature=0.0)
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(8))
    out = [step_logits(runner, StepPlan(0, [ScheduledSeq("r", prompt, 0, table, True, greedy)]))[0]]
    for i in range(3):
        tok = int(out[-1].argmax())
        out.append(step_logits(runner, StepPlan(0, [ScheduledSeq("r", [tok], 9 + i, table, True, greedy, i + 1)]))[0])
    return out


# ---------------------------------------------------------------- 1. interpreter (subprocess)

@pytest.fixture(scope="module")
def interp_results() -> dict:
    pytest.importorskip("triton")
    return run_interp_checks(__file__, timeout_s=600)  # this file, main()


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_fused_skinny_kernel_matches_reference_under_interpreter(interp_results, case):
    r = interp_results[case]
    assert r["err"] <= TOL[case.rsplit("_", 1)[1]], f"{case}: relative error {r['err']}"
    assert r["counters_zero"], f"{case}: a tile counter was left non-zero"
    if r["splits"] > 1:  # the last-arriving program's sum is the 2-kernel sum, bit for bit
        assert r["equal_to_two_kernel_path"], case


def test_interpreter_cases_really_split_k(interp_results):
    assert {interp_results[c]["splits"] for c in KERNEL_CASES} == set(SPLITS)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_fused_layer_path_through_the_kernel_matches_unfused_path_under_interpreter(interp_results, case):
    r = interp_results[case]
    arch = case[len("model_"):].rsplit("_", 1)[0]
    # the projections x 4 steps; without the gemv a MoE router norms apart (xn_out) and its plain
    # projection takes the dispatcher's plain path, F.linear for these CPU tensors
    want = (PROJECTIONS[arch] - (arch == "qwen3_moe")) * 4
    assert r["kernel_calls"] >= want and r["gemv_calls"] == 0, r
    assert 0 < r["split_calls"] < r["kernel_calls"], r  # o_proj and down_proj split K, the others not
    assert r["err"] <= TOL[case.rsplit("_", 1)[1]], f"{case}: relative error {r['err']}"


@pytest.mark.parametrize("case", MODEL_CASES)
def test_fused_layer_path_at_one_row_through_gemv_matches_unfused_path_under_interpreter(interp_results, case):
    # the 3 one-row decode steps take kernels.gemv with the norm prologue and residual
    # epilogue; the 9-token prefill the skinny kernel
    r = interp_results[case.replace("model_", "model_gemv_")]
    arch = case[len("model_"):].rsplit("_", 1)[0]
    # (the prefill's MoE router: the norm apart and F.linear, as in the skinny case)
    assert r["gemv_calls"] == PROJECTIONS[arch] * 3 and r["kernel_calls"] == PROJECTIONS[arch] - (arch == "qwen3_moe"), r
    if arch == "qwen3_moe":  # the router's gemv stored the normalised rows the experts read
        assert r["xn_out_calls"] == 3, r
    assert 0 < r["gemv_split_calls"] < r["gemv_calls"], r
    assert r["err"] <= TOL[case.rsplit("_", 1)[1]], f"{case}: relative error {r['err']}"


# ---------------------------------------------------------------- 2. in process (no Triton)

def test_linear_rejects_two_prologues_and_misfitting_tensors():
    from kernels.linear import linear

    x, w = torch.randn(2, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="both prologues"):
        linear(torch.randn(2, 16), w, norm_weight=torch.ones(8), silu_mul=True)
    with pytest.raises(ValueError, match="2K columns"):
        linear(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="norm_weight"):
        linear(x, w, norm_weight=torch.ones(7))
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, residual=torch.randn(2, 5, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cpu_path_with_fused_steps_equals_the_formula(dtype):
    from kernels.linear import linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 24, generator=g).to(dtype)
    w = torch.randn(7, 12, generator=g).to(dtype)
    b = torch.randn(7, generator=g).to(dtype)
    nw = (1 + 0.2 * torch.randn(24, generator=g)).to(dtype)
    r = torch.randn(3, 7, generator=g).to(dtype)
    # the formula written out in fp64 with the reference's roundings to the dtype
    gate, up = x.double().chunk(2, -1)
    act = ((gate * torch.sigmoid(gate)).to(dtype).double() * up).to(dtype)
    want = ((act.double() @ w.double().T + b.double()).to(dtype).double() + r.double()).to(dtype)
    got = linear(x, w, b, silu_mul=True, residual=r)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((got.double() - want.double()).norm() / want.double().norm()) < tol
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    xn = (xn.to(dtype).double() * nw.double()).to(dtype)
    w2 = torch.randn(7, 24, generator=g).to(dtype)
    want = (xn.double() @ w2.double().T).to(dtype)
    got = linear(x, w2, norm_weight=nw, eps=1e-5)
    assert float((got.double() - want.double()).norm() / want.double().norm()) < tol


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layer_path_forced_on_cpu_equals_unfused_path_bit_for_bit(arch, tmp_path, monkeypatch):
    from services.worker.fusion import FusionPlan

    runner = tiny_runner(tmp_path / arch, arch, "float32")
    assert runner.fusion.rows == frozenset() and not runner.fusion.fused(1)  # the CPU keeps the unfused path
    unfused = run_steps(runner)
    monkeypatch.setattr(runner, "fusion", FusionPlan(None))  # every step on the fused path
    fused = run_steps(runner)
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the interpreter run

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel_checks(out: dict) -> None:
    from kernels import linear as L
    from kernels.device_info import TILE_COUNTERS

    real_sum = L._split_sum_kernel

    class _Forbidden:  # the atomic path must not launch the 2-kernel path's sum kernel
        def __getitem__(self, grid):
            raise AssertionError("split-sum kernel launched on the atomic path")

    g = torch.Generator().manual_seed(0)
    for pro, res, split, m, dname in itertools.product(PROLOGUES, (False, True), SPLITS, ROWS, DTYPES):
        dt = getattr(torch, dname)
        cols = 2 * K if pro == "silu" else K
        x = torch.randn(m, cols + 6, generator=g).to(dt)[:, 3:cols + 3]  # a row-strided view
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
        kw = {"silu_mul": pro == "silu"}
        if pro == "norm":
            kw["norm_weight"] = (1 + 0.3 * torch.randn(K, generator=g)).to(dt)
            kw["eps"] = 1e-5
        if res:
            kw["residual"] = torch.randn(m, N, generator=g).to(dt)
        bias = torch.randn(N, generator=g).to(dt) if m != 1 else None
        tiles = dict(block_n=16, block_k=32, split_k=split)
        L._split_sum_kernel = _Forbidden()
        try:
            got = L.skinny_linear_triton(x, w, bias, split_reduce="atomic", one_tile=False, **tiles, **kw)
        finally:
            L._split_sum_kernel = real_sum
        counters_zero = all(bool((c == 0).all()) for c in TILE_COUNTERS.values())
        two_kernel = L.skinny_linear_triton(x, w, bias, split_reduce="kernel", one_tile=False, **tiles, **kw)
        ref = L.linear_ref(x, w, bias, **kw)
        d64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw.items()}
        ref64 = L.linear_ref(x.double(), w.double(), None if bias is None else bias.double(), **d64)
        k_per = _cdiv(_cdiv(K, split), 32) * 32  # as skinny_linear_triton plans it
        out[f"{pro}_{'res' if res else 'nores'}_s{split}_m{m}_{dname}"] = {
            "err": max(_rel(got, ref), _rel(got, ref64)), "counters_zero": counters_zero,
            "equal_to_two_kernel_path": bool(torch.equal(got, two_kernel)), "splits": _cdiv(K, k_per)}


def _model_checks(out: dict, tmp: pathlib.Path) -> None:
    from kernels import linear as L
    from services.worker.fusion import FusionPlan
    from services.worker.layers.linear import Linear, unpack_cpu_weights

    from kernels import gemv

    calls = {"kernel": 0, "split": 0, "gemv": 0, "gemv_split": 0, "xn_out": 0}
    real, real_gemv = L.skinny_linear_triton, gemv.gemv_triton

    def counting(x, weight, *a, **kw):
        calls["kernel"] += 1
        calls["split"] += L.skinny_plan(x.shape[0], *weight.shape, x.device)[2] > 1
        return real(x, weight, *a, **kw)

    def counting_gemv(x, weight, *a, **kw):
        calls["gemv"] += 1
        calls["xn_out"] += kw.get("xn_out") is not None
        calls["gemv_split"] += gemv.gemv_plan(*weight.shape, x.device)[1] > 1
        return real_gemv(x, weight, *a, **kw)

    # K tiles of 32 and 2 programs per (interpreter) SM: o_proj and down_proj split K in 2;
    # gemv: K ranges of at most 64 columns, so rows of 128 and more split
    L.SKINNY_TUNING.update(block_k=32, programs_per_sm=2)
    gemv.TUNING.update(max_block_k=64)
    L.SKINNY_PDL = False  # the K-loop kernel (the one-tile one: tests/unit/skinny_pdl_interp_checks.py)
    for arch, dname, one_row in itertools.product(ARCHS, DTYPES, ("skinny", "gemv")):
        runner = tiny_runner(tmp / f"{arch}_{dname}_{one_row}", arch, dname)
        unpack_cpu_weights(runner.model)  # the kernel wants dense row-major weights (as on the GPU)
        for mod in runner.model.modules():
            if isinstance(mod, Linear):
                mod.weight.data = mod.weight.data.contiguous()
        unfused = run_steps(runner)
        saved = (L.skinny_applies, L.skinny_linear_triton, runner.fusion, gemv.gemv_triton, gemv.ENABLED)
        L.skinny_applies = lambda x, w: x.dim() == 2 and 0 < x.shape[0] <= L.SKINNY_MAX_ROWS
        L.skinny_linear_triton, gemv.gemv_triton = counting, counting_gemv
        gemv.ENABLED = one_row == "gemv"  # one row: the gemv kernel, or the skinny one
        runner.fusion = FusionPlan(frozenset(range(1, L.SKINNY_MAX_ROWS + 1)))
        calls.update(kernel=0, split=0, gemv=0, gemv_split=0, xn_out=0)
        try:
            fused = run_steps(runner)
        finally:
            L.skinny_applies, L.skinny_linear_triton, runner.fusion, gemv.gemv_triton, gemv.ENABLED = saved
        name = f"model_{arch}_{dname}" if one_row == "skinny" else f"model_gemv_{arch}_{dname}"
        out[name] = {"err": max(_rel(a, b) for a, b in zip(fused, unfused)), "kernel_calls": calls["kernel"],
                     "split_calls": calls["split"], "gemv_calls": calls["gemv"], "gemv_split_calls": calls["gemv_split"],
                     "xn_out_calls": calls["xn_out"]}


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
