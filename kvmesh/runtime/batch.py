"""Continuous batching: one engine thread advances running sequences by one token
per step, in one forward pass, shared fairly between clients.

A request whose prefix was already acquired (network waits happen on its own
thread, never here) is submitted as a :class:`Job`, tagged with its ``client``
(whatever the caller names: the HTTP API uses a valid API key, else an address). Contract:

- **Admission.** Between steps the engine thread admits waiting jobs, the client
  with the fewest resident sequences first (in order within a client). A job is
  admitted while its sequences fit ``max_batch``, or, for a client with nothing
  resident yet, ``2 * max_batch`` (a newcomer never waits behind one client's whole
  generation); and while the KV they may hold fits ``kv_budget_bytes``. A job that
  does not fit blocks those behind it (no starvation of large requests). A job
  that could never fit the budget is refused at :meth:`BatchRunner.submit` with
  :class:`OverBudget`.
- **What the budget counts.** A job's ``kv_bytes`` is the KV all its ``n``
  sequences may hold at their longest (each fork ends up with its own copy). For
  an engine that batches, a step also builds a padded working copy of the
  sequences it decodes (the torch engine keeps it while the same sequences step
  together, their KV then views of it; it is rebuilt when the group changes, the
  old and the new copy alive together), and a forward only batches lengths whose padding stays
  within :data:`PAD_SLACK` of their KV plus :data:`PAD_TOKENS` a sequence (one
  16k-token sequence never pads seven short ones to 16k), so a job is charged
  ``STEP_FACTOR`` times its KV plus ``PAD_TOKENS`` a sequence (a batched prefill
  forward pads its prompts by the same rule, then each keeps a copy of its row).
  Until its prompt is computed a job is also charged the working memory of its
  largest prefill forward (:func:`forward_work_bytes`: one chunk of its prompt
  attending to all of it), given back once its prompt is computed. Other
  holders (the head's kept sessions) reserve through :meth:`BatchRunner.reserve`,
  and are asked to give room back (``make_room``) before a job is made to wait.
- **Prefill.** Admitting a job asks it for its :class:`PrefillPlan` (its acquired
  prefix imported, its session resumed or another job's blocks taken: a state
  holding some positions, never a state anything else extends) and leaves the rest
  of its prompt to compute, whatever its prefix came from. A loop turn runs one
  prefill forward, then one decode step, so decoding never waits for a whole
  prompt: a running stream waits at most one forward of at most ``prefill_chunk``
  tokens a prompt, and its own step. That forward
  takes the prefilling job with the fewest tokens left (the least mean time to a
  first token: a short prompt never waits behind another's whole prefill; one
  passed over for :data:`STARVE_TURNS` forwards goes first), at most
  ``prefill_chunk`` of its tokens, and beside it (up to ``max_batch`` rows, while
  the forward holds at most ``prefill_batch_tokens``: past that a CPU gains
  nothing from batching) the prefilling jobs whose next chunks are within
  :data:`PAD_SLACK` of its length and whose positions pad within the decode rule
  below (each row computes its own chunk, right-padded to the longest):
  :meth:`Engine.prefill_batch`, one forward for several prompts. A job alone in
  its forward computes exactly as unbatched (a session resume of at most
  ``prefill_chunk`` new tokens computes exactly as :meth:`Engine.resume`).
- **Shared prefixes.** A job whose whole blocks (``card.block_tokens``) a job of
  the same chain root (:attr:`PrefillPlan.share`; docs/design.md invariant 11) is
  prefilling or has prefilled, beyond the prefix it brought, takes them from that
  job's state (a crop: the producer's very bytes, as its published blocks would be)
  and computes only the rest; when the producer has not computed them yet it waits,
  without being scheduled, until it has (at most :data:`SHARE_WAIT_S`); if the
  producer fails or is cancelled first, it takes the whole blocks the producer
  did compute, then waits for another producer or computes the rest itself (the
  producer's plan hears of them too, :attr:`PrefillPlan.abandoned`: the head
  keeps them as any computed block). Never with
  ``max_batch`` 1 (each prompt computes as if alone), never across roots, never
  finer than whole blocks.
- **Steps.** A computed prompt forks its job's ``n`` sequences. A step decodes at
  most ``max_batch`` sequences: when
  more are resident, slots are dealt to clients in turn, and within a client to
  the sequences that have decoded least. Each chosen sequence samples its next
  token (handed to its job at once), then one forward per group of similar
  lengths runs for those that go on (:meth:`Engine.decode_batch`; one sequence
  alone is the single-sequence forward, so a request running alone decodes
  exactly as before batching).
- **Failures.** A sequence whose sampling raises fails its own job only; a
  batched forward (decode or prefill) that raises is retried one sequence at a
  time, so only the jobs whose forward fails end (a prefill first starts over once
  through :attr:`PrefillPlan.fallback`, computing everything: invariant 1). If the
  loop itself dies (a bug), every waiting, prefilling and running job fails with
  :class:`EngineFailed`, later submits raise it, and
  :attr:`BatchRunner.failure` says why (``/healthz`` turns red): nothing hangs.

The engine lock is held for each forward and step, so other engine work (audits)
runs between them. A job's cancel event is checked every turn: a waiting job
never runs, a prefilling one stops before its next chunk (no state: nothing
decoded; what it computed is handed on, see above), a running one stops after
the token being decoded. :attr:`Job.stage` says where a cancelled job was
(:data:`CANCEL_STAGES`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import memory
from ..compat import dtype_size
from ..engine.base import PREFILL_CHUNK, Decoded, Decoder, Engine, KVState, Sampling
from ..engine.grammar import compile_grammar

log = logging.getLogger("kvmesh.batch")

DEFAULT_MAX_BATCH = 8
PAD_SLACK = 0.25  # a forward's padding stays within 25% of its real KV ...
PAD_TOKENS = 256  # ... plus this many tokens a sequence (short chats stay one batch)
STEP_FACTOR = 2.0 + PAD_SLACK  # a sequence's KV + its padded working copy in a step
SHARE_WAIT_S = 60.0  # the longest a job waits for another's prefill of their common blocks
# A prefill forward takes more prompts while it holds at most this many tokens: on a
# 2-core Xeon (demo model, one thread) a forward costs 77 / 45 / 31 / 26 / 24 / 25 ms a
# token at 16 / 32 / 64 / 128 / 256 / 512 tokens: past ~256 batching saves nothing and
# only delays the first prompt's first token.
PREFILL_BATCH_TOKENS = 256
STARVE_TURNS = 8  # a prompt passed over for this many prefill forwards goes next
# where a job was when its client left (Job.stage; the head counts cancellations by it)
QUEUED, PREFILLING, RUNNING = "queued", "prefilling", "running"
CANCEL_STAGES = (QUEUED, PREFILLING, RUNNING)


class OverBudget(ValueError):
    """A request whose worst case can never fit the KV budget."""


class EngineFailed(RuntimeError):
    """The engine thread died; no request can run on this head."""


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
class _Done:
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
    _items: queue.SimpleQueue[int | _Done] = field(default_factory=queue.SimpleQueue)
    _running: int = 0
    _charged: int = 0  # bytes held against the budget while admitted
    _work: int = 0  # of those, its prefill forwards' working memory (until prefilled)
    _root: bytes | None = None  # its plan's chain root, for sharing once it runs

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


@dataclass(eq=False)
class _Pre:
    """A job whose prompt is being computed."""

    job: Job
    plan: PrefillPlan
    since: int = 0  # the prefill forward count when it was planned or last advanced
    producer: _Pre | None = None  # whose prefill of ``want`` positions it waits for
    want: int = 0
    deadline: float = 0.0
    restarted: bool = False  # its fallback was used

    @property
    def left(self) -> int:
        return len(self.plan.state.tokens) - self.plan.state.cached


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
        self.prefill_chunk = prefill_chunk
        self.prefill_batch_tokens = prefill_batch_tokens
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._starting: list[Job] = []  # admitted, not yet planned
        self._prefilling: list[_Pre] = []  # planned, their prompts being computed
        self._running: list[_Seq] = []
        self._kv_held = 0
        self._reserved = 0  # held by others (sessions) against the same budget
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
        self.prefill_tokens = 0  # prompt tokens computed by prefill forwards
        self.peak_prefill_chunk = 0  # most tokens one prompt computed in one forward
        self.shared_tokens = 0  # prompt positions taken from another job's state
        self.share_waits = 0  # jobs that waited for another's prefill of their common blocks
        # of shared_tokens, those taken from a producer that was cancelled or failed
        self.share_rescued_tokens = 0
        self._geometry = _geometry(engine)  # for forward_work_bytes
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- the request side --------------------------------------------------------

    def charge(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """What a job of ``n`` sequences holding ``kv_bytes`` of KV in all counts
        against the budget while it prefills its ``prompt_tokens`` (None: as many
        as ``kv_bytes`` holds): its KV (with a step's working copy) and its
        :meth:`prefill_work`."""
        work = self.prefill_work(kv_bytes, n, prompt_tokens)
        if not self.engine.batches:
            return kv_bytes + work
        pad = n * PAD_TOKENS * self.engine.card.kv_bytes_per_token
        return int(kv_bytes * STEP_FACTOR) + pad + work

    def prefill_work(self, kv_bytes: int, n: int = 1, prompt_tokens: int | None = None) -> int:
        """The working memory of a job's largest prefill forward: one chunk of its
        prompt attending to all of it (:func:`forward_work_bytes`). A prompt whose
        length is not given is taken to fill its ``kv_bytes``."""
        ctx = prompt_tokens
        if ctx is None:
            ctx = kv_bytes // max(1, n * self.engine.card.kv_bytes_per_token)
        if ctx <= 0:
            return 0
        return forward_work_bytes(self.engine, min(self.prefill_chunk, ctx), ctx, self._geometry)

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
        with self._cv:
            budget = self.kv_budget_bytes
            if budget is not None and self._kv_held + self._reserved + nbytes > budget:
                return False
            self._reserved += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._cv:
            self._reserved -= nbytes
            self._cv.notify()

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
        return self._kv_held + self._reserved

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
                    self._fail_all(RuntimeError("the engine is shut down"))
                    return
            self._starting = self._admissible()
            while self._starting:  # each stays listed while it starts: a death ends it too
                self._begin(self._starting[0])
                self._starting.pop(0)
            if self._prefilling:
                self._prefill_turn()
            if self._running:
                self._step()

    def _admissible(self) -> list[Job]:
        """Jobs to start now, fairest first (see the module docstring). Cancelled
        waiting jobs end here."""
        with self._cv:
            for gone in [j for j in self._waiting if j._gone()]:  # wherever they wait
                self._waiting.remove(gone)
                self._end(gone, cancelled=True, stage=QUEUED)
        resident = self._resident_by_client()
        out: list[Job] = []
        while True:
            with self._cv:
                job = self._fairest(resident)
                if job is None or not self._fits_batch(job, resident):
                    return out
                need = self.charge(job.kv_bytes, job.sampling.n, job.prompt_tokens)
                work = self.prefill_work(job.kv_bytes, job.sampling.n, job.prompt_tokens)
                short = need - self._free_kv() if self.kv_budget_bytes is not None else 0
            if 0 < short <= self._reserved and self.make_room is not None:
                self.make_room(short)  # sessions give room back (outside our lock)
            with self._cv:
                if not self._fits_kv(need, out):
                    return out
                self._waiting.remove(job)
                self._kv_held += need
                job._charged, job._work = need, work
            resident[job.client] = resident.get(job.client, 0) + job.sampling.n
            out.append(job)

    def _resident_by_client(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for seq in self._running:
            counts[seq.job.client] = counts.get(seq.job.client, 0) + 1
        for pre in self._prefilling:  # its sequences are coming
            counts[pre.job.client] = counts.get(pre.job.client, 0) + pre.job.sampling.n
        return counts

    def _fairest(self, resident: dict[str, int]) -> Job | None:
        """The oldest waiting job of the client with the fewest resident sequences."""
        best: Job | None = None
        for job in self._waiting:  # in arrival order: the first of a client wins ties
            if best is None or resident.get(job.client, 0) < resident.get(best.client, 0):
                best = job
        return best

    def _fits_batch(self, job: Job, resident: dict[str, int]) -> bool:
        total = sum(resident.values()) + job.sampling.n
        newcomer = resident.get(job.client, 0) == 0
        return total <= (2 * self.max_batch if newcomer else self.max_batch)

    def _free_kv(self) -> int:
        assert self.kv_budget_bytes is not None
        return self.kv_budget_bytes - self._kv_held - self._reserved

    def _fits_kv(self, need: int, admitted_now: list[Job]) -> bool:
        if self.kv_budget_bytes is None or need <= self._free_kv():
            return True
        # alone it runs whatever else holds reservations (submit checked need <= budget)
        return not self._running and not self._prefilling and not admitted_now

    # -- prefill ---------------------------------------------------------------------

    def _begin(self, job: Job) -> None:
        """Plan ``job``'s prefill (its prefix imported); a prompt with nothing left
        to compute starts decoding at once."""
        try:
            if job.on_start is not None:
                job.on_start()
            plan = job.prefill()
        except Exception as e:  # this job's import or plan: it alone fails
            self._release(job)
            self._end(job, error=e)
            return
        job._root = plan.share
        pre = _Pre(job, plan, since=self.prefill_forwards)
        if pre.left <= 0:
            self._prefilled(pre)
            return
        self._prefilling.append(pre)
        self._find_share(pre)

    def _prefill_turn(self) -> None:
        """End cancelled prefills, settle shared prefixes, then one prefill forward."""
        for pre in [p for p in self._prefilling if p.job._gone()]:
            self._prefilling.remove(pre)
            self._abandon(pre)
            self._release(pre.job)
            self._end(pre.job, cancelled=True, stage=PREFILLING)
        self._settle_waits()
        ready = [p for p in self._prefilling if p.producer is None]
        if not ready:
            return
        group, chunks = self._prefill_group(ready)
        self._prefill_forward(group, chunks)
        for pre in group:
            if pre in self._prefilling and pre.left <= 0:
                self._prefilling.remove(pre)
                self._prefilled(pre)

    def _next_chunk(self, pre: _Pre) -> int:
        return min(pre.left, self.prefill_chunk)

    def _lead(self, ready: list[_Pre]) -> _Pre:
        """The prompt with the fewest tokens left (the first listed at a tie: arrival
        order), unless one was passed over too long."""
        starved = [p for p in ready if self.prefill_forwards - p.since >= STARVE_TURNS]
        if starved:
            return min(starved, key=lambda p: p.since)
        return min(ready, key=lambda p: p.left)

    def _prefill_group(self, ready: list[_Pre]) -> tuple[list[_Pre], list[int]]:
        """The next prompt and those that share its forward (see the module
        docstring), and the chunk each of them computes."""
        lead = self._lead(ready)
        group, chunks = [lead], [self._next_chunk(lead)]
        if not self.engine.batches:
            return group, chunks
        for pre in sorted(ready, key=lambda p: p.left):
            if len(group) >= self.max_batch:
                break
            n = self._next_chunk(pre)
            qs = [*chunks, n]
            if pre is lead or max(qs) > (1 + PAD_SLACK) * min(qs):
                continue
            if len(qs) * max(qs) > self.prefill_batch_tokens:
                break
            if _pads_within([p.plan.state.cached for p in [*group, pre]], qs):
                group.append(pre)
                chunks.append(n)
        return group, chunks

    def _prefill_forward(self, group: list[_Pre], chunks: list[int]) -> None:
        """One forward of ``chunks[i]`` tokens of each prompt ``group[i]``; if it
        raises, each alone, and a prompt whose own forward fails starts over once
        (its fallback), else its job fails."""
        states = [p.plan.state for p in group]
        t0 = time.perf_counter()
        try:
            with self.lock:
                self.engine.prefill_batch(states, chunks)
        except Exception as e:
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
        self.prefill_forwards += 1
        self.prefill_tokens += sum(chunks)
        self.peak_prefill_chunk = max(self.peak_prefill_chunk, *chunks)
        self.peak_prefill_batch = max(self.peak_prefill_batch, len(group))
        for pre, n in zip(group, chunks, strict=True):
            pre.since = self.prefill_forwards
            pre.plan.compute_s += dt * n / sum(chunks)  # its share of the forward

    def _prefill_failed(self, pre: _Pre, error: Exception) -> None:
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
        self._prefilling.remove(pre)
        self._abandon(pre)
        self._release(pre.job)
        self._end(pre.job, error=error)

    def _prefilled(self, pre: _Pre) -> None:
        """``pre``'s prompt is computed: report it and fork its sequences."""
        job, state = pre.job, pre.plan.state
        self._unwork(job)  # its prefill forwards are over
        try:
            if pre.plan.done is not None:
                pre.plan.done(state)
            job.state = state
            if job._gone():
                self._release(job)
                self._end(job, cancelled=True, stage=PREFILLING)
                return
            n = job.sampling.n
            states = [state] + [self.engine.fork(state) for _ in range(n - 1)]
            job.choices.extend(Decoded() for _ in range(n - len(job.choices)))
            seqs = []
            for i, (st, out) in enumerate(zip(states, job.choices[:n], strict=True)):
                seed = None if job.sampling.seed is None else job.sampling.seed + i
                one = replace(job.sampling, seed=seed, n=1)  # each its own grammar matcher
                seqs.append(_Seq(job, st, Decoder(self.engine, st, one, out)))
        except Exception as e:  # this job's report, forks or decoders: it alone fails
            self._release(job)
            self._end(job, error=e)
            return
        self._running.extend(seqs)
        job._running = n
        self.peak_resident = max(self.peak_resident, len(self._running))

    # -- shared prefixes -------------------------------------------------------------

    def _find_share(self, pre: _Pre) -> None:
        """Take the longest run of whole blocks another job of ``pre``'s root holds
        beyond ``pre``'s own prefix, or wait for a prefilling one to compute it."""
        root, state = pre.plan.share, pre.plan.state
        if root is None or self.max_batch == 1:
            return
        b = self.engine.card.block_tokens
        cap = (len(state.tokens) - 1) // b * b  # at least one token is computed
        sources: list[tuple[KVState, _Pre | None, int]] = [
            (p.plan.state, p, len(p.plan.state.tokens))
            for p in self._prefilling
            if p is not pre and p.producer is None and p.job._root == root
        ]
        sources += [(s.state, None, s.state.cached) for s in self._running if s.job._root == root]
        best: tuple[int, bool, KVState, _Pre | None] | None = None
        for src, producer, upto in sources:
            m = min(_common_prefix(src.tokens[:upto], state.tokens) // b * b, cap)
            key = (m, src.cached >= m)  # the longest; at a tie, one that holds it now
            if m > state.cached and (best is None or key > best[:2]):
                best = (m, src.cached >= m, src, producer)
        if best is None:
            return
        m, ready, src, producer = best
        if ready:
            self._share(pre, src, m)
        elif producer is not None:  # a running state holds all it has: only a prefill waits
            pre.producer, pre.want = producer, m
            pre.deadline = time.monotonic() + SHARE_WAIT_S
            self.share_waits += 1

    def _settle_waits(self) -> None:
        """Jobs whose producer computed what they wait for take it; those whose
        producer left without it (failed, cancelled, started over) or took too long
        look again, or compute it themselves."""
        now = time.monotonic()
        for pre in list(self._prefilling):
            producer = pre.producer
            if producer is None:
                continue
            src = producer.plan.state
            want = pre.want
            if src.cached >= want and src.tokens[:want] == pre.plan.state.tokens[:want]:
                pre.producer = None
                self._share(pre, src, want)
            elif (
                producer not in self._prefilling
                or producer.producer is not None
                or now > pre.deadline
            ):
                pre.producer = None
                if now <= pre.deadline:
                    self._find_share(pre)

    def _share(self, pre: _Pre, src: KVState, m: int) -> bool:
        """``pre`` continues from the first ``m`` positions of ``src``."""
        try:
            with self.lock:
                state = self.engine.begin_resume(src, m, pre.plan.state.tokens)
                self.engine.detach(state)  # its own tensors, never a view of a batch
        except Exception as e:  # the prompt is computed as it was planned
            log.warning("sharing a prefix failed: %r", e)
            return False
        m = state.cached  # a recurrent state restarts from its last checkpoint
        state.imported_tokens, state.computed_tokens = m, len(state.tokens) - m
        pre.plan.state, pre.plan.shared = state, m
        self.shared_tokens += m
        return True

    def _abandon(self, gone: _Pre) -> None:
        """``gone`` leaves before its prompt is computed (cancelled, failed): the jobs
        waiting for its blocks take the whole blocks it holds (computed by
        successful forwards, or brought), then look for another producer or compute
        the rest; its plan hears of what it holds (the head keeps those blocks)."""
        src, b = gone.plan.state, self.engine.card.block_tokens
        have = src.cached // b * b
        now = time.monotonic()
        for pre in [p for p in self._prefilling if p.producer is gone]:
            pre.producer = None
            m = min(pre.want, have)
            mine = pre.plan.state
            if m > mine.cached and src.tokens[:m] == mine.tokens[:m] and self._share(pre, src, m):
                self.share_rescued_tokens += m
            if now <= pre.deadline:
                self._find_share(pre)  # another job may hold or compute more
        if gone.plan.abandoned is not None and src.cached:
            try:
                gone.plan.abandoned(src)
            except Exception as e:  # keeping its blocks is optional
                log.warning("keeping an abandoned prefill failed: %r", e)

    # -- decode ----------------------------------------------------------------------

    def _chosen(self) -> list[_Seq]:
        """At most ``max_batch`` sequences for this step: slots dealt to clients in
        turn, within a client to the sequences that decoded least."""
        if len(self._running) <= self.max_batch:
            return list(self._running)
        by_client: dict[str, list[_Seq]] = {}
        for seq in sorted(self._running, key=lambda s: s.decoder.i):
            by_client.setdefault(seq.job.client, []).append(seq)
        queues = list(by_client.values())
        chosen: list[_Seq] = []
        while len(chosen) < self.max_batch:
            for q in queues:
                if q and len(chosen) < self.max_batch:
                    chosen.append(q.pop(0))
        return chosen

    def _step(self) -> None:
        """Sample each chosen sequence, then one forward for those that go on."""
        going: list[_Seq] = []
        with self.lock:
            for seq in self._chosen():
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
            going = [s for s in going if s in self._running]  # a sibling may have failed it
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
            self._kv_held -= job._charged
            job._charged = job._work = 0

    def _unwork(self, job: Job) -> None:
        """Give back the part of ``job``'s charge its prefill forwards needed."""
        with self._cv:
            self._kv_held -= job._work
            job._charged -= job._work
            job._work = 0

    @staticmethod
    def _end(
        job: Job, cancelled: bool = False, error: BaseException | None = None, stage: str = ""
    ) -> None:
        if cancelled and not job.cancelled:
            job.stage = stage
        job.cancelled = job.cancelled or cancelled
        job._items.put(_Done(error))

    def _fail_all(self, error: BaseException) -> None:
        for job in {seq.job for seq in self._running}:
            self._fail(job, error)
        with self._cv:
            pending = [*self._starting, *(p.job for p in self._prefilling), *self._waiting]
            waiting = list(dict.fromkeys(pending))  # a job starting may be prefilling already
            self._waiting, self._starting, self._prefilling = deque(), [], []
        for job in waiting:
            self._release(job)
            self._end(job, error=error)


@dataclass(frozen=True)
class _Geometry:
    heads: int  # query heads
    hidden: int
    intermediate: int
    itemsize: int  # bytes of one activation


def _geometry(engine: Engine) -> _Geometry:
    """What sizes a forward's activations: the loaded model's config where the
    engine has one (transformers' ``model.config``, mlx-lm's ``model.args``), else
    a guess from the card that errs high (8 query heads a KV head, an MLP 4 times
    the hidden size)."""
    card = engine.card
    model = getattr(engine, "model", None)
    cfg = getattr(model, "config", None) or getattr(model, "args", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)

    def read(name: str) -> int:
        v = getattr(cfg, name, None)
        return v if isinstance(v, int) and v > 0 else 0

    kv_heads = max((g.kv_heads for g in card.geometry), default=0) or 1
    head_dim = max((g.head_dim for g in card.geometry), default=0) or 128
    heads = read("num_attention_heads") or 8 * kv_heads
    hidden = read("hidden_size") or heads * head_dim
    intermediate = read("intermediate_size") or 4 * hidden
    size = getattr(getattr(engine, "dtype", None), "itemsize", None)
    itemsize = size if isinstance(size, int) and size > 0 else dtype_size(card.kv_dtype)
    return _Geometry(heads, hidden, intermediate, itemsize)


def forward_work_bytes(engine: Engine, q: int, ctx: int, geometry: _Geometry | None = None) -> int:
    """Memory a forward of ``q`` prompt tokens attending to ``ctx`` positions holds
    beside the KV, an estimate that errs high (an engine's own
    ``forward_work_bytes(q, ctx)`` is taken when it has one): one layer's attention
    scores and their mask (attention with a mask on the CPU materialises them:
    measured 6.7 bytes per query-key pair on demo-tiny's two float32 heads, this
    counts 9), the layer's activations (hidden states, Q/K/V/O, the MLP's three),
    and a second copy of one layer's KV while the cache grows by concatenation.
    Computing a prompt in one forward holds the scores of all of it at once:
    chunks keep this bounded by ``q``."""
    own = getattr(engine, "forward_work_bytes", None)
    if callable(own):
        return int(own(q, ctx))
    g = geometry or _geometry(engine)
    card = engine.card
    scores = q * ctx * (g.heads * g.itemsize + 1)
    acts = q * (4 * g.hidden + 3 * g.intermediate) * g.itemsize
    layer = ctx * card.kv_bytes_per_token // max(1, card.num_layers)
    return scores + acts + layer


def _pads_within(pasts: Sequence[int], chunks: Sequence[int]) -> bool:
    """Whether rows of ``pasts`` cached positions, computing ``chunks`` more, pad
    (cached positions right-aligned, chunks after them) within the rule of
    :func:`_similar_lengths`."""
    widths = [max(pasts) + max(chunks)] * len(pasts)  # what the padded batch holds
    real = [n + q for n, q in zip(pasts, chunks, strict=True)]
    padding = sum(widths) - sum(real)
    return padding <= PAD_SLACK * sum(real) + PAD_TOKENS * len(real)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


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
    "BatchRunner",
    "EngineFailed",
    "Job",
    "OverBudget",
    "PrefillPlan",
    "forward_work_bytes",
]
