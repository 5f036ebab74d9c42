"""The CPU decode path's op cuts (`kernels.ref_fast.FEWER_OPS`) give the same bits as the
forms before them: each reference is run with the switch off (the truth: F.rms_norm, the
rotary table's gather and `apply_rotary_ref`, the KV gather by index, SDPA's own bool-mask
conversion, x.to(bf16)) and on, and the outputs compared with torch.equal."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_quant_linear, ref_fast
from kernels.attention import build_ref_plan, paged_attention_ref
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rope_cos_sin, rope_factors, rope_inv_freq, rotary_and_store_kv_ref


@pytest.fixture
def switch():
    """Runs fn with FEWER_OPS off, then on; restores the default."""
    def both(fn):
        try:
            ref_fast.FEWER_OPS = False
            old = fn()
            ref_fast.FEWER_OPS = True
            new = fn()
        finally:
            ref_fast.FEWER_OPS = True
        return old, new
    return both


def _equal(a, b):
    if isinstance(a, (tuple, list)):
        return all(_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    return torch.equal(a, b)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (8, 960), (17, 100), (64, 4096)])
def test_rms_norm_same_bits(switch, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    for scale, eps in ((1e-3, 1e-5), (1.0, 1e-6), (300.0, 1e-12)):
        x = torch.randn(rows, hidden, generator=g) * scale
        r = torch.randn(rows, hidden, generator=g)
        w = torch.randn(hidden, generator=g)
        old, new = switch(lambda: (rms_norm_ref(x, w, eps), fused_add_rms_norm_ref(x, r, w, eps)))
        assert _equal(old, new)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("adjacent", [True, False])
def test_rotary_factors_same_bits(switch, tokens, adjacent):
    heads, kvh, d, bs = 9, 3, 64, 16
    table = rope_cos_sin(rope_inv_freq(d, 10000.0), 512)
    g = torch.Generator().manual_seed(tokens)
    qkv0 = torch.randn(tokens, (heads + 2 * kvh) * d, generator=g) * 3
    positions = torch.randint(0, 512, (tokens,), generator=g)
    slots = torch.randperm(4 * bs, generator=g)[:tokens]

    def run():
        qkv = qkv0.clone() if adjacent else None
        if adjacent:
            q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
            q, k, v = q.view(tokens, heads, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)
        else:  # separate tensors: q and k rotate one by one
            q = qkv0[:, :heads * d].reshape(tokens, heads, d).clone()
            k = qkv0[:, heads * d:(heads + kvh) * d].reshape(tokens, kvh, d).clone()
            v = qkv0[:, (heads + kvh) * d:].reshape(tokens, kvh, d).clone()
        kc, vc = torch.zeros(4, bs, kvh, d), torch.zeros(4, bs, kvh, d)
        f = rope_factors(table, positions) if ref_fast.FEWER_OPS else None
        rotary_and_store_kv_ref(q, k, v, positions, table, kc, vc, slots, factors=f)
        return q.clone(), k.clone(), kc, vc

    old, new = switch(run)
    assert _equal(old, new)
    assert not torch.equal(old[0], qkv0[:, :heads * d].reshape(tokens, heads, d))  # it did rotate


@pytest.mark.parametrize("blocks", [[2, 3, 4], [4, 0, 2]])  # consecutive (a slice) or not
@pytest.mark.parametrize("seq_len", [33, 48])  # a mask, or full blocks
def test_decode_attention_same_bits(switch, blocks, seq_len):
    heads, kvh, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(seq_len + blocks[0])
    kv = torch.randn(2, 6, bs, kvh, d, generator=g)
    kc, vc = kv[0], kv[1]  # views of one buffer (as the KV cache's): v's storage offset is not 0
    q = torch.randn(1, heads, d, generator=g)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    tables = torch.tensor([blocks], dtype=torch.int32)

    def run():
        plan = build_ref_plan(cu, lens, tables, bs)
        assert (plan.dec_first is not None) == (ref_fast.FEWER_OPS and blocks == [2, 3, 4])
        return paged_attention_ref(q, kc, vc, cu, lens, tables, d ** -0.5, plan)

    old, new = switch(run)
    assert torch.equal(old, new)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_matmul_x_buffer_same_bits(switch, scheme, monkeypatch):
    monkeypatch.setattr(cpu_quant_linear, "INT4_VNNI", False)  # the buffer is tinygemm's path's
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 128, generator=g)
    qw = cpu_quant_linear.quantize(w, scheme, 32)
    for rows in (1, 1, 4, 20):  # the buffer reused, another row count, past XBUF_ROWS
        x = torch.randn(rows, 128, generator=g)
        old, new = switch(lambda: qw.matmul(x))
        assert torch.equal(old, new)


@pytest.mark.parametrize("rows", [1, 3])
def test_silu_and_mul_same_bits(switch, rows):
    from kernels.activation import silu_and_mul_ref
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    old, new = switch(lambda: silu_and_mul_ref(x))
    assert torch.equal(old, new)
