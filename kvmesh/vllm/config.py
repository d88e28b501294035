"""The connector's settings: ``kv_connector_extra_config``, under ``kvmesh head``'s names.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVMeshConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"seed": "10.0.0.2:7070",
        "fleet_key_file": "fleet.key", "budget": "4GiB", "alias": "gpu-1"}}'

Keys are the long flag names of ``kvmesh head`` with ``_`` for ``-`` (``listen``
is accepted for ``grpc_listen``: a vLLM process has no kvmesh HTTP listener).
Flags that take a list (``seed``, ``advertise``) take a string or a list. An
unknown key is one :class:`~kvmesh.errors.ConfigError` that lists the valid ones,
and the node is built by the same function as the CLI's, so the same refusals
apply (a plaintext or unauthenticated listener off loopback). No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..mesh.node import NodeConfig

# the `kvmesh head` flags that mean something in a vLLM process, with their defaults
DEFAULTS: dict[str, Any] = {
    "grpc_listen": "127.0.0.1:0",
    "budget": "2GiB",
    "seed": [],
    "alias": None,
    "advertise": [],
    "no_publish": False,
    "gossip_interval": 1.0,
    "ttl": 5.0,
    "lookup_timeout": 0.25,
    "fetch_timeout": 30.0,
    "region": "",
    "fleet_key_file": None,
    "tls_cert": None,
    "tls_key": None,
    "tls_ca": None,
    "tls_server_name": None,
    "plaintext": False,
    "allow_unauthenticated": False,
    "max_block_bytes": "64MiB",
    "max_inflight": "128MiB",
    "max_members": 256,
    "disk": None,
    "disk_budget": "16GiB",
    "disk_admit": "evicted",
    # connector-only: prior prefill speed (tokens/s) until vLLM's own is measured,
    # and how many publishes may wait for export before new ones are dropped
    "prefill_tps": 100.0,
    "max_pending_publishes": 2,
}
ALIASES = {"listen": "grpc_listen"}
_LISTS = ("seed", "advertise")
_FLAGS = ("no_publish", "plaintext", "allow_unauthenticated")
_NUMBERS = ("gossip_interval", "ttl", "lookup_timeout", "fetch_timeout", "prefill_tps")
_INTS = ("max_members", "max_pending_publishes")
_SECURITY = (
    "fleet_key_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tls_server_name",
    "plaintext",
    "allow_unauthenticated",
    "max_block_bytes",
    "max_inflight",
    "max_members",
    "disk",
    "disk_budget",
    "disk_admit",
)


@dataclass(frozen=True)
class ConnectorSettings:
    values: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def publish(self) -> bool:
        return not self.values["no_publish"]

    def node_config(self, rank: int = 0, world: int = 1) -> NodeConfig:
        """The mesh node of tensor-parallel rank ``rank`` of ``world`` (one per worker
        process), built and checked like ``kvmesh head``'s. With several ranks, a
        fixed listen port is the first rank's (rank r listens on port + r) and an
        alias gets ``-tp<r>``; without an alias each worker is ``vllm-HOST-PID``. A
        rank of several is a head only (no cache role): it keeps and serves its own
        pages to itself, and publishes to the fleet's caches, never to a sibling."""
        from ..mesh.node import pid_alias
        from ..mesh.settings import node_config

        v = dict(self.values)
        if world > 1:
            host, _, port = str(v["grpc_listen"]).rpartition(":")
            if port.isdigit() and int(port):
                v["grpc_listen"] = f"{host}:{int(port) + rank}"
            if v["alias"]:
                v["alias"] = f"{v['alias']}-tp{rank}"
        v["alias"] = v["alias"] or f"vllm-{pid_alias()}"
        sec = {k: v[k] for k in _SECURITY}
        try:
            return node_config(
                v["grpc_listen"],
                str(v["budget"]),
                tuple(v["seed"]),
                v["alias"],
                tuple(v["advertise"]),
                # a rank of several is no cache for others: its siblings (which die
                # with it) would be publish targets; its own pages stay its own
                ("head", "cache") if world == 1 else ("head",),
                sec,
                gossip_interval=v["gossip_interval"],
                ttl=v["ttl"],
                region=v["region"],
                lookup_deadline=v["lookup_timeout"],
                fetch_deadline=v["fetch_timeout"],
            )
        except ConfigError as e:
            raise ConfigError(f"kv_connector_extra_config: {e}") from None
        except (ValueError, OSError) as e:
            raise ConfigError(f"kv_connector_extra_config: {e}") from None


def parse_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; unknown keys and bad types are errors."""
    values = dict(DEFAULTS)
    for raw_key, value in (extra or {}).items():
        key = ALIASES.get(raw_key, raw_key.replace("-", "_"))
        if key not in DEFAULTS:
            valid = ", ".join(sorted([*DEFAULTS, *ALIASES]))
            raise ConfigError(f"kv_connector_extra_config: unknown key {raw_key!r}; valid: {valid}")
        values[key] = _coerce(key, value)
    return ConnectorSettings(values)


def _coerce(key: str, value: Any) -> Any:
    bad = ConfigError(f"kv_connector_extra_config: {key} = {value!r} is not valid")
    if key in _LISTS:
        if isinstance(value, str):  # one seed list may be comma-separated; an advertise has commas
            parts = value.split(",") if key == "seed" else [value]
            return [s for s in (p.strip() for p in parts) if s]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise bad
    if key in _FLAGS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise bad
    if key in _NUMBERS:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if out <= 0:
            raise bad
        return out
    if key in _INTS:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad
        try:
            n = int(value)
        except ValueError:
            raise bad from None
        if n < 1:
            raise bad
        return n
    if value is not None and not isinstance(value, (str, int)):
        raise bad
    return None if value is None else str(value)
