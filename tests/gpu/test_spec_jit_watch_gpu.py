"""Compiles while serving, on CUDA (services/worker/jit_watch.py, kernels/attention_warmup.py,
docs/ARCHITECTURE.md §6.5): a real Triton compile is counted through this Triton's hooks
(the device's 3.6), and after `warm_up_attention` no paged-attention launch of any batch
size, q_len (decode, verify, mixed prefill) or context length compiles a new variant.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.attention_triton import paged_attention_triton  # noqa: E402
from kernels.attention_warmup import warm_up_attention  # noqa: E402
from services.worker import jit_watch  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs.to(tl.float32) + 1.0, mask=offs < n)


@pytest.fixture
def watch(monkeypatch):
    w = jit_watch.JitWatch()
    monkeypatch.setattr(jit_watch, "WATCH", w)
    assert jit_watch.install() != "none"
    w.arm()
    return w


def test_a_real_compile_is_counted_once_per_new_key(watch):
    x = torch.zeros(256, device="cuda")
    _probe_kernel[(1,)](x, 64, BLOCK=64)
    _probe_kernel[(1,)](x, 64, BLOCK=64)  # cached: no compile
    assert watch.compiles == 1
    _probe_kernel[(1,)](x, 200, BLOCK=256)  # a new constexpr
    assert watch.compiles == 2 and watch.take() == 2
    assert torch.equal(x[:200], torch.arange(1, 201, device="cuda", dtype=torch.float32))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 8, 128)])
def test_no_attention_launch_compiles_after_the_warm_up(watch, heads, kv_heads, head_dim):
    block, max_len, dtype, dev = 16, 2048, torch.bfloat16, torch.device("cuda")
    nb = max_len // block
    k = torch.randn(nb, block, kv_heads, head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    warm_up_attention(k, v, heads, dtype, max_len, 16384)
    watch.take()
    base = watch.compiles
    for b in (1, 3, 17, 33, 64, 100, 256):
        for q in (1, 2, 3, 5, 9, 17, 30, 40):
            for ctx in (q, 100, 700, max_len):
                lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
                cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev)
                tables = torch.arange(nb, dtype=torch.int32, device=dev).repeat(b, 1)
                qt = torch.randn(b * q, heads, head_dim, dtype=dtype, device=dev)
                paged_attention_triton(qt, k, v, cu, lens, tables, head_dim ** -0.5, max_q_len=q, max_seq_len=ctx)
    torch.cuda.synchronize()
    assert watch.compiles == base, f"{watch.compiles - base} compiles after the warm-up"
