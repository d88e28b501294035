"""Typed errors. Every cache failure is one of these, and each carries a short
machine-readable ``reason`` that telemetry counts as a fallback reason.

A typed error crosses the network as the text ``reason: message``
(:func:`wire_text`); each transport keeps one map from the reasons it carries
back to their types (:func:`carried`): ``kvmesh.mesh.rpc_errors`` for gRPC,
``kvmesh.mesh.bulk_wire`` for the bulk data path. A reason a transport does not carry
comes back as :class:`PeerUnavailable`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Reason(StrEnum):
    """Why the cache path gave up: each typed error's ``reason``, and so the
    fallback reasons telemetry counts (``fallback:<reason>``) and the text a
    refusal crosses the network with. Members are ``str``: JSON, metric labels
    and counter names read the same as the plain strings they replace."""

    ERROR = "error"  # an untyped failure
    MISS = "miss"
    INCOMPATIBLE_CARD = "incompatible_card"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    MALFORMED_PAYLOAD = "malformed_payload"
    OVERSIZE_PAYLOAD = "oversize_payload"
    LEASE_EXPIRED = "lease_expired"
    STALE_EPOCH = "stale_epoch"
    ORPHAN_BLOCK = "orphan_block"
    STORE_FULL = "store_full"
    PEER_UNREACHABLE = "peer_unreachable"
    BUSY = "busy"
    LOCAL_BUSY = "local_busy"
    TIMEOUT = "timeout"
    STALLED = "stalled"  # a bulk stream that stopped moving
    AUTH_DEADLINE = "auth_deadline"  # a bulk connection that did not authenticate in time
    UNAUTHENTICATED = "unauthenticated"
    CONFIG = "config"
    NO_CHAT_TEMPLATE = "no_chat_template"
    BUDGET = "budget"  # not an error: the request's cache time budget ran out


class KVMeshError(Exception):
    """Base of every kvmesh error."""

    reason: ClassVar[Reason] = Reason.ERROR


class CacheMiss(KVMeshError):
    reason = Reason.MISS


class IncompatibleCard(KVMeshError):
    """KV offered under a card (namespace) other than the one expected."""

    reason = Reason.INCOMPATIBLE_CARD


class ChecksumMismatch(KVMeshError):
    reason = Reason.CHECKSUM_MISMATCH


class MalformedPayload(KVMeshError):
    """A block payload or announcement that does not parse or violates a cap."""

    reason = Reason.MALFORMED_PAYLOAD


class OversizePayload(MalformedPayload):
    reason = Reason.OVERSIZE_PAYLOAD


class LeaseExpired(KVMeshError):
    reason = Reason.LEASE_EXPIRED


class StaleEpoch(LeaseExpired):
    """A lease or lookup answer from an earlier life of the peer."""

    reason = Reason.STALE_EPOCH


class OrphanBlock(KVMeshError):
    """A block whose parent is not stored: it could never be reached."""

    reason = Reason.ORPHAN_BLOCK


class StoreFull(KVMeshError):
    """Budget exhausted by leased or in-use blocks; nothing was stored."""

    reason = Reason.STORE_FULL


class PeerUnavailable(KVMeshError):
    reason = Reason.PEER_UNREACHABLE


class PeerBusy(PeerUnavailable):
    """The peer refused a stream because all its stream slots were taken: it is
    alive and honest, just loaded; not a failure to back off from."""

    reason = Reason.BUSY


class LocalBusy(KVMeshError):
    """This node's own stream slots stayed taken for the whole wait: the request
    never reached the peer, so it is not the peer's failure."""

    reason = Reason.LOCAL_BUSY


class PeerTimeout(KVMeshError):
    reason = Reason.TIMEOUT


class Unauthenticated(KVMeshError):
    reason = Reason.UNAUTHENTICATED


class ConfigError(KVMeshError):
    reason = Reason.CONFIG


class CannotRestore(ConfigError):
    """The engine builds a cache kvmesh cannot describe or restore exactly (an
    unknown cache class, keys and values of different shapes, a state it cannot
    ship): the model runs, its cache cannot travel (reuse off). Other
    ConfigErrors at load are the operator's options, a card that disagrees with
    the cache, or a model the engine cannot run here."""


class NoChatTemplate(KVMeshError):
    """A chat request to a model whose tokenizer has no chat template."""

    reason = Reason.NO_CHAT_TEMPLATE


def carried(*types: type[KVMeshError]) -> dict[str, type[KVMeshError]]:
    """A transport's map from reason back to type, for the ``types`` it carries
    (distinct reasons: a second type with a taken reason is a programming error)."""
    out: dict[str, type[KVMeshError]] = {t.reason: t for t in types}
    assert len(out) == len(types), "two carried types share a reason"
    return out


def wire_text(e: KVMeshError) -> str:
    """``reason: message``, as a typed error travels (a message that already
    starts with its reason, or is empty, is not repeated). A plain ``str``: gRPC
    refuses a ``str`` subclass such as a :class:`Reason` member as details."""
    message, reason = str(e), str(e.reason)
    if not message or message == reason:
        return reason
    return message if message.startswith(f"{reason}:") else f"{reason}: {message}"


def wire_reason(text: str) -> str:
    """The reason ``text`` (from :func:`wire_text`) names."""
    return text.split(":", 1)[0]
