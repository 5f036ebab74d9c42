"""Rotary embedding layer: a cos/sin table per position; math in `kernels.rotary`."""

from __future__ import annotations

import torch

from kernels.rotary import rope_cos_sin, rope_inv_freq
from services.worker.layers.module import Module


class RotaryEmbedding(Module):
    """RoPE for one model (all layers share one instance).

    rot_dim: rotated dims per head (head_dim unless partial rotary). theta: rope_theta.
    max_positions: table rows; positions must be below it. scaling: the config's rope
    scaling dict or None (see `rope_inv_freq` for supported types).
    It holds the table only: the attention backends rotate q and k with it
    (services/worker/layers/attention.py).
    """

    cos_sin: torch.Tensor  # the buffer: fp32 [max_positions, rot_dim]

    def __init__(self, rot_dim: int, theta: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(rot_dim, theta, scaling)  # on the default device
        table = rope_cos_sin(inv_freq, max_positions)  # fp32 whatever the model dtype
        self.register_buffer("cos_sin", table, persistent=False)
