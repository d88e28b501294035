"""gRPC status <-> typed error: the one map both ends of the mesh's gRPC calls use.

Contract: a server aborts a call with :func:`to_status` of the typed error; a
client raises :func:`from_status` of the status it got. The types in
:data:`STATUS` come back as themselves (a subclass as the listed type it
belongs to, with that type's reason); any other typed error travels as
INVALID_ARGUMENT with its ``reason: message`` and comes back, like every status
a kvmesh server never sends (UNAVAILABLE, INTERNAL...), as
:class:`~kvmesh.errors.PeerUnavailable`: to the caller a peer that refused a
request is a peer that did not serve it. Each carried type has a status of its
own, so the status alone names the type; the details are ``reason: message``
(:func:`~kvmesh.errors.wire_text`), for logs and people.
"""

from __future__ import annotations

import grpc

from ..errors import (
    KVMeshError,
    LeaseExpired,
    PeerTimeout,
    PeerUnavailable,
    StaleEpoch,
    Unauthenticated,
    wire_text,
)

Code = grpc.StatusCode

#: The typed errors gRPC carries, each under its own status; a subclass is
#: listed before its base (the first type an error is an instance of wins).
STATUS: dict[type[KVMeshError], grpc.StatusCode] = {
    StaleEpoch: Code.FAILED_PRECONDITION,
    LeaseExpired: Code.NOT_FOUND,
    Unauthenticated: Code.UNAUTHENTICATED,
    PeerTimeout: Code.DEADLINE_EXCEEDED,
}
_BY_CODE = {code: cls for cls, code in STATUS.items()}
assert len(_BY_CODE) == len(STATUS), "two carried types share a status"


def to_status(e: KVMeshError) -> tuple[grpc.StatusCode, str]:
    """The status and details a server aborts a call with for ``e``."""
    for cls, code in STATUS.items():
        if isinstance(e, cls):
            return code, wire_text(cls(str(e)))  # a subclass travels as its listed type
    return Code.INVALID_ARGUMENT, wire_text(e)


def from_status(code: grpc.StatusCode, details: str | None) -> KVMeshError:
    """The typed error a client raises for a call that ended in ``code``."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return PeerUnavailable(f"{code.name}: {details or ''}")
    return cls(details or cls.reason)


def from_rpc_error(e: grpc.aio.AioRpcError) -> KVMeshError:
    """A failed call's typed error."""
    return from_status(e.code(), e.details())


__all__ = ["STATUS", "from_rpc_error", "from_status", "to_status"]
