"""RMSNorm layer (optionally fused with the residual add); math in `kernels.norm`."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import fused_add_rms_norm, rms_norm
from services.worker.layers.module import Module


class RMSNorm(Module):
    """RMSNorm with weight [hidden] (uninitialised until loaded).

    forward(x) -> rms_norm(x); forward(x, residual) -> (rms_norm(x + residual), x + residual).
    x, residual: [num_tokens, hidden].
    """

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    @property
    def prologue_weight(self) -> torch.Tensor:
        """The weight a projection's fused norm prologue multiplies the normalised rows by
        (`kernels.linear.linear(..., norm_weight=, eps=)`; the fused layer path): the one
        forward uses, so the prologue is the same math. Here `weight` [hidden]."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores weight - 1 (zero-centred; Qwen3-Next's norms:
    rms_norm(x) * (1 + w)). The loaded parameter `weight` stays as the checkpoint has it;
    `process_weights_after_loading` (run by the loader, again after any reload) sets the
    scale 1 + weight that forward, the attention backend (q/k norms) and a fused prologue
    (`prologue_weight`) use, `scale` [hidden] in the parameter's dtype. In fp32 this equals
    the checkpoint model's (x_norm * (1 + w)); in bf16 it rounds 1 + w once, at load."""

    def __init__(self, hidden: int, eps: float):
        super().__init__(hidden, eps)
        self.scale = torch.empty(hidden)

    def process_weights_after_loading(self) -> None:
        self.scale = (1.0 + self.weight.detach().float()).to(self.weight.dtype)

    @property
    def prologue_weight(self) -> torch.Tensor:
        """`scale` (1 + weight, set after loading): what forward multiplies by."""
        return self.scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.scale, self.eps)
        return fused_add_rms_norm(x, residual, self.scale, self.eps)
