"""Transport security: TLS / mutual TLS credentials and the fleet pre-shared key.

The fleet key never travels. From it we derive two subkeys: one keys the block
hashes (HMAC-SHA256, see :mod:`kvmesh.blocks`), the other authenticates calls and
capability cards. Each card carries an HMAC over its own bytes, so a card
relayed by gossip is still verifiable end to end.

A call carries ``x-kvmesh-auth: NODE.DEST.TS.NONCE.MAC`` (``DEST`` hex-encoded),
where ``MAC = HMAC(auth_key, method, node, dest, ts, nonce, body)`` over
length-prefixed fields and ``body`` is the SHA-256 of the serialized request (for
the streaming ``Publish``, of its first message: see :func:`body_digest`). A
server accepts a credential only when

- its MAC matches the request it came with (so a credential moved onto another
  body, or another method, is refused),
- ``dest`` is the server's own node id (so a credential captured on its way to
  one peer is refused by every other), except the wildcard ``*``, accepted only
  for an empty ``Exchange``: how a node first learns a seed's id,
- its timestamp is within ``MAX_SKEW_S`` of the server's clock, and
- its nonce was not seen before. The nonce cache holds at most ``max_nonces``
  entries; when full it forgets the oldest and refuses every credential not newer
  than what it forgot, so a forgotten nonce can never be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..errors import ConfigError, Unauthenticated

AUTH_HEADER = "x-kvmesh-auth"
MAX_SKEW_S = 120.0
MAX_NONCES = 1 << 18  # ~2,000 calls/s for the whole skew window; ~40 MiB at most
ANY_DEST = "*"
EXCHANGE = "/kvmesh.v1.Membership/Exchange"
EMPTY_BODY = hashlib.sha256(b"").digest()


def body_digest(raw: bytes) -> bytes:
    """What a credential binds of a request: SHA-256 of its serialized bytes. For
    the streaming ``Publish`` that is its first message (the card, the first
    block's size and digest and its first chunk); later blocks are each checked
    against the digest announced in their own first chunk, which only TLS
    protects from an on-path attacker."""
    return hashlib.sha256(raw).digest()


class CallRefused(Unauthenticated):
    """A call credential refused; ``why`` is the short name counted for it."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why


def load_fleet_key(path: str | Path) -> bytes:
    raw = Path(path).read_bytes().strip()
    if len(raw) < 16:
        raise ConfigError(f"fleet key in {path} is shorter than 16 bytes")
    return raw


class NonceCache:
    """Nonces seen within the skew window, bounded. Forgetting a nonce raises a
    floor: credentials at or below the floor's timestamp are refused outright."""

    def __init__(self, max_entries: int = MAX_NONCES) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> its credential's ts (ms)
        self.floor_ms = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, ts_ms: int, now_ms: int) -> None:
        """Record ``nonce``, or raise :class:`CallRefused` if it was seen (or could be)."""
        with self._lock:
            if ts_ms <= self.floor_ms:
                raise CallRefused("replay_window_full", "credential older than the replay window")
            if nonce in self._seen:
                raise CallRefused("replayed", "replayed fleet credential")
            self._seen[nonce] = ts_ms
            oldest = now_ms - int(MAX_SKEW_S * 1000)
            # entries stale by the clock can go: a replay of one is refused as stale
            while self._seen and next(iter(self._seen.values())) < oldest:
                self._seen.popitem(last=False)
            while len(self._seen) > self.max_entries:
                _, ts = self._seen.popitem(last=False)
                self.floor_ms = max(self.floor_ms, ts)


class FleetAuth:
    def __init__(
        self,
        fleet_key: bytes,
        node_id: str,
        clock: Callable[[], float] = time.time,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self._auth_key = hmac.new(fleet_key, b"kvmesh/v1/auth", hashlib.sha256).digest()
        self.node_id = node_id
        self._clock = clock
        self.nonces = NonceCache(max_nonces)
        self.rejected = 0
        self.refusals: Counter[str] = Counter()  # why -> count

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._auth_key, b"|".join(parts), hashlib.sha256).digest()

    def _call_mac(self, *parts: bytes) -> bytes:
        # length-prefixed: no field can be shifted into its neighbour
        msg = b"".join(len(p).to_bytes(4, "big") + p for p in (b"call/v2", *parts))
        return hmac.new(self._auth_key, msg, hashlib.sha256).digest()

    def call_metadata(
        self, method: str, dest: str = ANY_DEST, body: bytes = EMPTY_BODY
    ) -> tuple[tuple[str, str], ...]:
        """The credential of one call to node ``dest`` whose request digests to
        ``body`` (see :func:`body_digest`); single use."""
        ts = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(12)
        mac = self._call_mac(
            method.encode(), self.node_id.encode(), dest.encode(), ts.encode(), nonce.encode(), body
        )
        value = f"{self.node_id}.{dest.encode().hex()}.{ts}.{nonce}.{mac.hex()}"
        return ((AUTH_HEADER, value),)

    def verify_call(
        self,
        method: str,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        body: bytes = EMPTY_BODY,
    ) -> str:
        """The caller's node id, or raise :class:`CallRefused` (counted by ``why``)."""
        try:
            return self._verify(method, metadata, body)
        except CallRefused as e:
            self.rejected += 1
            self.refusals[e.why] += 1
            raise

    def _verify(
        self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None, body: bytes
    ) -> str:
        value = next((v for k, v in metadata or () if k == AUTH_HEADER), None)
        if not isinstance(value, str):
            raise CallRefused("missing", "missing fleet credential")
        try:
            node, dest_hex, ts, nonce, mac_hex = value.rsplit(".", 4)
            dest, ts_ms, mac = bytes.fromhex(dest_hex).decode(), int(ts), bytes.fromhex(mac_hex)
        except (ValueError, UnicodeDecodeError):
            raise CallRefused("malformed", "malformed credential") from None
        expected = self._call_mac(
            method.encode(), node.encode(), dest.encode(), ts.encode(), nonce.encode(), body
        )
        if not hmac.compare_digest(mac, expected):
            raise CallRefused("bad_mac", "bad fleet credential (another key, method or request)")
        if dest != self.node_id and not (
            dest == ANY_DEST and method == EXCHANGE and body == EMPTY_BODY
        ):
            raise CallRefused("wrong_destination", "credential made for another node")
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - ts_ms) > MAX_SKEW_S * 1000:
            raise CallRefused("stale", "stale fleet credential")
        self.nonces.admit(nonce, ts_ms, now_ms)
        return node

    def sign_card(self, payload: bytes) -> bytes:
        return self._mac(b"card", payload)

    def verify_card(self, payload: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.sign_card(payload), mac)


@dataclass(frozen=True)
class TLSConfig:
    """Certificate files. ``ca`` set on a server means mutual TLS (client certs required)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_name: str | None = None  # override the name checked in the server certificate

    @classmethod
    def from_options(cls, opts: Mapping[str, object]) -> TLSConfig:
        """From the ``tls_cert``, ``tls_key``, ``tls_ca``, ``tls_server_name`` flags."""

        def path(name: str) -> Path | None:
            v = opts.get(name)
            return Path(str(v)) if v else None

        name = opts.get("tls_server_name")
        return cls(path("tls_cert"), path("tls_key"), path("tls_ca"), str(name) if name else None)

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ConfigError("TLS on a server needs --tls-cert and --tls-key")
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        if self.ca:
            return grpc.ssl_server_credentials(
                pair, root_certificates=Path(self.ca).read_bytes(), require_client_auth=True
            )
        return grpc.ssl_server_credentials(pair)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same certificates for the bulk data path's listener (mutual with ``ca``)."""
        if not (self.cert and self.key):
            raise ConfigError("TLS on a server needs --tls-cert and --tls-key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_ssl_context(self) -> ssl.SSLContext:
        """The bulk data path's client side: the server checked against ``ca`` (else the
        system roots, as gRPC does) and our certificate shown when we have one."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


@dataclass(frozen=True)
class Security:
    tls: TLSConfig = TLSConfig()
    fleet_key: bytes | None = None

    def auth(self, node_id: str) -> FleetAuth | None:
        return FleetAuth(self.fleet_key, node_id) if self.fleet_key else None

    @property
    def block_hash_key(self) -> bytes | None:
        if not self.fleet_key:
            return None
        return hmac.new(self.fleet_key, b"kvmesh/v1/block-keys", hashlib.sha256).digest()


def open_channel(
    address: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A gRPC channel to ``address``: TLS when ``tls`` is enabled, else plaintext."""
    opts = list(options or [])
    if tls is not None and tls.enabled:
        if tls.server_name:
            opts.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)
