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

A hybrid model's recurrent-state checkpoints (docs/ARCHITECTURE.md §4.7) go the same way
through the store's second pool (`StepPlan.state_pool`): `state_loads` (state pool slot ->
checkpoint slot of the `StateCache`) before the step, `state_stores` (checkpoint slot ->
state pool slot) after it. A state slot holds one request's state as
`shared.state_layout.StateLayout` says: per recurrent layer, its tensors in its
`StateSpec`'s order (conv window, recurrent matrix), each C-contiguous.
"""

from __future__ import annotations

import logging

import torch

from services.worker.kv_cache import KVCache
from services.worker.state_cache import StateCache
from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool
from shared.protocol import StepPlan

log = logging.getLogger("kestrel.worker")


class PoolCopier:
    """Copies between one pool's slots and the entries of a cache on the device.

    parts: the cache as uint8 [num_entries, bytes of one entry's part] views, in slot order
    (a slot holds one entry: its parts back to back). slot_bytes: their sum. device: the
    cache's device. The pool is mapped on first use and again when the pid of the kvstore
    that made it changes (a restarted kvstore).
    """

    def __init__(self, parts: list[torch.Tensor], device: torch.device, what: str):
        self.parts, self.device, self.what = parts, device, what
        self.slot_bytes = sum(p.shape[1] for p in parts)
        self.pool: KVPool | None = None
        self.pool_pid = 0
        self._mem: torch.Tensor | None = None   # the whole segment, uint8
        self._registered = False

    # ------------------------------------------------------------ mapping
    def _attach(self, name: str, pid: int) -> None:
        """Map pool `name` (created by kvstore pid `pid`). Raises FileNotFoundError,
        ValueError (not a pool, or its slots are not this worker's entry size)."""
        if self.pool is not None and self.pool_pid == pid and pid:
            return
        self.detach()
        pool = KVPool.attach(name)
        if pool.slot_bytes != self.slot_bytes:
            pool.close()
            raise ValueError(f"kvstore pool {name}: slots of {pool.slot_bytes} bytes, this worker's "
                             f"{self.what}s are {self.slot_bytes}")
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

    def detach(self) -> None:
        """Unmap the pool (and unregister it)."""
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
        """Slot `slot` as a [slot_bytes] uint8 tensor."""
        pool, mem = self.pool, self._mem
        assert pool is not None and mem is not None  # copies attach first
        off = pool.offset(slot)
        return mem[off:off + self.slot_bytes]

    # ------------------------------------------------------------ copies
    def load(self, name: str, pid: int, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot, entry) pairs from the pool into the cache. Raises like `_attach`,
        IndexError for a slot or entry out of range."""
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
        """Copy (entry, slot) pairs from the cache into the pool; returns when the bytes
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


class KVTransfer:
    """The tier copier of one worker: KV blocks, and a hybrid model's state checkpoints.

    kv: the worker's `KVCache` (lists k and v of [num_blocks, block_size, heads, head_dim],
    and k_scale and v_scale: an int8 cache's [num_blocks, block_size, heads] scales, moved
    with the block; 0-d per-layer scales and Nones are not). layout: the model's KV layout
    (one rank of one). state: the `StateCache` of a hybrid model (None for a dense one).
    Attributes slot_bytes: bytes of one block in a slot (the layout in the module doc);
    state_bytes: bytes of one state checkpoint (0 without a state cache). Raises ValueError
    when the cache's tensors are not laid out as `layout` says.
    """

    def __init__(self, kv: KVCache, layout: KVLayout, state: StateCache | None = None):
        self.kv = kv
        k0 = kv.k[0]
        self.dtype, self.device = k0.dtype, k0.device
        self.num_layers = len(kv.k)
        self.slot_bytes = layout.slot_bytes
        scales = [getattr(kv, "k_scale", [None] * self.num_layers), getattr(kv, "v_scale", [None] * self.num_layers)]
        # each block's parts in slot order, as uint8 [num_blocks, bytes of one block's part]
        parts: list[torch.Tensor] = []
        for layer in range(self.num_layers):
            tensors = [kv.k[layer], kv.v[layer]] + [s[layer] for s in scales
                                                    if s[layer] is not None and s[layer].dim() > 0]
            parts += [_bytes_view(t) for t in tensors]
        if sum(p.shape[1] for p in parts) != self.slot_bytes:
            raise ValueError(f"a KV cache of {self.num_layers} layers of {tuple(k0.shape)} "
                             f"{self.dtype} blocks is not laid out as {layout}")
        self.blocks = PoolCopier(parts, self.device, "block")
        self.parts = parts
        self.states: PoolCopier | None = None
        if state is not None:  # per recurrent layer its tensors, in spec order
            self.states = PoolCopier([_bytes_view(t) for layer in state.layers for t in layer],
                                     self.device, "state checkpoint")
        self.state_bytes = self.states.slot_bytes if self.states is not None else 0

    def detach(self) -> None:
        """Unmap both pools."""
        self.blocks.detach()
        if self.states is not None:
            self.states.detach()

    def load(self, name: str, pid: int, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot, block) pairs from the pool into the KV cache (`PoolCopier.load`)."""
        self.blocks.load(name, pid, pairs)

    def store(self, name: str, pid: int, pairs: list[tuple[int, int]]) -> None:
        """Copy (block, slot) pairs from the KV cache into the pool (`PoolCopier.store`)."""
        self.blocks.store(name, pid, pairs)

    # ------------------------------------------------------------ step hooks
    def before_step(self, plan: StepPlan) -> str:
        """Loads of `plan` (before its forward): blocks, then checkpoints. Returns "" or why
        they failed; then the blocks and checkpoint slots they were filling hold garbage, the
        forward must not run, and the engine recomputes the step's requests
        (`StepResult.kv_load_error`)."""
        if not plan.kv_loads and not plan.state_loads:
            return ""
        try:
            if plan.kv_loads:
                self.load(plan.kv_pool, plan.kv_pool_pid, plan.kv_loads)
            if plan.state_loads:
                if self.states is None:
                    raise ValueError("state checkpoint loads for a model without recurrent state")
                self.states.load(plan.state_pool, plan.kv_pool_pid, plan.state_loads)
            return ""
        except Exception as e:
            log.warning("step %d: KV tier loads failed (%d blocks, %d checkpoints): %s; its "
                        "requests recompute", plan.step_id, len(plan.kv_loads), len(plan.state_loads), e)
            return f"{type(e).__name__}: {e}"

    def after_step(self, plan: StepPlan) -> str:
        """Stores of `plan` (after its forward): blocks, then checkpoints. Returns "" or why
        they failed (the engine drops them; the step's tokens stand)."""
        if not plan.kv_stores and not plan.state_stores:
            return ""
        try:
            self.store(plan.kv_pool, plan.kv_pool_pid, plan.kv_stores)
            if plan.state_stores:
                if self.states is None:
                    raise ValueError("state checkpoint stores for a model without recurrent state")
                self.states.store(plan.state_pool, plan.kv_pool_pid, plan.state_stores)
            return ""
        except Exception as e:
            log.warning("step %d: KV stores failed: %s", plan.step_id, e)
            return f"{type(e).__name__}: {e}"


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """`t` [n, ...] as uint8 [n, bytes of one entry] (a view: copies through it write `t`)."""
    return t.view(t.shape[0], -1).view(torch.uint8)
