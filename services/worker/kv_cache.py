"""The worker's paged KV cache tensors (docs/ARCHITECTURE.md §4); the block manager lives in
the engine.

What a layer caches is its `PagedKVSpec` (the model says it, `CausalLM.kv_specs`); the cache
allocates one `KVHandle` per layer from it. A handle holds k and v of shape [num_blocks,
block_size, num_kv_heads, head_dim] in the KV dtype (the model dtype, or a quantized format
of `kernels.kv_quant`: float8_e4m3fn with per-layer scales, int8 with per-token-and-head
scales in fp32 tensors [num_blocks, block_size, num_kv_heads] beside k and v, written with
the block; docs/ARCHITECTURE.md §4.6). Slot s of a layer's cache is
block s // block_size, offset s % block_size. The cache is zero-filled: attention reads
padded slots under a mask, and 0 * NaN from uninitialised memory would poison the output.
On the CPU the zeros are the kernel's: every tensor is a view of one anonymous mmap, whose
pages are zero when first touched (mmap(2)), so the start does not fault the whole cache in
(`torch.zeros` writes every page: 1.2 GiB took 2-10 s of a worker restart on the 2-core dev
VM, where a page's first touch is the slow part). A daemon thread then faults the pages in
behind the start (`_populate`: madvise MADV_POPULATE_WRITE in 32 MiB chunks; Linux >= 5.14,
else the pages stay lazy), so the worker's RSS reaches its plateau within seconds of
serving instead of growing for minutes as blocks are first used (benchmarks/soak.py reads
RSS growth as a leak).
Only the attention backends (`services.worker.layers.attention`) and the tier copier
(`services.worker.kv_transfer`) touch the tensors; models never do.
"""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKVSpec:
    """What one attention layer caches per token: keys and values of num_kv_heads heads of
    head_dim each, in paged blocks. (Recurrent-state layers of hybrid models will add a spec
    of their own.)"""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVHandle:
    """One layer's paged KV cache.

    k, v: [num_blocks, block_size, num_kv_heads, head_dim] of `dtype`.
    k_scale, v_scale: dequantisation scales of a quantized KV dtype (`kernels.kv_quant`):
    float8_e4m3fn: the layer's 0-d fp32 scales; int8: fp32 [num_blocks, block_size,
    num_kv_heads], one per token and head, written with the token's K and V. None while the
    cache is in the model dtype.
    """

    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class KVCache:
    """Allocates one `KVHandle` per layer.

    specs: one `PagedKVSpec` per layer, in layer order (all layers of one shape today).
    num_blocks, block_size: of every layer. dtype, device: of the tensors (dtype
    torch.float8_e4m3fn or torch.int8: a quantized cache with its scales, see `KVHandle`).
    fp8_scales: float8_e4m3fn only: (k_scale, v_scale) per layer (None: 1.0 for every layer).
    Attributes: layers (the handles), k and v (the layers' tensors, in order), k_scale and
    v_scale (the layers' scales, in order; Nones for a float cache), num_blocks, block_size,
    bytes (all layers, K and V and int8's scales, as allocated; the per-block bytes are
    `shared.kv_layout.KVLayout.block_bytes`).
    Raises ValueError when specs is empty, the layers' shapes differ or fp8_scales does not
    have one pair per layer.
    """

    def __init__(self, specs: list[PagedKVSpec], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 fp8_scales: list[tuple[float, float]] | None = None):
        if not specs or any(s != specs[0] for s in specs):
            raise ValueError(f"KV cache: one shape for every layer expected, got {sorted(set(specs), key=str)}")
        self.num_blocks, self.block_size = num_blocks, block_size
        s, n, dev = specs[0], len(specs), torch.device(device)
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        tensors = _zeros(2 * n, shape, dtype, dev)
        scales: list[torch.Tensor | None] = [None] * (2 * n)
        if dtype == torch.int8:
            scales = list(_zeros(2 * n, shape[:3], torch.float32, dev))
        elif dtype == torch.float8_e4m3fn:
            pairs = fp8_scales if fp8_scales is not None else [(1.0, 1.0)] * n
            if len(pairs) != n:
                raise ValueError(f"KV cache: {len(pairs)} fp8 scale pairs for {n} layers")
            scales = [torch.tensor(float(x), dtype=torch.float32, device=dev) for p in pairs for x in p]
        self.layers = [KVHandle(tensors[2 * i], tensors[2 * i + 1], dtype, scales[2 * i], scales[2 * i + 1])
                       for i in range(n)]
        self.k = [h.k for h in self.layers]
        self.v = [h.v for h in self.layers]
        self.k_scale = [h.k_scale for h in self.layers]
        self.v_scale = [h.v_scale for h in self.layers]
        per_token = [t for t in self.k_scale + self.v_scale if t is not None and t.dim()]  # int8's
        self.bytes = sum(t.numel() * t.element_size() for t in self.k + self.v + per_token)  # as allocated


def _zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` and `dtype` on `device`. On the CPU they are views of
    one anonymous private mmap (zero pages, faulted in lazily; the tensors keep the mapping
    alive); elsewhere `torch.zeros`."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    numel = math.prod(shape)
    nbytes = count * numel * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, max(nbytes, 1))
    flat = torch.frombuffer(mm, dtype=dtype, count=count * numel)
    threading.Thread(target=_populate, args=(mm,), name="kv-populate", daemon=True).start()
    return [flat[i * numel:(i + 1) * numel].view(shape) for i in range(count)]


_POPULATE_CHUNK = 32 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14 (madvise(2))


def _populate(mm: mmap.mmap) -> None:
    """Fault every page of `mm` in, 32 MiB at a time, without changing its contents:
    MADV_POPULATE_WRITE (madvise(2)) maps each page writable and zero-filled, or keeps a page
    already written, and never writes data, so it may run beside the worker writing blocks.
    On a kernel without it (EINVAL) the pages stay lazy: a zero write from this thread could
    race a block's first write, so there is no fallback."""
    step = _POPULATE_CHUNK
    try:
        for off in range(0, len(mm), step):
            mm.madvise(_MADV_POPULATE_WRITE, off, min(step, len(mm) - off))
    except (OSError, ValueError):
        pass

