"""The cost model and the per-peer circuit breaker: the one policy every caller
of the fleet (the head, the vLLM connector) applies.

*Cost* (:meth:`Planner.choose`): fetch a prefix only when it beats computing
it: ``fetch_s = rtt + wire bytes / link rate + raw bytes / import rate``
against ``compute_s``, the local prefill curve's cost of the tokens the fetch
saves. Each peer's link rate and RTT are learned from real fetches
(:meth:`Planner.observe_link`; priors by interface until then), the prefill
curve ``a·n + b·n²`` from recent prefills, the import rate as an EWMA (all in
:mod:`.links`), so a slow link or a fast accelerator chooses recompute. A peer
busy serving others is slower: its rate is divided by ``1 + load × its mean
fetch time + our fetches in flight to it``. With a home directory, learned
link rates and prefill samples persist in ``links.json`` (:mod:`.links`), so a
restarted head chooses as well as the one before. A link whose measured rate
alone makes computing win is fetched from once more every ``RECHECK_S`` (the
evidence that it was slow grows old; a fetch is the only way to measure it).
``force`` ("fetch" or
"compute") overrides the choice (not the estimates): for measuring both.

*Breaker*: a peer that failed is not planned on for a while (invariant 10), per
kind of failure. A *lookup* failure is forgiven by the next lookup the peer
answers (:meth:`Planner.lookup_succeeded`); a *fetch* failure stands until its
backoff passes; a successful fetch forgives both. Each backoff is
``backoff_first_s × 2^(score − 1)``, at most ``BACKOFF_MAX_S``: a failure adds 1
to the score, which halves for every ``half_life_s`` the peer was usable without
failing, and stops growing at the maximum backoff. Entries are bounded
(``MAX_TRACKED``).

Only a peer's own failures blame it (:meth:`Planner.fetch_failed`): a busy peer
(``PeerBusy``), our own saturation (``LocalBusy``) and our own cache-time budget
running out (:class:`Attempt`: reason ``budget``) are counted
``fetch_skipped:<reason>`` and back nobody off; refused, reset, bad bytes,
``stalled`` (silent past the progress timeout) or ``timeout`` (past the per-peer
fetch deadline) are counted ``peer_failed:<reason>`` and back the peer off. Budget
overruns on a peer that delivered nothing add up (decaying); past ``stall_s`` in
all, the peer is blamed as ``stalled``. Lookup failures are counted
``lookup_failed:<reason>`` (:meth:`Planner.lookup_hooks`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from ..errors import CacheMiss, KVMeshError, LocalBusy, PeerBusy, Reason
from .links import (
    LINK_PRIORS,
    LINKS_FILE,
    MAX_SAVED_LINKS,
    Link,
    LinkBook,
    LinksFile,
    PrefillFit,
    Saved,
    ewma,
)
from .telemetry import Family, Tally, labelled

log = logging.getLogger("kvmesh.planner")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
HALF_LIFE_S = 60.0  # a failure's weight halves over this much quiet time
MAX_TRACKED = 4096  # peers with a breaker entry (ids come from gossip: bounded)
STALL_S = 2.0  # how long a peer may keep a stream silent (MeshClient's progress_timeout)
# a stream limit within this of the per-peer fetch deadline is that deadline: callers
# cap a request's budget at it, then take off the time their lookup took (~ms, at most
# about the lookup deadline, 0.25 s by default)
DEADLINE_SLACK_S = 0.5
LOOKUP, FETCH = "lookup", "fetch"
FORCES = ("fetch", "compute")
MAX_CARD_LINKS = 16  # links a node's card carries (display only)
RECHECK_S = 600.0  # a link measured too slow to fetch from is fetched once more after this


class LookupHooks(TypedDict):
    """What a fleet lookup reports to (``Fleet.lookup(card, keys, **hooks)``)."""

    skip: Callable[[str], bool]
    on_failure: Callable[[str, str], None]
    on_success: Callable[[str], None]


def _deadline_passed(e: BaseException) -> bool:
    """A timeout that is a deadline passing (not a stall, which has its own reason)."""
    if isinstance(e, KVMeshError):
        return e.reason == Reason.TIMEOUT
    return isinstance(e, (TimeoutError, concurrent.futures.TimeoutError))


def failure_reason(e: BaseException) -> Reason:
    """The reason a failure on the cache path is counted under."""
    if isinstance(e, KVMeshError):
        return Reason(e.reason)
    if isinstance(e, (TimeoutError, concurrent.futures.TimeoutError)):
        return Reason.TIMEOUT
    log.warning("cache path failed unexpectedly: %r", e)
    return Reason.ERROR


@dataclass(frozen=True)
class Attempt:
    """How a failed fetch went, as the requester saw it: the limit it gave the
    stream (its own budget left), how long the stream ran, the bytes of verified
    blocks it delivered, and the per-peer fetch deadline (``Fleet.fetch_deadline``)."""

    limit_s: float
    elapsed_s: float
    delivered: int = 0
    peer_deadline_s: float = math.inf

    def ran_out(self, error: BaseException) -> bool:
        """True when the requester's own budget, not the peer, ended the fetch: it
        failed on a deadline (reason ``timeout``; a stall, silence past the progress
        timeout, is the peer's), ran for the whole limit it had, and that limit was
        the requester's, shorter than the per-peer fetch deadline."""
        return (
            _deadline_passed(error)
            and self.limit_s < self.peer_deadline_s - DEADLINE_SLACK_S
            and self.elapsed_s >= 0.95 * self.limit_s  # not a peer's own early timeout
        )


@dataclass
class _Silence:
    """Seconds our budget ran out on a peer that delivered nothing (decaying)."""

    seconds: float = 0.0
    at: float = 0.0


@dataclass(frozen=True)
class Choice:
    """Fetch or compute, and the estimates it was made from: ``rate`` is the wire
    bytes/s assumed (measured or the interface's prior, less the peer's load),
    ``measured`` whether it was measured."""

    fetch: bool
    fetch_s: float
    compute_s: float
    rate: float
    rtt_s: float = 0.0
    measured: bool = False

    @property
    def name(self) -> str:
        return "fetch" if self.fetch else "compute"


@dataclass
class Estimate:
    """The old interface (:meth:`Planner.estimate`); ``forced``: the planner's
    ``force``, which overrides the comparison."""

    fetch_s: float
    compute_s: float
    forced: bool | None = None

    @property
    def worth_it(self) -> bool:
        return self.fetch_s < self.compute_s if self.forced is None else self.forced


@dataclass
class _Strikes:
    """One kind of failure of one peer: a decaying score and the end of its backoff."""

    score: float = 0.0
    until: float = 0.0

    def fail(self, now: float, first_s: float, half_life_s: float) -> float:
        quiet = max(0.0, now - self.until)  # usable and not failing: evidence of health
        # no higher than where the backoff reaches its maximum: bounded, never overflows
        top = 1.0 + (math.log2(BACKOFF_MAX_S / first_s) if BACKOFF_MAX_S > first_s > 0 else 0.0)
        self.score = min(top, self.score * 0.5 ** (quiet / half_life_s) + 1.0)
        backoff = min(BACKOFF_MAX_S, first_s * 2 ** (self.score - 1.0))
        self.until = now + backoff
        return backoff


@dataclass
class _Breaker:
    kinds: dict[str, _Strikes] = field(
        default_factory=lambda: {LOOKUP: _Strikes(), FETCH: _Strikes()}
    )

    def until(self) -> float:
        return max(s.until for s in self.kinds.values())


class Planner:
    def __init__(
        self,
        prefill_tps: float = 100.0,
        default_bandwidth: float = LINK_PRIORS["unknown"],  # bytes/s, interface unknown
        default_rtt: float = 0.002,
        import_bandwidth: float = 2e9,
        clock: Callable[[], float] = time.monotonic,
        backoff_first_s: float = BACKOFF_FIRST_S,
        half_life_s: float = HALF_LIFE_S,
        stall_s: float = STALL_S,
        *,
        home: str | Path | None = None,
        model: str = "",
        force: str | None = None,
        wall: Callable[[], float] = time.time,
        priors: Mapping[str, float] | None = None,
    ) -> None:
        """``prefill_tps``: the local prefill rate assumed before one is measured;
        ``home``: where ``links.json`` is kept (None: nothing persists); ``model``:
        the key its prefill samples are kept under (e.g. the card's namespace
        hex; empty: none kept); ``force``: "fetch" or "compute" whatever the
        estimates say; ``wall``: the clock measurements are dated by (expiry)."""
        if force not in (None, *FORCES):
            raise ValueError(f"force must be one of {FORCES} or None, not {force!r}")
        self.backoff_first_s = backoff_first_s
        self.half_life_s = half_life_s
        self.stall_s = stall_s
        self.force = force
        self._lock = threading.Lock()
        self._clock = clock
        self._breakers: OrderedDict[str, _Breaker] = OrderedDict()  # least recently failed first
        self._silence: OrderedDict[str, _Silence] = OrderedDict()  # least recently silent first
        self.quarantined: set[str] = set()  # peers whose KV failed an audit
        self._tps: float | None = None  # recent tokens/s (display; the fit decides)
        self._prefill = PrefillFit(prefill_tps)
        self._probe_s: float | None = None  # seconds a token, from a start-up prefill
        self.default_rtt = default_rtt
        self.import_bandwidth = import_bandwidth
        self._book = LinkBook({**LINK_PRIORS, **(priors or {}), "unknown": default_bandwidth}, wall)
        self.model = model
        self._file = LinksFile(Path(home) / LINKS_FILE, wall) if home is not None else None
        if self._file is not None:
            self._restore(self._file.read())

    def _restore(self, saved: Saved) -> None:
        self._book.restore(saved.links)
        if self.model and self.model in saved.prefill:
            at, samples = saved.prefill[self.model]
            self._prefill.restore(samples, at)

    # -- what is learned ------------------------------------------------------

    @property
    def default_bandwidth(self) -> float:
        return self._book.priors["unknown"]

    @property
    def prefill_tps(self) -> float | None:
        """Recent local prefill tokens/s (an EWMA, for display); None before one.
        Setting it pins the prefill cost to that rate until the next prefill."""
        return self._tps

    @prefill_tps.setter
    def prefill_tps(self, tps: float) -> None:
        with self._lock:
            self._tps = tps
            self._prefill.pin(tps)
            self._probe_s = None  # what was said outranks what was probed

    @property
    def bandwidth(self) -> dict[str, float]:
        """Measured link rates (wire bytes/s) by peer."""
        with self._lock:
            return {p: k.rate for p, k in self._book.measured().items() if k.rate is not None}

    @property
    def rtt(self) -> dict[str, float]:
        """Measured connect times by peer."""
        with self._lock:
            got = {p: self._book.rtt(p) for p in self._book.links}
        return {p: r for p, r in got.items() if r is not None}

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One local prefill of ``tokens`` took ``seconds``: teaches the curve."""
        with self._lock:
            if not self._prefill.add(tokens, seconds, self._book.wall()):
                return
            self._tps = ewma(self._tps, tokens / seconds)
        self._changed()

    def observe_link(
        self,
        peer: str,
        *,
        wire_bytes: int,
        raw_bytes: int,
        link_s: float,
        connect_s: float = 0.0,
        interface: str = "",
        address: str = "",
        compressed: bool | None = None,
    ) -> None:
        """A fetch from ``peer`` (reached on ``interface`` at ``address``) moved
        ``wire_bytes`` (frames included) in ``link_s`` from connected to the last
        byte in, after ``connect_s`` to connect (0: nothing connected: a
        long-lived channel). ``raw_bytes``: what was sent, decoded (after a window
        trim, before a codec). ``compressed``: whether a codec shrank it (None:
        ``raw_bytes > wire_bytes``); a compressed transfer only raises the rate.
        Teaches the peer's link rate and RTT."""
        with self._lock:
            self._book.observe(
                peer, wire_bytes, raw_bytes, link_s, connect_s, interface, address, compressed
            )
        self._changed()

    def observe_fetch(
        self, peer: str, nbytes: int, seconds: float, rtt: float | None = None
    ) -> None:
        """The old interface: ``nbytes`` uncompressed in ``seconds``."""
        self.observe_link(
            peer, wire_bytes=nbytes, raw_bytes=nbytes, link_s=seconds, connect_s=rtt or 0.0
        )

    def observe_import(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 16 and seconds > 0:
            with self._lock:
                self.import_bandwidth = ewma(self.import_bandwidth, nbytes / seconds)

    # -- the choice -------------------------------------------------------------

    def compute_s(self, tokens: int, have: int = 0) -> float:
        """Estimated seconds to prefill ``tokens`` locally after ``have`` are in."""
        with self._lock:
            return max(0.0, self._prefill.seconds(have + tokens) - self._prefill.seconds(have))

    def observe_probe(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` timed at start-up (a head with no samples kept):
        what :meth:`cold_s` goes by until a real prefill is measured. Per token of a
        short prompt, so an overestimate for long ones (their budget errs long)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._probe_s = seconds / tokens

    @property
    def probe_s(self) -> float | None:
        """Seconds a token by the start-up probe; None once said or measured otherwise."""
        with self._lock:
            return None if self._prefill.samples else self._probe_s

    def cold_s(self, tokens: int) -> float:
        """The cold prefill of ``tokens`` a fetch's wait is measured against: the
        prefill curve once a prefill was measured here (or kept from before); until
        then the start-up probe's rate, never the prior alone (a fresh head on a fast
        machine would wait on a trickling peer for what it computes in a blink)."""
        probe = self.probe_s
        return tokens * probe if probe is not None else self.compute_s(tokens)

    def link_rate(self, peer: str, interface: str = "") -> float:
        """Wire bytes/s expected from ``peer``: measured, else the interface's prior."""
        with self._lock:
            return self._book.rate(peer, interface)

    def choose(
        self,
        peer: str,
        interface: str,
        tokens: int,
        raw_bytes: int,
        wire_bytes: int | None = None,
        *,
        have: int = 0,
        load: float = 0.0,
        inflight: int = 0,
        rtt_s: float | None = None,
        remember: bool = True,
    ) -> Choice:
        """Fetch ``raw_bytes`` (``wire_bytes`` on the wire: less when trimmed or
        compressed) from ``peer``, reached on ``interface``, or compute the
        ``tokens`` it would save after ``have`` already in? ``load``: the fetches
        per second the peer's card says it serves; ``inflight``: our own fetches
        to it now; ``rtt_s``: a round trip known otherwise (the membership's),
        used until a connect is measured. Remembered as the peer's last choice
        (a recheck counted as done) unless ``remember`` is off: a plan's question."""
        wire = raw_bytes if wire_bytes is None else wire_bytes
        compute = self.compute_s(tokens, have)
        with self._lock:
            link = self._book.entry(peer)
            measured = self._book.fresh(link, link.rate) is not None
            rtt = self._book.rtt(peer)
            rtt = rtt if rtt is not None else (rtt_s if rtt_s is not None else self.default_rtt)
            busy = 1.0 + max(0.0, load) * link.link_s + max(0, inflight)
            busy = busy if math.isfinite(busy) else 1e9
            rate = self._book.rate(peer, interface) / busy
            fetch_s = rtt + wire / rate + raw_bytes / self.import_bandwidth
            fetch = fetch_s < compute if self.force is None else self.force == "fetch"
            if not fetch and measured and self.force is None:
                prior = self._book.prior(interface or link.interface) / busy
                by_prior = rtt + wire / prior + raw_bytes / self.import_bandwidth
                fetch = self._recheck(link, by_prior, compute, remember)
            if remember:
                link.last_choice = "fetch" if fetch else "compute"
                link.interface = interface or link.interface
        return Choice(fetch, fetch_s, compute, rate, rtt, measured)

    def _recheck(
        self, link: Link, prior_fetch_s: float, compute_s: float, remember: bool = True
    ) -> bool:
        """Whether to fetch once anyway, to measure ``link`` again: its measured rate
        alone makes computing win (its interface's prior would fetch) and it was not
        measured or rechecked for ``RECHECK_S``. A link measured slow once (or a
        planted rate) is otherwise never fetched from, so never measured again."""
        now = self._book.wall()
        if prior_fetch_s >= compute_s or now - max(link.at, link.rechecked) < RECHECK_S:
            return False
        if remember:
            link.rechecked = now
        return True

    def estimate(self, peer: str | None, tokens: int, nbytes: int) -> Estimate:
        """The old interface: :meth:`choose` on an unknown interface; ``peer``
        None is the local store (import only)."""
        forced = None if self.force is None else self.force == "fetch"
        if peer is None:
            return Estimate(nbytes / self.import_bandwidth, self.compute_s(tokens), forced)
        c = self.choose(peer, "", tokens, nbytes)
        return Estimate(c.fetch_s, c.compute_s, forced)

    # -- what is shown and kept -------------------------------------------------

    def links(self, limit: int = MAX_SAVED_LINKS) -> list[dict[str, Any]]:
        """Measured links, most recently measured first: node_id, bytes_per_s,
        rtt_s, fetches, last_choice, interface, age_s (display; a card carries
        the first ``MAX_CARD_LINKS``)."""
        with self._lock:
            now = self._book.wall()
            return [
                {
                    "node_id": peer,
                    "bytes_per_s": k.rate,
                    "rtt_s": self._book.fresh(k, k.rtt),
                    "fetches": k.fetches,
                    "last_choice": k.last_choice,
                    "interface": k.interface,
                    "age_s": max(0.0, now - k.at),
                }
                for peer, k in list(self._book.measured().items())[:limit]
            ]

    def link(self, peer: str) -> dict[str, Any] | None:
        """One peer's link as :meth:`links` shows it, or None if never seen; its
        ``bytes_per_s`` None while unmeasured (``last_choice`` may be set)."""
        with self._lock:
            k = self._book.links.get(peer)
            if k is None:
                return None
            return {
                "node_id": peer,
                "bytes_per_s": self._book.fresh(k, k.rate),
                "rtt_s": self._book.fresh(k, k.rtt),
                "fetches": k.fetches,
                "last_choice": k.last_choice,
                "interface": k.interface,
            }

    def _changed(self) -> None:
        if self._file is not None:
            self._file.schedule(self.flush)

    def _saved(self) -> Saved:
        with self._lock:
            links = dict(list(self._book.measured().items())[:MAX_SAVED_LINKS])
            links = {p: dataclasses.replace(k, last_choice="") for p, k in links.items()}
            prefill = {}
            if self.model and self._prefill.samples:
                prefill[self.model] = (self._prefill.at, list(self._prefill.samples))
        return Saved(links, prefill)

    def flush(self) -> None:
        """Write ``links.json`` now (a head closing); nothing without a home."""
        if self._file is not None:
            self._file.cancel()
            self._file.write(self._saved())

    # -- per-peer health -------------------------------------------------------

    def peer_failed(self, peer: str) -> float:
        """Record a failed fetch; returns the backoff (seconds) now applied to ``peer``."""
        return self._fail(peer, FETCH)

    def lookup_failed(self, peer: str) -> float:
        """Record a failed lookup (forgiven by the next answered one); the backoff."""
        return self._fail(peer, LOOKUP)

    def fetch_failed(
        self,
        peer: str,
        error: BaseException,
        count: Tally,
        alias: str = "",
        attempt: Attempt | None = None,
    ) -> str:
        """A fetch from ``peer`` raised ``error``: the fallback reason, counted.

        A busy peer (``PeerBusy``) or our own saturation (``LocalBusy``) is counted
        ``fetch_skipped:<reason>`` and blames nobody; so is our own budget running
        out (``attempt.ran_out``: reason ``budget``), unless the peer has kept us
        waiting with nothing delivered for longer than ``stall_s`` in all (then it
        is ``stalled``, see the module); a miss (``CacheMiss``: ours) is only
        returned; anything else is the peer's failure, counted
        ``peer_failed:<reason>``, backed off (circuit breaker) and logged."""
        reason = failure_reason(error)
        if attempt is not None and attempt.ran_out(error):
            if not self._kept_waiting(peer, attempt):
                count(labelled(Family.FETCH_SKIPPED, Reason.BUDGET))
                log.debug("fetch from %s ran past our budget; not its failure", alias or peer)
                return Reason.BUDGET
            reason = Reason.STALLED  # silent past its progress timeout, over our tries
        if isinstance(error, (PeerBusy, LocalBusy)):  # loaded, or our own streams
            count(labelled(Family.FETCH_SKIPPED, reason))
        elif not isinstance(error, CacheMiss):
            backoff = self.peer_failed(peer)
            count(labelled(Family.PEER_FAILED, reason))
            log.info(
                "fetch from %s failed (%s); avoided for %.0f s", alias or peer, reason, backoff
            )
        return reason

    def _kept_waiting(self, peer: str, attempt: Attempt) -> bool:
        """Our budget ran out on ``peer``: what it delivered teaches its bandwidth
        (a trickle makes the next fetch not worth trying), and the wait adds up;
        True once waits that never completed a fetch pass ``stall_s`` (and start
        over). Only a successful fetch forgives them: one block then a stall is
        no excuse."""
        if attempt.delivered:
            self.observe_fetch(peer, max(attempt.delivered, 1 << 16), attempt.elapsed_s)
        with self._lock:
            now = self._clock()
            s = self._silence.pop(peer, None) or _Silence(at=now)
            s.seconds = s.seconds * 0.5 ** ((now - s.at) / self.half_life_s) + attempt.elapsed_s
            s.at = now
            if s.seconds > self.stall_s:
                return True  # forgotten: its strikes take over
            self._silence[peer] = s
            while len(self._silence) > MAX_TRACKED:
                self._silence.popitem(last=False)
            return False

    def silent_s(self, peer: str) -> float:
        """Seconds of budget ``peer`` has used up delivering nothing (see the module)."""
        with self._lock:
            s = self._silence.get(peer)
            return 0.0 if s is None else s.seconds

    def lookup_hooks(self, count: Tally) -> LookupHooks:
        """How a fleet lookup reports to this planner: backed-off peers are not
        waited for; a peer that fails a lookup backs off (counted
        ``lookup_failed:<reason>``), so a frozen peer costs one request its lookup
        deadline, not every request; one that answers is forgiven its lookup
        failures."""

        def failed(peer: str, reason: str) -> None:
            self.lookup_failed(peer)
            count(labelled(Family.LOOKUP_FAILED, reason))

        return LookupHooks(skip=self.avoided, on_failure=failed, on_success=self.lookup_succeeded)

    def _fail(self, peer: str, kind: str) -> float:
        with self._lock:
            breaker = self._breakers.pop(peer, None) or _Breaker()
            self._breakers[peer] = breaker  # most recently failed last
            while len(self._breakers) > MAX_TRACKED:
                self._breakers.popitem(last=False)
            return breaker.kinds[kind].fail(self._clock(), self.backoff_first_s, self.half_life_s)

    def peer_succeeded(self, peer: str) -> None:
        """A fetch worked: every strike (and silence) against ``peer`` is forgiven."""
        with self._lock:
            self._breakers.pop(peer, None)
            self._silence.pop(peer, None)

    def lookup_succeeded(self, peer: str) -> None:
        """``peer`` answered a lookup: its lookup strikes are forgiven (it is alive
        and answering); fetch strikes stand until their backoff passes."""
        with self._lock:
            breaker = self._breakers.get(peer)
            if breaker is None:
                return
            breaker.kinds[LOOKUP] = _Strikes()
            fetch = breaker.kinds[FETCH]
            if fetch.score == 0.0:
                del self._breakers[peer]

    def usable(self, peer: str) -> bool:
        """False while ``peer`` is backed off after a failure, or quarantined."""
        with self._lock:
            if peer in self.quarantined:
                return False
            breaker = self._breakers.get(peer)
            return breaker is None or self._clock() >= breaker.until()

    def avoided(self, peer: str) -> bool:
        """A peer backed off or quarantined (not waited for at lookup time)."""
        return not self.usable(peer)

    def quarantine(self, peer: str) -> None:
        """Never plan on ``peer`` again in this process (its KV failed an audit)."""
        with self._lock:
            self.quarantined.add(peer)

    def backed_off(self) -> dict[str, float]:
        """Peers currently avoided, with the seconds left (for metrics)."""
        now = self._clock()
        with self._lock:
            untils = {p: b.until() for p, b in self._breakers.items()}
        return {p: t - now for p, t in untils.items() if t > now}
