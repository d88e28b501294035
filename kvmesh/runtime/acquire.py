"""The one acquisition core: how any engine (the head, the vLLM connector) gets a
prompt's prefix from the mesh, and how it gives computed prefixes back.

*Acquire* (:class:`Acquirer`), in order, each step once, for every caller:

1. **local**: the longest prefix in this node's own store (RAM, then disk);
2. **candidates**: when the prompt is longer, the fleet's validated hits
   (longest first; peers backed off by the circuit breaker are not waited for),
   keeping those longer than what is already held and whose peer is usable;
3. **plan and fetch**: each candidate in turn, while the cache-time budget
   (:meth:`Acquirer.budget`, at least :data:`MIN_CACHE_BUDGET_S`) lasts: skipped
   when the planner says computing is cheaper, else streamed (verified block by
   block) into a sink the caller opens for it. A failure is counted and, when it
   is the peer's, backs the peer off; the next candidate is tried. A stream that
   our own budget ends is no failure of the peer's (fallback ``budget``: the
   planner tells the two apart, :class:`~.planner.Attempt`). A successful
   fetch teaches the planner the peer's bandwidth, and the import bandwidth from
   the time the sink took (:meth:`Planner.observe_import`), and a fetched chain
   that continues the stored one is kept locally, to serve it from here too.

The caller only decides what a sink is (an engine's importer, or a dict of
verified pages) and what it does with the blocks.

*Give back* (:class:`Publisher`): computed chains are stored and published on
one background thread through a bounded number of slots: a publish that finds
every slot taken is dropped (counted ``publish_dropped``), never waited for. It
tells :func:`kvmesh.memory.after_request` when it has work and when all of it is
done (an idle head gives back what exports freed).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import memory
from ..blocks import PrefixKeys
from ..codec import Block, Layout
from ..compat import CompatCard
from ..errors import Reason
from ..mesh.bulk import StreamTimes
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from ..store import Match
from .planner import Attempt, Planner, failure_reason
from .slots import Slots

log = logging.getLogger("kvmesh.acquire")

MIN_CACHE_BUDGET_S = 0.2  # a fast model still tolerates a scheduling hiccup


class Count(Protocol):
    """A telemetry counter: ``count(name)`` adds one, ``count(name, n)`` adds n."""

    def __call__(self, name: str, n: int = 1, /) -> object: ...


class Sink(Protocol):
    """Where a fetch puts verified blocks (an engine's importer, a page table)."""

    def add(self, blk: Block, /) -> object: ...


@dataclass
class Candidates:
    """What the fleet offers beyond ``have`` tokens: usable hits, longest first."""

    hits: list[PeerHit] = field(default_factory=list)
    lookup_s: float = 0.0
    fallback: str | None = None  # why some peer did not answer (the first reason)


@dataclass
class Fetched:
    """The outcome of :meth:`Acquirer.fetch`: the hit that worked and its blocks
    (from ``start``), or ``hit is None`` and why the last try failed."""

    hit: PeerHit | None = None
    sink: Any = None  # what ``open_sink`` returned for the hit that worked
    blocks: list[Block] = field(default_factory=list)
    nbytes: int = 0
    fetch_s: float = 0.0
    fallback: str | None = None
    times: StreamTimes = field(default_factory=StreamTimes)  # the working stream's stages


def _importable(card: CompatCard, hit: PeerHit) -> PeerHit:
    """``hit`` cut to what an import can end on (the blocks past it would be fetched
    for nothing): a hybrid's chain without a tail ends on its last state
    checkpoint; a deterministic card's on its prefill grid, tail or not (the
    positions past the grid are recomputed as a cold prompt computes them)."""
    if not card.prefill_grid and (hit.tail is not None or not card.state_every):
        return hit
    n = card.importable_blocks(len(hit.blocks))
    if n == len(hit.blocks) and hit.tail is None:
        return hit
    return dataclasses.replace(hit, blocks=hit.blocks[:n], tokens=n * card.block_tokens, tail=None)


class Acquirer:
    """Local store, fleet candidates, planned verified fetch: see the module."""

    def __init__(self, fleet: Fleet, planner: Planner, count: Count) -> None:
        self.fleet = fleet
        self.planner = planner
        self.count = count

    def local(self, keys: PrefixKeys) -> Match:
        return self.fleet.local_prefix(keys)

    def budget(self, n_tokens: int) -> float:
        """Seconds all remote fetches of one request may take: the estimated cold
        prefill of the prompt (a fetch slower than that is not worth waiting for),
        at least :data:`MIN_CACHE_BUDGET_S`, at most the fetch deadline."""
        floor = max(self.planner.compute_s(n_tokens), MIN_CACHE_BUDGET_S)
        return min(self.fleet.fetch_deadline, floor)

    def candidates(self, card: CompatCard, keys: PrefixKeys, have: int) -> Candidates:
        """The fleet's validated hits holding more than ``have`` tokens, from usable
        peers, longest first. Never raises: a failed lookup is no candidate."""
        t0 = time.perf_counter()
        hits, errors = self.fleet.lookup(card, keys, **self.planner.lookup_hooks(self.count))
        hits = [_importable(card, h) for h in hits]
        usable = [h for h in hits if h.tokens > have and self.planner.usable(h.node_id)]
        return Candidates(usable, time.perf_counter() - t0, errors[0] if errors else None)

    def fetch(
        self,
        layout: Layout,
        hits: Sequence[PeerHit],
        local: Match,
        start: int,
        have: int,
        budget: float,
        open_sink: Callable[[PeerHit], Sink],
        on_start: Callable[[PeerHit], None] | None = None,
        owner: str | None = None,
    ) -> Fetched:
        """Stream the first candidate worth fetching from block ``start``, verified,
        into ``open_sink(hit).add``; on a failure, the next one, all within ``budget``
        seconds. ``open_sink`` raising is our failure (counted
        ``local_import_failed:<reason>``), the next candidate is tried. ``on_start``
        hears of each candidate as its stream begins. Blocks kept here count
        against ``owner``'s tenant budget (see :class:`~kvmesh.store.BlockStore`)."""
        t0 = time.perf_counter()
        out = Fetched()
        for hit in hits:
            if hit.tokens <= have or not self.planner.usable(hit.node_id):
                continue
            left = budget - (time.perf_counter() - t0)
            if left <= 0:
                out.fallback = Reason.BUDGET
                break
            nbytes = sum(i.nbytes for i in hit.infos[start:])
            if not self.planner.estimate(hit.node_id, hit.tokens - have, nbytes).worth_it:
                self.count("planned_compute")
                continue
            if self._try(layout, hit, local, start, nbytes, left, open_sink, on_start, out, owner):
                return out
        return out

    def _try(
        self,
        layout: Layout,
        hit: PeerHit,
        local: Match,
        start: int,
        nbytes: int,
        left: float,
        open_sink: Callable[[PeerHit], Sink],
        on_start: Callable[[PeerHit], None] | None,
        out: Fetched,
        owner: str | None = None,
    ) -> bool:
        """One candidate; True (``out`` filled in) when its stream worked."""
        try:  # ours: a failure here is never the peer's fault
            sink = open_sink(hit)
        except Exception as e:  # e.g. past a sliding window, or a bad local block
            out.fallback = failure_reason(e)
            self.count(f"local_import_failed:{out.fallback}")
            return False
        timed = _Timed(sink.add)
        if on_start is not None:
            on_start(hit)
        t0 = time.perf_counter()
        times = StreamTimes()
        try:
            blocks = self.fleet.fetch(layout, hit, start, timed, left, times)
        except Exception as e:  # the cache never decides correctness
            # counted; only the peer's own failures back it off (busy, or our own
            # budget running out, do not)
            tried = Attempt(left, time.perf_counter() - t0, timed.nbytes, self.fleet.fetch_deadline)
            out.fallback = self.planner.fetch_failed(hit.node_id, e, self.count, hit.alias, tried)
            return False
        out.fetch_s = time.perf_counter() - t0
        self.planner.observe_fetch(hit.node_id, nbytes, out.fetch_s)
        self.planner.observe_import(timed.nbytes, timed.seconds)
        self.planner.peer_succeeded(hit.node_id)
        self.count("fetched_bytes", nbytes)
        out.hit, out.sink, out.blocks, out.nbytes, out.fallback = hit, sink, blocks, nbytes, None
        out.times = times
        if start == len(local.blocks):  # the fetched blocks continue the stored chain
            self.fleet.keep(blocks, owner)
        return True

    def imported(self, blocks: Sequence[Block], copy: Callable[[Block], object]) -> int:
        """Import ``blocks`` with ``copy`` (in order, stopping at the first failure,
        which is raised), teaching the planner the import bandwidth; how many."""
        timed = _Timed(copy)
        for blk in blocks:
            timed(blk)
        self.planner.observe_import(timed.nbytes, timed.seconds)
        return len(blocks)


class _Timed:
    """A block consumer that adds up the bytes it took and the seconds it worked."""

    def __init__(self, sink: Callable[[Block], object]) -> None:
        self.sink = sink
        self.nbytes = 0
        self.seconds = 0.0

    def __call__(self, blk: Block) -> None:
        t0 = time.perf_counter()
        self.sink(blk)
        self.seconds += time.perf_counter() - t0
        self.nbytes += blk.nbytes


class Publisher:
    """Stores and publishes computed chains on one background thread, through
    ``slots`` bounded slots (a publish finding none free is dropped and counted)."""

    def __init__(
        self, fleet: Fleet | None, card: CompatCard, slots: int, count: Count, publish: bool = True
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
        self.count("publish_dropped")
        return False

    def release(self) -> None:
        """Give back a slot reserved for work that will not be submitted."""
        self._slots.give()

    def submit(
        self, make: Callable[[], list[list[Block]]], counter: str, owner: str | None = None
    ) -> None:
        """In a reserved slot: ``make()`` the chains (on the background thread),
        keep each here (against ``owner``'s tenant budget) and publish it; count
        their distinct blocks under ``counter``."""
        self._work(+1)
        try:
            self._pool.submit(self._run, make, counter, owner)
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

    def _run(self, make: Callable[[], list[list[Block]]], counter: str, owner: str | None) -> None:
        try:
            chains = make()
            if self.fleet is None:
                return
            for chain in chains:
                self.fleet.keep(chain, owner)
                if self.publish:
                    self.fleet.publish(self.card, chain)
            self.count(counter, len({b.key for c in chains for b in c}))  # distinct blocks
        except Exception as e:  # a publish never fails a request
            log.warning("publish failed: %r", e)
            self.count("publish_failed")
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
