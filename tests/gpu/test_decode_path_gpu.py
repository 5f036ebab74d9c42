"""The batch-1 decode path on the GPU: the one-row matrix-vector kernel (`kernels.gemv`)
against `linear_ref`; decode attention with the rotary and the KV write fused in
(`kernels.rope_decode`) against the rotary reference then the attention reference; and a
decoder layer's kernels launched with programmatic dependent launch (`kernels.pdl`) inside
a CUDA graph against the same kernels launched without it (bit for bit) and the torch
references.

PDL lets a kernel start before the one before it has finished; a kernel that read its
input before its wait would read stale data. The layer test poisons, before every replay,
what the kernels of the step write (the new token's KV slot, the inputs) so that such a
read would show. Skipped without CUDA or triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import activation, attention, device_info, gemv, linear, norm, pdl, rope_decode, rotary  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,plan", [(4096, 1024, {}), (1024, 3072, {}), (151, 577, {}),
                                      (1024, 3072, {"split": 3, "block_n": 8}),
                                      (6144, 1024, {"split": 4, "block_n": 2}), (7, 9000, {}),
                                      (1000, 2048, {"block_n": 32, "num_warps": 8})])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gemv_matches_reference(dtype, n, k, plan, use_pdl):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    for bias in (None, b):
        y = gemv.gemv_triton(x, w, bias, pdl=use_pdl, **plan)
        ref = linear.linear_ref(x.float(), w.float(), None if bias is None else bias.float())
        assert y.shape == (1, n) and y.dtype == dtype
        assert rel(y, ref) < TOL[dtype]
    gu = torch.randn(1, 2 * k, device="cuda", dtype=dtype)  # x = cat(gate, up) for the SiLU-and-mul
    ref = linear.linear_ref(gu.float(), w.float(), b.float(), silu_mul=True)
    assert rel(gemv.gemv_triton(gu, w, b, silu_mul=True, pdl=use_pdl, **plan), ref) < TOL[dtype]
    torch.cuda.synchronize()
    assert all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())


def test_linear_dispatches_one_row_to_gemv_and_more_rows_elsewhere(monkeypatch):
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a, **kw: calls.append(kw.get("silu_mul", False))
                        or real(*a, **kw))
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    for m in (1, 2):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        assert rel(linear.linear(x, w), linear.linear_ref(x.float(), w.float())) < TOL[torch.bfloat16]
        gu = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        assert rel(linear.linear(gu, w, silu_mul=True),
                   linear.linear_ref(gu.float(), w.float(), silu_mul=True)) < TOL[torch.bfloat16]
    assert calls == [False, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,bs,qk_norm", [(1, 16, True), (3, 32, False), (64, 16, True), (256, 16, True)])
def test_rope_decode_matches_rotary_then_attention_reference(dtype, batch, bs, qk_norm):
    torch.manual_seed(batch)
    hq, hk, d = 16, 8, 128
    lens = torch.randint(1, 2100, (batch,)).tolist()
    lens[0] = bs  # the token ends a block
    if batch > 2:
        lens[1], lens[2] = 1, bs + 1  # the first token of a sequence; one past a block boundary
    nb = sum(-(-n // bs) for n in lens) + 2
    perm = torch.randperm(nb).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pos = (sl - 1).long()
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)], device="cuda")
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 1e6), 4096).cuda()
    qn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype) if qk_norm else None
    kn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype) if qk_norm else None
    qkv = torch.randn(batch, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    kc0 = torch.randn(nb, bs, hk, d, device="cuda", dtype=dtype)
    vc0 = torch.randn_like(kc0)
    kc, vc = kc0.clone(), vc0.clone()
    q, k, v = (t.view(batch, -1, d) for t in qkv.clone().split([hq * d, hk * d, hk * d], -1))
    got = rope_decode.rope_paged_decode(q, k, v, pos, table, kc, vc, slots, None, sl, bt, d ** -0.5,
                                        qn, kn, 1e-6, None, 4096)
    up = (lambda t: None if t is None else t.float())
    q, k, v = (t.view(batch, -1, d).float() for t in qkv.split([hq * d, hk * d, hk * d], -1))
    q, k = q.contiguous(), k.contiguous()
    rkc, rvc = kc0.float(), vc0.float()
    rotary.rotary_and_store_kv_ref(q, k, v, pos, table, rkc, rvc, slots, up(qn), up(kn), 1e-6)
    ref = attention.paged_attention_ref(q, rkc, rvc, torch.arange(batch + 1, dtype=torch.int32), sl.cpu(),
                                        bt, d ** -0.5)
    tol = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    assert rel(got, ref) < tol
    assert rel(kc, rkc) < tol and rel(vc, rvc) < tol


def _layer_inputs(dtype=torch.bfloat16, hid=1024, hq=16, hk=8, d=128, inter=3072, ctx=1000, bs=16):
    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)
    nblocks = -(-(ctx + 1) // bs) + 4
    p = {
        "h": rnd(1, hid), "res": rnd(1, hid),
        "ln1": 1 + rnd(hid, scale=0.1), "ln2": 1 + rnd(hid, scale=0.1),
        "qn": 1 + rnd(d, scale=0.1), "kn": 1 + rnd(d, scale=0.1),
        "wqkv": rnd((hq + 2 * hk) * d, hid, scale=hid ** -0.5), "wo": rnd(hid, hq * d, scale=(hq * d) ** -0.5),
        "wgu": rnd(2 * inter, hid, scale=hid ** -0.5), "wd": rnd(hid, inter, scale=inter ** -0.5),
        "kc": rnd(nblocks, bs, hk, d), "vc": rnd(nblocks, bs, hk, d),
        "table": torch.randperm(nblocks, device="cuda", generator=g)[None, :].to(torch.int32),
        "cos_sin": rotary.rope_cos_sin(rotary.rope_inv_freq(d, 1e6), 4096).cuda(),
        "pos": torch.tensor([ctx], device="cuda"), "seq_lens": torch.tensor([ctx + 1], device="cuda", dtype=torch.int32),
        "cu": torch.tensor([0, 1], device="cuda", dtype=torch.int32),
    }
    slot = int(p["table"][0, ctx // bs]) * bs + ctx % bs
    p["slot"] = torch.tensor([slot], device="cuda")
    p["dims"] = (hq, hk, d)
    return p


def _layer(p, ref=False):
    """One Qwen3-style decoder layer at batch 1 (the kernels' dispatchers, or the torch
    references in fp32 with ref=True) -> (mlp output, residual)."""
    hq, hk, d = p["dims"]
    f = (lambda t: t.float()) if ref else (lambda t: t)
    lin = linear.linear_ref if ref else linear.linear
    if ref:
        x, r = norm.fused_add_rms_norm_ref(f(p["h"]), f(p["res"]), f(p["ln1"]), 1e-6)
    else:
        x, r = norm.fused_add_rms_norm(p["h"], p["res"], p["ln1"], 1e-6)
    qkv = lin(x, f(p["wqkv"]))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], -1)
    q, k, v = q.reshape(1, hq, d), k.reshape(1, hk, d), v.reshape(1, hk, d)
    kc, vc = (p["kc"].float(), p["vc"].float()) if ref else (p["kc"], p["vc"])
    if ref:
        q, k = q.contiguous(), k.contiguous()
        rotary.rotary_and_store_kv_ref(q, k, v, p["pos"], p["cos_sin"], kc, vc, p["slot"], f(p["qn"]),
                                       f(p["kn"]), 1e-6)
        o = attention.paged_attention_ref(q, kc, vc, p["cu"].cpu(), p["seq_lens"].cpu(), p["table"], d ** -0.5)
    else:  # as the model's decode step: the fused kernel
        o = rope_decode.rope_paged_decode(q, k, v, p["pos"], p["cos_sin"], kc, vc, p["slot"], p["cu"],
                                          p["seq_lens"], p["table"], d ** -0.5, p["qn"], p["kn"], 1e-6,
                                          None, 4096)
    o = lin(o.reshape(1, hq * d), f(p["wo"]))
    if ref:
        x, r = norm.fused_add_rms_norm_ref(o, r, f(p["ln2"]), 1e-6)
        return lin(activation.silu_and_mul_ref(lin(x, f(p["wgu"]))), f(p["wd"])), r
    x, r = norm.fused_add_rms_norm(o, r, p["ln2"], 1e-6)
    return lin(lin(x, p["wgu"]), p["wd"], silu_mul=True), r  # as LlamaMLP at one row


def test_decode_layer_in_a_pdl_graph_equals_the_layer_without_pdl_and_the_reference(monkeypatch):
    p = _layer_inputs()
    slot = int(p["slot"])
    kc_flat, vc_flat = p["kc"].view(-1, *p["kc"].shape[2:]), p["vc"].view(-1, *p["vc"].shape[2:])
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.use_pdl(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _layer(p)  # warm-up: compiles, allocates the split counters
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _layer(p)
    g = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(4):
        p["h"].copy_(torch.randn(p["h"].shape, device="cuda", generator=g))
        p["res"].copy_(torch.randn(p["res"].shape, device="cuda", generator=g))
        kc_flat[slot].fill_(30.0)  # stale K/V at the new token's slot: the step overwrites it
        vc_flat[slot].fill_(-30.0)
        kv0 = (p["kc"].clone(), p["vc"].clone())
        graph.replay()
        torch.cuda.synchronize()
        got = (out.clone(), res.clone(), p["kc"].clone(), p["vc"].clone())
        # the same layer eagerly without PDL, from the same state
        p["kc"].copy_(kv0[0])
        p["vc"].copy_(kv0[1])
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = _layer(p)
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2], p["kc"]) and torch.equal(got[3], p["vc"])
        p["kc"].copy_(kv0[0])
        p["vc"].copy_(kv0[1])
        ref, _ = _layer(p, ref=True)
        assert rel(got[0], ref) < 3e-2
