"""Counters a head keeps: tokens, hits and misses per tier, fallback reasons,
bytes, checksum failures, import time and prefill seconds saved."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PrefillReport:
    source: str  # session | local | disk | remote | compute
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Telemetry:
    def __init__(self, history: int = 600) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.timers: dict[str, float] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=history)  # per-request rows
        self.started = time.time()

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n  # type: ignore[assignment]

    def record(self, report: PrefillReport, completion_tokens: int) -> None:
        with self._lock:
            c = self.counters
            c["requests"] += 1
            c["prompt_tokens"] += report.prompt_tokens
            c["completion_tokens"] += completion_tokens
            c["kv_assisted_tokens"] += report.reused_tokens
            c["computed_prompt_tokens"] += report.computed_tokens
            c[f"prefill_source:{report.source}"] += 1
            c["bytes_fetched"] += report.bytes_fetched
            if report.fallback:
                c[f"fallback:{report.fallback}"] += 1
            self.timers["import_s"] = self.timers.get("import_s", 0.0) + report.import_s
            self.timers["fetch_s"] = self.timers.get("fetch_s", 0.0) + report.fetch_s
            self.timers["prefill_s"] = self.timers.get("prefill_s", 0.0) + report.compute_s
            self.timers["saved_s"] = self.timers.get("saved_s", 0.0) + report.saved_s
            self.recent.append(
                {"t": time.time(), "completion_tokens": completion_tokens, **report.as_dict()}
            )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"counters": dict(self.counters), "timers": dict(self.timers)}

    @property
    def fallbacks(self) -> dict[str, int]:
        with self._lock:
            return {
                k.split(":", 1)[1]: v for k, v in self.counters.items() if k.startswith("fallback:")
            }
