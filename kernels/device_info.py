"""Facts about the device a kernel launches on, looked up once per device.

`num_sms` sizes the grids of split kernels (decode attention's split-K, the skinny linear's
K split, the chunked sampler). CPU tensors run the kernels under Triton's interpreter in
tests; there it answers a small count, so that the split paths are exercised at tiny sizes.
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
