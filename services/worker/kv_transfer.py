"""Copies of KV blocks between the worker's cache and the kvstore's shm pool (docs/ARCHITECTURE.md §4).

The engine's plan says what to copy (`StepPlan.kv_loads`: slot -> block before the step's
forward; `StepPlan.kv_stores`: block -> slot after it) and which pool (`kv_pool`, the
/dev/shm name, and `kv_pool_pid`, the kvstore that created it: the pool is mapped again
when that pid changes, i.e. after a kvstore restart). The kvstore never touches the bytes.

Slot byte layout (one block of one model, rank 0 of 1; all little-endian as the host):
layer-major, K then V, each a C-contiguous [block_size, num_kv_heads, head_dim] array of the
KV cache dtype::

    layer 0 K | layer 0 V | layer 1 K | layer 1 V | ... | layer L-1 V

i.e. a [L, 2, block_size, num_kv_heads, head_dim] array, 2 * L * block_size *
num_kv_heads * head_dim * element_size bytes: `shared.kv_layout.KVLayout.slot_bytes`. The block's tokens are in position
order, as in `services.worker.kv_cache`. An int8 KV cache moves its per-token-and-head
scales with the block: each layer's share is K, V, K scales, V scales (the scales
[block_size, num_kv_heads] fp32 each), so a block loaded from a tier reads back exactly
as it was written. An fp8_e4m3 cache's per-layer scales are the model's, not the block's.
The copies move bytes (uint8 views of every part), so any element size works.

On a CUDA device the pool is registered as pinned host memory (cudaHostRegister through
torch.cuda.cudart()) when that works, so each slot is copied by DMA straight to or from the
device (one async copy per slot, no host staging); otherwise plain pageable copies through
a host stack.
"""

from __future__ import annotations

import logging

import torch

from services.worker.kv_cache import KVCache
from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool
from shared.protocol import StepPlan

log = logging.getLogger("kestrel.worker")


class KVTransfer:
    """The block copier of one worker.

    kv: the worker's `KVCache` (lists k and v of [num_blocks, block_size, heads, head_dim],
    and k_scale and v_scale: an int8 cache's [num_blocks, block_size, heads] scales, moved
    with the block; 0-d per-layer scales and Nones are not). layout: the model's KV layout
    (one rank of one). Attribute slot_bytes: bytes of one block in a slot (the layout in
    the module doc). Raises ValueError when the cache's tensors are not laid out as
    `layout` says.
    """

    def __init__(self, kv: KVCache, layout: KVLayout):
        self.kv = kv
        k0 = kv.k[0]
        self.dtype, self.device = k0.dtype, k0.device
        self.num_layers = len(kv.k)
        self.slot_bytes = layout.slot_bytes
        scales = [getattr(kv, "k_scale", [None] * self.num_layers), getattr(kv, "v_scale", [None] * self.num_layers)]
        # each block's parts in slot order, as uint8 [num_blocks, bytes of one block's part]
        self.parts: list[torch.Tensor] = []
        for layer in range(self.num_layers):
            tensors = [kv.k[layer], kv.v[layer]] + [s[layer] for s in scales
                                                    if s[layer] is not None and s[layer].dim() > 0]
            self.parts += [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
        if sum(p.shape[1] for p in self.parts) != self.slot_bytes:
            raise ValueError(f"a KV cache of {self.num_layers} layers of {tuple(k0.shape)} "
                             f"{self.dtype} blocks is not laid out as {layout}")
        self.pool: KVPool | None = None
        self.pool_pid = 0
        self._mem: torch.Tensor | None = None   # the whole segment, uint8
        self._registered = False

    # ------------------------------------------------------------ mapping
    def _attach(self, name: str, pid: int) -> None:
        """Map pool `name` (created by kvstore pid `pid`). Raises FileNotFoundError,
        ValueError (not a pool, or its slots are not this worker's block size)."""
        if self.pool is not None and self.pool_pid == pid and pid:
            return
        self._detach()
        pool = KVPool.attach(name)
        if pool.slot_bytes != self.slot_bytes:
            pool.close()
            raise ValueError(f"kvstore pool {name}: slots of {pool.slot_bytes} bytes, this worker's "
                             f"blocks are {self.slot_bytes}")
        self.pool, self.pool_pid = pool, pid
        self._mem = torch.frombuffer(pool.mm, dtype=torch.uint8)
        if self.device.type == "cuda":
            self._register()
        log.info("mapped kvstore pool %s (%d slots)%s", name, pool.n_slots,
                 ", pinned" if self._registered else "")

    def _register(self) -> None:
        try:
            cudart = torch.cuda.cudart()
            mem = self._mem
            assert mem is not None  # called by _attach, after the map
            err = cudart.cudaHostRegister(mem.data_ptr(), mem.numel(), 0)
            self._registered = int(getattr(err, "value", err)) == 0
        except Exception as e:  # no cudart binding: pageable copies still work
            log.info("cudaHostRegister unavailable (%s): pool copies are pageable", e)

    def _detach(self) -> None:
        if self._registered and self._mem is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._mem.data_ptr())
            except Exception:
                pass
            self._registered = False
        self._mem = None
        if self.pool is not None:
            self.pool.close()  # the map stays while a tensor still views it
            self.pool = None

    def _slot(self, slot: int) -> torch.Tensor:
        """Slot `slot` as a [slot_bytes] uint8 tensor (the layout in the module doc)."""
        pool, mem = self.pool, self._mem
        assert pool is not None and mem is not None  # copies attach first
        off = pool.offset(slot)
        return mem[off:off + self.slot_bytes]

    # ------------------------------------------------------------ copies
    def load(self, name: str, pid: int, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot, block) pairs from the pool into the KV cache. Raises like `_attach`,
        IndexError for a slot or block out of range."""
        if not pairs:
            return
        self._attach(name, pid)
        if self._registered:  # DMA straight from each pinned slot into one device staging
            src = torch.empty((len(pairs), self.slot_bytes), dtype=torch.uint8, device=self.device)
            for i, (s, _) in enumerate(pairs):
                src[i].copy_(self._slot(s), non_blocking=True)
        else:
            src = torch.stack([self._slot(s) for s, _ in pairs])      # [n, slot_bytes]
            if self.device.type != "cpu":
                src = src.to(self.device)
        idx = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        off = 0
        for part in self.parts:
            n = part.shape[1]
            part.index_copy_(0, idx, src[:, off:off + n])
            off += n

    def store(self, name: str, pid: int, pairs: list[tuple[int, int]]) -> None:
        """Copy (block, slot) pairs from the KV cache into the pool; returns when the bytes
        are in the pool. Raises like `load`."""
        if not pairs:
            return
        self._attach(name, pid)
        idx = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=self.device)
        data = torch.cat([p.index_select(0, idx) for p in self.parts], dim=1)  # [n, slot_bytes]
        if self._registered:  # DMA straight into each pinned slot, then wait for them
            for i, (_, slot) in enumerate(pairs):
                self._slot(slot).copy_(data[i], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return
        if self.device.type != "cpu":
            data = data.cpu()
        for i, (_, slot) in enumerate(pairs):
            self._slot(slot).copy_(data[i])

    # ------------------------------------------------------------ step hooks
    def before_step(self, plan: StepPlan) -> None:
        """Loads of `plan` (before its forward). A failure raises: the step fails."""
        if plan.kv_loads:
            self.load(plan.kv_pool, plan.kv_pool_pid, plan.kv_loads)

    def after_step(self, plan: StepPlan) -> str:
        """Stores of `plan` (after its forward). Returns "" or why they failed (the engine
        drops them; the step's tokens stand)."""
        if not plan.kv_stores:
            return ""
        try:
            self.store(plan.kv_pool, plan.kv_pool_pid, plan.kv_stores)
            return ""
        except Exception as e:
            log.warning("step %d: KV stores failed: %s", plan.step_id, e)
            return f"{type(e).__name__}: {e}"
