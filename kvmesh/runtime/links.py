"""What the planner learns about costs: per-peer link rates, the local prefill
curve, and ``$KVMESH_HOME/links.json`` where a head keeps both across restarts.

*Links* (:class:`LinkBook`): one entry per peer (node id), bounded
(``MAX_TRACKED``, least recently touched dropped first). A real fetch teaches
its peer's rate, an EWMA of wire bytes per second of the stream (from connected
to last byte in), only from transfers of at least ``MIN_LINK_BYTES`` (smaller
ones measure latency, not the link). A compressed transfer (fewer wire bytes
than raw) may have been bound by the sender's encoder, not the link, so it only
ever raises a rate. A fetch's connect time teaches the peer's RTT. A peer never
measured is assumed at its interface's prior (:data:`LINK_PRIORS`, keyed like
``PeerHit.interface``); a measurement older than ``LINKS_TTL_S`` counts as none.

*Prefill* (:class:`PrefillFit`): the last ``PREFILL_SAMPLES`` (tokens, seconds)
of local prefills fit ``seconds = a·n + b·n²`` (non-negative least squares on
relative error), so a long prompt's attention cost is not extrapolated from a
short prompt's tokens per second.

*File* (:class:`LinksFile`): measured links keyed by node id (at most
``MAX_SAVED_LINKS``, newest kept) and each model's prefill samples, each with
the wall time it was measured; entries older than ``LINKS_TTL_S`` are dropped.
Written by a timer thread at most every ``SAVE_EVERY_S`` (never on the request
path), merged with what the file already holds (two heads sharing a home keep
both's), to a temporary file renamed over the old one. Read once, at most
``MAX_FILE_BYTES``, only when it is this user's alone (mode 600, as written:
what steers the planner is trusted like a secret), validated entry by entry: a
file that does not parse or is not private is ignored with a warning, a bad
entry is skipped, nothing read can raise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..private import MAX_PRIVATE_BYTES, read_private

log = logging.getLogger("kvmesh.planner")

# wire bytes per second of a peer never measured, by the interface it is reached on
LINK_PRIORS: Mapping[str, float] = {
    "loopback": 5e9,
    "thunderbolt": 2e9,
    "ethernet": 117e6,  # 1 GbE less framing
    "wifi": 30e6,
    "tailscale": 20e6,
    "unknown": 100e6,
}
ALPHA = 0.3
MIN_LINK_BYTES = 1 << 16  # smaller fetches measure latency, not the link
MAX_TRACKED = 4096  # peers with a link entry (ids come from gossip: bounded)
PREFILL_SAMPLES = 32
MIN_PREFILL_TOKENS = 16  # shorter runs measure overhead, not throughput
LINKS_FILE = "links.json"
LINKS_TTL_S = 24 * 3600.0
MAX_SAVED_LINKS = 256
MAX_SAVED_MODELS = 16
MAX_FILE_BYTES = MAX_PRIVATE_BYTES
SAVE_EVERY_S = 5.0
FUTURE_SLACK_S = 300.0  # a measurement "from the future" beyond this is garbage
MAX_RATE = 1e13  # bytes/s; anything faster read from a file is garbage
MAX_RTT_S = 60.0
MAX_ID_CHARS = 128


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class Link:
    """What one peer's fetches measured (wall-clock ``at`` of the last one)."""

    rate: float | None = None  # wire bytes/s (EWMA); None: unmeasured
    rtt: float | None = None  # connect seconds (EWMA); None: unmeasured
    link_s: float = 0.0  # seconds a fetch's stream took (EWMA): how long a served fetch holds it
    fetches: int = 0
    at: float = 0.0
    interface: str = ""
    address: str = ""
    last_choice: str = ""  # "fetch" | "compute" | "": the planner's last choice for it
    rechecked: float = 0.0  # wall time the planner last fetched only to re-measure it


class LinkBook:
    """Per-peer link measurements (see the module); not locked: the planner's
    lock guards it."""

    def __init__(self, priors: Mapping[str, float], wall: Callable[[], float]) -> None:
        self.priors = dict(priors)
        self.wall = wall
        self.links: OrderedDict[str, Link] = OrderedDict()  # least recently touched first

    def entry(self, peer: str) -> Link:
        link = self.links.pop(peer, None) or Link()
        self.links[peer] = link
        while len(self.links) > MAX_TRACKED:
            self.links.popitem(last=False)
        return link

    def observe(
        self,
        peer: str,
        wire_bytes: int,
        raw_bytes: int,
        link_s: float,
        connect_s: float,
        interface: str = "",
        address: str = "",
        compressed: bool | None = None,
    ) -> None:
        link = self.entry(peer)
        link.interface = interface or link.interface
        link.address = address or link.address
        link.fetches += 1
        if self.wall() - link.at >= LINKS_TTL_S:  # expired: learn afresh
            link.rate, link.rtt, link.link_s = None, None, 0.0
        if connect_s > 0:  # 0: a long-lived channel, nothing connected
            link.rtt = ewma(link.rtt, connect_s)
            link.at = self.wall()
        if wire_bytes < MIN_LINK_BYTES or not link_s > 0:
            return
        sample = wire_bytes / link_s
        if compressed is None:
            compressed = raw_bytes > wire_bytes
        if compressed and sample <= self.rate(peer, link.interface):
            return  # compressed: maybe bound by the sender's encoder, not the link
        link.rate = ewma(link.rate, sample)
        link.link_s = ewma(link.link_s or None, link_s)
        link.at = self.wall()

    def fresh(self, link: Link, value: float | None) -> float | None:
        """``value`` if ``link``'s measurements are younger than ``LINKS_TTL_S``."""
        return value if self.wall() - link.at < LINKS_TTL_S else None

    def prior(self, interface: str) -> float:
        return self.priors.get(interface or "unknown", self.priors["unknown"])

    def rate(self, peer: str, interface: str = "") -> float:
        """Wire bytes/s to expect from ``peer``: measured, else its interface's prior."""
        link = self.links.get(peer)
        measured = self.fresh(link, link.rate) if link is not None else None
        return measured if measured is not None else self.prior(interface)

    def rtt(self, peer: str) -> float | None:
        link = self.links.get(peer)
        return self.fresh(link, link.rtt) if link is not None else None

    def measured(self) -> dict[str, Link]:
        """Peers with a live measured rate, most recently measured first."""
        live = [(p, k) for p, k in self.links.items() if self.fresh(k, k.rate) is not None]
        return dict(sorted(live, key=lambda pk: -pk[1].at))

    def restore(self, saved: Mapping[str, Link]) -> None:
        """Links read from a file, under what is already measured here."""
        for peer, link in sorted(saved.items(), key=lambda pk: pk[1].at):
            if peer not in self.links:
                self.links[peer] = link
                self.links.move_to_end(peer, last=False)
        while len(self.links) > MAX_TRACKED:
            self.links.popitem(last=False)


# -- local prefill ------------------------------------------------------------


def fit_prefill(samples: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """``(a, b)``, both ≥ 0, minimizing the relative squared error of ``a·n + b·n²``
    against ``(n, seconds)`` samples; None without one. The simpler linear model
    wins unless a curve fits better (same-length samples cannot tell them apart)."""
    pts = [(n, s) for n, s in samples if n > 0 and s > 0]
    if not pts:
        return None
    scale = float(max(n for n, _ in pts))  # fit in n / scale: n⁴ stays near 1
    rows = [(n / scale, s) for n, s in pts]
    w = [1.0 / (s * s) for _, s in rows]
    m2 = sum(wi * m**2 for wi, (m, _) in zip(w, rows, strict=True))
    m3 = sum(wi * m**3 for wi, (m, _) in zip(w, rows, strict=True))
    m4 = sum(wi * m**4 for wi, (m, _) in zip(w, rows, strict=True))
    ms = sum(wi * m * s for wi, (m, s) in zip(w, rows, strict=True))
    m2s = sum(wi * m * m * s for wi, (m, s) in zip(w, rows, strict=True))

    def residual(a: float, b: float) -> float:
        return sum(wi * (a * m + b * m * m - s) ** 2 for wi, (m, s) in zip(w, rows, strict=True))

    best = (ms / m2, 0.0)
    cands = [(0.0, m2s / m4)]
    det = m2 * m4 - m3 * m3
    if det > 1e-9 * m2 * m4:
        a, b = (ms * m4 - m2s * m3) / det, (m2 * m2s - m3 * ms) / det
        if a >= 0 and b >= 0:
            cands.insert(0, (a, b))
    best_r = residual(*best)
    for a, b in cands:
        r = residual(a, b)
        if r < best_r * (1 - 1e-6):
            best, best_r = (a, b), r
    return best[0] / scale, best[1] / scale**2


class PrefillFit:
    """The last ``PREFILL_SAMPLES`` local prefills and the curve they fit."""

    def __init__(self, prior_tps: float) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self.coef: tuple[float, float] = (1.0 / prior_tps, 0.0)
        self.at = 0.0  # wall clock of the last sample

    def add(self, tokens: int, seconds: float, at: float) -> bool:
        """Learn one prefill; False when it is too short (or bad) to teach."""
        if tokens < MIN_PREFILL_TOKENS or not 0 < seconds < math.inf:
            return False
        self.samples.append((tokens, seconds))
        self.at = at
        self._refit()
        return True

    def restore(self, samples: Iterable[tuple[int, float]], at: float) -> None:
        self.samples.extend(samples)
        self.at = at
        self._refit()

    def pin(self, tps: float) -> None:
        """Forget the samples: ``tps`` tokens/s, linear, until the next one."""
        self.samples.clear()
        self.coef = (1.0 / tps, 0.0)

    def _refit(self) -> None:
        coef = fit_prefill(self.samples)
        if coef is not None and coef != (0.0, 0.0):
            self.coef = coef

    def seconds(self, tokens: int) -> float:
        a, b = self.coef
        return a * tokens + b * tokens * tokens


# -- the file -----------------------------------------------------------------


def _number(v: Any, lo: float, hi: float) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return f if math.isfinite(f) and lo <= f <= hi else None


def _link_from(v: Any, now: float) -> Link | None:
    """A saved link, or None when any part of it is not what this module writes."""
    if not isinstance(v, dict):
        return None
    rate = _number(v.get("bytes_per_s"), 1.0, MAX_RATE)
    at = _number(v.get("at"), now - LINKS_TTL_S, now + FUTURE_SLACK_S)
    fetches = v.get("fetches", 0)
    rtt_raw = v.get("rtt_s")
    rtt = None if rtt_raw is None else _number(rtt_raw, 0.0, MAX_RTT_S)
    link_s = _number(v.get("link_s", 0.0), 0.0, 3600.0)
    iface, addr = v.get("interface", ""), v.get("address", "")
    if rate is None or at is None or link_s is None or (rtt_raw is not None and rtt is None):
        return None
    if isinstance(fetches, bool) or not isinstance(fetches, int) or not 0 <= fetches < 2**53:
        return None
    if iface not in LINK_PRIORS and iface != "":
        return None
    if not isinstance(addr, str) or len(addr) > 256:
        return None
    return Link(rate, rtt, link_s, fetches, at, iface, addr)


def _samples_from(v: Any, now: float) -> tuple[float, list[tuple[int, float]]] | None:
    if not isinstance(v, dict):
        return None
    at, raw = _number(v.get("at"), now - LINKS_TTL_S, now + FUTURE_SLACK_S), v.get("samples")
    if at is None or not isinstance(raw, list) or len(raw) > PREFILL_SAMPLES:
        return None
    out = []
    for s in raw:
        if not (isinstance(s, list) and len(s) == 2):
            return None
        n, sec = _number(s[0], MIN_PREFILL_TOKENS, 1e8), _number(s[1], 1e-9, 1e6)
        if n is None or sec is None or n != int(n):
            return None
        out.append((int(n), sec))
    return at, out


def _valid_id(k: Any) -> bool:
    return isinstance(k, str) and 0 < len(k) <= MAX_ID_CHARS


@dataclass
class Saved:
    """What a links file holds, validated."""

    links: dict[str, Link]
    prefill: dict[str, tuple[float, list[tuple[int, float]]]]


class LinksFile:
    """``links.json`` (see the module): read once, written behind a timer."""

    def __init__(self, path: Path, wall: Callable[[], float]) -> None:
        self.path = path
        self.wall = wall
        self._lock = threading.Lock()  # one writer at a time
        self._timer: threading.Timer | None = None
        self._last = -math.inf  # time.monotonic() of the last write

    def read(self) -> Saved:
        """What the file holds, entry by entry valid and unexpired; never raises."""
        try:
            if not self.path.exists():
                return Saved({}, {})
            doc = json.loads(read_private(self.path))  # what steers fetches: this user's alone
            if not isinstance(doc, dict) or doc.get("version") != 1:
                raise ValueError("not a version 1 links file")
            return self._entries(doc)
        # JSONDecodeError and PrivateFileError are ValueErrors
        except (OSError, ValueError, RecursionError, OverflowError, TypeError) as e:
            log.warning("ignoring %s: %s", self.path, e)
            return Saved({}, {})

    def _entries(self, doc: dict[str, Any]) -> Saved:
        now, bad = self.wall(), 0
        links_raw, prefill_raw = doc.get("links", {}), doc.get("prefill", {})
        if not isinstance(links_raw, dict) or not isinstance(prefill_raw, dict):
            raise ValueError("links and prefill must be objects")
        links: dict[str, Link] = {}
        for k, v in links_raw.items():
            link = _link_from(v, now) if _valid_id(k) else None
            bad += link is None
            if link is not None:
                links[k] = link
        prefill = {}
        for k, v in prefill_raw.items():
            got = _samples_from(v, now) if _valid_id(k) else None
            bad += got is None
            if got is not None:
                prefill[k] = got
        if bad:  # expired entries too: the next write drops them
            log.info("%s: %d entries expired or invalid, skipped", self.path, bad)
        newest = sorted(links.items(), key=lambda kv: -kv[1].at)[:MAX_SAVED_LINKS]
        models = sorted(prefill.items(), key=lambda kv: -kv[1][0])[:MAX_SAVED_MODELS]
        return Saved(dict(newest), dict(models))

    def schedule(self, write: Callable[[], None]) -> None:
        """Run ``write`` on a timer thread, at most once per ``SAVE_EVERY_S``."""
        with self._lock:
            if self._timer is not None:
                return  # one is pending: it will see this change too
            delay = max(0.0, self._last + SAVE_EVERY_S - time.monotonic())
            self._timer = threading.Timer(delay, self._fire, (write,))
            self._timer.daemon = True
            self._timer.name = "kvmesh-links"
            self._timer.start()

    def _fire(self, write: Callable[[], None]) -> None:
        with self._lock:
            self._last = time.monotonic()
        try:
            write()
        finally:
            with self._lock:
                if self._timer is threading.current_thread():
                    self._timer = None

    def cancel(self) -> None:
        """No pending write; one already writing is waited for (a flush follows)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join(10)

    def write(self, ours: Saved) -> None:
        """Merge ``ours`` over what the file holds (newer entry wins), bounded, and
        replace the file atomically. A failure is logged, never raised."""
        with self._lock:
            try:
                self._write(ours)
            except OSError as e:
                log.warning("could not save link rates to %s: %s", self.path, e)

    def _write(self, ours: Saved) -> None:
        theirs = self.read()
        links = {**theirs.links}
        for k, v in ours.links.items():
            if k not in links or links[k].at <= v.at:
                links[k] = v
        prefill = {**theirs.prefill}
        for k, p in ours.prefill.items():
            if k not in prefill or prefill[k][0] <= p[0]:
                prefill[k] = p
        newest = sorted(links.items(), key=lambda kv: -kv[1].at)[:MAX_SAVED_LINKS]
        models = sorted(prefill.items(), key=lambda kv: -kv[1][0])[:MAX_SAVED_MODELS]
        doc = {
            "version": 1,
            "links": {k: _link_doc(v) for k, v in newest},
            "prefill": {k: {"at": at, "samples": [list(s) for s in ss]} for k, (at, ss) in models},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, separators=(",", ":")))
            tmp.replace(self.path)
        finally:
            tmp.unlink(missing_ok=True)


def _link_doc(v: Link) -> dict[str, Any]:
    return {
        "bytes_per_s": v.rate,
        "rtt_s": v.rtt,
        "link_s": v.link_s,
        "fetches": v.fetches,
        "at": v.at,
        "interface": v.interface if v.interface in LINK_PRIORS else "",
        "address": v.address[:256],
    }
