"""SiLU-and-mul layer of a SwiGLU MLP; math in `kernels.activation`."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * intermediate] = cat(gate, up) -> [num_tokens, intermediate]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
