"""Where prefixes live and whom to fetch them from: one policy, plain functions.

The peers' client (:mod:`.client`), their server (:mod:`.server`) and the
simulation (``bench/scale_sim.py``) all call these functions; none keeps a copy.

- **Owners.** The ``k`` owners of a key are its highest rendezvous scores
  (:func:`rendezvous`), computed alike by every node from the live cache peers.
- **Placement by the first block that differs** (:func:`place_index`). A chain
  (its full blocks, then its tail) is first offered to the owners of its root
  block; what they already hold is the part it shares with chains placed before
  it (a chat template, a system prompt). The chain goes to the owners of its
  first block they do *not* hold, so distinct conversations behind one preamble
  land on different peers, while the root's owners keep answering the preamble.
  A lookup mirrors it: ask the root's owners, then the owners of the first block
  they lack: two rounds of ``k`` owners (plus one spare in the first).
- **Popularity-driven replicas** (:class:`Popularity`, :func:`replicas_for`).
  A holder counts the lookups its stored prefixes answer over a sliding window;
  a prefix above ``Policy.hot_rate`` is asked to be held by ``r`` more peers, ``r``
  growing with its rate, at the first ``r`` rendezvous ranks of its deepest block
  (:func:`replica_ranks`). A lookup that meets a hot answer probes one of those
  ranks (:func:`probe_rank`); when the probed rank lacks the prefix, the head
  that fetched it gives a copy to it and to more ranks that lack it (:func:`repair_ranks`;
  ordinary verified blocks: nothing about trust changes). When the prefix cools, ``r`` falls, nobody probes the extra ranks,
  and their copies age out of the LRU like any block.
- **Load-aware choice** (:func:`by_load`): among holders of the longest prefix
  the fetch goes to the least loaded (measured fetch rate, then RTT). A hot
  prefix's owners go last when the probed replica holds it: they answer every
  lookup for it and would otherwise win most choices; the replicas, one probed
  at random per lookup, share its fetches evenly.

A lookup therefore costs at most ``2k + 2`` messages at any fleet size.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

MAX_REPLICAS = 256  # the most extra holders a hot answer may ask for (a claim is capped here)
REPAIR_FANOUT = 16  # copies a fetcher sends after a probe that missed
REPAIR_CHECKS = 4 * REPAIR_FANOUT  # ranks it may ask (quiet lookups) to find that many


@dataclass(frozen=True)
class Policy:
    """The placement policy's knobs (the defaults are what the peers run)."""

    deep: bool = True  # place by the first block the root's owners lack (else the root)
    replicate: bool = True  # popularity-driven replicas and the probe of one of them
    by_load: bool = True  # fetch from the least loaded holder (else the first that answered)
    window_s: float = 2.0  # the popularity window
    hot_rate: float = 4.0  # lookups/s over the window before a prefix gets a replica
    per_replica_rate: float = 1.0  # one more holder for every this many lookups/s
    max_replicas: int = MAX_REPLICAS


DEFAULT = Policy()


def rendezvous(root: bytes, node_ids: Sequence[str], k: int) -> list[str]:
    """The ``k`` owners of a key: highest SHA-256(key || node id) first."""
    score = {n: hashlib.sha256(root + n.encode()).digest() for n in node_ids}
    return sorted(node_ids, key=lambda n: score[n], reverse=True)[:k]


def place_index(chain_len: int, root_held: int, policy: Policy = DEFAULT) -> int | None:
    """Which element of a chain (full blocks, then its tail) names the owners that
    hold it, given how many leading elements the root's owners hold: the first
    one they lack. None: the root's owners themselves (they hold nothing of it
    yet, or all of it, or the policy places by the root)."""
    if not policy.deep or not 0 < root_held < chain_len:
        return None
    return root_held


def replicas_for(rate: float, policy: Policy = DEFAULT) -> int:
    """Extra holders a prefix looked up ``rate`` times per second should have."""
    if rate < policy.hot_rate or not policy.replicate:
        return 0
    return min(policy.max_replicas, math.ceil(rate / policy.per_replica_rate))


def replica_ranks(key: bytes, node_ids: Sequence[str], replicas: int) -> list[str]:
    """The peers asked to hold a hot prefix whose deepest block is ``key``."""
    return rendezvous(key, node_ids, min(replicas, MAX_REPLICAS))


def probe_rank(ranks: Sequence[str], asked: Sequence[str], rng: random.Random) -> str | None:
    """One of a hot prefix's replica ``ranks`` not asked yet, at random (None: none)."""
    seen = set(asked)
    left = [n for n in ranks if n not in seen]
    return rng.choice(left) if left else None


def repair_ranks(ranks: Sequence[str], probed: str, rng: random.Random) -> list[str]:
    """The replica ranks a fetcher offers a copy when the probed rank lacked the
    prefix, in the order it offers them: that rank, then the others at random (at
    most ``REPAIR_CHECKS``). Each is asked first what it holds; the fetcher stops
    once ``REPAIR_FANOUT`` lacked it and got a copy, so the owner serves about
    ``r / REPAIR_FANOUT`` fetches while ``r`` ranks fill, not one per rank."""
    others = [n for n in ranks if n != probed]
    return [probed, *rng.sample(others, min(REPAIR_CHECKS - 1, len(others)))]


def by_load(
    holders: Sequence[str],
    load: Callable[[str], float],
    rtt: Callable[[str], float] | None = None,
    policy: Policy = DEFAULT,
    rng: random.Random | None = None,
    shed: Collection[str] = (),
) -> list[str]:
    """Holders of one prefix, least loaded first, then lowest RTT, then at random
    (ties must not all go to one). ``shed`` go last: the owners of a hot prefix a
    replica also holds. An owner answers every lookup for its prefix, so if it
    also took every fetch it looked least loaded by (the probed replica is one
    random rank of many, seldom busier than the owner), it would serve several
    times what any replica does. Without ``policy.by_load``: the order they
    answered in."""
    if not policy.by_load:
        return list(holders)
    r = rng or random
    ranked = [
        (n in shed, load(n), rtt(n) if rtt is not None else 0.0, r.random(), n) for n in holders
    ]
    return [n for *_, n in sorted(ranked)]


class Rate:
    """Events per second over a sliding window (two buckets, interpolated: O(1)).
    Within its first window a rate is measured over the time since it began (at
    least half a window), so a prefix that turns hot at once is seen at once."""

    __slots__ = ("window", "_born", "_start", "_now", "_prev")

    def __init__(self, window_s: float, now: float) -> None:
        self.window = window_s
        self._born = self._start = now
        self._now = self._prev = 0

    def _roll(self, now: float) -> None:
        passed = int((now - self._start) // self.window)
        if passed >= 1:
            self._prev = self._now if passed == 1 else 0
            self._now = 0
            self._start += passed * self.window

    def add(self, now: float, n: int = 1) -> None:
        self._roll(now)
        self._now += n

    def per_s(self, now: float) -> float:
        self._roll(now)
        if self._start == self._born:  # the first window: no earlier bucket to weigh
            return self._now / max(now - self._born, self.window / 2)
        frac = (now - self._start) / self.window
        return (self._prev * (1.0 - frac) + self._now) / self.window


class Popularity:
    """Lookups answered per prefix (its deepest matched block's key), over a sliding
    window, for at most ``max_keys`` prefixes (the least recently seen forgotten).
    Thread-safe: a server counts on its loop while metrics read from another thread."""

    def __init__(
        self,
        policy: Policy = DEFAULT,
        clock: Callable[[], float] | None = None,
        max_keys: int = 4096,
    ) -> None:
        self._lock = threading.Lock()
        self.policy = policy
        self._clock = clock or time.monotonic
        self.max_keys = max_keys
        self._rates: OrderedDict[bytes, Rate] = OrderedDict()

    def hit(self, key: bytes, now: float | None = None) -> int:
        """Count one lookup answered with the prefix ending at ``key``; the extra
        holders it should now have."""
        t = self._clock() if now is None else now
        with self._lock:
            r = self._rates.get(key)
            if r is None:
                r = self._rates[key] = Rate(self.policy.window_s, t)
                while len(self._rates) > self.max_keys:
                    self._rates.popitem(last=False)
            self._rates.move_to_end(key)
            r.add(t)
            return replicas_for(r.per_s(t), self.policy)

    def rate(self, key: bytes, now: float | None = None) -> float:
        t = self._clock() if now is None else now
        with self._lock:
            r = self._rates.get(key)
            return 0.0 if r is None else r.per_s(t)

    def hot(self, now: float | None = None) -> Mapping[bytes, int]:
        """Every tracked prefix with extra holders, and how many."""
        t = self._clock() if now is None else now
        with self._lock:
            out = {k: replicas_for(r.per_s(t), self.policy) for k, r in self._rates.items()}
        return {k: n for k, n in out.items() if n}
