"""Every option that more than one ``kvmesh`` command takes, declared once.

Contract: each name below is a decorator that adds one group of options, with
the same flag names, defaults and help text wherever it is used; a command lists
the groups it takes and only its own options beside them. The flags' names are
also the config file's keys and the ``KVMESH_<ROLE>_<FLAG>`` variables'
(:mod:`kvmesh.config`), so renaming one here renames those too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..engine import ENGINES
from ..store_cli import disk_options

F = TypeVar("F", bound=Callable[..., Any])

_FILE = click.Path(exists=True, dir_okay=False)


def stack(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator applying ``options`` so they list in the given order in --help."""

    def apply(fn: F) -> F:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


_fleet_key_file = click.option(
    "--fleet-key-file",
    type=_FILE,
    help="Fleet pre-shared key: authenticates calls, cards, publishes; keys block hashes.",
)
_tls_cert = click.option("--tls-cert", type=_FILE, help="Server/client certificate (PEM).")
_tls_key = click.option("--tls-key", type=_FILE, help="Private key (PEM).")
_tls_ca = click.option(
    "--tls-ca", type=_FILE, help="CA bundle; on a server it turns on mutual TLS."
)
_tls_server_name = click.option("--tls-server-name", help="Name to check in peers' certificates.")

#: What a client of the mesh (``kvmesh status``) needs to reach a secured node.
client_security_options = stack(_fleet_key_file, _tls_cert, _tls_key, _tls_ca, _tls_server_name)

#: Transport security and the node's own limits, for ``peer`` and ``head``.
security_options = stack(
    client_security_options,
    click.option(
        "--plaintext", is_flag=True, help="Allow an unencrypted listener on a non-loopback address."
    ),
    click.option(
        "--allow-unauthenticated",
        is_flag=True,
        help="Serve a non-loopback listener without client authentication "
        "(no fleet key, no mutual TLS): anyone who reaches it may publish and fetch.",
    ),
    click.option(
        "--max-block-bytes",
        default="64MiB",
        show_default=True,
        help="Largest block this node accepts from a publisher (its own limit, "
        "whatever the publisher's card implies).",
    ),
    click.option(
        "--max-inflight",
        default="128MiB",
        show_default=True,
        help="Bytes of published blocks this node buffers at once, over all publishers.",
    ),
    click.option(
        "--max-members",
        default=256,
        show_default=True,
        type=click.IntRange(min=1),
        help="Most nodes kept in the membership view.",
    ),
    click.option(
        "--data-port",
        default=0,
        show_default=True,
        type=click.IntRange(0, 65535),
        help="TCP port of the bulk data path (block bytes beside gRPC, same TLS and "
        "fleet key) on the --listen host; 0: any free port, advertised in the card.",
    ),
    click.option(
        "--advertise-data-port",
        type=click.IntRange(1, 65535),
        help="The data port peers should dial, when it differs from --data-port "
        "(port forwarding, containers).",
    ),
    click.option(
        "--no-bulk",
        is_flag=True,
        help="No bulk data path: block bytes go over gRPC (slower; for networks that "
        "allow one port only).",
    ),
)

#: ``--kv-events ENDPOINT``, ``--kv-events-replay ENDPOINT``, ``--kv-events-topic``.
events_options = stack(
    click.option(
        "--kv-events",
        metavar="ENDPOINT",
        help="Publish vLLM-format KV events (BlockStored/BlockRemoved/AllBlocksCleared) "
        "on a ZMQ PUB socket, e.g. tcp://*:5557 (binds; tcp://HOST:PORT connects), for "
        "llm-d's or Dynamo's KV-aware routers (docs/routing.md).",
    ),
    click.option(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="A ZMQ ROUTER socket that replays the last batches from a sequence number "
        "(vLLM's replay_endpoint), e.g. tcp://*:5558.",
    ),
    click.option("--kv-events-topic", default="", help="Topic frame of every KV event message."),
)

#: What makes a process a mesh node: its store, its neighbours, its name.
membership_options = stack(
    click.option(
        "--budget",
        default="2GiB",
        show_default=True,
        help="Byte budget of the in-memory block store.",
    ),
    click.option("--seed", multiple=True, help="HOST:PORT of a node to gossip with (repeatable)."),
    click.option("--alias", help="Human name shown on the dashboard."),
    click.option(
        "--advertise",
        multiple=True,
        help="ADDR[,interface=thunderbolt|ethernet|wifi|tailscale|loopback] for the gRPC "
        "service (repeatable; detected if omitted).",
    ),
    click.option(
        "--gossip-interval", default=1.0, show_default=True, help="Seconds between gossip rounds."
    ),
    click.option(
        "--ttl", default=5.0, show_default=True, help="Seconds before a silent node is dropped."
    ),
    click.option("--region", default="", help="Coarse region label shown publicly."),
)

#: Every option of a mesh node, ``peer`` and ``head`` alike.
node_options = stack(
    membership_options,
    click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level."),
    security_options,
    disk_options,
    events_options,
)

#: The model a command loads, for ``demo`` and ``head``.
model_options = stack(
    click.option(
        "--model",
        default="demo",
        show_default=True,
        help="demo, demo-tiny or a local model directory.",
    ),
    click.option(
        "--engine",
        type=click.Choice(ENGINES),
        default="torch",
        show_default=True,
        help="torch (CPU, CUDA, MPS) or mlx (Apple silicon).",
    ),
)

__all__ = [
    "client_security_options",
    "disk_options",
    "events_options",
    "membership_options",
    "model_options",
    "node_options",
    "security_options",
    "stack",
]
