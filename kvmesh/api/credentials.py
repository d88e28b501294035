"""What a client presented on an HTTP request, and whose cache it may use.

- :func:`presented_key`: the credential a client presented (no checking here: see
  :class:`kvmesh.api.network.APIKeys`). A leaf module, so the OpenAI routes and the
  network routes both read keys the same way without importing each other.
- :func:`read_key_file`: the ``--api-key-file`` format, one ``KEY [TENANT]`` per
  line (blank lines and ``#`` comments skipped). A bad file is a
  :class:`KeyFileError` naming the line, at start-up, never later.
- :class:`Tenants`: a request's tenant from what the server authenticated — its
  valid key's tenant (a key without one is its own tenant), or with
  ``--tenant-header`` a trusted gateway's header — never from the body. With
  neither, it is the default tenant: the one shared cache, as before tenants.
  Its chain root is derived here (:func:`kvmesh.blocks.tenant_root` under the
  fleet key or a per-head secret), so no client can name its way into another
  tenant's cache; ``cache_salt`` only separates further within a tenant.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from ..blocks import chain_root, check_cache_salt, tenant_root

MAX_TENANT_CHARS = 128
MAX_KEY_CHARS = 4096
MAX_KEY_FILE_BYTES = 16 << 20
SECRET_BYTES = 32


class KeyFileError(ValueError):
    """An ``--api-key-file`` (or tenant option) the head refuses to start with."""


class BadTenant(ValueError):
    """A trusted tenant header whose value is not a tenant name (a 400)."""


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client presented: ``X-API-Key``, else ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def check_tenant_name(name: str) -> str:
    """``name`` if it is a tenant name: 1 to ``MAX_TENANT_CHARS`` printable ASCII
    characters without spaces, not starting with ``#`` (it labels metrics and
    must survive a header); else ValueError."""
    if not 0 < len(name) <= MAX_TENANT_CHARS:
        raise ValueError(f"a tenant name has 1 to {MAX_TENANT_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in name):
        raise ValueError("a tenant name is printable ASCII without spaces")
    if name.startswith("#"):  # in a key file that reads as a comment: refuse the doubt
        raise ValueError("a tenant name does not start with #")
    return name


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str | Path) -> list[tuple[str, str | None]]:
    """``(key, tenant or None)`` for each key line of ``path``."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"{path}: larger than {MAX_KEY_FILE_BYTES} bytes")
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read it ({e.strerror})") from None
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise KeyFileError(f"{path}:{n}: expected KEY [TENANT], got {len(fields)} fields")
        key = fields[0]
        if len(key) > MAX_KEY_CHARS or not key.isprintable() or not key.isascii():
            raise KeyFileError(f"{path}:{n}: a key is printable ASCII, at most {MAX_KEY_CHARS}")
        tenant = fields[1] if len(fields) == 2 else None
        if tenant is not None:
            try:
                check_tenant_name(tenant)
            except ValueError as e:
                raise KeyFileError(f"{path}:{n}: {e}") from None
        if any(k == key for k, _ in out):
            raise KeyFileError(f"{path}:{n}: a key listed twice")
        out.append((key, tenant))
    return out


def head_secret(path: str | Path | None) -> bytes:
    """The per-head secret tenant roots are derived under when there is no fleet
    key: read from ``path`` (made, mode 0600, when missing) so tenants' caches
    survive a restart; without a path, a fresh one for this process."""
    if path is None:
        return secrets.token_bytes(SECRET_BYTES)
    p = Path(path)
    try:
        if not p.exists():
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    except OSError as e:
        raise KeyFileError(f"{path}: cannot make a tenant secret ({e.strerror})") from None
    try:
        secret = bytes.fromhex(p.read_text().strip())
    except (ValueError, OSError) as e:
        raise KeyFileError(f"{path}: not a hex tenant secret ({e})") from None
    if len(secret) < 16:
        raise KeyFileError(f"{path}: a tenant secret has at least 16 bytes")
    return secret


class Tenants:
    """Resolves a request's tenant and chain root. ``keys``: key -> tenant (None:
    the key is its own tenant); ``secret``: what tenant roots are derived under;
    ``header``: the trusted gateway header (lower case), if any; ``shared``:
    tenants whose cache is deliberately the shared one."""

    def __init__(
        self,
        namespace: bytes,
        secret: bytes,
        keys: Mapping[str, str | None] | None = None,
        header: str | None = None,
        shared: frozenset[str] = frozenset(),
    ) -> None:
        self.namespace = namespace
        self._secret = secret
        self._by_digest = {
            key_digest(k): t if t is not None else "key-" + key_digest(k).hex()[:12]
            for k, t in (keys or {}).items()
        }
        self.header = header.lower() if header else None
        self.shared = shared
        self._roots: dict[str, bytes] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest) or self.header is not None

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """The request's tenant (None: the default tenant). The gateway's header
        wins when configured and present; else a valid key's tenant."""
        if self.header is not None:
            value = headers.get(self.header)
            if value is not None:
                try:
                    return check_tenant_name(value)
                except ValueError as e:
                    raise BadTenant(f"header {self.header}: {e}") from None
        key = presented_key(headers)
        return self._by_digest.get(key_digest(key)) if key else None

    def root(self, tenant: str | None, cache_salt: str | None = None) -> bytes | None:
        """The chain root of ``tenant``'s requests with ``cache_salt`` (None: the
        namespace). Raises ValueError on a bad salt."""
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        if tenant is None or tenant in self.shared:
            return None if cache_salt is None else chain_root(self.namespace, None, cache_salt)
        troot = self._roots.get(tenant)
        if troot is None:
            troot = tenant_root(self._secret, tenant)
            if len(self._roots) < 1 << 16:  # header tenants are unbounded: cache a few
                self._roots[tenant] = troot
        return chain_root(self.namespace, troot, cache_salt)


__all__ = [
    "BadTenant",
    "KeyFileError",
    "Tenants",
    "check_tenant_name",
    "head_secret",
    "presented_key",
    "read_key_file",
]
