"""Rotary embedding layer: a cos/sin table per position; math in `kernels.rotary`."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq


class RotaryEmbedding(nn.Module):
    """RoPE for one model (all layers share one instance).

    rot_dim: rotated dims per head (head_dim unless partial rotary). theta: rope_theta.
    max_positions: table rows; positions must be below it. scaling: the config's rope
    scaling dict or None (see `rope_inv_freq` for supported types).
    forward(positions [num_tokens] int64, x [num_tokens, heads, head_dim]) -> x rotated
    (pass q and k heads together, see `apply_rotary_ref`).
    """

    cos_sin: torch.Tensor  # the buffer: fp32 [max_positions, rot_dim]

    def __init__(self, rot_dim: int, theta: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(rot_dim, theta, scaling)  # on the default device
        table = rope_cos_sin(inv_freq, max_positions)  # fp32 whatever the model dtype
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos_sin.index_select(0, positions))
