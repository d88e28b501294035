"""What a request hands the batch runner (:mod:`kvmesh.runtime.batch`) and reads
back: a :class:`Job` (its sampling, its KV charge, callbacks) whose tokens arrive
through :meth:`Job.tokens`, and the :class:`PrefillPlan` the job makes on the
engine thread once admitted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..engine.base import Decoded, KVState, Sampling

# where a job was when its client left (Job.stage; the head counts cancellations by it)
QUEUED, PREFILLING, RUNNING = "queued", "prefilling", "running"
CANCEL_STAGES = (QUEUED, PREFILLING, RUNNING)


@dataclass(eq=False)
class PrefillPlan:
    """A prompt's prefill as the engine thread drives it: ``state`` holds the
    prompt's tokens and ``cached`` positions (imported, resumed); the runner
    computes the rest (:meth:`Engine.prefill_batch`), then calls ``done``."""

    state: KVState
    share: bytes | None = None  # chain root: whole blocks are shared within it (None: never)
    done: Callable[[KVState], None] | None = None  # the prompt is computed (engine thread)
    fallback: Callable[[BaseException], PrefillPlan] | None = None  # a forward failed: all anew
    # the prompt was given up (cancelled, failed) holding ``state.cached`` positions,
    # computed by successful forwards (engine thread; a raise is logged, nothing more)
    abandoned: Callable[[KVState], None] | None = None
    shared: int = 0  # positions taken from another job's state (set by the runner)
    compute_s: float = 0.0  # this prompt's share of the forwards' seconds (set by the runner)


@dataclass(frozen=True)
class Done:
    """The last item of a job's token queue: ``error`` is what failed it."""

    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    """One request on the batch: filled in by the engine thread, read by its owner."""

    sampling: Sampling
    choices: list[Decoded]
    prefill: Callable[[], PrefillPlan]  # its prefix imported, the rest to compute; engine thread
    kv_bytes: int  # the KV its sequences may hold at their longest
    cancel: threading.Event | None = None
    on_start: Callable[[], None] | None = None
    on_token: Callable[[], None] | None = None  # after a token is recorded, before it is handed on
    client: str = ""  # whose share of the batch it takes
    prompt_tokens: int | None = None  # its prompt's length (None: at most kv_bytes' positions)
    state: KVState | None = None  # the prompt's state once prefilled
    cancelled: bool = False
    stage: str = ""  # where it was when cancelled: one of CANCEL_STAGES
    _items: queue.SimpleQueue[int | Done] = field(default_factory=queue.SimpleQueue)
    _running: int = 0
    _charged: int = 0  # bytes held against the budget while admitted
    _work: int = 0  # of those, its prefill forwards' working memory (until prefilled)
    _root: bytes | None = None  # its plan's chain root, for sharing once it runs

    def tokens(self) -> Iterator[int]:
        """The job's tokens as they are decoded (all choices, interleaved); raises
        what failed it."""
        while True:
            item = self._items.get()
            if isinstance(item, Done):
                if item.error is not None:
                    raise item.error
                return
            yield item

    def _gone(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def end(
        self, cancelled: bool = False, error: BaseException | None = None, stage: str = ""
    ) -> None:
        """Close the token stream: cancelled (at ``stage``), failed, or done."""
        if cancelled and not self.cancelled:
            self.stage = stage
        self.cancelled = self.cancelled or cancelled
        self._items.put(Done(error))
