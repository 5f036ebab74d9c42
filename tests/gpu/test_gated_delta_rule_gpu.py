"""fla-core's gated delta rule kernels, through `kernels.gated_delta_rule`'s dispatchers, against
the torch references on CUDA, at Qwen3-Next's shape (K = V = 128, 16 key heads, 32 value
heads): a prefill of 1,000 tokens (one sequence, and a varlen batch of three) from nonzero
initial states, its final states, and one decode step from the carried states. Then the
`GatedDeltaNet` layer on the CUDA path (fla's chunked prefill, kernels/gdn_decode.py's decode) against the
same layer on the references.

Tolerances: relative norm error against the recurrent reference run in fp32 on the same
(upcast) inputs: bf16 1e-2, fp32 5e-3 (fla's fp32 dots run in tf32; issue 16 saw 3e-3 and
1.5e-3 on an H200 with torch 2.11, Triton 3.6, fla-core 0.6.0). NaN never passes.
Skipped without CUDA or without fla-core (the `gpu` extra).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernels import gated_delta_rule as gdr  # noqa: E402

if gdr.fla_ops() is None:
    pytest.skip("needs fla-core", allow_module_level=True)

from kernels import gdn_decode, norm  # noqa: E402
from services.worker.layers.gated_deltanet import GatedDeltaNet  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float32: 5e-3}
K = V = 128
HK, HV = 16, 32


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fla_calls(monkeypatch):
    """Counts the dispatchers' calls into fla (chunk, recurrent): proves the fla path ran."""
    chunk, rec = gdr.fla_ops()
    calls = {"chunk": 0, "recurrent": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(gdr, "_FLA", (counted("chunk", chunk), counted("recurrent", rec)))
    return calls


def _inputs(t, n, dtype):
    dev = "cuda"
    q = torch.randn(1, t, HK, K, device=dev, dtype=dtype)
    k = torch.randn(1, t, HK, K, device=dev, dtype=dtype)
    v = torch.randn(1, t, HV, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(1, t, HV, device=dev))  # fp32 log decays, as the layer makes them
    beta = torch.randn(1, t, HV, device=dev).sigmoid().to(dtype)
    h0 = 0.1 * torch.randn(n, HV, K, V, device=dev)
    return q, k, v, g, beta, h0


def _ref_per_seq(q, k, v, g, beta, h0, cu):
    """The recurrent reference in fp32, one sequence at a time (the truth)."""
    os, ss = [], []
    for i in range(len(cu) - 1):
        lo, hi = cu[i], cu[i + 1]
        o, s = gdr.gated_delta_rule_recurrent_ref(*(x[:, lo:hi].float() for x in (q, k, v, g, beta)),
                                                  h0[i:i + 1], None, True)
        os.append(o)
        ss.append(s)
    return torch.cat(os, dim=1), torch.cat(ss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [(1000,), (1, 377, 622)])
def test_fla_prefill_state_and_decode_match_reference(dtype, lens, fla_calls):
    n, t = len(lens), sum(lens)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v, g, beta, h0 = _inputs(t, n, dtype)
    o, s = gdr.gated_delta_rule_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                                        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"))
    assert fla_calls["chunk"] == 1
    assert o.shape == v.shape and o.dtype == dtype and s.shape == (n, HV, K, V) and s.dtype == torch.float32
    o_r, s_r = _ref_per_seq(q, k, v, g, beta, h0, cu)
    assert rel(o, o_r) < TOL[dtype], rel(o, o_r)
    assert rel(s, s_r) < TOL[dtype], rel(s, s_r)

    # one decode token per sequence, from the carried (fla) state
    q1, k1, v1, g1, beta1, _ = _inputs(n, n, dtype)
    q1, k1, v1, g1, beta1 = (x.transpose(0, 1) for x in (q1, k1, v1, g1, beta1))  # [N, 1, ...]
    od, sd = gdr.gated_delta_rule_decode(q1, k1, v1, g1, beta1, initial_state=s, use_qk_l2norm=True)
    assert fla_calls["recurrent"] == 1
    od_r, sd_r = gdr.gated_delta_rule_recurrent_ref(*(x.float() for x in (q1, k1, v1, g1, beta1)), s, None, True)
    assert od.shape == v1.shape and od.dtype == dtype
    assert rel(od, od_r) < TOL[dtype], rel(od, od_r)
    assert rel(sd, sd_r) < TOL[dtype], rel(sd, sd_r)


def test_layer_on_fla_matches_layer_on_references(monkeypatch):
    """Qwen3-Next's layer shape (hidden 2048), bf16, random weights: a varlen prefill of three
    sequences (one continuing a state) and a decode step, the CUDA path (fla's chunked
    prefill, the in-place decode kernels, the gated-norm kernel) against references."""
    dtype, dev = torch.bfloat16, torch.device("cuda")
    with dev:
        torch.set_default_dtype(dtype)
        try:
            layer = GatedDeltaNet(2048, HK, HV, K, V, 4, 1e-6)
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in (layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, layer.out_proj.weight):
            p.normal_(0, 0.02)
        layer.conv1d.weight.normal_(0, 0.3)
        layer.A_log.copy_(torch.empty(HV, device=dev).uniform_(0.05, 1.0).log())
        layer.dt_bias.normal_()
        layer.norm.weight.copy_(1 + 0.2 * torch.randn(V, device=dev))
    conv_shape, ssm_shape = layer.state_shapes()
    cu = torch.tensor([0, 300, 301, 365], dtype=torch.int32, device=dev)
    x = torch.randn(365, 2048, device=dev, dtype=dtype)
    x1 = torch.randn(3, 2048, device=dev, dtype=dtype)
    conv0 = torch.randn(3, *conv_shape.shape, device=dev, dtype=conv_shape.dtype)
    ssm0 = 0.1 * torch.randn(3, *ssm_shape.shape, device=dev, dtype=ssm_shape.dtype)
    has = torch.tensor([False, True, False], device=dev)

    def run():
        conv, ssm = conv0.clone(), ssm0.clone()
        with torch.no_grad():
            out = layer(x, cu, conv, ssm, has)
            out1 = layer(x1, torch.arange(4, dtype=torch.int32, device=dev), conv, ssm, None)
        return out, out1, conv, ssm

    got = run()
    monkeypatch.setattr(gdr, "_FLA", False)  # the references, on the same device
    monkeypatch.setattr(gdn_decode, "ENABLED", False)  # ... for the decode step too (kernels/gdn_decode.py)
    monkeypatch.setattr(norm, "GATED_TRITON", False)
    want = run()
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2, rel(a, b)
