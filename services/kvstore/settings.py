"""What a kvstore is for, resolved from the config and checked before anything is created.

The store is bound at startup to one model identity and one block size (bytes), both
derived from the same settings the engine uses, so the pool exists (and `kestrel shm ls`
shows it) before any engine connects, and the disk index can be rebuilt at startup. An
engine's KVHello carries its own identity and block bytes; a mismatch is refused.

- model identity: `shared.kv_layout.identity_for(cfg)`, the engine's prefix-cache root
  (`KVLayout.model_identity`); it needs no model folder.
- block bytes: `kv_offload_block_bytes` when set, else `KVLayout.slot_bytes` of the
  model (shared/kv_layout.py, from the model's config.json).

`check` is the supervisor's view of all this: `kestrel serve` (services/cli.py) hands it
to the supervisor, which runs it before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from services.kvstore.disk_tier import file_bytes
from shared.config import KestrelConfig
from shared.kv_layout import identity_for, kv_layout_for
from shared.kv_pool import HEADER_SIZE, slot_stride
from shared.model_spec import ModelFolderError

GIB = 1 << 30


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


def store_block_bytes(cfg: KestrelConfig) -> int:
    """Bytes of one KV block in a slot (see module doc). Raises ConfigError when
    kv_offload_block_bytes is not positive, or is unset and the model folder cannot size a
    block."""
    if cfg.kv_offload_block_bytes is not None:
        if cfg.kv_offload_block_bytes <= 0:
            raise ConfigError("setting kv_offload_block_bytes: must be positive, got "
                              f"{cfg.kv_offload_block_bytes}")
        return int(cfg.kv_offload_block_bytes)
    try:
        return kv_layout_for(cfg).slot_bytes
    except (ModelFolderError, ValueError) as e:
        raise ConfigError(f"cannot size a KV block from {cfg.model!r} ({e}); set "
                          "--kv-offload-block-bytes") from None


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


def resolve_setup(cfg: KestrelConfig) -> StoreSetup:
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
    try:
        identity = identity_for(cfg)
    except ValueError as e:  # a quantized kv_cache_dtype on CUDA (the config check refuses it first)
        raise ConfigError(str(e)) from None
    block_bytes = store_block_bytes(cfg)
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
        capacity = int((cfg.kv_offload_disk_gib or 0.0) * GIB) // file_bytes(block_bytes)
        if capacity < 1:
            raise ConfigError(f"setting kv_offload_disk_gib: {cfg.kv_offload_disk_gib} GiB holds "
                              f"no block file of {file_bytes(block_bytes)} bytes")
        _check_writable(disk_dir)
    return StoreSetup(identity, block_bytes, n_slots, disk_dir, capacity)


def check(cfg: KestrelConfig) -> str:
    """The supervisor's check of the offload settings before anything starts: a one-line
    summary of the tiers. Raises ConfigError as `resolve_setup`."""
    setup = resolve_setup(cfg)
    disk = f"{setup.disk_dir} ({setup.disk_capacity} blocks)" if setup.disk_dir else "off"
    return f"{setup.n_slots} CPU slots of {setup.block_bytes} bytes, disk tier {disk}"
