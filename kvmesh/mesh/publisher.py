"""Where a head's computed chains and repair copies go, off the request path.

:class:`Publisher` queues chains (bounded: a full queue drops and counts, never
blocks) and sends each where :func:`~.placement.place` puts it, to the first
``replicas`` owners that answer, each only the part it lacks
(:func:`~.placement.offer`). A fetch of a hot prefix whose probed replica rank
lacked it queues copies for such ranks, at most once per prefix per popularity
window from this node, so a peer's hot claim never turns each fetch into many
publishes. Every failure is counted (``publish_failed:<reason>``), none raised. A
chain may open with trimmed blocks (a head's import of a fetched prefix): only a
peer that holds them already gets the rest (``publish_skipped:partial`` otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import grpc

from ..codec import Block
from ..compat import CompatCard
from ..errors import KVMeshError
from .placement import REPAIR_FANOUT, offer, place, ranking
from .proto import kvmesh_pb2 as pb
from .rpc_errors import from_rpc_error
from .transport import LOOKUP

if TYPE_CHECKING:
    from .client import MeshClient

log = logging.getLogger("kvmesh.client")

MAX_REPAIRED = 1024  # hot prefixes whose last repair time is remembered

_Job = tuple[CompatCard, list[Block], tuple[str, ...] | None]


class Publisher:
    """The publish queue of one :class:`~.client.MeshClient` (its peers, counters,
    policy and transports)."""

    def __init__(self, client: MeshClient, size: int) -> None:
        self.client = client
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(size)
        self._task: asyncio.Task[None] | None = None
        self._inflight = 0
        self._repaired: OrderedDict[bytes, float] = OrderedDict()  # prefix -> last repair
        self._clock = time.monotonic

    def enqueue(self, card: CompatCard, blocks: list[Block], to: tuple[str, ...] | None) -> bool:
        """Queue ``blocks`` for placement (``to`` None) or for the peers ``to`` names.
        Non-blocking; call on the client's loop. False: dropped (counted)."""
        if not blocks:
            return True
        try:
            self._queue.put_nowait((card, blocks, to))
        except asyncio.QueueFull:
            self.client.counters["publish_dropped"] += 1
            return False
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return True

    def repair(self, card: CompatCard, blocks: list[Block], ranks: tuple[str, ...]) -> None:
        """Queue copies of a fetched hot prefix for the replica ranks that lacked it,
        unless this node repaired it within the popularity window."""
        if self._may_repair(blocks[-1].key):
            self.client.counters["replica_repairs"] += 1
            self.enqueue(card, blocks, ranks)

    def _may_repair(self, key: bytes) -> bool:
        now = self._clock()
        last = self._repaired.get(key)
        if last is not None and now - last < self.client.policy.window_s:
            return False
        self._repaired[key] = now
        self._repaired.move_to_end(key)
        while len(self._repaired) > MAX_REPAIRED:
            self._repaired.popitem(last=False)
        return True

    def queued(self) -> int:
        """Publishes queued or being sent."""
        return self._queue.qsize() + self._inflight

    async def drain(self) -> None:
        await self._queue.join()

    def close(self) -> None:
        if self._task:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            card, blocks, to = await self._queue.get()
            self._inflight += 1
            try:
                if to is None:
                    await self._place(card, blocks)
                else:  # a hot prefix's replica ranks (placement.repair_ranks' order)
                    live = {c.node_id: c for c in self.client.membership.live()}
                    ranks = [n for n in to if n in live]
                    await self._offer(live, ranks, card, blocks, REPAIR_FANOUT, missing=True)
            except Exception as e:  # a publish never kills the loop
                log.warning("publish failed: %r", e)
                self.client.counters["publish_failed:error"] += 1
            finally:
                self._inflight -= 1
                self._queue.task_done()

    async def _place(self, card: CompatCard, blocks: list[Block]) -> None:
        """Publish a chain where :func:`~.placement.place` puts it."""
        caches = self.client.caches()

        async def held(node: str) -> int | None:
            return await self._held_or_none(caches[node], card, blocks)

        where = await place(
            [b.key for b in blocks], ranking(list(caches)), held, self.client.policy
        )
        if where is None:
            return
        if where.deep:
            self.client.counters["publish_placed_deep"] += 1
        await self._offer(caches, where.targets, card, blocks, self.client.replicas, where.known)

    async def _offer(
        self,
        peers: dict[str, pb.CapabilityCard],
        targets: list[str],
        card: CompatCard,
        blocks: list[Block],
        n: int,
        known: dict[str, int] | None = None,
        missing: bool = False,
    ) -> None:
        """Give ``blocks`` to the first ``n`` of ``targets`` that answer, each only the
        part it lacks (:func:`~.placement.offer`)."""

        async def held(node: str) -> int | None:
            return await self._held_or_none(peers[node], card, blocks)

        async def send(node: str, have: int) -> bool:
            if not all(b.whole for b in blocks[have:]):  # a trimmed fetch's, ahead of ours
                self.client.counters["publish_skipped:partial"] += 1
                return False
            try:
                await self.client.publish(peers[node], card, blocks[have:])
            except KVMeshError as e:
                self.client.counters[f"publish_failed:{e.reason}"] += 1
                return False
            return True

        await offer(targets, n, len(blocks), held, send, known, missing)

    async def _held_or_none(
        self, peer: pb.CapabilityCard, card: CompatCard, blocks: list[Block]
    ) -> int | None:
        """:meth:`_held`, or None (counted) when ``peer`` did not answer."""
        try:
            return await self._held(peer, card, blocks)
        except KVMeshError as e:
            self.client.counters[f"publish_failed:{e.reason}"] += 1
            return None

    async def _held(self, peer: pb.CapabilityCard, card: CompatCard, blocks: list[Block]) -> int:
        """How many leading blocks of a chain ``peer`` already stores (one quiet Lookup)."""
        eps = self.client.membership.ranked_endpoints(peer)
        full = [b.key for b in blocks if b.header.kind == "block"]
        tails = [b.key for b in blocks if b.header.kind == "tail"]
        if not eps or blocks[0].header.start != 0:
            return 0
        req = pb.LookupRequest(
            namespace=card.namespace, block_keys=full, tail_keys=tails, quiet=True
        )
        try:
            resp = await self.client.channels.unary(
                eps[0].address,
                LOOKUP,
                peer.node_id,
                req.SerializeToString(),
                pb.LookupResponse,
                self.client.lookup_deadline * 4,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return min(len(blocks), len(resp.blocks) + (1 if resp.HasField("tail") else 0))
