"""The bulk data path: block bytes on a plain TCP (or TLS) stream beside gRPC.

gRPC stays the control plane (lookup, membership, and Fetch / Publish with peers
that advertise no data port). Here block bytes move without a Python object per
chunk: a sender writes each stored blob with one ``sendall`` from its own buffer;
a receiver ``recv_into``\\ s a buffer preallocated at the size announced (checked
against the card's cap *before* it is allocated), and a hasher thread verifies
each finished block while the next one arrives.

Wire (integers little-endian)::

    request  b"KVX1" | u8 op | u32 body_len | u16 cred_len | body | credential
             FETCH:   body is a FetchRequest; the reply is one frame per block
             PUBLISH: body is a BulkPublish (the card, every block's size and
                      digest); the blocks' bytes follow it back to back
    frame    u8 code | u64 n | n bytes
             BLOCK: one block's bytes   ERROR: "reason: detail" (UTF-8)
             DONE:  a PublishResponse

The credential is the ``x-kvmesh-auth`` value (see :mod:`.security`) for
``/kvmesh.v1.Bulk/Fetch`` or ``/kvmesh.v1.Bulk/Publish`` bound to the body; for a
publish that body names every block's digest, so no block can be swapped in. It
is empty without a fleet key. Under TLS the stream is wrapped with the node's own
certificates (client certificates required when the server has a CA).

Every wait is bounded: the progress timeout for each read or write, and the
caller's total deadline. A server runs at most ``max_conns`` streams (one more is
answered ``busy``), reserves publish bytes against the cache service's in-flight
cap before allocating them, and counts every refusal as ``bulk_rejected:<reason>``;
a client turns every failure into a typed error. Neither side trusts the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from ..codec import Block, Layout, decode_block
from ..errors import (
    ChecksumMismatch,
    KVMeshError,
    LeaseExpired,
    MalformedPayload,
    OversizePayload,
    PeerTimeout,
    PeerUnavailable,
    StaleEpoch,
    StoreFull,
    Unauthenticated,
)
from .proto import kvmesh_pb2 as pb
from .security import AUTH_HEADER, CallRefused, FleetAuth, TLSConfig, body_digest

if TYPE_CHECKING:
    from .server import CacheService

log = logging.getLogger("kvmesh.bulk")

MAGIC = b"KVX1"
REQUEST = struct.Struct("<4sBIH")
FRAME = struct.Struct("<BQ")
FETCH, PUBLISH = 1, 2
BLOCK, ERROR, DONE = 0, 1, 2
METHODS = {FETCH: "/kvmesh.v1.Bulk/Fetch", PUBLISH: "/kvmesh.v1.Bulk/Publish"}
MAX_BODY = 4 << 20  # 65,536 keys of a fetch fit; a card plus 65,536 block infos too
MAX_CRED = 1024
MAX_REASON = 512
MAX_PUBLISH_BLOCKS = 65536
MAX_CONNS = 32
PROGRESS_S = 10.0
DRAIN_S = 1.0  # after refusing a publish, read (and drop) for this long so the answer lands


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


def receive_buffer(n: int) -> bytearray:
    """A bytearray of ``n`` bytes left uninitialized (``bytearray(n)`` zero-fills it:
    a whole extra pass over memory the socket overwrites anyway). Only for buffers
    filled in full before anyone reads them; a short read discards the buffer."""
    return _new_bytearray(None, n)  # type: ignore[no-any-return]


class FetchStalled(PeerTimeout):
    """No bytes arrived for the progress timeout: the peer is alive but silent."""

    reason = "stalled"


_ERRORS: dict[str, type[KVMeshError]] = {
    "stale_epoch": StaleEpoch,
    "lease_expired": LeaseExpired,
    "unauthenticated": Unauthenticated,
    "oversize_payload": OversizePayload,
    "malformed_payload": MalformedPayload,
    "checksum_mismatch": ChecksumMismatch,
    "store_full": StoreFull,
    "timeout": PeerTimeout,
}


def _typed(text: str) -> KVMeshError:
    """A peer's ERROR frame as the typed error it names (else peer_unreachable)."""
    reason = text.split(":", 1)[0]
    return _ERRORS.get(reason, PeerUnavailable)(f"peer refused: {text}")


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
            raise _typed(self.recv(n).decode("utf-8", "replace"))
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


class Dialer:
    """How a client opens bulk streams: plain TCP, or TLS with the node's certificates
    (the context is built once: loading certificates per stream would cost ms)."""

    def __init__(self, tls: TLSConfig | None) -> None:
        enabled = tls is not None and tls.enabled
        self.ssl = tls.client_ssl_context() if tls is not None and enabled else None
        self.server_name = tls.server_name if tls is not None else None


def _connect(address: str, dialer: Dialer, progress_s: float, cancel: Cancel) -> socket.socket:
    host, port = _split(address)
    try:
        sock = socket.create_connection((host, port), timeout=progress_s)
    except OSError as e:
        raise PeerUnavailable(f"bulk connect to {address}: {e}") from None
    _tune(sock)
    if dialer.ssl is not None:
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
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)


def _request(op: int, body: bytes, cred: str) -> bytes:
    raw = cred.encode()
    return REQUEST.pack(MAGIC, op, len(body), len(raw)) + body + raw


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
    deadline: float,
    cancel: Cancel,
) -> list[Block]:
    """Fetch ``infos``' blocks (``request`` is their serialized FetchRequest): each
    received into a buffer of its announced size (already capped by the caller),
    verified on ``hashers`` (alternating) while the next arrives. Blocking; raises
    a typed error."""
    sock = _connect(address, dialer, progress_s, cancel)
    stream = _Stream(sock, progress_s, deadline)
    pending: list[Future[Block]] = []
    try:
        try:
            stream.send(_request(FETCH, request, cred))
            for j, info in enumerate(infos):
                _, n = stream.read_frame(info.nbytes)
                if n != info.nbytes:
                    raise MalformedPayload(f"block {j} is {n} bytes, its lookup said {info.nbytes}")
                buf = receive_buffer(n)
                stream.recv_into(memoryview(buf))
                pending.append(
                    hashers[j % len(hashers)].submit(_verify, buf, layout, info, on_block)
                )
        except KVMeshError as e:  # a block already received and found bad says more
            wait(pending)
            bad = next((f.exception() for f in pending if f.exception() is not None), None)
            raise (bad or e) from None
        return [f.result() for f in pending]
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
    deadline: float,
    cancel: Cancel,
) -> pb.PublishResponse:
    """Send ``blocks`` (announced by ``body``, a BulkPublish) from their own buffers;
    the receiver's answer. Blocking; raises a typed error when there is none."""
    sock = _connect(address, dialer, progress_s, cancel)
    stream = _Stream(sock, progress_s, deadline)
    try:
        try:
            stream.send(_request(PUBLISH, body, cred))
            for blk in blocks:
                stream.send(blk.blob)
        except PeerUnavailable:
            pass  # the receiver may have refused midway: its answer is still there to read
        _, n = stream.read_frame(64 << 10)
        return pb.PublishResponse.FromString(stream.recv(n))
    finally:
        sock.close()


# -- server ----------------------------------------------------------------------


class BulkServer:
    """The bulk path of one cache node: a listening socket, one thread accepting and
    one thread per stream (at most ``max_conns``)."""

    def __init__(
        self,
        cache: CacheService,
        auth: FleetAuth | None = None,
        tls: TLSConfig | None = None,
        max_conns: int = MAX_CONNS,
        progress_s: float = PROGRESS_S,
    ) -> None:
        self.cache = cache
        self.auth = auth
        self.tls = tls if tls is not None and tls.enabled else None
        self.max_conns = max_conns
        self.progress_s = progress_s
        self.port = 0
        self._ssl = self.tls.server_ssl_context() if self.tls else None
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._verify = ThreadPoolExecutor(2, thread_name_prefix="kvmesh-bulk-verify")
        self._acceptor: threading.Thread | None = None

    @property
    def counters(self) -> Any:
        return self.cache.counters

    def start(self, host: str, port: int = 0) -> int:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]") or "0.0.0.0", port))
        sock.listen(64)
        sock.settimeout(0.25)  # the accept loop checks for stop this often
        self._sock, self.port = sock, sock.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="kvmesh-bulk", daemon=True)
        self._acceptor.start()
        return self.port

    def stop(self) -> None:
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(2)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._verify.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                busy = len(self._conns) >= self.max_conns
                if not busy:
                    self._conns.add(conn)
            if busy:
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        self.counters["bulk_rejected:busy"] += 1
        with contextlib.suppress(OSError):
            if self._ssl is None:  # (under TLS a refusal would need a handshake first)
                conn.settimeout(0.5)
                conn.sendall(FRAME.pack(ERROR, 4) + b"busy")
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        sock = conn
        try:
            _tune(conn)
            if self._ssl is not None:
                conn.settimeout(self.progress_s)
                sock = self._ssl.wrap_socket(conn, server_side=True)
            stream = _Stream(sock, self.progress_s, time.monotonic() + 3600)
            self._handle(stream)
        except (ssl.SSLError, OSError) as e:
            self.counters["bulk_rejected:connection"] += 1
            log.debug("bulk stream failed: %s", e)
        except Exception:  # a bug here must not take the acceptor or the node down
            log.exception("bulk stream failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()

    def _handle(self, stream: _Stream) -> None:
        try:
            op, body = self._admit(stream)
            if op == FETCH:
                self._fetch(stream, body)
            else:
                self._publish(stream, body)
        except KVMeshError as e:
            self.counters[f"bulk_rejected:{e.reason}"] += 1
            with contextlib.suppress(KVMeshError):  # the peer may be gone already
                stream.frame(ERROR, f"{e.reason}: {e}"[:MAX_REASON].encode())

    def _admit(self, stream: _Stream) -> tuple[int, bytes]:
        """The request's op and body, once its prefix, sizes and credential check out."""
        magic, op, body_len, cred_len = REQUEST.unpack(stream.recv(REQUEST.size))
        if magic != MAGIC or op not in METHODS:
            raise MalformedPayload("not a kvmesh bulk request")
        if body_len > MAX_BODY or cred_len > MAX_CRED:
            raise OversizePayload("bulk request header too large")
        body = stream.recv(body_len)
        cred = stream.recv(cred_len).decode("ascii", "replace")
        if self.auth is not None:
            try:
                self.auth.verify_call(METHODS[op], ((AUTH_HEADER, cred),), body_digest(body))
            except CallRefused as e:
                self.counters["unauthenticated"] += 1
                self.counters[f"unauthenticated:{e.why}"] += 1
                raise
        return op, body

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
            self._answer_refused(stream, resp)
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

    def _answer_refused(self, stream: _Stream, resp: pb.PublishResponse) -> None:
        """Answer, then read (and drop) what the publisher is still sending for a
        moment, so that closing does not reset the connection before it reads."""
        with contextlib.suppress(KVMeshError):
            stream.frame(DONE, resp.SerializeToString())
        sock, sink = stream.sock, bytearray(1 << 20)
        end = time.monotonic() + DRAIN_S
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
            while (left := end - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv_into(sink):
                    break


def _parse(message: Any, body: bytes) -> Any:
    try:
        return message.FromString(body)
    except Exception:  # DecodeError and friends
        raise MalformedPayload("bulk request body does not parse") from None
