"""What a kvstore is for, resolved from the config and checked before anything is created.

The store is bound at startup to one model identity and one block size (bytes), both
derived from the same settings the engine uses, so the pool exists (and `kestrel shm ls`
shows it) before any engine connects, and the disk index can be rebuilt at startup. An
engine's KVHello carries its own identity and block bytes; a mismatch is refused.

- model identity: `shared.kv_layout.identity_for(cfg)`, the engine's prefix-cache root
  (`KVLayout.model_identity`); it needs no model folder.
- block bytes: `kv_offload_block_bytes` when set, else `KVLayout.slot_bytes` of the
  model (shared/kv_layout.py, from the model's config.json).
- a hybrid model's recurrent-state checkpoints (docs/ARCHITECTURE.md §4.7): their state
  identity and bytes from `shared.state_layout.StateLayout` (the model's config.json; none
  when the folder cannot be read and kv_offload_block_bytes is set: a hybrid engine is then
  refused at its hello). They take `kv_offload_state_fraction` of the CPU pool (a second
  pool) and of the disk limit (files under the state identity's folder).

`check` is the supervisor's view of all this: `kestrel serve` (services/cli.py) hands it
to the supervisor, which runs it before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from services.kvstore.disk_tier import file_bytes
from shared.config import KestrelConfig, check_kv_offload
from shared.kv_layout import identity_for, kv_layout_for
from shared.kv_pool import HEADER_SIZE, slot_stride
from shared.model_spec import ModelFolderError
from shared.state_layout import state_layout_for

GIB = 1 << 30


class ConfigError(ValueError):
    """A kvstore setting that cannot work; the message names the setting."""


@dataclass(frozen=True)
class StoreSetup:
    """model_identity: 32 bytes. block_bytes: bytes per block. n_slots: CPU pool slots.
    disk_dir: None without a disk tier. disk_capacity: block files the disk limit holds.
    A hybrid model's state checkpoints (0 / b"" for a dense model): state_identity (32
    bytes), state_bytes (one checkpoint), state_n_slots (slots of the state pool),
    state_disk_capacity (checkpoint files the disk limit holds)."""

    model_identity: bytes
    block_bytes: int
    n_slots: int
    disk_dir: str | None
    disk_capacity: int
    state_identity: bytes = b""
    state_bytes: int = 0
    state_n_slots: int = 0
    state_disk_capacity: int = 0


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


def store_state_layout(cfg: KestrelConfig) -> tuple[bytes, int]:
    """(state identity, bytes of one checkpoint) of a hybrid model, (b"", 0) for a dense one
    (see module doc). Raises ConfigError when the model folder names recurrent layers but
    cannot size their state, or cannot be read and kv_offload_block_bytes is unset."""
    try:
        layout = state_layout_for(cfg)
    except (ModelFolderError, ValueError) as e:
        if cfg.kv_offload_block_bytes is not None and isinstance(e, ModelFolderError):
            return b"", 0
        raise ConfigError(f"cannot size a state checkpoint of {cfg.model!r} ({e})") from None
    return (layout.state_identity, layout.state_bytes) if layout is not None else (b"", 0)


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
    the reverse), a non-positive limit (`shared.config.check_kv_offload`), a limit smaller than one block file, a pool larger
    than the host memory or than the free space of /dev/shm, an unwritable disk dir, and a
    pool that holds no block."""
    cpu_gib = cfg.kv_offload_cpu_gib
    if cpu_gib is None or cpu_gib <= 0:
        raise ConfigError("setting kv_offload_cpu_gib: the kvstore needs a CPU tier; set "
                          "--kv-offload-cpu-gib to a positive size in GiB")
    try:  # the pairing and signs (the config builder has refused these already)
        check_kv_offload(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        identity = identity_for(cfg)
    except ValueError as e:  # an int8 kv_cache_dtype on CUDA (the config check refuses it first)
        raise ConfigError(str(e)) from None
    block_bytes = store_block_bytes(cfg)
    state_identity, state_bytes = store_state_layout(cfg)
    pool_bytes = int(cpu_gib * GIB)
    total = psutil.virtual_memory().total
    headers = HEADER_SIZE * (2 if state_bytes else 1)
    if pool_bytes + headers > total:
        raise ConfigError(f"setting kv_offload_cpu_gib: a pool of {cpu_gib} GiB is larger than "
                          f"the host memory ({total / GIB:.1f} GiB)")
    shm_free = psutil.disk_usage("/dev/shm").free
    if pool_bytes + headers > shm_free:
        raise ConfigError(f"setting kv_offload_cpu_gib: a pool of {cpu_gib} GiB does not fit in "
                          f"/dev/shm ({shm_free / GIB:.1f} GiB free)")
    share = cfg.kv_offload_state_fraction if state_bytes else 0.0  # the checkpoints' part
    n_slots = int(pool_bytes * (1 - share)) // slot_stride(block_bytes)
    if n_slots < 1:
        raise ConfigError(f"setting kv_offload_cpu_gib: {cpu_gib} GiB holds no block of "
                          f"{block_bytes} bytes")
    state_slots = int(pool_bytes * share) // slot_stride(state_bytes) if state_bytes else 0
    if state_bytes and state_slots < 1:
        raise ConfigError(f"setting kv_offload_cpu_gib: {share:g} of {cpu_gib} GiB "
                          f"(kv_offload_state_fraction) holds no state checkpoint of {state_bytes} bytes")
    disk_dir, capacity, state_capacity = None, 0, 0
    if cfg.kv_offload_disk_dir:
        disk_dir = os.path.abspath(cfg.kv_offload_disk_dir)
        disk_bytes = int((cfg.kv_offload_disk_gib or 0.0) * GIB)
        capacity = int(disk_bytes * (1 - share)) // file_bytes(block_bytes)
        if capacity < 1:
            raise ConfigError(f"setting kv_offload_disk_gib: {cfg.kv_offload_disk_gib} GiB holds "
                              f"no block file of {file_bytes(block_bytes)} bytes")
        if state_bytes:
            state_capacity = int(disk_bytes * share) // file_bytes(state_bytes)
            if state_capacity < 1:
                raise ConfigError(f"setting kv_offload_disk_gib: {share:g} of {cfg.kv_offload_disk_gib} "
                                  f"GiB (kv_offload_state_fraction) holds no state checkpoint file of "
                                  f"{file_bytes(state_bytes)} bytes")
        _check_writable(disk_dir)
    return StoreSetup(identity, block_bytes, n_slots, disk_dir, capacity,
                      state_identity, state_bytes, state_slots, state_capacity)


def check(cfg: KestrelConfig) -> str:
    """The supervisor's check of the offload settings before anything starts: a one-line
    summary of the tiers. Raises ConfigError as `resolve_setup`."""
    setup = resolve_setup(cfg)
    disk = f"{setup.disk_dir} ({setup.disk_capacity} blocks)" if setup.disk_dir else "off"
    states = ""
    if setup.state_bytes:
        states = (f"; {setup.state_n_slots} state checkpoint slots of {setup.state_bytes} bytes"
                  + (f", {setup.state_disk_capacity} on disk" if setup.disk_dir else ""))
    return f"{setup.n_slots} CPU slots of {setup.block_bytes} bytes, disk tier {disk}{states}"
