"""A mesh node's :class:`NodeConfig` from flat option values, with the checks
every role shares (``kvmesh peer``, ``kvmesh head`` and the vLLM connector).

Contract: :func:`node_config` returns a checked config or raises
:class:`ConfigError` with a message naming the option; it never reads the command
line or the environment itself (the CLI and the connector hand it their values).
A plaintext listener off loopback needs ``plaintext``; one without client
authentication (no fleet key, no mutual TLS) needs ``allow_unauthenticated``.
KV events (``kv_events``) are plaintext ZMQ carrying prompts' token ids, so an
endpoint beyond loopback (``tcp://*:5557`` included) needs ``plaintext`` too.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..units import is_loopback, parse_size, split_hostport
from .events import EventsConfig
from .node import NodeConfig
from .security import Security, TLSConfig, load_fleet_key


def _size(value: object, default: str, option: str) -> int:
    try:
        return parse_size(str(value or default))
    except ValueError as e:
        raise ConfigError(f"invalid {option}: {e}") from None


def _disk(sec: dict[str, object]) -> dict[str, Any]:
    """``NodeConfig`` fields for the ``--disk*`` options (none without ``--disk``)."""
    if not sec.get("disk"):
        return {}
    return dict(disk_path=str(sec["disk"]),
                disk_budget_bytes=_size(sec.get("disk_budget"), "16GiB", "--disk-budget"),
                disk_admit=str(sec.get("disk_admit") or "evicted"))  # fmt: skip


def _endpoint(value: str, option: str, sec: dict[str, object]) -> str:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ConfigError(f"invalid {option} {value!r}: expected tcp://HOST:PORT, ipc:// or inproc://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"invalid {option} {value!r}: expected tcp://HOST:PORT")
        if not is_loopback(host.strip("[]")) and not sec.get("plaintext"):
            raise ConfigError(
                f"refusing {option} on {host}: KV events are plaintext and carry prompts' "
                "token ids; pass --plaintext for a trusted private network"
            )
    return value


def _events(sec: dict[str, object]) -> dict[str, Any]:
    """``NodeConfig`` fields for the ``--kv-events*`` options (none without ``--kv-events``)."""
    if not sec.get("kv_events"):
        if sec.get("kv_events_replay"):
            raise ConfigError("--kv-events-replay needs --kv-events")
        return {}
    replay = str(sec.get("kv_events_replay") or "")
    return dict(kv_events=EventsConfig(
        _endpoint(str(sec["kv_events"]), "--kv-events", sec),
        _endpoint(replay, "--kv-events-replay", sec) if replay else "",
        str(sec.get("kv_events_topic") or ""),
    ))  # fmt: skip


def node_config(
    listen: str,
    budget: str,
    seed: tuple[str, ...],
    alias: str | None,
    advertise: tuple[str, ...],
    roles: tuple[str, ...],
    sec: dict[str, object],
    **extra: object,
) -> NodeConfig:
    """A checked node config; ``sec`` holds the security, disk and limit options by
    their long names (``fleet_key_file``, ``tls_ca``, ``disk_budget``...)."""
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
        budget_bytes=_size(budget, budget, "--budget"),
        seeds=list(seed),
        alias=alias or "",
        advertise=list(advertise),
        roles=roles,
        security=Security(tls=tls, fleet_key=key),
        **_disk(sec),
        **_events(sec),
        bulk=not sec.get("no_bulk"),
        data_port=int(str(sec.get("data_port") or 0)),
        advertise_data_port=int(str(sec.get("advertise_data_port") or 0)),
        max_block_bytes=_size(sec.get("max_block_bytes"), "64MiB", "--max-block-bytes"),
        max_inflight_bytes=_size(sec.get("max_inflight"), "128MiB", "--max-inflight"),
        max_members=int(str(sec.get("max_members") or 256)),
        **extra,  # type: ignore[arg-type]
    )


__all__ = ["node_config"]
