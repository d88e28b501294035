"""Typed errors. Every cache failure is one of these, and each carries a short
machine-readable ``reason`` that telemetry counts as a fallback reason.

A typed error crosses the network as the text ``reason: message``
(:func:`wire_text`); each transport keeps one map from the reasons it carries
back to their types (:func:`carried`): ``kvmesh.mesh.rpc_errors`` for gRPC,
``kvmesh.mesh.bulk`` for the bulk data path. A reason a transport does not carry
comes back as :class:`PeerUnavailable`.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base of every kvmesh error."""

    reason = "error"


class CacheMiss(KVMeshError):
    reason = "miss"


class IncompatibleCard(KVMeshError):
    """KV offered under a card (namespace) other than the one expected."""

    reason = "incompatible_card"


class ChecksumMismatch(KVMeshError):
    reason = "checksum_mismatch"


class MalformedPayload(KVMeshError):
    """A block payload or announcement that does not parse or violates a cap."""

    reason = "malformed_payload"


class OversizePayload(MalformedPayload):
    reason = "oversize_payload"


class LeaseExpired(KVMeshError):
    reason = "lease_expired"


class StaleEpoch(LeaseExpired):
    """A lease or lookup answer from an earlier life of the peer."""

    reason = "stale_epoch"


class OrphanBlock(KVMeshError):
    """A block whose parent is not stored: it could never be reached."""

    reason = "orphan_block"


class StoreFull(KVMeshError):
    """Budget exhausted by leased or in-use blocks; nothing was stored."""

    reason = "store_full"


class PeerUnavailable(KVMeshError):
    reason = "peer_unreachable"


class PeerBusy(PeerUnavailable):
    """The peer refused a stream because all its stream slots were taken: it is
    alive and honest, just loaded; not a failure to back off from."""

    reason = "busy"


class LocalBusy(KVMeshError):
    """This node's own stream slots stayed taken for the whole wait: the request
    never reached the peer, so it is not the peer's failure."""

    reason = "local_busy"


class PeerTimeout(KVMeshError):
    reason = "timeout"


class Unauthenticated(KVMeshError):
    reason = "unauthenticated"


class ConfigError(KVMeshError):
    reason = "config"


class NoChatTemplate(KVMeshError):
    """A chat request to a model whose tokenizer has no chat template."""

    reason = "no_chat_template"


def carried(*types: type[KVMeshError]) -> dict[str, type[KVMeshError]]:
    """A transport's map from reason back to type, for the ``types`` it carries
    (distinct reasons: a second type with a taken reason is a programming error)."""
    out = {t.reason: t for t in types}
    assert len(out) == len(types), "two carried types share a reason"
    return out


def wire_text(e: KVMeshError) -> str:
    """``reason: message``, as a typed error travels (a message that already
    starts with its reason, or is empty, is not repeated)."""
    message = str(e)
    if not message or message == e.reason:
        return e.reason
    return message if message.startswith(f"{e.reason}:") else f"{e.reason}: {message}"


def wire_reason(text: str) -> str:
    """The reason ``text`` (from :func:`wire_text`) names."""
    return text.split(":", 1)[0]
