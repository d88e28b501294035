"""The cost model and the per-peer circuit breaker: the one policy every caller
of the fleet (the head, the vLLM connector) applies.

*Cost*: fetch a prefix only when transfer + import beats computing it. Local
prefill speed and each peer's bandwidth and RTT are learned as exponentially
weighted averages, so a slow link or a fast accelerator chooses recompute.

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
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from ..errors import CacheMiss, KVMeshError, LocalBusy, PeerBusy, Reason
from .telemetry import Family, Tally, labelled

log = logging.getLogger("kvmesh.planner")

ALPHA = 0.3
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


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class Estimate:
    fetch_s: float
    compute_s: float

    @property
    def worth_it(self) -> bool:
        return self.fetch_s < self.compute_s


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
        default_bandwidth: float = 100e6,  # bytes/s before a peer is measured
        default_rtt: float = 0.002,
        import_bandwidth: float = 2e9,
        clock: Callable[[], float] = time.monotonic,
        backoff_first_s: float = BACKOFF_FIRST_S,
        half_life_s: float = HALF_LIFE_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.backoff_first_s = backoff_first_s
        self.half_life_s = half_life_s
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._clock = clock
        self._breakers: OrderedDict[str, _Breaker] = OrderedDict()  # least recently failed first
        self._silence: OrderedDict[str, _Silence] = OrderedDict()  # least recently silent first
        self.quarantined: set[str] = set()  # peers whose KV failed an audit
        self.prefill_tps: float | None = None
        self._prior_tps = prefill_tps
        self.default_bandwidth = default_bandwidth
        self.default_rtt = default_rtt
        self.import_bandwidth = import_bandwidth
        self.bandwidth: dict[str, float] = {}
        self.rtt: dict[str, float] = {}

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:  # short runs measure overhead, not throughput
            with self._lock:
                self.prefill_tps = _ewma(self.prefill_tps, tokens / seconds)

    def observe_fetch(
        self, peer: str, nbytes: int, seconds: float, rtt: float | None = None
    ) -> None:
        if nbytes >= 1 << 16 and seconds > 0:
            with self._lock:
                self.bandwidth[peer] = _ewma(self.bandwidth.get(peer), nbytes / seconds)
        if rtt is not None:
            with self._lock:
                self.rtt[peer] = _ewma(self.rtt.get(peer), rtt)

    def observe_import(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 16 and seconds > 0:
            with self._lock:
                self.import_bandwidth = _ewma(self.import_bandwidth, nbytes / seconds)

    def estimate(self, peer: str | None, tokens: int, nbytes: int) -> Estimate:
        tps = self.prefill_tps or self._prior_tps
        compute = tokens / tps
        imp = nbytes / self.import_bandwidth
        if peer is None:  # local store: import only
            return Estimate(imp, compute)
        bw = self.bandwidth.get(peer, self.default_bandwidth)
        rtt = self.rtt.get(peer, self.default_rtt)
        return Estimate(rtt + nbytes / bw + imp, compute)

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

    def compute_s(self, tokens: int) -> float:
        """Estimated seconds to prefill ``tokens`` locally."""
        return tokens / (self.prefill_tps or self._prior_tps)
