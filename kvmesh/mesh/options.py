"""What a mesh node can be told, declared once as plain data: each option's name,
default, kind and help.

Contract: :data:`NODE` holds every option of a mesh node (``kvmesh peer``, ``kvmesh
head`` and the vLLM connector's ``kv_connector_extra_config``); the CLI
(``kvmesh.cli.options``) makes its click options from these rows and the connector
(:mod:`kvmesh.vllm.config`) its keys, defaults, checks and documentation, so a
flag and a key cannot drift apart. An option's name is its long flag with ``_``
for ``-``, which is also the config file's key and the ``KVMESH_<ROLE>_<FLAG>``
variable's: renaming one here renames all of them. No click here (library code
never loads the command line); :meth:`Option.parse` checks a value that came
untyped (JSON, TOML) and raises ``ValueError`` saying what was expected.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from ..store import ADMIT
from ..units import parse_size

#: text: any string; size: a byte size (``2GiB``), kept as written; positive: a
#: float above 0 (seconds, a rate); file: an existing file; path: a file name,
#: existing or not.
Kind = Literal["text", "size", "int", "float", "positive", "flag", "choice", "file", "path"]
Value = str | int | float | bool | None | list[str]


@dataclass(frozen=True)
class Option:
    """One option: ``name`` is the long flag with ``_`` for ``-`` unless ``flags``
    spells it otherwise; ``low``/``high`` bound an int or float (inclusive)."""

    name: str
    help: str
    default: str | int | float | bool | None = None
    kind: Kind = "text"
    _: KW_ONLY
    multiple: bool = False
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    metavar: str | None = None
    flags: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The long flag, e.g. ``--gossip-interval``."""
        longs = [f for f in self.flags if f.startswith("--")]
        return longs[0] if longs else "--" + self.name.replace("_", "-")

    @property
    def initial(self) -> Value:
        """The default as a value: a list for a repeatable option, False for a flag."""
        if self.multiple:
            return []
        return False if self.kind == "flag" else self.default

    def parse(self, value: object) -> Value:
        """``value`` (from JSON, TOML, a string) as this option's value; None is the default."""
        if value is None:
            return self.initial
        if self.multiple:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
                raise ValueError("expected a string or a list of strings")
            return list(items)
        return _PARSE[self.kind](self, value)


def _flag(_: Option, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError("expected true or false")


def _number(opt: Option, value: object) -> int | float:
    whole = opt.kind == "int"
    what = "an integer" if whole else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, str) if whole else (int, float, str)):
        raise ValueError(f"expected {what}")
    try:
        n = int(value) if whole else float(value)
    except ValueError:
        raise ValueError(f"expected {what}") from None
    if not math.isfinite(n):  # an infinite interval or timeout would never fire
        raise ValueError(f"expected a finite {what.split()[-1]}")
    if opt.kind == "positive" and n <= 0:
        raise ValueError("expected a positive number")
    if (opt.low is not None and n < opt.low) or (opt.high is not None and n > opt.high):
        raise ValueError(f"expected {what} {_bounds(opt)}")
    return n


def _bounds(opt: Option) -> str:
    low = f">= {opt.low}" if opt.low is not None else ""
    high = f"<= {opt.high}" if opt.high is not None else ""
    return " and ".join(b for b in (low, high) if b)


def _text(opt: Option, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("expected a string")
    text = str(value)
    if opt.kind == "size":
        parse_size(text)  # its ValueError says what a size looks like
    elif opt.kind == "choice" and text not in opt.choices:
        raise ValueError(f"expected one of {', '.join(opt.choices)}")
    elif opt.kind == "file" and not os.path.isfile(text):
        raise ValueError(f"no such file: {text}")
    return text


_PARSE: dict[Kind, Callable[[Option, object], Value]] = {
    "flag": _flag,
    "int": _number,
    "float": _number,
    "positive": _number,
    "text": _text,
    "size": _text,
    "choice": _text,
    "file": _text,
    "path": _text,
}


def _rows(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


#: What makes a process a mesh node: its store, its neighbours, its name.
MEMBERSHIP = _rows(
    Option("budget", "Byte budget of the in-memory block store.", "2GiB", "size"),
    Option("seed", "HOST:PORT of a node to gossip with (repeatable).", multiple=True),
    Option("alias", "Human name shown on the dashboard."),
    Option(
        "advertise",
        "ADDR[,interface=thunderbolt|ethernet|wifi|tailscale|loopback] for the gRPC "
        "service (repeatable; detected if omitted).",
        multiple=True,
    ),
    Option("gossip_interval", "Seconds between gossip rounds.", 1.0, "positive"),
    Option("ttl", "Seconds before a silent node is dropped.", 5.0, "positive"),
    Option("region", "Coarse region label shown publicly.", ""),
)

#: What a client of the mesh (``kvmesh status``) needs to reach a secured node.
CLIENT_SECURITY = _rows(
    Option(
        "fleet_key_file",
        "Fleet pre-shared key: authenticates calls, cards, publishes; keys block hashes.",
        kind="file",
    ),
    Option("tls_cert", "Server/client certificate (PEM).", kind="file"),
    Option("tls_key", "Private key (PEM).", kind="file"),
    Option("tls_ca", "CA bundle; on a server it turns on mutual TLS.", kind="file"),
    Option("tls_server_name", "Name to check in peers' certificates."),
)

#: Transport security and the node's own limits.
SECURITY = CLIENT_SECURITY | _rows(
    Option("plaintext", "Allow an unencrypted listener on a non-loopback address.", kind="flag"),
    Option(
        "allow_unauthenticated",
        "Serve a non-loopback listener without client authentication "
        "(no fleet key, no mutual TLS): anyone who reaches it may publish and fetch.",
        kind="flag",
    ),
    Option(
        "max_block_bytes",
        "Largest block this node accepts from a publisher (its own limit, "
        "whatever the publisher's card implies).",
        "64MiB",
        "size",
    ),
    Option(
        "max_inflight",
        "Bytes of published blocks this node buffers at once, over all publishers.",
        "128MiB",
        "size",
    ),
    Option("max_members", "Most nodes kept in the membership view.", 256, "int", low=1),
    Option(
        "data_port",
        "TCP port of the bulk data path (block bytes beside gRPC, same TLS and "
        "fleet key) on the gRPC listener's host; 0: any free port, advertised in the card.",
        0,
        "int",
        low=0,
        high=65535,
    ),
    Option(
        "advertise_data_port",
        "The data port peers should dial, when it differs from --data-port "
        "(port forwarding, containers).",
        kind="int",
        low=1,
        high=65535,
    ),
    Option(
        "no_bulk",
        "No bulk data path: block bytes go over gRPC (slower; for networks that "
        "allow one port only).",
        kind="flag",
    ),
    Option(
        "no_local_socket",
        "Nodes on one host (same kernel, filesystem and user) send block bytes over "
        "TCP like any peer, not over a Unix socket (which skips the TCP stack).",
        kind="flag",
    ),
    Option(
        "no_window_trim",
        "Fetch whole blocks, uncompressed: every position of a sliding-window layer, "
        "not only those the import's window needs (more bytes; the reference the "
        "benchmark compares with).",
        kind="flag",
    ),
    Option(
        "serve_rate",
        "Send block bytes to peers at most this fast, in bytes per second (e.g. 12.5MB "
        "for 100 Mbit/s); unlimited by default.",
        kind="size",
        metavar="BYTES",
    ),
)

#: A disk tier under the RAM store.
DISK = _rows(
    Option("disk", "Keep blocks on disk too, in DIR: they survive restarts.", metavar="DIR"),
    Option("disk_budget", "Byte budget of the disk tier (never exceeded).", "16GiB", "size"),
    Option(
        "disk_admit",
        "evicted: every block goes to disk; hit: only blocks hit at least once.",
        "evicted",
        "choice",
        choices=ADMIT,
    ),
)

#: vLLM-format KV events for routers (``mesh/events.py``).
EVENTS = _rows(
    Option(
        "kv_events",
        "Publish vLLM-format KV events (BlockStored/BlockRemoved/AllBlocksCleared) "
        "on a ZMQ PUB socket, e.g. tcp://*:5557 (binds; tcp://HOST:PORT connects), for "
        "llm-d's or Dynamo's KV-aware routers (docs/routing.md).",
        metavar="ENDPOINT",
    ),
    Option(
        "kv_events_replay",
        "A ZMQ ROUTER socket that replays the last batches from a sequence number "
        "(vLLM's replay_endpoint), e.g. tcp://*:5558.",
        metavar="ENDPOINT",
    ),
    Option("kv_events_topic", "Topic frame of every KV event message.", ""),
    Option(
        "kv_events_curve_key",
        "CURVE secret key file for the KV events sockets (made, mode 0600, when missing; "
        "the public key is logged at start and printed by `python -m kvmesh.mesh.events "
        "FILE`): subscribers must be CURVE clients of that public key. Needed for an "
        "endpoint beyond loopback (tcp://*:P included) unless --kv-events-hashes-only.",
        kind="path",
        metavar="FILE",
    ),
    Option(
        "kv_events_curve_clients",
        "Public keys (Z85, one a line) of the subscribers admitted under "
        "--kv-events-curve-key. Without it, any client that knows the node's public key "
        "may subscribe.",
        kind="file",
        metavar="FILE",
    ),
    Option(
        "kv_events_hashes_only",
        "Publish block hashes without token ids. Routers that key blocks by their tokens "
        "(llm-d, Dynamo) then learn nothing from a head; the only way to publish beyond "
        "loopback without CURVE (anyone who connects sees which blocks this node holds).",
        kind="flag",
    ),
)

#: A node that also serves requests (``kvmesh head``, a vLLM worker).
HEAD = _rows(
    Option(
        "grpc_listen",
        "gRPC HOST:PORT of this node's own cache service (a head is also a peer).",
        "127.0.0.1:0",
    ),
    Option("no_publish", "Never publish new prefixes.", kind="flag"),
    Option("lookup_timeout", "Seconds a lookup may take.", 0.25, "positive"),
    Option("fetch_timeout", "Seconds a fetch may take.", 30.0, "positive"),
)

#: Every option of a mesh node, by name.
NODE = MEMBERSHIP | SECURITY | DISK | EVENTS | HEAD

__all__ = [
    "CLIENT_SECURITY",
    "DISK",
    "EVENTS",
    "HEAD",
    "MEMBERSHIP",
    "NODE",
    "SECURITY",
    "Kind",
    "Option",
    "Value",
]
