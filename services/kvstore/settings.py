"""What a kvstore is for, resolved from the config and checked before anything is created.

The store is bound at startup to one model identity and one block size (bytes), both
derived from the same settings the engine uses, so the pool exists (and `kestrel shm ls`
shows it) before any engine connects, and the disk index can be rebuilt at startup. An
engine's KVHello carries its own identity and block bytes; a mismatch is refused.

- model identity: `shared.hashing.model_identity_hash(abspath(model), dtype, kv dtype,
  block_size, tensor_parallel_size=1)`, where the kv dtype is `dtype` while
  kv_cache_dtype is "auto" (as the engine computes its prefix-cache root).
- block bytes: `kv_offload_block_bytes` when set, else 2 (K and V) * num_hidden_layers *
  block_size * num_key_value_heads * head_dim * element size, from the model's config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import psutil

from services.kvstore.cpu_tier import HEADER_SIZE, slot_stride
from services.kvstore.disk_tier import file_bytes
from shared.hashing import model_identity_hash

GIB = 1 << 30
_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "int8": 1}


class ConfigError(ValueError):
    """A kvstore setting that cannot work; the message names the setting."""


@dataclass(frozen=True)
class StoreSetup:
    """model_identity: 32 bytes. block_bytes: bytes per block. n_slots: CPU pool slots.
    disk_dir: None without a disk tier. disk_capacity: block files the disk limit holds."""

    model_identity: bytes
    block_bytes: int
    n_slots: int
    disk_dir: str | None
    disk_capacity: int


def store_identity(cfg) -> bytes:
    """The model identity hash the engine's prefix cache starts from (see module doc)."""
    kv_dtype = cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    return model_identity_hash(os.path.abspath(cfg.model), cfg.dtype, kv_dtype, cfg.block_size,
                               tensor_parallel_size=1)


def derive_block_bytes(cfg) -> int:
    """Bytes of one KV block (see module doc). Raises ConfigError when the model folder has
    no usable config.json and kv_offload_block_bytes is unset."""
    if cfg.kv_offload_block_bytes is not None:
        if cfg.kv_offload_block_bytes <= 0:
            raise ConfigError("setting kv_offload_block_bytes: must be positive, got "
                              f"{cfg.kv_offload_block_bytes}")
        return cfg.kv_offload_block_bytes
    path = os.path.join(cfg.model, "config.json")
    try:
        with open(path) as fh:
            mc = json.load(fh)
        heads = int(mc["num_attention_heads"])
        kv_heads = int(mc.get("num_key_value_heads") or heads)
        head_dim = int(mc.get("head_dim") or int(mc["hidden_size"]) // heads)
        layers = int(mc["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot size a KV block from {path} ({e}); set "
                          "--kv-offload-block-bytes") from None
    dt = cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    return 2 * layers * cfg.block_size * kv_heads * head_dim * _ELEM_BYTES.get(dt, 4)


def _check_writable(folder: str) -> None:
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        probe = os.path.join(folder, f".kestrel-write-probe-{os.getpid()}")
        with open(probe, "wb") as fh:
            fh.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"setting kv_offload_disk_dir: {folder!r} is not a writable folder "
                          f"({e.strerror or e})") from None


def resolve_setup(cfg) -> StoreSetup:
    """Check the offload settings and size the tiers. Raises ConfigError with a clear
    message for: no CPU tier (kv_offload_cpu_gib <= 0), a disk dir without a size limit (or
    the reverse), a non-positive limit, a limit smaller than one block file, a pool larger
    than the host memory or than the free space of /dev/shm, an unwritable disk dir, and a
    pool that holds no block."""
    cpu_gib = cfg.kv_offload_cpu_gib
    if cpu_gib is None or cpu_gib <= 0:
        raise ConfigError("setting kv_offload_cpu_gib: the kvstore needs a CPU tier; set "
                          "--kv-offload-cpu-gib to a positive size in GiB")
    if cfg.kv_offload_disk_dir and cfg.kv_offload_disk_gib is None:
        raise ConfigError("setting kv_offload_disk_dir requires --kv-offload-disk-gib: a disk "
                          "tier without a size limit would fill the disk")
    if cfg.kv_offload_disk_gib is not None and not cfg.kv_offload_disk_dir:
        raise ConfigError("setting kv_offload_disk_gib is set but kv_offload_disk_dir is not")
    if cfg.kv_offload_disk_gib is not None and cfg.kv_offload_disk_gib <= 0:
        raise ConfigError(f"setting kv_offload_disk_gib: must be positive, got {cfg.kv_offload_disk_gib}")
    block_bytes = derive_block_bytes(cfg)
    pool_bytes = int(cpu_gib * GIB)
    total = psutil.virtual_memory().total
    if pool_bytes + HEADER_SIZE > total:
        raise ConfigError(f"setting kv_offload_cpu_gib: a pool of {cpu_gib} GiB is larger than "
                          f"the host memory ({total / GIB:.1f} GiB)")
    shm_free = psutil.disk_usage("/dev/shm").free
    if pool_bytes + HEADER_SIZE > shm_free:
        raise ConfigError(f"setting kv_offload_cpu_gib: a pool of {cpu_gib} GiB does not fit in "
                          f"/dev/shm ({shm_free / GIB:.1f} GiB free)")
    n_slots = pool_bytes // slot_stride(block_bytes)
    if n_slots < 1:
        raise ConfigError(f"setting kv_offload_cpu_gib: {cpu_gib} GiB holds no block of "
                          f"{block_bytes} bytes")
    disk_dir, capacity = None, 0
    if cfg.kv_offload_disk_dir:
        disk_dir = os.path.abspath(cfg.kv_offload_disk_dir)
        capacity = int(cfg.kv_offload_disk_gib * GIB) // file_bytes(block_bytes)
        if capacity < 1:
            raise ConfigError(f"setting kv_offload_disk_gib: {cfg.kv_offload_disk_gib} GiB holds "
                              f"no block file of {file_bytes(block_bytes)} bytes")
        _check_writable(disk_dir)
    return StoreSetup(store_identity(cfg), block_bytes, n_slots, disk_dir, capacity)
