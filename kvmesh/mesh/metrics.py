"""Prometheus metrics of a mesh node, collected on scrape (no hot-path cost)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class NodeCollector(Collector):
    def __init__(self, node_fn: Callable[[], Any]) -> None:
        self._node_fn = node_fn

    def collect(self) -> Iterator[Any]:
        node = self._node_fn()
        if node is None:
            return
        s = node.store.stats
        yield GaugeMetricFamily(
            "kvmesh_store_budget_bytes", "Store byte budget", value=s.budget_bytes
        )
        yield GaugeMetricFamily("kvmesh_store_used_bytes", "Bytes stored", value=s.used_bytes)
        yield GaugeMetricFamily("kvmesh_store_entries", "Blocks stored", value=s.entries)
        yield GaugeMetricFamily("kvmesh_store_leases", "Active leases", value=s.leases)
        yield GaugeMetricFamily(
            "kvmesh_peers_live", "Live peers", value=len(node.membership.live())
        )
        for name, value, doc in (
            ("kvmesh_store_hits", s.hits, "Store lookups with a hit"),
            ("kvmesh_store_misses", s.misses, "Store lookups without a hit"),
            ("kvmesh_store_evictions", s.evictions, "Blocks evicted"),
            ("kvmesh_store_inserts", s.inserts, "Blocks stored"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        c = CounterMetricFamily("kvmesh_events", "Node events by kind", labels=["kind"])
        for k, v in sorted({**node.cache.counters, **node.client.counters}.items()):
            c.add_metric([k], v)
        for k, v in sorted(s.rejects.items()):
            c.add_metric([f"store_rejected:{k}"], v)
        yield c
