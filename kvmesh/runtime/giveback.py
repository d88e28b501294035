"""The give-back queue: computed chains (a head's prompts and answers, a vLLM
worker's saved pages) stored here and published to peers off the request path.

:class:`GiveBack` runs the work on one background thread through bounded slots: a
caller :meth:`~GiveBack.reserve`\ s a slot before it exports, and work finding
none free is dropped (counted ``publish_dropped``), never waited for. It tells
:func:`kvmesh.memory.after_request` when it has work and when all of it is done
(an idle process gives exported memory back). Sending to peers is the mesh's
(:class:`kvmesh.mesh.publisher.Publisher`, behind :meth:`Fleet.publish`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from .. import memory
from ..codec import Block
from ..compat import CompatCard
from ..mesh.fleet import Fleet
from .slots import Slots
from .telemetry import Count, Tally

log = logging.getLogger("kvmesh.giveback")


class GiveBack:
    """Stores and publishes computed chains on one background thread, through
    ``slots`` bounded slots (a publish finding none free is dropped and counted)."""

    def __init__(
        self, fleet: Fleet | None, card: CompatCard, slots: int, count: Tally, publish: bool = True
    ) -> None:
        self.fleet = fleet
        self.card = card
        self.count = count
        self.publish = publish
        self._slots = Slots(slots)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-publish")
        self._working = 0  # submitted, not yet finished: tells the heap trimmer (kvmesh.memory)
        self._working_lock = threading.Lock()

    def reserve(self) -> bool:
        """One slot, or False (counted ``publish_dropped``) when all are taken."""
        if self._slots.take():
            return True
        self.count(Count.PUBLISH_DROPPED)
        return False

    def release(self) -> None:
        """Give back a slot reserved for work that will not be submitted."""
        self._slots.give()

    def submit(
        self,
        make: Callable[[], list[list[Block]]],
        counter: str,
        owner: str | None = None,
        card: CompatCard | None = None,
    ) -> None:
        """In a reserved slot: ``make()`` the chains (on the background thread),
        keep each here (against ``owner``'s tenant budget) and publish it under
        ``card`` (None: this queue's); count their distinct blocks under ``counter``."""
        self._work(+1)
        try:
            self._pool.submit(self._run, make, counter, owner, card or self.card)
        except RuntimeError:  # shut down: the work will never run, nor say it is done
            self._work(-1)
            raise

    def _work(self, n: int) -> None:
        """Count work in and out; the heap trimmer hears when all of it is done
        (exports free memory: an idle head gives it back, see kvmesh.memory)."""
        with self._working_lock:
            self._working += n
            if self._working == (1 if n > 0 else 0):
                memory.after_request(idle=n < 0, source="publish")

    def background(self, fn: Callable[..., object], *args: object) -> None:
        """Other off-path work that should queue behind publishes (audits)."""
        self._pool.submit(fn, *args)

    def _run(
        self,
        make: Callable[[], list[list[Block]]],
        counter: str,
        owner: str | None,
        card: CompatCard,
    ) -> None:
        try:
            chains = make()
            if self.fleet is None:
                return
            for chain in chains:
                self.fleet.keep(chain, owner)
                if self.publish:
                    self.fleet.publish(card, chain)
            self.count(counter, len({b.key for c in chains for b in c}))  # distinct blocks
        except Exception as e:  # a publish never fails a request
            log.warning("publish failed: %r", e)
            self.count(Count.PUBLISH_FAILED)
        finally:
            self._slots.give()
            self._work(-1)

    def pending(self) -> int:
        """Publishes not yet handed to peers (exports running or queued sends)."""
        n = self._slots.in_use
        if self.fleet is not None:
            n += self.fleet.queued()
        return n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued publishes reached the peers (tests, benchmarks, shutdown)."""
        left = self._slots.wait_idle(timeout)
        if self.fleet is not None:
            self.fleet.drain(max(0.1, left))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
