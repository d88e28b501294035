"""Grammar work off the event loop and off the engine's step.

A constrained request's grammar is checked and compiled (and its first mask
computed: :class:`~kvmesh.engine.grammar.CompiledGrammar`) by :class:`GrammarWorker`:
``workers`` threads (llguidance drops the GIL while it builds), at most ``waiting``
requests queued behind them (more is a 503 with ``Retry-After``, the queue's own
answer), and each request waits at most ``deadline_s`` (then a 400 saying the
grammar took too long: a queued compile that never started is dropped, one already
running finishes into the cache). Nothing here blocks the loop: ``/healthz`` and
other clients' streams go on while a client's 4 MB schema compiles.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import APIError

T = TypeVar("T")

WORKERS = 1
WAITING = 32
DEADLINE_S = 10.0


class GrammarWorker:
    """See the module."""

    def __init__(
        self, workers: int = WORKERS, waiting: int = WAITING, deadline_s: float = DEADLINE_S
    ) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvmesh-grammar")
        self._room = workers + waiting
        self._held = 0
        self._lock = threading.Lock()
        self.deadline_s = deadline_s

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread; its exceptions are the caller's."""
        with self._lock:
            if self._held >= self._room:
                raise APIError(
                    503,
                    "too many grammars are compiling; retry later",
                    "server_error",
                    code="grammar_busy",
                    headers={"Retry-After": "1"},
                )
            self._held += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except TimeoutError:
            future.cancel()  # not started yet: never runs
            raise APIError(
                400,
                f"the output constraint did not compile within {self.deadline_s:g} s: simplify it",
                code="grammar_too_complex",
            ) from None

    def _release(self, _: object) -> None:
        with self._lock:
            self._held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarWorker"]
