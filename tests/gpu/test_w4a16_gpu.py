"""4-bit weights (W4A16) on CUDA (kernels/w4a16_linear.py, kernels/w4a16_gemv.py,
kernels/w4a16_gemm.py; docs/ARCHITECTURE.md §6.4):

- the decode kernels (1..16 rows: the one-row kernel, the dot kernel) and the GEMM kernel
  (17+ rows) at M = 1, 2, 5, 16, 17, 64, 300 on Llama-3.1-8B's shapes, a ragged N, a
  per-channel group and a group size that needs gathered scales, against
  `w4a16_linear_ref` (fp32 product of the dequantized weight), with forced K splits (both
  split sums, the in-kernel one and the second kernel's, and any partials loaded at a time,
  `sum_chunk`, giving the same bits), with and
  without programmatic dependent launch, the dot kernel with its fp32 dequantization
  instead of the bf16 magic numbers, and the dispatcher's choice by M;
- all of them in a CUDA graph: replays equal eager;
- a tiny AWQ checkpoint (tests/unit/test_w4a16_checkpoint.py's writer) found from its
  config.json on CUDA (--quantization none): packed weights, logits against its meaning in bf16;
- a 4-layer Qwen3-0.6B-shaped model (dummy weights) with --quantization awq: random packed
  weights, decode and prefill logits against the same runner with its weights dequantized to
  bf16 (`loader.dense_weights`), CUDA-graph decode equal to eager, the weight bytes held.
Measured errors are recorded (`record_property`, pytest --junitxml keeps them) to tighten the
bounds, which are estimates (no GPU run when written): bf16 output 2^-8 relative, plus the
dequantized weight rounded to bf16 before tl.dot (2+ rows). Skipped without CUDA or triton.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import w4a16_gemm, w4a16_gemv  # noqa: E402
from kernels import w4a16_linear as W  # noqa: E402
from tests.gpu.test_kernels_gpu import _seed, rel  # noqa: E402,F401  (the same check and seed)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = 1e-2  # bf16 output (and bf16-rounded weight on the dot path) against the fp32 reference
MS = [1, 2, 5, 16, 17, 64, 300]
# (N, K, G): qkv, o, gate_up, down of Llama-3.1-8B at every M; a ragged N with bias, per channel
# (G = K) and gathered scales (G = 24) at fewer M (each shape compiles its own specializations)
LLAMA = [(6144, 4096, 128), (4096, 4096, 128), (28672, 4096, 128), (4096, 14336, 128)]
ODD = [(1000, 1024, 64), (512, 768, 768), (264, 384, 24)]
CASES = [(m, *s) for s in LLAMA for m in MS] + [(m, *s) for s in ODD for m in (1, 5, 64)]


def _weight(n: int, k: int, g: int) -> W.W4Weight:
    return W.W4Weight.quantize(torch.randn(n, k, device="cuda") / k ** 0.5, g)


def test_dispatcher_has_the_triton_kernels():
    assert w4a16_gemv.w4_gemv_triton is not None and w4a16_gemm.w4_gemm_triton is not None


@pytest.mark.parametrize("m,n,k,g", CASES)
def test_kernels_match_reference(m, n, k, g, record_property):
    w = _weight(n, k, g)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16() if n == 1000 else None
    want = W.w4a16_linear_ref(x, w, bias)
    got = W.w4a16_linear(x, w, bias)
    err = rel(got, want)
    record_property("rel_err", err)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n) and err < TOL
    if m <= 16:
        for split in (1, 3):
            got = w4a16_gemv.w4_gemv_triton(x, w.qweight, w.zeros, w.scales, g, bias, config={"split": split})
            assert rel(got, want) < TOL
            if split > 1:  # the second-kernel sum, no PDL, other partials a load: the same bits
                for cfg in ({"split_sum": "kernel"}, {"pdl": False}, {"sum_chunk": 1},
                            {"sum_chunk": 2, "split_sum": "kernel"}):
                    other = w4a16_gemv.w4_gemv_triton(x, w.qweight, w.zeros, w.scales, g, bias,
                                                      config={"split": split, **cfg})
                    assert torch.equal(other, got), cfg
            if m > 1:  # the dot kernel's fp32 dequantization instead of the bf16 magic numbers
                alt = w4a16_gemv.w4_gemv_triton(x, w.qweight, w.zeros, w.scales, g, bias,
                                                config={"split": split, "magic16": False})
                assert rel(alt, want) < TOL
    else:
        assert rel(w4a16_gemm.w4_gemm_triton(x, w.qweight, w.zeros, w.scales, g, bias,
                                             tuning={"block_m": 32, "block_n": 128, "block_k": 32}), want) < TOL


@pytest.mark.parametrize("m", [1, 16, 17])
def test_dispatcher_picks_by_rows(m):
    w = _weight(1024, 2048, 128)
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    f = w4a16_gemv.w4_gemv_triton if m <= W.SKINNY_MAX_ROWS else w4a16_gemm.w4_gemm_triton
    assert torch.equal(W.w4a16_linear(x, w), f(x, w.qweight, w.zeros, w.scales, 128))
    assert W.w4a16_linear(x[:0], w).shape == (0, 1024)


@pytest.mark.parametrize("m", [1, 2, 8, 64])
def test_kernels_replay_in_a_cuda_graph(m):
    w = _weight(4096, 4096, 128)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    eager = W.w4a16_linear(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        W.w4a16_linear(x, w)  # warm-up (compiles) outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = W.w4a16_linear(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, W.w4a16_linear(x, w)) and rel(out, eager) > 0.5  # computed from the new x


@pytest.fixture(autouse=True)
def _restore_schemes(monkeypatch):
    """A runner sets the process's weight schemes: restored after each test."""
    from kernels import fp8_linear

    monkeypatch.setattr(W, "MODE", "off")
    monkeypatch.setattr(fp8_linear, "MODE", "off")


def _runner(d, **kw):
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    cli = {"model": str(d), "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 16, "max_model_len": 1024,
           "gpu_memory_utilization": 0.2, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


def test_awq_checkpoint_found_from_its_config_runs_packed(tmp_path, record_property):
    from services.worker.layers.linear import Linear
    from tests.unit.test_w4a16_checkpoint import _checkpoints, _logits

    quantized, reference, _ = _checkpoints(tmp_path, "awq")
    want = _logits(_runner(reference, max_model_len=128))  # the tiny config's 256 positions
    r = _runner(quantized, max_model_len=128)
    rep = r.report()
    assert rep["quantization"] == "awq" and rep["weight_format"].endswith("from the checkpoint (W4A16)")
    assert all(isinstance(m.qweight, W.W4Weight) for m in r.model.modules() if isinstance(m, Linear))
    err = rel(_logits(r), want)
    record_property("checkpoint_logits_rel_err", err)
    assert err < 3e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    d = tmp_path_factory.mktemp("qwen3w4")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_model_with_dummy_awq_weights_end_to_end(model_dir, record_property):
    from services.worker.layers.linear import Linear
    from services.worker.loader import dense_weights
    from tests.gpu.test_fp8_linear_gpu import _plans
    from tests.runner_driver import generate, step_logits

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (100, 1, 37)]
    prefill, decode = _plans(prompts)
    r = _runner(model_dir, load_format="dummy", quantization="awq")
    rep = r.report()
    assert rep["quantization"] == "awq" and "random packed" in rep["weight_format"]
    assert r.fusion.rows == frozenset()  # quantized projections take the unfused layer path
    lins = [m for m in r.model.modules() if isinstance(m, Linear)]
    assert lins and all(isinstance(m.qweight, W.W4Weight) and m.weight.device.type == "meta" for m in lins)
    proj = sum(m.weight.numel() for m in lins)
    assert sum(m.qweight.nbytes for m in lins) < proj * 0.55  # 4 bits + fp16 scales / uint8 zeros per 128
    with_graphs = generate(r, prompts, 8)
    graphs, r.graphs = r.graphs, None
    assert graphs is not None and generate(r, prompts, 8) == with_graphs
    p4, d4 = step_logits(r, prefill), step_logits(r, decode)
    with torch.no_grad(), dense_weights(r.model):  # the packed weights' own values, in bf16
        pd, dd = step_logits(r, prefill), step_logits(r, decode)
    errs = {"decode_vs_dequantized": rel(d4, dd), "prefill_vs_dequantized": rel(p4, pd)}
    for k, v in errs.items():
        record_property(k, v)
    assert errs["decode_vs_dequantized"] < 5e-2 and errs["prefill_vs_dequantized"] < 5e-2
