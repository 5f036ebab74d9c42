"""The worker's paged KV cache tensors (DESIGN §4); the block manager lives in the engine.

Per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim] in
the model dtype. Slot s of a layer's cache is block s // block_size, offset
s % block_size. The cache is zero-filled: attention reads padded slots under a mask, and
0 * NaN from uninitialised memory would poison the output.
"""

from __future__ import annotations

import torch


def num_blocks_for(kv_cache_gib: float, bytes_per_block: int) -> int:
    """floor(kv_cache_gib GiB / bytes_per_block). Raises ValueError when that is 0."""
    n = int(kv_cache_gib * (1 << 30)) // bytes_per_block
    if n < 1:
        raise ValueError(f"kv_cache_gib={kv_cache_gib} holds no KV block of {bytes_per_block} bytes")
    return n


class KVCache:
    """Allocates the cache and binds each layer's pair to its attention module.

    layers: the model's attention modules (each gets `.k_cache` / `.v_cache`).
    num_kv_heads, head_dim: per layer. dtype, device: of the tensors.
    Attributes: num_blocks, block_size, bytes (all layers, K and V; the per-block bytes are
    `shared.kv_layout.KVLayout.block_bytes`).
    """

    def __init__(self, layers: list, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        for layer, k, v in zip(layers, self.k, self.v):
            layer.k_cache, layer.v_cache = k, v
        self.bytes = sum(t.numel() * t.element_size() for t in self.k + self.v)  # as allocated
