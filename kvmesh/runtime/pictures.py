"""A vision head's encoder rows through the fleet: a picture encoded anywhere is not
encoded again.

Before a prompt is computed (off the engine thread, after its KV prefix is
acquired), :meth:`PictureRows.acquire` looks up each picture whose positions the
prompt computes and whose rows the engine does not hold
(:meth:`~kvmesh.engine.vision.Vision.needed`): in this node's store, then across the
fleet under the lookup's deadline, fetching the first hit within the fetch deadline;
the rows are verified as any block is (the card, the digest) and checked by the
engine before it holds them (:meth:`~kvmesh.engine.vision.Vision.take`). A picture
found nowhere, or any failure, is encoded as before (invariant 1). After a request
(:meth:`PictureRows.give_back`), the rows of every picture encoded here since are
kept in this node's store and published, never blocking.

A picture's rows are one block of the rows card for its length
(:meth:`~kvmesh.engine.vision.Vision.rows_card`), keyed by its media ids under the
fleet key: the picture's digest, which hashes the request's chain root, so a
tenant's pictures are its own here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..blocks import BlockKeyer
from ..codec import Block, Layout
from ..compat import CompatCard
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from .audit import Taken

log = logging.getLogger("kvmesh.head")


class PictureRows:
    """The encoder rows of one vision engine's pictures, shared through ``fleet``."""

    def __init__(
        self,
        vision: Any,
        card: CompatCard,
        fleet: Fleet,
        hash_key: bytes | None = None,
        avoided: Callable[[str], bool] | None = None,
    ) -> None:
        """``vision``: the engine's :class:`~kvmesh.engine.vision.Vision`; ``card``:
        the model's; ``avoided(peer)``: a peer not to wait for (backed off)."""
        self.vision, self.card, self.fleet = vision, card, fleet
        self._hash_key, self._avoided = hash_key, avoided
        self._cards: dict[int, tuple[CompatCard, Layout, BlockKeyer] | None] = {}
        self.fetched = 0  # pictures whose rows came from a peer
        self.published = 0

    def _for(self, length: int) -> tuple[CompatCard, Layout, BlockKeyer] | None:
        """The rows card of a ``length``-position picture, its layout and keyer."""
        if length not in self._cards:
            card = self.vision.rows_card(self.card, length)
            self._cards[length] = None
            if card is not None:
                keyer = self.fleet.hold_rows(card, self._hash_key)
                self._cards[length] = (card, Layout(card), keyer)
        return self._cards[length]

    def acquire(self, tokens: Sequence[int], start: int) -> list[Taken]:
        """Take the rows of each picture a prefill of ``tokens`` from ``start`` would
        encode, where this node or a peer holds them. Returns those a peer served
        (what an audit may check). Never raises."""
        from_peers = []
        for digest, ids in self.vision.needed(tokens, start):
            try:
                found = self._find(ids)
                if found is None:
                    continue
                block, hit = found
                self.vision.take(digest, block)
                if hit is not None:
                    self.fetched += 1
                    from_peers.append(Taken(digest, self.card.kv_dtype, hit.node_id, hit.alias))
            except Exception as e:  # the cache never decides correctness: encode it
                log.debug("a picture's encoder rows were not taken: %r", e)
        return from_peers

    def _find(self, ids: list[int]) -> tuple[Block, PeerHit | None] | None:
        """The block of a picture's rows (media ids ``ids``) and the peer that served
        it: from this node's store (no peer), else from the first peer holding it."""
        found = self._for(len(ids))
        if found is None:
            return None
        card, layout, keyer = found
        keys = keyer.keys(ids)
        here = self.fleet.local_prefix(keys)
        if here.blocks:
            return here.blocks[0], None
        hits, _ = self.fleet.lookup(card, keys, skip=self._avoided)
        for hit in hits:
            if hit.tokens < len(ids) or not hit.blocks:
                continue
            got = self.fleet.fetch(layout, hit, 0, lambda _: None, self.fleet.fetch_deadline)
            if got and got[0].header.key == keys.blocks[0]:
                return got[0], hit
        return None

    def give_back(self) -> int:
        """Keep here and publish the rows of every picture encoded here since the
        last call. Returns how many were published. Never raises."""
        sent = 0
        for digest, length in self.vision.fresh():
            try:
                found = self._for(length)
                if found is None:
                    continue
                card, _, keyer = found
                block = self.vision.rows_block(card, keyer, digest)
                if block is None:  # dropped from the engine's rows since
                    continue
                self.fleet.keep([block])
                self.fleet.publish(card, [block])
                sent += 1
            except Exception as e:  # sharing is optional
                log.debug("a picture's encoder rows were not published: %r", e)
        self.published += sent
        return sent
