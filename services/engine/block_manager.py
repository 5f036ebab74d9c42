"""KV block allocation and the GPU-local prefix cache (the tensors live in the workers).

A request's block table covers its computed tokens plus those scheduled this step: block i
holds token positions [i*block_size, (i+1)*block_size). Blocks are plain ids into the
workers' KV cache tensors.

Prefix cache (docs/ARCHITECTURE.md §4; the design of vLLM's automatic prefix caching):
- Every block has a reference count: the number of requests whose table holds it.
- A block whose tokens are all computed gets its chained name (`shared.hashing`) and is
  registered in `cached` (name -> block). A hit on it by a later request shares the block
  (ref count > 1). Shared blocks are always full, and a request only writes positions at or
  past its hit, so a shared block is never written.
- A freed block (ref count 0) with a name stays in the cache, "evictable". Allocation takes
  never-named free blocks first, then evicts the least recently freed named block. A
  request's blocks are freed tail first, so its last blocks (the least likely to be shared)
  are evicted before its first ones.
- When two requests compute the same block at once, the first to finish registers it; the
  other keeps its copy unnamed, and that copy goes back as a plain free block.

`num_free_blocks` counts blocks available for allocation: plain free + evictable.

Store pins (KV tiers, docs/ARCHITECTURE.md §4): while a block's copy into the kvstore is in flight
(`pin_for_store` .. `unpin_store`), the block is neither free nor evictable, whatever its
reference count, so it is never reallocated or evicted under the copy. Requests may still
share it as a prefix hit (they only read it). `reset_prefix_cache` is not refused by store
pins: a pinned block loses its name and becomes a plain free block when unpinned.
`cache_full_blocks` returns the (block, name) pairs it registered, for the KV connector to
store (`services.engine.kv_connector.StorePins` is the part of this class it may use).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from services.engine.request import Request
from shared.hashing import hash_block_tokens, model_identity_hash


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates, frees, names and shares fixed-size KV blocks.

    num_blocks: total blocks in the KV cache; block_size: tokens per block.
    enable_prefix_caching: when False no block is ever named, shared or kept after free.
    root_hash: the model identity hash that starts every chain (see
        `shared.hashing.model_identity_hash`); tests may leave it out.
    Raises ValueError for a non-positive shape.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 root_hash: bytes | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"bad KV cache shape: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash if root_hash is not None else model_identity_hash(
            "unnamed", "unknown", "unknown", block_size)
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref 0, no name
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, named; LRU first
        self.cached: dict[bytes, int] = {}  # name -> block (in use or evictable)
        self.store_pins: dict[int, int] = {}  # block -> stores in flight (see module doc)
        # Hit accounting, cumulative. Queries and hits in tokens and in full blocks.
        self.num_queries = 0          # requests looked up at admission
        self.query_tokens = 0
        self.hit_tokens = 0
        self.query_blocks = 0
        self.hit_blocks = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation: never-named free plus evictable cached."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Named blocks in the prefix cache, in use or evictable."""
        return len(self.cached)

    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> dict:
        """Prefix cache counters (cumulative): queries and hits in tokens and blocks."""
        return {
            "enable_prefix_caching": self.enable_prefix_caching,
            "prefix_cache_queries": self.query_tokens,
            "prefix_cache_hits": self.hit_tokens,
            "prefix_cache_query_blocks": self.query_blocks,
            "prefix_cache_hit_blocks": self.hit_blocks,
            "prefix_cache_requests": self.num_queries,
            "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "num_cached_blocks": len(self.cached),
            "num_evictable_blocks": len(self.evictable),
            "num_evictions": self.num_evictions,
            "num_store_pinned_blocks": len(self.store_pins),
        }

    # ------------------------------------------------------------------ names

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend request.block_hashes to name its first `num_blocks` full blocks."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            hashes.append(hash_block_tokens(parent, request.token_slice(i * bs, (i + 1) * bs)))

    def block_name(self, request: Request, index: int) -> bytes:
        """The name (chain hash) of the request's block `index` (its tokens
        [index * block_size, (index + 1) * block_size) must be known), computing the chain
        up to it when needed."""
        self._ensure_block_hashes(request, index + 1)
        return request.block_hashes[index]

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks matching the request's prompt + outputs chain.

        Returns (block ids, hit length in tokens). A pure lookup: it takes no reference and
        counts nothing; `allocate(..., computed_blocks=...)` does both when the scheduler
        commits to the hit. The hit stops at num_tokens - 1 rounded down to a block boundary,
        so at least the last token is computed and yields logits to sample (as vLLM does); a
        prompt ending exactly on a block boundary thus recomputes its whole last block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_block_hashes(request, max_blocks)
        hit: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            blk = self.cached.get(h)
            if blk is None:
                break
            hit.append(blk)
        return hit, len(hit) * self.block_size

    def cache_full_blocks(self, request: Request, upto: int | None = None) -> list[tuple[int, bytes]]:
        """Name and register the request's blocks whose tokens are all computed.

        upto: tokens whose KV a step that came back has written (default: the request's
        num_computed_tokens; with async scheduling that also counts plans still in flight,
        whose tokens may not be known yet). A block taken from the cache is already named;
        a block whose name another block already holds stays unnamed (the first one wins).
        Returns the (block id, name) pairs newly registered by this call, in table order.
        """
        new: list[tuple[int, bytes]] = []
        if not self.enable_prefix_caching:
            return new
        done = request.num_computed_tokens if upto is None else min(upto, request.num_tokens)
        full = min(done // self.block_size, len(request.block_ids))
        if full <= request.num_registered_blocks:
            return new
        self._ensure_block_hashes(request, full)
        for i in range(request.num_registered_blocks, full):
            blk, h = request.block_ids[i], request.block_hashes[i]
            if self.block_hash[blk] is not None:
                if self.block_hash[blk] != h:
                    raise RuntimeError(f"block {blk} of {request.request_id} is named for other tokens")
                continue
            if h not in self.cached:
                self.cached[h] = blk
                self.block_hash[blk] = h
                new.append((blk, h))
        request.num_registered_blocks = full
        return new

    # ------------------------------------------------------------------ store pins

    def pin_for_store(self, blk: int) -> None:
        """Keep `blk` out of the free and evictable pools until `unpin_store` (a copy of it
        into the kvstore is in flight). Pins nest."""
        self.store_pins[blk] = self.store_pins.get(blk, 0) + 1
        self.evictable.pop(blk, None)

    def is_named(self, blk: int, name: bytes) -> bool:
        """Whether `blk` holds the block named `name` in the prefix cache now."""
        return self.block_hash[blk] == name

    def unpin_store(self, blk: int) -> None:
        """End one store pin; a block with no pin and no reference becomes evictable (named)
        or free. Raises RuntimeError if `blk` is not pinned."""
        n = self.store_pins.get(blk, 0)
        if n <= 0:
            raise RuntimeError(f"block {blk} unpinned with no store pin")
        if n > 1:
            self.store_pins[blk] = n - 1
            return
        del self.store_pins[blk]
        if self.ref_cnt[blk] == 0:
            self._release(blk)

    def _release(self, blk: int) -> None:
        """A block nobody holds: evictable when named, plain free otherwise."""
        if self.block_hash[blk] is not None:
            self.evictable[blk] = None
        else:
            self.free_blocks.append(blk)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached name, as vLLM's reset_prefix_cache does.

        Refuses (returns False, changes nothing) while any block is in use by a request,
        because an in-use named block would re-enter the cache when freed. Otherwise every
        evictable block becomes a plain free block, and True is returned. The hit counters
        are not reset.
        """
        if any(self.ref_cnt):
            return False
        for blk in self.evictable:
            self.free_blocks.append(blk)
        self.evictable.clear()
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks  # store-pinned blocks go free when unpinned
        return True

    # ------------------------------------------------------------------ allocation

    def allocate(self, request: Request, num_tokens: int,
                 computed_blocks: Sequence[int] | None = None) -> bool:
        """Grow the request's block table to cover `num_tokens` tokens.

        computed_blocks: a prefix cache hit from `get_computed_blocks`, given once at
            admission while the request holds no blocks; they become the head of its table
            (each gains a reference) and the lookup is counted in the hit statistics.
        Returns False (and changes nothing) when there are not enough free blocks.
        """
        bs = self.block_size
        if computed_blocks is not None:
            if request.block_ids:
                raise ValueError(f"{request.request_id}: cache hit given to a request holding blocks")
            # Hit blocks that are evictable stop being available once referenced.
            held = sum(1 for b in computed_blocks if b in self.evictable)
            need = blocks_needed(num_tokens, bs) - len(computed_blocks)
            if need > self.num_free_blocks - held:
                return False
            if self.enable_prefix_caching:
                self.num_queries += 1
                self.query_tokens += request.num_tokens
                self.hit_tokens += len(computed_blocks) * bs
                self.query_blocks += (request.num_tokens - 1) // bs
                self.hit_blocks += len(computed_blocks)
            for blk in computed_blocks:
                self.evictable.pop(blk, None)  # absent when store-pinned
                self.ref_cnt[blk] += 1
            request.block_ids = list(computed_blocks)
            request.num_registered_blocks = len(computed_blocks)
        need = blocks_needed(num_tokens, bs) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            blk = self._take_free_block()
            self.ref_cnt[blk] = 1
            request.block_ids.append(blk)
        return True

    def _take_free_block(self) -> int:
        """A never-named free block if any, else evict the least recently freed named one."""
        if self.free_blocks:
            return self.free_blocks.popleft()
        blk, _ = self.evictable.popitem(last=False)
        name = self.block_hash[blk]
        assert name is not None  # only named blocks are evictable
        del self.cached[name]
        self.block_hash[blk] = None
        self.num_evictions += 1
        return blk

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the trailing blocks of the request's table past those covering `num_tokens`
        tokens (speculative decoding, docs/ARCHITECTURE.md §5.5: blocks allocated for draft
        positions that were rejected). Trailing blocks hold no accepted KV, so they were
        never registered in the prefix cache; they go back as plain free blocks (or, were
        one named, evictable). Returns the number of blocks freed. Raises RuntimeError on
        a block with no reference."""
        keep = blocks_needed(num_tokens, self.block_size)
        table = request.block_ids
        n = len(table) - keep
        if n <= 0:
            return 0
        for blk in reversed(table[keep:]):
            if self.ref_cnt[blk] <= 0:
                raise RuntimeError(f"block {blk} of {request.request_id} trimmed with no reference")
            self.ref_cnt[blk] -= 1
            if self.ref_cnt[blk] == 0 and blk not in self.store_pins:
                self._release(blk)
        del table[keep:]
        request.num_registered_blocks = min(request.num_registered_blocks, keep)
        return n

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first. A block nobody holds becomes free:
        evictable (still cached) when named, plain free otherwise.

        Raises RuntimeError if a reference count would go negative (a double free).
        """
        for blk in reversed(request.block_ids):
            if self.ref_cnt[blk] <= 0:
                raise RuntimeError(f"block {blk} of {request.request_id} freed with no reference")
            self.ref_cnt[blk] -= 1
            if self.ref_cnt[blk] == 0 and blk not in self.store_pins:
                self._release(blk)
        request.block_ids = []
        request.num_registered_blocks = 0
