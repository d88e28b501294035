"""A bounded count of work in flight (publishes waiting for export): take a slot or
be refused at once, never block; wait until none is left (tests, shutdown)."""

from __future__ import annotations

import threading
import time


class Slots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._n = 0
        self._cond = threading.Condition()

    def take(self) -> bool:
        """One slot, or False when all ``limit`` are in use."""
        with self._cond:
            if self._n >= self.limit:
                return False
            self._n += 1
            return True

    def give(self) -> None:
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._n

    def wait_idle(self, timeout: float) -> float:
        """Wait until no slot is in use; returns the seconds left of ``timeout``.
        Raises ``TimeoutError`` when work is still in flight at the deadline."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._n == 0, timeout):
                raise TimeoutError("publish did not finish")
        return max(0.0, deadline - time.monotonic())
