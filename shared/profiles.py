"""Settings profiles: defaults picked by the device and the model size
(docs/ARCHITECTURE.md §8).

A profile is a set of setting values that replaces the built-in defaults; every explicit
setting (config file, env, cli) still wins over it. `shared.config.build_config` applies the
chosen profile with the source `profile:<name>`.

Profiles (`--profile auto|cpu|sm90|gpu|none`):
- `cpu`:  max_num_seqs 16 (8 for models of 3B parameters or more), max_num_batched_tokens
  1024 (512), kv_cache_gib from the host's available memory (see `cpu_kv_cache_gib`).
- `sm90`: an NVIDIA GPU of compute capability 9.0 (H100/H200): max_num_seqs 256 (128 for
  30B or more), max_num_batched_tokens 8192, gpu_memory_utilization 0.9.
- `gpu`:  any other NVIDIA GPU: max_num_seqs 128 (64 for 30B or more),
  max_num_batched_tokens 4096, gpu_memory_utilization 0.9.
- `none`: the built-in defaults only.
`auto` picks `cpu` when the device is cpu (set, or no GPU found), else `sm90` or `gpu` by the
compute capability that nvidia-smi reports (shared/device.py). The model size comes from
shared/model_size.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.device import GIB, DeviceInfo, detect_device
from shared.model_size import ModelSize, estimate_model_size
from shared.model_spec import DTYPE_BYTES, default_max_model_len

PROFILE_NAMES = ("auto", "cpu", "sm90", "gpu", "none")


@dataclass
class Profile:
    """A chosen profile: its name, the values it sets and why it was chosen."""

    name: str
    values: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def cpu_kv_cache_gib(device: DeviceInfo, size: ModelSize, dtype_bytes: int,
                     max_model_len: int | None) -> float:
    """KV cache GiB for the CPU path: 5% of the available host memory left after the weights
    (fp32 estimate), between 0.5 and 4 GiB, raised to hold 1.25 x max_model_len tokens
    (the engine refuses a KV cache smaller than max_model_len). Rounded up to 1/8 GiB."""
    weights = (size.params or 0) * dtype_bytes
    free = max(device.host_available_bytes - weights, 0)
    gib = min(max(0.05 * free / GIB, 0.5), 4.0)
    if size.kv_elems_per_token:
        tokens = max_model_len or default_max_model_len(size.max_position_embeddings)
        need = 1.25 * tokens * size.kv_elems_per_token * dtype_bytes / GIB
        gib = max(gib, need)
    return float(int(gib * 8 + 0.999)) / 8


def choose_profile(requested: str, device: str, model_dir: str, *, dtype: str = "auto",
                   max_model_len: int | None = None,
                   probe: DeviceInfo | None = None) -> Profile | None:
    """The profile for a server, or None for `none`.

    requested: the `profile` setting (auto, cpu, sm90, gpu, none). device: the `device`
    setting (auto, cpu, cuda). model_dir: the model folder (config.json gives the size).
    dtype / max_model_len: the settings (they size the CPU KV cache). probe: the host's
    DeviceInfo (default: `detect_device()`; tests pass their own).
    Raises ValueError for an unknown profile name.
    """
    if requested not in PROFILE_NAMES:
        raise ValueError(f"setting profile: {requested!r} is not one of {PROFILE_NAMES}")
    if requested == "none":
        return None
    dev = probe or detect_device()
    size = estimate_model_size(model_dir)
    name = requested
    if name == "auto":
        if device == "cpu" or dev.kind == "cpu":
            name = "cpu"
        else:
            name = "sm90" if dev.compute_cap.strip() == "9.0" else "gpu"
    big = size.size_class
    if name == "cpu":
        dtype_bytes = DTYPE_BYTES.get(dtype, DTYPE_BYTES["float32"])  # "auto" on a CPU: float32
        values = {"max_num_seqs": 16 if big == "small" else 8,
                  "max_num_batched_tokens": 1024 if big == "small" else 512,
                  "kv_cache_gib": cpu_kv_cache_gib(dev, size, dtype_bytes, max_model_len)}
    elif name == "sm90":
        values = {"max_num_seqs": 128 if big == "large" else 256,
                  "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}
    else:
        values = {"max_num_seqs": 64 if big == "large" else 128,
                  "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.9}
    how = "chosen by device" if requested == "auto" else "requested"
    return Profile(name, values, f"profile {name} ({how}): {dev.describe()}; {size.describe()}")
