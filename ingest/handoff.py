"""Hand items from the caller's threads to the emitter's one sender thread, in order.

``queue.Queue`` takes a lock and notifies a condition on every put and every get: with
the sender's per-event ``run_id`` parse that was ~1/3 of the emitter's CPU per event
(py-spy, 200k bench events), all of it under the GIL the agent's own threads need. A
``deque``'s ``append`` and ``popleft`` are atomic in CPython, so here the only
synchronisation is an :class:`threading.Event` that a put sets only while the sender
sleeps.

>>> handoff: Handoff[str] = Handoff()
>>> handoff.put("a"); handoff.put("b"); handoff.put("c")
>>> handoff.get(0.1), handoff.take(5), handoff.get(0.01)
('a', ['b', 'c'], None)
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """Many putting threads, one getting thread. Why a get cannot miss a put: the getter
    says it sleeps *before* it looks at the deque a last time, and a putter looks
    whether the getter sleeps *after* it appended; under the GIL one of the two sees
    the other."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._wake = threading.Event()
        self._sleeping = False

    def put(self, item: T) -> None:
        self._items.append(item)
        if self._sleeping:
            self._wake.set()

    def wake(self) -> None:
        """End a wait in :meth:`get` now, or the next one if none is waiting (it
        returns None if nothing arrived)."""
        self._wake.set()

    def get(self, timeout: float) -> T | None:
        """The oldest item, waiting up to ``timeout`` seconds for one; None if none came."""
        try:
            return self._items.popleft()
        except IndexError:
            if timeout <= 0:
                return None
        self._sleeping = True
        try:
            if not self._items:
                self._wake.wait(timeout)
        finally:
            self._sleeping = False
            self._wake.clear()
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def take(self, limit: int) -> list[T]:
        """Up to ``limit`` of the oldest items waiting now, without waiting."""
        items = self._items
        return [items.popleft() for _ in range(min(limit, len(items)))]

    def __len__(self) -> int:
        return len(self._items)
