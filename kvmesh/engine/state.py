"""One sequence's engine state (:class:`KVState`) and how imported blocks become
one (:class:`Importer`, :func:`check_chain`).

A state holds token ids, an opaque engine cache with KV for its first ``cached``
tokens, and the next-token logits (None until computed). Imported blocks are a
contiguous chain from the card's namespace, each checked against the card before
any byte is copied; their bytes become the cache's tensors unchanged
(invariant 2).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..codec import Block, Layout, check_block
from ..errors import MalformedPayload


@dataclass
class KVState:
    """One sequence's state. ``cache`` holds KV for ``cached`` tokens."""

    tokens: list[int]
    cache: Any
    logits: Any  # next-token logits after tokens[-1]
    cached: int
    imported_tokens: int = 0  # tokens whose KV came from blocks
    computed_tokens: int = 0  # tokens forward-passed by prefill
    used_stored_logits: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def check_chain(prefix: Sequence[Block], layout: Layout, tokens: int, checked: bool = False) -> int:
    """Validate that ``prefix`` is a contiguous chain from the root whose every
    block is what ``layout``'s card says a block is (:func:`check_block`:
    namespace, token count, layer count, per-tensor dtypes and shapes, logits),
    whichever tier it came from; return its length in tokens. ``checked``: an
    importer with this layout already checked each block as it was added."""
    parent, pos = layout.card.namespace, 0
    for i, blk in enumerate(prefix):
        if not checked:
            check_block(blk, layout)
        h = blk.header
        if h.parent != parent or h.start != pos:
            raise MalformedPayload(f"block {i} does not continue the chain")
        if h.kind == "tail" and i != len(prefix) - 1:
            raise MalformedPayload("a tail must end the prefix")
        parent, pos = h.key, pos + h.tokens
    if pos > tokens:
        raise MalformedPayload("prefix longer than the prompt")
    return pos


class Importer(abc.ABC):
    """Preallocated KV for ``n_tokens`` positions. ``add`` may be called from any
    thread, in any order, once per block: blocks write disjoint positions.

    With ``layout``, ``add`` checks each block against it (:func:`check_block`)
    before anything is copied, so ``_copy`` may rely on the block holding exactly
    one tensor per buffer, of the card's dtype and shape, and a bad block (from
    any tier) writes nothing. Without one, only :func:`check_chain` at prefill
    checks the blocks."""

    def __init__(self, n_tokens: int, layout: Layout | None = None) -> None:
        self.n_tokens = n_tokens
        self.layout = layout
        self.added = 0
        self._count = threading.Lock()

    def add(self, block: Block) -> None:
        h = block.header
        if self.layout is not None:
            check_block(block, self.layout)
        if h.start + h.tokens > self.n_tokens:
            raise MalformedPayload("block beyond the imported prefix")
        if h.tokens or h.states:  # an empty tail may carry the state at its start
            self._copy(block)
        with self._count:
            self.added += 1

    @abc.abstractmethod
    def _copy(self, block: Block) -> None:
        """Copy ``block``'s K/V (:meth:`Block.kv_tensors`, one per buffer, in
        order) into positions ``[start, start + tokens)``."""

    @abc.abstractmethod
    def cache(self) -> Any: ...
