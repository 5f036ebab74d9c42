"""How one model's KV cache is laid out in blocks, for the engine, the workers and the kvstore.

A KV block holds `block_size` tokens of every layer that keeps paged KV. On one worker
(tensor-parallel rank) a layer's share of a block is K then V, each a C-contiguous
[block_size, num_kv_heads / tp_size, head_dim] array of the KV dtype, and for an int8 KV
cache then the K scales and the V scales, each a [block_size, num_kv_heads / tp_size] fp32
array (one per token and head, kernels/kv_quant.py): `layer_block_bytes`. An fp8_e4m3
cache's per-layer scales are constants of the model, not part of a block.
A worker spends `block_bytes` (all layers) per block of its cache. A kvstore slot holds a
whole block as the workers lay it out (services/worker/kv_transfer.py): layer-major, K then
V, rank r's share at [r * block_bytes, (r + 1) * block_bytes) of the slot's `slot_bytes`
(docs/ARCHITECTURE.md §4).

The model identity hash names what the bytes of a block depend on (the model folder, dtype,
KV dtype, block size and parallel layout); it is the root of every block hash chain, so
the prefix cache and the kvstore tiers of the same identity can share blocks
(`shared.hashing`). Everything here is derived once from a `ModelSpec` and the settings;
no other module computes block bytes or the identity.

A hybrid model (attention and recurrent-state layers) will have one layout per cache group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.hashing import model_identity_hash
from shared.model_spec import ModelSpec, dtype_bytes, kv_dtype_in_use, model_spec_for, resolved_dtype

if TYPE_CHECKING:  # no import at run time: shared.config imports shared.model_spec
    from shared.config import KestrelConfig


# bytes of the scale of one token and head per KV dtype with per-token scales (int8: fp32)
TOKEN_SCALE_BYTES = {"int8": 4}


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split across workers. tp_size: tensor-parallel ranks (KV heads are
    split across them); tp_rank: this worker's rank, 0 <= tp_rank < tp_size (0 outside a
    worker). Raises ValueError for a size below 1 or a rank out of range."""

    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad parallel layout: rank {self.tp_rank} of {self.tp_size}")


def model_identity(model_path: str, dtype: str, kv_dtype: str, block_size: int,
                   parallel: ParallelLayout = ParallelLayout()) -> bytes:
    """The 32-byte model identity hash (`shared.hashing.model_identity_hash`) of the model
    folder `model_path` (made absolute), served in `dtype` with KV in `kv_dtype`, blocks of
    `block_size` tokens, split over parallel.tp_size ranks (the rank does not change it)."""
    return model_identity_hash(os.path.abspath(model_path), dtype, kv_dtype, int(block_size),
                               tensor_parallel_size=parallel.tp_size)


@dataclass(frozen=True)
class KVLayout:
    """The block layout of one model's KV cache. Build it with `for_model` or `kv_layout_for`.

    block_size: tokens per block. num_layers: layers with paged KV. num_kv_heads: KV heads of
    the whole model (each rank holds num_kv_heads // tp_size). head_dim: elements.
    kv_dtype: the KV dtype name in use; elem_bytes: its bytes per element.
    model_identity: 32 bytes, the prefix-cache root (`model_identity`). parallel: the split.
    token_scale_bytes: bytes of the scale of one token and head, for K and for V each (4
    for int8's fp32 scales, 0 for a KV dtype without per-token scales).
    Sizes (bytes) are properties: layer_block_bytes, block_bytes, slot_bytes.
    """

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    elem_bytes: int
    model_identity: bytes
    parallel: ParallelLayout = ParallelLayout()
    token_scale_bytes: int = 0

    @classmethod
    def for_model(cls, spec: ModelSpec, block_size: int,
                  parallel: ParallelLayout = ParallelLayout()) -> KVLayout:
        """The layout of `spec`'s KV cache in blocks of `block_size` tokens. Raises
        ValueError for a non-positive block size or KV heads that do not split evenly over
        parallel.tp_size ranks."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if spec.num_kv_heads % parallel.tp_size:
            raise ValueError(f"{spec.num_kv_heads} KV heads do not split over "
                             f"{parallel.tp_size} tensor-parallel ranks")
        return cls(block_size, len(spec.attention_layer_ids), spec.num_kv_heads, spec.head_dim, spec.kv_dtype,
                   dtype_bytes(spec.kv_dtype),
                   model_identity(spec.path, spec.dtype, spec.kv_dtype, block_size, parallel),
                   parallel, TOKEN_SCALE_BYTES.get(spec.kv_dtype, 0))

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads one worker holds: num_kv_heads // tp_size."""
        return self.num_kv_heads // self.parallel.tp_size

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer on one rank, K and V and their per-token scales:
        2 * block_size * kv_heads_per_rank * (head_dim * elem_bytes + token_scale_bytes)."""
        return 2 * self.block_size * self.kv_heads_per_rank * (self.head_dim * self.elem_bytes
                                                               + self.token_scale_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on one rank, every layer (what a worker's cache spends per block)."""
        return self.num_layers * self.layer_block_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes of one block in a kvstore slot: every layer of every rank
        (block_bytes * tp_size). This is the block size the kvstore is bound to."""
        return self.block_bytes * self.parallel.tp_size

    @property
    def rank_slot_offset(self) -> int:
        """Byte offset of this rank's share in a slot: tp_rank * block_bytes."""
        return self.parallel.tp_rank * self.block_bytes


def num_blocks_for(kv_cache_gib: float, bytes_per_block: int) -> int:
    """floor(kv_cache_gib GiB / bytes_per_block): the KV blocks of a CPU worker's cache
    (`services.worker.model_runner`), and what `kestrel serve` checks max_model_len against
    (`shared.config.check_cpu_kv_cache`). Raises ValueError when that is 0."""
    n = int(kv_cache_gib * (1 << 30)) // bytes_per_block
    if n < 1:
        raise ValueError(f"kv_cache_gib={kv_cache_gib} holds no KV block of {bytes_per_block} bytes")
    return n


def kv_layout_for(cfg: KestrelConfig, *, dtype: str | None = None,
                  parallel: ParallelLayout = ParallelLayout()) -> KVLayout:
    """The layout for a config (model, dtype, kv_cache_dtype, max_model_len, block_size).
    dtype: overrides cfg.dtype (see `shared.model_spec.model_spec_for`). Raises
    ModelFolderError, ValueError as `load_model_spec` and `for_model`."""
    return KVLayout.for_model(model_spec_for(cfg, dtype=dtype), cfg.block_size, parallel)


def identity_for(cfg: KestrelConfig, parallel: ParallelLayout = ParallelLayout()) -> bytes:
    """The model identity of a config without reading the model folder (the kvstore, which
    may be bound to a folder it never reads; equal to `kv_layout_for(cfg).model_identity`).
    Raises ValueError for an unknown kv_cache_dtype."""
    dtype = resolved_dtype(cfg.dtype, cfg.device)
    return model_identity(cfg.model, dtype, kv_dtype_in_use(dtype, cfg.kv_cache_dtype),
                          cfg.block_size, parallel)
