"""The attention backends on CUDA (the Triton kernels: rotary + KV write, paged attention,
and the fused rope-decode kernel) against the dense fp64 truth of tests/unit/test_worker_seams.py.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from services.worker.layers.attention import DecodeAttention, PagedAttention  # noqa: E402
from tests.unit.test_worker_seams import run_backend_steps  # noqa: E402


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("backend_cls", [PagedAttention, DecodeAttention])
def test_cuda_attention_backends_equal_dense_attention_with_rope(backend_cls, qk_norm):
    # fp32 inputs; the kernels' dots may run as tf32
    run_backend_steps(backend_cls, True, qk_norm, device="cuda", tol=5e-3)
