"""Rotary position embedding (RoPE, Su et al. 2021), "neox" layout.

The rotated pairs are (x[i], x[i + rot_dim/2]), the layout of Hugging Face's `rotate_half`
(Llama checkpoints in HF format are permuted for it). The frequency table comes from
`rope_inv_freq`, with Llama 3 scaling (`rope_type: llama3`) when asked.

Dispatcher `apply_rotary` picks the torch reference on the CPU; a Triton kernel for CUDA
lands with the GPU issue.
"""

from __future__ import annotations

import math

import torch

apply_rotary_triton = None  # set by the GPU issue: same signature as apply_rotary_ref


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rot_dim), i < rot_dim/2, as fp32 [rot_dim // 2].

    scaling: the config's rope scaling dict, or None. Supported `rope_type`s: "default",
    "llama3" (keys factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings; formula of Meta's Llama 3.1 reference code).
    Raises NotImplementedError for other rope types.
    """
    # fp32, as Hugging Face computes it, so that angles match its reference bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int,
                 attention_scaling: float = 1.0) -> torch.Tensor:
    """Table of cos and sin per position: fp32 [max_positions, rot_dim] = cat(cos, sin),
    on inv_freq's device."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def apply_rotary_ref(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of x by its token's angles (out of place).

    x: [num_tokens, num_heads, head_dim]; pass q and k together as one view of the fused
    qkv output (heads of q then of k) to rotate both in one call.
    cos_sin: [num_tokens, rot_dim] fp32 (the `rope_cos_sin` rows of the tokens' positions);
    rot_dim <= head_dim, the dims past rot_dim pass through (partial rotary).
    Returns [num_tokens, num_heads, head_dim], x's dtype. Math in fp32 then cast, as
    Hugging Face does for fp32; for bf16 HF casts cos/sin first, so results may differ by
    one bf16 ulp.
    """
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    xr = x[..., : 2 * half].float()
    x1, x2 = xr[..., :half], xr[..., half:]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half != x.shape[-1]:
        parts.append(x[..., 2 * half:].float())
    return torch.cat(parts, dim=-1).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `apply_rotary_ref` (see there for shapes)."""
    if x.is_cuda and apply_rotary_triton is not None:
        return apply_rotary_triton(x, cos_sin)
    return apply_rotary_ref(x, cos_sin)
