"""KV block allocation for the engine (the tensors live in the workers).

A request's block table covers its computed tokens plus those scheduled this step: block i
holds token positions [i*block_size, (i+1)*block_size). Blocks are plain ids into the
workers' KV cache tensors. The prefix cache (chained block hashes, LRU reuse of freed full
blocks) arrives with the KV tier issue and plugs in here.
"""

from __future__ import annotations

from collections import deque

from services.engine.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates and frees fixed-size KV blocks.

    num_blocks: total blocks in the KV cache; block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"bad KV cache shape: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether the request's table can grow to cover `num_tokens` tokens."""
        need = blocks_needed(num_tokens, self.block_size) - len(request.block_ids)
        return need <= len(self.free_blocks)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block table to cover `num_tokens` tokens.

        Returns False (and allocates nothing) when there are not enough free blocks.
        """
        need = blocks_needed(num_tokens, self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        pop = self.free_blocks.popleft
        request.block_ids.extend(pop() for _ in range(need))
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the free pool."""
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []
