"""Weight-only int8/int4 CPU linear layers (kernels/cpu_quant_linear.py) and their wiring
into `Linear` / `LMHead` (services/worker/layers): the quantizers' error bounds on awkward
shapes, the packed ATen kernels against the dequantize-then-matmul reference, stacked shards
with the fused keyword arguments, `loader.dense_weights`, and the refusal on a GPU device."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from kernels import cpu_int4_vnni, cpu_linear
from kernels import cpu_quant_linear as cq
from kernels.linear_ref import linear_ref
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import (Linear, dense_copy_bytes, held_weight_bytes, quantized_weight_bytes,
                                          unpack_cpu_weights)
from services.worker.loader import dense_weights, process_weights_after_loading
from shared.config import build_config
from shared.device import GIB
from shared.startup_report import format_startup_report

SMOLLM2 = "models/SmolLM2-135M-Instruct"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def quant(monkeypatch):
    """Set the CPU quantization scheme for one test (the model runner sets it per worker)."""
    def set_scheme(scheme: str) -> None:
        monkeypatch.setattr(cq, "QUANTIZATION", scheme)
    return set_scheme


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [n, k] fp32 weight with a few outliers (what per-channel scales must absorb)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w.view(-1)[torch.randint(0, n * k, (max(1, n * k // 97),), generator=g)] *= 12.0
    return w


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 100), (64, 576), (3, 40)])
def test_int8_round_trip_within_half_a_step(shape):
    w = _weights(*shape)
    w[0] = 0.0  # an all-zero row: scale 1, exact zeros
    q, scale = cq.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (shape[0],) and int(q.abs().max()) <= 127
    err = (cq.dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12)
    assert err[0].max() == 0
    # the step is the row's absmax / 127: the largest entry of each row is exact
    amax = w.abs().amax(1)
    assert torch.allclose(scale[1:], amax[1:] / 127)


@pytest.mark.parametrize("shape,group", [((5, 32), 32), ((17, 96), 32), ((3, 256), 128), ((40, 576), 64),
                                         ((2, 64), 64)])
def test_int4_round_trip_within_half_a_step(shape, group):
    w = _weights(*shape, seed=1)
    w[-1, :group] = 0.25  # a constant group: hi == lo
    q, scale, zero = cq.quantize_int4(w, group)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (shape[0], shape[1] // group)
    deq = cq.dequantize_int4(q, scale, zero)
    step = scale.repeat_interleave(group, dim=1)
    assert torch.all((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-6)
    # each group's min and max are on the grid (q = 0 and 15)
    wg, dg = w.reshape(shape[0], -1, group), deq.reshape(shape[0], -1, group)
    assert torch.allclose(dg.amin(2), wg.amin(2), atol=1e-6) and torch.allclose(dg.amax(2), wg.amax(2), atol=1e-5)


def test_int4_group_size_choice_and_refusals():
    assert cq.int4_group_size(576, 128) == 64  # SmolLM2's hidden size is not a multiple of 128
    assert cq.int4_group_size(1536, 128) == 128 and cq.int4_group_size(1536, 32) == 32
    assert cq.int4_group_size(80, 32) == 32  # no divisor: K is padded to 96
    with pytest.raises(ValueError, match="does not divide"):
        cq.quantize_int4(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="unknown scheme"):
        cq.quantize(torch.randn(4, 32), "int2")


# (N, K): N not a multiple of 16 (int4 pads rows), K not a multiple of 16 (int8 pads) nor of
# 32 (int4 pads), and SmolLM2's own projection shapes
SHAPES = [(7, 40), (33, 100), (16, 64), (48, 576), (960, 576), (576, 1536)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_kernel_matches_the_reference(scheme, shape, monkeypatch):
    """The ATen kernels (tinygemm for int4: INT4_VNNI off here; the VNNI route's own tests are
    tests/unit/test_cpu_int4_vnni.py) against the dequantize-then-matmul reference."""
    monkeypatch.setattr(cq, "INT4_VNNI", False)
    n, k = shape
    w = _weights(n, k, seed=2)
    qw = cq.quantize(w, scheme)
    deq = qw.dequantize()
    assert deq.shape == (n, k)
    # the weight the kernel stands for is the quantizer's, scales rounded to ACT_DTYPE
    if scheme == "int8":
        q, s = cq.quantize_int8(w)
        want = cq.dequantize_int8(q, s.to(cq.ACT_DTYPE))
    else:
        g = qw.group_size
        kp = -(-k // g) * g
        q, s, z = cq.quantize_int4(torch.nn.functional.pad(w, (0, kp - k)), g)
        want = cq.dequantize_int4(q, s.to(cq.ACT_DTYPE), z.to(cq.ACT_DTYPE))[:, :k]
    assert torch.equal(deq, want)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = qw.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = cq.quant_linear_ref(x.to(cq.ACT_DTYPE).float(), deq)
        # the kernel's bf16 output rounding (2^-9 relative) and summation order
        tol = 2.0 ** -7 * ref.abs().amax(1, keepdim=True) + 1e-4
        assert torch.all((y - ref).abs() <= tol), float((y - ref).abs().max())
    xb = torch.randn(2, k).to(torch.bfloat16)
    assert qw.matmul(xb).dtype == torch.bfloat16
    assert qw.matmul(torch.randn(2, 2 * k)[:, :k]).shape == (2, n)  # a row-strided view


W8A8 = pytest.mark.skipif(not cq.w8a8_available(), reason="no oneDNN int8 linear with VNNI on this CPU")


def _w8a8_truth(x: torch.Tensor, w: torch.Tensor, n_out: int) -> torch.Tensor:
    """The "w8a8" product computed independently, in fp64: each row's n_out largest |x|
    columns times the float w, the rest rounded to the row's grid (max |rest| / 127) times
    the int8-quantized w (`quantize_int8`, the per-channel absmax quantizer)."""
    q, sc = cq.quantize_int8(w)
    wq = q.double() * sc.double()[:, None]
    xd = x.double()
    order = xd.abs().argsort(dim=1, descending=True)
    mask = torch.zeros_like(xd, dtype=torch.bool).scatter_(1, order[:, :n_out], True)
    out, rest = torch.where(mask, xd, 0.0), torch.where(mask, 0.0, xd)
    step = rest.abs().amax(1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(rest / step) * step) @ wq.t() + out @ w.double().t()


@W8A8
@pytest.mark.parametrize("shape", [(7, 40), (33, 100), (48, 576), (1000, 576), (5, 3)])
def test_w8a8_matches_an_independent_truth_and_stays_near_the_float_product(shape):
    n, k = shape
    w = _weights(n, k, seed=3)
    qw = cq.quantize(w, "w8a8")
    q, sc = cq.quantize_int8(w)
    assert torch.equal(qw.dequantize(), cq.dequantize_int8(q, sc))
    assert qw.dense_t is not None and qw.dense_t.shape == (k, n)
    for m in (1, 3, 17):
        g = torch.Generator().manual_seed(10 + m)
        x = torch.randn(m, k, generator=g)
        x[:, torch.randint(0, k, (2,), generator=g)] *= 20.0  # outlier channels, as in a real hidden state
        y = qw.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        want = _w8a8_truth(x, w, min(cq.W8A8_OUTLIERS, k))
        # exact int32 dots; fp32 scaling and the fp32 outlier sums
        assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), \
            float((y.double() - want).abs().max())
        # the float product, within the triangle bound of the two roundings: half a weight
        # step per |x| (outliers included) plus half the row's activation step per |w|
        ref = x.double() @ w.double().t()
        rest = x.double().clone()
        rest.scatter_(1, x.abs().topk(min(cq.W8A8_OUTLIERS, k), dim=1).indices, 0.0)
        a_step = rest.abs().amax(1, keepdim=True) / 127
        bound = x.double().abs().sum(1, keepdim=True) * sc.double()[None, :] / 2 \
            + a_step / 2 * w.double().abs().sum(1)[None, :]
        assert torch.all((y.double() - ref).abs() <= bound * (1 + 1e-4) + 1e-5)
    assert qw.matmul(torch.randn(2, k).to(torch.bfloat16)).dtype == torch.bfloat16
    zero = qw.matmul(torch.zeros(2, k))
    assert torch.equal(zero, torch.zeros(2, n))


@W8A8
def test_w8a8_outliers_are_exact_and_the_head_scheme_follows_its_switch(monkeypatch):
    """A row whose only nonzero entries are W8A8_OUTLIERS columns takes the float weight
    exactly; `head_scheme` is "w8a8" with HEAD_W8A8 on, "int8" off."""
    w = _weights(64, 96, seed=4)
    qw = cq.quantize(w, "w8a8")
    x = torch.zeros(1, 96)
    x[0, [3, 50, 95]] = torch.tensor([7.0, -3.0, 0.5])
    assert torch.allclose(qw.matmul(x), x @ w.t(), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(cq, "HEAD_W8A8", True)
    assert cq.head_scheme() == "w8a8"
    monkeypatch.setattr(cq, "HEAD_W8A8", False)
    assert cq.head_scheme() == "int8"


def _filled(lin: Linear, seed: int) -> torch.Tensor:
    """Fill a Linear's weight like the loader does (in place) and return a dense copy."""
    w = _weights(*lin.weight.shape, seed=seed)
    lin.weight.data.copy_(w)
    return w


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_stacked_linear_with_fused_arguments(quant, scheme, monkeypatch):
    """The fused arguments through the ATen kernels (INT4_VNNI off; with it on:
    tests/unit/test_cpu_int4_vnni.py)."""
    quant(scheme)
    monkeypatch.setattr(cq, "INT4_VNNI", False)
    torch.manual_seed(0)
    k = 64
    qkv = Linear(k, [48, 16, 16])  # stacked shards, N = 80 (not a multiple of 16 * 2)
    _filled(qkv, 3)
    process_weights_after_loading(qkv)
    assert qkv.qweight is not None and qkv.qweight.scheme == scheme
    assert qkv.weight.device.type == "meta" and qkv.weight.shape == (80, k)
    assert qkv.weight.shard_sizes == [48, 16, 16]
    deq = qkv.qweight.dequantize()
    x = torch.randn(5, k)
    nw, res = torch.rand(k) + 0.5, torch.randn(5, 80)

    def close(y, ref):
        tol = 2.0 ** -7 * ref.abs().amax(1, keepdim=True) + 1e-4
        assert torch.all((y - ref).abs() <= tol), float((y - ref).abs().max())

    xr = lambda t: t.to(cq.ACT_DTYPE).float()  # noqa: E731 (the kernel's input rounding)
    from kernels.norm import rms_norm
    close(qkv(x), linear_ref(xr(x), deq))
    close(qkv(x, norm_weight=nw, eps=1e-5), linear_ref(xr(rms_norm(x, nw, 1e-5)), deq))
    close(qkv(x, residual=res.clone()), linear_ref(xr(x), deq) + res)
    down = Linear(32, 24, bias=True)  # the MLP's down projection, with a bias
    _filled(down, 4)
    down.bias.data.copy_(torch.randn(24))
    process_weights_after_loading(down)
    xs = torch.randn(3, 64)
    from kernels.activation import silu_and_mul
    close(down(xs, silu_mul=True), linear_ref(xr(silu_and_mul(xs)), down.qweight.dequantize(), down.bias))
    with pytest.raises(ValueError, match="does not fit"):
        qkv(torch.randn(2, k + 1), residual=torch.randn(2, 80))
    # the weights held: the quantized bytes, no fp32 copy
    assert held_weight_bytes(qkv) == qkv.qweight.nbytes < 80 * k * 4 / (3 if scheme == "int8" else 5)


def test_dense_weights_dequantize_then_quantize_what_was_written(quant):
    quant("int8")
    lin = Linear(64, [32, 32])
    w = _filled(lin, 5)
    process_weights_after_loading(lin)
    old = lin.qweight.dequantize()
    with torch.no_grad(), dense_weights(lin):
        assert lin.qweight is None and lin.weight.device.type == "cpu"
        assert torch.equal(lin.weight.data, old)
        lin.weight.data[:32] *= 2.0  # a test rewrites shard 0
    assert lin.qweight is not None and lin.weight.shard_sizes == [32, 32]
    new = lin.qweight.dequantize()
    assert torch.allclose(new[:32], 2 * w[:32], atol=float(w.abs().max()) / 127 * 1.01)
    assert torch.allclose(new[32:], w[32:], atol=float(w.abs().max()) / 127 * 0.51)
    assert unpack_cpu_weights(lin) == 1 and lin.qweight is None


def test_lm_head_untied_quantized_tied_kept_and_no_one_row_copy(quant, monkeypatch):
    """An untied head is quantized in place; a tied one keeps the embedding's fp32 weight
    (the lookups read it) and multiplies by a quantized copy (`qweight_tied`), dropped by
    `unpack_cpu_weights` and made again after loading."""
    quant("int4")
    monkeypatch.setattr(cpu_linear, "KEEP_DENSE_ONE_ROW", True)  # a 1-thread speculative worker
    emb = VocabEmbedding(64, 32)
    emb.weight.data.copy_(_weights(64, 32, seed=6))
    tied, untied = LMHead(64, 32, emb), LMHead(64, 32)
    untied.weight.data.copy_(_weights(64, 32, seed=7))
    lin = Linear(32, 48)
    _filled(lin, 8)
    for m in (emb, tied, untied, lin):
        process_weights_after_loading(m)
    assert tied.qweight is None and tied.weight is emb.weight and emb.weight.device.type == "cpu"
    assert tied.qweight_tied is not None and quantized_weight_bytes(tied) == tied.qweight_tied.nbytes
    assert tied.qweight_tied.scheme == cq.head_scheme()
    h = torch.randn(2, 32)
    if tied.qweight_tied.scheme == "w8a8":  # int8 activations but the outliers: its own truth above
        ref = _w8a8_truth(h, emb.weight.data, cq.W8A8_OUTLIERS).float()
        assert torch.allclose(tied(h), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:
        ref = linear_ref(h.to(cq.ACT_DTYPE).float(), tied.qweight_tied.dequantize())
        assert torch.allclose(tied(h), ref, atol=2.0 ** -7 * float(ref.abs().max()) + 1e-4)
    assert (tied.qweight_tied.dequantize() - emb.weight).abs().max() < 0.1 * emb.weight.abs().max()
    assert unpack_cpu_weights(tied) >= 1 and tied.qweight_tied is None and tied.weight is emb.weight
    process_weights_after_loading(tied)
    assert tied.qweight_tied is not None
    assert untied.qweight is not None and untied.weight_dense is None and lin.weight_dense is None
    assert dense_copy_bytes(untied) == dense_copy_bytes(lin) == 0
    h = torch.randn(1, 32)
    if untied.qweight.vnni is not None:  # one row: the int4 VNNI kernel (int8 x), its own truth
        ref = cpu_int4_vnni.mm_ref(h, untied.qweight.vnni, 64)
        assert torch.allclose(untied(h), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:
        ref = linear_ref(h.to(cq.ACT_DTYPE).float(), untied.qweight.dequantize())
        assert torch.allclose(untied(h), ref, atol=2.0 ** -7 * float(ref.abs().max()) + 1e-4)


def test_quantization_refused_on_cuda_before_any_process_starts():
    with pytest.raises(ValueError, match=r"setting quantization: 'int4' weights run on the CPU only.*"
                                         r"--quantization none.*--device cpu --quantization int4"):
        build_config({"model": SMOLLM2, "device": "cuda", "quantization": "int4"}, env={})
    with pytest.raises(ValueError, match="quantization"):
        build_config({"model": SMOLLM2, "device": "cpu", "quantization": "int3"}, env={})
    assert build_config({"model": SMOLLM2, "device": "cuda"}, env={}).quantization == "none"
    assert build_config({"model": SMOLLM2, "device": "cpu", "quantization": "int8"}, env={}).quantization == "int8"


def test_startup_report_names_the_scheme_and_the_bytes_held():
    worker = {"device": "cpu", "dtype": "float32", "weight_bytes": 2 * GIB, "kv_bytes": GIB,
              "quantization": "int4", "weight_bytes_held": GIB // 2}
    lines = format_startup_report({"workers": [worker]})
    assert "startup report: worker 0 memory: weights 2.00 GiB (int4: 0.50 GiB held), KV cache 1.00 GiB" in lines
    plain = format_startup_report({"workers": [{**worker, "quantization": "none"}]})
    assert "startup report: worker 0 memory: weights 2.00 GiB, KV cache 1.00 GiB" in plain
    assert not any("other:" in ln for ln in plain)


def test_the_cli_refuses_quantization_on_cuda_before_any_process_starts(tmp_path):
    runtime = tmp_path / "rt"
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cuda",
                        "--quantization", "int8", "--runtime-dir", str(runtime),
                        "--instance-id", "qnt" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "setting quantization: 'int8' weights run on the CPU only" in r.stderr, r.stderr
    assert not runtime.exists(), "a process started: the runtime folder was created"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_device_cuda_without_cuda_stops_the_server_with_exit_2_not_a_restart_loop(tmp_path):
    """Found by a fresh-user pass: `--device cuda` on a CPU host crash-looped the worker (an
    AssertionError from torch) for ~50 s and exited 1. The worker now refuses its
    configuration (a ValueError naming the setting), so the supervisor stops at once."""
    from services.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match="setting device: 'cuda', but torch sees no CUDA device"):
        ModelRunner(build_config({"model": SMOLLM2, "device": "cuda"}, env={}))
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", SMOLLM2, "--device", "cuda",
                        "--runtime-dir", str(tmp_path / "rt"), "--port", "1",
                        "--instance-id", "dev" + uuid.uuid4().hex[:6]],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-4000:]
    assert "setting device: 'cuda'" in r.stderr and "giving up" not in r.stderr, r.stderr[-4000:]
