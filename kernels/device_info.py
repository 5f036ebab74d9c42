"""Facts about the device a kernel launches on, looked up once per device.

`num_sms` sizes the grids of split kernels (decode attention's split-K, the skinny linear's
K split, the chunked sampler). CPU tensors run the kernels under Triton's interpreter in
tests; there it answers a small count, so that the split paths are exercised at tiny sizes.
`tile_counters` is the per-device zeroed counter buffer that split-K kernels share (one
buffer per pool: the linear kernels' pool, decode attention's own).
"""

from __future__ import annotations

import torch

_NUM_SMS: dict[int, int] = {}
INTERPRETER_SMS = 4


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (H200: 132); INTERPRETER_SMS for a CPU
    device (Triton's interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


TILE_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}  # (device, pool) -> zeroed int32 counters
_RETIRED: list[torch.Tensor] = []  # outgrown counter buffers: captured graphs may still use them
COUNTERS_MIN = 4096  # counters allocated at least (Qwen3-0.6B's widest layer has 384 N tiles)


def tile_counters(device: torch.device, n_tiles: int, pool: str = "split_k") -> torch.Tensor | None:
    """The device's persistent int32 counter buffer of split-K kernels (`kernels.linear`,
    `kernels.gemv`: the last program of a tile to arrive sums the partials), at least
    n_tiles long and all zero between launches; allocated (or grown) on first need, outside
    CUDA-graph capture. pool names a separate buffer (decode attention's in-kernel merge
    takes "decode_merge"), so that kernels of different pools never share a counter.
    Returns None when it would have to be allocated during capture (the caller then takes
    a path without counters)."""
    key = (device, pool)
    buf = TILE_COUNTERS.get(key)
    if buf is not None and buf.numel() >= n_tiles:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    new = torch.zeros(max(COUNTERS_MIN, 1 << (n_tiles - 1).bit_length()), dtype=torch.int32, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # zeroed before any stream's launch reads it
    if buf is not None:
        _RETIRED.append(buf)
    TILE_COUNTERS[key] = new
    return new
