"""A head's live sessions: finished prompts' states kept in memory, so the next
request sharing their prefix resumes one (a crop) instead of importing a copy.

At most ``max_sessions`` are kept, oldest given up first; each holds its KV in
the batch's budget (:class:`Budget`), and one that cannot fit is not kept. A
session belongs to a chain root (a tenant's cache) and a caller: a request sees
only sessions under its own root, another caller's only in whole blocks, so
token-exact reuse stays within one caller. Taking a session removes it: two
requests never extend one state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..compat import CompatCard
from ..engine import KVState
from .prefill import common_prefix


class Budget(Protocol):
    """Where sessions hold their KV bytes (the batch's KV budget)."""

    def reserve(self, nbytes: int) -> bool: ...

    def unreserve(self, nbytes: int) -> None: ...


@dataclass
class _Kept:
    state: KVState
    nbytes: int
    root: bytes
    client: str


class Sessions:
    def __init__(self, card: CompatCard, max_sessions: int, budget: Budget) -> None:
        self.card = card
        self.max_sessions = max_sessions
        self.budget = budget
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # oldest first
        self._next = 0

    def __len__(self) -> int:
        return len(self._kept)

    def best(
        self, tokens: Sequence[int], root: bytes | None = None, client: str = ""
    ) -> tuple[int, int] | None:
        """(id, tokens it can keep) of the session under ``root`` sharing the
        longest prefix with ``tokens``, at least one block; not taken yet."""
        best, best_len = None, 0
        root = root or self.card.namespace
        b = self.card.block_tokens
        with self._lock:
            for sid, kept in self._kept.items():
                if kept.root != root:
                    continue
                n = common_prefix(kept.state.tokens[: kept.state.cached], tokens)
                if kept.client != client:  # not the caller's own conversation
                    n -= n % b
                if n > best_len:
                    best, best_len = sid, n
        if best is None or best_len < b:
            return None
        return best, min(best_len, len(tokens) - 1)

    def prefix(self, tokens: Sequence[int], root: bytes | None = None, client: str = "") -> int:
        """Prompt tokens a session would give ``tokens`` now (0: none)."""
        best = self.best(tokens, root, client)
        return best[1] if best else 0

    def keep(self, state: KVState, root: bytes | None = None, client: str = "") -> None:
        """Keep ``state`` as ``client``'s session under ``root``, older ones giving way."""
        if self.max_sessions < 1:
            return
        nbytes = self.card.sequence_bytes(state.cached)
        with self._lock:
            while len(self._kept) >= self.max_sessions:
                self._forget_oldest()
            while not self.budget.reserve(nbytes):
                if not self._kept:
                    return
                self._forget_oldest()
            self._kept[self._next] = _Kept(state, nbytes, root or self.card.namespace, client)
            self._next += 1

    def take(self, sid: int) -> KVState | None:
        """Remove session ``sid`` (None: already taken or forgotten); the request
        resuming it holds its own share of the budget."""
        with self._lock:
            kept = self._kept.pop(sid, None)
        if kept is None:
            return None
        self.budget.unreserve(kept.nbytes)
        return kept.state

    def drop(self, nbytes: int) -> None:
        """Give back at least ``nbytes`` of the budget, oldest sessions first."""
        freed = 0
        with self._lock:
            while self._kept and freed < nbytes:
                freed += self._forget_oldest()

    def _forget_oldest(self) -> int:
        _, kept = self._kept.popitem(last=False)
        self.budget.unreserve(kept.nbytes)
        return kept.nbytes
