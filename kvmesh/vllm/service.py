"""The mesh side of one vLLM worker: node, fleet, planner, acquisition core, publisher.

Each vLLM worker process (one per tensor-parallel rank) that registers a KV
cache starts one :class:`MeshService`, owned by its worker-side connector: one
mesh node (a head and a cache on the dashboard), one block store holding this
rank's pages, one planner that learns this rank's prefill and import speed, and
the shared acquisition core (:mod:`kvmesh.runtime.acquire`) that finds, plans,
fetches and publishes. The scheduler side needs none of it: it lives in vLLM's
engine-core process and only exchanges decisions with the workers through
vLLM's connector metadata. Nothing here is shared through module state.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import Counter

from ..blocks import BlockKeyer
from ..codec import Layout
from ..compat import CompatCard
from ..mesh.fleet import Fleet
from ..mesh.node import NodeConfig, NodeThread
from ..runtime.acquire import Acquirer, Publisher
from ..runtime.planner import Planner
from .config import ConnectorSettings

log = logging.getLogger("kvmesh.vllm")


class MeshService:
    def __init__(self, settings: ConnectorSettings, card: CompatCard, cfg: NodeConfig) -> None:
        self.settings = settings
        self.card = card
        self.layout = Layout(card)
        self.node = NodeThread(cfg)
        self.fleet = Fleet(self.node)
        self.fleet.advertise(card)
        self.keyer = BlockKeyer(card.namespace, card.block_tokens, cfg.security.fleet_key)
        self.planner = Planner(prefill_tps=float(settings["prefill_tps"]))
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.acquirer = Acquirer(self.fleet, self.planner, self.count)
        self.publisher = Publisher(
            self.fleet, card, int(settings["max_pending_publishes"]), self.count, settings.publish
        )
        # acquisitions (lookup, then fetch) never wait on loads, loads wait on them:
        # two pools, so no deadlock
        self.acquires = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-acq")
        self.loads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-load")
        log.info("kvmesh node %s serving %s", self.node.node.address, card.summary())

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued publishes reached the peers (tests, benchmarks, shutdown)."""
        self.publisher.flush(timeout)

    def close(self) -> None:
        """Flush publishes, stop the threads and the node; the counters go to the log
        (one ``kvmesh counters {...}`` line: what benchmarks of a server read)."""
        log.warning("kvmesh counters %s", json.dumps(dict(sorted(self.counters.items()))))
        try:
            self.publisher.flush(timeout=10)
        except Exception as e:  # shutdown never fails vLLM's
            log.warning("publishes not flushed at shutdown: %r", e)
        for pool in (self.acquires, self.loads):
            pool.shutdown(wait=True, cancel_futures=True)
        self.publisher.close()
        self.node.close()
