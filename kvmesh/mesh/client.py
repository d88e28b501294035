"""What a head uses to reach the fleet: lookup, fetch, publish, gossip exchange.

One long-lived channel per peer address (at most ``MAX_CHANNELS``, least
recently used closed first). Lookups fan out concurrently under a short deadline
and are metadata only; a peer the caller marks as failing (``skip``) is not
waited for, but still asked in the background, so that its failure keeps being
reported while it lasts and no request pays its deadline again. A fetch streams
blocks under a lease and hashes them in a worker thread while the next bytes
arrive: on the peer's bulk data path (:mod:`.bulk`) when it advertises one, else as
a gRPC stream; it aborts when the total deadline passes or when no bytes arrive for
``progress_timeout`` (:class:`FetchStalled`). Publishing takes the bulk path too.
At most ``STREAMS`` bulk streams run at once; a call's deadline covers both the
wait for one and the stream: the wait is bounded by it (then :class:`LocalBusy`:
our failure, not the peer's, as when too little of it is left once a stream is
free), and the stream gets what is left, counted from when it starts. A peer
that answers ``busy`` raises
:class:`PeerBusy` (loaded, not failing). Every failure is a typed error whose
``reason`` the caller counts before falling back. Publishing goes through a
bounded queue that drops (and counts) rather than ever blocking.

Beyond ``ASK_ALL_BELOW`` cache peers, where lookups go and where publishes land
follow one policy (:mod:`.placement`): the root's owners, then the owners of the
first block they lack, then one replica rank of a hot prefix (at most
``2 * replicas + 2`` peers); the fetch goes to the least loaded holder; a replica
rank found lacking a hot prefix gets copies from the head that fetched it.

``lookup`` reports each peer's outcome to the caller (``on_failure``,
``on_success``), background probes included, so a circuit breaker can both back
off from a failing peer and forgive one that answers again.

Under a fleet key each call's credential is bound to its destination's node id
and to the exact request bytes sent (requests are serialized once, here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import math
import random
import socket
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from ..blocks import PrefixKeys
from ..codec import CHUNK_BYTES, Assembler, Block, Layout, chunks, decode_block
from ..compat import CompatCard
from ..errors import (
    ChecksumMismatch,
    KVMeshError,
    LocalBusy,
    MalformedPayload,
    OversizePayload,
    PeerUnavailable,
)
from . import bulk
from .bulk import FetchStalled, StreamTimes
from .hits import PeerHit, Transfer, validated
from .membership import Membership
from .placement import (
    DEFAULT,
    MAX_REPLICAS,
    REPAIR_FANOUT,
    Policy,
    by_load,
    place_index,
    probe_rank,
    rendezvous,
    repair_ranks,
    replica_ranks,
)
from .proto import kvmesh_pb2 as pb
from .rpc_errors import from_rpc_error
from .security import ANY_DEST, FleetAuth, TLSConfig, body_digest, open_channel
from .server import GRPC_OPTIONS

log = logging.getLogger("kvmesh.client")

ASK_ALL_BELOW = 8  # fleets this small are asked in full: a lookup is ~1 ms and metadata only
STREAMS = 8  # bulk streams at once (threads); a call waits for one within its own limit
MIN_STREAM_S = 0.05  # a stream given less than this (or half its limit) after the wait: LocalBusy
MAX_REPAIRED = 1024  # hot prefixes whose last repair time is remembered
MAX_CHANNELS = 512  # addresses come from gossip: a hostile card must not open channels forever
LOOKUP = "/kvmesh.v1.PrefillCache/Lookup"
FETCH = "/kvmesh.v1.PrefillCache/Fetch"
PUBLISH = "/kvmesh.v1.PrefillCache/Publish"
EXCHANGE = "/kvmesh.v1.Membership/Exchange"


class MeshClient:
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
        self._repaired: OrderedDict[bytes, float] = OrderedDict()  # prefix -> last repair
        self.auth = auth
        self.tls = tls
        self.lookup_deadline = lookup_deadline
        self.fetch_deadline = fetch_deadline
        self.progress_timeout = progress_timeout
        self.chunk_bytes = chunk_bytes
        self.replicas = replicas
        self.counters: Counter[str] = Counter()
        self.transfers: deque[Transfer] = deque(maxlen=64)
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._probing: set[str] = set()  # node ids with a background lookup in flight
        # blocks alternate between two single-thread hashers: chunks of one block
        # stay in order, and consecutive blocks are verified in parallel
        self._hashers = [
            ThreadPoolExecutor(1, thread_name_prefix="kvmesh-verify") for _ in range(2)
        ]
        self.use_bulk = use_bulk
        if use_bulk:
            bulk.check_credential(auth)  # our own node id fits a bulk hello: ConfigError now
        self._clock = time.monotonic
        self._dialer = bulk.Dialer(tls)
        # peers whose cards carry this are on this host: their Unix socket is dialled
        self.local_host = bulk.host_identity() if use_bulk and local_socket else b""
        self._streams = ThreadPoolExecutor(STREAMS, thread_name_prefix="kvmesh-bulk")
        self._stream_slots = asyncio.Semaphore(STREAMS)  # a thread free for each holder
        self._queue: asyncio.Queue[tuple[CompatCard, list[Block], tuple[str, ...] | None]] = (
            asyncio.Queue(publish_queue)
        )
        self._publisher: asyncio.Task[None] | None = None
        self._inflight = 0

    # -- plumbing ----------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, self.tls, GRPC_OPTIONS)
            while len(self._channels) > MAX_CHANNELS:
                _, old = self._channels.popitem(last=False)
                self._spawn(old.close(grace=self.fetch_deadline))
        self._channels.move_to_end(address)
        return ch

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    def _cred(self, method: str, dest: str, digest: bytes) -> str:
        """A bulk stream's credential (the call credential's value; "" without a key)
        for a body whose :func:`body_digest` is ``digest`` (it goes in the hello too).
        Our own node id was checked when we were set up: a credential too long for
        the hello is the peer's node id (:class:`MalformedPayload`)."""
        self._count_call(method)
        if self.auth is None:
            return ""
        cred = self.auth.call_metadata(method, dest, digest)[0][1]
        if len(cred.encode()) > bulk.CRED_SLOT:
            raise MalformedPayload("the peer's node id is too long for a bulk credential")
        return cred

    def _data_address(self, peer: pb.CapabilityCard, address: str) -> str:
        """The peer's bulk address on ``address``'s host ("": none, or no bulk). A
        peer on this host (the same :func:`~.bulk.host_identity`) is dialled at
        its Unix socket first, by a path derived from its node id."""
        if not self.use_bulk:
            return ""
        data = bulk.data_address(address, peer.data_port)
        same_host = bool(data and self.local_host) and peer.host == self.local_host
        path = bulk.local_socket_path(peer.node_id) if same_host else ""  # a digest: only then
        if path:
            self._dialer.add_local(data, path)
        elif data:
            self._dialer.drop_local(data)  # a card can stop saying it (a restart elsewhere)
        return data

    @property
    def local_streams(self) -> int:
        """Bulk streams that went over a same-host Unix socket."""
        return self._dialer.local_streams

    async def _on_stream(
        self, fn: Callable[..., Any], *args: Any, limit_s: float, **kwargs: Any
    ) -> Any:
        """``fn(*args, left, cancel, **kwargs)`` on a stream thread once one is free,
        all within ``limit_s`` of this call: the wait for a thread is bounded by it
        and ``fn`` gets the ``left`` of it (its own limit, counted from when it
        starts). A wait that leaves ``fn`` too little (under ``MIN_STREAM_S`` and
        under half of ``limit_s``) is :class:`LocalBusy`, our own failure, not the
        peer's, which is never reached. Cancelling us aborts its socket and waits
        for it, so nothing it hands on (``on_block``) runs after we return."""
        deadline = self._clock() + limit_s
        try:
            async with asyncio.timeout(limit_s):
                await self._stream_slots.acquire()
        except TimeoutError:
            self._local_busy(limit_s)
        try:
            left = deadline - self._clock()
            if left < min(MIN_STREAM_S, limit_s / 2):
                self._local_busy(limit_s - left)
            return await self._run_stream(functools.partial(fn, *args, left, **kwargs))
        finally:
            self._stream_slots.release()

    def _local_busy(self, waited_s: float) -> NoReturn:
        self.counters["local_busy"] += 1
        raise LocalBusy(f"all {STREAMS} bulk streams busy for {waited_s:.2f} s") from None

    async def _run_stream(self, fn: Callable[..., Any]) -> Any:
        cancel = bulk.Cancel()
        fut = asyncio.get_running_loop().run_in_executor(self._streams, fn, cancel)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel()
            await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: its failure is moot once we gave up
            raise
        except KVMeshError:
            raise
        except Exception as e:  # anything else a peer's bytes provoke is still typed
            raise PeerUnavailable(f"bulk stream failed: {e!r}") from None

    def _count_call(self, method: str) -> None:
        self.counters[f"rpc:{method.rsplit('/', 1)[-1]}"] += 1

    def _md(self, method: str, dest: str, raw: bytes) -> tuple[tuple[str, str], ...] | None:
        """Call metadata: a credential for ``dest`` bound to the request bytes ``raw``."""
        self._count_call(method)
        return self.auth.call_metadata(method, dest, body_digest(raw)) if self.auth else None

    async def _unary(
        self, address: str, method: str, dest: str, raw: bytes, response: Any, timeout: float
    ) -> Any:
        """One unary call with the request already serialized (``raw`` is what the
        credential binds, byte for byte)."""
        call = self.channel(address).unary_unary(
            method, request_serializer=None, response_deserializer=response.FromString
        )
        return await call(raw, timeout=timeout, metadata=self._md(method, dest, raw))

    async def warm(self, layout: Layout, sample: Block, nbytes: int) -> None:
        """Pay a new process's first-use costs of a fetch now, not in its first
        request (a head calls this at start): start the stream thread and both
        hashers, resolve a numeric address (Python's first lookup imports its IDNA
        codec), verify ``sample`` on each hasher (the digest and parsing paths),
        and pre-fault ``nbytes`` of heap (:func:`bulk.prefault`) where a fetch
        allocates: on the stream thread (received blocks) and on the first hasher
        (a sink that allocates when its first block arrives does so there). An
        idle pool hands its next task to the thread that ran this, so the first
        fetch finds both warm."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._streams, _warm_stream, nbytes, sample.nbytes)
        for i, h in enumerate(self._hashers):
            await loop.run_in_executor(h, _warm_hasher, layout, sample, nbytes if i == 0 else 0)

    async def close(self) -> None:
        if self._publisher:
            self._publisher.cancel()
        for task in list(self._background):
            task.cancel()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        for h in self._hashers:
            h.shutdown(wait=False)
        self._streams.shutdown(wait=False)

    # -- gossip ------------------------------------------------------------------

    async def exchange(self, address: str, node_id: str | None, timeout: float = 2.0) -> None:
        """Push-pull our cards with the node at ``address``. Under a fleet key a
        credential names its destination, so a seed whose id is not yet known is
        first asked, with an empty request, who it is (its own card comes first)."""
        if node_id is None and self.auth is not None:
            resp = await self._unary(address, EXCHANGE, ANY_DEST, b"", pb.ExchangeResponse, timeout)
            self.membership.merge(list(resp.cards))
            if not resp.cards:
                return
            node_id = resp.cards[0].node_id
        raw = pb.ExchangeRequest(cards=self.membership.outgoing()).SerializeToString()
        t0 = time.perf_counter()
        resp = await self._unary(
            address, EXCHANGE, node_id or ANY_DEST, raw, pb.ExchangeResponse, timeout
        )
        rtt_ms = (time.perf_counter() - t0) * 1000
        self.membership.merge(list(resp.cards))
        sender = node_id or (resp.cards[0].node_id if resp.cards else None)
        if sender:
            self.membership.record_rtt(sender, address, rtt_ms)

    # -- lookup ------------------------------------------------------------------

    def compatible_peers(
        self, card: CompatCard, root: bytes | None = None
    ) -> list[pb.CapabilityCard]:
        """Who a lookup may ask, in the order it asks them. In a small fleet every
        live cache peer, all at once (a card can lag a publish by a gossip
        interval); beyond that the cache peers in rendezvous order of ``root``,
        the order publishes follow: a lookup asks the first ``replicas + 1`` and
        one more for each of those skipped or failing, so its cost stays flat with
        fleet size. Without a root, the peers that advertise the namespace."""
        ns = card.namespace_hex
        caches = [c for c in self.membership.live() if "cache" in c.roles]
        if len(caches) <= ASK_ALL_BELOW:
            return caches
        if root is None:
            return [c for c in caches if ns in c.namespaces]
        by_id = {c.node_id: c for c in caches}
        return [by_id[n] for n in rendezvous(root, list(by_id), len(by_id))]

    async def lookup(
        self,
        card: CompatCard,
        keys: PrefixKeys,
        skip: Callable[[str], bool] | None = None,
        on_failure: Callable[[str, str], None] | None = None,
        on_success: Callable[[str], None] | None = None,
    ) -> tuple[list[PeerHit], list[str]]:
        """Lookup on the peers that may hold the prompt: (hits longest first, the
        least loaded holder first among equals; the failure reasons of peers that
        did not answer).

        A small fleet is asked in full. Beyond that (:mod:`.placement`): the
        root's owners (``replicas`` + 1), then the owners of the first block they
        lack (``replicas``), then, when an answer says its prefix is hot, one of
        that prefix's replica ranks: at most ``2 * replicas + 2`` peers, one more
        for each skipped or failing owner.

        ``skip(node_id)`` true: that peer (e.g. one backed off by a circuit
        breaker) is not waited for; it is asked in the background instead (one
        probe per peer at a time) and its answer is never a hit. ``on_failure
        (node_id, reason)`` is called, on this loop, for every peer whose lookup
        failed or whose answer did not add up, and ``on_success(node_id)`` for
        every peer whose answer (hit or miss) checked out, probes included."""
        chain = _chain(keys)
        peers = self.compatible_peers(card, chain[0])
        req = pb.LookupRequest(
            namespace=card.namespace, block_keys=keys.blocks, tail_keys=[keys.tail]
        )
        ask = _Ask(card, keys, req, req.SerializeToString(), on_failure, on_success, skip)
        hits: list[PeerHit] = []
        errors: list[str] = []
        if len(peers) <= ASK_ALL_BELOW:
            await self._round(peers, len(peers), ask, hits, errors)
            return self._ordered(hits), errors
        asked = await self._round(peers, self.replicas + 1, ask, hits, errors)
        root_held = max((_held_of(h) for h in hits), default=0)
        deep = place_index(len(chain), root_held, self.policy)
        if deep is not None:  # the chain lives with the first block the root's owners lack
            rest = [p for p in self._ranked(chain[deep]) if p.node_id not in asked]
            asked += await self._round(rest, self.replicas, ask, hits, errors)
        shed: set[str] = set()
        if self.policy.replicate and hits:
            shed = await self._probe_replica(hits, asked, ask, errors)
        return self._ordered(hits, shed), errors

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

    async def _probe_replica(
        self, hits: list[PeerHit], asked: list[str], ask: _Ask, errors: list[str]
    ) -> set[str]:
        """When the longest hit's prefix is hot, ask one of its replica ranks too (a
        second holder to choose from by load). A rank that lacks the prefix is
        named in the hits' ``repair``: whoever fetches one gives copies. Returns
        the owners to try last (:func:`~.placement.by_load`): all asked before
        the probe, when the probed replica holds the prefix."""
        best = max(h.tokens for h in hits)
        top = [h for h in hits if h.tokens == best and h.blocks]
        replicas = min(max((h.replicas for h in top), default=0), MAX_REPLICAS)
        if not replicas:
            return set()
        key = top[0].blocks[-1].key  # the prefix its holders counted
        caches = {c.node_id: c for c in self.membership.live() if "cache" in c.roles}
        ranks = replica_ranks(key, list(caches), replicas)
        node = probe_rank(ranks, asked, self._rng)
        if node is None or (ask.skip is not None and ask.skip(node)):
            return set()
        self.counters["lookup_replica_probes"] += 1
        found: list[PeerHit] = []
        await self._ask([caches[node]], ask, found, errors)
        hits.extend(found)
        n_blocks = len(top[0].blocks)
        if any(len(h.blocks) >= n_blocks for h in found):
            return set(asked)
        fill = tuple(repair_ranks(ranks, node, self._rng))
        lack = {id(h) for h in top}
        hits[:] = [dataclasses.replace(h, repair=fill) if id(h) in lack else h for h in hits]
        return set()

    def _ranked(self, key: bytes) -> list[pb.CapabilityCard]:
        """Live cache peers in rendezvous order of ``key``."""
        by_id = {c.node_id: c for c in self.membership.live() if "cache" in c.roles}
        return [by_id[n] for n in rendezvous(key, list(by_id), len(by_id))]

    def _ordered(self, hits: list[PeerHit], shed: Collection[str] = ()) -> list[PeerHit]:
        """Longest first; among holders of one length the least loaded (measured
        fetch rate gossiped by each, plus our own fetches in flight to it), then
        the best endpoint; ``shed`` (a hot prefix's owners) after the others."""
        hits = sorted(hits, key=lambda h: (-h.tokens, self._endpoint_rank(h)))
        out: list[PeerHit] = []
        for _, group in itertools.groupby(hits, key=lambda h: h.tokens):
            same = {h.node_id: h for h in group}
            rtt = {n: self._endpoint_rank(h)[1] for n, h in same.items()}
            order = by_load(list(same), self.load_of, rtt.__getitem__, self.policy, self._rng, shed)
            out += [same[n] for n in order]
        return out

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
        from .membership import INTERFACE_PRIORITY

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
            resp = await self._unary(
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
            data_address=self._data_address(peer, ep.address),
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
    ) -> list[Block]:
        """Stream ``hit``'s blocks from index ``start`` on, verified, within ``deadline``
        seconds (at most the client's fetch deadline), each wait for bytes within
        ``progress_timeout``. Raises a typed error. On the bulk path the deadline
        covers the wait for a stream thread too: a wait that runs it out (or leaves
        the stream too little) is :class:`LocalBusy` (ours, not the peer's); the
        stream gets the rest, counted from when it starts.

        ``on_block`` is called on a worker thread with each block as soon as its
        digest has been checked, so the caller can import while the rest arrives.
        ``times`` hears when the stream connected, received and verified it all."""
        infos = hit.infos[start:]
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
        raw = req.SerializeToString()
        limit = min(self.fetch_deadline, deadline or self.fetch_deadline)
        t0 = time.perf_counter()
        self._fetching[hit.node_id] += 1
        try:
            blocks = await self._fetch_from(
                layout, hit, infos, raw, on_block, limit, times or StreamTimes()
            )
        finally:
            self._fetching[hit.node_id] -= 1
            if not self._fetching[hit.node_id]:
                del self._fetching[hit.node_id]
        dt = time.perf_counter() - t0
        total = sum(b.nbytes for b in blocks)
        self.counters["bytes_fetched"] += total
        self.transfers.append(Transfer(hit.alias, total, dt, len(blocks), time.time()))
        if hit.repair and start == 0 and self._may_repair(blocks[-1].key):
            self.counters["replica_repairs"] += 1  # replica ranks that lacked it get copies
            self._enqueue(layout.card, blocks, hit.repair)
        return blocks

    def _may_repair(self, key: bytes) -> bool:
        """At most one repair per prefix per popularity window from this node: a hot
        claim (a peer's word) never turns each of our fetches into many publishes."""
        now = self._clock()
        last = self._repaired.get(key)
        if last is not None and now - last < self.policy.window_s:
            return False
        self._repaired[key] = now
        self._repaired.move_to_end(key)
        while len(self._repaired) > MAX_REPAIRED:
            self._repaired.popitem(last=False)
        return True

    async def _fetch_from(
        self,
        layout: Layout,
        hit: PeerHit,
        infos: tuple[pb.BlockInfo, ...],
        raw: bytes,
        on_block: Callable[[Block], None] | None,
        limit: float,
        times: StreamTimes,
    ) -> list[Block]:
        """The stream itself: the bulk data path when the peer has one, else gRPC."""
        if hit.data_address:
            digest = body_digest(raw)  # hashed once: the credential and the hello carry it
            cred = self._cred(bulk.METHODS[bulk.FETCH], hit.node_id, digest)
            blocks: list[Block] = await self._on_stream(
                bulk.fetch,
                hit.data_address,
                self._dialer,
                cred,
                raw,
                infos,
                layout,
                self._hashers,
                on_block,
                self.progress_timeout,
                limit_s=limit,
                digest=digest,
                times=times,
            )
            return blocks
        return await self._fetch_grpc(layout, hit, infos, raw, on_block, limit, times)

    async def _fetch_grpc(
        self,
        layout: Layout,
        hit: PeerHit,
        infos: tuple[pb.BlockInfo, ...],
        raw: bytes,
        on_block: Callable[[Block], None] | None,
        limit: float,
        times: StreamTimes,
    ) -> list[Block]:
        """The fetch as a gRPC stream of raw chunks (a peer without a data path);
        ``connected`` is when the call started (the channel is long-lived)."""
        loop = asyncio.get_running_loop()
        times.started = times.connected = time.perf_counter()
        call = self.channel(hit.address).unary_stream(
            FETCH, request_serializer=None, response_deserializer=None
        )(raw, timeout=limit, metadata=self._md(FETCH, hit.node_id, raw))
        asms = [Assembler(layout, i.nbytes, i.digest) for i in infos]
        done: list[Block | None] = [None] * len(asms)

        def feed(j: int, data: bytes, last: bool) -> None:
            asms[j].feed(data)
            if last:
                blk = asms[j].finish()  # raises ChecksumMismatch
                if blk.key != infos[j].key:
                    raise ChecksumMismatch("peer sent a block other than the one asked for")
                if on_block is not None:
                    on_block(blk)
                done[j] = blk

        pending: list[asyncio.Future[None]] = []
        i = booked = 0
        try:
            while (data := await self._next_chunk(call, hit)) is not None:
                if i >= len(asms) or booked + len(data) > asms[i].total:
                    raise MalformedPayload("chunk beyond the blocks asked for")
                booked += len(data)
                last = booked == asms[i].total
                # hashing runs on a worker thread (hashlib drops the GIL) while we receive
                pending.append(loop.run_in_executor(self._hashers[i % 2], feed, i, data, last))
                if last:
                    i, booked = i + 1, 0
                if len(pending) > 16:
                    await pending.pop(0)
            times.received = time.perf_counter()
            for f in pending:
                await f
            pending.clear()
            times.verified = time.perf_counter()
            if i < len(asms):
                raise MalformedPayload(f"stream ended after {i} of {len(asms)} blocks")
            blocks = [b for b in done if b is not None]
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        except (asyncio.CancelledError, KVMeshError):
            call.cancel()
            raise
        finally:
            if pending:  # the fetch failed: let in-flight hashing finish, its errors moot
                await asyncio.wait(pending)
                for f in pending:
                    if not f.cancelled():
                        f.exception()  # retrieved, so asyncio does not log it as lost
        return blocks

    async def _next_chunk(self, call: Any, hit: PeerHit) -> bytes | None:
        """The next message of a fetch, None at its end; :class:`FetchStalled` when
        nothing arrives within the progress timeout."""
        try:
            async with asyncio.timeout(self.progress_timeout):
                data = await call.read()
        except TimeoutError:
            raise FetchStalled(f"no bytes from {hit.alias} for {self.progress_timeout} s") from None
        return None if data is grpc.aio.EOF else data

    # -- publish -----------------------------------------------------------------

    def publish_targets(self, root: bytes) -> list[pb.CapabilityCard]:
        """Every live cache peer, in rendezvous order for this key."""
        return self._ranked(root)

    def enqueue_publish(self, card: CompatCard, blocks: list[Block]) -> bool:
        """Non-blocking; call on the client's loop. Drops (and counts) when full."""
        return self._enqueue(card, blocks, None)

    def _enqueue(self, card: CompatCard, blocks: list[Block], to: tuple[str, ...] | None) -> bool:
        """Queue ``blocks`` for placement (``to`` None) or for the peers ``to`` names."""
        if not blocks:
            return True
        try:
            self._queue.put_nowait((card, blocks, to))
        except asyncio.QueueFull:
            self.counters["publish_dropped"] += 1
            return False
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())
        return True

    def queued(self) -> int:
        """Publishes queued or being sent."""
        return self._queue.qsize() + self._inflight

    async def drain(self) -> None:
        await self._queue.join()

    async def _publish_loop(self) -> None:
        while True:
            card, blocks, to = await self._queue.get()
            self._inflight += 1
            try:
                if to is None:
                    await self._place(card, blocks)
                else:  # a hot prefix's replica ranks (placement.repair_ranks' order)
                    peers = {c.node_id: c for c in self.membership.live()}
                    targets = [peers[n] for n in to if n in peers]
                    await self._publish_to(targets, card, blocks, REPAIR_FANOUT, {}, missing=True)
            except Exception as e:  # a publish never kills the loop
                log.warning("publish failed: %r", e)
                self.counters["publish_failed:error"] += 1
            finally:
                self._inflight -= 1
                self._queue.task_done()

    async def _place(self, card: CompatCard, blocks: list[Block]) -> None:
        """Publish a chain where :func:`~.placement.place_index` puts it: the first
        root owner that answers says how much of it the root holds; the chain goes
        to the owners of the first block it lacks (or to the root's owners)."""
        owners = self.publish_targets(blocks[0].key)
        for peer in owners:
            try:
                held = await self._held(peer, card, blocks)
            except KVMeshError as e:
                self.counters[f"publish_failed:{e.reason}"] += 1
                continue
            i = place_index(len(blocks), held, self.policy)
            if i is None:  # from the one that answered: those before it failed just now
                rest = owners[owners.index(peer) :]
                await self._publish_to(rest, card, blocks, self.replicas, {peer.node_id: held})
            else:
                self.counters["publish_placed_deep"] += 1
                await self._publish_to(self._ranked(blocks[i].key), card, blocks, self.replicas, {})
            return

    async def _publish_to(
        self,
        targets: list[pb.CapabilityCard],
        card: CompatCard,
        blocks: list[Block],
        n: int,
        held: dict[str, int],
        missing: bool = False,
    ) -> None:
        """Give ``blocks`` to the first ``n`` of ``targets`` that answer (``missing``:
        that lacked some of them), each only the part it lacks (``held`` says what
        some of them hold already)."""
        done = 0
        for peer in targets:
            if done >= n:
                break
            try:
                have = held.get(peer.node_id)
                if have is None:
                    have = await self._held(peer, card, blocks)
                if have < len(blocks):
                    await self.publish(peer, card, blocks[have:])
                elif missing:
                    continue
                done += 1
            except KVMeshError as e:
                self.counters[f"publish_failed:{e.reason}"] += 1

    async def _held(self, peer: pb.CapabilityCard, card: CompatCard, blocks: list[Block]) -> int:
        """How many leading blocks of a chain ``peer`` already stores (one Lookup)."""
        eps = self.membership.ranked_endpoints(peer)
        full = [b.key for b in blocks if b.header.kind == "block"]
        tails = [b.key for b in blocks if b.header.kind == "tail"]
        if not eps or blocks[0].header.start != 0:
            return 0
        req = pb.LookupRequest(
            namespace=card.namespace, block_keys=full, tail_keys=tails, quiet=True
        )
        try:
            resp = await self._unary(
                eps[0].address,
                LOOKUP,
                peer.node_id,
                req.SerializeToString(),
                pb.LookupResponse,
                self.lookup_deadline * 4,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return min(len(blocks), len(resp.blocks) + (1 if resp.HasField("tail") else 0))

    async def publish(self, peer: pb.CapabilityCard, card: CompatCard, blocks: list[Block]) -> Any:
        eps = self.membership.ranked_endpoints(peer)
        if not eps:
            raise PeerUnavailable("peer has no endpoint")
        if not blocks:
            return pb.PublishResponse()
        card_json = json.dumps(card.to_json())
        if peer.data_port and self.use_bulk:
            resp = await self._publish_bulk(peer, eps[0].address, card_json, blocks)
        else:
            resp = await self._publish_grpc(peer, eps[0].address, card_json, blocks)
        self.counters["bytes_published"] += sum(b.nbytes for b in blocks)
        if resp.rejected:
            self.counters[f"publish_rejected:{resp.reason}"] += 1
        return resp

    async def _publish_bulk(
        self, peer: pb.CapabilityCard, address: str, card_json: str, blocks: list[Block]
    ) -> Any:
        infos = [
            pb.BlockInfo(key=b.key, nbytes=b.nbytes, digest=b.digest, tokens=b.header.tokens)
            for b in blocks
        ]
        body = pb.BulkPublish(card_json=card_json, blocks=infos).SerializeToString()
        digest = body_digest(body)  # hashed once: the credential and the hello carry it
        cred = self._cred(bulk.METHODS[bulk.PUBLISH], peer.node_id, digest)
        return await self._on_stream(
            bulk.publish,
            self._data_address(peer, address),
            self._dialer,
            cred,
            body,
            blocks,
            self.progress_timeout,
            limit_s=self.fetch_deadline,
            digest=digest,
        )

    async def _publish_grpc(
        self, peer: pb.CapabilityCard, address: str, card_json: str, blocks: list[Block]
    ) -> Any:
        size = self.chunk_bytes

        def messages():  # type: ignore[no-untyped-def]
            first = True
            for i, blk in enumerate(blocks):
                for j, c in enumerate(chunks(blk.blob, size)):
                    msg = pb.PublishChunk(block=i, data=bytes(c))
                    if j == 0:
                        msg.nbytes, msg.digest = blk.nbytes, blk.digest
                    if first:
                        msg.card_json, first = card_json, False
                    yield msg.SerializeToString()

        stream = messages()
        first = next(stream)  # the credential binds the first message (see body_digest)

        def raws():  # type: ignore[no-untyped-def]
            yield first
            yield from stream

        call = self.channel(address).stream_unary(
            PUBLISH, request_serializer=None, response_deserializer=pb.PublishResponse.FromString
        )
        try:
            return await call(
                raws(), timeout=self.fetch_deadline, metadata=self._md(PUBLISH, peer.node_id, first)
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None


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


def _warm_stream(nbytes: int, chunk: int) -> None:
    socket.getaddrinfo("127.0.0.1", 0, 0, socket.SOCK_STREAM)
    bulk.prefault(nbytes, chunk)


def _warm_hasher(layout: Layout, sample: Block, nbytes: int) -> None:
    decode_block(sample.blob, layout, sample.digest)
    bulk.prefault(nbytes, 1 << 20)


def _chain(keys: PrefixKeys) -> list[bytes]:
    """A prompt's chain as placement sees it: its full blocks, then its tail."""
    return [*keys.blocks, keys.tail] if keys.tail_tokens or not keys.blocks else list(keys.blocks)


def _held_of(hit: PeerHit) -> int:
    """How many elements of the asked chain (blocks, then the tail) a hit holds."""
    return len(hit.blocks) + (hit.tail is not None)


def _report(listener: Callable[..., None] | None, *args: str) -> None:
    """Tell the caller how a peer did; the caller's bug never fails a lookup."""
    if listener is None:
        return
    try:
        listener(*args)
    except Exception:
        log.exception("lookup listener raised")
