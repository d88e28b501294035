"""How block bytes travel between a head and a peer: the :class:`Transport` protocol
and its gRPC implementation (the bulk one is :class:`~.bulk_client.BulkTransport`).

A transport fetches a chain's blocks (verified, each handed to ``on_block`` as
soon as its digest checks out) and publishes a chain. Either raises a typed
error (:mod:`kvmesh.errors`): gRPC statuses are mapped once, here, by
:func:`~.rpc_errors.from_rpc_error`; bulk ERROR frames by
:func:`~.bulk_wire.frame_error`. A fetch aborts when its limit passes or when no
bytes arrive for ``progress_s`` (:class:`~.bulk_wire.FetchStalled`).

:class:`Channels` holds one long-lived gRPC channel per peer address (at most
``MAX_CHANNELS``, least recently used closed first) and signs each call: under a
fleet key a call's credential names its destination node and binds the exact
request bytes sent.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from .. import squeeze
from ..codec import Assembler, Block, Layout, chunks
from ..errors import ChecksumMismatch, KVMeshError, MalformedPayload
from .bulk_wire import FetchStalled
from .hits import PeerHit
from .proto import kvmesh_pb2 as pb
from .rpc_errors import from_rpc_error
from .security import FleetAuth, TLSConfig, body_digest, open_channel
from .server import GRPC_OPTIONS

MAX_CHANNELS = 512  # addresses come from gossip: a hostile card must not open channels forever
LOOKUP = "/kvmesh.v1.PrefillCache/Lookup"
FETCH = "/kvmesh.v1.PrefillCache/Fetch"
PUBLISH = "/kvmesh.v1.PrefillCache/Publish"

OnBlock = Callable[[Block], None]


@dataclass
class StreamTimes:
    """When one fetch's stream reached each stage, in ``time.perf_counter()``
    seconds (0.0: not reached): what a caller's per-request breakdown is made of."""

    started: float = 0.0  # the stream's thread took it up
    connected: float = 0.0  # the socket (and TLS) is up
    received: float = 0.0  # the last byte of the last block is in
    verified: float = 0.0  # every block verified and handed on
    wire_bytes: int = 0  # frame bytes received (bulk path; gRPC: block bytes)


@dataclass(frozen=True)
class Want:
    """What a fetch asks of its blocks beyond their keys: ``keep_from`` (per layer,
    the first position the import needs: :meth:`kvmesh.codec.Layout.keep_from`;
    None: every part) and ``codecs`` the parts may come in (preferred first). Only
    the bulk path honours it; gRPC streams whole blocks, which an import takes too."""

    keep_from: tuple[int, ...] | None = None
    codecs: tuple[str, ...] = ()
    wire: int | None = None  # the block bytes that should then move (the planner's estimate)

    @property
    def codec_ids(self) -> tuple[int, ...]:
        return (0, *(squeeze.codec_id(c) for c in self.codecs))


class Transport(Protocol):
    """Moves a chain's blocks to or from one peer; every failure a typed error."""

    async def fetch(
        self,
        hit: PeerHit,
        request: bytes,
        infos: Sequence[pb.BlockInfo],
        layout: Layout,
        on_block: OnBlock | None,
        limit_s: float,
        times: StreamTimes,
        want: Want | None = None,
    ) -> list[Block]:
        """``infos``' blocks from ``hit``'s peer (``request``: their serialized
        FetchRequest), verified, within ``limit_s``; ``want``: see :class:`Want`."""
        ...

    async def publish(
        self, peer: pb.CapabilityCard, address: str, card_json: str, blocks: Sequence[Block]
    ) -> pb.PublishResponse:
        """Give ``blocks`` (of the card ``card_json``) to ``peer`` at its gRPC ``address``."""
        ...


class Channels:
    """gRPC channels by address, and the credential each call carries."""

    def __init__(
        self,
        tls: TLSConfig | None,
        auth: FleetAuth | None,
        counters: Counter[str],
        close_grace: float,
    ) -> None:
        self.tls, self.auth, self.counters = tls, auth, counters
        self.close_grace = close_grace
        self._open: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._open.get(address)
        if ch is None:
            ch = self._open[address] = open_channel(address, self.tls, GRPC_OPTIONS)
            while len(self._open) > MAX_CHANNELS:
                _, old = self._open.popitem(last=False)
                self._close_later(old.close(grace=self.close_grace))
        self._open.move_to_end(address)
        return ch

    def _close_later(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._closing.discard)

    def count(self, method: str) -> None:
        self.counters[f"rpc:{method.rsplit('/', 1)[-1]}"] += 1

    def metadata(self, method: str, dest: str, raw: bytes) -> tuple[tuple[str, str], ...] | None:
        """Call metadata: a credential for ``dest`` bound to the request bytes ``raw``."""
        self.count(method)
        return self.auth.call_metadata(method, dest, body_digest(raw)) if self.auth else None

    async def unary(
        self, address: str, method: str, dest: str, raw: bytes, response: Any, timeout: float
    ) -> Any:
        """One unary call with the request already serialized (``raw`` is what the
        credential binds, byte for byte). Raises ``grpc.aio.AioRpcError``."""
        call = self.channel(address).unary_unary(
            method, request_serializer=None, response_deserializer=response.FromString
        )
        return await call(raw, timeout=timeout, metadata=self.metadata(method, dest, raw))

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        for ch in self._open.values():
            await ch.close()
        self._open.clear()


class GrpcTransport:
    """Fetch as a gRPC stream of raw chunks, publish as a client stream: for peers
    without a bulk data path. Chunks are hashed on ``hashers`` (alternating by
    block, so one block's chunks stay in order) while the next ones arrive."""

    def __init__(
        self,
        channels: Channels,
        hashers: Sequence[ThreadPoolExecutor],
        progress_s: float,
        chunk_bytes: int,
        publish_limit_s: float,
    ) -> None:
        self.channels, self.hashers = channels, hashers
        self.progress_s, self.chunk_bytes = progress_s, chunk_bytes
        self.publish_limit_s = publish_limit_s

    async def fetch(
        self,
        hit: PeerHit,
        request: bytes,
        infos: Sequence[pb.BlockInfo],
        layout: Layout,
        on_block: OnBlock | None,
        limit_s: float,
        times: StreamTimes,
        want: Want | None = None,
    ) -> list[Block]:
        """``connected`` is when the call started (the channel is long-lived);
        ``want`` is not honoured here: whole blocks, which an import takes too."""
        times.started = times.connected = time.perf_counter()
        call = self.channels.channel(hit.address).unary_stream(
            FETCH, request_serializer=None, response_deserializer=None
        )(request, timeout=limit_s, metadata=self.channels.metadata(FETCH, hit.node_id, request))
        sink = _Verifier(layout, infos, on_block, self.hashers)
        try:
            while (data := await self._next_chunk(call, hit)) is not None:
                await sink.feed(data)
            times.received = time.perf_counter()
            await sink.drain()
            times.verified = time.perf_counter()
            blocks = sink.blocks()
            times.wire_bytes += sum(b.nbytes for b in blocks)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        except (asyncio.CancelledError, KVMeshError):
            call.cancel()
            raise
        finally:
            await sink.settle()
        return blocks

    async def _next_chunk(self, call: Any, hit: PeerHit) -> bytes | None:
        """The next message of a fetch, None at its end; :class:`FetchStalled` when
        nothing arrives within the progress timeout."""
        try:
            async with asyncio.timeout(self.progress_s):
                data = await call.read()
        except TimeoutError:
            raise FetchStalled(f"no bytes from {hit.alias} for {self.progress_s} s") from None
        return None if data is grpc.aio.EOF else data

    async def publish(
        self, peer: pb.CapabilityCard, address: str, card_json: str, blocks: Sequence[Block]
    ) -> pb.PublishResponse:
        stream = _publish_messages(card_json, blocks, self.chunk_bytes)
        first = next(stream)  # the credential binds the first message (see body_digest)

        def raws() -> Iterator[bytes]:
            yield first
            yield from stream

        call = self.channels.channel(address).stream_unary(
            PUBLISH, request_serializer=None, response_deserializer=pb.PublishResponse.FromString
        )
        metadata = self.channels.metadata(PUBLISH, peer.node_id, first)
        try:
            resp: pb.PublishResponse = await call(
                raws(), timeout=self.publish_limit_s, metadata=metadata
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return resp


def _publish_messages(card_json: str, blocks: Sequence[Block], size: int) -> Iterator[bytes]:
    """A publish as serialized PublishChunks: the card in the first, each block's
    size and digest in its own first chunk."""
    first = True
    for i, blk in enumerate(blocks):
        for j, c in enumerate(chunks(blk.blob, size)):
            msg = pb.PublishChunk(block=i, data=bytes(c))
            if j == 0:
                msg.nbytes, msg.digest = blk.nbytes, blk.digest
            if first:
                msg.card_json, first = card_json, False
            yield msg.SerializeToString()


class _Verifier:
    """Assembles a fetch's chunks into blocks and verifies each on a hasher thread
    (hashlib drops the GIL) while the next chunks arrive."""

    def __init__(
        self,
        layout: Layout,
        infos: Sequence[pb.BlockInfo],
        on_block: OnBlock | None,
        hashers: Sequence[ThreadPoolExecutor],
    ) -> None:
        self.infos, self.on_block, self.hashers = infos, on_block, hashers
        self.asms = [Assembler(layout, i.nbytes, i.digest) for i in infos]
        self.done: list[Block | None] = [None] * len(self.asms)
        self.pending: list[asyncio.Future[None]] = []
        self.i = self.booked = 0

    async def feed(self, data: bytes) -> None:
        i, asms = self.i, self.asms
        if i >= len(asms) or self.booked + len(data) > asms[i].total:
            raise MalformedPayload("chunk beyond the blocks asked for")
        self.booked += len(data)
        last = self.booked == asms[i].total
        loop = asyncio.get_running_loop()
        self.pending.append(loop.run_in_executor(self.hashers[i % 2], self._add, i, data, last))
        if last:
            self.i, self.booked = i + 1, 0
        if len(self.pending) > 16:
            await self.pending.pop(0)

    def _add(self, j: int, data: bytes, last: bool) -> None:
        self.asms[j].feed(data)
        if last:
            blk = self.asms[j].finish()  # raises ChecksumMismatch
            if blk.key != self.infos[j].key:
                raise ChecksumMismatch("peer sent a block other than the one asked for")
            if self.on_block is not None:
                self.on_block(blk)
            self.done[j] = blk

    async def drain(self) -> None:
        for f in self.pending:
            await f
        self.pending.clear()

    def blocks(self) -> list[Block]:
        if self.i < len(self.asms):
            raise MalformedPayload(f"stream ended after {self.i} of {len(self.asms)} blocks")
        return [b for b in self.done if b is not None]

    async def settle(self) -> None:
        """After a failure: let in-flight hashing finish, its errors moot."""
        if self.pending:
            await asyncio.wait(self.pending)
            for f in self.pending:
                if not f.cancelled():
                    f.exception()  # retrieved, so asyncio does not log it as lost
