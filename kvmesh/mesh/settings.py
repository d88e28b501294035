"""A mesh node's :class:`NodeConfig` from flat option values, with the checks
every role shares (``kvmesh peer``, ``kvmesh head`` and the vLLM connector).

Contract: :func:`node_from` (values by their declared names,
:data:`kvmesh.mesh.options.NODE`) and :func:`node_config` return a checked config
or raise :class:`ConfigError` with a message naming the option; they never read
the command line or the environment (the CLI and the connector hand them values).
A plaintext listener off loopback needs ``plaintext``; one without client
authentication (no fleet key, no mutual TLS) needs ``allow_unauthenticated``.
KV events (``kv_events*``) are checked by :func:`kvmesh.mesh.events.events_config`:
an endpoint beyond loopback (``tcp://*:5557`` included) needs a CURVE key
(``kv_events_curve_key``) or ``kv_events_hashes_only``; ``plaintext`` does not
cover them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..units import is_loopback, parse_size, split_hostport
from .events import events_config
from .node import NodeConfig
from .options import NODE, Option, Value
from .security import Security, TLSConfig, load_fleet_key


def _size(value: object, name: str) -> int:
    """The byte size of option ``name`` (its declared default when not given)."""
    opt = NODE[name]
    try:
        return parse_size(str(value or opt.default))
    except ValueError as e:
        raise ConfigError(f"invalid {opt.flag}: {e}") from None


def _disk(sec: dict[str, object]) -> dict[str, Any]:
    """``NodeConfig`` fields for the ``--disk*`` options (none without ``--disk``)."""
    if not sec.get("disk"):
        return {}
    return dict(
        disk_path=str(sec["disk"]),
        disk_budget_bytes=_size(sec.get("disk_budget"), "disk_budget"),
        disk_admit=str(sec.get("disk_admit") or NODE["disk_admit"].default),
    )


def _events(sec: dict[str, object]) -> dict[str, Any]:
    """``NodeConfig`` fields for the ``--kv-events*`` options (none without ``--kv-events``)."""
    cfg = events_config(sec)
    return {"kv_events": cfg} if cfg is not None else {}


def node_config(
    listen: str,
    budget: str,
    seed: tuple[str, ...],
    alias: str | None,
    advertise: tuple[str, ...],
    roles: tuple[str, ...],
    sec: dict[str, object],
    *,
    gossip_interval: float = 1.0,
    ttl: float = 5.0,
    region: str = "",
    lookup_deadline: float = 0.25,
    fetch_deadline: float = 30.0,
) -> NodeConfig:
    """A checked node config; ``sec`` holds the security, disk and limit options by
    their declared names (:data:`kvmesh.mesh.options.NODE`: ``fleet_key_file``,
    ``tls_ca``, ``disk_budget``...); one not given takes its declared default."""
    host, _ = split_hostport(listen)
    tls = TLSConfig.from_options(sec)
    if tls.enabled and not (tls.cert and tls.key):
        raise ConfigError("--tls-ca needs --tls-cert and --tls-key on a node")
    if not tls.enabled and not is_loopback(host) and not sec.get("plaintext"):
        raise ConfigError(
            f"refusing a plaintext listener on {host}: pass --tls-cert/--tls-key, or --plaintext "
            "for a trusted private network"
        )
    key = load_fleet_key(str(sec["fleet_key_file"])) if sec.get("fleet_key_file") else None
    mutual_tls = tls.enabled and bool(sec.get("tls_ca"))
    if not is_loopback(host) and not (key or mutual_tls or sec.get("allow_unauthenticated")):
        raise ConfigError(
            f"refusing an unauthenticated listener on {host}: anyone reaching it could publish "
            "and fetch. Pass --fleet-key-file (e.g. `openssl rand -hex 32 > fleet.key`), mutual TLS "
            "(--tls-ca), or --allow-unauthenticated for a network you fully trust"
        )
    return NodeConfig(
        listen=listen,
        budget_bytes=_size(budget, "budget"),
        seeds=list(seed),
        alias=alias or "",
        advertise=list(advertise),
        roles=roles,
        security=Security(tls=tls, fleet_key=key),
        **_disk(sec),
        **_events(sec),
        bulk=not sec.get("no_bulk"),
        local_socket=not sec.get("no_local_socket"),
        window_trim=not sec.get("no_window_trim"),
        serve_rate=_size(sec.get("serve_rate"), "serve_rate") if sec.get("serve_rate") else 0.0,
        data_port=int(str(sec.get("data_port") or 0)),
        advertise_data_port=int(str(sec.get("advertise_data_port") or 0)),
        max_block_bytes=_size(sec.get("max_block_bytes"), "max_block_bytes"),
        max_inflight_bytes=_size(sec.get("max_inflight"), "max_inflight"),
        max_members=int(str(sec.get("max_members") or NODE["max_members"].default)),
        gossip_interval=gossip_interval,
        ttl=ttl,
        region=region,
        lookup_deadline=lookup_deadline,
        fetch_deadline=fetch_deadline,
    )


def node_from(
    values: Mapping[str, object], roles: tuple[str, ...], listen: str | None = None
) -> NodeConfig:
    """:func:`node_config` from option values by their declared names, each checked
    by its declaration; a node option not in ``values`` takes its declared default,
    a name that is no node option is not read. ``listen`` is the gRPC listener
    (default: ``values["grpc_listen"]``)."""
    v = {name: _parsed(opt, values.get(name)) for name, opt in NODE.items()}
    return node_config(
        listen or str(v["grpc_listen"]),
        str(v["budget"]),
        _strings(v["seed"]),
        str(v["alias"] or ""),
        _strings(v["advertise"]),
        roles,
        dict(v),
        gossip_interval=_number(v["gossip_interval"]),
        ttl=_number(v["ttl"]),
        region=str(v["region"] or ""),
        lookup_deadline=_number(v["lookup_timeout"]),
        fetch_deadline=_number(v["fetch_timeout"]),
    )


def _parsed(opt: Option, value: object) -> Value:
    try:
        return opt.parse(value)
    except ValueError as e:
        raise ConfigError(f"invalid {opt.flag} {value!r}: {e}") from None


def _strings(value: Value) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, list) else ()


def _number(value: Value) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0  # parsed: always a number


__all__ = ["node_config", "node_from"]
