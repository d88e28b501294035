"""Where prefixes live and whom to fetch them from: one policy, and its composition.

The client (:mod:`.client`), the server (:mod:`.server`) and the simulation
(``bench/scale_sim.py``) all call these functions; none keeps a copy. How a
lookup, a publish and a repair combine them is written once, here
(:func:`locate`, :func:`place`, :func:`offer`): each takes the asking as a
callback, so the client asks peers over the network and the simulation asks
nodes in memory.

- **Owners.** The ``k`` owners of a key are its highest rendezvous scores
  (:func:`rendezvous`), computed alike by every node from the live cache peers.
  A fleet of at most ``ASK_ALL_BELOW`` is asked in full.
- **Placement by the first block that differs** (:func:`place_index`). A chain
  (its full blocks, then its tail) is first offered to the owners of its root
  block; what they already hold is the part it shares with chains placed before
  it (a chat template, a system prompt). The chain goes to the owners of its
  first block they do *not* hold, so distinct conversations behind one preamble
  land on different peers. A lookup mirrors it: the root's ``k + 1`` owners, then
  the ``k`` owners of the first block they lack.
- **Popularity-driven replicas** (:class:`Popularity`, :func:`replicas_for`).
  A holder counts the lookups its stored prefixes answer over a sliding window;
  a prefix above ``Policy.hot_rate`` asks for ``r`` more holders, ``r`` growing
  with its rate: the first ``r`` rendezvous ranks of its deepest block
  (:func:`replica_ranks`). A lookup that meets a hot answer probes one of those
  ranks (:func:`probe_rank`); when it lacks the prefix, the fetcher gives copies
  to ranks that lack it (:func:`repair_ranks`). When the prefix cools, nobody
  probes the extra ranks and their copies age out of the LRU like any block.
- **Load-aware choice** (:func:`by_load`): among holders of the longest prefix
  the fetch goes to the least loaded (measured fetch rate, then RTT). A hot
  prefix's owners go last when the probed replica holds it.

A lookup therefore costs at most ``2k + 2`` messages at any fleet size.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

ASK_ALL_BELOW = 8  # fleets this small are asked in full: a lookup is ~1 ms and metadata only
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


def ranking(node_ids: Sequence[str]) -> Ranked:
    """``ranked(key)`` over ``node_ids``: all of them, in rendezvous order of ``key``."""
    ids = list(node_ids)
    return lambda key: rendezvous(key, ids, len(ids))


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


@dataclass(frozen=True)
class Answer:
    """What placement needs of one peer's lookup answer that holds something."""

    node: str
    held: int  # leading elements of the chain it holds (full blocks, then the tail)
    blocks: int  # ... of them full blocks
    replicas: int = 0  # extra holders it says the prefix should have


@dataclass
class Located:
    """What :func:`locate` learned: whom it asked, what they hold, and what a fetch
    from them owes."""

    asked: list[str] = field(default_factory=list)  # in order, skipped ones included
    answers: list[Answer] = field(default_factory=list)
    shed: set[str] = field(default_factory=set)  # owners to choose last: a replica holds it
    repair: tuple[str, ...] = ()  # replica ranks lacking it: given copies by a fetcher of...
    owed: frozenset[str] = frozenset()  # ... these holders' prefix
    probed: str | None = None  # the replica rank asked

    @property
    def best(self) -> int:
        """The most elements of the chain any answer holds."""
        return max((a.held for a in self.answers), default=0)


#: ``ask(candidates, want)``: ask the first ``want`` of ``candidates`` in order, one
#: more for each that fails or is skipped; the node ids asked, and the answers
#: that hold something.
Ask = Callable[[Sequence[str], int], Awaitable[tuple[list[str], list[Answer]]]]
#: ``ranked(key)``: every candidate in rendezvous order of ``key``.
Ranked = Callable[[bytes], Sequence[str]]


async def locate(
    chain: Sequence[bytes],
    ranked: Ranked,
    ask: Ask,
    k: int,
    policy: Policy = DEFAULT,
    rng: random.Random | None = None,
    may_probe: Callable[[str], bool] | None = None,
) -> Located:
    """Ask for ``chain`` (its elements' keys) where the policy puts it: a small
    fleet in full; else the root's ``k + 1`` owners, then the ``k`` owners of the
    first element they lack, then a replica rank of a hot prefix
    (:func:`probe_replica`, unless ``may_probe`` says no)."""
    found = Located()
    everyone = ranked(chain[0])
    if len(everyone) <= ASK_ALL_BELOW:
        await _ask(found, ask, everyone, len(everyone))
        return found
    await _ask(found, ask, everyone, k + 1)
    deep = place_index(len(chain), found.best, policy)
    if deep is not None:  # the chain lives with the first element the root's owners lack
        await _ask(found, ask, [n for n in ranked(chain[deep]) if n not in found.asked], k)
    if policy.replicate and found.answers:
        await probe_replica(found, chain, ranked, ask, rng or random.Random(), may_probe)
    return found


async def _ask(found: Located, ask: Ask, candidates: Sequence[str], want: int) -> list[Answer]:
    asked, answers = await ask(candidates, want)
    found.asked += asked
    found.answers += answers
    return answers


async def probe_replica(
    found: Located,
    chain: Sequence[bytes],
    ranked: Ranked,
    ask: Ask,
    rng: random.Random,
    may_probe: Callable[[str], bool] | None = None,
) -> None:
    """When the longest answers' prefix is hot, ask one of its replica ranks too (a
    second holder to choose from by load). If that rank holds it, everyone asked
    before goes last (``shed``); if not, a fetch from the longest answers owes
    copies to the ranks :func:`repair_ranks` names (``repair``, ``owed``)."""
    top = [a for a in found.answers if a.held == found.best and a.blocks]
    replicas = min(max((a.replicas for a in top), default=0), MAX_REPLICAS)
    if not replicas:
        return
    n_blocks = top[0].blocks
    ranks = list(ranked(chain[n_blocks - 1])[:replicas])  # replica_ranks of the prefix's key
    node = probe_rank(ranks, found.asked, rng)
    if node is None or (may_probe is not None and not may_probe(node)):
        return
    owners, found.probed = set(found.asked), node
    if any(a.blocks >= n_blocks for a in await _ask(found, ask, [node], 1)):
        found.shed = owners
    else:
        found.repair = tuple(repair_ranks(ranks, node, rng))
        found.owed = frozenset(a.node for a in top)


def holders(
    answers: Sequence[Answer],
    load: Callable[[str], float],
    rtt: Callable[[str], float] | None = None,
    policy: Policy = DEFAULT,
    rng: random.Random | None = None,
    shed: Collection[str] = (),
) -> list[str]:
    """The answers' nodes, longest first; among those of one length :func:`by_load`
    (without ``policy.by_load``, in the order given)."""
    out: list[str] = []
    longest_first = sorted(answers, key=lambda a: -a.held)
    for _, group in itertools.groupby(longest_first, key=lambda a: a.held):
        out += by_load([a.node for a in group], load, rtt, policy, rng, shed)
    return out


@dataclass(frozen=True)
class Placed:
    """Where a computed chain goes: to the first ``k`` of ``targets`` that answer."""

    targets: list[str]
    known: dict[str, int]  # what some targets are known to hold already
    deep: bool  # placed by an element after the root


async def place(
    chain: Sequence[bytes],
    ranked: Ranked,
    held: Callable[[str], Awaitable[int | None]],
    policy: Policy = DEFAULT,
) -> Placed | None:
    """Where a computed ``chain`` goes (:func:`place_index`): the first root owner
    whose ``held`` answers (None: it did not) says how much of it the root holds;
    the chain goes to the owners of the first element it lacks, or to the root's
    owners from that one on. None when no owner answered."""
    owners = ranked(chain[0])
    for i, node in enumerate(owners):
        have = await held(node)
        if have is None:
            continue
        deep = place_index(len(chain), have, policy)
        if deep is None:  # from the one that answered: those before it failed just now
            return Placed(list(owners[i:]), {node: have}, False)
        return Placed(list(ranked(chain[deep])), {}, True)
    return None


async def offer(
    targets: Sequence[str],
    want: int,
    chain_len: int,
    held: Callable[[str], Awaitable[int | None]],
    send: Callable[[str, int], Awaitable[bool]],
    known: Mapping[str, int] | None = None,
    missing: bool = False,
) -> int:
    """Give a chain to the first ``want`` of ``targets`` that answer, each only the
    part it lacks: ``held(node)`` says how many leading elements it holds (None: no
    answer) unless ``known`` does; ``send(node, have)`` gives the rest (False: it
    failed). With ``missing`` only those that lacked some count. How many counted."""
    done = 0
    for node in targets:
        if done >= want:
            break
        have = (known or {}).get(node)
        if have is None:
            have = await held(node)
        if have is None:
            continue
        if have < chain_len:
            if not await send(node, have):
                continue
        elif missing:
            continue
        done += 1
    return done


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
