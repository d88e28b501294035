"""Who a request is, decided once from what it presented, and whose cache it uses.

- :class:`Credentials` (one parser for every route): the head's keys by role —
  *tenant* keys (``--api-key-file``, one ``KEY [TENANT]`` per line: completions
  in that tenant's cache, its own cache query), *admin* keys
  (``--admin-key-file``: network writes, pairing, ``/v1/admin/*``, addresses,
  per-tenant metrics) and *gateway* keys (``--gateway-key-file``: the only
  requests whose ``--tenant-header`` is honoured). :meth:`Credentials.identify`
  turns a request's headers into an :class:`Identity` or refuses it with
  :class:`BadCredentials` (two credential headers, a key the head does not know,
  a tenant header not sent by a gateway). A request without a key is anonymous:
  the default tenant, and no token-exact reuse (one address can be many people
  behind a proxy or a NAT) unless the operator says every address is one user.
- :func:`read_key_file`: the key file format (blank lines and ``#`` comments
  skipped). A bad file is a :class:`KeyFileError` naming the line, at start-up.
- :func:`load_credentials`: the one check of a head's key options, asked by the
  command line (before the model loads) and by the app: each file, a key in one
  role only, ``--api-key-scope all`` with a key, ``--tenant-header`` with gateway
  keys. Its :class:`KeyFileError` names the flag at fault.
- :class:`Tenants`: a tenant's chain root, derived (:func:`kvmesh.blocks.tenant_root`)
  under the tenant secret (:func:`head_secret`, a 0600 file kept across restarts),
  never under the fleet key: a node that was handed the fleet key to join cannot
  compute a tenant's root. ``cache_salt`` only separates further within a tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ..blocks import check_cache_salt, request_root, tenant_root
from ..private import PrivateFileError, read_private

MAX_TENANT_CHARS = 128
MAX_KEY_CHARS = 4096
MAX_KEY_FILE_BYTES = 16 << 20
SECRET_BYTES = 32
DEFAULT_TENANT = "(default)"  # the label keyless requests' blocks are counted under
CREDENTIAL_HEADERS = ("x-api-key", "authorization")


class KeyFileError(ValueError):
    """An ``--api-key-file`` (or tenant option) the head refuses to start with;
    ``flag``: the option at fault, where one is."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


class BadTenant(ValueError):
    """A trusted tenant header whose value is not a tenant name (a 400)."""


class BadCredentials(Exception):
    """A request whose credentials are refused: ``status`` 400 (ambiguous) or 401
    (unknown key), with an OpenAI-style ``code``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Role(StrEnum):
    ANONYMOUS = "anonymous"
    TENANT = "tenant"
    ADMIN = "admin"
    GATEWAY = "gateway"


@dataclass(frozen=True)
class Identity:
    """What the head decided a request is. ``tenant``: whose cache (None: the
    default tenant); ``share``: whose fair share of the batch; ``caller``: whose
    token-exact reuse ("": nobody's, whole blocks only)."""

    role: Role
    tenant: str | None = None
    share: str = ""
    caller: str = ""

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN


ANONYMOUS = Identity(Role.ANONYMOUS)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client presented: ``X-API-Key``, else ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _credential(raw: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The one key ``raw`` (an ASGI scope's headers) presents; BadCredentials when
    it presents two (a repeated header, or X-API-Key and a different bearer):
    every reader must see the same key, so none may pick."""
    seen: dict[str, list[str]] = {}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in CREDENTIAL_HEADERS:
            seen.setdefault(name, []).append(v.decode("latin-1"))
    if any(len(v) > 1 for v in seen.values()):
        raise BadCredentials(
            400, "a request carries one credential header", "duplicate_credentials"
        )
    key = presented_key({k: v[0] for k, v in seen.items()})
    if "x-api-key" in seen and "authorization" in seen:
        bearer = presented_key({"authorization": seen["authorization"][0]})
        if bearer is not None and bearer != key:
            raise BadCredentials(
                400, "X-API-Key and Authorization name different keys", "duplicate_credentials"
            )
    return key


def check_tenant_name(name: str) -> str:
    """``name`` if it is a tenant name: 1 to ``MAX_TENANT_CHARS`` printable ASCII
    characters without spaces, not starting with ``#`` (it labels metrics and
    must survive a header) nor ``(`` (kept for the head's own labels); else ValueError."""
    if not 0 < len(name) <= MAX_TENANT_CHARS:
        raise ValueError(f"a tenant name has 1 to {MAX_TENANT_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in name):
        raise ValueError("a tenant name is printable ASCII without spaces")
    if name.startswith("#"):  # in a key file that reads as a comment: refuse the doubt
        raise ValueError("a tenant name does not start with #")
    if name.startswith("("):
        raise ValueError("a tenant name does not start with ( (the head's own labels do)")
    return name


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str | Path, tenants: bool = True) -> list[tuple[str, str | None]]:
    """``(key, tenant or None)`` for each key line of ``path``: ``KEY [TENANT]``,
    or with ``tenants=False`` (admin and gateway keys) a bare ``KEY``."""
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
    most = 2 if tenants else 1
    for n, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > most:
            want = "KEY [TENANT]" if tenants else "KEY"
            raise KeyFileError(f"{path}:{n}: expected {want}, got {len(fields)} fields")
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


def load_credentials(
    api_key_file: str | None = None,
    admin_key_file: str | None = None,
    gateway_key_file: str | None = None,
    *,
    header: str | None = None,
    scope: str = "admin",
    exact_by_address: bool = False,
) -> Credentials:
    """A head's :class:`Credentials` from its key files (``--api-key-file``:
    tenant keys; admin and gateway keys bare), with every rule of its key options
    checked once: a :class:`KeyFileError` naming the flag at fault."""
    roles: list[dict[str, str | None]] = []
    seen: dict[str, str] = {}
    files = ("--api-key-file", api_key_file), ("--admin-key-file", admin_key_file)
    for flag, path in (*files, ("--gateway-key-file", gateway_key_file)):
        try:
            keys = dict(read_key_file(path, tenants=flag == "--api-key-file")) if path else {}
        except KeyFileError as e:
            raise KeyFileError(str(e), flag) from None
        for k in keys:
            if k in seen:
                raise KeyFileError(f"a key has one role: a key of {seen[k]} is here too", flag)
            seen[k] = flag
        roles.append(keys)
    tenants, admins, gateways = roles
    credentials = Credentials(tenants, admins, gateways, header, exact_by_address)
    if scope == "all" and not credentials.any:
        raise KeyFileError("--api-key-scope all needs --api-key-file", "--api-key-scope")
    return credentials


def default_secret_file() -> Path:
    """Where a head keeps its tenant secret without ``--tenant-secret-file``."""
    home = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))
    return home / "tenant-secret"


def head_secret(path: str | Path | None) -> bytes:
    """The secret tenant roots are derived under: read from ``path`` (default
    :func:`default_secret_file`; made, mode 0600, when missing) so tenants' caches
    survive a restart. A file others may read or write is refused."""
    p = Path(path) if path is not None else default_secret_file()
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not p.exists():
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    except OSError as e:
        raise KeyFileError(f"{p}: cannot make a tenant secret ({e.strerror})") from None
    try:
        secret = bytes.fromhex(read_private(p).strip())  # this user's alone, or refused
    except PrivateFileError as e:
        raise KeyFileError(f"tenant secret {e}") from None
    except ValueError as e:
        raise KeyFileError(f"{p}: not a hex tenant secret ({e})") from None
    if len(secret) < 16:
        raise KeyFileError(f"{p}: a tenant secret has at least 16 bytes")
    return secret


class _KeySet:
    """Keys by SHA-256 digest, compared in constant time in the match position."""

    def __init__(self, keys: Mapping[str, str | None]) -> None:
        self._rows = [(key_digest(k), t) for k, t in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._rows)

    def find(self, key: str) -> tuple[bytes, str | None] | None:
        h = key_digest(key)
        found = None
        for digest, tenant in self._rows:  # no early exit
            if hmac.compare_digest(h, digest):
                found = (digest, tenant)
        return found


class Credentials:
    """The head's keys by role and its rules for who a request is (see the module
    docstring). ``header``: the gateway's tenant header (needs gateway keys);
    ``exact_by_address``: an anonymous caller's own exact tails are its address's
    (only where every address is one user: no proxy, no NAT)."""

    def __init__(
        self,
        tenant_keys: Mapping[str, str | None] | None = None,
        admin_keys: Iterable[str] = (),
        gateway_keys: Iterable[str] = (),
        header: str | None = None,
        exact_by_address: bool = False,
    ) -> None:
        self._tenants = _KeySet(tenant_keys or {})
        self._admins = _KeySet(dict.fromkeys(admin_keys))
        self._gateways = _KeySet(dict.fromkeys(gateway_keys))
        self.header = header.lower() if header else None
        if self.header is not None and not self._gateways:
            raise KeyFileError(
                "--tenant-header is honoured only from a gateway that proves it: "
                "give --gateway-key-file",
                "--tenant-header",
            )
        self.exact_by_address = exact_by_address

    @property
    def any(self) -> bool:
        """Whether the head has keys at all (else every request is anonymous)."""
        return bool(self._tenants or self._admins or self._gateways)

    @property
    def tenants_enabled(self) -> bool:
        return bool(self._tenants) or self.header is not None

    def identify(self, raw: Sequence[tuple[bytes, bytes]], host: str | None) -> Identity:
        """Who the request with ASGI headers ``raw`` from ``host`` is; BadCredentials
        when its credentials are ambiguous, unknown or not its to present."""
        if not self.any:  # a head without keys: every key is an SDK's dummy
            return self._anonymous(host)
        key = _credential(raw)
        tenant_header = self._tenant_header(raw)
        if key is None:
            if tenant_header is not None:
                raise BadCredentials(
                    401, "a tenant header needs the gateway's key", "invalid_api_key"
                )
            return self._anonymous(host)
        found = self._tenants.find(key)
        if found is not None:
            if tenant_header is not None:
                raise BadCredentials(
                    400, "a tenant key does not name a tenant header", "untrusted_tenant_header"
                )
            digest, tenant = found
            who = "key:" + digest.hex()[:16]
            return Identity(Role.TENANT, tenant or "key-" + digest.hex()[:12], who, who)
        found = self._admins.find(key)
        if found is not None:
            if tenant_header is not None:
                raise BadCredentials(
                    400, "an admin key does not name a tenant header", "untrusted_tenant_header"
                )
            who = "key:" + found[0].hex()[:16]
            return Identity(Role.ADMIN, None, who, who)
        found = self._gateways.find(key)
        if found is not None:
            return self._through_gateway(tenant_header)
        raise BadCredentials(401, "the API key is not one this head knows", "invalid_api_key")

    def _anonymous(self, host: str | None) -> Identity:
        """A request without a key: its address's fair share; token-exact reuse of
        its own only when the operator said every address is one user."""
        addr = f"host:{host or '?'}"
        return Identity(Role.ANONYMOUS, None, addr, addr if self.exact_by_address else "")

    def _tenant_header(self, raw: Sequence[tuple[bytes, bytes]]) -> str | None:
        if self.header is None:
            return None
        values = [v.decode("latin-1") for k, v in raw if k.decode("latin-1").lower() == self.header]
        if len(values) > 1:
            raise BadCredentials(400, f"header {self.header} given twice", "duplicate_credentials")
        return values[0] if values else None

    def _through_gateway(self, tenant: str | None) -> Identity:
        """A gateway's request: its header names the tenant (none: the default
        tenant). Its users are many behind one key: no token-exact reuse."""
        if tenant is None:
            return Identity(Role.GATEWAY, None, "gateway:", "")
        try:
            check_tenant_name(tenant)
        except ValueError as e:
            raise BadCredentials(
                400, f"header {self.header}: {e}", "invalid_tenant", self.header
            ) from None
        return Identity(Role.GATEWAY, tenant, "gateway:" + tenant, "")


class Tenants:
    """A tenant's chain root. ``secret``: what tenant roots are derived under;
    ``shared``: tenants whose cache is deliberately the shared one."""

    def __init__(
        self, namespace: bytes, secret: bytes, shared: frozenset[str] = frozenset()
    ) -> None:
        self.namespace = namespace
        self._secret = secret
        self.shared = shared
        self._roots: dict[str, bytes] = {}

    def root(
        self, tenant: str | None, cache_salt: str | None = None, adapter: bytes | None = None
    ) -> bytes | None:
        """The chain root of ``tenant``'s requests with ``cache_salt`` and LoRA
        ``adapter`` digest (None for all: the namespace). Raises ValueError on a
        bad salt."""
        if cache_salt is not None:
            check_cache_salt(cache_salt)  # before a tenant root is cached for it
        if tenant is None or tenant in self.shared or tenant == DEFAULT_TENANT:
            return request_root(self.namespace, None, cache_salt, adapter)
        troot = self._roots.get(tenant)
        if troot is None:
            troot = tenant_root(self._secret, tenant)
            if len(self._roots) < 1 << 16:  # header tenants are unbounded: cache a few
                self._roots[tenant] = troot
        return request_root(self.namespace, troot, cache_salt, adapter)


__all__ = [
    "ANONYMOUS",
    "DEFAULT_TENANT",
    "BadCredentials",
    "BadTenant",
    "Credentials",
    "Identity",
    "Role",
    "default_secret_file",
    "KeyFileError",
    "load_credentials",
    "Tenants",
    "check_tenant_name",
    "head_secret",
    "presented_key",
    "read_key_file",
]
