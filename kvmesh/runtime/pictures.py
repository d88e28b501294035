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
(:meth:`PictureRows.publish`), the rows of every picture encoded here since are
kept in this node's store and published on the give-back thread, as a prompt's
blocks are.

A picture's rows are a chain of blocks of the model's rows card
(:meth:`~kvmesh.engine.vision.Vision.rows_card`: one namespace for every picture),
keyed by its media ids under the fleet key: the picture's digest, which hashes the
request's chain root, so a tenant's pictures are its own here too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..codec import Block, Layout
from ..compat import CompatCard
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from .audit import Taken
from .giveback import GiveBack
from .planner import LookupHooks
from .telemetry import Count

log = logging.getLogger("kvmesh.head")


class PictureRows:
    """The encoder rows of one vision engine's pictures, shared through ``fleet``."""

    def __init__(
        self,
        vision: Any,
        card: CompatCard,
        fleet: Fleet,
        hash_key: bytes | None = None,
        hooks: LookupHooks | None = None,
    ) -> None:
        """``vision``: the engine's :class:`~kvmesh.engine.vision.Vision`; ``card``:
        the model's; ``hooks``: how a lookup reports to the head's planner (a peer
        backed off is not waited for; one failing a lookup is backed off, so a frozen
        peer costs one picture its lookup deadline, not every picture)."""
        self.vision, self.card, self.fleet = vision, card, fleet
        self._hooks: LookupHooks | dict[str, Any] = hooks or {}
        self.rows_card = vision.rows_card(card)  # None: this model's rows are not shared
        if self.rows_card is not None:
            self.layout = Layout(self.rows_card)
            self.keyer = fleet.hold_rows(self.rows_card, hash_key)

    def acquire(self, tokens: Sequence[int], start: int) -> list[Taken]:
        """Take the rows of each picture a prefill of ``tokens`` from ``start`` would
        encode, where this node or a peer holds them. Returns those a peer served
        (what an audit may check). Never raises."""
        from_peers = []
        for digest, length in self.vision.needed(tokens, start) if self.rows_card else ():
            try:
                found = self._find(digest, length)
                if found is None:
                    continue
                blocks, hit = found
                self.vision.take(digest, length, blocks)
                if hit is not None:
                    from_peers.append(Taken(digest, self.card.kv_dtype, hit.node_id, hit.alias))
            except Exception as e:  # the cache never decides correctness: encode it
                log.debug("a picture's encoder rows were not taken: %r", e)
        return from_peers

    def _find(self, digest: bytes, length: int) -> tuple[list[Block], PeerHit | None] | None:
        """The chain of picture ``digest``'s rows blocks and the peer that served it:
        from this node's store (no peer), else from the first peer holding it all."""
        assert self.rows_card is not None
        keys = self.keyer.keys(self.vision.rows_tokens(digest, length, self.keyer.block_tokens))
        whole = len(keys.blocks) * keys.block_tokens
        here = self.fleet.local_prefix(keys)
        if len(here.blocks) == len(keys.blocks):
            return list(here.blocks), None
        hits, _ = self.fleet.lookup(self.rows_card, keys, **self._hooks)
        for hit in hits:
            if hit.tokens < whole or len(hit.blocks) < len(keys.blocks):
                continue
            got = self.fleet.fetch(self.layout, hit, 0, _ignore, self.fleet.fetch_deadline)
            got = got[: len(keys.blocks)]
            if [b.header.key for b in got] == list(keys.blocks):
                return got, hit
        return None

    def publish(self, give_back: GiveBack) -> None:
        """Hand the rows of the pictures encoded here since the last call to
        ``give_back`` (kept here and published off the request path, in a reserved
        slot; none free: dropped, as a prompt's blocks are)."""
        fresh = self.vision.fresh()
        if not fresh or self.rows_card is None or not give_back.reserve():
            return
        card = self.rows_card
        make = lambda: self._chains(card, fresh)  # noqa: E731  (run on the give-back thread)
        give_back.submit(make, Count.PICTURE_ROWS_BLOCKS, card=card)

    def _chains(self, card: CompatCard, fresh: Sequence[tuple[bytes, int]]) -> list[list[Block]]:
        """The rows chain of each picture in ``fresh`` still held."""
        chains = (self.vision.rows_blocks(card, self.keyer, d) for d, _ in fresh)
        return [c for c in chains if c]


def _ignore(_: Block) -> None:
    """A fetch's per-block hook: the blocks are taken whole, once all arrived."""
