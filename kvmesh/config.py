"""One TOML config file for every flag, ``KVMESH_*`` environment overrides, and
the command line on top (click's precedence: flag > environment > file > default).

    [common]            # applies to every role that has the key
    fleet_key_file = "/etc/kvmesh/fleet.key"
    [peer]
    listen = "0.0.0.0:7070"
    budget = "8GiB"
    seed = ["10.0.0.1:7070"]
    [head]
    model = "/models/qwen2.5-0.5b"
    listen = "127.0.0.1:8000"

Keys are the long flag names with ``_`` for ``-``. Environment variables are
``KVMESH_<ROLE>_<KEY>`` (e.g. ``KVMESH_PEER_BUDGET=4GiB``). A bad file is one
error that names the file and the key.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import click

from .errors import ConfigError

ROLES = ("peer", "head")
SECRET = re.compile(r"(token|secret|password)$")
ENV_PREFIX = "KVMESH"


def _params(cmd: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in cmd.params if p.name and p.name not in ("help", "verbose")}


def read_config(
    path: str | Path, group: click.Group, ctx: click.Context
) -> dict[str, dict[str, Any]]:
    """Parse and validate ``path`` into a click ``default_map``."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    unknown = set(doc) - {"common", *ROLES}
    if unknown:
        raise ConfigError(
            f"{path}: unknown section [{sorted(unknown)[0]}]; use [common], [peer] or [head]"
        )
    out: dict[str, dict[str, Any]] = {r: {} for r in ROLES}
    commands = {r: _params(group.commands[r]) for r in ROLES}
    common = doc.get("common", {})
    for key in common:
        if not any(key in commands[r] for r in ROLES):
            raise ConfigError(f"{path}: [common] unknown key {key!r}")
    for role in ROLES:
        section = doc.get(role, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: [{role}] must be a table")
        params = commands[role]
        merged = {k: v for k, v in common.items() if k in params} | section
        for key, value in merged.items():
            param = params.get(key)
            if param is None:
                valid = ", ".join(sorted(params))
                raise ConfigError(f"{path}: [{role}] unknown key {key!r}; valid keys: {valid}")
            if param.multiple and not isinstance(value, list):
                raise ConfigError(f"{path}: [{role}] {key} must be a list")
            try:
                param.type_cast_value(ctx, value)
            except click.BadParameter as e:
                raise ConfigError(f"{path}: [{role}] {key} = {value!r}: {e.message}") from None
            out[role][key] = value
    return out


def effective(
    group: click.Group, ctx: click.Context, default_map: dict[str, dict[str, Any]] | None
) -> dict[str, Any]:
    """Every role's settings, where each came from, secrets redacted."""
    report: dict[str, Any] = {}
    for role in ROLES:
        rows = {}
        for name, p in _params(group.commands[role]).items():
            env = f"{ENV_PREFIX}_{role.upper()}_{name.upper()}"
            value: Any
            if env in os.environ:
                value, source = os.environ[env], f"env {env}"
            elif default_map and name in default_map.get(role, {}):
                value, source = default_map[role][name], "file"
            else:
                value, source = p.get_default(ctx, call=True), "default"
            if str(value) == "Sentinel.UNSET":  # click's "no default"
                value = False if getattr(p, "is_flag", False) else ([] if p.multiple else None)
            if isinstance(value, tuple):
                value = list(value)
            if value is not None and SECRET.search(name):
                value = "<redacted>"
            rows[name] = {"value": value, "source": source}
        report[role] = rows
    return report
