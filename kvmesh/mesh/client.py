"""What a head uses to reach the fleet: lookup, fetch, publish, gossip exchange.

Lookups are metadata only and fan out concurrently under a short deadline, to
the peers :func:`~.placement.locate` names (at most ``2 * replicas + 2``). A peer
the caller marks as failing (``skip``) is not waited for but asked in the
background, so its outcome keeps being reported (``on_failure``,
``on_success``, background asks included) while no request pays its deadline.
Every answer is validated (:func:`~.hits.validated`) before it ranks anything;
hits come back longest first, the least loaded holder first among equals
(:func:`~.placement.holders`).

A fetch or publish goes over a :class:`~.transport.Transport`: the peer's bulk
data path (:class:`~.bulk_client.BulkTransport`) when it advertises one, else
gRPC (:class:`~.transport.GrpcTransport`). Every failure is a typed error whose
``reason`` the caller counts before falling back. Computed chains, and copies a
fetch of a hot prefix owes its replica ranks, are published off the request path
by the client's :class:`~.publisher.Publisher`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from ..blocks import PrefixKeys
from ..codec import CHUNK_BYTES, Block, Layout
from ..compat import CompatCard
from ..errors import MalformedPayload, OversizePayload, PeerUnavailable
from .bulk_client import BulkTransport
from .bulk_wire import check_credential, host_identity
from .hits import PeerHit, Transfer, validated
from .membership import INTERFACE_PRIORITY, Membership
from .placement import (
    ASK_ALL_BELOW,
    DEFAULT,
    MAX_REPLICAS,
    Answer,
    Policy,
    holders,
    locate,
    ranking,
)
from .proto import kvmesh_pb2 as pb
from .publisher import Publisher
from .rpc_errors import from_rpc_error
from .security import ANY_DEST, FleetAuth, TLSConfig
from .transport import LOOKUP, Channels, GrpcTransport, StreamTimes, Transport, Want

__all__ = ["ASK_ALL_BELOW", "MeshClient", "PeerHit"]

log = logging.getLogger("kvmesh.client")

EXCHANGE = "/kvmesh.v1.Membership/Exchange"


class MeshClient:
    """A node's way to the fleet: gossip with its members, lookups of who holds a
    prompt, and the transport that moves blocks to or from one of them."""

    def __init__(
        self,
        membership: Membership,
        auth: FleetAuth | None = None,
        tls: TLSConfig | None = None,
        lookup_deadline: float = 0.25,
        fetch_deadline: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
        publish_queue: int = 64,
        replicas: int = 1,
        progress_timeout: float = 2.0,
        use_bulk: bool = True,
        policy: Policy = DEFAULT,
        local_socket: bool = True,
    ) -> None:
        self.membership = membership
        self.policy = policy
        self._rng = random.Random()
        self._fetching: Counter[str] = Counter()  # our fetches in flight, per peer
        self.auth, self.tls = auth, tls
        self.lookup_deadline = lookup_deadline
        self.fetch_deadline = fetch_deadline
        self.progress_timeout = progress_timeout
        self.chunk_bytes = chunk_bytes
        self.replicas = replicas
        self.counters: Counter[str] = Counter()
        self.transfers: deque[Transfer] = deque(maxlen=64)
        self._background: set[asyncio.Task[Any]] = set()
        self._probing: set[str] = set()  # node ids with a background lookup in flight
        # blocks alternate between two single-thread hashers: chunks of one block
        # stay in order, and consecutive blocks are verified in parallel
        self._hashers = [
            ThreadPoolExecutor(1, thread_name_prefix="kvmesh-verify") for _ in range(2)
        ]
        self.channels = Channels(tls, auth, self.counters, fetch_deadline)
        self.grpc = GrpcTransport(
            self.channels, self._hashers, progress_timeout, chunk_bytes, fetch_deadline
        )
        self.use_bulk = use_bulk
        if use_bulk:
            check_credential(auth)  # our own node id fits a bulk hello: ConfigError now
        self.bulk = BulkTransport(
            tls, auth, self.counters, self._hashers, progress_timeout, fetch_deadline
        )
        # peers whose cards carry this are on this host: their Unix socket is dialled
        self.bulk.local_host = host_identity() if use_bulk and local_socket else b""
        self.publisher = Publisher(self, publish_queue)

    # -- plumbing ----------------------------------------------------------------

    @property
    def local_host(self) -> bytes:
        """This host's identity as our card carries it (b"": no same-host sockets)."""
        return self.bulk.local_host

    @local_host.setter
    def local_host(self, host: bytes) -> None:
        self.bulk.local_host = host

    @property
    def local_streams(self) -> int:
        """Bulk streams that went over a same-host Unix socket."""
        return self.bulk.dialer.local_streams

    def _transport(self, bulk: bool) -> Transport:
        """The peer's bulk data path when it has one (``bulk``), else gRPC."""
        return self.bulk if bulk else self.grpc

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def warm(self, layout: Layout, sample: Block, nbytes: int) -> None:
        """Pay a new process's first-use costs of a fetch now, not in its first
        request (a head calls this at start): see :meth:`BulkTransport.warm`."""
        await self.bulk.warm(layout, sample, nbytes)

    async def close(self) -> None:
        self.publisher.close()
        for task in list(self._background):
            task.cancel()
        await self.channels.close()
        for h in self._hashers:
            h.shutdown(wait=False)
        self.bulk.close()

    # -- gossip ------------------------------------------------------------------

    async def exchange(self, address: str, node_id: str | None, timeout: float = 2.0) -> None:
        """Push-pull our cards with the node at ``address``. Under a fleet key a
        credential names its destination, so a seed whose id is not yet known is
        first asked, with an empty request, who it is (its own card comes first)."""
        unary = self.channels.unary
        if node_id is None and self.auth is not None:
            resp = await unary(address, EXCHANGE, ANY_DEST, b"", pb.ExchangeResponse, timeout)
            self.membership.merge(list(resp.cards))
            if not resp.cards:
                return
            node_id = resp.cards[0].node_id
        raw = pb.ExchangeRequest(cards=self.membership.outgoing()).SerializeToString()
        t0 = time.perf_counter()
        resp = await unary(
            address, EXCHANGE, node_id or ANY_DEST, raw, pb.ExchangeResponse, timeout
        )
        rtt_ms = (time.perf_counter() - t0) * 1000
        self.membership.merge(list(resp.cards))
        sender = node_id or (resp.cards[0].node_id if resp.cards else None)
        if sender:
            self.membership.record_rtt(sender, address, rtt_ms)

    # -- lookup ------------------------------------------------------------------

    def caches(self) -> dict[str, pb.CapabilityCard]:
        """Live cache peers by node id."""
        return {c.node_id: c for c in self.membership.live() if "cache" in c.roles}

    def _ranked(self, key: bytes) -> list[pb.CapabilityCard]:
        """Live cache peers in rendezvous order of ``key``."""
        caches = self.caches()
        return [caches[n] for n in ranking(list(caches))(key)]

    def compatible_peers(
        self, card: CompatCard, root: bytes | None = None
    ) -> list[pb.CapabilityCard]:
        """Who a lookup may ask: in a small fleet every live cache peer; beyond that
        the cache peers in rendezvous order of ``root`` (the order publishes
        follow), or without a root those that advertise the namespace."""
        caches = list(self.caches().values())
        if len(caches) <= ASK_ALL_BELOW:
            return caches
        if root is None:
            return [c for c in caches if card.namespace_hex in c.namespaces]
        return self._ranked(root)

    async def lookup(
        self,
        card: CompatCard,
        keys: PrefixKeys,
        skip: Callable[[str], bool] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_success: Callable[[str], None] | None = None,
    ) -> tuple[list[PeerHit], list[str]]:
        """Lookup on the peers :func:`~.placement.locate` names: (hits longest
        first, the least loaded holder first among equals; the failure reasons of
        peers that did not answer).

        ``skip(node_id)`` true: that peer is not waited for; it is asked in the
        background instead (one ask per peer at a time) and its answer is never a
        hit. ``on_failure(node_id, reason)`` is called, on this loop, for every
        peer whose lookup failed or whose answer did not add up, and
        ``on_success(node_id)`` for every peer whose answer checked out."""
        chain = _chain(keys)
        caches = self.caches()
        req = pb.LookupRequest(
            namespace=card.namespace, block_keys=keys.blocks, tail_keys=[keys.tail]
        )
        ask = _Ask(card, keys, req, req.SerializeToString(), on_failure, on_success, skip)
        hits: list[PeerHit] = []
        errors: list[str] = []

        async def ask_round(ids: Sequence[str], want: int) -> tuple[list[str], list[Answer]]:
            before = len(hits)
            asked = await self._round([caches[n] for n in ids], want, ask, hits, errors)
            return asked, [_answer(h) for h in hits[before:]]

        may_probe = None if skip is None else (lambda n: not skip(n))
        found = await locate(
            chain,
            ranking(list(caches)),
            ask_round,
            self.replicas,
            self.policy,
            self._rng,
            may_probe,
        )
        if found.probed is not None:
            self.counters["lookup_replica_probes"] += 1
        owed, fill = found.owed, found.repair
        hits = [dataclasses.replace(h, repair=fill) if h.node_id in owed else h for h in hits]
        return self._ordered(hits, found.shed), errors

    async def _round(
        self,
        peers: list[pb.CapabilityCard],
        want: int,
        ask: _Ask,
        hits: list[PeerHit],
        errors: list[str],
    ) -> list[str]:
        """Ask the first ``want`` of ``peers`` (in order), one more for each skipped or
        failing; the node ids asked (skipped ones included)."""
        asked = 0
        while want > 0 and asked < len(peers):  # a later batch only when an owner is out
            batch = peers[asked : asked + want]
            asked += len(batch)
            waited = [p for p in batch if not (ask.skip is not None and ask.skip(p.node_id))]
            for p in batch:
                if p not in waited:
                    self.counters["lookup_skipped"] += 1
                    self._probe(p, ask)
            failed = await self._ask(waited, ask, hits, errors)
            want = len(batch) - len(waited) + failed
        return [p.node_id for p in peers[:asked]]

    def _ordered(self, hits: list[PeerHit], shed: Collection[str] = ()) -> list[PeerHit]:
        """Longest first; among holders of one length the least loaded (:meth:`load_of`),
        then the best endpoint; ``shed`` (a hot prefix's owners) after the others."""
        by_id = {h.node_id: h for h in sorted(hits, key=self._endpoint_rank)}
        rtt = {n: self._endpoint_rank(h)[1] for n, h in by_id.items()}
        answers = [_answer(h) for h in by_id.values()]
        order = holders(answers, self.load_of, rtt.__getitem__, self.policy, self._rng, shed)
        return [by_id[n] for n in order]

    def load_of(self, node_id: str) -> float:
        """How busy a peer looks from here: the fetch rate its card reports plus our
        own fetches in flight to it. A rate that is no rate (negative, NaN,
        infinite: a claim that would always win) counts as the busiest."""
        card = next((c for c in self.membership.live() if c.node_id == node_id), None)
        claimed = card.load if card is not None else 0.0
        rate = claimed if math.isfinite(claimed) and claimed >= 0 else math.inf
        return rate + self._fetching[node_id]

    async def _ask(
        self, peers: list[pb.CapabilityCard], ask: _Ask, hits: list[PeerHit], errors: list[str]
    ) -> int:
        """One round of a lookup: validated hits into ``hits``, failure reasons into
        ``errors`` (and reported); how many peers failed."""
        results = await asyncio.gather(*(self._lookup_one(p, ask.req, ask.raw) for p in peers))
        failed = 0
        for peer, r in zip(peers, results, strict=True):
            r = self._checked(peer, r, ask)
            if isinstance(r, str):
                errors.append(r)
                failed += 1
            elif r is not None and r.tokens > 0:
                hits.append(r)
        return failed

    def _checked(self, peer: pb.CapabilityCard, r: PeerHit | str | None, ask: _Ask) -> Any:
        """A peer's lookup result validated (a claim that does not add up is a
        failure, no hit at all) and reported to the caller's listeners."""
        if isinstance(r, PeerHit) and r.tokens > 0:
            try:
                r = validated(r, Layout(ask.card), ask.keys.tail_tokens)
            except MalformedPayload as e:
                self.counters[f"lookup_failed:{e.reason}"] += 1
                r = e.reason
        if isinstance(r, str):
            _report(ask.on_failure, peer.node_id, r)
        elif r is not None:
            _report(ask.on_success, peer.node_id)
        return r

    def _probe(self, peer: pb.CapabilityCard, ask: _Ask) -> None:
        """Ask a skipped peer in the background: its outcome is still reported."""
        if peer.node_id in self._probing:
            return
        self._probing.add(peer.node_id)

        async def probe() -> None:
            try:
                r = await self._lookup_one(peer, ask.req, ask.raw)
            finally:
                self._probing.discard(peer.node_id)
            self._checked(peer, r, ask)

        self._spawn(probe())

    def _endpoint_rank(self, hit: PeerHit) -> tuple[int, float]:
        rtt = self.membership.rtt(hit.node_id, hit.address) or float("inf")
        return INTERFACE_PRIORITY.get(hit.interface, 9), rtt

    async def _lookup_one(
        self, peer: pb.CapabilityCard, req: pb.LookupRequest, raw: bytes
    ) -> PeerHit | str | None:
        eps = self.membership.ranked_endpoints(peer)
        if not eps:
            return None
        ep = eps[0]
        try:
            resp = await self.channels.unary(
                ep.address, LOOKUP, peer.node_id, raw, pb.LookupResponse, self.lookup_deadline
            )
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e)
            self.counters[f"lookup_failed:{err.reason}"] += 1
            log.debug("lookup on %s failed: %s", peer.alias, err)
            return err.reason
        n_blocks = len(resp.blocks)
        if n_blocks > len(req.block_keys) or any(
            b.key != k for b, k in zip(resp.blocks, req.block_keys, strict=False)
        ):
            self.counters["lookup_failed:malformed_payload"] += 1  # an answer we did not ask for
            return "malformed_payload"
        tail = resp.tail if resp.HasField("tail") and n_blocks == len(req.block_keys) else None
        if tail is not None and tail.key not in req.tail_keys:
            tail = None
        return PeerHit(
            node_id=peer.node_id,
            alias=peer.alias,
            address=ep.address,
            interface=ep.interface,
            epoch=resp.epoch,
            blocks=tuple(resp.blocks),
            tail=tail,
            tokens=resp.matched_tokens,
            data_address=self.bulk.address_of(peer, ep.address) if self.use_bulk else "",
            replicas=min(resp.replicas, MAX_REPLICAS) if n_blocks else 0,
        )

    # -- fetch -------------------------------------------------------------------

    async def fetch(
        self,
        layout: Layout,
        hit: PeerHit,
        start: int = 0,
        lease_ttl: float | None = None,
        on_block: Callable[[Block], None] | None = None,
        deadline: float | None = None,
        times: StreamTimes | None = None,
        want: Want | None = None,
    ) -> list[Block]:
        """Stream ``hit``'s blocks from index ``start`` on, verified, within ``deadline``
        seconds (at most the client's fetch deadline), each wait for bytes within
        ``progress_timeout``. Raises a typed error. On the bulk path the deadline
        covers the wait for a stream thread too (:class:`BulkTransport`).

        ``on_block`` is called on a worker thread with each block as soon as its
        digest has been checked, so the caller can import while the rest arrives.
        ``times`` hears when the stream connected, received and verified it all.
        ``want`` (:class:`~.transport.Want`): the parts and codecs the bulk path may
        send; the blocks then carry at least the parts an import needs."""
        infos = hit.infos[start:]
        bulk = bool(hit.data_address) and self.use_bulk
        want = want if bulk else None
        raw = self._fetch_request(layout, hit, infos, lease_ttl, want)
        limit = min(self.fetch_deadline, deadline or self.fetch_deadline)
        transport = self._transport(bool(hit.data_address))
        t0 = time.perf_counter()
        self._fetching[hit.node_id] += 1
        try:
            blocks = await transport.fetch(
                hit, raw, infos, layout, on_block, limit, times or StreamTimes(), want
            )
        finally:
            self._fetching[hit.node_id] -= 1
            if not self._fetching[hit.node_id]:
                del self._fetching[hit.node_id]
        dt = time.perf_counter() - t0
        total = sum(b.nbytes for b in blocks)
        self.counters["bytes_fetched"] += total
        self.transfers.append(Transfer(hit.alias, total, dt, len(blocks), time.time()))
        if hit.repair and start == 0 and all(b.whole for b in blocks):
            self.publisher.repair(layout.card, blocks, hit.repair)  # ranks that lacked it
        return blocks

    def _fetch_request(
        self,
        layout: Layout,
        hit: PeerHit,
        infos: Sequence[pb.BlockInfo],
        lease_ttl: float | None,
        want: Want | None = None,
    ) -> bytes:
        """The serialized FetchRequest for ``infos``, once what they announce is
        checked against the card (before anything is allocated for them)."""
        cap = layout.max_block_bytes
        if any(len(i.digest) != 32 for i in infos):
            raise MalformedPayload("peer announced a block without a 256-bit digest")
        if any(not 0 < i.nbytes <= cap for i in infos):
            raise OversizePayload("peer announced a block larger than the card allows")
        req = pb.FetchRequest(
            namespace=layout.card.namespace,
            keys=[i.key for i in infos],
            epoch=hit.epoch,
            chunk_bytes=self.chunk_bytes,
            lease_ttl_s=lease_ttl or max(10.0, self.fetch_deadline),
        )
        if want is not None:
            req.keep_from.extend(want.keep_from or ())
            req.codecs.extend(want.codecs)
        return req.SerializeToString()

    # -- publish -----------------------------------------------------------------

    def publish_targets(self, root: bytes) -> list[pb.CapabilityCard]:
        """Every live cache peer, in rendezvous order for this key."""
        return self._ranked(root)

    def enqueue_publish(self, card: CompatCard, blocks: list[Block]) -> bool:
        """Non-blocking; call on the client's loop. Drops (and counts) when full."""
        return self.publisher.enqueue(card, blocks, None)

    def queued(self) -> int:
        """Publishes queued or being sent."""
        return self.publisher.queued()

    async def drain(self) -> None:
        await self.publisher.drain()

    async def publish(self, peer: pb.CapabilityCard, card: CompatCard, blocks: list[Block]) -> Any:
        eps = self.membership.ranked_endpoints(peer)
        if not eps:
            raise PeerUnavailable("peer has no endpoint")
        if not blocks:
            return pb.PublishResponse()
        transport = self._transport(bool(peer.data_port) and self.use_bulk)
        resp = await transport.publish(peer, eps[0].address, json.dumps(card.to_json()), blocks)
        self.counters["bytes_published"] += sum(b.nbytes for b in blocks)
        if resp.rejected:
            self.counters[f"publish_rejected:{resp.reason}"] += 1
        return resp


@dataclass(frozen=True)
class _Ask:
    """One lookup's question, and whom to tell how each peer answered."""

    card: CompatCard
    keys: PrefixKeys
    req: pb.LookupRequest
    raw: bytes
    on_failure: Callable[[str, str], None] | None
    on_success: Callable[[str], None] | None
    skip: Callable[[str], bool] | None = None


def _chain(keys: PrefixKeys) -> list[bytes]:
    """A prompt's chain as placement sees it: its full blocks, then its tail."""
    return [*keys.blocks, keys.tail] if keys.tail_tokens or not keys.blocks else list(keys.blocks)


def _answer(hit: PeerHit) -> Answer:
    """A hit as placement sees it: how much of the asked chain (blocks, then the
    tail) it holds, and how many extra holders its peer asks for."""
    return Answer(
        hit.node_id, len(hit.blocks) + (hit.tail is not None), len(hit.blocks), hit.replicas
    )


def _report(listener: Callable[..., None] | None, *args: str) -> None:
    """Tell the caller how a peer did; the caller's bug never fails a lookup."""
    if listener is None:
        return
    try:
        listener(*args)
    except Exception:
        log.exception("lookup listener raised")
