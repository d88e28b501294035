"""The cache node's gRPC services: ``PrefillCache`` and ``Membership``.

Lookup is metadata only. Fetch streams the chosen blocks under a lease tied to
the store's epoch. Publish is idempotent and immutable: each block is validated
against the card the publisher names (whose SHA-256 must be the namespace) and
its digest (the card's algorithm, BLAKE3 by default) is checked before it is
stored. Under a fleet key every call must carry a credential bound to this node
and to its request (see :mod:`kvmesh.mesh.security`), else UNAUTHENTICATED;
request bytes are hashed before they are parsed, so nothing an unauthenticated
caller sends is parsed.

The receiver sets its own limits, never the publisher's card: a block larger
than ``max_block_bytes`` (or than the store's budget) is refused when announced,
and the bytes of every block being received are reserved against
``max_inflight_bytes`` *before* one of them is buffered, released on any outcome.
A publisher that sends nothing for ``publish_progress_s`` is cut off (its
reservation released). A fetch naming a key twice is refused. Every refusal is
counted by reason (``publish_rejected:*``, ``fetch_rejected:*``,
``lookup_rejected:*``, ``unauthenticated:*``).

A lookup that finds a prefix counts it as demand (:class:`~.placement.Popularity`;
a publisher's ``quiet`` lookup does not) and answers how many extra holders it
should have (``replicas``, see :mod:`.placement`). Fetches served and bytes out
are counted, and the recent fetch rate is this node's gossiped ``load``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..codec import CHUNK_BYTES, MAX_CHUNK_BYTES, Assembler, Block, Layout, chunks
from ..compat import CompatCard
from ..errors import (
    KVMeshError,
    LeaseExpired,
    MalformedPayload,
    OversizePayload,
    PeerTimeout,
    Reason,
    StaleEpoch,
    StoreFull,
)
from ..store import BlockStore
from .hits import info_of
from .membership import Membership
from .placement import Popularity, Rate
from .proto import kvmesh_pb2 as pb
from .proto import kvmesh_pb2_grpc as pbg
from .rpc_errors import to_status
from .security import CallRefused, FleetAuth, TLSConfig, body_digest

log = logging.getLogger("kvmesh.server")

MAX_CARD_JSON = 16 * 1024
MAX_NAMESPACES = 64
MAX_LOOKUP_KEYS = 65536
MAX_SUMMARY_CHARS = 200
DEFAULT_MAX_BLOCK_BYTES = 64 << 20
PUBLISH_PROGRESS_S = 10.0  # a publisher silent this long is cut off, its reservation freed
HEALTH = "/grpc.health.v1.Health/"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (64 << 10)),
    ("grpc.max_send_message_length", MAX_CHUNK_BYTES + (64 << 10)),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.max_frame_size", 1 << 20),
    ("grpc.http2.lookahead_bytes", 16 << 20),  # a big first window: no slow start per fetch
]


class CacheService:
    def __init__(
        self,
        store: BlockStore,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        max_inflight_bytes: int | None = None,
        publish_progress_s: float = PUBLISH_PROGRESS_S,
        quiet: Callable[[bytes], None] | None = None,
    ) -> None:
        """``quiet(namespace)``: told of each published namespace whose blocks are
        not KV (pictures' encoder rows), before one of its blocks is stored."""
        self.store = store
        self._quiet = quiet
        self.max_block_bytes = max_block_bytes
        self.max_inflight_bytes = max_inflight_bytes or 2 * max_block_bytes
        self.publish_progress_s = publish_progress_s
        self.inflight_bytes = 0
        self._inflight_lock = threading.Lock()  # the bulk path reserves from its threads
        self.layouts: dict[bytes, Layout] = {}
        self.summaries: dict[bytes, str] = {}
        self.counters: Counter[str] = Counter()
        self.popularity = Popularity()
        self._served = Rate(self.popularity.policy.window_s, time.monotonic())
        self._served_lock = threading.Lock()  # fetches are served from bulk threads too

    def load(self) -> float:
        """Fetches served per second, recently (what a card gossips as ``load``)."""
        with self._served_lock:
            return self._served.per_s(time.monotonic())

    def reserve(self, nbytes: int) -> int:
        """Reserve room to buffer one announced block, or refuse it (typed)."""
        cap = min(self.max_block_bytes, self.store.stats.budget_bytes)
        if not 0 < nbytes <= cap:
            raise OversizePayload(f"announced block of {nbytes} bytes; this peer takes <= {cap}")
        with self._inflight_lock:
            if self.inflight_bytes + nbytes > self.max_inflight_bytes:
                raise StoreFull("too many bytes in flight; publish later")
            self.inflight_bytes += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        with self._inflight_lock:
            self.inflight_bytes -= nbytes

    def keep(self, block: Block, resp: pb.PublishResponse) -> None:
        """Store a verified published block, counting it in ``resp``."""
        if self.store.put(block):
            resp.stored += 1
            self.counters["bytes_published"] += block.nbytes
        else:
            resp.duplicates += 1

    def count_rejection(self, resp: pb.PublishResponse, e: Exception) -> None:
        """A publish refused midway: typed and counted; what was complete is kept."""
        reason = Reason.MALFORMED_PAYLOAD  # an untyped refusal: the payload's fault
        if isinstance(e, KVMeshError) and type(e) is not KVMeshError:
            reason = e.reason
        resp.rejected += 1
        resp.reason = str(reason)
        self.counters[f"publish_rejected:{reason}"] += 1
        log.warning("publish rejected: %s (%s)", reason, e)

    def serve_fetch(self, request: pb.FetchRequest) -> Generator[Block, None, None]:
        """The blocks a fetch names, in order, under a lease on the store's epoch;
        a refusal is a typed error, counted as ``fetch_rejected:*``. The caller
        counts ``bytes_served``: what it sent (a trimmed or compressed block's
        parts, not the block)."""
        if len(request.keys) > MAX_LOOKUP_KEYS:
            self.counters["fetch_rejected:bad_request"] += 1
            raise MalformedPayload("bad fetch request")
        if len(set(request.keys)) != len(request.keys):
            self.counters["fetch_rejected:duplicate_keys"] += 1
            raise MalformedPayload("duplicate keys")
        if request.epoch != self.store.epoch:
            self.counters["fetch_rejected:stale_epoch"] += 1
            raise StaleEpoch("stale_epoch")
        ttl = request.lease_ttl_s if 0 < request.lease_ttl_s <= 300 else 30.0
        try:
            lease = self.store.lease(list(request.keys), ttl)
        except LeaseExpired:
            self.counters["fetch_rejected:not_found"] += 1
            raise
        self.counters["fetches"] += 1
        with self._served_lock:
            self._served.add(time.monotonic())
        try:
            for key in request.keys:
                try:
                    self.store.check_lease(lease.id, lease.epoch)
                except LeaseExpired:
                    self.counters["fetch_rejected:lease_expired"] += 1
                    raise
                block = self.store.get(key)
                if block is None:  # a disk file found bad on read (deleted, counted)
                    raise LeaseExpired("lease_expired: block gone")
                yield block
        finally:
            self.store.release(lease.id)

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        if len(request.block_keys) > MAX_LOOKUP_KEYS or len(request.tail_keys) > 64:
            self.counters["lookup_rejected:too_many_keys"] += 1
            await context.abort(*to_status(MalformedPayload("too many keys")))
        self.counters["lookups"] += 1
        tail = next((k for k in request.tail_keys if k in self.store), None)
        m = self.store.lookup(list(request.block_keys), tail)  # the index only: no file read
        if m.blocks and m.blocks[0].header.namespace != request.namespace:
            return pb.LookupResponse(epoch=self.store.epoch)  # keys of another namespace
        resp = pb.LookupResponse(
            epoch=self.store.epoch, blocks=[info_of(b) for b in m.blocks], matched_tokens=m.tokens
        )
        if m.tail is not None:
            resp.tail.CopyFrom(info_of(m.tail))
        if m.blocks and not request.quiet:  # demand for the prefix ending at its last block
            resp.replicas = self.popularity.hit(m.blocks[-1].key)
        return resp

    async def Fetch(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[bytes]:
        """Raw block bytes, in order; each message holds part of exactly one block.
        (Not protobuf-encoded: a block travels without re-serialisation copies.)"""
        size = request.chunk_bytes or CHUNK_BYTES
        if not 0 < size <= MAX_CHUNK_BYTES:
            self.counters["fetch_rejected:bad_request"] += 1
            await context.abort(*to_status(MalformedPayload("bad fetch request")))
        blocks = self.serve_fetch(request)
        try:
            while True:
                try:
                    block = next(blocks)
                except StopIteration:
                    return
                except KVMeshError as e:
                    await context.abort(*to_status(e))
                    return
                blob = block.blob
                if len(blob) <= size and isinstance(blob, bytes):
                    yield blob
                else:
                    for chunk in chunks(blob, size):
                        yield bytes(chunk)
                self.counters["bytes_served"] += len(blob)
        finally:
            blocks.close()

    async def Publish(
        self, request_iterator: AsyncIterator[pb.PublishChunk], context: Any
    ) -> pb.PublishResponse:
        resp = pb.PublishResponse()
        layout: Layout | None = None
        asm: Assembler | None = None
        reserved = 0  # bytes of the block being received, held against the in-flight cap
        try:
            async for msg in self._progressing(request_iterator):
                if layout is None:
                    layout = self.layout_of(msg.card_json)
                if msg.nbytes:  # first chunk of a block
                    if asm is not None:
                        raise KVMeshError("previous block incomplete")
                    reserved = self.reserve(msg.nbytes)
                    asm = Assembler(layout, msg.nbytes, msg.digest or None)
                if asm is None:
                    raise KVMeshError("chunk outside a block")
                if len(msg.data) > 256 << 10:
                    await asyncio.to_thread(asm.feed, msg.data)
                else:
                    asm.feed(msg.data)
                if asm.complete:
                    block = asm.finish()
                    asm = None
                    self.release(reserved)
                    reserved = 0
                    self.keep(block, resp)
            if asm is not None:
                raise KVMeshError("stream ended inside a block")
        except (KVMeshError, ValueError, TypeError, KeyError) as e:  # typed and counted
            self.count_rejection(resp, e)
        finally:
            self.release(reserved)  # a failed or abandoned block frees its reservation
        return resp

    async def _progressing(self, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``messages``, cut off with :class:`PeerTimeout` when the next one takes
        longer than ``publish_progress_s`` (a slow publisher must not hold its
        reservation forever)."""
        it = aiter(messages)
        while True:
            try:
                async with asyncio.timeout(self.publish_progress_s):
                    msg = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise PeerTimeout(f"publisher silent for {self.publish_progress_s} s") from None
            yield msg

    def layout_of(self, card_json: str) -> Layout:
        """The layout of a publisher's card (typed refusal when it is no card)."""
        if not card_json or len(card_json) > MAX_CARD_JSON:
            raise MalformedPayload("publish must start with a card")
        try:
            card = CompatCard.from_json(json.loads(card_json))
        except (ValueError, TypeError, AttributeError):
            raise MalformedPayload("publish card does not parse") from None
        ns = card.namespace
        if ns not in self.layouts:
            if len(self.layouts) >= MAX_NAMESPACES:
                raise KVMeshError("too many namespaces")
            self.layouts[ns] = Layout(card)
            self.summaries[ns] = card.summary()[:MAX_SUMMARY_CHARS]
            if card.rows and self._quiet is not None:
                self._quiet(ns)
        return self.layouts[ns]


def cache_handler(svc: CacheService) -> grpc.GenericRpcHandler:
    """PrefillCache, registered by hand so that Fetch can stream raw bytes."""
    return grpc.method_handlers_generic_handler(
        "kvmesh.v1.PrefillCache",
        {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                svc.Lookup,
                request_deserializer=pb.LookupRequest.FromString,
                response_serializer=pb.LookupResponse.SerializeToString,
            ),
            "Fetch": grpc.unary_stream_rpc_method_handler(
                svc.Fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=None
            ),
            "Publish": grpc.stream_unary_rpc_method_handler(
                svc.Publish,
                request_deserializer=pb.PublishChunk.FromString,
                response_serializer=pb.PublishResponse.SerializeToString,
            ),
        },
    )


class MembershipService(pbg.MembershipServicer):
    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    async def Exchange(self, request: pb.ExchangeRequest, context: Any) -> pb.ExchangeResponse:
        self.membership.merge(request.cards)
        return pb.ExchangeResponse(cards=self.membership.outgoing())


class CycleCollector:
    """Collects cyclic garbage after every ``every`` bytes of requests received.
    grpc.aio leaves each finished call's state in a reference cycle, and that state
    holds the call's request: its bytes, gRPC's buffers and what parsed from them.
    The longer a call runs the more collections its state outlives before it is
    garbage, so on a loaded machine such cycles reach the oldest generation and pile
    up: measured, 30 lookups of 70,000 keys grew a peer's RSS by 72 MiB beside a busy
    loop, by 1 MiB with a collection before each (publishes likewise:
    bench/hostile_publish.py). Counted as ``gc_collections``."""

    def __init__(self, every: int, counters: Counter[str]) -> None:
        self.every = every
        self.counters = counters
        self._since = 0  # request bytes received since the last collection

    def received(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every:
            self._since = 0
            gc.collect()
            self.counters["gc_collections"] += 1


class RequestGate(grpc.aio.ServerInterceptor):
    """Every request's bytes pass here before anything parses them. Under a fleet
    key (``auth``) every call but health checks must carry a credential bound to
    this node and to those bytes; a refusal is UNAUTHENTICATED, counted as
    ``unauthenticated`` and ``unauthenticated:<why>``. Bytes that do not parse
    are INVALID_ARGUMENT (counted ``request_rejected:malformed``), never an
    exception escaping into gRPC (UNKNOWN, with the exception's text). Every
    message's bytes are told to ``collector`` (see :class:`CycleCollector`)."""

    def __init__(
        self, auth: FleetAuth | None, counters: Counter[str], collector: CycleCollector
    ) -> None:
        self.auth = auth
        self.counters = counters
        self.collector = collector

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler  # an unknown method: UNIMPLEMENTED
        auth = None if details.method.startswith(HEALTH) else self.auth  # health is public

        async def admit(raw: bytes, context: Any) -> Any:
            """The parsed request once its credential checks out, else abort."""
            self.collector.received(len(raw))
            if auth is not None:
                try:
                    auth.verify_call(details.method, details.invocation_metadata, body_digest(raw))
                except CallRefused as e:
                    self.counters["unauthenticated"] += 1
                    self.counters[f"unauthenticated:{e.why}"] += 1
                    await context.abort(*to_status(e))
            return await self._parse(handler, raw, context)

        return _gated(handler, admit, self.counters, self.collector)

    async def _parse(self, handler: grpc.RpcMethodHandler, raw: bytes, context: Any) -> Any:
        parse = handler.request_deserializer
        try:
            return parse(raw) if parse is not None else raw
        except (DecodeError, ValueError):
            self.counters["request_rejected:malformed"] += 1
            await context.abort(*to_status(MalformedPayload("malformed request")))


Admit = Callable[[bytes, Any], Awaitable[Any]]


async def _after_first(
    first: Any,
    rest: AsyncIterator[bytes],
    parse: Callable[[bytes], Any] | None,
    counters: Counter[str],
    collector: CycleCollector,
) -> AsyncIterator[Any]:
    """The request stream again: its admitted first message, then the rest parsed
    (a message that does not parse is a typed payload error of the call)."""
    yield first
    async for raw in rest:
        collector.received(len(raw))
        try:
            yield parse(raw) if parse is not None else raw
        except (DecodeError, ValueError):
            counters["request_rejected:malformed"] += 1
            raise MalformedPayload("a request message does not parse") from None


def _gated(
    handler: grpc.RpcMethodHandler,
    admit: Admit,
    counters: Counter[str],
    collector: CycleCollector,
) -> grpc.RpcMethodHandler:
    """``handler`` behind ``admit``: it receives raw request bytes, and its first
    (for a stream, its only bound) request is admitted before anything runs."""
    out = dict(response_serializer=handler.response_serializer)

    async def first_of(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        it = aiter(raws)
        first = await anext(it, None)
        msg = await admit(b"" if first is None else first, context)  # an empty stream binds b""
        if first is None:
            return _none()
        return _after_first(msg, it, handler.request_deserializer, counters, collector)

    if not handler.request_streaming and not handler.response_streaming:

        async def unary_unary(raw: bytes, context: Any) -> Any:
            return await handler.unary_unary(await admit(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **out)
    if not handler.request_streaming:

        async def unary_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            async for item in handler.unary_stream(await admit(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **out)
    if not handler.response_streaming:

        async def stream_unary(raws: AsyncIterator[bytes], context: Any) -> Any:
            return await handler.stream_unary(await first_of(raws, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **out)

    async def stream_stream(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        async for item in handler.stream_stream(await first_of(raws, context), context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **out)


async def _none() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover


async def start_server(
    listen: str,
    store: BlockStore,
    membership: Membership,
    auth: FleetAuth | None = None,
    tls: TLSConfig | None = None,
    cache: CacheService | None = None,
) -> tuple[grpc.aio.Server, int, CacheService]:
    """Start the gRPC server; return it, the bound port and the cache service."""
    cache = cache or CacheService(store)
    gate = RequestGate(
        auth, cache.counters, CycleCollector(cache.max_inflight_bytes, cache.counters)
    )
    server = grpc.aio.server(interceptors=[gate], options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((cache_handler(cache),))
    pbg.add_MembershipServicer_to_server(MembershipService(membership), server)
    hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if tls is not None and tls.enabled:
        port = server.add_secure_port(listen, tls.server_credentials())
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not bind {listen}")
    await server.start()
    res = hs.set("", health_pb2.HealthCheckResponse.SERVING)
    if asyncio.iscoroutine(res):
        await res
    return server, port, cache
