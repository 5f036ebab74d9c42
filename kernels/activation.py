"""SiLU-and-mul, the gate of a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer").

Dispatcher `silu_and_mul` picks the torch reference on the CPU; a Triton kernel for CUDA
lands with the GPU issue (until then every device runs the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

silu_and_mul_triton = None  # set by the GPU issue: same signature as silu_and_mul_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where x = cat([gate, up], -1).

    x: [num_tokens, 2 * intermediate] (fp32/bf16/fp16). Returns [num_tokens, intermediate],
    x's dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `silu_and_mul_ref` (see there for shapes)."""
    if x.is_cuda and silu_and_mul_triton is not None:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
