"""One sequence's engine state (:class:`KVState`) and how imported blocks become
one (:class:`Importer`, :func:`check_chain`).

A state holds token ids, an opaque engine cache with KV for its first ``cached``
tokens, and the next-token logits (None until computed). Imported blocks are a
contiguous chain from the card's namespace, each checked against the card before
any byte is copied; their bytes become the cache's tensors unchanged
(invariant 2).

An importer opened with ``keep_from`` (:meth:`kvmesh.codec.Layout.keep_from`:
per layer, the first position the import needs) takes *trimmed* blocks: each
must carry at least the parts :meth:`~kvmesh.codec.Layout.want` names for it,
and only those are copied; a layer's positions before its ``keep_from`` are
never read (the engine's cache refuses to export or crop into them). Without
``keep_from`` every block must be whole.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..codec import Block, Layout, check_block
from ..errors import MalformedPayload


@dataclass
class KVState:
    """One sequence's state. ``cache`` holds KV for ``cached`` tokens, computed
    with LoRA ``adapter`` (its name on the engine; None: the base model)."""

    tokens: list[int]
    cache: Any
    logits: Any  # next-token logits after tokens[-1]
    cached: int
    imported_tokens: int = 0  # tokens whose KV came from blocks
    computed_tokens: int = 0  # tokens forward-passed by prefill
    used_stored_logits: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    adapter: str | None = None

    def view(self, n: int, logits: Any = None) -> KVState:
        """Its first ``n`` positions as a state of their own, on the same cache,
        with ``logits`` (None: none), computed with the same adapter: what is
        exported or kept of it."""
        return KVState(self.tokens[:n], self.cache, logits, n, adapter=self.adapter)


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
    checks the blocks.

    With ``keep_from`` (it needs ``layout``), layer ``i``'s positions before
    ``keep_from[i]`` are not imported: ``add`` takes a block that carries at
    least ``layout.want(header, keep_from)`` and ``_copy`` copies only the
    layers :meth:`wanted` names (a whole block's others are ignored)."""

    def __init__(
        self,
        n_tokens: int,
        layout: Layout | None = None,
        keep_from: Sequence[int] | None = None,
    ) -> None:
        if keep_from is not None:
            if layout is None:
                raise ValueError("keep_from needs the card's layout")
            if len(keep_from) != layout.card.num_layers:
                raise ValueError(
                    f"keep_from has {len(keep_from)} layers, the card {layout.card.num_layers}"
                )
            keep_from = tuple(int(lo) for lo in keep_from)
        self.n_tokens = n_tokens
        self.layout = layout
        self.keep_from: tuple[int, ...] | None = keep_from
        self.added = 0
        self._count = threading.Lock()

    def add(self, block: Block) -> None:
        h = block.header
        if self.layout is not None:
            check_block(block, self.layout)
        if h.start + h.tokens > self.n_tokens:
            raise MalformedPayload("block beyond the imported prefix")
        if self.keep_from is None:
            if not block.whole:
                raise MalformedPayload("a trimmed block where the import needs whole ones")
        else:
            assert self.layout is not None  # __init__ checked
            want = self.layout.want(h, self.keep_from)
            if block.present & want != want:
                raise MalformedPayload("block lacks parts the import needs")
        if h.tokens or h.states:  # an empty tail may carry the state at its start
            self._copy(block)
        with self._count:
            self.added += 1

    def wanted(self, block: Block) -> int:
        """The parts of ``block`` to copy: all of them without ``keep_from``."""
        if self.keep_from is None or self.layout is None:
            return block.present
        return self.layout.want(block.header, self.keep_from) & block.present

    def _spans(self, block: Block, lows: Sequence[int]) -> Iterator[tuple[int, Any, int, int]]:
        """``(layer, parts, skip, at)`` for each layer of ``block`` to copy that
        reaches past its low bound ``lows[layer]``: its K/V ``parts``, how many of
        the block's positions fall below the bound (dropped), and where the rest
        start in the layer's buffer (which begins at the bound)."""
        a, end = block.header.start, block.header.start + block.header.tokens
        want = self.wanted(block)
        for i, parts in block.kv_layers():
            if want >> i & 1 and end > lows[i]:
                skip = max(0, lows[i] - a)
                yield i, parts, skip, a + skip - lows[i]

    @abc.abstractmethod
    def _copy(self, block: Block) -> None:
        """Copy ``block``'s K/V (the layers :meth:`wanted` names:
        :meth:`Block.kv_layers`) into positions ``[start, start + tokens)``."""

    @abc.abstractmethod
    def cache(self) -> Any: ...
