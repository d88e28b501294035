"""The cache path's vocabulary and a head's counters.

Every name is typed here, once: :class:`Source` (where a prefix came from),
:class:`Count` (plain counters), :class:`Family` (counters with a label, kept as
``family:label``: ``prefill_source:remote``, ``fallback:<Reason>``),
:class:`Timer`; reasons are :class:`kvmesh.errors.Reason`. Members are
``StrEnum``: counters, JSON and metric labels read as plain strings. Writers and
readers use these names, never a spelled-out string. :class:`Tally` is what any
counter sink (a :class:`Telemetry`, the vLLM connector's) looks like.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class Tally(Protocol):
    """A counter sink: ``tally(name)`` adds one, ``tally(name, n)`` adds n."""

    def __call__(self, name: str, n: int = 1, /) -> object: ...


class Source(StrEnum):
    """Where a prefill's prefix came from."""

    SESSION = "session"  # the same conversation's state, still in memory
    LOCAL = "local"  # this node's block store
    DISK = "disk"  # this node's disk tier
    REMOTE = "remote"  # fetched from a peer
    COMPUTE = "compute"  # nothing reused: computed in full


class Count(StrEnum):
    """Plain counters of a head."""

    REQUESTS = "requests"
    PROMPT_TOKENS = "prompt_tokens"
    COMPLETION_TOKENS = "completion_tokens"
    KV_ASSISTED_TOKENS = "kv_assisted_tokens"
    COMPUTED_PROMPT_TOKENS = "computed_prompt_tokens"
    BYTES_FETCHED = "bytes_fetched"  # by requests that used a fetched prefix
    FETCHED_BYTES = "fetched_bytes"  # by every fetch that worked
    PLANNED_COMPUTE = "planned_compute"
    # a session's continuation computed without asking the fleet (runtime.lookup_gate)
    LOOKUP_SKIPPED = "lookups_skipped"
    # a chat prompt's ids kept from a render of the same messages (api.prompt_memo)
    RENDERS_REUSED = "renders_reused"
    AUDITS = "audits"
    AUDIT_MISMATCH = "audit_mismatch"
    PUBLISHED_BLOCKS = "published_blocks"
    PICTURE_ROWS_BLOCKS = "picture_rows_blocks"  # pictures' encoder rows kept and published
    PUBLISH_DROPPED = "publish_dropped"
    PUBLISH_FAILED = "publish_failed"
    # blocks (chains from the root) kept and published from prompts given up while
    # being computed (cancelled, failed)
    PARTIAL_BLOCKS = "partial_blocks"


class Family(StrEnum):
    """Counters with a label, kept under ``family:label``."""

    PREFILL_SOURCE = "prefill_source"  # label: a Source
    FALLBACK = "fallback"  # label: a Reason
    PEER_FAILED = "peer_failed"  # label: a Reason (the peer is backed off)
    FETCH_SKIPPED = "fetch_skipped"  # label: a Reason that blames nobody (busy, budget)
    LOOKUP_FAILED = "lookup_failed"  # label: a Reason
    LOCAL_IMPORT_FAILED = "local_import_failed"  # label: a Reason
    CANCELLED = "cancelled"  # label: the stage (runtime.batch.CANCEL_STAGES)
    LOAD_FALLBACK = "load_fallback"  # label: a Reason (a paged load left pages to compute)
    LOAD_FAILED = "load_failed"  # label: a Reason (a paged load failed whole)


class Timer(StrEnum):
    """Seconds summed over requests."""

    IMPORT = "import_s"
    FETCH = "fetch_s"
    PREFILL = "prefill_s"
    SAVED = "saved_s"


def labelled(family: Family, label: str) -> str:
    """The counter name of ``family`` for ``label``."""
    return f"{family}:{label}"


@dataclass(frozen=True)
class PrefillReport:
    source: str  # a Source (its value: checked, and kept as the member)
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    peer: str | None = None
    bytes_fetched: int = 0
    fallback: str | None = None
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    import_s: float = 0.0
    compute_s: float = 0.0
    saved_s: float = 0.0
    used_stored_logits: bool = False
    bytes_wire: int = 0  # what crossed the wire for the fetch (frames, trimmed, compressed)
    trimmed: bool = False  # sliding layers' positions outside the window stayed home
    codec: str = ""  # the part codec asked for ("": raw)
    # the planner's last choice for this prompt: {choice, fetch_s_est, compute_s_est}
    planner: dict[str, Any] = field(default_factory=dict)
    # seconds per stage to the first token (runtime.head.STAGES), filled in at it
    breakdown: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", Source(self.source))  # an unknown one: ValueError

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Telemetry:
    def __init__(self, history: int = 600) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.timers: dict[str, float] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=history)  # per-request rows
        self.started = time.time()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def record(self, report: PrefillReport, completion_tokens: int) -> None:
        with self._lock:
            c = self.counters
            c[Count.REQUESTS] += 1
            c[Count.PROMPT_TOKENS] += report.prompt_tokens
            c[Count.COMPLETION_TOKENS] += completion_tokens
            c[Count.KV_ASSISTED_TOKENS] += report.reused_tokens
            c[Count.COMPUTED_PROMPT_TOKENS] += report.computed_tokens
            c[labelled(Family.PREFILL_SOURCE, report.source)] += 1
            c[Count.BYTES_FETCHED] += report.bytes_fetched
            if report.fallback:
                c[labelled(Family.FALLBACK, report.fallback)] += 1
            for timer, s in (
                (Timer.IMPORT, report.import_s),
                (Timer.FETCH, report.fetch_s),
                (Timer.PREFILL, report.compute_s),
                (Timer.SAVED, report.saved_s),
            ):
                self.timers[timer] = self.timers.get(timer, 0.0) + s
            self.recent.append(
                {"t": time.time(), "completion_tokens": completion_tokens, **report.as_dict()}
            )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"counters": dict(self.counters), "timers": dict(self.timers)}

    def family(self, family: Family) -> dict[str, int]:
        """The counters of ``family``, by label."""
        prefix = labelled(family, "")
        with self._lock:
            return {k[len(prefix) :]: v for k, v in self.counters.items() if k.startswith(prefix)}

    @property
    def fallbacks(self) -> dict[str, int]:
        """Fallbacks by reason."""
        return self.family(Family.FALLBACK)
