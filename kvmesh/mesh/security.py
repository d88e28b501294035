"""Transport security: TLS / mutual TLS credentials and the fleet pre-shared key.

The fleet key never travels. From it we derive two subkeys: one keys the block
hashes (HMAC-SHA256, see :mod:`kvmesh.blocks`), the other authenticates calls and
capability cards. A call carries ``x-kvmesh-auth: node.ts.nonce.mac`` where
``mac = HMAC(auth_key, method|node|ts|nonce)``; the server rejects stale
timestamps and replayed nonces. Each card carries an HMAC over its own bytes, so
a card relayed by gossip is still verifiable end to end.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..errors import ConfigError, Unauthenticated

AUTH_HEADER = "x-kvmesh-auth"
MAX_SKEW_S = 120.0


def load_fleet_key(path: str | Path) -> bytes:
    raw = Path(path).read_bytes().strip()
    if len(raw) < 16:
        raise ConfigError(f"fleet key in {path} is shorter than 16 bytes")
    return raw


class FleetAuth:
    def __init__(self, fleet_key: bytes, node_id: str, clock=time.time) -> None:  # type: ignore[no-untyped-def]
        self._auth_key = hmac.new(fleet_key, b"kvmesh/v1/auth", hashlib.sha256).digest()
        self.node_id = node_id
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self.rejected = 0

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._auth_key, b"|".join(parts), hashlib.sha256).digest()

    def call_metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        ts = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(12)
        mac = self._mac(method.encode(), self.node_id.encode(), ts.encode(), nonce.encode())
        return ((AUTH_HEADER, f"{self.node_id}.{ts}.{nonce}.{mac.hex()}"),)

    def verify_call(self, method: str, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
        """Return the caller's node id, or raise :class:`Unauthenticated`."""
        value = next((v for k, v in metadata or () if k == AUTH_HEADER), None)
        try:
            if not isinstance(value, str):
                raise Unauthenticated("missing fleet credential")
            node, ts, nonce, mac_hex = value.rsplit(".", 3)
            expected = self._mac(method.encode(), node.encode(), ts.encode(), nonce.encode())
            if not hmac.compare_digest(bytes.fromhex(mac_hex), expected):
                raise Unauthenticated("bad fleet credential")
            now = self._clock()
            if abs(now - int(ts) / 1000) > MAX_SKEW_S:
                raise Unauthenticated("stale fleet credential")
            with self._lock:
                if nonce in self._seen:
                    raise Unauthenticated("replayed fleet credential")
                self._seen[nonce] = now
                while self._seen and next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S:
                    self._seen.popitem(last=False)
            return node
        except Unauthenticated:
            self.rejected += 1
            raise
        except ValueError:
            self.rejected += 1
            raise Unauthenticated("malformed credential") from None

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
