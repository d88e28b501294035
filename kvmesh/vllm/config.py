"""The connector's settings: ``kv_connector_extra_config``, under ``kvmesh head``'s names.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVMeshConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"seed": "10.0.0.2:7070",
        "fleet_key_file": "fleet.key", "budget": "4GiB", "alias": "gpu-1"}}'

Keys are ``kvmesh head``'s long flag names with ``_`` for ``-`` (``listen`` also
names ``grpc_listen``: a vLLM process has no kvmesh HTTP listener), made from the
flags' own declarations (:mod:`kvmesh.mesh.options`), plus the connector's own
:data:`CONNECTOR_ONLY`. A list flag (``seed``, ``advertise``) takes a string or a
list. An unknown key or a bad value is one :class:`~kvmesh.errors.ConfigError`
naming it (an unknown key lists the valid ones); the node is built by the CLI's
own :func:`kvmesh.mesh.settings.node_from`, so the same refusals apply.
:func:`settings_table` is docs/vllm.md's table of keys. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..mesh.node import NodeConfig
from ..mesh.options import DISK, NODE, SECURITY, Option, Value

_PREFIX = "kv_connector_extra_config"

#: The ``kvmesh head`` options that mean something in a vLLM process (KV events
#: come from vLLM's own ``--kv-events-config``, logging from vLLM's).
HEAD_KEYS = (
    *("grpc_listen", "budget", "seed", "alias", "advertise", "no_publish", "region"),
    *("gossip_interval", "ttl", "lookup_timeout", "fetch_timeout"),
    *SECURITY,
    *DISK,
)
#: Settings only the connector has.
CONNECTOR_ONLY = (
    Option(
        "prefill_tps",
        "Prior prefill speed (tokens/s) until vLLM's own is measured.",
        100.0,
        "positive",
    ),
    Option(
        "max_pending_publishes",
        "Exports waiting for the publisher before new ones are dropped.",
        2,
        "int",
        low=1,
    ),
    Option(
        "no_warm_heap",
        "Leave the process's heap and allocator as vLLM set them (kvmesh's service still "
        "warms its own threads and buffers).",
        False,
        "flag",
    ),
)
#: Every key, declared once: the head's rows (:mod:`kvmesh.mesh.options`) and the connector's.
KEYS: dict[str, Option] = {k: NODE[k] for k in HEAD_KEYS} | {o.name: o for o in CONNECTOR_ONLY}
ALIASES = {"listen": "grpc_listen"}
_COMMA_SEPARATED = ("seed",)  # one string may list several seeds; an advertise has commas
_PER_RANK_PORTS = ("data_port", "advertise_data_port")  # a fixed one is rank 0's


def defaults() -> dict[str, Value]:
    """Every key's default (a fresh dict: lists are not shared)."""
    return {name: opt.initial for name, opt in KEYS.items()}


@dataclass(frozen=True)
class ConnectorSettings:
    values: dict[str, Any] = field(default_factory=defaults)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def publish(self) -> bool:
        return not self.values["no_publish"]

    def node_config(self, rank: int = 0, world: int = 1) -> NodeConfig:
        """The mesh node of tensor-parallel rank ``rank`` of ``world`` (one per worker
        process), built and checked like ``kvmesh head``'s. With several ranks, a
        fixed port (listen, data) is the first rank's (rank r's is port + r) and an
        alias gets ``-tp<r>``; without an alias each worker is ``vllm-HOST-PID``. A
        rank of several is a head only (no cache role): it keeps and serves its own
        pages to itself, and publishes to the fleet's caches, never to a sibling."""
        from ..mesh.node import pid_alias
        from ..mesh.settings import node_from

        v = self._for_rank(rank) if world > 1 else dict(self.values)
        v["alias"] = v["alias"] or f"vllm-{pid_alias()}"
        # a rank of several is no cache for others: its siblings (which die with
        # it) would be publish targets; its own pages stay its own
        roles = ("head", "cache") if world == 1 else ("head",)
        try:
            return node_from(v, roles)
        except (ConfigError, ValueError, OSError) as e:
            raise ConfigError(f"{_PREFIX}: {e}") from None

    def _for_rank(self, rank: int) -> dict[str, Any]:
        v = dict(self.values)
        host, _, port = str(v["grpc_listen"]).rpartition(":")
        if port.isdigit() and int(port):
            v["grpc_listen"] = f"{host}:{int(port) + rank}"
        for key in _PER_RANK_PORTS:
            if v[key]:
                v[key] += rank
        if v["alias"]:
            v["alias"] = f"{v['alias']}-tp{rank}"
        return v


def parse_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; unknown keys and bad values are errors."""
    values = defaults()
    for raw_key, value in (extra or {}).items():
        key = ALIASES.get(raw_key, raw_key.replace("-", "_"))
        if key not in KEYS:
            valid = ", ".join(sorted([*KEYS, *ALIASES]))
            raise ConfigError(f"{_PREFIX}: unknown key {raw_key!r}; valid: {valid}")
        values[key] = _parse(KEYS[key], value)
    return ConnectorSettings(values)


def _parse(opt: Option, value: object) -> Value:
    if opt.name in _COMMA_SEPARATED and isinstance(value, str):
        value = value.split(",")
    try:
        out = opt.parse(value)
    except ValueError as e:
        raise ConfigError(f"{_PREFIX}: {opt.name} = {value!r} is not valid: {e}") from None
    if isinstance(out, list):  # an empty entry ("a,,b", "") is no entry
        return [s for s in (p.strip() for p in out) if s]
    return out


_SHOWN_DEFAULT = {"alias": "`vllm-HOST-PID`"}  # what an unset key turns into


def settings_table() -> str:
    """The keys as docs/vllm.md's markdown table, from the declarations."""
    rows = ["| key | meaning | default |", "|---|---|---|"]
    for name, opt in KEYS.items():
        key = f"`{name}`" + "".join(f" (or `{a}`)" for a, k in ALIASES.items() if k == name)
        meaning = opt.help.replace("|", "\\|")
        if opt.multiple:
            meaning += " A string or a list" + (
                " (comma-separated)." if name in _COMMA_SEPARATED else "."
            )
        rows.append(f"| {key} | {meaning} | {_shown(opt)} |")
    return "\n".join(rows) + "\n"


def _shown(opt: Option) -> str:
    if opt.name in _SHOWN_DEFAULT:
        return _SHOWN_DEFAULT[opt.name]
    if opt.kind == "flag":
        return "false"
    return "none" if opt.default in (None, "") else f"`{opt.default}`"
