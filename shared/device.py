"""This host's compute device and memory, probed once, without torch.

The frontend and the engine must not need torch, so detection never imports it: a GPU host
is one with `/dev/nvidiactl`; its name, compute capability and memory come from
`nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits` when
that command exists. Host memory comes from psutil. The settings profiles
(shared/profiles.py) and the engine's startup report read it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

GIB = 1 << 30


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
