"""The cost model: fetch a prefix only when its transfer + import beats computing it.

Local prefill speed (tokens/s, per model) and per-peer bandwidth and RTT are
learned from measurements as exponentially weighted averages, so a slow link or a
fast accelerator correctly chooses recompute. A peer whose fetch failed is not
planned on for a backoff that doubles on each further failure and resets on a
success (a circuit breaker, invariant 10).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

ALPHA = 0.3
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class Estimate:
    fetch_s: float
    compute_s: float

    @property
    def worth_it(self) -> bool:
        return self.fetch_s < self.compute_s


class Planner:
    def __init__(
        self,
        prefill_tps: float = 100.0,
        default_bandwidth: float = 100e6,  # bytes/s before a peer is measured
        default_rtt: float = 0.002,
        import_bandwidth: float = 2e9,
        clock: Callable[[], float] = time.monotonic,
        backoff_first_s: float = BACKOFF_FIRST_S,
    ) -> None:
        self.backoff_first_s = backoff_first_s
        self._lock = threading.Lock()
        self._clock = clock
        self._failures: dict[str, int] = {}  # peer -> consecutive failures
        self._avoid_until: dict[str, float] = {}
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
        with self._lock:
            n = self._failures.get(peer, 0) + 1
            self._failures[peer] = n
            backoff = min(BACKOFF_MAX_S, self.backoff_first_s * 2 ** (n - 1))
            self._avoid_until[peer] = self._clock() + backoff
            return backoff

    def peer_succeeded(self, peer: str) -> None:
        with self._lock:
            self._failures.pop(peer, None)
            self._avoid_until.pop(peer, None)

    def usable(self, peer: str) -> bool:
        """False while ``peer`` is backed off after a failure, or quarantined."""
        with self._lock:
            if peer in self.quarantined:
                return False
            return self._clock() >= self._avoid_until.get(peer, 0.0)

    def quarantine(self, peer: str) -> None:
        """Never plan on ``peer`` again in this process (its KV failed an audit)."""
        with self._lock:
            self.quarantined.add(peer)

    def backed_off(self) -> dict[str, float]:
        """Peers currently avoided, with the seconds left (for metrics)."""
        now = self._clock()
        with self._lock:
            return {p: t - now for p, t in self._avoid_until.items() if t > now}

    def compute_s(self, tokens: int) -> float:
        """Estimated seconds to prefill ``tokens`` locally."""
        return tokens / (self.prefill_tps or self._prior_tps)
