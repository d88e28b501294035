"""Whether a head asks the fleet about a prompt that continues one of its live sessions.

A fleet lookup costs its round trip (every peer's answer, ~5-10 ms on a loaded
fleet) before the suffix is computed. For a prompt that continues a live session,
the fleet holds more than the session only if another node served a later turn of
the same conversation: never while a router keeps each conversation on its node
(``kv_aware``, ``cache_aware``), often under round-robin. :class:`LookupGate`
learns which from what the last :data:`WINDOW` such lookups found and skips one
when asking is not worth its cost:

    P(a peer holds more) * saving_s < lookup_s

``P`` is the window's rate of lookups that found a peer holding more (Laplace's
rule: never 0, so a large enough saving is always asked about), ``saving_s`` the
planner's cold time of the tokens the session lacks (what a fetch could save at
most), ``lookup_s`` the recent lookups' mean (an exponential average). Nothing is
skipped before :data:`MIN_SEEN` lookups were seen, and after :data:`EXPLORE_EVERY`
skips in a row one is asked anyway, so a change of routing is noticed. Only
session continuations are gated: a prompt held in the store (a shared system
prompt) or not at all is always asked about.

A skip never changes an answer (the suffix is computed, as after a lookup that
found nothing); it only forgoes a fetch the window says is unlikely. Thread-safe:
request threads share one gate.
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW = 16  # session lookups remembered
MIN_SEEN = 2  # lookups seen before any is skipped: a cost, and more than one outcome
EXPLORE_EVERY = 8  # skips in a row before one is asked anyway
COST_WEIGHT = 0.2  # the newest lookup's weight in the mean cost


class LookupGate:
    """See the module. ``ask`` decides (``act=False``: decide, change nothing);
    ``learn`` hears what an asked lookup found and took."""

    def __init__(self) -> None:
        self._found: deque[bool] = deque(maxlen=WINDOW)
        self._cost_s: float | None = None
        self._skips = 0  # in a row
        self._lock = threading.Lock()

    def ask(self, saving_s: float, act: bool = True) -> bool:
        """Whether to ask the fleet about a continuation lacking ``saving_s`` seconds
        of compute. With ``act``, a skip counts towards the next exploration."""
        with self._lock:
            worth = self._worth(saving_s)
            if act:
                self._skips = 0 if worth else self._skips + 1
            return worth

    def _worth(self, saving_s: float) -> bool:
        if len(self._found) < MIN_SEEN or self._cost_s is None or self._skips >= EXPLORE_EVERY:
            return True
        p = (sum(self._found) + 1) / (len(self._found) + 2)
        return p * saving_s >= self._cost_s

    def learn(self, found_more: bool, lookup_s: float) -> None:
        """An asked lookup's outcome: whether some peer held more than the session,
        and how long asking took."""
        with self._lock:
            self._found.append(found_more)
            old = self._cost_s
            self._cost_s = lookup_s if old is None else old + COST_WEIGHT * (lookup_s - old)
