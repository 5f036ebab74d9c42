"""A single-consumer asyncio mailbox: put from the event loop's thread, get with a timeout.

Cheaper than `asyncio.wait_for(queue.get(), timeout)`, which wraps every get in a new
Task (Python 3.11): a get that finds an item returns it at once; a get that waits awaits
one future, with one `call_later` timer only when a timeout is given. The frontend gets
one per engine request and per fan-out, and calls it once per streamed output, so this
cost is paid per token under load.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Mailbox(Generic[T]):
    """FIFO of items for one consumer task. `put` never blocks; `get(timeout)` returns the
    oldest item or raises TimeoutError after `timeout` seconds (None: wait forever);
    `peek` and `take` look at and remove the oldest item without waiting. Not thread-safe: use from the event loop's thread."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        """Append `item` and wake a waiting `get`."""
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    async def get(self, timeout: float | None = None) -> T:
        """The oldest item; waits up to `timeout` seconds for one. Raises TimeoutError."""
        if not self._items:
            loop = asyncio.get_running_loop()
            fut = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, fut) if timeout is not None else None
            try:
                await fut
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                raise TimeoutError
        return self._items.popleft()

    def peek(self) -> T:
        """The oldest item, left in place. Raises IndexError when empty."""
        return self._items[0]

    def take(self) -> T:
        """The oldest item (no wait). Raises IndexError when empty."""
        return self._items.popleft()
