"""What a peer's lookup answer may claim, and what a head keeps of it.

A :class:`PeerHit` is a validated claim: :func:`validated` checks that its token
count is exactly what its blocks hold and that every announced size is one the
card allows, before anything ranks it or allocates for it (invariant 10).
:func:`rendezvous` (from :mod:`.placement`) names the owners of a key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..codec import Layout
from ..errors import MalformedPayload, OversizePayload
from .placement import rendezvous
from .proto import kvmesh_pb2 as pb

__all__ = ["PeerHit", "Transfer", "info_of", "rendezvous", "validated"]


def info_of(block: Any) -> pb.BlockInfo:
    """What a lookup answer or a publish says of a stored block (a :class:`Block` or
    the store's reference to one): its key, size, digest, tokens, and whether it
    carries recurrent state (read from its header, so it costs nothing to say)."""
    h = block.header
    return pb.BlockInfo(
        key=block.key,
        nbytes=block.nbytes,
        digest=block.digest,
        tokens=h.tokens,
        states=bool(h.states),
    )


@dataclass(frozen=True)
class PeerHit:
    node_id: str
    alias: str
    address: str
    interface: str
    epoch: str
    blocks: tuple[pb.BlockInfo, ...]
    tail: pb.BlockInfo | None
    tokens: int
    data_address: str = ""  # the peer's bulk data path; "" = fetch over gRPC
    replicas: int = 0  # extra holders the peer says this prefix should have (capped)
    repair: tuple[str, ...] = ()  # replica ranks found lacking it: given a copy once fetched

    @property
    def infos(self) -> tuple[pb.BlockInfo, ...]:
        return self.blocks + ((self.tail,) if self.tail is not None else ())

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos)


@dataclass(frozen=True)
class Transfer:
    """One fetch as the dashboard lists it: ``bytes`` of verified blocks in
    ``seconds``; ``wire_bytes`` what crossed the wire (frames included; 0:
    not counted), ``raw_bytes`` the blocks' bytes whole (before a window trim or
    a codec), ``link_s`` connected to last byte in, ``connect_s`` connecting,
    ``codec`` the part codec used ("" none), ``trimmed`` whether sliding
    layers' positions outside the window were left out."""

    peer: str
    bytes: int
    seconds: float
    blocks: int
    at: float
    wire_bytes: int = 0
    raw_bytes: int = 0
    link_s: float = 0.0
    connect_s: float = 0.0
    codec: str = ""
    trimmed: bool = False

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def validated(hit: PeerHit, layout: Layout, tail_tokens: int) -> PeerHit:
    """``hit`` if its claimed length is exactly what its blocks hold (every block a
    full block of tokens, a tail of exactly the asked tail's tokens) and every
    announced size is one the card allows. A peer's ``matched_tokens`` alone never
    ranks a candidate or sizes an allocation."""
    block_tokens = layout.card.block_tokens
    if any(not 0 < i.nbytes <= layout.max_block_bytes for i in hit.infos):
        raise OversizePayload("a lookup answer announced a block larger than the card allows")
    if any(b.tokens != block_tokens for b in hit.blocks):
        raise MalformedPayload("a lookup answer's block does not hold a full block of tokens")
    if any(i.states for i in hit.infos) and not layout.card.state_every:
        raise MalformedPayload("a lookup answer claimed recurrent state on a card without any")
    if hit.tail is not None and hit.tail.tokens != tail_tokens:
        raise MalformedPayload("a lookup answer's tail does not match the asked tail")
    held = len(hit.blocks) * block_tokens + (hit.tail.tokens if hit.tail is not None else 0)
    if held != hit.tokens:
        raise MalformedPayload(f"a peer claimed {hit.tokens} tokens for blocks holding {held}")
    return hit
