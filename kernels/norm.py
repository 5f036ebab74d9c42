"""RMSNorm, alone and fused with the residual add.

Dispatchers `rms_norm` and `fused_add_rms_norm` pick the torch references (`*_ref`) on the
CPU. A Triton kernel for CUDA lands with the GPU issue; until `*_triton` is set, every
device runs the reference.

Algorithm: RMSNorm (Zhang & Sennrich 2019), y = x / sqrt(mean(x^2) + eps) * w, computed in
fp32 and cast back before the weight multiply, in the order of Hugging Face's LlamaRMSNorm
so that fp32 and bf16 outputs match it bit for bit on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

rms_norm_triton = None  # set by the GPU issue: same signature as rms_norm_ref
fused_add_rms_norm_triton = None  # same signature as fused_add_rms_norm_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    x: [..., hidden] (fp32/bf16/fp16); weight: [hidden], same dtype as x.
    Returns [..., hidden] in x's dtype.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # the same formula in one torch op (no casts happen in fp32): fewer small kernels
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual').

    x, residual: [num_tokens, hidden], same dtype; weight: [hidden].
    The add runs in the model dtype (as in Hugging Face's decoder layer); the norm in fp32.
    """
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatcher for `rms_norm_ref` (see there for shapes)."""
    if x.is_cuda and rms_norm_triton is not None:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for `fused_add_rms_norm_ref` (see there for shapes)."""
    if x.is_cuda and fused_add_rms_norm_triton is not None:
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
