"""The one acquisition core: how any engine (the head, the vLLM connector) gets a
prompt's prefix.

*Acquire* (:meth:`Acquirer.acquire`), each step once, for every caller:

1. **held**: the longest prefix in this node's store (RAM, then disk) and, for
   the head, its live session's (a session wins a tie: resuming is a crop);
2. **candidates**: when more of the prompt is wanted, the fleet's validated
   hits, longest first, from usable peers (backed-off ones are not waited for),
   holding more than is held;
3. **fetch**: each candidate in turn while the cache-time budget lasts
   (:meth:`Acquirer.budget` less the lookup's time): skipped when the planner
   says computing is cheaper, else streamed, verified block by block, into a
   sink the caller opens. A failure is counted, backs the peer off when it is
   the peer's (:meth:`Planner.fetch_failed`), and the next candidate is tried. A
   fetch teaches the planner the peer's and the import's bandwidth; a fetched
   chain that continues the stored one is kept here. Stored blocks are imported
   through :meth:`Acquirer.imported` too, so the planner learns local imports.

:meth:`Acquirer.plan` goes through the same decision (``_decide``) acting on
nothing: the store read from its index, untouched; the fleet asked only where
acquire would ask it; the planner taught nothing; the first candidate acquire
would stream taken as fetched. ``/v1/cache/query`` answers with it. A paged
caller's limits are :class:`PageLimits`. Outcomes are
:class:`~.telemetry.Source` members, reasons :class:`~kvmesh.errors.Reason`
members (:func:`~.planner.failure_reason`), counters typed in :mod:`.telemetry`.
Giving computed chains back is :mod:`.giveback`'s; which codec a fetch asks for,
:mod:`.calibrate`'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..blocks import PrefixKeys
from ..codec import Block, Layout
from ..compat import CompatCard
from ..errors import Reason
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from ..mesh.transport import StreamTimes, Want
from ..store import Match, Peek
from .calibrate import Calibrator
from .lookup_gate import LookupGate
from .planner import Attempt, Choice, Planner, failure_reason
from .telemetry import Count, Family, Source, Tally, labelled

MIN_CACHE_BUDGET_S = 0.2  # a fast model still tolerates a scheduling hiccup


class Sink(Protocol):
    """Where a fetch puts verified blocks (an engine's importer, a page table)."""

    def add(self, blk: Block, /) -> object: ...


#: ``open_sink(hit, held, keep_from)``: where a fetch from ``hit`` puts its blocks;
#: ``held`` are the local blocks (from the root) the fetched ones continue;
#: ``keep_from`` (None: whole blocks) the parts the fetched blocks carry at least
#: (:meth:`kvmesh.codec.Layout.keep_from` of the import's length).
OpenSink = Callable[[PeerHit, tuple[Block, ...], tuple[int, ...] | None], Sink]


@dataclass
class Candidates:
    """What the fleet offers beyond ``have`` tokens: usable hits, longest first."""

    hits: list[PeerHit] = field(default_factory=list)
    lookup_s: float = 0.0
    fallback: str | None = None  # why some peer did not answer (the first reason)
    offered: list[PeerHit] = field(default_factory=list)  # every hit, as its peer answered


@dataclass
class Fetched:
    """The outcome of :meth:`Acquirer.fetch`: the hit that worked and its blocks
    (from ``start``), or ``hit is None`` and why the last try failed. A plan's:
    the hit it would stream, what it would ask for and the choice; no blocks."""

    hit: PeerHit | None = None
    sink: Any = None  # what ``open_sink`` returned for the hit that worked
    blocks: list[Block] = field(default_factory=list)
    nbytes: int = 0
    fetch_s: float = 0.0
    fallback: str | None = None
    times: StreamTimes = field(default_factory=StreamTimes)  # the working stream's stages
    want: Want = field(default_factory=Want)  # what the working stream asked for
    choice: Choice | None = None  # the planner's last fetch-or-compute choice


@dataclass(frozen=True)
class _Held:
    """What this node holds of a prompt before the fleet is asked: read (acquire)
    or from the store's index (plan, ``match`` unread)."""

    tokens: int
    whole: bool  # it ends on a stored tail
    disk: bool  # some of it is on the disk tier only
    blocks: int  # whole blocks from the root
    match: Match = field(default_factory=lambda: Match((), None))

    @property
    def start(self) -> int:
        """The chain index a fetch starts from: after the stored whole blocks, or
        from the root after a stored tail (a tail is matched token-exactly)."""
        return 0 if self.whole else self.blocks

    @staticmethod
    def read(local: Match) -> _Held:
        tail = local.tail is not None
        return _Held(local.tokens, tail, local.from_disk, len(local.blocks), local)

    @staticmethod
    def peeked(peek: Peek, block_tokens: int) -> _Held:
        disk = peek.tokens > peek.ram_tokens
        return _Held(peek.tokens, peek.whole, disk, peek.tokens // block_tokens)


#: ``attempt(hit, left, want, out)``: stream ``hit`` within ``left`` seconds asking
#: for ``want``, filling ``out``; True when it worked (None: a plan, acting on nothing).
_Attempt = Callable[[PeerHit, float, Want, Fetched], bool]


@dataclass
class Acquired:
    """Where a prompt's prefix comes from: what :meth:`Acquirer.acquire` did, or
    what :meth:`Acquirer.plan` would do (nothing fetched, ``local`` unread)."""

    source: Source = Source.COMPUTE
    tokens: int = 0  # prompt tokens ``source`` holds from the start
    whole: bool = False  # they end on a stored tail (its logits: nothing to compute)
    fallback: str | None = None  # why no peer's prefix is used, when one was sought
    hit: PeerHit | None = None  # the peer fetched from (plan: the first it would stream)
    local: Match = field(default_factory=lambda: Match((), None))  # the stored chain read
    start: int = 0  # the chain index a fetch starts from
    fetched: Fetched = field(default_factory=Fetched)  # (plan: its want and choice only)
    sought: bool = False  # the fleet was asked (less than is wanted was held)
    lookup_s: float = 0.0
    offered: list[PeerHit] = field(default_factory=list)  # every peer's validated hit

    @property
    def prefix(self) -> tuple[Block, ...]:
        """The acquired chain from the root (blocks, then a tail); () for a session."""
        if self.source == Source.REMOTE:
            return self.local.blocks[: self.start] + tuple(self.fetched.blocks)
        if self.source in (Source.LOCAL, Source.DISK):
            return self.local.all()
        return ()


def wire_bytes(layout: Layout, hit: PeerHit, start: int, keep: tuple[int, ...] | None) -> int:
    """The bytes a fetch of ``hit``'s blocks from ``start`` moves when each carries
    only the parts an import with ``keep`` needs (its announced sizes without the
    sliding layers' blocks before their windows)."""
    total, b = 0, layout.card.block_tokens
    for j, info in enumerate(hit.infos[start:], start):
        total += info.nbytes
        if keep is None:
            continue
        end = j * b + info.tokens
        for lo, specs in zip(keep, layout.layers(info.tokens), strict=True):
            if end <= lo:
                total -= sum(t.nbytes for t in specs)
    return max(total, 0)


def _importable(card: CompatCard, hit: PeerHit) -> PeerHit:
    """``hit`` cut to what an import can end on (the blocks past it would be fetched
    for nothing): a hybrid's chain without a tail ends on its last block that
    carries the state (a grid checkpoint, or one the answer flags); a deterministic
    card's on its prefill grid, tail or not (the positions past the grid are
    recomputed as a cold prompt computes them)."""
    if not card.prefill_grid and (hit.tail is not None or not card.state_every):
        return hit
    n = card.importable_blocks(len(hit.blocks), [b.states for b in hit.blocks])
    if n == len(hit.blocks) and hit.tail is None:
        return hit
    return dataclasses.replace(hit, blocks=hit.blocks[:n], tokens=n * card.block_tokens, tail=None)


@dataclass(frozen=True)
class PageLimits:
    """What a paged caller (the vLLM connector) may load: at most ``limit`` whole
    blocks, never a tail (it computes the rest). ``cut_hit`` cuts a candidate
    further, ``cut_held`` says how many of the stored blocks an import can take
    (e.g. up to the last page that carries a recurrent state)."""

    limit: int
    cut_hit: Callable[[PeerHit], PeerHit] | None = None
    cut_held: Callable[[Sequence[Block]], int] | None = None

    def held(self, local: Match) -> Match:
        """The stored chain cut to what may be loaded."""
        blocks = local.blocks[: self.limit]
        if self.cut_held is not None:
            blocks = blocks[: self.cut_held(blocks)]
        return Match(blocks, None, min(local.disk_blocks, len(blocks)))

    def hit(self, hit: PeerHit, block_tokens: int) -> PeerHit:
        """A candidate cut to what may be loaded."""
        n = min(len(hit.blocks), self.limit)
        if n < len(hit.blocks) or hit.tail is not None:
            hit = dataclasses.replace(
                hit, blocks=hit.blocks[:n], tail=None, tokens=n * block_tokens
            )
        return self.cut_hit(hit) if self.cut_hit is not None else hit


def _choose(session: int, tokens: int, whole: bool, disk: bool) -> Acquired:
    """The better of a live session's ``session`` tokens and the local store's
    ``tokens`` (a session wins a tie: resuming is a crop, importing a copy)."""
    if session and session >= tokens:
        return Acquired(Source.SESSION, session)
    if tokens:
        return Acquired(Source.DISK if disk else Source.LOCAL, tokens, whole)
    return Acquired()


class Acquirer:
    """Local store, fleet candidates, planned verified fetch: see the module.
    Without a fleet (prefix reuse off, no node) only a session is ever held."""

    def __init__(
        self,
        fleet: Fleet | None,
        planner: Planner,
        count: Tally,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.fleet = fleet
        self.planner = planner
        self.count = count
        self.calibrator = calibrator or Calibrator()  # which codec a fetch asks for
        self.gate = LookupGate()  # whether a session's continuation is worth a lookup

    def acquire(
        self,
        layout: Layout,
        keys: PrefixKeys,
        open_sink: OpenSink,
        *,
        session: int = 0,
        pages: PageLimits | None = None,
        on_looked_up: Callable[[], None] | None = None,
        on_start: Callable[[PeerHit], None] | None = None,
        owner: str | None = None,
    ) -> Acquired:
        """The prefix of the prompt ``keys`` name: held here (a live session of
        ``session`` tokens, the local store) or fetched from the first candidate
        worth it (see the module). ``open_sink`` (:data:`OpenSink`) raising is our
        failure: the next candidate is tried. ``pages``: what a paged caller may
        load (:class:`PageLimits`); None: the whole prompt, its tail included.
        ``on_looked_up`` hears when the candidates are known, ``on_start`` of each
        stream as it begins; blocks kept here count against ``owner``'s tenant
        budget. A cache failure is never raised: it is ``fallback``."""
        local = self.local(keys)
        if pages is not None:
            local = pages.held(local)
        held = _Held.read(local)
        continued = local.blocks[: held.start]  # the stored blocks a fetch continues

        def sink(hit: PeerHit, keep: tuple[int, ...] | None) -> Sink:
            return open_sink(hit, continued, keep)

        def attempt(hit: PeerHit, left: float, want: Want, out: Fetched) -> bool:
            start = held.start
            return self._try(layout, hit, local, start, left, sink, on_start, out, owner, want)

        return self._decide(layout, keys, held, session, pages, attempt, on_looked_up)

    def plan(self, layout: Layout, keys: PrefixKeys, *, session: int = 0) -> Acquired:
        """What :meth:`acquire` (of the whole prompt) would do now, through the same
        decision, acting on nothing: the local store read from its index
        (untouched), the fleet asked only where acquire would ask it, the planner
        taught nothing, and the first candidate acquire would stream taken as
        fetched (``hit``; ``fetched`` holds only what it would ask for)."""
        peek = self.fleet.peek(keys) if self.fleet is not None else Peek(0, 0, False)
        held = _Held.peeked(peek, keys.block_tokens)
        return self._decide(layout, keys, held, session, None, None, None)

    def _decide(
        self,
        layout: Layout,
        keys: PrefixKeys,
        held: _Held,
        session: int,
        pages: PageLimits | None,
        attempt: _Attempt | None,
        on_looked_up: Callable[[], None] | None,
    ) -> Acquired:
        """The one decision (see the module) from what is ``held``: the better of it
        and the session; the fleet asked when more is wanted; its candidates walked
        within the budget (:meth:`_walk`), each streamed by ``attempt`` (None: a
        plan, the first worth fetching taken)."""
        out = _choose(session, held.tokens, held.whole, held.disk)
        out.local = held.match
        if not self._seeks(out.tokens, keys, pages):
            return out
        continues = out.source == Source.SESSION
        if continues and not self._worth_asking(keys, out.tokens, act=attempt is not None):
            return out
        found = self._candidates(layout.card, keys, out.tokens, pages, teach=attempt is not None)
        if continues and attempt is not None:
            self.gate.learn(bool(found.hits), found.lookup_s)
        if on_looked_up is not None:
            on_looked_up()
        out.sought, out.lookup_s, out.offered = True, found.lookup_s, found.offered
        out.start = held.start
        budget = self.budget(self._wanted(keys, pages)) - found.lookup_s
        trims = pages is None  # a paged caller recomputes windows: whole blocks
        walk = self._walk(layout, found.hits, out.start, out.tokens, budget, trims, attempt)
        out.fetched = walk
        if walk.hit is None:
            out.fallback = walk.fallback or found.fallback
            return out
        out.source, out.tokens, out.hit = Source.REMOTE, walk.hit.tokens, walk.hit
        out.whole = walk.hit.tail is not None
        return out

    def _worth_asking(self, keys: PrefixKeys, have: int, act: bool) -> bool:
        """Whether the fleet is asked about a session's continuation holding ``have``
        tokens (:class:`.lookup_gate.LookupGate`; always under a planner's ``force``,
        which overrides every cost comparison); a skip is counted when ``act``."""
        if self.planner.force is not None:
            return True
        ask = self.gate.ask(self.planner.cold_s(keys.n_tokens - have), act)
        if not ask and act:
            self.count(Count.LOOKUP_SKIPPED)
        return ask

    def local(self, keys: PrefixKeys) -> Match:
        return self.fleet.local_prefix(keys) if self.fleet is not None else Match((), None)

    def budget(self, n_tokens: int) -> float:
        """Seconds all remote fetches of one request may take: the estimated cold
        prefill of the prompt (a fetch slower than that is not worth waiting for),
        at least :data:`MIN_CACHE_BUDGET_S`, at most the fetch deadline."""
        assert self.fleet is not None
        floor = max(self.planner.cold_s(n_tokens), MIN_CACHE_BUDGET_S)
        return min(self.fleet.fetch_deadline, floor)

    def _seeks(self, have: int, keys: PrefixKeys, pages: PageLimits | None = None) -> bool:
        """Whether the fleet is asked: there is one, and ``have`` tokens are less
        than is wanted (every page; else all but the last token, computed anyway)."""
        if self.fleet is None:
            return False
        return have < (keys.n_tokens - 1 if pages is None else pages.limit * keys.block_tokens)

    @staticmethod
    def _wanted(keys: PrefixKeys, pages: PageLimits | None) -> int:
        """The tokens a fetch could save: the budget's measure."""
        return keys.n_tokens if pages is None else pages.limit * keys.block_tokens

    def candidates(
        self, card: CompatCard, keys: PrefixKeys, have: int, teach: bool = True
    ) -> Candidates:
        """The fleet's validated hits holding more than ``have`` tokens, from usable
        peers, longest first. Backed-off peers are not waited for; with ``teach``,
        a peer failing its lookup is backed off, one answering forgiven. Never
        raises: a failed lookup is no candidate."""
        assert self.fleet is not None
        t0 = time.perf_counter()
        if teach:
            hits, errors = self.fleet.lookup(card, keys, **self.planner.lookup_hooks(self.count))
        else:
            hits, errors = self.fleet.lookup(card, keys, skip=self.planner.avoided)
        offered = list(hits)
        hits = [_importable(card, h) for h in hits]
        usable = [h for h in hits if h.tokens > have and self.planner.usable(h.node_id)]
        fallback = errors[0] if errors else None
        return Candidates(usable, time.perf_counter() - t0, fallback, offered)

    def offers(self, card: CompatCard, keys: PrefixKeys) -> list[PeerHit]:
        """Every peer's validated hit for ``keys``, as it answered; the planner
        taught nothing (what ``/v1/cache/query`` shows when no fetch is sought)."""
        if self.fleet is None:
            return []
        return self.candidates(card, keys, 0, teach=False).offered

    def _candidates(
        self,
        card: CompatCard,
        keys: PrefixKeys,
        have: int,
        pages: PageLimits | None,
        teach: bool = True,
    ) -> Candidates:
        found = self.candidates(card, keys, have, teach)
        if pages is not None:
            paged = (pages.hit(h, card.block_tokens) for h in found.hits)
            found.hits = [h for h in paged if h.tokens > have]
        return found

    def _worth(
        self, hit: PeerHit, have: int, start: int, wire: int | None = None, remember: bool = True
    ) -> Choice | None:
        """The planner's choice for ``hit`` from block ``start`` (``wire`` bytes on
        the wire, when trimmed or compressed), or None when it holds no more than
        ``have`` or its peer is not usable. ``remember``: the planner records it."""
        if hit.tokens <= have or not self.planner.usable(hit.node_id):
            return None
        nbytes = sum(i.nbytes for i in hit.infos[start:])
        return self.planner.choose(
            hit.node_id,
            hit.interface,
            hit.tokens - have,
            nbytes,
            wire,
            have=have,
            remember=remember,
        )

    def fetch(
        self,
        layout: Layout,
        hits: Sequence[PeerHit],
        local: Match,
        start: int,
        have: int,
        budget: float,
        open_sink: Callable[[PeerHit, tuple[int, ...] | None], Sink],
        on_start: Callable[[PeerHit], None] | None = None,
        owner: str | None = None,
        trims: bool = False,
    ) -> Fetched:
        """Stream the first candidate worth fetching from block ``start``, verified,
        into ``open_sink(hit).add``; on a failure, the next one, all within ``budget``
        seconds. ``open_sink`` raising is our failure (counted
        ``local_import_failed:<reason>``), the next candidate is tried. ``on_start``
        hears of each candidate as its stream begins. Blocks kept here count
        against ``owner``'s tenant budget (see :class:`~kvmesh.store.BlockStore`).
        ``trims``: the import takes blocks trimmed to what it needs (a caller that
        imports the whole prompt; not a paged one, which recomputes windows)."""

        def attempt(hit: PeerHit, left: float, want: Want, out: Fetched) -> bool:
            return self._try(layout, hit, local, start, left, open_sink, on_start, out, owner, want)

        return self._walk(layout, hits, start, have, budget, trims, attempt)

    def _walk(
        self,
        layout: Layout,
        hits: Sequence[PeerHit],
        start: int,
        have: int,
        budget: float,
        trims: bool,
        attempt: _Attempt | None,
    ) -> Fetched:
        """The candidates in turn while ``budget`` seconds last: skipped when the
        planner says computing is cheaper (counted), else ``attempt``\\ ed until one
        works. A plan (``attempt`` None) takes the first worth fetching, the
        planner recording nothing."""
        t0 = time.perf_counter()
        out = Fetched()
        acting = attempt is not None
        for hit in hits:
            if hit.tokens <= have or not self.planner.usable(hit.node_id):
                continue
            left = budget - (time.perf_counter() - t0)
            if left <= 0:
                out.fallback = Reason.BUDGET
                break
            want = self._want(layout, hit, start, trims)
            out.choice = self._worth(hit, have, start, want.wire, remember=acting)
            if out.choice is None or not out.choice.fetch:
                if acting:
                    self.count(Count.PLANNED_COMPUTE)
                continue
            if attempt is None:  # a plan: this is the stream acquire would start
                out.hit, out.want = hit, want
                return out
            if attempt(hit, left, want, out):
                return out
        return out

    def _want(self, layout: Layout, hit: PeerHit, start: int, trims: bool) -> Want:
        """What a fetch of ``hit`` from block ``start`` asks for: the parts an import
        of its tokens needs (when trimming is on), and the codec that moves them
        fastest over the peer's link as measured here (none: raw)."""
        assert self.fleet is not None
        if not self.fleet.window_trim:  # the reference path: whole blocks, raw
            return Want(None, (), wire_bytes(layout, hit, start, None))
        keep = layout.keep_from(hit.tokens) if trims else None
        rate = self.planner.link_rate(hit.node_id, hit.interface)
        wire = wire_bytes(layout, hit, start, keep)
        codec, ratio = self.calibrator.codec(rate, wire)
        if codec == "raw":
            return Want(keep, (), wire)
        return Want(keep, (codec,), int(wire / ratio))

    def _try(
        self,
        layout: Layout,
        hit: PeerHit,
        local: Match,
        start: int,
        left: float,
        open_sink: Callable[[PeerHit, tuple[int, ...] | None], Sink],
        on_start: Callable[[PeerHit], None] | None,
        out: Fetched,
        owner: str | None,
        want: Want,
    ) -> bool:
        """One candidate; True (``out`` filled in) when its stream worked."""
        assert self.fleet is not None
        try:  # ours: a failure here is never the peer's fault
            sink = open_sink(hit, want.keep_from)
        except Exception as e:  # e.g. past a sliding window, or a bad local block
            out.fallback = failure_reason(e)
            self.count(labelled(Family.LOCAL_IMPORT_FAILED, out.fallback))
            return False
        timed = _Timed(sink.add)
        if on_start is not None:
            on_start(hit)
        t0 = time.perf_counter()
        times = StreamTimes()
        try:
            blocks = self.fleet.fetch(layout, hit, start, timed, left, times, want)
        except Exception as e:  # the cache never decides correctness
            # counted; only the peer's own failures back it off (busy, or our own
            # budget running out, do not)
            tried = Attempt(left, time.perf_counter() - t0, timed.nbytes, self.fleet.fetch_deadline)
            out.fallback = self.planner.fetch_failed(hit.node_id, e, self.count, hit.alias, tried)
            return False
        out.fetch_s = time.perf_counter() - t0
        nbytes = sum(len(b.blob) for b in blocks)  # what arrived (trimmed: less than announced)
        self._learn(hit, times, nbytes, timed, want)
        self.count(Count.FETCHED_BYTES, nbytes)
        out.hit, out.sink, out.blocks, out.nbytes, out.fallback = hit, sink, blocks, nbytes, None
        out.times, out.want = times, want
        if blocks:
            self.calibrator.calibrate(max(blocks, key=lambda b: b.nbytes))
        if start == len(local.blocks):  # the fetched blocks continue the stored chain
            self.fleet.keep(blocks, owner)
        return True

    def _learn(
        self, hit: PeerHit, times: StreamTimes, nbytes: int, timed: _Timed, want: Want
    ) -> None:
        """What a working fetch teaches the planner: the link's rate and round trip,
        the import's bandwidth; the peer is forgiven."""
        self.planner.observe_link(
            hit.node_id,
            wire_bytes=times.wire_bytes or nbytes,
            raw_bytes=nbytes,
            link_s=max(times.received - times.connected, 0.0),
            connect_s=max(times.connected - times.started, 0.0),
            interface=hit.interface,
            address=hit.data_address or hit.address,
            compressed=bool(want.codecs),
        )
        self.planner.observe_import(timed.nbytes, timed.seconds)
        self.planner.peer_succeeded(hit.node_id)

    def imported(self, blocks: Sequence[Block], copy: Callable[[Block], object]) -> int:
        """Import ``blocks`` with ``copy`` (in order, stopping at the first failure,
        which is raised), teaching the planner the import bandwidth; how many."""
        timed = _Timed(copy)
        for blk in blocks:
            timed(blk)
        self.planner.observe_import(timed.nbytes, timed.seconds)
        return len(blocks)


class _Timed:
    """A block consumer that adds up the bytes it took and the seconds it worked."""

    def __init__(self, sink: Callable[[Block], object]) -> None:
        self.sink = sink
        self.nbytes = 0
        self.seconds = 0.0

    def __call__(self, blk: Block) -> None:
        t0 = time.perf_counter()
        self.sink(blk)
        self.seconds += time.perf_counter() - t0
        self.nbytes += blk.nbytes
