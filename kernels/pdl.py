"""Programmatic dependent launch (PDL) for the decode-path Triton kernels.

On Hopper (compute capability 9.0+) a kernel launched with the programmatic-stream-
serialization attribute may start while the kernel before it on the stream is still running
(CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX
`griddepcontrol`). Its programs must then run `griddepcontrol.wait` (`pdl_wait`) before they
read anything the kernel before wrote, and before they write anything at all (a buffer it
still reads may be handed out again by torch's allocator). Work that touches only data no
kernel of the step writes may go first: the matrix-vector kernel (`kernels.gemv`) loads its
weight tile before the wait, so the weight stream of one projection overlaps the small
kernel before it. `pdl_release` (`griddepcontrol.launch_dependents`) lets the next kernel's
programs be scheduled before this one's have finished.

Every kernel launched with PDL runs `pdl_wait` on every path (none returns before it): the
wait of a kernel covers the kernel before it only, so a chain is ordered only if each link
waits. Kernels launched without the attribute (torch's, cuBLAS) keep the usual stream order.
Captured CUDA graphs keep the programmatic edges (CUDA 12.3+).

`ENABLED` turns it on or off for every kernel (benchmarks flip it); `use_pdl(device)` is
what a launcher passes as the kernel's USE_PDL and as Triton's `launch_pdl`.
Measured on the H200 (Qwen3-0.6B, batch 1): the decode stack without attention in one graph
579 -> 495 us with the gemv kernel; decode_latency.py TPOT 1.111 ms with `--pdl off`
against 0.955 on (one run each, same machine and session).
"""

from __future__ import annotations

import torch

ENABLED = True  # benchmarks/decode_latency.py --pdl off measures without it
_CAPABLE: dict[int, bool] = {}

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: ENABLED, a CUDA device of compute
    capability 9.0 or newer, and a Triton that has `tl.extra.cuda.gdc_wait`. False for the
    CPU (Triton's interpreter has no griddepcontrol)."""
    if not ENABLED or device.type != "cuda" or triton is None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        cuda_ext = getattr(getattr(tl, "extra", None), "cuda", None)
        _CAPABLE[idx] = (torch.cuda.get_device_capability(idx)[0] >= 9
                         and hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents"))
    return _CAPABLE[idx]


def launch_args(pdl: bool) -> dict:
    """Triton launch keywords for a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        """Wait until the kernel before has finished and its writes are visible (no-op
        without PDL)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release(USE_PDL: tl.constexpr):
        """Let the next kernel's programs launch now (no-op without PDL)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
