"""The CPU's oneDNN-packed linear weights (kernels/cpu_linear.py) against torch's F.linear on
the dense weight: same values after packing, same products up to fp32 summation order, at
the row counts of decode (1), speculative verify and batched decode (2..16) and prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear
from kernels.linear import linear
from kernels.linear_ref import linear_ref
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear, unpack_cpu_weights
from services.worker.loader import dense_weights, process_weights_after_loading

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
ROWS = [1, 2, 3, 5, 9, 16, 64, 200]


@pytest.fixture(autouse=True)
def _packing_on(monkeypatch):
    """Packing on for these tests: a ModelRunner built earlier in the process sets the flag
    by its own rule (`cpu_linear.use_packing`)."""
    monkeypatch.setattr(cpu_linear, "PACK_WEIGHTS", True)


def test_the_runner_packs_with_two_threads_or_speculation_only():
    assert cpu_linear.use_packing(2, False) and cpu_linear.use_packing(1, True)
    assert not cpu_linear.use_packing(1, False)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("col_major", [False, True])
def test_pack_keeps_the_values_exactly(col_major):
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    src = w.t().contiguous().t() if col_major else w
    p = cpu_linear.pack(src)
    assert p.is_mkldnn and p.shape == w.shape and p.dtype == torch.float32
    assert torch.equal(cpu_linear.dense(p), w)
    assert cpu_linear.dense(w) is w


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(m, with_bias):
    g = torch.Generator().manual_seed(m)
    w = 0.05 * torch.randn(300, 72, generator=g)
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(m, 2 * 72, generator=g)[:, 10:82]  # a row-strided view, as a split would give
    _close(cpu_linear.packed_linear(x, cpu_linear.pack(w), b), F.linear(x, w, b))
    # the dense column-major weight oneDNN also takes (the tied LM head's)
    _close(cpu_linear.packed_linear(x, w.t().contiguous().t(), b), F.linear(x, w, b))


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("step", ["plain", "norm", "silu", "residual"])
def test_dispatcher_on_packed_weight_equals_reference(m, step):
    g = torch.Generator().manual_seed(7)
    n, k = 48, 32
    w = 0.1 * torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    kw: dict = {}
    x = torch.randn(m, k, generator=g)
    if step == "norm":
        kw = {"norm_weight": 1 + 0.2 * torch.randn(k, generator=g), "eps": 1e-5}
    elif step == "silu":
        kw, x = {"silu_mul": True}, torch.randn(m, 2 * k, generator=g)
    elif step == "residual":
        kw = {"residual": torch.randn(m, n, generator=g)}
    want = linear_ref(x, w, b, **kw)
    got = linear(x, cpu_linear.pack(w), b, **{k_: v.clone() if torch.is_tensor(v) else v for k_, v in kw.items()})
    _close(got, want)


def _filled_linear(seed: int) -> tuple[Linear, torch.Tensor]:
    lin = Linear(24, [16, 8], bias=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 24, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    return lin, lin.weight.detach().clone()


def test_linear_layer_is_packed_at_load_and_unpacks_exactly():
    lin, w = _filled_linear(1)
    lin.process_weights_after_loading()
    assert lin.weight.is_mkldnn and lin.weight.shard_sizes == [16, 8]
    lin.process_weights_after_loading()  # idempotent
    x = torch.randn(5, 24)
    _close(lin(x), F.linear(x, w, lin.bias))
    assert unpack_cpu_weights(lin) == 1
    assert not lin.weight.is_mkldnn and torch.equal(lin.weight, w) and lin.weight.shard_sizes == [16, 8]


def test_dense_weights_block_writes_then_packs_again():
    lin, w = _filled_linear(2)
    process_weights_after_loading(lin)
    with torch.no_grad(), dense_weights(lin):
        lin.weight.mul_(2.0)
    assert lin.weight.is_mkldnn
    x = torch.randn(3, 24)
    _close(lin(x), F.linear(x, 2.0 * w, lin.bias))


def test_pack_off_keeps_the_column_major_dense_weight(monkeypatch):
    monkeypatch.setattr(cpu_linear, "PACK_WEIGHTS", False)
    lin, w = _filled_linear(3)
    lin.process_weights_after_loading()
    assert not lin.weight.is_mkldnn and lin.weight.t().is_contiguous() and torch.equal(lin.weight, w)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_logits_equal_f_linear_at_every_row_count(tied):
    emb = VocabEmbedding(200, 32)
    head = LMHead(200, 32, emb if tied else None)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(200, 32, generator=g))
        if not tied:
            head.weight.copy_(torch.randn(200, 32, generator=g))
    w = head.weight.detach().clone()
    process_weights_after_loading(torch.nn.ModuleList([emb, head]))
    assert head.weight.is_mkldnn is (not tied)  # a tied head stays dense: the embedding reads rows
    assert not emb.weight.is_mkldnn
    for m in ROWS[:6]:
        h = torch.randn(m, 32, generator=g)
        out = head(h)
        assert out.dtype == torch.float32
        _close(out, F.linear(h, w))
    ids = torch.tensor([0, 7, 199])
    assert torch.equal(emb(ids), emb.weight.detach()[ids])
