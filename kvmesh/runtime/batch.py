"""Continuous batching: one engine thread advances running sequences by one token
per step, in one forward pass, shared fairly between clients.

A request whose prefix was already acquired (network waits happen on its own
thread, never here) is submitted as a :class:`Job` (:mod:`kvmesh.runtime.jobs`),
tagged with its ``client`` (whatever the caller names it). Contract:

- **Admission.** Between steps the engine thread admits waiting jobs, the client
  with the fewest resident sequences first (in order within a client), while
  their sequences fit ``max_batch`` (``2 * max_batch`` for a client with nothing
  resident: a newcomer never waits behind one client's whole generation) and
  their charge fits ``kv_budget_bytes`` (:mod:`kvmesh.runtime.kvbudget`). A job
  that does not fit blocks those behind it (no starvation of large requests); one
  that could never fit is refused at :meth:`BatchRunner.submit` with
  :class:`OverBudget`. Other holders (the head's kept sessions) reserve through
  :meth:`BatchRunner.reserve` and are asked to give room back (``make_room``)
  before a job is made to wait.
- **Prefill.** An admitted job makes its :class:`PrefillPlan` (its acquired
  prefix imported, its session resumed: a state holding some positions) and the
  runner computes the rest. A loop turn runs one prefill forward, then one decode
  step, so a running stream waits at most one forward of at most
  ``prefill_chunk`` tokens a prompt. Where the engine
  :attr:`~kvmesh.engine.base.EngineBase.rides` and the forward is one prompt's,
  the running sequences sample first and their steps ride that forward (its
  chunk shortened by their count): no step of their own that turn. Which
  prompts share a forward, and how a prompt takes whole blocks another job of
  its chain root computed (never with ``max_batch`` 1, never across roots):
  :mod:`kvmesh.runtime.prefill`. A job alone in its forward computes exactly as
  unbatched.
- **Steps.** A computed prompt forks its job's ``n`` sequences. A step decodes at
  most ``max_batch`` sequences, slots dealt to clients in turn and within a client
  to the sequences that decoded least; each samples its next token (handed to its
  job at once), then one forward per group of similar lengths runs for those that
  go on (:meth:`Engine.decode_batch`; one sequence alone is the single-sequence
  forward).
- **Failures.** A sequence whose sampling raises fails its own job only; a
  batched forward that raises is retried one sequence at a time, so only the
  jobs whose own forward fails end (a prefill first starts over once through
  :attr:`PrefillPlan.fallback`: invariant 1). If the loop itself dies, every job
  fails with :class:`EngineFailed`, later submits raise it, and
  :attr:`BatchRunner.failure` says why: nothing hangs.

The engine lock is held for each forward and step, so other engine work (audits)
runs between them. A job's cancel event is checked every turn: a waiting job
never runs, a prefilling one stops before its next chunk (what it computed is
handed on), a running one stops after the token being decoded. :attr:`Job.stage`
says where a cancelled job was (:data:`CANCEL_STAGES`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from .. import memory
from ..engine.base import PREFILL_CHUNK, Decoded, Decoder, Engine, KVState
from ..engine.grammar import compile_grammar
from .jobs import CANCEL_STAGES, PREFILLING, QUEUED, RUNNING, Job, PrefillPlan
from .kvbudget import PAD_SLACK, PAD_TOKENS, STEP_FACTOR, KVBudget, forward_work_bytes
from .prefill import (
    LONE_PREFILL,
    PREFILL_BATCH_TOKENS,
    LoneForward,
    Prefilling,
    PrefillOrder,
    PrefixSharing,
)

log = logging.getLogger("kvmesh.batch")

DEFAULT_MAX_BATCH = 8


class OverBudget(ValueError):
    """A request whose worst case can never fit the KV budget."""


class EngineFailed(RuntimeError):
    """The engine thread died; no request can run on this head."""


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
        make_room: Callable[[int], None] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_batch_tokens: int = PREFILL_BATCH_TOKENS,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.engine = engine
        self.lock = lock  # the engine lock: held for each step
        self.max_batch = max_batch
        self.kv_budget_bytes = kv_budget_bytes
        self.make_room = make_room  # asked to free reserved bytes before a job waits
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.prefill_batch_tokens = prefill_batch_tokens
        self.lone = LoneForward(max(prefill_chunk, LONE_PREFILL))  # a lone prompt's forward
        self._cv = threading.Condition()
        self._budget = KVBudget(engine, kv_budget_bytes, prefill_chunk, self._cv)
        self._sharing = PrefixSharing(engine, lock, enabled=max_batch > 1)
        self._waiting: deque[Job] = deque()
        self._starting: list[Job] = []  # admitted, not yet planned
        self._prefilling: list[Prefilling] = []  # planned, their prompts being computed
        self._running: list[_Seq] = []
        self._closed = False
        self.failure: BaseException | None = None
        self.steps = 0
        self.batched_tokens = 0  # tokens decoded in steps of more than one sequence
        self.peak_batch = 0
        self.peak_resident = 0
        self.peak_padding = (0, 0, 0)  # (padding, real, rows) tokens of the most padded forward
        self.prefill_forwards = 0
        self.peak_prefill_batch = 0  # most prompts in one prefill forward
        self.prefill_retries = 0  # batched prefill forwards that raised: retried one by one
        self.ridden_steps = 0  # decode steps computed in a prompt's prefill forward
        self.prefill_tokens = 0  # prompt tokens computed by prefill forwards
        self.peak_prefill_chunk = 0  # most tokens one prompt computed in one forward
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- the request side --------------------------------------------------------

    def charge(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """What a job of ``n`` sequences holding ``kv_bytes`` of KV in all counts
        against the budget while it prefills (see :meth:`KVBudget.charge`)."""
        return self._budget.charge(kv_bytes, n, prompt_tokens)

    def prefill_work(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """The working memory of a job's largest prefill forward (see
        :meth:`KVBudget.prefill_work`)."""
        return self._budget.prefill_work(kv_bytes, n, prompt_tokens)

    def check(self, n: int, kv_bytes: int, prompt_tokens: int | None = None) -> None:
        """Raise ValueError for a request this runner could never run."""
        if n > self.max_batch:
            raise ValueError(f"n={n} exceeds --max-batch {self.max_batch}")
        budget, need = self.kv_budget_bytes, self.charge(kv_bytes, n, prompt_tokens)
        if budget is not None and need > budget:
            raise OverBudget(
                f"this request may need {need / 2**20:.0f} MiB of KV "
                f"(prompt and max_tokens, times n, with a step's working copy and a "
                f"prefill forward's); the head's --kv-budget is {budget / 2**20:.0f} MiB: "
                f"lower max_tokens or n"
            )

    def submit(self, job: Job) -> Job:
        """Queue ``job``; read its tokens with ``job.tokens()``. A grammar is compiled
        here, in the caller's thread (an error is the caller's ValueError; the
        tokenizer's one-off set-up and the compile never stall the engine thread,
        whose decoders then find it cached)."""
        self.check(job.sampling.n, job.kv_bytes, job.prompt_tokens)
        if job.sampling.grammar is not None:
            compile_grammar(self.engine.tokenizer, job.sampling.grammar)
        with self._cv:
            if self.failure is not None:
                raise EngineFailed(f"the engine failed: {self.failure!r}")
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` of the budget for something else (a kept session);
        False when they do not fit beside what runs now."""
        return self._budget.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self._budget.unreserve(nbytes)

    @property
    def prefill_chunk(self) -> int:
        """The most tokens of one prompt a prefill forward computes."""
        return self._budget.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, n: int) -> None:
        self._budget.prefill_chunk = n

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def held_bytes(self) -> int:
        """Budget bytes held now: admitted jobs (charged) and reservations."""
        return self._budget.held + self._budget.reserved

    @property
    def shared_tokens(self) -> int:
        """Prompt positions taken from another job's state."""
        return self._sharing.shared_tokens

    @property
    def share_waits(self) -> int:
        """Jobs that waited for another's prefill of their common blocks."""
        return self._sharing.waits

    @property
    def share_rescued_tokens(self) -> int:
        """Of :attr:`shared_tokens`, those taken from a producer that was cancelled
        or failed."""
        return self._sharing.rescued_tokens

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(10)

    # -- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        """The loop, supervised: if it dies, every job fails and nothing waits."""
        try:
            self._loop()
        except BaseException as e:
            log.critical("the engine thread died", exc_info=True)
            with self._cv:
                self.failure = e
                self._closed = True
            self._fail_all(EngineFailed(f"the engine failed: {e!r}"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not (self._waiting or self._prefilling or self._running or self._closed):
                    memory.after_request(idle=True)  # nothing left: trimmed after IDLE_S of quiet
                    while not (self._waiting or self._prefilling or self._running or self._closed):
                        self._cv.wait()
                    memory.after_request(idle=False)
                if self._closed:
                    memory.after_request(idle=True)  # a closed engine holds no request open
                    self._fail_all(RuntimeError("the engine is shut down"))
                    return
            self._starting = self._admissible()
            while self._starting:  # each stays listed while it starts: a death ends it too
                self._begin(self._starting[0])
                self._starting.pop(0)
            stepped = self._prefill_turn() if self._prefilling else False
            if self._running and not stepped:  # each chosen samples, those going on step
                self._decode(self._sample())

    def _admissible(self) -> list[Job]:
        """Jobs to start now, fairest first (see the module docstring). Cancelled
        waiting jobs end here."""
        with self._cv:
            for gone in [j for j in self._waiting if j._gone()]:  # wherever they wait
                self._waiting.remove(gone)
                gone.end(cancelled=True, stage=QUEUED)
        resident = _resident_by_client(self._running, self._prefilling)
        out: list[Job] = []
        budget = self._budget
        while True:
            with self._cv:
                job = _fairest(self._waiting, resident)
                if job is None or not _fits_batch(job, resident, self.max_batch):
                    return out
                need, work = budget.job_charge(job)
                short = budget.short(need)
            if 0 < short <= budget.reserved and self.make_room is not None:
                self.make_room(short)  # sessions give room back (outside our lock)
            with self._cv:
                # alone it runs whatever else holds reservations (submit checked need <= budget)
                if not budget.fits(need, alone=not (self._running or self._prefilling or out)):
                    return out
                self._waiting.remove(job)
                budget.take(job, need, work)
            resident[job.client] = resident.get(job.client, 0) + job.sampling.n
            out.append(job)

    # -- prefill ---------------------------------------------------------------------

    def _running_roots(self) -> list[tuple[KVState, bytes | None]]:
        return [(s.state, s.job._root) for s in self._running]

    def _begin(self, job: Job) -> None:
        """Plan ``job``'s prefill (its prefix imported); a prompt with nothing left
        to compute starts decoding at once."""
        try:
            if job.on_start is not None:
                job.on_start()
            plan = job.prefill()
        except Exception as e:  # this job's import or plan: it alone fails
            self._budget.release(job)
            job.end(error=e)
            return
        job._root = plan.share
        pre = Prefilling(job, plan, since=self.prefill_forwards)
        if pre.left <= 0:
            self._prefilled(pre)
            return
        self._prefilling.append(pre)
        self._sharing.find(pre, self._prefilling, self._running_roots())

    def _prefill_turn(self) -> bool:
        """End cancelled prefills, settle shared prefixes, then one prefill forward.
        True when the running sequences stepped in it (:meth:`_riders`)."""
        for pre in [p for p in self._prefilling if p.job._gone()]:
            self._drop_prefill(pre, cancelled=True)
        self._sharing.settle(self._prefilling, self._running_roots())
        ready = [p for p in self._prefilling if p.producer is None]
        if not ready:
            return False
        order = PrefillOrder(
            self.prefill_chunk, self.max_batch, self.prefill_batch_tokens, self.engine.batches
        )
        group, chunks = order.group(ready, self.prefill_forwards)
        alone = not (self._running or self._waiting or len(self._prefilling) > 1)
        widened = self.lone.widen(group[0], chunks, self._budget) if alone else 0
        riders = self._riders(group)
        if riders:  # the forward's rows stay within prefill_chunk
            chunks[0] = max(1, min(chunks[0], self.prefill_chunk - len(riders)))
        chunks = [_whole(self.engine, p, n) for p, n in zip(group, chunks, strict=True)]
        try:
            self._prefill_forward(group, chunks, tuple(riders or ()))
        finally:
            if widened:
                self._budget.unreserve(widened)
        for pre in group:
            if pre in self._prefilling and pre.left <= 0:
                self._prefilling.remove(pre)
                self._prefilled(pre)
        return riders is not None

    def _riders(self, group: list[Prefilling]) -> list[_Seq] | None:
        """The running sequences sampled, those going on to ride ``group``'s forward
        (:meth:`Engine.prefill_riding`: one prompt, no LoRA row; a LoRA step goes
        alone first). None: no riding; the turn's step comes after the forward."""
        if not (self._running and self.engine.rides and len(group) == 1):
            return None
        if group[0].plan.state.adapter is not None:
            return None
        going = self._sample()
        self._decode([s for s in going if s.state.adapter is not None])
        return [s for s in going if s.state.adapter is None and s in self._running]

    def _drop_prefill(
        self, pre: Prefilling, cancelled: bool = False, error: BaseException | None = None
    ) -> None:
        """``pre`` leaves before its prompt is computed: what it holds is handed on."""
        self._prefilling.remove(pre)
        self._sharing.abandon(pre, self._prefilling, self._running_roots())
        self._budget.release(pre.job)
        pre.job.end(cancelled=cancelled, error=error, stage=PREFILLING)

    def _prefill_forward(
        self, group: list[Prefilling], chunks: list[int], riders: tuple[_Seq, ...] = ()
    ) -> None:
        """One forward of ``chunks[i]`` tokens of each prompt ``group[i]`` (and the
        steps of ``riders``: one prompt); if it raises, each alone, and a prompt
        whose own forward fails starts over once (its fallback), else its job fails."""
        states = [p.plan.state for p in group]
        t0 = time.perf_counter()
        try:
            with self.lock:
                if riders:
                    self.engine.prefill_riding(states[0], chunks[0], [s.state for s in riders])
                else:
                    self.engine.prefill_batch(states, chunks)
        except Exception as e:
            if riders:  # the engine left every state as it was
                log.warning("a prefill forward with steps riding failed (%r): each alone", e)
                self.prefill_retries += 1
                self._prefill_forward(group, chunks)
                self._decode(list(riders))
                return
            if len(group) == 1:
                self._prefill_failed(group[0], e)
                return
            log.warning("batched prefill failed (%r): each prompt alone", e)
            self.prefill_retries += 1
            for pre, n in zip(group, chunks, strict=True):
                if pre in self._prefilling and pre.left > 0:
                    self._prefill_forward([pre], [min(n, pre.left)])
            return
        dt = time.perf_counter() - t0
        log.debug("prefill forward: %s tokens, %d riding, %.3f s", chunks, len(riders), dt)
        if riders:
            self._stepped(list(riders))
            self.ridden_steps += len(riders)
        self.lone.observe(sum(chunks), dt)
        self.prefill_forwards += 1
        self.prefill_tokens += sum(chunks)
        self.peak_prefill_chunk = max(self.peak_prefill_chunk, *chunks)
        self.peak_prefill_batch = max(self.peak_prefill_batch, len(group))
        for pre, n in zip(group, chunks, strict=True):
            pre.since = self.prefill_forwards
            pre.plan.compute_s += dt * n / sum(chunks)  # its share of the forward

    def _prefill_failed(self, pre: Prefilling, error: Exception) -> None:
        fallback = pre.plan.fallback
        if fallback is not None and not pre.restarted:
            log.info("prefill failed (%r): computing all of the prompt", error)
            try:
                with self.lock:
                    pre.plan = fallback(error)
                pre.restarted, pre.producer = True, None
                return
            except Exception as e:
                error = e
        log.warning("prefill failed: %r", error)
        self._drop_prefill(pre, error=error)

    def _prefilled(self, pre: Prefilling) -> None:
        """``pre``'s prompt is computed: report it and fork its sequences."""
        job, state = pre.job, pre.plan.state
        self._budget.unwork(job)  # its prefill forwards are over
        try:
            if pre.plan.done is not None:
                pre.plan.done(state)
            job.state = state
            if job._gone():
                self._budget.release(job)
                job.end(cancelled=True, stage=PREFILLING)
                return
            seqs = _fork(self.engine, job, state)
        except Exception as e:  # this job's report, forks or decoders: it alone fails
            self._budget.release(job)
            job.end(error=e)
            return
        self._running.extend(seqs)
        job._running = len(seqs)
        self.peak_resident = max(self.peak_resident, len(self._running))

    # -- decode ----------------------------------------------------------------------

    def _sample(self) -> list[_Seq]:
        """Each chosen sequence's next token, handed to its job: those that go on."""
        going: list[_Seq] = []
        with self.lock:
            for seq in _chosen(self._running, self.max_batch):
                if seq not in self._running:  # a sibling's failure ended its job
                    continue
                if seq.job._gone():
                    self._finish(seq, cancelled=True)
                    continue
                try:
                    tok, last = seq.decoder.next()
                    if seq.job.on_token is not None:
                        seq.job.on_token()
                except Exception as e:  # this sequence's sampling: its job alone fails
                    log.warning("sampling failed: %r", e)
                    self._fail(seq.job, e)
                    continue
                seq.job._items.put(tok)
                if last:
                    self._finish(seq)
                else:
                    going.append(seq)
        return [s for s in going if s in self._running]  # a sibling may have failed it

    def _decode(self, going: list[_Seq]) -> None:
        """One forward per group of similar lengths for ``going``."""
        with self.lock:
            for group in _similar_lengths(going):
                self._forward(group)

    def _forward(self, going: list[_Seq]) -> None:
        """One batched forward; if it raises, each sequence alone, failing only the
        jobs whose own forward fails."""
        lens = [s.state.cached for s in going]
        padding = len(lens) * max(lens) - sum(lens)
        if padding > self.peak_padding[0]:
            self.peak_padding = (padding, sum(lens), len(lens))
        try:
            self.engine.decode_batch([s.state for s in going])
        except Exception as e:
            if len(going) == 1:
                log.warning("decode step failed: %r", e)
                self._fail(going[0].job, e)
                return
            log.warning("batched decode step failed (%r): stepping each alone", e)
            for seq in going:
                if seq in self._running and seq.state.cached < len(seq.state.tokens):
                    self._forward([seq])
            return
        self._stepped(going)

    def _stepped(self, going: list[_Seq]) -> None:
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(going))
        if len(going) > 1:
            self.batched_tokens += len(going)

    def _finish(self, seq: _Seq, cancelled: bool = False) -> None:
        """``seq`` is over: out of the batch, owning its tensors; its job ends with
        its last sequence."""
        self._running.remove(seq)
        self.engine.detach(seq.state)  # a batch's tensors are not kept alive by it
        job = seq.job
        job._running -= 1
        if cancelled and not job.cancelled:
            job.stage = RUNNING
        job.cancelled = job.cancelled or cancelled
        if job._running == 0:
            self._budget.release(job)
            job.end()

    def _fail(self, job: Job, error: BaseException) -> None:
        for seq in [s for s in self._running if s.job is job]:
            self._running.remove(seq)
        if job._running:
            job._running = 0
            self._budget.release(job)
            job.end(error=error)

    def _fail_all(self, error: BaseException) -> None:
        for job in {seq.job for seq in self._running}:
            self._fail(job, error)
        with self._cv:
            pending = [*self._starting, *(p.job for p in self._prefilling), *self._waiting]
            waiting = list(dict.fromkeys(pending))  # a job starting may be prefilling already
            self._waiting, self._starting, self._prefilling = deque(), [], []
        for job in waiting:
            self._budget.release(job)
            job.end(error=error)


def _fork(engine: Engine, job: Job, state: KVState) -> list[_Seq]:
    """``job``'s ``n`` sequences from its computed prompt, each its own decoder."""
    n = job.sampling.n
    states = [state] + [engine.fork(state) for _ in range(n - 1)]
    job.choices.extend(Decoded() for _ in range(n - len(job.choices)))
    seqs = []
    for i, (st, out) in enumerate(zip(states, job.choices[:n], strict=True)):
        seed = None if job.sampling.seed is None else job.sampling.seed + i
        one = replace(job.sampling, seed=seed, n=1)  # each its own grammar matcher
        seqs.append(_Seq(job, st, Decoder(engine, st, one, out)))
    return seqs


def _chosen(running: list[_Seq], max_batch: int) -> list[_Seq]:
    """At most ``max_batch`` of ``running`` for this step: slots dealt to clients in
    turn, within a client to the sequences that decoded least."""
    if len(running) <= max_batch:
        return list(running)
    by_client: dict[str, list[_Seq]] = {}
    for seq in sorted(running, key=lambda s: s.decoder.i):
        by_client.setdefault(seq.job.client, []).append(seq)
    queues = list(by_client.values())
    chosen: list[_Seq] = []
    while len(chosen) < max_batch:
        for q in queues:
            if q and len(chosen) < max_batch:
                chosen.append(q.pop(0))
    return chosen


def _whole(engine: Engine, pre: Prefilling, n: int) -> int:
    """``n`` tokens of ``pre``'s prompt, moved so the forward stops at no picture's
    inside where the model attends both ways within one (``forward_tokens``)."""
    state = pre.plan.state
    return min(engine.forward_tokens(state.tokens, state.cached, n), pre.left)


def _resident_by_client(running: list[_Seq], prefilling: list[Prefilling]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in running:
        counts[seq.job.client] = counts.get(seq.job.client, 0) + 1
    for pre in prefilling:  # its sequences are coming
        counts[pre.job.client] = counts.get(pre.job.client, 0) + pre.job.sampling.n
    return counts


def _fairest(waiting: deque[Job], resident: dict[str, int]) -> Job | None:
    """The oldest waiting job of the client with the fewest resident sequences."""
    best: Job | None = None
    for job in waiting:  # in arrival order: the first of a client wins ties
        if best is None or resident.get(job.client, 0) < resident.get(best.client, 0):
            best = job
    return best


def _fits_batch(job: Job, resident: dict[str, int], max_batch: int) -> bool:
    """Whether ``job``'s sequences fit beside the resident ones (a client with none
    resident may take up to twice ``max_batch``)."""
    total = sum(resident.values()) + job.sampling.n
    newcomer = resident.get(job.client, 0) == 0
    return total <= (2 * max_batch if newcomer else max_batch)


def _similar_lengths(seqs: list[_Seq]) -> list[list[_Seq]]:
    """``seqs`` in groups whose padding to their longest stays small."""
    groups: list[list[_Seq]] = []
    real = 0  # tokens the last group holds
    for seq in sorted(seqs, key=lambda s: s.state.cached):
        n = seq.state.cached  # the longest so far: the width the group would pad to
        rows = len(groups[-1]) + 1 if groups else 1
        if groups and rows * n <= (1 + PAD_SLACK) * (real + n) + PAD_TOKENS * rows:
            groups[-1].append(seq)
            real += n
        else:
            groups.append([seq])
            real = n
    return groups


__all__ = [
    "CANCEL_STAGES",
    "DEFAULT_MAX_BATCH",
    "PAD_SLACK",
    "PAD_TOKENS",
    "PREFILLING",
    "QUEUED",
    "RUNNING",
    "STEP_FACTOR",
    "BatchRunner",
    "EngineFailed",
    "Job",
    "OverBudget",
    "PrefillPlan",
    "forward_work_bytes",
]
