"""Typed errors. Every cache failure is one of these, and each carries a short
machine-readable ``reason`` that telemetry counts as a fallback reason."""

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
