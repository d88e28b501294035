"""The client end of the bulk data path (:mod:`.bulk_wire`): blocking streams on
a worker thread, and :class:`BulkTransport`, which runs them for the event loop.

A fetch receives each block into a buffer of its announced size (capped by the
caller before anything is allocated) and verifies it on a hasher thread while the
next one arrives; a publish sends each block from its own buffer. Every failure
is a typed error; nothing the peer sends is trusted. A stream's ``limit_s``
counts from when it starts on its thread. To a peer on this host (:class:`Dialer`,
:meth:`Dialer.add_local`) the Unix socket is dialled first, and only when the
listener's process is this user's (``SO_PEERCRED``); TCP is the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NoReturn

from ..codec import (
    PART_ENTRY,
    Block,
    Layout,
    PartsPlan,
    decode_block,
    finish_parts,
    read_parts_head,
)
from ..errors import (
    ChecksumMismatch,
    KVMeshError,
    LocalBusy,
    MalformedPayload,
    PeerUnavailable,
    Unauthenticated,
)
from .bulk_wire import (
    BLOCK,
    CRED_SLOT,
    FETCH,
    FRAME,
    METHODS,
    PUBLISH,
    Stream,
    hello,
    local_socket_path,
    private_dir,
    receive_buffer,
    tune,
)
from .hits import PeerHit, info_of
from .proto import kvmesh_pb2 as pb
from .security import FleetAuth, TLSConfig, body_digest
from .transport import StreamTimes, Want

STREAMS = 8  # bulk streams at once (threads); a call waits for one within its own limit
MIN_STREAM_S = 0.05  # a stream given less than this (or half its limit) after the wait: LocalBusy
MAX_LOCAL_PEERS = 256  # data addresses known to have a Unix socket on this host


def prefault(nbytes: int, chunk: int) -> int:
    """Touch ``nbytes`` of fresh heap in ``chunk``-sized pieces and free them, so
    that the calling thread's malloc arena holds them already faulted in: the
    buffers it allocates next (received blocks) take no page faults (a 4 KiB fault
    costs microseconds: ~7,000 of them for a 27 MB prefix). They stay in the arena
    only where the process keeps freed heap (:func:`kvmesh.memory.keep_heap_warm`).
    Returns the bytes touched."""
    chunk = max(1, min(chunk, nbytes or 1))
    pieces = [bytearray(chunk) for _ in range(nbytes // chunk)]  # zero-filled: touched
    del pieces
    return (nbytes // chunk) * chunk


class Cancel:
    """Lets the caller's event loop abort a stream a worker thread is blocked on."""

    def __init__(self) -> None:
        self.cancelled = False
        self.sock: socket.socket | None = None

    def __call__(self) -> None:
        self.cancelled = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def data_address(grpc_address: str, data_port: int) -> str:
    """The bulk path's address on the host of a gRPC endpoint ("" if none)."""
    if not data_port:
        return ""
    return f"{grpc_address.rpartition(':')[0]}:{data_port}"


def _peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a Unix socket (-1: unknown)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return -1
    return int(struct.unpack("3i", raw)[1])


class Dialer:
    """How a client opens bulk streams: plain TCP, or TLS with the node's certificates
    (the context is built once: loading certificates per stream would cost ms); to
    a peer on this host (:meth:`add_local`), its Unix socket first."""

    def __init__(self, tls: TLSConfig | None) -> None:
        enabled = tls is not None and tls.enabled
        self.ssl = tls.client_ssl_context() if tls is not None and enabled else None
        self.server_name = tls.server_name if tls is not None else None
        self._local: OrderedDict[str, str] = OrderedDict()  # data address -> socket path
        self._lock = threading.Lock()  # stream threads read, the event loop writes
        self.local_streams = 0  # streams that went over a Unix socket

    def add_local(self, address: str, path: str) -> None:
        """Dial ``path`` before ``address`` (the same node's TCP data address)."""
        with self._lock:
            self._local[address] = path
            self._local.move_to_end(address)
            while len(self._local) > MAX_LOCAL_PEERS:
                self._local.popitem(last=False)

    def drop_local(self, address: str) -> None:
        """``address`` is no longer a node on this host: TCP only."""
        with self._lock:
            self._local.pop(address, None)

    def local_path(self, address: str) -> str | None:
        with self._lock:
            return self._local.get(address)

    def open(self, address: str, timeout: float) -> socket.socket:
        """A connected socket to ``address``: the node's Unix socket when it is on
        this host and listening there, else TCP (a Unix socket that is gone or
        refuses is no failure of the peer: TCP is still tried)."""
        path = self.local_path(address)
        if path and private_dir(os.path.dirname(path)):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
            else:
                if _peer_uid(sock) == os.getuid():  # never another user's listener
                    with self._lock:
                        self.local_streams += 1
                    return sock
                sock.close()
        host, port = _split(address)
        return socket.create_connection((host, port), timeout=timeout)


def _connect(address: str, dialer: Dialer, progress_s: float, cancel: Cancel) -> socket.socket:
    try:
        sock = dialer.open(address, progress_s)
    except OSError as e:
        raise PeerUnavailable(f"bulk connect to {address}: {e}") from None
    tune(sock)
    if dialer.ssl is not None:
        host = _split(address)[0]
        try:
            sock = dialer.ssl.wrap_socket(sock, server_hostname=dialer.server_name or host)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise Unauthenticated(f"bulk TLS handshake with {address}: {e}") from None
    cancel.sock = sock
    if cancel.cancelled:
        sock.close()
        raise PeerUnavailable("cancelled")
    return sock


def fetch(
    address: str,
    dialer: Dialer,
    cred: str,
    request: bytes,
    infos: Sequence[pb.BlockInfo],
    layout: Layout,
    hashers: Sequence[ThreadPoolExecutor],
    on_block: Callable[[Block], None] | None,
    progress_s: float,
    limit_s: float,
    cancel: Cancel,
    digest: bytes | None = None,
    times: StreamTimes | None = None,
    want: Want | None = None,
) -> list[Block]:
    """Fetch ``infos``' blocks (``request`` is their serialized FetchRequest,
    ``digest`` its :func:`body_digest` if known): each received into a buffer of
    its announced size (already capped by the caller), verified on ``hashers``
    (alternating) while the next arrives, all within ``limit_s`` of this call.
    With ``want`` (what ``request`` asked: the import's window, codecs) a block may
    come as exactly the parts the import needs (:func:`kvmesh.codec.read_parts_head`).
    Blocking; raises a typed error. ``times`` is filled in as stages are reached."""
    times = times or StreamTimes()
    times.started = time.perf_counter()
    deadline = time.monotonic() + limit_s  # from now: not while the call waited for a thread
    sock = _connect(address, dialer, progress_s, cancel)
    times.connected = time.perf_counter()
    stream = Stream(sock, progress_s, deadline)
    pending: list[Future[Block]] = []
    try:
        try:
            stream.send(hello(FETCH, request, cred, digest) + request)
            for j, info in enumerate(infos):
                job, n = _receive(stream, info, layout, want)
                times.wire_bytes += FRAME.size + n
                pending.append(hashers[j % len(hashers)].submit(job, on_block))
            times.received = time.perf_counter()
        except KVMeshError as e:  # a block already received and found bad says more
            wait(pending)
            bad = next((f.exception() for f in pending if f.exception() is not None), None)
            raise (bad or e) from None
        blocks = [f.result() for f in pending]
        times.verified = time.perf_counter()
        return blocks
    finally:
        sock.close()
        for f in pending:
            f.cancel()
        wait(pending)  # no block is handed on once this returns


def _parts_cap(info: pb.BlockInfo, layout: Layout) -> int:
    """The most bytes a PARTS frame of ``info``'s block may take: its whole size,
    plus a digest and a table entry per part and two counts."""
    return int(info.nbytes) + 4 + (layout.card.num_layers + 2) * (32 + PART_ENTRY.size)


def _receive(
    stream: Stream, info: pb.BlockInfo, layout: Layout, want: Want | None
) -> tuple[Callable[[Callable[[Block], None] | None], Block], int]:
    """Receive one block's frame: what verifies it (on a hasher thread), and the
    frame's bytes."""
    trims = want is not None and (want.keep_from is not None or bool(want.codecs))
    code, n = stream.read_frame(_parts_cap(info, layout) if trims else info.nbytes)
    if code == BLOCK:
        if n != info.nbytes:
            raise MalformedPayload(f"block is {n} bytes, its lookup said {info.nbytes}")
        buf = receive_buffer(n)
        stream.recv_into(memoryview(buf))
        return functools.partial(_verify, buf, layout, info), n
    if not trims or want is None:
        raise MalformedPayload("parts sent for a fetch that asked for whole blocks")
    plan = read_parts_head(
        stream.recv,
        n,
        layout,
        info.key,
        info.digest,
        want.keep_from,
        want.codec_ids,
        receive_buffer,
    )
    wires: dict[int, bytes] = {}
    for part, cid, nbytes, slot in plan.slots():
        if cid:
            wires[part] = stream.recv(nbytes)
        else:
            stream.recv_into(slot)
    return functools.partial(_verify_parts, plan, wires, layout), n


def _verify_parts(
    plan: PartsPlan,
    wires: dict[int, bytes],
    layout: Layout,
    on_block: Callable[[Block], None] | None,
) -> Block:
    blk = finish_parts(plan, wires, layout.card.block_digest)
    if on_block is not None:
        on_block(blk)
    return blk


def _verify(
    buf: bytearray, layout: Layout, info: pb.BlockInfo, on_block: Callable[[Block], None] | None
) -> Block:
    blk = decode_block(buf, layout, info.digest)  # type: ignore[arg-type]  # never written again
    if blk.key != info.key:
        raise ChecksumMismatch("peer sent a block other than the one asked for")
    if on_block is not None:
        on_block(blk)
    return blk


def publish(
    address: str,
    dialer: Dialer,
    cred: str,
    body: bytes,
    blocks: Sequence[Block],
    progress_s: float,
    limit_s: float,
    cancel: Cancel,
    digest: bytes | None = None,
) -> pb.PublishResponse:
    """Send ``blocks`` (announced by ``body``, a BulkPublish; ``digest`` its
    :func:`body_digest` if known) from their own buffers within ``limit_s`` of this
    call; the receiver's answer. Blocking; raises a typed error when there is none."""
    deadline = time.monotonic() + limit_s
    sock = _connect(address, dialer, progress_s, cancel)
    stream = Stream(sock, progress_s, deadline)
    try:
        try:
            stream.send(hello(PUBLISH, body, cred, digest) + body)
            for blk in blocks:
                stream.send(blk.blob)
        except PeerUnavailable:
            pass  # the receiver may have refused midway: its answer is still there to read
        _, n = stream.read_frame(64 << 10)
        return pb.PublishResponse.FromString(stream.recv(n))
    finally:
        sock.close()


class BulkTransport:
    """The bulk data path as a :class:`~.transport.Transport`: each stream runs on
    one of ``STREAMS`` threads. A call's limit covers both the wait for a thread
    and the stream: the wait is bounded by it (then :class:`LocalBusy`, our
    failure, not the peer's, as when too little of it is left once a thread is
    free) and the stream gets what is left, counted from when it starts."""

    def __init__(
        self,
        tls: TLSConfig | None,
        auth: FleetAuth | None,
        counters: Counter[str],
        hashers: Sequence[ThreadPoolExecutor],
        progress_s: float,
        publish_limit_s: float,
    ) -> None:
        self.auth, self.counters, self.hashers = auth, counters, hashers
        self.progress_s, self.publish_limit_s = progress_s, publish_limit_s
        self.dialer = Dialer(tls)
        self.local_host = b""  # this host's identity (host_identity); b"": TCP only
        self._clock = time.monotonic
        self._streams = ThreadPoolExecutor(STREAMS, thread_name_prefix="kvmesh-bulk")
        self._stream_slots = asyncio.Semaphore(STREAMS)  # a thread free for each holder

    def address_of(self, peer: pb.CapabilityCard, address: str) -> str:
        """The peer's bulk address on ``address``'s host ("": none). A peer whose
        card carries our ``local_host`` is dialled at its Unix socket first, by a
        path derived from its node id (:func:`~.bulk_wire.local_socket_path`)."""
        data = data_address(address, peer.data_port)
        same_host = bool(data and self.local_host) and peer.host == self.local_host
        path = local_socket_path(peer.node_id) if same_host else ""  # a digest: only then
        if path:
            self.dialer.add_local(data, path)
        elif data:
            self.dialer.drop_local(data)  # a card can stop saying it (a restart elsewhere)
        return data

    async def fetch(
        self,
        hit: PeerHit,
        request: bytes,
        infos: Sequence[pb.BlockInfo],
        layout: Layout,
        on_block: Callable[[Block], None] | None,
        limit_s: float,
        times: StreamTimes,
        want: Want | None = None,
    ) -> list[Block]:
        digest = body_digest(request)  # hashed once: the credential and the hello carry it
        cred = self._cred(FETCH, hit.node_id, digest)
        blocks: list[Block] = await self._on_stream(
            fetch,
            hit.data_address,
            self.dialer,
            cred,
            request,
            infos,
            layout,
            self.hashers,
            on_block,
            self.progress_s,
            limit_s=limit_s,
            digest=digest,
            times=times,
            want=want,
        )
        return blocks

    async def publish(
        self, peer: pb.CapabilityCard, address: str, card_json: str, blocks: Sequence[Block]
    ) -> pb.PublishResponse:
        infos = [info_of(b) for b in blocks]
        body = pb.BulkPublish(card_json=card_json, blocks=infos).SerializeToString()
        digest = body_digest(body)  # hashed once: the credential and the hello carry it
        cred = self._cred(PUBLISH, peer.node_id, digest)
        resp: pb.PublishResponse = await self._on_stream(
            publish,
            self.address_of(peer, address),
            self.dialer,
            cred,
            body,
            blocks,
            self.progress_s,
            limit_s=self.publish_limit_s,
            digest=digest,
        )
        return resp

    def _cred(self, op: int, dest: str, digest: bytes) -> str:
        """A stream's credential ("" without a key) for a body whose
        :func:`body_digest` is ``digest``. Our own node id was checked at setup:
        one too long for the hello is the peer's (:class:`MalformedPayload`)."""
        method = METHODS[op]
        self.counters[f"rpc:{method.rsplit('/', 1)[-1]}"] += 1
        if self.auth is None:
            return ""
        cred = self.auth.call_metadata(method, dest, digest)[0][1]
        if len(cred.encode()) > CRED_SLOT:
            raise MalformedPayload("the peer's node id is too long for a bulk credential")
        return cred

    async def _on_stream(
        self, fn: Callable[..., Any], *args: Any, limit_s: float, **kwargs: Any
    ) -> Any:
        """``fn(*args, left, cancel, **kwargs)`` on a stream thread once one is free,
        all within ``limit_s`` of this call (see the class). Cancelling us aborts
        its socket and waits for it, so nothing it hands on runs after we return."""
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
        cancel = Cancel()
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

    async def warm(self, layout: Layout, sample: Block, nbytes: int) -> None:
        """Pay a process's first-use costs of a fetch now: start the stream thread
        and both hashers, resolve a numeric address (Python's first lookup imports
        its IDNA codec), verify ``sample`` on each hasher, and pre-fault ``nbytes``
        of heap (:func:`prefault`) where a fetch allocates: on the stream thread
        and on the first hasher. An idle pool hands its next task to the thread
        that ran this, so the first fetch finds both warm."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._streams, _warm_stream, nbytes, sample.nbytes)
        for i, h in enumerate(self.hashers):
            await loop.run_in_executor(h, _warm_hasher, layout, sample, nbytes if i == 0 else 0)

    def close(self) -> None:
        self._streams.shutdown(wait=False)


def _warm_stream(nbytes: int, chunk: int) -> None:
    socket.getaddrinfo("127.0.0.1", 0, 0, socket.SOCK_STREAM)
    prefault(nbytes, chunk)


def _warm_hasher(layout: Layout, sample: Block, nbytes: int) -> None:
    decode_block(sample.blob, layout, sample.digest)
    prefault(nbytes, 1 << 20)
