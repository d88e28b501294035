"""Prometheus metrics of a mesh node, collected on scrape (no hot-path cost).

- Store gauges, and per tier ``kvmesh_tier_*{tier="ram"|"disk"}``: bytes,
  blocks, hits, admissions, evictions, promotions, corrupt files found.
- What this node serves, so an operator sees a hot spot:
  ``kvmesh_fetches_served_total``, ``kvmesh_bytes_served_total``,
  ``kvmesh_fetch_rate`` (the recent fetches per second its card gossips as
  ``load``) and ``kvmesh_hot_prefixes`` (prefixes it answers that ask for replicas).
- ``kvmesh_link_bytes_per_second{peer}``: the wire rate this node measured
  fetching from each peer (when a planner feeds ``MeshNode.link_rates``; peers
  named by alias, else the start of their node id).
- ``kvmesh_kv_events{outcome}`` (routers' KV events: changes, published,
  dropped...) and ``kvmesh_events{kind, side}`` (every counter of the node's
  server and client, ``side`` telling which).
- Two families to alert on a hostile or failing fleet without knowing every
  counter name: ``kvmesh_lookup_failures{reason}`` (this node's lookups on peers
  that failed or whose answer did not add up: ``lookup_failed:*``, background
  asks included) and ``kvmesh_rejections{surface, reason}`` (what it refused as
  a receiver: ``publish``, ``fetch``, ``lookup``, ``auth`` by why, ``request``
  (bytes that do not parse), ``card`` (gossiped cards) and ``store``).

The usual reasons are always present (zero until they happen), so an alert rule
never waits for a first occurrence to exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LOOKUP_REASONS = (
    "timeout",
    "peer_unreachable",
    "unauthenticated",
    "malformed_payload",
    "oversize_payload",
)
SURFACES: dict[str, tuple[str, ...]] = {
    "publish": (
        "oversize_payload",
        "store_full",
        "malformed_payload",
        "checksum_mismatch",
        "timeout",
        "orphan_block",
        "incompatible_card",
    ),
    "fetch": ("duplicate_keys", "bad_request", "stale_epoch", "lease_expired", "not_found"),
    "lookup": ("too_many_keys",),
    "request": ("malformed",),
    "auth": ("missing", "malformed", "bad_mac", "wrong_destination", "stale", "replayed"),
}
PREFIXES = {
    "publish_rejected:": "publish",
    "fetch_rejected:": "fetch",
    "lookup_rejected:": "lookup",
    "unauthenticated:": "auth",
    "request_rejected:": "request",
}


def _by_prefix(counters: Mapping[str, int], prefix: str) -> dict[str, int]:
    return {k[len(prefix) :]: v for k, v in counters.items() if k.startswith(prefix)}


class NodeCollector(Collector):
    def __init__(self, node_fn: Callable[[], Any]) -> None:
        self._node_fn = node_fn

    def collect(self) -> Iterator[Any]:
        node = self._node_fn()
        if node is None:
            return
        yield from self._store(node)
        yield from self._served(node)
        yield from self._tiers(node)
        yield from self._events(node)
        yield from self._failures(node)
        yield from self._kv_events(node)
        yield from self._links(node)

    def _links(self, node: Any) -> Iterator[Any]:
        source = getattr(node, "link_rates", None)
        g = GaugeMetricFamily(
            "kvmesh_link_bytes_per_second",
            "Wire bytes per second measured fetching from a peer (EWMA)",
            labels=["peer"],
        )
        if source is not None:
            alias = {c.node_id: c.alias for c in node.membership.live()}
            seen: set[str] = set()
            for r in source():
                name = alias.get(r["node_id"], r["node_id"][:12])
                if r["bytes_per_s"] is not None and name not in seen:  # labels unique
                    seen.add(name)
                    g.add_metric([name], r["bytes_per_s"])
        yield g

    def _store(self, node: Any) -> Iterator[Any]:
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
        yield GaugeMetricFamily(
            "kvmesh_publish_inflight_bytes",
            "Bytes reserved for published blocks being received",
            value=node.cache.inflight_bytes,
        )
        yield GaugeMetricFamily(
            "kvmesh_publish_inflight_cap_bytes",
            "Most bytes of published blocks received at once (this node's limit)",
            value=node.cache.max_inflight_bytes,
        )
        for name, value, doc in (
            ("kvmesh_store_hits", s.hits, "Store lookups with a hit"),
            ("kvmesh_store_misses", s.misses, "Store lookups without a hit"),
            ("kvmesh_store_evictions", s.evictions, "Blocks evicted"),
            ("kvmesh_store_inserts", s.inserts, "Blocks stored"),
        ):
            yield CounterMetricFamily(name, doc, value=value)

    def _served(self, node: Any) -> Iterator[Any]:
        """What this node serves to others: a hot spot shows here first."""
        c = node.cache
        yield CounterMetricFamily(
            "kvmesh_fetches_served", "Fetches this node served", value=c.counters["fetches"]
        )
        yield CounterMetricFamily(
            "kvmesh_bytes_served",
            "Block bytes this node sent to fetchers, as sent",
            value=c.counters["bytes_served"],
        )
        yield GaugeMetricFamily(
            "kvmesh_fetch_rate",
            "Fetches served per second, recently (gossiped load)",
            value=c.load(),
        )
        yield GaugeMetricFamily(
            "kvmesh_hot_prefixes",
            "Prefixes this node answers that are hot enough to ask for replicas",
            value=len(c.popularity.hot()),
        )

    def _tiers(self, node: Any) -> Iterator[Any]:
        """Per tier (``ram``, and ``disk`` with a disk tier): bytes, blocks, hits,
        admissions, evictions, promotions, bad files found, writes dropped."""
        tiers = node.store.tier_stats()
        for name, attr, doc, family in (
            ("kvmesh_tier_budget_bytes", "budget_bytes", "Byte budget by tier", GaugeMetricFamily),
            ("kvmesh_tier_used_bytes", "used_bytes", "Bytes stored by tier", GaugeMetricFamily),
            ("kvmesh_tier_entries", "entries", "Blocks stored by tier", GaugeMetricFamily),
            (
                "kvmesh_tier_hits",
                "hits",
                "Lookups answered (in part) from a tier",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_admissions",
                "admissions",
                "Blocks that entered a tier (RAM: stored or promoted; disk: files written)",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_evictions",
                "evictions",
                "Blocks that left a tier for its budget",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_promotions",
                "promotions",
                "Disk blocks copied back into RAM",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_corrupt",
                "corrupt",
                "Bad files found (header scan or digest on read) and deleted, never served",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_dropped",
                "dropped",
                "Disk writes refused (queue full, no room, I/O error)",
                CounterMetricFamily,
            ),
            (
                "kvmesh_tier_queued_bytes",
                "queued_bytes",
                "Bytes waiting for the disk writer",
                GaugeMetricFamily,
            ),
        ):
            m = family(name, doc, labels=["tier"])
            for t in tiers:
                m.add_metric([t.tier], getattr(t, attr))
            yield m
        if len(tiers) > 1:
            d = node.store.disk_stats
            f = CounterMetricFamily(
                "kvmesh_disk_files_deleted",
                "Disk tier files deleted at start or on read, by why",
                labels=["reason"],
            )
            for reason, v in (("corrupt", d.corrupt), ("torn", d.torn), ("orphan", d.orphans)):
                f.add_metric([reason], v)
            yield f

    def _kv_events(self, node: Any) -> Iterator[Any]:
        """Routers' KV events (``--kv-events``): changes announced and dropped."""
        ev = getattr(node, "events", None)
        if ev is None:
            return
        c = CounterMetricFamily(
            "kvmesh_kv_events", "KV events for routers, by outcome", labels=["outcome"]
        )
        st = ev.publisher.stats
        for outcome, v in (
            ("changes", ev.source.changes),
            ("published", st.events),
            ("batches", st.batches),
            ("dropped", ev.source.dropped),
            ("send_failed", st.send_failed),
            ("replays", st.replays),
            ("bad_replays", st.bad_replays),
            ("denied", st.denied),
        ):
            c.add_metric([outcome], v)
        yield c

    def _events(self, node: Any) -> Iterator[Any]:
        c = CounterMetricFamily(
            "kvmesh_events", "Node events by kind and side", labels=["kind", "side"]
        )
        for side, counters in (("server", node.cache.counters), ("client", node.client.counters)):
            for k, v in sorted(counters.items()):
                c.add_metric([k, side], v)
        for k, v in sorted(node.store.stats.rejects.items()):
            c.add_metric([f"store_rejected:{k}", "server"], v)
        yield c

    def _failures(self, node: Any) -> Iterator[Any]:
        lookups = dict.fromkeys(LOOKUP_REASONS, 0)
        lookups.update(_by_prefix(node.client.counters, "lookup_failed:"))
        f = CounterMetricFamily(
            "kvmesh_lookup_failures",
            "Lookups on peers that failed or did not add up, by reason",
            labels=["reason"],
        )
        for reason, v in sorted(lookups.items()):
            f.add_metric([reason], v)
        yield f
        r = CounterMetricFamily(
            "kvmesh_rejections",
            "What this node refused as a receiver, by surface and reason",
            labels=["surface", "reason"],
        )
        for prefix, surface in PREFIXES.items():
            seen = dict.fromkeys(SURFACES.get(surface, ()), 0)
            seen.update(_by_prefix(node.cache.counters, prefix))
            for reason, v in sorted(seen.items()):
                r.add_metric([surface, reason], v)
        r.add_metric(["card", "rejected"], node.membership.rejected_cards)
        for reason, v in sorted(node.store.stats.rejects.items()):
            r.add_metric(["store", reason], v)
        yield r
