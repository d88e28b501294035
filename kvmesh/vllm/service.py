"""The mesh side of one vLLM worker: node, fleet, planner, acquisition core, give-back queue.

Each vLLM worker process (one per tensor-parallel rank) that registers a KV cache
starts one :class:`MeshService`, owned by its worker-side connector: one mesh node,
one block store holding this rank's pages, one planner that learns this rank's
prefill and import speed, and the shared acquisition core
(:mod:`kvmesh.runtime.acquire`). The scheduler side, in vLLM's engine-core
process, needs none of it. Nothing here is shared through module state.

A worker's first fetch is as fast as a fresh head's: at start the service does
what a head does (:func:`kvmesh.runtime.ready.ready`): the fetch path warmed and,
unless ``no_warm_heap``, the process-wide part (the heap kept warm and shared by
the threads created from then on, gc frozen, a short GIL switch interval). It
cannot be first in the process (vLLM loads first), but the threads that receive
and verify a fetch are created after it and pre-fault where they allocate. The
warm heap is never trimmed: a trim holds the heap's lock, and only vLLM knows
when its engine is idle.

With ``events`` (vLLM's ``kv_events_config`` on, on the rank that reports them),
the store's changes are kept in a bounded :class:`~kvmesh.mesh.events.StoreEvents`
sink that never clears, and the keyer records each full block's tokens (salted
chains too) so a stored block's event carries them; :meth:`MeshService.take_events`
drains it as msgpack bytes for vLLM's worker metadata.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence

import msgspec

from ..blocks import BlockKeyer
from ..codec import Layout
from ..compat import CompatCard
from ..mesh.events import RecordingKeyer, StoreEvents
from ..mesh.fleet import Fleet
from ..mesh.node import NodeConfig, NodeThread
from ..runtime.acquire import Acquirer
from ..runtime.giveback import GiveBack
from ..runtime.planner import Planner
from ..runtime.ready import ready
from .config import ConnectorSettings
from .pages import StateCut

log = logging.getLogger("kvmesh.vllm")


EVENTS_PENDING = 100_000  # store changes kept for the scheduler, then dropped (counted)
EVENTS_PER_STEP = 4096  # store changes sent with one step's worker metadata at most


def warm_heap(settings: ConnectorSettings) -> bool:
    """A worker gets a head's process-wide start-up (:func:`kvmesh.runtime.ready.ready`)
    unless the connector's ``no_warm_heap`` setting says not to."""
    return not settings["no_warm_heap"]


class MeshService:
    def __init__(
        self, settings: ConnectorSettings, card: CompatCard, cfg: NodeConfig, events: bool = False
    ) -> None:
        self.settings = settings
        self.card = card
        self.layout = Layout(card)
        self.cut = StateCut(self.layout)  # where an import of this card's pages can end
        self.node = NodeThread(cfg)
        self.fleet = Fleet(self.node)
        self.fleet.advertise(card)
        self.keyer = BlockKeyer(card.namespace, card.block_tokens, cfg.security.fleet_key)
        self.events: StoreEvents | None = None
        self._events_dropped = 0  # drops already reported
        if events:  # before any block is stored: the store is empty until the first save
            self.events = StoreEvents(max_pending=EVENTS_PENDING, clears=False)
            self.fleet.hear_store(self.events)
            self.keyer = RecordingKeyer(self.keyer, self.events.memo)
        self.planner = Planner(prefill_tps=float(settings["prefill_tps"]))
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.acquirer = Acquirer(self.fleet, self.planner, self.count)
        self.give_back = GiveBack(
            self.fleet, card, int(settings["max_pending_publishes"]), self.count, settings.publish
        )
        # acquisitions (lookup, then fetch) never wait on loads, loads wait on them:
        # two pools, so no deadlock
        self.acquires = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-acq")
        self.loads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-load")
        # a head's start-up for this worker's fetches (see the module)
        self.warm_s = ready(
            None, self.fleet, self.layout, process=warm_heap(settings), idle_trim=False
        )
        log.info("kvmesh node %s serving %s", self.fleet.address, card.summary())

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def renew_tokens(self, keys: Sequence[bytes], tokens: Sequence[int]) -> None:
        """With events on, the tokens of pages about to be stored (``keys[i]``: page
        ``i`` of ``tokens``) kept again for their events: the memo is an LRU, and a
        page keyed at its request's ask may have aged out by the prefill's end."""
        if self.events is None:
            return
        b = self.card.block_tokens
        for i, key in enumerate(keys):
            self.events.memo.record(key, tokens[i * b : (i + 1) * b])

    def take_events(self) -> tuple[bytes, int]:
        """The store's pending changes as one msgpack list of vLLM events (empty
        bytes when none), and how many changes were dropped since the last call."""
        if self.events is None:
            return b"", 0
        events = self.events.take(EVENTS_PER_STEP)
        dropped = self.events.dropped - self._events_dropped
        self._events_dropped += dropped
        if dropped:
            self.count("events_dropped", dropped)
        if events:
            self.count("events", len(events))
        return (msgspec.msgpack.encode(events) if events else b""), dropped

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued publishes reached the peers (tests, benchmarks, shutdown)."""
        self.give_back.flush(timeout)

    def close(self) -> None:
        """Flush publishes, stop the threads and the node; the counters go to the log
        (one ``kvmesh counters {...}`` line: what benchmarks of a server read)."""
        log.warning("kvmesh counters %s", json.dumps(dict(sorted(self.counters.items()))))
        try:
            self.give_back.flush(timeout=10)
        except Exception as e:  # shutdown never fails vLLM's
            log.warning("publishes not flushed at shutdown: %r", e)
        for pool in (self.acquires, self.loads):
            pool.shutdown(wait=True, cancel_futures=True)
        self.give_back.close()
        self.node.close()
