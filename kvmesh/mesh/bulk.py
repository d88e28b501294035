"""The bulk data path: block bytes on a plain TCP (or TLS) stream beside gRPC.

gRPC stays the control plane (lookup, membership, and Fetch / Publish with peers
that advertise no data port). Here block bytes move without a Python object per
chunk: a sender writes each stored blob with one ``sendall`` from its own buffer;
a receiver ``recv_into``\\ s a buffer preallocated at the size announced (checked
against the card's cap *before* it is allocated), and a hasher thread verifies
each finished block while the next one arrives.

Wire, version 2 (integers little-endian)::

    hello    b"KVX2" | u8 op | u32 body_len | 32-byte SHA-256 of the body
             | u16 cred_len | credential, zero-padded to 1,024 bytes
             (fixed size, 1,067 bytes: all a server reads before it authenticates)
    body     body_len bytes, hashing to the hello's SHA-256
             FETCH:   a FetchRequest; the reply is one frame per block
             PUBLISH: a BulkPublish (the card, every block's size and digest);
                      the blocks' bytes follow it back to back
    frame    u8 code | u64 n | n bytes
             BLOCK: one block's bytes   ERROR: "reason: detail" (UTF-8)
             DONE:  a PublishResponse

The credential is the ``x-kvmesh-auth`` value (see :mod:`.security`) for
``/kvmesh.v1.Bulk/Fetch`` or ``/kvmesh.v1.Bulk/Publish`` bound to the body's
SHA-256; for a publish that body names every block's digest, so no block can be
swapped in. It is empty without a fleet key. Under TLS the stream is wrapped with
the node's own certificates (client certificates required when the server has a
CA). A version 1 hello (``KVX1``) is refused at once, by name.

Before authentication a connection gets ``auth_s`` seconds *in all* (TLS handshake
and hello; not per read), at most ``per_source`` such connections from one
address and ``max_pending`` in all: past either cap the oldest unauthenticated
connection (of that address, else of all) is cut, so a new one always gets its
turn and slow unauthenticated connections cannot hold the port. Only then does a
stream take one of ``max_conns`` slots (one more is answered ``busy``, which a
client raises as :class:`~kvmesh.errors.PeerBusy`: the peer is loaded, not
failing), read the body, each read or write within the progress timeout. Every
error answered after the hello is followed by reading (and dropping) what the
client still sends for up to ``DRAIN_S``, so that closing does not reset the
connection before the client has read the answer; connections answered ``busy``
while they drain are at most ``max_conns`` more (any further one is closed at
once) and are cut with the rest when the server stops.

Two nodes on one host (the same kernel, filesystem and user: their cards carry the
same :func:`host_identity`) speak the same protocol over a Unix socket instead of
TCP on loopback: the server listens at :func:`local_socket_path` of its node id too,
and a client that finds it there dials it, falling back to TCP when it cannot. The
path is derived from the node id on both sides, never taken from a card, so a card
cannot point a client at another program's socket; the directory must be the
user's own (mode 0700) and the listener's process this user's (``SO_PEERCRED``).
It saves the TCP stack's work (~30% of a loopback transfer's time); bytes are
verified exactly as from anywhere.

A server reserves publish bytes against the cache service's in-flight cap before
allocating them and counts every refusal as ``bulk_rejected:<reason>``; a client
turns every failure into a typed error. Neither side trusts the other. A client's
``limit_s`` counts from when its call starts on a stream thread. A credential
that cannot fit the hello is a configuration error, found when a node is set up
(:func:`check_credential`), never on a stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..codec import Block, Layout, decode_block
from ..errors import (
    ChecksumMismatch,
    ConfigError,
    KVMeshError,
    LeaseExpired,
    MalformedPayload,
    OversizePayload,
    PeerBusy,
    PeerTimeout,
    PeerUnavailable,
    Reason,
    StaleEpoch,
    StoreFull,
    Unauthenticated,
    carried,
    wire_reason,
    wire_text,
)
from .proto import kvmesh_pb2 as pb
from .security import AUTH_HEADER, CallRefused, FleetAuth, TLSConfig, body_digest

if TYPE_CHECKING:
    from .server import CacheService

log = logging.getLogger("kvmesh.bulk")

MAGIC = b"KVX2"  # the protocol version: a peer speaking another is refused by name
CRED_SLOT = 1024  # a credential is ~110 bytes plus the node ids
HELLO = struct.Struct(f"<4sBI32sH{CRED_SLOT}s")
FRAME = struct.Struct("<BQ")
FETCH, PUBLISH = 1, 2
BLOCK, ERROR, DONE = 0, 1, 2
METHODS = {FETCH: "/kvmesh.v1.Bulk/Fetch", PUBLISH: "/kvmesh.v1.Bulk/Publish"}
MAX_BODY = 4 << 20  # 65,536 keys of a fetch fit; a card plus 65,536 block infos too
MAX_REASON = 512
MAX_PUBLISH_BLOCKS = 65536
MAX_CONNS = 32  # authenticated streams
MAX_PENDING = 64  # connections not yet authenticated, from all addresses
PER_SOURCE = 8  # ... from one address
AUTH_S = 3.0  # TLS handshake and hello, in all: an honest peer needs milliseconds
STREAM_S = 3600.0  # an authenticated stream's total (its reads and writes: PROGRESS_S each)
PROGRESS_S = 10.0
DRAIN_S = 1.0  # after an error answered past the hello, read (and drop) this long so it lands


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


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


def receive_buffer(n: int) -> bytearray:
    """A bytearray of ``n`` bytes left uninitialized (``bytearray(n)`` zero-fills it:
    a whole extra pass over memory the socket overwrites anyway). Only for buffers
    filled in full before anyone reads them; a short read discards the buffer."""
    return _new_bytearray(None, n)  # type: ignore[no-any-return]


@dataclass
class StreamTimes:
    """When one fetch's stream reached each stage, in ``time.perf_counter()``
    seconds (0.0: not reached): what a caller's per-request breakdown is made of."""

    started: float = 0.0  # the stream's thread took it up
    connected: float = 0.0  # the socket (and TLS) is up
    received: float = 0.0  # the last byte of the last block is in
    verified: float = 0.0  # every block verified and handed on


class FetchStalled(PeerTimeout):
    """No bytes arrived for the progress timeout: the peer is alive but silent."""

    reason = Reason.STALLED


class AuthDeadline(PeerTimeout):
    """A connection did not authenticate within the pre-auth deadline."""

    reason = Reason.AUTH_DEADLINE


#: The typed errors an ERROR frame carries back as themselves, by the reason its
#: text starts with; any other reason comes back as PeerUnavailable.
FRAME_ERRORS = carried(
    StaleEpoch,
    LeaseExpired,
    Unauthenticated,
    OversizePayload,
    MalformedPayload,
    ChecksumMismatch,
    StoreFull,
    PeerTimeout,
    PeerBusy,
)


def error_frame(e: KVMeshError) -> bytes:
    """The payload of the ERROR frame that refuses with ``e``: ``reason: message``."""
    return wire_text(e)[:MAX_REASON].encode()


def frame_error(text: str) -> KVMeshError:
    """A peer's ERROR frame as the typed error it names (else peer_unreachable)."""
    return FRAME_ERRORS.get(wire_reason(text), PeerUnavailable)(f"peer refused: {text}")


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


class _Stream:
    """One socket with bounded waits: each read or write within ``progress_s`` and
    all of them before ``deadline`` (monotonic seconds)."""

    def __init__(self, sock: socket.socket, progress_s: float, deadline: float) -> None:
        self.sock = sock
        self.progress_s = progress_s
        self.deadline = deadline
        self._by_deadline = False

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout("bulk stream deadline passed")
        self._by_deadline = left < self.progress_s
        self.sock.settimeout(min(self.progress_s, left))

    def _timed_out(self, what: str) -> PeerTimeout:
        if self._by_deadline:
            return PeerTimeout("bulk stream deadline passed")
        return FetchStalled(f"{what} for {self.progress_s} s")

    def _pump(self, move: Callable[[memoryview], int], view: memoryview, idle: str) -> None:
        """``move`` (one recv_into or send) until ``view`` is done, each call bounded."""
        while view:
            self._arm()
            try:
                n = move(view)
            except TimeoutError:
                raise self._timed_out(idle) from None
            except OSError as e:
                raise PeerUnavailable(f"bulk stream broke: {e}") from None
            if n == 0:
                raise PeerUnavailable("bulk stream closed early")
            view = view[n:]

    def recv_into(self, view: memoryview) -> None:
        self._pump(self.sock.recv_into, view, "no bytes")

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def send(self, data: Any) -> None:
        """sendall, but each write bounded by the progress timeout."""
        self._pump(self.sock.send, memoryview(data).cast("B"), "peer took no bytes")

    def frame(self, code: int, payload: bytes = b"") -> None:
        self.send(FRAME.pack(code, len(payload)) + payload)

    def read_frame(self, max_payload: int) -> tuple[int, int]:
        """(code, n) of the next frame; an ERROR frame is raised as its typed error."""
        code, n = FRAME.unpack(self.recv(FRAME.size))
        if code == ERROR:
            if n > MAX_REASON:
                raise MalformedPayload("peer sent an oversize error frame")
            raise frame_error(self.recv(n).decode("utf-8", "replace"))
        if code not in (BLOCK, DONE) or n > max_payload:
            raise MalformedPayload(f"unexpected frame {code} of {n} bytes")
        return code, n


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def data_address(grpc_address: str, data_port: int) -> str:
    """The bulk path's address on the host of a gRPC endpoint ("" if none)."""
    if not data_port:
        return ""
    return f"{grpc_address.rpartition(':')[0]}:{data_port}"


MAX_LOCAL_PEERS = 256  # data addresses known to have a Unix socket on this host
_SUN_PATH_MAX = 107  # a Unix socket path's bytes (sun_path holds 108 with its NUL)


def host_identity() -> bytes:
    """What two nodes share exactly when each can reach the other's Unix socket by
    the same path: this boot of the kernel, this mount namespace and this user.
    Empty where it cannot be told (no ``/proc``): such a node never uses one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as fh:
            boot = fh.read().strip()
        mounts = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return b""
    where = _socket_dir().encode()  # both sides must look in the same directory
    ident = b"kvmesh-host|%s|%d|%d|%s" % (boot, mounts, os.getuid(), where)
    return hashlib.sha256(ident).digest()[:16]


def _socket_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"kvmesh-{os.getuid()}")


def _private_dir(folder: str) -> bool:
    """``folder`` is a directory of this user's that no one else may enter."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a Unix socket (-1: unknown)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return -1
    return int(struct.unpack("3i", raw)[1])


def local_socket_path(node_id: str) -> str:
    """Where the node ``node_id`` listens for same-host bulk streams: in a
    directory of this user's (mode 0700), named by a digest of the node id, so
    that no card can name the path ("" when it would not fit a socket address)."""
    name = hashlib.sha256(node_id.encode()).hexdigest()[:20]
    path = os.path.join(_socket_dir(), f"bulk-{name}.sock")
    return path if len(path.encode()) <= _SUN_PATH_MAX else ""


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
        if path and _private_dir(os.path.dirname(path)):
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
    _tune(sock)
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


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)


def check_credential(auth: FleetAuth | None) -> None:
    """Raise :class:`~kvmesh.errors.ConfigError` (when a node is set up, not per
    stream) if a bulk credential of this node to a peer whose node id is as long
    as its own would not fit the hello."""
    if auth is None:
        return
    cred = auth.call_metadata(METHODS[PUBLISH], auth.node_id, bytes(32))[0][1]
    if len(cred.encode()) > CRED_SLOT:
        raise ConfigError(
            f"node id of {len(auth.node_id.encode())} bytes: its bulk credentials "
            f"would be {len(cred.encode())} bytes (at most {CRED_SLOT}); "
            "shorten the node id"
        )


def hello(op: int, body: bytes, cred: str, digest: bytes | None = None) -> bytes:
    """The fixed-size frame a request opens with: everything the server checks
    before it reads ``body`` (which the caller sends next). ``digest`` is
    ``body_digest(body)`` when the caller has it already (it bound the credential)."""
    raw = cred.encode()
    if len(raw) > CRED_SLOT:
        raise MalformedPayload(f"a bulk credential is {len(raw)} bytes (at most {CRED_SLOT})")
    digest = body_digest(body) if digest is None else digest
    return HELLO.pack(MAGIC, op, len(body), digest, len(raw), raw)


# -- client ----------------------------------------------------------------------


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
) -> list[Block]:
    """Fetch ``infos``' blocks (``request`` is their serialized FetchRequest,
    ``digest`` its :func:`body_digest` if known): each received into a buffer of
    its announced size (already capped by the caller), verified on ``hashers``
    (alternating) while the next arrives, all within ``limit_s`` of this call.
    Blocking; raises a typed error. ``times`` is filled in as stages are reached."""
    times = times or StreamTimes()
    times.started = time.perf_counter()
    deadline = time.monotonic() + limit_s  # from now: not while the call waited for a thread
    sock = _connect(address, dialer, progress_s, cancel)
    times.connected = time.perf_counter()
    stream = _Stream(sock, progress_s, deadline)
    pending: list[Future[Block]] = []
    try:
        try:
            stream.send(hello(FETCH, request, cred, digest) + request)
            for j, info in enumerate(infos):
                _, n = stream.read_frame(info.nbytes)
                if n != info.nbytes:
                    raise MalformedPayload(f"block {j} is {n} bytes, its lookup said {info.nbytes}")
                buf = receive_buffer(n)
                stream.recv_into(memoryview(buf))
                pending.append(
                    hashers[j % len(hashers)].submit(_verify, buf, layout, info, on_block)
                )
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
    stream = _Stream(sock, progress_s, deadline)
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


# -- server ----------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    """One accepted connection: its socket as it is now (plain, then TLS), where
    it came from, and whether the gate cut it before it authenticated."""

    sock: socket.socket
    source: str
    accepted: float
    evicted: bool = False
    admitted: bool = False  # authenticated, holding a stream or a refusing place

    def cut(self) -> None:
        # socket.socket's own shutdown: SSLSocket's would drop its TLS state under
        # the thread that is using it
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class _Gate:
    """Who holds the port. Unauthenticated connections: at most ``per_source`` from
    one address and ``max_pending`` in all, the oldest (of that address, else of
    all) cut to make room for a new one. Authenticated streams: at most
    ``max_conns``, the next refused ``busy``: up to ``max_conns`` of those are held
    while their answer drains (``refusing``), any more closed at once. Thread-safe."""

    def __init__(self, max_conns: int, max_pending: int, per_source: int) -> None:
        self.max_conns, self.max_pending, self.per_source = max_conns, max_pending, per_source
        self._lock = threading.Lock()
        self._pending: OrderedDict[_Conn, None] = OrderedDict()  # oldest first
        self._by_source: dict[str, int] = {}
        self._streams: set[_Conn] = set()
        self._refusing: set[_Conn] = set()  # answered busy, draining

    def arrive(self, conn: _Conn) -> None:
        """Admit a new unauthenticated connection, cutting whom it displaces."""
        with self._lock:
            if self._by_source.get(conn.source, 0) >= self.per_source:
                self._evict(next(c for c in self._pending if c.source == conn.source))
            if len(self._pending) >= self.max_pending:
                self._evict(next(iter(self._pending)))
            self._pending[conn] = None
            self._by_source[conn.source] = self._by_source.get(conn.source, 0) + 1

    def _evict(self, conn: _Conn) -> None:
        self._leave(conn)
        conn.evicted = True
        conn.cut()

    def _leave(self, conn: _Conn) -> bool:
        if self._pending.pop(conn, False) is False:
            return False
        left = self._by_source[conn.source] - 1
        if left:
            self._by_source[conn.source] = left
        else:
            del self._by_source[conn.source]
        return True

    def rewrap(self, conn: _Conn, wrap: Callable[[socket.socket], socket.socket]) -> None:
        """``conn.sock = wrap(conn.sock)`` where no eviction can cut in between (a
        wrapped socket takes over the file descriptor of the plain one)."""
        with self._lock:
            if conn.evicted:
                raise PeerUnavailable("cut before it authenticated")
            conn.sock = wrap(conn.sock)

    def authenticated(self, conn: _Conn) -> None:
        """Move ``conn`` from pending to a stream slot; raise :class:`PeerBusy` when
        there is none (``conn.admitted`` when it may drain that answer)."""
        with self._lock:
            if not self._leave(conn):
                raise PeerUnavailable("cut before it authenticated")
            if len(self._streams) >= self.max_conns:
                if len(self._refusing) < self.max_conns:
                    self._refusing.add(conn)
                    conn.admitted = True
                raise PeerBusy(f"all {self.max_conns} bulk streams in use")
            self._streams.add(conn)
            conn.admitted = True

    def gone(self, conn: _Conn) -> None:
        with self._lock:
            self._leave(conn)
            self._streams.discard(conn)
            self._refusing.discard(conn)

    def refusing(self) -> int:
        """Connections answered ``busy`` whose answer is draining now."""
        with self._lock:
            return len(self._refusing)

    def counts(self) -> tuple[int, int]:
        """(unauthenticated connections, authenticated streams) now."""
        with self._lock:
            return len(self._pending), len(self._streams)

    def cut_all(self) -> None:
        with self._lock:
            for c in [*self._pending, *self._streams, *self._refusing]:
                c.cut()


class BulkServer:
    """The bulk path of one cache node: a listening socket, one thread accepting and
    one thread per connection (at most ``max_pending`` unauthenticated and
    ``max_conns`` authenticated ones)."""

    def __init__(
        self,
        cache: CacheService,
        auth: FleetAuth | None = None,
        tls: TLSConfig | None = None,
        max_conns: int = MAX_CONNS,
        progress_s: float = PROGRESS_S,
        auth_s: float = AUTH_S,
        max_pending: int = MAX_PENDING,
        per_source: int = PER_SOURCE,
    ) -> None:
        self.cache = cache
        self.auth = auth
        self.tls = tls if tls is not None and tls.enabled else None
        self.progress_s = progress_s
        self.auth_s = auth_s
        self.port = 0
        self.gate = _Gate(max_conns, max_pending, per_source)
        self._ssl = self.tls.server_ssl_context() if self.tls else None
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._verify = ThreadPoolExecutor(2, thread_name_prefix="kvmesh-bulk-verify")
        self._acceptors: list[threading.Thread] = []
        self.local_path = ""  # the Unix socket it also listens on ("" if none)
        self._local: socket.socket | None = None
        self._local_inode = 0

    @property
    def counters(self) -> Any:
        return self.cache.counters

    def start(self, host: str, port: int = 0, local_path: str = "") -> int:
        """Listen on ``host:port`` (0: any free port; returned), and at
        ``local_path`` too when given (for nodes on this host; skipped, logged,
        when it cannot be bound)."""
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]") or "0.0.0.0", port))
        sock.listen(64)
        sock.settimeout(0.25)  # the accept loop checks for stop this often
        self._sock, self.port = sock, sock.getsockname()[1]
        self._listen(sock, "kvmesh-bulk")
        if local_path:
            try:
                self._local, self._local_inode = _unix_listener(local_path)
            except OSError as e:
                log.warning("no same-host bulk socket at %s: %s", local_path, e)
            else:
                self.local_path = local_path
                self._listen(self._local, "kvmesh-bulk-local")
        return self.port

    def _listen(self, sock: socket.socket, name: str) -> None:
        acceptor = threading.Thread(target=self._accept, args=(sock,), name=name, daemon=True)
        self._acceptors.append(acceptor)
        acceptor.start()

    def stop(self) -> None:
        self._stopping.set()
        for acceptor in self._acceptors:
            acceptor.join(2)
        if self._sock is not None:
            self._sock.close()
        if self._local is not None:
            self._local.close()
            with contextlib.suppress(OSError):  # ours still (not a later node's)
                if os.stat(self.local_path).st_ino == self._local_inode:
                    os.unlink(self.local_path)
        self.gate.cut_all()
        self._verify.shutdown(wait=False, cancel_futures=True)

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                sock, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            source = addr[0] if isinstance(addr, tuple) else "local"  # a Unix socket's is ""
            if source == "local":
                self.counters["bulk_local_connections"] += 1
            conn = _Conn(sock, source, time.monotonic())
            self.gate.arrive(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except RuntimeError as e:  # no thread to be had now: this one is cut, we go on
                log.warning("bulk connection cut: %s", e)
                self._count_reject(conn, "no_thread")
                self.gate.gone(conn)
                conn.cut()
                conn.sock.close()

    def _serve(self, conn: _Conn) -> None:
        try:
            _tune(conn.sock)
            self._handle(conn)
        except (ssl.SSLError, OSError) as e:
            self._count_reject(conn, "connection")
            log.debug("bulk stream failed: %s", e)
        except Exception:  # a bug here must not take the acceptor or the node down
            log.exception("bulk stream failed")
        finally:
            self.gate.gone(conn)
            conn.sock.close()

    def _count_reject(self, conn: _Conn, reason: str) -> None:
        self.counters[f"bulk_rejected:{'evicted' if conn.evicted else reason}"] += 1

    def _handle(self, conn: _Conn) -> None:
        stream: _Stream | None = None
        try:
            deadline = conn.accepted + self.auth_s  # the whole pre-auth phase
            if self._ssl is not None:
                self._handshake(conn, deadline)
            stream = _Stream(conn.sock, self.auth_s, deadline)
            op, body_len, digest = self._admit(stream)
            self.gate.authenticated(conn)
            stream.progress_s, stream.deadline = self.progress_s, time.monotonic() + STREAM_S
            body = stream.recv(body_len)
            if body_digest(body) != digest:
                raise MalformedPayload("bulk request body differs from its hello's digest")
            if op == FETCH:
                self._fetch(stream, body)
            else:
                self._publish(stream, body)
        except KVMeshError as e:
            self._count_reject(conn, e.reason)
            if stream is None or conn.evicted:
                return
            answer = error_frame(e)
            if conn.admitted:  # past the hello: the client may still be sending
                stream.progress_s = self.progress_s  # a refused busy one has the pre-auth ones
                stream.deadline = time.monotonic() + self.progress_s
                self._answer_refused(stream, ERROR, answer)
            else:  # not authenticated: answered, then closed at once
                with contextlib.suppress(KVMeshError):  # the peer may be gone already
                    stream.frame(ERROR, answer)

    def _admit(self, stream: _Stream) -> tuple[int, int, bytes]:
        """Read and check the hello: (op, body_len, body digest) once its credential
        checks out. Nothing of the body has been read."""
        try:
            magic = stream.recv(len(MAGIC))
            if magic != MAGIC:  # answered at once: an old peer learns why
                raise MalformedPayload(f"not a kvmesh bulk {MAGIC.decode()} hello ({magic!r})")
            rest = stream.recv(HELLO.size - len(MAGIC))
        except PeerTimeout:
            raise AuthDeadline(f"no hello within {self.auth_s} s") from None
        _, op, body_len, digest, cred_len, cred = HELLO.unpack(magic + rest)
        if op not in METHODS or cred_len > CRED_SLOT:
            raise MalformedPayload("not a kvmesh bulk request")
        if body_len > MAX_BODY:
            raise OversizePayload("bulk request body too large")
        self._check_credential(op, cred[:cred_len].decode("ascii", "replace"), digest)
        return op, body_len, digest

    def _handshake(self, conn: _Conn, deadline: float) -> None:
        """TLS handshake bounded by the pre-auth deadline: the socket timeout is a
        deadline for the whole handshake (not per read) in :mod:`ssl`."""
        assert self._ssl is not None
        ctx = self._ssl
        self.gate.rewrap(
            conn, lambda s: ctx.wrap_socket(s, server_side=True, do_handshake_on_connect=False)
        )
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthDeadline("no time left for the TLS handshake")
        conn.sock.settimeout(left)
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except TimeoutError:
            raise AuthDeadline(f"TLS handshake took over {self.auth_s} s") from None

    def _check_credential(self, op: int, cred: str, digest: bytes) -> None:
        if self.auth is None:
            return
        try:
            self.auth.verify_call(METHODS[op], ((AUTH_HEADER, cred),), digest)
        except CallRefused as e:
            self.counters["unauthenticated"] += 1
            self.counters[f"unauthenticated:{e.why}"] += 1
            raise

    def _fetch(self, stream: _Stream, body: bytes) -> None:
        request = _parse(pb.FetchRequest, body)
        for block in self.cache.serve_fetch(request):
            blob = block.blob
            stream.send(FRAME.pack(BLOCK, len(blob)))
            stream.send(blob)  # from the store's own buffer: no copy

    def _publish(self, stream: _Stream, body: bytes) -> None:
        request = _parse(pb.BulkPublish, body)
        if not 0 < len(request.blocks) <= MAX_PUBLISH_BLOCKS:
            raise MalformedPayload("a publish names 1 to 65,536 blocks")
        layout = self.cache.layout_of(request.card_json)
        resp = pb.PublishResponse()
        verifying: Future[None] | None = None
        try:
            for info in request.blocks:
                reserved = self.cache.reserve(info.nbytes)  # before the buffer exists
                try:
                    buf = receive_buffer(info.nbytes)
                    stream.recv_into(memoryview(buf))
                    if verifying is not None:
                        verifying.result()  # one block verified while the next arrives
                except BaseException:
                    self.cache.release(reserved)
                    raise
                verifying = self._verify.submit(self._keep, buf, layout, info, reserved, resp)
            if verifying is not None:
                verifying.result()
        except KVMeshError as e:
            if verifying is not None:
                with contextlib.suppress(KVMeshError):
                    verifying.result()
            self.cache.count_rejection(resp, e)
            self._answer_refused(stream, DONE, resp.SerializeToString())
            return
        stream.frame(DONE, resp.SerializeToString())

    def _keep(
        self,
        buf: bytearray,
        layout: Layout,
        info: pb.BlockInfo,
        reserved: int,
        resp: pb.PublishResponse,
    ) -> None:
        try:
            block = decode_block(buf, layout, info.digest)  # type: ignore[arg-type]
        finally:
            self.cache.release(reserved)
        if block.key != info.key:
            raise MalformedPayload("block key differs from the one announced")
        self.cache.keep(block, resp)

    def _answer_refused(self, stream: _Stream, code: int, payload: bytes) -> None:
        """Answer, then read (and drop) what the client is still sending for a
        moment, so that closing does not reset the connection before it reads."""
        with contextlib.suppress(KVMeshError):  # the peer may be gone already
            stream.frame(code, payload)
        sock, sink = stream.sock, bytearray(1 << 20)
        end = time.monotonic() + DRAIN_S
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
            while (left := end - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv_into(sink):
                    break


def _unix_listener(path: str) -> tuple[socket.socket, int]:
    """A listening Unix socket at ``path`` and its file's inode, in a directory only
    this user may use (made mode 0700; refused when it is anyone else's or open to
    others). A file left at ``path`` by a node that died is replaced; one that a
    live node (the same node id, twice) still answers on is not."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not _private_dir(folder):
        raise PermissionError(f"{folder} is not a private directory of this user")
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a dead node's
        else:
            raise FileExistsError(f"a live node listens at {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(64)
        inode = os.stat(path).st_ino
    except OSError:
        sock.close()
        raise
    sock.settimeout(0.25)
    return sock, inode


def _parse(message: Any, body: bytes) -> Any:
    try:
        return message.FromString(body)
    except Exception:  # DecodeError and friends
        raise MalformedPayload("bulk request body does not parse") from None
