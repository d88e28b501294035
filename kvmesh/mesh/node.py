"""A mesh node: block store + gRPC server + bulk data path + gossip + client.

The store, gRPC server, gossip and client share one event loop; the bulk data
path (:mod:`.bulk_server`) serves block bytes from its own threads on ``data_port``
(advertised in the node's card; 0 binds any free port).

``kvmesh peer`` runs one as a cache-only node; a head runs one too (a head is
also a peer). :class:`NodeThread` hosts a node's loop in a background thread so
synchronous engine code can call into it.

The card carries what this node measured fetching from its peers
(``CapabilityCard.links``, at most ``MAX_CARD_LINKS``) when whoever plans its
fetches sets :attr:`MeshNode.link_rates` (a head: its planner's ``links``):
display only, never another node's planner input.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..blocks import BlockKeyer
from ..store import BlockStore, DiskConfig
from .bulk_server import BulkServer
from .bulk_wire import local_socket_path
from .client import MeshClient
from .events import EventsConfig, NodeEvents
from .membership import MAX_MEMBERS, Membership, detect_endpoints, parse_advertise
from .proto import kvmesh_pb2 as pb
from .security import Security
from .server import DEFAULT_MAX_BLOCK_BYTES, CacheService, start_server

log = logging.getLogger("kvmesh.node")
T = TypeVar("T")
MAX_CARD_LINKS = 16  # LinkRates a card carries


@dataclass
class NodeConfig:
    listen: str = "127.0.0.1:0"
    budget_bytes: int = 2 << 30
    seeds: list[str] = field(default_factory=list)
    alias: str = ""
    advertise: list[str] = field(default_factory=list)
    roles: tuple[str, ...] = ("cache",)
    region: str = ""
    security: Security = field(default_factory=Security)
    gossip_interval: float = 1.0
    ttl: float = 5.0
    node_id: str = ""
    replicas: int = 1
    lookup_deadline: float = 0.25
    fetch_deadline: float = 30.0
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES  # the receiver's own per-block cap
    max_inflight_bytes: int = 2 * DEFAULT_MAX_BLOCK_BYTES  # publish bytes buffered at once
    max_members: int = MAX_MEMBERS
    disk_path: str = ""  # a disk tier under the RAM store (empty: none)
    disk_budget_bytes: int = 16 << 30
    disk_admit: str = "evicted"  # "evicted" (every block) | "hit" (blocks hit at least once)
    bulk: bool = True  # serve and use the bulk data path (else block bytes go over gRPC)
    data_port: int = 0  # the bulk path's port on the listen host (0: any free port)
    advertise_data_port: int = 0  # the port peers dial, if not data_port (forwarding)
    local_socket: bool = True  # bulk over a Unix socket with nodes on this host
    window_trim: bool = True  # fetch only the parts an import needs (sliding windows)
    serve_rate: float = 0.0  # bytes/s this node's bulk path sends at most (0: no cap)
    kv_events: EventsConfig | None = None  # publish vLLM-format KV events (mesh/events.py)

    def disk(self) -> DiskConfig | None:
        if not self.disk_path:
            return None
        return DiskConfig(self.disk_path, self.disk_budget_bytes, self.disk_admit)

    def resolved_node_id(self) -> str:
        if self.node_id:
            return self.node_id
        if self.listen.endswith(":0"):  # an ephemeral port: a new node each start
            return secrets.token_hex(8)
        # stable across restarts of the same node, so a restart shows a new epoch
        ident = f"{socket.gethostname()}|{self.alias}|{self.listen}"
        return hashlib.sha256(ident.encode()).hexdigest()[:16]


class MeshNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.resolved_node_id()
        self.alias = config.alias or f"node-{self.node_id[:6]}"
        # events first: AllBlocksCleared, then a rebuilt disk tier's blocks
        self.events = NodeEvents(config.kv_events) if config.kv_events else None
        self.store = BlockStore(
            config.budget_bytes,
            disk=config.disk(),
            listener=self.events.source if self.events else None,
        )
        self.cache = CacheService(
            self.store, config.max_block_bytes, config.max_inflight_bytes, quiet=self.quiet
        )
        self.auth = config.security.auth(self.node_id)
        self.membership = Membership(
            self.node_id, self._card, self.auth, ttl=config.ttl, max_members=config.max_members
        )
        self.client = MeshClient(
            self.membership,
            self.auth,
            config.security.tls,
            replicas=config.replicas,
            lookup_deadline=config.lookup_deadline,
            fetch_deadline=config.fetch_deadline,
            use_bulk=config.bulk,
            local_socket=config.local_socket,
        )
        self.endpoints: list[pb.Endpoint] = []
        self.port = 0
        self.bulk: BulkServer | None = None
        self.data_port = 0
        self.started = time.time()
        self._server: Any = None
        self._gossip: asyncio.Task[None] | None = None
        self.extra_namespaces: dict[str, str] = {}  # hex -> summary (a head's own model)
        # measured links for the card: node_id, bytes_per_s, rtt_s, fetches (Planner.links)
        self.link_rates: Callable[[], list[dict[str, Any]]] | None = None
        self._disk_namespaces = self.store.namespaces() if config.disk_path else set()

    def advertise_head(self, namespace_hex: str, summary: str) -> None:
        """Say in this node's card that it also runs a head serving ``namespace_hex``
        (its card's ``summary``), whether or not its store holds any of it yet."""
        self.extra_namespaces[namespace_hex] = summary
        self.config.roles = tuple(sorted({"head", *self.config.roles}))

    def quiet(self, namespace: bytes) -> None:
        """Never announce ``namespace``'s blocks in this node's KV events (they are
        not KV: pictures' encoder rows)."""
        if self.events is not None:
            self.events.source.quiet.add(namespace)

    def recording(self, keyer: BlockKeyer) -> BlockKeyer:
        """``keyer``, recording each block's tokens when this node's KV events carry
        token ids (:meth:`.events.StoreEvents.recording`)."""
        return keyer if self.events is None else self.events.source.recording(keyer)

    def _card(self) -> pb.CapabilityCard:
        s = self.store.stats
        # namespaces rebuilt from a disk tier are served before anyone publishes again
        ns = {k.hex(): "" for k in self._disk_namespaces}
        ns.update({k.hex(): v for k, v in self.cache.summaries.items()})
        ns.update(self.extra_namespaces)
        return pb.CapabilityCard(
            alias=self.alias,
            epoch=self.store.epoch,
            roles=list(self.config.roles),
            endpoints=self.endpoints,
            namespaces=list(ns),
            card_summaries=list(ns.values()),
            budget_bytes=s.budget_bytes,
            used_bytes=s.used_bytes,
            entries=s.entries,
            load=self.cache.load(),
            region=self.config.region,
            hits=s.hits,
            misses=s.misses,
            data_port=self.data_port,
            host=self.client.local_host if self.bulk is not None and self.bulk.local_path else b"",
            fetches_served=self.cache.counters["fetches"],
            bytes_served=self.cache.counters["bytes_served"],
            links=self._links(),
        )

    def _links(self) -> list[pb.LinkRate]:
        """This node's measured links for its card; none when nothing plans here or
        the source fails (a card is always built)."""
        if self.link_rates is None:
            return []
        try:
            rows = self.link_rates()[:MAX_CARD_LINKS]
            return [
                pb.LinkRate(
                    node_id=str(r["node_id"]),
                    bytes_per_s=float(r["bytes_per_s"] or 0.0),
                    rtt_s=float(r.get("rtt_s") or 0.0),
                    fetches=int(r.get("fetches") or 0),
                )
                for r in rows
            ]
        except Exception as e:  # display only: never worth a card
            log.debug("link rates left off the card: %r", e)
            return []

    async def start(self) -> None:
        self._server, self.port, _ = await start_server(
            self.config.listen,
            self.store,
            self.membership,
            self.auth,
            self.config.security.tls,
            self.cache,
        )
        host = self.config.listen.rpartition(":")[0].strip("[]")
        if self.config.bulk:
            self.bulk = BulkServer(
                self.cache, self.auth, self.config.security.tls, serve_rate=self.config.serve_rate
            )
            local = local_socket_path(self.node_id) if self.client.local_host else ""
            bound = self.bulk.start(host, self.config.data_port, local)
            self.data_port = self.config.advertise_data_port or bound
        if self.config.advertise:
            self.endpoints = [parse_advertise(a) for a in self.config.advertise]
        else:
            self.endpoints = detect_endpoints(host, self.port)
        self._gossip = asyncio.get_running_loop().create_task(self._gossip_loop())
        log.info(
            "%s (%s) listening on %s epoch %s",
            self.alias,
            self.node_id[:8],
            self.address,
            self.store.epoch[:8],
        )

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    async def gossip_once(self) -> None:
        self.membership.bump()
        targets = self.membership.gossip_targets(self.config.seeds)
        await asyncio.gather(*(self._exchange(n, a) for n, a in targets))

    async def _exchange(self, node_id: str | None, address: str) -> None:
        try:
            await self.client.exchange(address, node_id)
        except Exception as e:  # a gossip round never fails the node
            log.debug("gossip with %s failed: %s", address, e)

    async def _gossip_loop(self) -> None:
        while True:
            await self.gossip_once()
            jitter = random.uniform(0.8, 1.0)
            await asyncio.sleep(self.config.gossip_interval * jitter)

    async def stop(self, grace: float = 1.0) -> None:
        if self._gossip:
            self._gossip.cancel()
        # say goodbye, so peers drop this node now rather than after its TTL
        self.membership.leaving = True
        self.membership.bump()
        targets = [
            (c.node_id, e[0].address)
            for c in self.membership.live()
            if (e := self.membership.ranked_endpoints(c))
        ]
        if targets:
            await asyncio.wait(
                [
                    asyncio.ensure_future(self.client.exchange(a, n, timeout=0.5))
                    for n, a in targets
                ],
                timeout=1.0,
            )
        await self.client.close()
        if self.bulk is not None:
            await asyncio.to_thread(self.bulk.stop)
        if self._server:
            await self._server.stop(grace)
        await asyncio.to_thread(self.store.close)  # finish queued disk writes
        if self.events is not None:
            await asyncio.to_thread(self.events.close)


class NodeThread:
    """Runs a :class:`MeshNode` on its own event loop thread."""

    def __init__(self, config: NodeConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvmesh-mesh", daemon=True
        )
        self._thread.start()
        self.node: MeshNode = self.call(self._make(config))
        self.call(self.node.start())

    @staticmethod
    async def _make(config: NodeConfig) -> MeshNode:
        return MeshNode(config)  # built on the loop: its asyncio objects bind here

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # a caller that gave up must not leave the work running
            raise

    def submit(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        try:
            self.call(self.node.stop(0.2), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


def pid_alias() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"
