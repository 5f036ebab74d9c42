"""Settings profiles: defaults picked by the device and the model size (DESIGN §8).

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
compute capability that nvidia-smi reports.

Device detection never imports torch (the frontend and the engine must not need it): a GPU
host is one with `/dev/nvidiactl`; its name, compute capability and memory come from
`nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits` when
that command exists. Host memory comes from psutil.

This module also formats the startup report (`format_startup_report`) that the engine logs
and the supervisor prints once the server is ready.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from shared.model_spec import (DEFAULT_MAX_POSITIONS, DTYPE_BYTES, ModelFolderError,
                               default_max_model_len, load_model_spec)

GIB = 1 << 30
PROFILE_NAMES = ("auto", "cpu", "sm90", "gpu", "none")

# Model size classes by estimated parameter count.
MEDIUM_PARAMS = 3e9
LARGE_PARAMS = 30e9


@dataclass(frozen=True)
class DeviceInfo:
    """What the profile needs to know about this host.

    kind: "cpu" or "cuda". name: GPU name ("" on cpu). compute_cap: "9.0" style, "" when
    unknown. gpu_memory_bytes: memory of GPU 0 in bytes (0 on cpu or unknown). num_gpus: GPUs
    nvidia-smi listed. host_memory_bytes / host_available_bytes: RAM total and available,
    bytes. cpu_count: logical CPUs this process may use.
    """

    kind: str
    name: str = ""
    compute_cap: str = ""
    gpu_memory_bytes: int = 0
    num_gpus: int = 0
    host_memory_bytes: int = 0
    host_available_bytes: int = 0
    cpu_count: int = 1

    def describe(self) -> str:
        """One line for the startup log: the device and its memory."""
        host = (f"host memory {self.host_memory_bytes / GIB:.1f} GiB "
                f"({self.host_available_bytes / GIB:.1f} GiB available), {self.cpu_count} CPUs")
        if self.kind == "cuda":
            cap = f", sm{self.compute_cap.replace('.', '')}" if self.compute_cap else ""
            mem = f", {self.gpu_memory_bytes / GIB:.1f} GiB" if self.gpu_memory_bytes else ""
            n = f"{self.num_gpus} x " if self.num_gpus > 1 else ""
            return f"cuda: {n}{self.name or 'NVIDIA GPU'}{cap}{mem}; {host}"
        return f"cpu; {host}"


def _host_memory() -> tuple[int, int, int]:
    """(total bytes, available bytes, usable CPUs) of this host."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, avail = int(vm.total), int(vm.available)
    except Exception:  # psutil missing or /proc unreadable: assume a small host
        total = avail = 4 * GIB
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return total, avail, cpus


def _nvidia_smi() -> list[tuple[str, str, int]]:
    """[(name, compute_cap, memory bytes)] per GPU from nvidia-smi; [] when unavailable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10.0, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [s.strip() for s in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            mem = int(float(parts[2])) * (1 << 20) if len(parts) > 2 else 0  # MiB -> bytes
        except ValueError:
            mem = 0
        gpus.append((parts[0], parts[1], mem))
    return gpus


@functools.lru_cache(maxsize=1)
def detect_device() -> DeviceInfo:
    """Probe this host once (cached): /dev/nvidiactl, nvidia-smi, psutil. No torch."""
    total, avail, cpus = _host_memory()
    if not os.path.exists("/dev/nvidiactl"):
        return DeviceInfo("cpu", host_memory_bytes=total, host_available_bytes=avail,
                          cpu_count=cpus)
    gpus = _nvidia_smi()
    name, cap, mem = gpus[0] if gpus else ("", "", 0)
    return DeviceInfo("cuda", name, cap, mem, len(gpus), total, avail, cpus)


# ---------------------------------------------------------------------------- model size

@dataclass(frozen=True)
class ModelSize:
    """Size facts of a model folder, estimated from config.json (no weights read).

    params: parameter count estimate (None when config.json is missing or unreadable).
    kv_bytes_per_token_elem: KV elements per token across all layers (2 * layers * kv heads
    * head dim); multiply by the KV dtype's bytes. max_position_embeddings: tokens.
    """

    params: float | None
    kv_elems_per_token: int = 0
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS

    @property
    def size_class(self) -> str:
        """"small" (< 3B parameters or unknown), "medium" (< 30B) or "large"."""
        if self.params is None or self.params < MEDIUM_PARAMS:
            return "small"
        return "medium" if self.params < LARGE_PARAMS else "large"

    def describe(self) -> str:
        if self.params is None:
            return "model size unknown"
        p = self.params
        txt = f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M"
        return f"~{txt} parameters ({self.size_class})"


def estimate_model_size(model_dir: str) -> ModelSize:
    """Estimate the parameter count of a HF decoder from its `ModelSpec`.

    Counts embeddings (and an untied lm_head), per-layer attention projections (q, k, v, o),
    the gated MLP (3 * hidden * intermediate, times the expert count for MoE configs) and
    norms. Good to a few percent for Llama-style models, which is all a profile needs.
    A folder that has no usable config.json gives ModelSize(None).
    """
    try:
        m = load_model_spec(model_dir)
    except ModelFolderError:
        return ModelSize(None)
    h, heads, kv_heads, head_dim = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp = 3 * h * (m.moe_intermediate_size * m.num_experts if m.num_experts > 1 else m.intermediate_size)
    per_layer = attn + mlp + 2 * h
    emb = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return ModelSize(float(m.num_layers * per_layer + emb + h), 2 * m.num_layers * kv_heads * head_dim,
                     m.max_position_embeddings)


# ---------------------------------------------------------------------------- profiles

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


# ---------------------------------------------------------------------------- startup report

def _gib(n: Any) -> str:
    try:
        return f"{float(n) / GIB:.2f} GiB"
    except (TypeError, ValueError):
        return "?"


def _secs(v: Any) -> str:
    return f"{float(v):.2f} s" if isinstance(v, (int, float)) else "?"


_KNOWN = {"device", "dtype", "threads", "attention", "kernels", "weight_bytes", "kv_bytes",
          "num_blocks", "block_size", "kv_tokens", "max_model_len", "load_seconds",
          "kv_alloc_seconds", "startup_s", "graph_sizes", "cuda_graph_sizes",
          "gpu_memory_bytes", "device_name", "rank", "pid"}


def format_startup_report(report: dict[str, Any]) -> list[str]:
    """The startup report as log lines (DESIGN §8).

    report: what the engine writes to `<runtime_dir>/startup_report.json`:
      {"device": str (host description), "workers": [WorkerReady.report + rank, pid],
       "num_blocks": int, "block_size": int, "kv_tokens": int, "max_model_len": int,
       "phases": {name: seconds}}. Worker phases (load, kv alloc, worker startup) are
    seconds since the worker started; engine phases since the engine started; `ready`
    (added by the supervisor) since the supervisor started the processes.
    Lines: device and memory, kernels, weight and KV memory, KV blocks and tokens, graph
    sizes, time per phase, then any other worker facts.
    """
    lines = []
    workers = report.get("workers") or [{}]
    if report.get("device"):
        lines.append(f"device: {report['device']}")
    for w in workers:
        tag = f"worker {w.get('rank', 0)}"
        dev = w.get("device_name") or w.get("device", "?")
        mem = f", device memory {_gib(w['gpu_memory_bytes'])}" if w.get("gpu_memory_bytes") else ""
        threads = f", {w['threads']} threads" if w.get("threads") else ""
        lines.append(f"{tag}: {dev}, {w.get('dtype', '?')}{threads}{mem}")
        kernels = w.get("kernels")
        if isinstance(kernels, dict):
            ktxt = ", ".join(f"{k} {v}" for k, v in kernels.items())
        else:
            ktxt = f"attention {w.get('attention', '?')}" + (f", {kernels}" if kernels else "")
        lines.append(f"{tag} kernels: {ktxt}")
        lines.append(f"{tag} memory: weights {_gib(w.get('weight_bytes'))}, "
                     f"KV cache {_gib(w.get('kv_bytes'))}")
        graphs = w.get("graph_sizes", w.get("cuda_graph_sizes"))
        gtxt = (", ".join(str(g) for g in graphs) if graphs else
                "none (eager)" if graphs is not None or w.get("device", "cpu") != "cpu"
                else "none (cpu runs eagerly)")
        lines.append(f"{tag} graph sizes: {gtxt}")
        extra = {k: v for k, v in w.items() if k not in _KNOWN}
        if extra:
            lines.append(f"{tag} other: " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
    lines.append(f"KV blocks: {report.get('num_blocks', '?')} of {report.get('block_size', '?')} "
                 f"tokens = {report.get('kv_tokens', '?')} KV tokens; "
                 f"max_model_len {report.get('max_model_len', '?')}")
    phases = dict(report.get("phases") or {})
    w0 = workers[0]
    ordered = {"load": w0.get("load_seconds"), "kv alloc": w0.get("kv_alloc_seconds"),
               "worker startup": w0.get("startup_s")}
    ordered.update(phases)
    lines.append("phases: " + ", ".join(f"{k} {_secs(v)}" for k, v in ordered.items()
                                        if v is not None))
    return ["startup report: " + s for s in lines]
