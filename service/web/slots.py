"""A worker's compute slots, handed to the jobs waiting for one in the queue's order: the least key
first (admission.py makes the keys: by arrival for ATTN_QUEUE_ORDER=fifo, by deadline, then
arrival, for edf).

threading.Semaphore wakes its oldest waiter, so it can only be first come, first served; here a
freed slot goes to the waiter of least key, and a waiter that times out leaves the queue (one
granted a slot as it timed out keeps it: the grant and the timeout are decided under one lock)."""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    key: tuple
    event: threading.Event = field(default_factory=threading.Event, compare=False)
    granted: bool = field(default=False, compare=False)


class Slots:
    """n compute slots, each held by one job at a time."""

    def __init__(self, n: int):
        self.free = n
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []  # a heap by key

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_take(self) -> bool:
        """A slot, if one is free and no job waits for one."""
        with self._lock:
            if self.free and not self._waiters:
                self.free -= 1
                return True
            return False

    def take(self, key: tuple, timeout_s: float) -> bool:
        """A slot: at once if one is free and no job waits, else when every waiter of lesser key
        has had one and one comes free, within timeout_s (False if not). Keys are unique."""
        with self._lock:
            if self.free and not self._waiters:
                self.free -= 1
                return True
            waiter = _Waiter(key)
            heapq.heappush(self._waiters, waiter)
        waiter.event.wait(max(timeout_s, 0.0))
        with self._lock:
            if waiter.granted:
                return True
            self._waiters.remove(waiter)
            heapq.heapify(self._waiters)
            return False

    def give(self) -> None:
        """A slot back: to the waiter of least key, or free."""
        with self._lock:
            if self._waiters:
                waiter = heapq.heappop(self._waiters)
                waiter.granted = True
                waiter.event.set()
            else:
                self.free += 1
