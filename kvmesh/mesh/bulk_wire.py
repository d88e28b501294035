"""The bulk data path's wire: block bytes on a plain TCP (or TLS) stream beside gRPC.

gRPC stays the control plane (lookup, membership, and Fetch / Publish with peers
that advertise no data port). Here block bytes move without a Python object per
chunk: a sender writes each stored blob from its own buffer; a receiver
``recv_into``\\ s a buffer preallocated at the size announced (checked against the
card's cap *before* it is allocated). :mod:`.bulk_client` and :mod:`.bulk_server`
are its two ends; this module is what both speak.

Version 2 (integers little-endian)::

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
             PARTS: some of one block's parts (a fetch naming keep_from or
                    codecs; kvmesh.codec.parts_frame)

The credential is the ``x-kvmesh-auth`` value (see :mod:`.security`) for
``/kvmesh.v1.Bulk/Fetch`` or ``/kvmesh.v1.Bulk/Publish`` bound to the body's
SHA-256; for a publish that body names every block's digest, so no block can be
swapped in. It is empty without a fleet key; one that cannot fit the hello is a
configuration error found when a node is set up (:func:`check_credential`). A
version 1 hello (``KVX1``) is refused at once, by name.

Two nodes on one host (the same kernel, mount namespace and user: their cards
carry the same :func:`host_identity`) speak the same protocol over a Unix socket
at :func:`local_socket_path` of the server's node id: derived from the node id on
both sides, never taken from a card, in a directory that must be the user's own
(mode 0700).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

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
from .security import FleetAuth, body_digest

MAGIC = b"KVX2"  # the protocol version: a peer speaking another is refused by name
CRED_SLOT = 1024  # a credential is ~110 bytes plus the node ids
HELLO = struct.Struct(f"<4sBI32sH{CRED_SLOT}s")
FRAME = struct.Struct("<BQ")
FETCH, PUBLISH = 1, 2
BLOCK, ERROR, DONE, PARTS = 0, 1, 2, 3
METHODS = {FETCH: "/kvmesh.v1.Bulk/Fetch", PUBLISH: "/kvmesh.v1.Bulk/Publish"}
MAX_BODY = 4 << 20  # 65,536 keys of a fetch fit; a card plus 65,536 block infos too
MAX_REASON = 512
_SUN_PATH_MAX = 107  # a Unix socket path's bytes (sun_path holds 108 with its NUL)

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

    reason = Reason.STALLED


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


class Stream:
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
        if code not in (BLOCK, DONE, PARTS) or n > max_payload:
            raise MalformedPayload(f"unexpected frame {code} of {n} bytes")
        return code, n


def tune(sock: socket.socket) -> None:
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


def private_dir(folder: str) -> bool:
    """``folder`` is a directory of this user's that no one else may enter."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def local_socket_path(node_id: str) -> str:
    """Where the node ``node_id`` listens for same-host bulk streams: in a
    directory of this user's (mode 0700), named by a digest of the node id, so
    that no card can name the path ("" when it would not fit a socket address)."""
    name = hashlib.sha256(node_id.encode()).hexdigest()[:20]
    path = os.path.join(_socket_dir(), f"bulk-{name}.sock")
    return path if len(path.encode()) <= _SUN_PATH_MAX else ""
