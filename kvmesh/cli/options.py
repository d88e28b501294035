"""Every option of the ``kvmesh`` commands, made from declarations.

Contract: options are declared once, as rows (:class:`kvmesh.mesh.options.Option`):
a mesh node's in :mod:`kvmesh.mesh.options` (the vLLM connector's settings are the
same rows), the head's own in :mod:`kvmesh.api.head_options` (the fields of
``HeadOptions``), those of ``peer`` and ``verbose`` here. :func:`option` turns a
row into a click option (type, default, help, and the row's own check where click
has none: a size, a positive number). Each group below is a decorator that adds
its options in order. A flag's name is also the config file's key and the
``KVMESH_<ROLE>_<FLAG>`` variable's (:mod:`kvmesh.config`), so renaming one
renames those too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from ..api.head_options import DETERMINISTIC, HEAD_ROWS, MODEL
from ..mesh.options import CLIENT_SECURITY, DISK, EVENTS, HEAD, MEMBERSHIP, SECURITY, Option

F = TypeVar("F", bound=Callable[..., Any])


def stack(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator applying ``options`` so they list in the given order in --help."""

    def apply(fn: F) -> F:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _type(opt: Option) -> click.ParamType | type | None:
    bounded = opt.low is not None or opt.high is not None
    if opt.kind == "int":
        return click.IntRange(_int(opt.low), _int(opt.high)) if bounded else int
    if opt.kind in ("float", "positive"):
        return click.FloatRange(opt.low, opt.high) if bounded else float
    if opt.kind == "choice":
        return click.Choice(opt.choices)
    if opt.kind in ("file", "path"):
        return click.Path(exists=opt.kind == "file", dir_okay=False)
    return None  # text, size: a string


def _checked(opt: Option) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """The declaration's own check, for what click's type cannot say (a size, a
    positive or finite number); the value itself is passed on as click made it."""

    def check(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is not None:
            try:
                opt.parse(value)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None
        return value

    return check


def option(opt: Option) -> Callable[[F], F]:
    """The click option of one declaration."""
    kw: dict[str, Any] = {"help": opt.help, "metavar": opt.metavar}
    if opt.kind == "flag":
        kw["is_flag"] = True
    elif opt.multiple:
        kw["multiple"] = True
    else:
        kw.update(default=opt.default, type=_type(opt))
        # what click prints as "[default: ...]": a real value, not an empty one
        kw["show_default"] = opt.default not in (None, "")
    if opt.kind in ("size", "positive", "float"):  # click lets "lots", 0 and nan through
        kw["callback"] = _checked(opt)
    return click.option(*(opt.flags or (opt.flag,)), opt.name, **kw)


def options(rows: Iterable[Option]) -> Callable[[F], F]:
    """One decorator adding the options of ``rows``, in order."""
    return stack(*(option(o) for o in rows))


#: What a client of the mesh (``kvmesh status``) needs to reach a secured node.
client_security_options = options(CLIENT_SECURITY.values())
#: Transport security and the node's own limits, for ``peer`` and ``head``.
security_options = options(SECURITY.values())
#: ``--kv-events ENDPOINT``, ``--kv-events-replay ENDPOINT``, ``--kv-events-topic``.
events_options = options(EVENTS.values())
#: What makes a process a mesh node: its store, its neighbours, its name.
membership_options = options(MEMBERSHIP.values())
#: ``--disk DIR``, ``--disk-budget SIZE``, ``--disk-admit evicted|hit``.
disk_options = options(DISK.values())

VERBOSE = Option("verbose", "Log at DEBUG level.", kind="flag", flags=("-v", "--verbose"))

#: Every option of a mesh node, ``peer`` and ``head`` alike.
node_options = stack(
    membership_options, option(VERBOSE), security_options, disk_options, events_options
)

#: The model a command loads, for ``demo`` and ``head``.
model_options = options(MODEL)

#: ``kvmesh peer``'s own options (before :data:`node_options`).
PEER = (
    Option("listen", "gRPC HOST:PORT (port 0 = any).", "127.0.0.1:7070"),
    Option("metrics", "Serve Prometheus metrics on HOST:PORT."),
    Option("join", "Join the fleet of this head (with --pairing-token).", metavar="HEAD_URL"),
    Option("pairing_token", "Single-use token from POST /v1/network/nodes/register."),
)
peer_options = stack(options(PEER), node_options)

#: Deterministic mode, for ``head`` and ``demo``.
deterministic_options = options(DETERMINISTIC)

#: ``kvmesh head``'s options (before :data:`node_options`): the fields of
#: :class:`~kvmesh.api.head_options.HeadOptions`, then the serving node's own.
HEAD_ONLY = (*HEAD_ROWS.values(), *(o for name, o in HEAD.items() if name not in HEAD_ROWS))
head_options = stack(options(HEAD_ONLY), node_options)

__all__ = [
    "HEAD_ONLY",
    "MODEL",
    "PEER",
    "client_security_options",
    "deterministic_options",
    "disk_options",
    "events_options",
    "head_options",
    "membership_options",
    "model_options",
    "node_options",
    "option",
    "options",
    "peer_options",
    "security_options",
    "stack",
]
