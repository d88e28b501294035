"""The head runtime: one engine, its live sessions, and the fleet behind it.

``generate`` is the path of one request (docs/design.md §3),
read as plan → fetch → compute:

- *acquire* (no engine lock: network waits never block other requests): every
  source offers a prefix: the live session sharing the longest prefix, the
  local store, and — when the prompt is longer than both — the validated hits of
  the fleet. The longest prefix worth having wins; a remote prefix is fetched
  from where the local blocks end, and a failed peer gives way to the next one
  within one cache-time budget, then backs off (circuit breaker).
- *compute* (on the engine thread, :mod:`.batch`): import the acquired prefix or
  resume the session, compute the suffix (whatever the prefix came from, in chunks
  that share forwards with other prompts' and alternate with decode steps; whole
  blocks another request in flight under the same chain root holds are taken from
  it), then decode locally, batched with every
  other running request (continuous batching: one forward per step for all of
  them; a request running alone decodes exactly as it would unbatched).

Every cache failure is caught, counted as a fallback reason, and answered by
local prefill (invariant 1). Publishing starts only after the last token
(invariant 3: the decode loop makes no remote call) and runs on a background
thread. A request can be cancelled (its client left): while queued it never
takes the engine; while prefilling it stops before its next chunk, and the whole
blocks it computed are kept (stored and published as any computed block, handed
to requests waiting for them); while decoding it stops after the current token.
Cancellations are counted by stage (``cancelled:queued|prefilling|running``).
``max_batch`` sequences run at once and ``kv_budget_bytes`` bounds the KV they
may hold; beyond either, requests wait in order.

Tenants (:class:`Scope`, resolved by the API from what it authenticated): a
request's key chain starts from its scope's root, so it reads and fills only its
tenant's cache, in every tier and on every peer; blocks it keeps count against its
tenant's budget. Whole blocks are shared within a root; token-exact reuse (a live
session beyond whole blocks, an exact tail) only within one caller's own requests
(``client``), so no request learns another's prompt finer than a block.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import memory
from ..blocks import BlockKeyer
from ..codec import Block, new_blob
from ..engine import Decoded, Engine, KVState, Sampling
from ..engine.base import PREFILL_CHUNK, Decoder, Importer, TokenLogprob
from ..engine.scoring import prompt_logprobs
from ..errors import CacheMiss
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from ..mesh.node import NodeThread
from ..store import Match
from .acquire import Acquirer, Publisher
from .audit import AuditJob, Auditor
from .batch import (
    DEFAULT_MAX_BATCH,
    QUEUED,
    RUNNING,
    BatchRunner,
    EngineFailed,
    Job,
    PrefillPlan,
)
from .planner import Planner, failure_reason
from .telemetry import Count, Family, PrefillReport, Source, Telemetry, labelled

log = logging.getLogger("kvmesh.head")

MAX_TENANT_STATS = 1024  # tenants counted by name; the rest are counted together
WARM_TOKENS = 2048  # a fetch of this many tokens' KV finds its heap pre-faulted (see warm_up)
MAX_WARM_BYTES = 128 << 20  # ... at most this much, in each of two threads
OTHER_TENANTS = "_other"


@dataclass(frozen=True)
class Scope:
    """Whose cache a request reads and fills, as the server decided it (never the
    client's claim). ``root``: the chain root (:func:`kvmesh.blocks.chain_root`;
    None: the namespace, the one shared cache). ``tenant``: the name its blocks and
    counters go under on this head; it never leaves the head. ``caller``: whose
    token-exact reuse (exact tails, a session beyond whole blocks) the request
    shares; None: its ``client``'s, "": nobody's (an unidentified caller gets
    whole blocks only: behind a proxy or a NAT, one address is many people)."""

    root: bytes | None = None
    tenant: str | None = None
    caller: str | None = None

    def exact(self, client: str) -> str:
        """The identity token-exact reuse is keyed by: for an anonymous request
        (``caller`` ""), a fresh one each time, so it matches no other request."""
        if self.caller is None:
            return client
        return self.caller or "anonymous:" + os.urandom(16).hex()


def _caller(client: str) -> bytes | None:
    """The key a caller's own exact tails are made under (None: no caller known)."""
    return hashlib.sha256(b"kvmesh/caller/v1\x00" + client.encode()).digest() if client else None


@dataclass
class Generation:
    """Filled in while a request runs; final once its iterator is exhausted.
    ``choices`` are the ``sampling.n`` sequences decoded from one prefill, in order."""

    report: PrefillReport | None = None
    choices: list[Decoded] = field(default_factory=lambda: [Decoded()])
    ttft_s: float = 0.0
    cancelled: bool = False  # the client went away; ``tokens`` is what was decoded

    @property
    def tokens(self) -> list[int]:
        return self.choices[0].tokens

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


#: The stages of one request's path to its first token, in order (see :class:`Stamps`).
STAGES = ("lookup", "connect", "transfer", "verify", "queue", "import", "first_token")


@dataclass
class Stamps:
    """When one request reached each point on its way to the first token
    (``time.perf_counter()``; 0.0: not reached). :meth:`breakdown` turns them into
    the stages of :data:`STAGES`, which sum to the TTFT:

    - ``lookup``: keys, the local store and the fleet's lookup, until candidates are known;
    - ``connect``: plan, open the importer, hand the fetch to a stream, connect;
    - ``transfer``: connected until the last byte of the last block is in;
    - ``verify``: the digests and import copies not yet done then (they run while
      bytes arrive), keeping the blocks locally, back on the request's thread;
    - ``queue``: waiting for the engine thread;
    - ``import``: the imported prefix made a cache, and any suffix computed;
    - ``first_token``: sampling the first token.

    A stage a request did not reach takes 0 s (a local hit has no connect); time
    spent on a fetch that failed falls in ``verify``."""

    start: float
    looked_up: float = 0.0
    connected: float = 0.0
    received: float = 0.0
    acquired: float = 0.0
    engine: float = 0.0
    state: float = 0.0
    first: float = 0.0

    def breakdown(self) -> dict[str, float]:
        marks = (
            self.looked_up,
            self.connected,
            self.received,
            self.acquired,
            self.engine,
            self.state,
            self.first,
        )
        out, prev = {}, self.start
        for name, t in zip(STAGES, marks, strict=True):
            t = max(t, prev)  # not reached: the stage took nothing
            out[name], prev = t - prev, t
        return out


@dataclass
class _Acquired:
    """The prefix gathered for one request before the engine runs."""

    session: tuple[int, int] | None = None  # (session id, tokens to keep)
    source: Source = Source.COMPUTE  # disk: local, in part from the disk tier
    prefix: tuple[Block, ...] = ()  # the chain from the root (blocks, then a tail)
    importer: Importer | None = None  # ``prefix`` already copied in (remote)
    peer: str | None = None
    peer_id: str | None = None
    fetched: tuple[tuple[int, Block], ...] = ()  # (chain index, block) from the peer
    fetched_bytes: int = 0
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    fallback: str | None = None
    owner: str | None = None  # the tenant whose budget blocks kept for it count against

    @property
    def session_tokens(self) -> int:
        return self.session[1] if self.session else 0


@dataclass(frozen=True)
class _Begun:
    """A prompt's prefill before its suffix is computed (see :meth:`HeadRuntime._begin`)."""

    state: KVState
    source: Source
    prefix: tuple[Block, ...]
    fallback: str | None
    begin_s: float  # the import (or crop) took this long


@dataclass
class _Prefilled:
    """What a request's prefill left for its thread (filled on the engine thread)."""

    report: PrefillReport | None = None
    chain: tuple[Block, ...] = ()
    prompt: KVState | None = None  # the prompt's own view, for publishing


class HeadRuntime:
    def __init__(
        self,
        engine: Engine,
        node: NodeThread | None = None,
        *,
        hash_key: bytes | None = None,
        planner: Planner | None = None,
        telemetry: Telemetry | None = None,
        max_sessions: int = 8,
        fetch_timeout: float = 30.0,
        publish: bool = True,
        max_pending_publishes: int = 2,
        audit_rate: float = 0.0,
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.engine = engine
        self.card = engine.card
        self.node = node
        if engine.reuse_off is not None:  # served, every prompt computed, nothing shared
            log.warning("prefix reuse is off for this model: %s", engine.reuse_off)
            publish, max_sessions = False, 0
        reuse = node is not None and engine.reuse_off is None
        self.fleet = Fleet(node) if reuse and node is not None else None
        self.keyer = BlockKeyer(self.card.namespace, self.card.block_tokens, hash_key)
        self.planner = planner or Planner()
        self.telemetry = telemetry or Telemetry()
        self.max_sessions = max_sessions
        self.fetch_timeout = self.fleet.fetch_deadline if self.fleet else fetch_timeout
        self.publish_enabled = publish
        self.auditor = Auditor(audit_rate) if audit_rate else None
        self._lock = threading.RLock()  # held for each engine step (and audits between)
        self.batch = BatchRunner(
            engine, self._lock, max_batch, kv_budget_bytes, self._drop_sessions, prefill_chunk
        )
        self._sessions_lock = threading.Lock()
        self._sessions: OrderedDict[int, tuple[KVState, int]] = OrderedDict()  # (state, bytes)
        self._session_scope: dict[int, tuple[bytes, str]] = {}  # id -> (chain root, client)
        self._tenant_lock = threading.Lock()
        self.tenant_stats: dict[str, dict[str, int]] = {}  # tenant -> counters (admin reads)
        self._next_session = 0
        count = self.telemetry.count
        self.acquirer = Acquirer(self.fleet, self.planner, count) if self.fleet else None
        # exports waiting for the publisher: dropped beyond ``max_pending_publishes``
        self.publisher = Publisher(self.fleet, self.card, max_pending_publishes, count)
        if self.fleet is not None:
            self.fleet.advertise(self.card)
        self.warm_s = self.warm_up()

    def warm_up(self) -> float:
        """Pay a new process's first-use costs now rather than in its first request:
        the fetch path's threads, code paths and pre-faulted heap
        (:meth:`~kvmesh.mesh.fleet.Fleet.warm`, sized for :data:`WARM_TOKENS` of KV,
        at most :data:`MAX_WARM_BYTES`), and the engine's import and first-token
        paths (a one-token synthetic tail imported, its token sampled). Bounded in
        memory by that size and in time by a short deadline; a failure is logged,
        never raised (a cold first request is still correct). Returns the seconds
        it took."""
        t0 = time.perf_counter()
        try:
            if self.engine.reuse_off is not None:  # nothing imports: the first token only
                state = self.engine.prefill([0])
                Decoder(self.engine, state, Sampling(max_tokens=1)).next()
                return time.perf_counter() - t0
            sample = self._warm_block()
            if self.fleet is not None:
                nbytes = min(self.card.kv_bytes_per_token * WARM_TOKENS, MAX_WARM_BYTES)
                self.fleet.warm(self.engine.layout, sample, nbytes, timeout=5.0)
            importer = self.engine.importer(sample.header.tokens)
            importer.add(sample)
            tokens = [0] * sample.header.tokens
            state = self.engine.prefill(tokens, (sample,), importer)
            Decoder(self.engine, state, Sampling(max_tokens=1)).next()
        except Exception as e:  # only the first request's speed is at stake
            log.warning("warm-up failed: %r", e)
        took = time.perf_counter() - t0
        log.info("warm-up took %.0f ms", took * 1000)
        return took

    def _warm_block(self) -> Block:
        """A one-token tail of zeros under a key no prompt has (never stored)."""
        layout = self.engine.layout
        header = layout.header("tail", bytes(32), self.card.namespace, 0, 1)
        blob, _ = new_blob(header)
        return layout.seal(header, blob)

    # -- the request path ------------------------------------------------------

    def generate(
        self,
        tokens: Sequence[int],
        sampling: Sampling,
        out: Generation,
        cancel: threading.Event | None = None,
        on_start: Callable[[], None] | None = None,
        client: str = "",
        scope: Scope | None = None,
        on_token: Callable[[], None] | None = None,
    ) -> Iterator[int]:
        """Prefill (planned) then decode locally, yielding tokens; publish after.

        ``cancel`` (the client went away): a request still queued never runs, a
        prefilling one stops before its next chunk (its computed whole blocks are
        kept), a running one stops after the token being decoded. ``on_start`` is
        called once the engine is this request's (it has left the queue);
        ``on_token`` on the engine thread as each token is decoded, before it is
        handed on. ``client`` names whose fair share of the batch it takes (see
        :mod:`.batch`) and whose own conversation it continues; ``scope`` whose
        cache it uses (:class:`Scope`)."""
        tokens = list(tokens)
        self.check_request(len(tokens), sampling)  # before any network work
        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            self._cancelled(out, QUEUED)
            return
        scope = scope or Scope()
        keyer = self.keyer_for(scope, client)
        stamps = Stamps(t0)
        # network waits happen here, never on the engine thread; no idle heap trim
        # may land in the middle of them
        acquiring = f"acquire-{id(out)}"
        memory.after_request(idle=False, source=acquiring)
        try:
            got = self._acquire(tokens, keyer, scope.exact(client), scope.tenant, stamps)
        finally:
            memory.after_request(idle=True, source=acquiring)
        stamps.acquired = time.perf_counter()
        done = _Prefilled()

        def prefill() -> PrefillPlan:  # on the engine thread: the batch computes the rest
            stamps.engine = time.perf_counter()
            with self._lock:
                begun = self._begin(tokens, got)
            return self._plan(tokens, got, begun, done, out, keyer, stamps, scope.tenant)

        def first_token() -> None:
            if not out.ttft_s:
                stamps.first = time.perf_counter()
                out.ttft_s = stamps.first - t0
                if done.report is not None:
                    done.report.breakdown.update(stamps.breakdown())
            if on_token is not None:
                on_token()

        job = Job(
            sampling,
            out.choices,
            prefill,
            self._kv_bytes(len(tokens), sampling),
            cancel,
            on_start,
            first_token,
            client,
            prompt_tokens=len(tokens),
        )
        yield from self.batch.submit(job).tokens()
        state = job.state
        if state is None:  # cancelled queued or prefilling: nothing decoded
            self._cancelled(out, job.stage or QUEUED)
            return
        if job.cancelled:  # the state is whole: keep and publish it
            self._cancelled(out, job.stage or RUNNING)
        report, prompt = done.report, done.prompt
        assert report is not None and prompt is not None  # the job ran: it was prefilled
        self.telemetry.record(report, sum(len(c.tokens) for c in out.choices))
        self._count_tenant(scope.tenant, report)
        self._keep_session(state, keyer.root, scope.exact(client))
        if self.publish_enabled:
            self._publish_later(
                prompt, state, done.chain, keyer, scope.tenant, tails=scope.caller != ""
            )
        if self.auditor is not None and report.source == Source.REMOTE and got.peer_id:
            audit = self.auditor.pick(tokens, got.fetched, got.peer_id, got.peer or "")
            if audit is not None:
                self.publisher.background(self._audit, audit, keyer)

    def keyer_for(self, scope: Scope, client: str = "") -> BlockKeyer:
        """The keyer of ``scope``'s chains, its exact tails ``client``'s own."""
        return self.keyer.rooted(scope.root or self.card.namespace, _caller(scope.exact(client)))

    def _count_tenant(self, tenant: str | None, report: PrefillReport) -> None:
        if tenant is None:
            return
        with self._tenant_lock:
            if tenant not in self.tenant_stats and len(self.tenant_stats) >= MAX_TENANT_STATS:
                tenant = OTHER_TENANTS
            c = self.tenant_stats.setdefault(tenant, {})
            for name, n in (
                ("requests", 1),
                ("hits", int(report.reused_tokens > 0)),
                ("prompt_tokens", report.prompt_tokens),
                ("reused_tokens", report.reused_tokens),
            ):
                c[name] = c.get(name, 0) + n

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        """A copy of each tenant's counters (for admin reads only)."""
        with self._tenant_lock:
            return {t: dict(c) for t, c in self.tenant_stats.items()}

    def prompt_logprobs(
        self, tokens: Sequence[int], top: int = 0, cancel: threading.Event | None = None
    ) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability and ``top`` alternatives (None for the
        first): one full forward of its own, nothing cached reused (see
        :mod:`kvmesh.engine.scoring`), the engine lock held one chunk at a time so
        running requests decode between chunks. An engine that died fails it."""
        if self.engine_failure is not None:
            raise EngineFailed(f"the engine thread died: {self.engine_failure!r}")
        return prompt_logprobs(self.engine, tokens, top, lock=self._lock, cancel=cancel)

    def check_request(self, prompt_tokens: int, sampling: Sampling) -> None:
        """Raise ValueError (a 400) for a request this head could never run: ``n``
        beyond the batch, or a worst case beyond the KV budget."""
        self.batch.check(sampling.n, self._kv_bytes(prompt_tokens, sampling), prompt_tokens)

    @property
    def engine_failure(self) -> BaseException | None:
        """Why the engine thread died, or None while it serves."""
        return self.batch.failure

    def _kv_bytes(self, prompt_tokens: int, sampling: Sampling) -> int:
        """The KV a request's sequences may hold at their longest (its budget share):
        each of its ``n`` sequences ends up with its own copy of the prompt."""
        per = self.card.kv_bytes_per_token
        return per * sampling.n * (prompt_tokens + sampling.max_tokens)

    def _cancelled(self, out: Generation, stage: str) -> None:
        out.cancelled = True
        self.telemetry.count(labelled(Family.CANCELLED, stage))

    def complete(self, tokens: Sequence[int], sampling: Sampling) -> Generation:
        out = Generation()
        for _ in self.generate(tokens, sampling, out):
            pass
        return out

    def prefill(self, tokens: list[int]) -> tuple[KVState, PrefillReport, tuple[Block, ...]]:
        """State for ``tokens`` and how it was obtained; also the reused block chain.
        Beside the batch (see :meth:`_compute`), not through it."""
        got = self._acquire(list(tokens), self.keyer)
        return self._compute(list(tokens), got)

    def _acquire(
        self,
        tokens: list[int],
        keyer: BlockKeyer,
        client: str = "",
        tenant: str | None = None,
        stamps: Stamps | None = None,
    ) -> _Acquired:
        """Gather the best prefix. Sources: a live session, the local store and,
        when the prompt is longer than both, the fleet (never skipped because a
        session holds a shorter prefix), through the shared acquisition core
        (:mod:`.acquire`): failed remote candidates give way to the next within
        one cache-time budget. ``stamps`` hears when candidates were known and
        when the stream connected and received."""
        stamps = stamps or Stamps(time.perf_counter())
        keys = keyer.keys(tokens)
        got = _Acquired(session=self._best_session(tokens, keyer.root, client), owner=tenant)
        local = self.acquirer.local(keys) if self.acquirer else Match((), None)
        if got.session_tokens >= local.tokens and got.session_tokens:
            got.source = Source.SESSION  # resuming is a crop, importing a copy: sessions win ties
        elif local.tokens:
            got.source, got.prefix = Source.DISK if local.from_disk else Source.LOCAL, local.all()
        have = max(got.session_tokens, local.tokens)
        if self.acquirer is None or have >= len(tokens) - 1:
            stamps.looked_up = time.perf_counter()
            return got
        found = self.acquirer.candidates(self.card, keys, have)
        stamps.looked_up = time.perf_counter()
        got.lookup_s, got.fallback = found.lookup_s, found.fallback
        # a tail is matched token-exactly: after one, the fetch starts from the root
        skip = len(local.blocks) if local.tail is None else 0

        def open_importer(hit: PeerHit) -> Importer:
            # bounded by the prompt: a validated hit holds no more tokens than its keys
            importer = self.engine.importer(hit.tokens)
            for blk in local.blocks[:skip]:
                importer.add(blk)
            return importer

        budget = self.acquirer.budget(len(tokens)) - found.lookup_s
        done = self.acquirer.fetch(
            self.engine.layout,
            found.hits,
            local,
            skip,
            have,
            budget,
            open_importer,
            owner=tenant,
        )
        if done.hit is None:
            got.fallback = done.fallback or got.fallback
            return got
        stamps.connected, stamps.received = done.times.connected, done.times.received
        got.source, got.importer, got.fetched_bytes = Source.REMOTE, done.sink, done.nbytes
        got.peer, got.peer_id, got.fetch_s = done.hit.alias, done.hit.node_id, done.fetch_s
        got.fetched = tuple(enumerate(done.blocks, start=skip))
        got.prefix = tuple(local.blocks[:skip]) + tuple(done.blocks)
        got.fallback = None
        return got

    def _compute(
        self, tokens: list[int], got: _Acquired
    ) -> tuple[KVState, PrefillReport, tuple[Block, ...]]:
        """Import the acquired prefix (or resume the session) and compute the rest,
        as the batch does (``prefill_chunk`` tokens a forward), the engine lock held
        for each step, so running streams decode between them. Any failure to use
        the prefix computes it all."""
        with self._lock:
            begun = self._begin(tokens, got)
        t0 = time.perf_counter()
        try:
            self._finish(begun.state)
        except Exception as e:  # invariant 1: compute it all
            if begun.source == Source.COMPUTE:
                raise
            with self._lock:
                begun = self._anew(tokens, e)
            self._finish(begun.state)
        return begun.state, *self._report(tokens, got, begun, time.perf_counter() - t0)

    def _finish(self, state: KVState) -> None:
        while state.cached < len(state.tokens):
            n = min(self.batch.prefill_chunk, len(state.tokens) - state.cached)
            with self._lock:
                self.engine.prefill_batch([state], [n])

    def _begin(self, tokens: list[int], got: _Acquired) -> _Begun:
        """Under the engine lock: the prompt's state with the acquired prefix imported
        (or the session resumed), its suffix still to compute. A prefix that cannot
        be used is dropped (invariant 1: everything is computed)."""
        t0 = time.perf_counter()
        try:
            if got.source == Source.SESSION:
                state = self._resume(tokens, got)
            else:
                state = self.engine.begin_prefill(tokens, got.prefix, got.importer)
        except Exception as e:  # invariant 1: compute it all
            return self._anew(tokens, e, t0)
        return _Begun(state, got.source, got.prefix, got.fallback, time.perf_counter() - t0)

    def _anew(self, tokens: list[int], error: BaseException, t0: float | None = None) -> _Begun:
        """A prompt computed from nothing, after ``error`` made its prefix unusable."""
        t0 = time.perf_counter() if t0 is None else t0
        state = self.engine.begin_prefill(tokens)
        return _Begun(state, Source.COMPUTE, (), failure_reason(error), time.perf_counter() - t0)

    def _plan(
        self,
        tokens: list[int],
        got: _Acquired,
        begun: _Begun,
        done: _Prefilled,
        out: Generation,
        keyer: BlockKeyer,
        stamps: Stamps,
        owner: str | None = None,
    ) -> PrefillPlan:
        """The batch's plan for a request's prefill, computed in chunks whatever its
        prefix came from (a session's state is taken out of the session table: the
        plan's state is a crop of it, which nothing else extends): reported into
        ``done`` and ``out`` once computed; a failed forward starts over computing
        everything; given up (cancelled, failed), the whole blocks it computed are
        kept (:meth:`_keep_abandoned`, against ``owner``'s budget)."""
        plan = PrefillPlan(begun.state, share=keyer.root)

        def finished(state: KVState) -> None:  # on the engine thread
            stamps.state = time.perf_counter()
            b = begun
            if plan.shared:  # whole blocks of another request's state, still in memory
                b = _Begun(state, Source.SESSION, (), begun.fallback, begun.begin_s)
            done.report, done.chain = self._report(tokens, got, b, plan.compute_s)
            out.report = done.report
            done.prompt = KVState(list(tokens), state.cache, state.logits, len(tokens))

        def anew(error: BaseException) -> PrefillPlan:
            begun = self._anew(tokens, error)
            return self._plan(tokens, got, begun, done, out, keyer, stamps, owner)

        def abandoned(state: KVState) -> None:  # on the engine thread
            self._keep_abandoned(state, keyer, owner)

        plan.done, plan.fallback, plan.abandoned = finished, anew, abandoned
        return plan

    def _keep_abandoned(self, state: KVState, keyer: BlockKeyer, owner: str | None) -> None:
        """Keep and publish the whole blocks of a prompt given up while it was being
        computed (cancelled, failed), as a finished prompt's are: the next request
        for them imports them. Only when it computed a block beyond what it came
        with; the chain from the root is what the local store holds, then the
        export of the rest (on the publisher thread)."""
        b = self.card.block_tokens
        n = state.cached // b * b
        fleet = self.fleet
        if not self.publish_enabled or fleet is None or n <= state.imported_tokens:
            return
        if not self.publisher.reserve():
            return
        partial = KVState(state.tokens[:n], state.cache, None, n)  # blocks only: no tail

        def chains() -> list[list[Block]]:  # on the publisher thread
            keys = keyer.keys(partial.tokens)
            have = list(fleet.local_prefix(keys).blocks)
            more = self.engine.export(partial, keyer, keys, first_block=len(have))
            return [have + more]

        self.publisher.submit(chains, Count.PARTIAL_BLOCKS, owner)

    def _report(
        self, tokens: list[int], got: _Acquired, begun: _Begun, compute_s: float
    ) -> tuple[PrefillReport, tuple[Block, ...]]:
        """How ``begun``'s prompt was obtained, now that it is computed; and the
        reused block chain."""
        state, fallback, source, prefix = begun.state, begun.fallback, begun.source, begun.prefix
        dt = begun.begin_s + compute_s
        if state.computed_tokens:
            self.planner.observe_prefill(state.computed_tokens, dt)
        if fallback:
            log.info("prefill fell back: %s", fallback)
        report = PrefillReport(
            source=source,
            prompt_tokens=len(tokens),
            reused_tokens=state.imported_tokens,
            computed_tokens=state.computed_tokens,
            peer=got.peer if source == Source.REMOTE else None,
            bytes_fetched=got.fetched_bytes if source == Source.REMOTE else 0,
            fallback=fallback,
            lookup_s=got.lookup_s,
            fetch_s=got.fetch_s,
            import_s=dt if not state.computed_tokens else 0.0,
            compute_s=dt,
            saved_s=self.planner.compute_s(state.imported_tokens),
            used_stored_logits=state.used_stored_logits,
        )
        chain = () if source == Source.SESSION else prefix
        return report, tuple(b for b in chain if b.header.kind == "block")

    def _resume(self, tokens: list[int], got: _Acquired) -> KVState:
        assert got.session is not None
        sid, keep = got.session
        session = self._take_session(sid)
        if session is None:
            raise CacheMiss("the session was taken by another request")
        return self.engine.begin_resume(session, keep, tokens)

    # -- sessions --------------------------------------------------------------

    def session_prefix(self, tokens: list[int], root: bytes | None = None, client: str = "") -> int:
        """Prompt tokens a live session would give ``tokens`` now (0: none)."""
        best = self._best_session(tokens, root, client)
        return best[1] if best else 0

    def _best_session(
        self, tokens: list[int], root: bytes | None = None, client: str = ""
    ) -> tuple[int, int] | None:
        """(id, tokens it can keep) of the live session sharing the longest prefix
        with ``tokens``, when that is at least one block. Not taken yet. Only
        sessions under ``root``; another caller's only in whole blocks."""
        best, best_len = None, 0
        root = root or self.card.namespace
        b = self.card.block_tokens
        with self._sessions_lock:
            for sid, (st, _) in self._sessions.items():
                owner = self._session_scope.get(sid, (self.card.namespace, ""))
                if owner[0] != root:
                    continue
                n = _common_prefix(st.tokens[: st.cached], tokens)
                if owner[1] != client:  # not the caller's own conversation
                    n -= n % b
                if n > best_len:
                    best, best_len = sid, n
        if best is None or best_len < self.card.block_tokens:
            return None
        return best, min(best_len, len(tokens) - 1)

    def _keep_session(self, state: KVState, root: bytes | None = None, client: str = "") -> None:
        """Keep ``state`` as a session, its KV reserved in the batch's budget (older
        sessions give way; a session that cannot fit is not kept), as ``client``'s
        under ``root``."""
        nbytes = self.card.kv_bytes_per_token * state.cached
        if self.max_sessions < 1:
            return
        with self._sessions_lock:
            while len(self._sessions) >= self.max_sessions:
                self._forget_oldest()
            while not self.batch.reserve(nbytes):
                if not self._sessions:
                    return
                self._forget_oldest()
            self._sessions[self._next_session] = (state, nbytes)
            self._session_scope[self._next_session] = (root or self.card.namespace, client)
            for sid in [s for s in self._session_scope if s not in self._sessions]:
                del self._session_scope[sid]  # taken or forgotten
            self._next_session += 1

    def _take_session(self, sid: int) -> KVState | None:
        with self._sessions_lock:
            kept = self._sessions.pop(sid, None)
        if kept is None:
            return None
        self.batch.unreserve(kept[1])  # the request resuming it holds its own share
        return kept[0]

    def _forget_oldest(self) -> None:
        _, (_, nbytes) = self._sessions.popitem(last=False)
        self.batch.unreserve(nbytes)

    def _drop_sessions(self, nbytes: int) -> None:
        """Give back at least ``nbytes`` of the budget, oldest sessions first (the
        batch asks before a request would wait for room)."""
        freed = 0
        with self._sessions_lock:
            while self._sessions and freed < nbytes:
                freed += self._sessions[next(iter(self._sessions))][1]
                self._forget_oldest()

    # -- audit -----------------------------------------------------------------

    def _audit(self, job: AuditJob, keyer: BlockKeyer | None = None) -> None:
        """Recompute one imported block (background thread, engine lock held
        briefly as for any request); quarantine the peer on a disagreement."""
        try:
            with self._lock:
                agrees = Auditor.agrees(self.engine, keyer or self.keyer, job)
        except Exception as e:  # an audit never fails anything else
            log.warning("audit failed: %r", e)
            return
        if agrees is None:
            return
        self.telemetry.count("audits")
        if not agrees:
            self.telemetry.count("audit_mismatch")
            self.planner.quarantine(job.peer_id)
            log.warning("peer %s served KV that disagrees with a recompute: quarantined", job.peer)

    # -- publishing ------------------------------------------------------------

    def _publish_later(
        self,
        prompt: KVState,
        final: KVState,
        reused: tuple[Block, ...],
        keyer: BlockKeyer | None = None,
        owner: str | None = None,
        tails: bool = True,
    ) -> None:
        """Export and publish the prompt's blocks (and the answer's) off the request
        path; without ``tails`` (an anonymous request: its tail is keyed for nobody)
        whole blocks only."""
        if not self.publisher.reserve():
            return
        keyer = keyer or self.keyer

        def chains() -> list[list[Block]]:  # on the publisher thread
            n_reused = len(reused)
            blocks = list(reused) + self.engine.export(prompt, keyer, first_block=n_reused)
            prompt_full = [b for b in blocks if b.header.kind == "block"]
            more = self.engine.export(
                KVState(final.tokens[: final.cached], final.cache, None, final.cached),
                keyer,
                first_block=len(prompt_full),
            )
            out = [blocks, prompt_full + more] if more else [blocks]
            if tails:
                return out
            whole = ([b for b in c if b.header.kind != "tail"] for c in out)
            return [c for c in whole if c]

        self.publisher.submit(chains, "published_blocks", owner)

    def publish_pending(self) -> int:
        """Publishes not yet handed to peers (exports running or queued sends)."""
        return self.publisher.pending()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued publishes to reach the peers (tests and the demo)."""
        self.publisher.flush(timeout)

    def close(self) -> None:
        self.batch.close()
        self.publisher.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n
