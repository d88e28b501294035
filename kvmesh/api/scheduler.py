"""Admission and execution of generations, off the event loop and off starlette's pool.

- ``admit`` takes a slot in a bounded queue: at most ``max_queue`` requests wait
  (admitted, not yet running on the engine); one more raises ``QueueFull``, which
  the API answers with 503 and ``Retry-After`` (nothing is buffered without bound).
  Once tokenized, ``hold`` counts their prompts: the waiting requests hold at most
  ``max_queued_tokens`` together (a request alone in the queue always may wait).
- ``start`` runs the generation on this module's own thread pool, sized so every
  admitted request has a thread. Starlette's pool (sync endpoints, tokenization)
  and the event loop (health, metrics, network reads) never wait behind the engine.
- Tokens reach the event loop as they are decoded; a slow reader never holds the
  engine, and a reader that stops (client gone) cancels: a queued request never
  runs, a running one stops after the current token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ..engine import Sampling
from ..runtime.head import CacheScope, Generation, HeadRuntime

RETRY_AFTER_S = 1  # a queue slot frees when one request ends: seconds, not minutes


class QueueFull(Exception):
    """No queue slot: the caller should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int, why: str = "") -> None:
        super().__init__(why or "the request queue is full")
        self.retry_after = retry_after


@dataclass(eq=False)
class Admission:
    """One admitted request: queued until it takes the engine, then running."""

    cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    done: bool = False
    tokens: int = 0  # its prompt's, counted while it waits (Scheduler.hold)


@dataclass(frozen=True)
class _End:
    error: BaseException | None = None


class Scheduler:
    def __init__(
        self, runtime: HeadRuntime, max_queue: int, max_queued_tokens: int = 1 << 20
    ) -> None:
        self.runtime = runtime
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self._lock = threading.Lock()
        self.waiting = 0  # admitted, not yet on the engine
        self.queued_tokens = 0  # the waiting requests' prompt tokens (those held)
        self.running = 0  # on the engine (up to its batch, plus those finishing)
        self.rejected = 0
        # a thread per waiting and per running request, one finishing: never a wait for one
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_queue + runtime.batch.max_batch + 1, thread_name_prefix="kvmesh-generate"
        )

    def admit(self) -> Admission:
        with self._lock:
            if self.waiting >= self.max_queue:
                self.rejected += 1
                raise QueueFull(RETRY_AFTER_S, f"{self.waiting} requests waiting")
            self.waiting += 1
            return Admission()

    def hold(self, jobs: Sequence[Admission], tokens: Sequence[int]) -> None:
        """Count admitted ``jobs``' prompt ``tokens`` while they wait: QueueFull
        (holding nothing) when the waiting would hold more than ``max_queued_tokens``
        and others wait too."""
        with self._lock:
            new = sum(tokens)
            alone = self.waiting == len(jobs)
            if not alone and self.queued_tokens + new > self.max_queued_tokens:
                self.rejected += 1
                raise QueueFull(
                    RETRY_AFTER_S, f"{self.queued_tokens} prompt tokens waiting, {new} more"
                )
            for job, n in zip(jobs, tokens, strict=True):
                job.tokens = n
            self.queued_tokens += new

    def _unqueue(self, job: Admission) -> None:
        self.waiting -= 1
        self.queued_tokens -= job.tokens
        job.tokens = 0

    def _started(self, job: Admission) -> None:
        with self._lock:
            if not job.started and not job.done:
                job.started = True
                self._unqueue(job)
                self.running += 1

    def release(self, job: Admission) -> None:
        """The job is over (finished, failed, cancelled or never started)."""
        with self._lock:
            if job.done:
                return
            job.done = True
            if job.started:
                self.running -= 1
            else:
                self._unqueue(job)

    def start(
        self,
        job: Admission,
        tokens: Sequence[int],
        sampling: Sampling,
        out: Generation,
        client: str = "",
        scope: CacheScope | None = None,
    ) -> TokenStream:
        """Run ``job`` now (it owns its slot until it ends); read its tokens from
        the returned stream. The caller must not ``release`` it afterwards.
        ``client`` (a valid API key, else the client's address) takes a fair share of
        the batch beside other clients (see :mod:`kvmesh.runtime.batch`)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | _End] = asyncio.Queue()

        def put(item: int | _End) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed (shutdown): nobody is reading
                job.cancel.set()

        def produce() -> None:
            try:
                gen = self.runtime.generate(
                    tokens,
                    sampling,
                    out,
                    cancel=job.cancel,
                    on_start=lambda: self._started(job),
                    client=client,
                    scope=scope,
                )
                for tok in gen:
                    put(tok)
                put(_End())
            except BaseException as e:  # handed to the reader, which raises it
                put(_End(e))
            finally:
                self.release(job)

        self._pool.submit(produce)
        return TokenStream(job, queue)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenStream:
    """Tokens of one running job. Leaving the iteration early (the client went
    away, or the reader was cancelled) cancels the job."""

    def __init__(self, job: Admission, queue: asyncio.Queue[int | _End]) -> None:
        self.job = job
        self._queue = queue

    def __aiter__(self) -> AsyncIterator[int]:
        return self._tokens()

    async def _tokens(self) -> AsyncIterator[int]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            self.job.cancel.set()  # a no-op once the generation has ended
