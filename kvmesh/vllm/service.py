"""The mesh side of one vLLM process: node, fleet, planner, keyer and their threads.

vLLM builds two connector objects, one per role (scheduler, worker); in a
single-device deployment (the ``uni`` executor) both live in the engine-core
process and share one :class:`MeshService`: one mesh node, so one alias on the
dashboard, one block store that serves this process's published pages, and one
planner that learns vLLM's own prefill speed. The worker creates it once it has
seen the cache tensors (the card describes the cache vLLM actually allocated);
the scheduler, built after the worker in vLLM's start-up, finds it here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import Counter
from typing import Any

from ..blocks import BlockKeyer
from ..codec import Layout
from ..compat import CompatCard
from ..mesh.fleet import Fleet
from ..mesh.node import NodeThread
from ..runtime.planner import Planner
from ..runtime.slots import Slots
from .config import ConnectorSettings

log = logging.getLogger("kvmesh.vllm")


class MeshService:
    def __init__(self, settings: ConnectorSettings, card: CompatCard) -> None:
        cfg = settings.node_config()
        if not cfg.alias:
            from ..mesh.node import pid_alias

            cfg.alias = f"vllm-{pid_alias()}"
        self.settings = settings
        self.card = card
        self.layout = Layout(card)
        self.node = NodeThread(cfg)
        self.fleet = Fleet(self.node)
        self.fleet.advertise(card)
        self.keyer = BlockKeyer(card.namespace, card.block_tokens, cfg.security.fleet_key)
        self.planner = Planner(prefill_tps=float(settings["prefill_tps"]))
        self.lookups = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-lookup")
        # fetches never wait on loads, loads wait on fetches: two pools, so no deadlock
        self.fetches = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-fetch")
        self.loads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-load")
        self.publisher = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvmesh-publish"
        )
        self.counters: Counter[str] = Counter()
        # request id -> the scheduler's plan for it, read by the worker when it loads
        self.plans: dict[str, Any] = {}
        self.plans_lock = threading.Lock()
        self._lock = threading.Lock()
        self._publishes = Slots(int(settings["max_pending_publishes"]))
        log.info("kvmesh node %s serving %s", self.node.node.address, card.summary())

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def try_reserve_publish(self) -> bool:
        """One slot of the bounded publish queue; False (and counted) when full."""
        if self._publishes.take():
            return True
        self.count("publish_dropped")
        return False

    def release_publish(self) -> None:
        self._publishes.give()

    def pending_publishes(self) -> int:
        return self._publishes.in_use + self.fleet.queued()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued publishes reached the peers (tests, benchmarks, shutdown)."""
        self.fleet.drain(max(0.1, self._publishes.wait_idle(timeout)))

    def close(self) -> None:
        for pool in (self.lookups, self.fetches, self.loads, self.publisher):
            pool.shutdown(wait=True, cancel_futures=False)
        self.node.close()


_services: dict[int, MeshService] = {}  # one per process (keyed by nothing else in practice)
_services_lock = threading.Lock()


def start(settings: ConnectorSettings, card: CompatCard) -> MeshService:
    """This process's service, started on first use with ``card``."""
    with _services_lock:
        svc = _services.get(0)
        if svc is not None and svc.card != card:
            raise RuntimeError("a second vLLM cache card in one process is not supported")
        if svc is None:
            svc = _services[0] = MeshService(settings, card)
        return svc


def current() -> MeshService | None:
    """The service of this process, if its worker has started one."""
    with _services_lock:
        return _services.get(0)


def stop() -> None:
    with _services_lock:
        svc = _services.pop(0, None)
    if svc is not None:
        try:
            svc.flush(timeout=10)
        except Exception as e:  # shutdown never fails vLLM's
            log.warning("publishes not flushed at shutdown: %r", e)
        svc.close()
