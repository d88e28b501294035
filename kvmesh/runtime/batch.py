"""Continuous batching: one engine thread advances every running sequence by one
token per step, in one forward pass.

A request whose prefix was already acquired (network waits happen on its own
thread, never here) is submitted as a :class:`Job`. Between steps the engine
thread admits waiting jobs while fewer than ``max_batch`` sequences run and the
KV they will hold fits ``kv_budget_bytes`` (beyond either limit requests queue,
in order). Admitting a job prefills it (imported prefix, computed suffix) and
forks its ``n`` sequences; a suffix longer than ``prefill_chunk`` tokens is
computed one chunk per step, so running sequences keep decoding while a long
prompt is prefilled. A step samples every running sequence's next token (handed
to its job at once), then runs one batched forward for those that continue
(:meth:`Engine.decode_batch`: one sequence alone is the plain single-sequence
forward, so a request running alone decodes exactly as before batching).

The engine lock is held for each step, so other engine work (audits) runs between
steps. A job's cancel event is checked every step: a waiting job never runs, a
running one stops after the token being decoded. A failure while prefilling or
stepping fails the jobs involved (their readers raise it), never the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.base import Decoded, Decoder, Engine, KVState, Sampling

log = logging.getLogger("kvmesh.batch")

DEFAULT_MAX_BATCH = 8


@dataclass(frozen=True)
class _Done:
    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    """One request on the batch: filled in by the engine thread, read by its owner."""

    sampling: Sampling
    choices: list[Decoded]
    prefill: Callable[[Callable[[], None]], KVState]  # (between chunks) -> state; engine thread
    kv_bytes: int  # the KV its sequences may hold at their longest
    cancel: threading.Event | None = None
    on_start: Callable[[], None] | None = None
    on_token: Callable[[], None] | None = None  # after a token is recorded, before it is handed on
    state: KVState | None = None  # the prompt's state once prefilled
    cancelled: bool = False
    _items: queue.SimpleQueue[int | _Done] = field(default_factory=queue.SimpleQueue)
    _running: int = 0

    def tokens(self) -> Iterator[int]:
        """The job's tokens as they are decoded (all choices, interleaved); raises
        what failed it."""
        while True:
            item = self._items.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                return
            yield item

    def _gone(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass(eq=False)
class _Seq:
    job: Job
    state: KVState
    decoder: Decoder


class BatchRunner:
    def __init__(
        self,
        engine: Engine,
        lock: AbstractContextManager[Any],
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_budget_bytes: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.engine = engine
        self.lock = lock  # the engine lock: held for each step
        self.max_batch = max_batch
        self.kv_budget_bytes = kv_budget_bytes
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[_Seq] = []
        self._kv_held = 0
        self._closed = False
        self.steps = 0
        self.batched_tokens = 0  # tokens decoded in steps of more than one sequence
        self.peak_batch = 0
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- the request side --------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue ``job``; read its tokens with ``job.tokens()``."""
        if job.sampling.n > self.max_batch:
            raise ValueError(f"n={job.sampling.n} exceeds --max-batch {self.max_batch}")
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._waiting.append(job)
            self._cv.notify()
        return job

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(10)

    # -- the engine thread ---------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._running and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._fail_all(RuntimeError("the engine is shut down"))
                    return
                admit = self._admissible()
            for job in admit:
                self._start(job)
            if self._running:
                self._step()

    def _admissible(self) -> list[Job]:
        """Jobs to start now, in order: a job that does not fit blocks those behind it
        (no starvation of large requests). Cancelled waiting jobs end here."""
        for job in [j for j in self._waiting if j._gone()]:  # wherever they wait
            self._waiting.remove(job)
            self._end(job, cancelled=True)
        out: list[Job] = []
        seqs = len(self._running)
        while self._waiting:
            job = self._waiting[0]
            fits_kv = (
                self.kv_budget_bytes is None
                or not (seqs or out)
                or (self._kv_held + job.kv_bytes <= self.kv_budget_bytes)
            )
            if seqs + job.sampling.n > self.max_batch or not fits_kv:
                break
            self._waiting.popleft()
            self._kv_held += job.kv_bytes
            seqs += job.sampling.n
            out.append(job)
        return out

    def _start(self, job: Job) -> None:
        try:
            if job.on_start is not None:
                job.on_start()
            # a long suffix is computed in chunks, the running sequences stepping between
            state = job.prefill(self._between)
        except BaseException as e:
            self._release(job)
            self._end(job, error=e)
            return
        job.state = state
        if job._gone():
            self._release(job)
            self._end(job, cancelled=True)
            return
        n = job.sampling.n
        states = [state] + [self.engine.fork(state) for _ in range(n - 1)]
        job.choices.extend(Decoded() for _ in range(n - len(job.choices)))
        for i, (st, out) in enumerate(zip(states, job.choices[:n], strict=True)):
            seed = None if job.sampling.seed is None else job.sampling.seed + i
            one = replace(job.sampling, seed=seed, n=1)
            self._running.append(_Seq(job, st, Decoder(self.engine, st, one, out)))
        job._running = n

    def _between(self) -> None:
        if self._running:
            self._step()

    def _step(self) -> None:
        """Sample every running sequence, then one forward for those that go on."""
        going: list[_Seq] = []
        try:
            with self.lock:
                for seq in list(self._running):
                    if seq.job._gone():
                        self._finish(seq, cancelled=True)
                        continue
                    tok, last = seq.decoder.next()
                    if seq.job.on_token is not None:
                        seq.job.on_token()
                    seq.job._items.put(tok)
                    if last:
                        self._finish(seq)
                    else:
                        going.append(seq)
                if going:
                    self.engine.decode_batch([s.state for s in going])
                    self.steps += 1
                    self.peak_batch = max(self.peak_batch, len(going))
                    if len(going) > 1:
                        self.batched_tokens += len(going)
        except BaseException as e:  # fail the jobs of this step, keep serving
            log.exception("decode step failed")
            for job in {seq.job for seq in going}:
                self._fail(job, e)

    def _finish(self, seq: _Seq, cancelled: bool = False) -> None:
        """``seq`` is over: out of the batch, owning its tensors; its job ends with
        its last sequence."""
        self._running.remove(seq)
        self.engine.detach(seq.state)  # a batch's tensors are not kept alive by it
        job = seq.job
        job._running -= 1
        job.cancelled = job.cancelled or cancelled
        if job._running == 0:
            self._release(job)
            self._end(job)

    def _fail(self, job: Job, error: BaseException) -> None:
        for seq in [s for s in self._running if s.job is job]:
            self._running.remove(seq)
        if job._running:
            job._running = 0
            self._release(job)
            self._end(job, error=error)

    def _release(self, job: Job) -> None:
        with self._cv:
            self._kv_held -= job.kv_bytes

    @staticmethod
    def _end(job: Job, cancelled: bool = False, error: BaseException | None = None) -> None:
        job.cancelled = job.cancelled or cancelled
        job._items.put(_Done(error))

    def _fail_all(self, error: BaseException) -> None:
        for job in {seq.job for seq in self._running}:
            self._fail(job, error)
        while self._waiting:
            self._end(self._waiting.popleft(), error=error)


__all__ = ["DEFAULT_MAX_BATCH", "BatchRunner", "Job"]
