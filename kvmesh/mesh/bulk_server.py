"""The server end of the bulk data path (:mod:`.bulk_wire`): one cache node's listener.

Before authentication a connection gets ``auth_s`` seconds *in all* (TLS handshake
and hello; not per read), at most ``per_source`` such connections from one
address and ``max_pending`` in all: past either cap the oldest unauthenticated
connection (of that address, else of all) is cut, so a new one always gets its
turn and slow unauthenticated connections cannot hold the port. Only then does a
stream take one of ``max_conns`` slots (one more is answered ``busy``, which a
client raises as :class:`~kvmesh.errors.PeerBusy`: loaded, not failing), and
read the body, each read or write within the progress timeout. Every error
answered after the hello is followed by reading (and dropping) what the client
still sends for up to ``DRAIN_S``, so that closing does not reset the connection
before the client has read the answer; connections answered ``busy`` while they
drain are at most ``max_conns`` more (any further one is closed at once).

A fetch that names ``keep_from`` (the importer's window: :meth:`kvmesh.codec.Layout.keep_from`)
gets each block that needs fewer than all of its parts, or that the codec it asked
for (``codecs``) shrinks, as a PARTS frame (:func:`kvmesh.codec.parts_frame`); any
other block as its stored bytes. ``serve_rate`` caps the bytes per second all of a
node's fetch streams send together (a token bucket: an operator's cap, and the
benchmark's shaper where it has no root).

Publish bytes are reserved against the cache service's in-flight cap before they
are allocated; every refusal is counted as ``bulk_rejected:<reason>``. Under TLS
client certificates are required when the server has a CA. A same-host Unix
socket is served only from a private directory of this user's; a node that binds
one there removes the files of dead nodes' sockets (older than ``STALE_SOCKET_S``,
refusing connections: a killed node never unlinks its own, and no later node has
its id). A connection that closes before sending a byte is a liveness probe (that
sweep's, a TCP health check's): nothing is counted against it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import squeeze
from ..codec import ALL, Block, Layout, decode_block, parts_frame, want_mask
from ..errors import (
    KVMeshError,
    MalformedPayload,
    OversizePayload,
    PeerBusy,
    PeerTimeout,
    PeerUnavailable,
    Reason,
)
from .bulk_wire import (
    BLOCK,
    CRED_SLOT,
    DONE,
    ERROR,
    FETCH,
    FRAME,
    HELLO,
    MAGIC,
    MAX_BODY,
    METHODS,
    PARTS,
    Stream,
    error_frame,
    private_dir,
    receive_buffer,
    tune,
)
from .proto import kvmesh_pb2 as pb
from .security import AUTH_HEADER, CallRefused, FleetAuth, TLSConfig, body_digest

if TYPE_CHECKING:
    from .server import CacheService

log = logging.getLogger("kvmesh.bulk")

MAX_PUBLISH_BLOCKS = 65536
MAX_CONNS = 32  # authenticated streams
MAX_PENDING = 64  # connections not yet authenticated, from all addresses
PER_SOURCE = 8  # ... from one address
AUTH_S = 3.0  # TLS handshake and hello, in all: an honest peer needs milliseconds
STREAM_S = 3600.0  # an authenticated stream's total (its reads and writes: PROGRESS_S each)
PROGRESS_S = 10.0
DRAIN_S = 1.0  # after an error answered past the hello, read (and drop) this long so it lands
PACE_BYTES = 64 << 10  # a paced stream's bytes per send
MAX_CODECS = 8
STALE_SOCKET_S = 60.0  # a younger socket file may be a starting node's, bound but not listening


class Pacer:
    """A token bucket over every fetch stream of one server: ``rate`` bytes per
    second, with a burst of a tenth of a second (0: no cap)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def send(self, stream: Stream, data: Any) -> None:
        if not self.rate:
            stream.send(data)
            return
        view = memoryview(data).cast("B")
        for off in range(0, len(view), PACE_BYTES):
            piece = view[off : off + PACE_BYTES]
            self._wait(len(piece))
            stream.send(piece)

    def _wait(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now - 0.1) + n / self.rate
            late = self._next - now
        if late > 0:
            time.sleep(late)


class AuthDeadline(PeerTimeout):
    """A connection did not authenticate within the pre-auth deadline."""

    reason = Reason.AUTH_DEADLINE


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
        serve_rate: float = 0.0,
    ) -> None:
        self.cache = cache
        self.pacer = Pacer(serve_rate)
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
            tune(conn.sock)
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
        stream: Stream | None = None
        try:
            deadline = conn.accepted + self.auth_s  # the whole pre-auth phase
            if _sent_nothing(conn.sock, deadline) and not conn.evicted:  # (cut: counted)
                return
            if self._ssl is not None:
                self._handshake(conn, deadline)
            stream = Stream(conn.sock, self.auth_s, deadline)
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

    def _admit(self, stream: Stream) -> tuple[int, int, bytes]:
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

    def _fetch(self, stream: Stream, body: bytes) -> None:
        request = _parse(pb.FetchRequest, body)
        keep = tuple(request.keep_from) or None
        codec = _codec(request.codecs)
        for block in self.cache.serve_fetch(request):
            mask = want_mask(block.header, keep)
            if mask == ALL and codec == "raw":
                pieces: list[Any] = [block.blob]  # the store's own buffer: no copy
                code = BLOCK
            else:
                pieces, code = _parts(block, mask, codec), PARTS
                self.counters["bulk_parts_frames"] += 1
            n = sum(len(p) for p in pieces)
            stream.send(FRAME.pack(code, n))
            for piece in pieces:
                self.pacer.send(stream, piece)
            self.counters["bulk_bytes_sent"] += FRAME.size + n
            self.counters["bytes_served"] += n

    def _publish(self, stream: Stream, body: bytes) -> None:
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

    def _answer_refused(self, stream: Stream, code: int, payload: bytes) -> None:
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
    if not private_dir(folder):
        raise PermissionError(f"{folder} is not a private directory of this user")
    _remove_dead_sockets(folder)
    if os.path.exists(path):
        if not _refuses(path):  # (one that answers, or is too busy to: a live node's)
            raise FileExistsError(f"a live node listens at {path}")
        os.unlink(path)  # nobody listens: a dead node's
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


def _refuses(path: str) -> bool:
    """Nobody listens at the Unix socket ``path`` (the connect is refused). A full
    backlog (a live node, busy or stopped) answers at once too, without waiting."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _remove_dead_sockets(folder: str) -> None:
    """Unlink each ``bulk-*.sock`` in ``folder`` older than ``STALE_SOCKET_S`` that
    refuses connections: a node killed without its ``finally`` leaves its file, and
    a restart has another node id, so nothing would ever replace it."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if not (entry.name.startswith("bulk-") and entry.name.endswith(".sock")):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                old = stat.S_ISSOCK(st.st_mode) and now - st.st_mtime > STALE_SOCKET_S
                if old and _refuses(entry.path):
                    os.unlink(entry.path)


def _sent_nothing(sock: socket.socket, deadline: float) -> bool:
    """The client closed before its first byte: a probe of whether this node is alive,
    not a request to refuse. Anything else (bytes, silence, an error) is left to the
    stream's own reads."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return False


def _codec(asked: Any) -> str:
    """The first codec of a fetch's ``codecs`` this node can encode ("raw": none)."""
    if len(asked) > MAX_CODECS:
        raise MalformedPayload("a fetch names too many codecs")
    have = squeeze.available_codecs()
    return next((c for c in asked if c in have), "raw")


def _parts(block: Block, mask: int, codec: str) -> list[Any]:
    """A PARTS frame of ``block``'s parts in ``mask``, each in ``codec`` where that
    saves bytes (else raw)."""
    if codec == "raw":
        return parts_frame(block, mask)

    def encode(raw: memoryview, itemsize: int) -> tuple[int, Any]:
        used, wire = squeeze.encode_or_raw(codec, raw, itemsize)
        return squeeze.codec_id(used), wire

    return parts_frame(block, mask, encode)


def _parse(message: Any, body: bytes) -> Any:
    try:
        return message.FromString(body)
    except Exception:  # DecodeError and friends
        raise MalformedPayload("bulk request body does not parse") from None
