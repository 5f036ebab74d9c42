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
from services.worker.layers.linear import Linear, dense_copy_bytes, unpack_cpu_weights
from services.worker.loader import dense_weights, process_weights_after_loading

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
ROWS = [1, 2, 3, 5, 9, 16, 64, 200]


@pytest.fixture(autouse=True)
def _packing_on(monkeypatch):
    """Packing on, no dense copy, for these tests: a ModelRunner built earlier in the process
    sets the flags by its own rules (`cpu_linear.use_packing`, `keep_dense_one_row`)."""
    monkeypatch.setattr(cpu_linear, "PACK_WEIGHTS", True)
    monkeypatch.setattr(cpu_linear, "KEEP_DENSE_ONE_ROW", False)


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


def test_the_dense_copy_is_kept_only_for_one_thread_with_speculation():
    assert cpu_linear.keep_dense_one_row(1, True)
    assert not cpu_linear.keep_dense_one_row(2, True) and not cpu_linear.keep_dense_one_row(1, False)


def _processed(seed: int, pack: bool, keep: bool, monkeypatch) -> Linear:
    monkeypatch.setattr(cpu_linear, "PACK_WEIGHTS", pack)
    monkeypatch.setattr(cpu_linear, "KEEP_DENSE_ONE_ROW", keep)
    lin, _ = _filled_linear(seed)
    lin.process_weights_after_loading()
    return lin


@pytest.mark.parametrize("verify", [True, False], ids=["verify_step", "plain_step"])
@pytest.mark.parametrize("step", ["plain", "norm", "silu", "residual"])
def test_one_row_takes_the_plain_workers_path_and_more_rows_the_packed_one(step, verify, monkeypatch):
    """With the dense copy kept, one row gives bit for bit what an unpacked layer (a worker
    without speculation) gives; several rows what a packed-only layer gives in a step that
    verifies drafts (cpu_linear.PACKED_STEP), and what the unpacked layer gives in any other
    step (a prefill: the plain worker's prompt KV and first token)."""
    monkeypatch.setattr(cpu_linear, "PACKED_STEP", verify)
    both = _processed(5, True, True, monkeypatch)
    plain = _processed(5, False, False, monkeypatch)
    packed = _processed(5, True, False, monkeypatch)
    assert both.weight.is_mkldnn and both.weight_dense is not None and both.weight_dense.t().is_contiguous()
    assert plain.weight_dense is None and packed.weight_dense is None
    g = torch.Generator().manual_seed(11)
    for m in (1, 2, 5):
        cols = 2 * 24 if step == "silu" else 24
        x = torch.randn(m, cols, generator=g)
        kw: dict = {}
        if step == "norm":
            kw = {"norm_weight": 1 + 0.2 * torch.randn(24, generator=g), "eps": 1e-5}
        elif step == "silu":
            kw = {"silu_mul": True}
        elif step == "residual":
            kw = {"residual": torch.randn(m, 24, generator=g)}
        outs = {name: layer(x, **{k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()})
                for name, layer in (("both", both), ("plain", plain), ("packed", packed))}
        assert torch.equal(outs["both"], outs["packed" if m > 1 and verify else "plain"])
        _close(outs["both"], linear_ref(x, cpu_linear.dense(packed.weight), packed.bias, **kw))


def test_the_dense_copy_follows_in_place_writes(monkeypatch):
    lin = _processed(6, True, True, monkeypatch)
    w = cpu_linear.dense(lin.weight).clone()
    assert unpack_cpu_weights(lin) == 1 and lin.weight_dense is None
    with torch.no_grad():
        lin.weight.mul_(3.0)
    lin.process_weights_after_loading()
    assert lin.weight.is_mkldnn and torch.equal(lin.weight_dense, 3.0 * w)
    x = torch.randn(1, 24)
    _close(lin(x), F.linear(x, 3.0 * w, lin.bias))


def test_untied_lm_head_one_row_takes_the_dense_copy(monkeypatch):
    monkeypatch.setattr(cpu_linear, "KEEP_DENSE_ONE_ROW", True)
    monkeypatch.setattr(cpu_linear, "PACKED_STEP", True)
    head = LMHead(200, 32)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        head.weight.copy_(torch.randn(200, 32, generator=g))
    w = head.weight.detach().t().contiguous().t()  # the plain worker's layout
    process_weights_after_loading(head)
    assert head.weight.is_mkldnn and head.weight_dense is not None
    assert dense_copy_bytes(head) == 200 * 32 * 4
    h = torch.randn(1, 32, generator=g)
    assert torch.equal(head(h), F.linear(h, w).float())
    h5 = torch.randn(5, 32, generator=g)
    _close(head(h5), F.linear(h5, w))
    monkeypatch.setattr(cpu_linear, "PACKED_STEP", False)  # a step without drafts: the dense copy
    assert torch.equal(head(h5), F.linear(h5, w).float())
