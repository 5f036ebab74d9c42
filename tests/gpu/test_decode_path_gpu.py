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

from kernels import (activation, attention, decode_merge, device_info, gemv, linear, norm, pdl,  # noqa: E402
                     rope_decode, rotary)
from tests.launch_count import LaunchCount  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 5, 8, 16])
@pytest.mark.parametrize("n,k,plan", [(4096, 1024, {}), (1024, 3072, {}), (151, 577, {}),
                                      (6144, 1024, {"split": 4, "block_n": 2})])
def test_gemv_rows_equal_one_row_launches_and_reference(dtype, m, n, k, plan):
    """gemv over M rows (gemv.ROWS, verify steps at batch 1): every fused step, each row bit
    for bit the one-row launch's, all within the float reference's tolerance, counters zeroed."""
    torch.manual_seed(n + k + m)
    x = torch.randn(m, k + 8, device="cuda", dtype=dtype)[:, 4:k + 4]  # a row-strided view
    gu = torch.randn(m, 2 * k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    res = torch.randn(m, n, device="cuda", dtype=dtype)
    nw = 1 + 0.3 * torch.randn(k, device="cuda", dtype=dtype)
    for xin, fused in ((x, {"bias": b}), (gu, {"silu_mul": True, "residual": res}),
                       (x, {"norm_weight": nw, "eps": 1e-6, "residual": res})):
        y = gemv.gemv_triton(xin, w, **fused, pdl=True, **plan)
        f32 = {a: (v.float() if torch.is_tensor(v) else v) for a, v in fused.items()}
        assert y.shape == (m, n) and rel(y, linear.linear_ref(xin.float(), w.float(), **f32)) < TOL[dtype]
        for i in range(m):
            one = {a: (v[i:i + 1] if a == "residual" else v) for a, v in fused.items()}
            assert torch.equal(y[i:i + 1], gemv.gemv_triton(xin[i:i + 1], w, **one, pdl=True, **plan))
    torch.cuda.synchronize()
    assert all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())


def test_linear_takes_gemv_up_to_gemv_rows(monkeypatch):
    """With gemv.ROWS = 8 `linear` sends 1..8 rows to the gemv kernel and 9+ to the skinny one."""
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(gemv, "ROWS", 8)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    for m in (1, 5, 8, 9):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        assert rel(linear.linear(x, w), linear.linear_ref(x.float(), w.float())) < TOL[torch.bfloat16]
    assert calls == [1, 5, 8]


def _counters_zero() -> bool:
    torch.cuda.synchronize()
    return all(bool((c == 0).all()) for c in device_info.TILE_COUNTERS.values())


def _rope_step(lens, bs, dtype, qk_norm, hq=16, hk=8, d=128):
    """A decode step for `rope_paged_decode` over sequences of lengths lens (0: a CUDA-graph
    padding row, length 0 and slot -1) and its reference, the rotary reference then the
    attention reference in fp32 over the rows of length > 0. Returns a dict: qkv [B, (H + 2
    KVH) D], kc0/vc0 the caches before the step, args(q, k, v, kc, vc) the call's arguments,
    ok [B] the rows of length > 0, want [B, H, D] (zeros on padding rows), want_kc/want_vc."""
    batch = len(lens)
    nb = sum(-(-n // bs) for n in lens) + 2
    perm = torch.randperm(nb).tolist()
    width = max(1, max(-(-n // bs) for n in lens))
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pos = (sl - 1).clamp_min(0).long()
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs if n else -1 for t, n in zip(tables, lens)],
                         device="cuda")
    table = rotary.rope_cos_sin(rotary.rope_inv_freq(d, 1e6), 4096).cuda()
    qn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype) if qk_norm else None
    kn = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype) if qk_norm else None
    qkv = torch.randn(batch, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    kc0 = torch.randn(nb, bs, hk, d, device="cuda", dtype=dtype)
    vc0 = torch.randn_like(kc0)
    up = (lambda t: None if t is None else t.float())
    ok = sl > 0
    q, k, v = (t.view(batch, -1, d)[ok].float() for t in qkv.split([hq * d, hk * d, hk * d], -1))
    rkc, rvc = kc0.float(), vc0.float()
    rotary.rotary_and_store_kv_ref(q, k, v, pos[ok], table, rkc, rvc, slots[ok], up(qn), up(kn), 1e-6)
    want = torch.zeros(batch, hq, d, device="cuda")
    want[ok] = attention.paged_attention_ref(q, rkc, rvc, torch.arange(int(ok.sum()) + 1, dtype=torch.int32),
                                             sl[ok].cpu(), bt[ok], d ** -0.5)

    def args(q, k, v, kc, vc):
        return (q, k, v, pos, table, kc, vc, slots, None, sl, bt, d ** -0.5, qn, kn, 1e-6, None, 4096)
    return {"qkv": qkv, "kc0": kc0, "vc0": vc0, "args": args, "ok": ok, "want": want, "want_kc": rkc,
            "want_vc": rvc, "split": [hq * d, hk * d, hk * d], "shape": (batch, d)}


def _views(step, qkv):
    batch, d = step["shape"]
    return tuple(t.view(batch, -1, d) for t in qkv.split(step["split"], -1))


# fused_merge on and off, with the default splits (b=1: 33, b=3: 11, b=64 and 256: one) and
# with 5 forced (several splits at every batch)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch,bs,qk_norm", [(1, 16, True), (3, 32, False), (64, 16, True), (256, 16, True)])
@pytest.mark.parametrize("fused_merge,splits", [(True, None), (False, None), (True, 5), (False, 5)])
def test_rope_decode_matches_rotary_then_attention_reference(monkeypatch, dtype, batch, bs, qk_norm, fused_merge,
                                                             splits):
    monkeypatch.setitem(rope_decode.ROPE_DECODE_DEFAULTS, "fused_merge", fused_merge)
    monkeypatch.setitem(rope_decode.ROPE_DECODE_DEFAULTS, "splits", splits)
    torch.manual_seed(batch)
    lens = torch.randint(1, 2100, (batch,)).tolist()
    lens[0] = bs  # the token ends a block
    if batch > 2:
        lens[1], lens[2] = 1, bs + 1  # the first token of a sequence; one past a block boundary
    step = _rope_step(lens, bs, dtype, qk_norm)
    kc, vc = step["kc0"].clone(), step["vc0"].clone()
    got = rope_decode.rope_paged_decode(*step["args"](*_views(step, step["qkv"].clone()), kc, vc))
    tol = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    assert rel(got, step["want"]) < tol
    assert rel(kc, step["want_kc"]) < tol and rel(vc, step["want_vc"]) < tol
    # the same step again: equal bit for bit (the merge sums the splits in split order
    # whichever program arrives last), which needs the first to have left its counters at 0
    kc2, vc2 = step["kc0"].clone(), step["vc0"].clone()
    again = rope_decode.rope_paged_decode(*step["args"](*_views(step, step["qkv"].clone()), kc2, vc2))
    assert torch.equal(again, got) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert _counters_zero()


@pytest.mark.parametrize("fused_merge", [True, False])
@pytest.mark.parametrize("lens,splits", [([1000], 7), ([700, 0, 33, 0, 2000], 3)])
def test_rope_decode_graph_replays_merge_splits_and_zero_padding_rows(monkeypatch, fused_merge, lens, splits):
    """Captured in a CUDA graph as `services.worker.cuda_graphs` captures the decode step and
    replayed: every replay equals the eager call bit for bit and the reference, padding rows
    (length 0, slot -1) give zeros, and the merge counters are left at 0 between replays."""
    monkeypatch.setitem(rope_decode.ROPE_DECODE_DEFAULTS, "fused_merge", fused_merge)
    monkeypatch.setitem(rope_decode.ROPE_DECODE_DEFAULTS, "splits", splits)
    torch.manual_seed(len(lens))
    step = _rope_step(lens, 16, torch.bfloat16, True)
    qkv = step["qkv"].clone()
    kc, vc = step["kc0"].clone(), step["vc0"].clone()
    args = step["args"](*_views(step, qkv), kc, vc)
    merges = LaunchCount(decode_merge._merge_kernel)
    monkeypatch.setattr(decode_merge, "_merge_kernel", merges)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = rope_decode.rope_paged_decode(*args)  # warm-up: compiles, allocates the counters
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert merges.n == (0 if fused_merge else 1)  # the merge ran in the kernel, or a second launch
    eager = eager.clone()
    eager_kc = kc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_decode.rope_paged_decode(*args)
    for _ in range(3):
        kc.copy_(step["kc0"])
        vc.copy_(step["vc0"])
        out.fill_(float("nan"))  # a row the replay leaves unwritten shows
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(kc, eager_kc)
        assert bool((out[~step["ok"]] == 0).all())
        assert rel(out, step["want"]) < 2e-2
        assert _counters_zero()


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


def _layer(p, ref=False, fused=False):
    """One Qwen3-style decoder layer at batch 1 (the kernels' dispatchers, or the torch
    references in fp32 with ref=True) -> (mlp output, residual). fused: as the model's fused
    one-row path (services.worker.fusion.FUSE_ONE_ROW): the residual stream s = h + res, the norms inside
    the qkv / gate_up gemv and the residual adds inside the o_proj / down gemv -> (the next
    stream, the stream after attention), i.e. (mlp output + residual, residual)."""
    hq, hk, d = p["dims"]
    f = (lambda t: t.float()) if ref else (lambda t: t)
    lin = linear.linear_ref if ref else linear.linear
    if fused:
        s = p["h"] + p["res"]
        qkv = lin(s, p["wqkv"], norm_weight=p["ln1"], eps=1e-6)
    elif ref:
        x, r = norm.fused_add_rms_norm_ref(f(p["h"]), f(p["res"]), f(p["ln1"]), 1e-6)
    else:
        x, r = norm.fused_add_rms_norm(p["h"], p["res"], p["ln1"], 1e-6)
    if not fused:
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
    if fused:
        s2 = lin(o.reshape(1, hq * d), p["wo"], residual=s)
        return lin(lin(s2, p["wgu"], norm_weight=p["ln2"], eps=1e-6), p["wd"], silu_mul=True, residual=s2), s2
    o = lin(o.reshape(1, hq * d), f(p["wo"]))
    if ref:
        x, r = norm.fused_add_rms_norm_ref(o, r, f(p["ln2"]), 1e-6)
        return lin(activation.silu_and_mul_ref(lin(x, f(p["wgu"]))), f(p["wd"])), r
    x, r = norm.fused_add_rms_norm(o, r, p["ln2"], 1e-6)
    return lin(lin(x, p["wgu"]), p["wd"], silu_mul=True), r  # as LlamaMLP at one row


@pytest.mark.parametrize("fused_merge,fused_layer", [(False, True), (False, False), (True, False)])
def test_decode_layer_in_a_pdl_graph_equals_the_layer_without_pdl_and_the_reference(monkeypatch, fused_merge,
                                                                                      fused_layer):
    # (False, True) is the model's default at batch 1: the merge launch, the fused layer
    monkeypatch.setitem(rope_decode.ROPE_DECODE_DEFAULTS, "fused_merge", fused_merge)
    p = _layer_inputs()
    slot = int(p["slot"])
    kc_flat, vc_flat = p["kc"].view(-1, *p["kc"].shape[2:]), p["vc"].view(-1, *p["vc"].shape[2:])
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.use_pdl(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    merges = LaunchCount(decode_merge._merge_kernel)
    monkeypatch.setattr(decode_merge, "_merge_kernel", merges)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _layer(p, fused=fused_layer)  # warm-up: compiles, allocates the split counters
    torch.cuda.current_stream().wait_stream(s)
    # 1K context at batch 1 runs several splits: merged by a second launch, or in the kernel
    assert merges.n == (0 if fused_merge else 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _layer(p, fused=fused_layer)
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
        want = _layer(p, fused=fused_layer)
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2], p["kc"]) and torch.equal(got[3], p["vc"])
        p["kc"].copy_(kv0[0])
        p["vc"].copy_(kv0[1])
        ref, ref_res = _layer(p, ref=True)
        assert rel(got[0], ref + ref_res if fused_layer else ref) < 3e-2
        assert rel(got[1], ref_res) < 3e-2
    assert _counters_zero()
