"""The head runtime: one engine, its live sessions, and the fleet behind it.

``generate`` is the path of one request (docs/design.md §3), plan → fetch → compute:

- *acquire* (:meth:`.acquire.Acquirer.acquire`, off the engine thread: network
  waits never block other requests): the longest prefix worth having among a
  live session, the local store and the fleet's validated hits;
- *compute* (on the engine thread, :mod:`.batch`): import the prefix or resume
  the session, compute the suffix in chunks batched with other prompts' and with
  decode steps, then decode, batched with every running request.

Every cache failure is caught, counted as a fallback reason and answered by local
prefill (invariant 1). Publishing starts after the last token (invariant 3) on a
background thread. A cancelled request (its client left) never takes the engine
while queued, stops before its next chunk while prefilling (its computed whole
blocks kept and published), after the current token while decoding; counted
``cancelled:queued|prefilling|running``. ``max_batch`` sequences run at once and
``kv_budget_bytes`` bounds their KV; beyond either, requests wait in order.

Tenants (:class:`CacheScope`, resolved by the API): a request's key chain starts from
its scope's root, so it reads and fills only its tenant's cache, everywhere;
blocks it keeps count against its tenant's budget. Whole blocks are shared within
a root; token-exact reuse (a session beyond whole blocks, an exact tail) only
within one caller's own requests, so no request learns another's prompt finer
than a block.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import memory
from ..blocks import BlockKeyer
from ..codec import Block
from ..engine import Decoded, Engine, KVState, Sampling
from ..engine.base import PREFILL_CHUNK, Importer, TokenLogprob
from ..engine.scoring import prompt_logprobs
from ..errors import CacheMiss
from ..mesh.fleet import Fleet
from ..mesh.hits import PeerHit
from ..mesh.node import NodeThread
from .acquire import Acquired, Acquirer
from .audit import Auditor, Taken
from .batch import (
    DEFAULT_MAX_BATCH,
    QUEUED,
    RUNNING,
    BatchRunner,
    EngineFailed,
    Job,
    PrefillPlan,
)
from .calibrate import Calibrator
from .giveback import GiveBack
from .pictures import PictureRows
from .planner import Planner, failure_reason
from .ready import ready
from .sessions import Sessions
from .telemetry import Count, Family, PrefillReport, Source, Telemetry, labelled

log = logging.getLogger("kvmesh.head")

MAX_TENANT_STATS = 1024  # tenants counted by name; the rest are counted together
OTHER_TENANTS = "_other"
PROBE_TOKENS = 64  # a short prefill timed at start (Planner.observe_probe)


def probe_prefill(engine: Engine, planner: Planner, vocab_size: int) -> None:
    """Time one short prefill now, so a fresh head's first fetch budgets come from
    this machine (:meth:`.planner.Planner.cold_s`), not the planner's prior. A
    failure is logged, never raised: the prior stands."""
    tokens = [i % max(2, vocab_size) for i in range(PROBE_TOKENS)]
    try:
        took = []
        for _ in range(3):  # the best of three: a first run at a new size pays set-up
            t0 = time.perf_counter()
            engine.prefill(tokens)
            took.append(time.perf_counter() - t0)
        planner.observe_probe(len(tokens), min(took))
    except Exception as e:
        log.warning("prefill probe failed: %r", e)


@dataclass(frozen=True)
class CacheScope:
    """Whose cache a request reads and fills, as the server decided it (never the
    client's claim). ``root``: the chain root (:func:`kvmesh.blocks.chain_root`;
    None: the namespace, the one shared cache). ``tenant``: the name its blocks and
    counters go under on this head; it never leaves the head. ``caller``: whose
    token-exact reuse (exact tails, a session beyond whole blocks) the request
    shares; None: its ``client``'s, "": nobody's (an unidentified caller gets
    whole blocks only: behind a proxy or a NAT, one address is many people).
    ``adapter``: the LoRA adapter it computes with (its name on the engine; its
    weights digest is in ``root``)."""

    root: bytes | None = None
    tenant: str | None = None
    caller: str | None = None
    adapter: str | None = None

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


@dataclass(frozen=True)
class _Acquired:
    """The prefix gathered for one request before the engine runs."""

    found: Acquired = field(default_factory=Acquired)
    session: int | None = None  # the live session's id, when ``found`` resumes it

    @property
    def fetched(self) -> tuple[tuple[int, Block], ...]:
        """(chain index, block) of each block fetched from the peer."""
        return tuple(enumerate(self.found.fetched.blocks, start=self.found.start))


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


def _prefill_report(
    planner: Planner, tokens: list[int], got: _Acquired, begun: _Begun, compute_s: float
) -> tuple[PrefillReport, tuple[Block, ...]]:
    """How ``begun``'s prompt was obtained, now that it is computed (its prefill
    time learnt by ``planner``); and the reused block chain."""
    state, fallback, source, prefix = begun.state, begun.fallback, begun.source, begun.prefix
    found = got.found
    dt = begun.begin_s + compute_s
    if state.computed_tokens:
        planner.observe_prefill(state.computed_tokens, dt)
    if fallback:
        log.info("prefill fell back: %s", fallback)
    report = PrefillReport(
        source=source,
        prompt_tokens=len(tokens),
        reused_tokens=state.imported_tokens,
        computed_tokens=state.computed_tokens,
        peer=found.hit.alias if source == Source.REMOTE and found.hit else None,
        bytes_fetched=found.fetched.nbytes if source == Source.REMOTE else 0,
        fallback=fallback,
        lookup_s=found.lookup_s,
        fetch_s=found.fetched.fetch_s,
        import_s=dt if not state.computed_tokens else 0.0,
        compute_s=dt,
        saved_s=planner.compute_s(state.imported_tokens),
        used_stored_logits=state.used_stored_logits,
        **_wire_report(found, source == Source.REMOTE),
    )
    chain = () if source == Source.SESSION else prefix
    return report, tuple(b for b in chain if b.header.kind == "block")


class HeadRuntime:
    """One engine serving requests (:meth:`generate`) with its sessions, batch,
    acquirer and give-back queue; see the module."""

    def __init__(
        self,
        engine: Engine,
        node: NodeThread | None = None,
        *,
        hash_key: bytes | None = None,
        planner: Planner | None = None,
        telemetry: Telemetry | None = None,
        max_sessions: int = 8,
        publish: bool = True,
        max_pending_publishes: int = 2,
        audit_rate: float = 0.0,
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        """``node``: the mesh node this head serves through (:attr:`fleet`, its one
        door to the mesh; None: a head alone); ``hash_key``: the fleet's block-key
        secret, from which :attr:`keyer` is made; ``adapters``: LoRA adapters to
        serve, name -> PEFT directory (ConfigError for one the engine cannot take)."""
        self.engine = engine
        self.card = engine.card
        # name -> weights digest: a request naming one computes with it, keyed by it
        self.adapters = {n: engine.load_adapter(n, p) for n, p in (adapters or {}).items()}
        self.node = node  # the node itself: tests and benchmarks reach in; the head does not
        if engine.reuse_off is not None:  # served, every prompt computed, nothing shared
            log.warning("prefix reuse is off for this model: %s", engine.reuse_off)
            publish, max_sessions = False, 0
        self.fleet = Fleet(node) if node is not None else None
        reuse = self.fleet if engine.reuse_off is None else None  # None: nothing shared
        if self.fleet is not None:
            self.keyer = self.fleet.keyer(self.card, hash_key)
        else:
            self.keyer = BlockKeyer(self.card.namespace, self.card.block_tokens, hash_key)
        self.planner = planner or Planner()
        self.telemetry = telemetry or Telemetry()
        self.publish_enabled = publish
        self.auditor = Auditor(audit_rate) if audit_rate else None
        self._lock = threading.RLock()  # held for each engine step (and audits between)
        self.batch = BatchRunner(
            engine, self._lock, max_batch, kv_budget_bytes, self._make_room, prefill_chunk
        )
        self.sessions = Sessions(self.card, max_sessions, self.batch)
        self.tenants = TenantStats()
        count = self.telemetry.count
        self.calibrator = Calibrator()  # what each part codec achieves here
        self.acquirer = Acquirer(reuse, self.planner, count, self.calibrator)
        if self.fleet is not None:
            self.fleet.show_links(self.planner.links)
        # exports waiting to be given back: dropped beyond ``max_pending_publishes``
        self.give_back = GiveBack(reuse, self.card, max_pending_publishes, count)
        self.pictures = (  # a vision model's encoder rows, shared as blocks
            PictureRows(engine.vision, self.card, reuse, hash_key, self.planner.lookup_hooks(count))
            if reuse is not None and engine.vision is not None
            else None
        )
        if reuse is not None:
            reuse.advertise(self.card)
        self.warm_s = self.warm_up()
        if reuse is not None:
            with self._lock:
                probe_prefill(self.engine, self.planner, self.card.vocab_size)

    def warm_up(self) -> float:
        """Pay a new process's first-use costs now rather than in its first request
        (:func:`.ready.ready`: the fetch path's threads, code paths and pre-faulted
        heap, the engine's import and first-token paths; and, in a process that
        called :func:`.ready.prepare_process`, what a head does once at start).
        A failure is logged, never raised. Returns the seconds it took."""
        return ready(self.engine, self.fleet, self.engine.layout)

    # -- the request path ------------------------------------------------------

    def generate(
        self,
        tokens: Sequence[int],
        sampling: Sampling,
        out: Generation,
        cancel: threading.Event | None = None,
        on_start: Callable[[], None] | None = None,
        client: str = "",
        scope: CacheScope | None = None,
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
        cache it uses (:class:`CacheScope`)."""
        tokens = list(tokens)
        self.check_request(len(tokens), sampling)  # before any network work
        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            self._cancelled(out, QUEUED)
            return
        scope = scope or CacheScope()
        caller = scope.exact(client)  # decided once: an anonymous caller's is new each time
        keyer = self.keyer_for(scope.root, caller)
        stamps = Stamps(t0)
        got = self._acquire(tokens, keyer, caller, scope.tenant, stamps, id(out))
        taken = []  # pictures of what is computed whose encoder rows a peer served
        if self.pictures is not None:
            taken = self.pictures.acquire(tokens, got.found.tokens)
        stamps.acquired = time.perf_counter()
        done = _Prefilled()

        def prefill() -> PrefillPlan:  # on the engine thread: the batch computes the rest
            stamps.engine = time.perf_counter()
            with self._lock:
                begun = self._begin(tokens, got, scope.adapter)
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
        if job.state is None:  # cancelled queued or prefilling: nothing decoded
            self._cancelled(out, job.stage or QUEUED)
            return
        if job.cancelled:  # the state is whole: keep and publish it
            self._cancelled(out, job.stage or RUNNING)
        self._decoded(tokens, job.state, done, got, out, keyer, scope, caller)
        self._pictures_after(taken)

    def _pictures_after(self, taken: Sequence[Taken]) -> None:
        """After a request: publish the rows of the pictures encoded here, and maybe
        audit rows a peer served for it (as fetched KV is audited)."""
        if self.pictures is None:
            return
        if self.publish_enabled:
            self.pictures.publish(self.give_back)
        for one in taken:
            if self.auditor is not None and self.auditor.chance():
                args = (self.engine.vision, self._lock, one, self.planner, self.telemetry.count)
                self.give_back.background(self.auditor.check_rows, *args)

    def _decoded(
        self,
        tokens: list[int],
        state: KVState,
        done: _Prefilled,
        got: _Acquired,
        out: Generation,
        keyer: BlockKeyer,
        scope: CacheScope,
        caller: str,
    ) -> None:
        """After the last token: count the request, keep its state as ``caller``'s
        session, publish its blocks, and maybe audit what was fetched for it."""
        report, prompt = done.report, done.prompt
        assert report is not None and prompt is not None  # the job ran: it was prefilled
        self.telemetry.record(report, sum(len(c.tokens) for c in out.choices))
        self.tenants.count(scope.tenant, report)
        self.sessions.keep(state, keyer.root, caller)
        if self.publish_enabled:
            self._publish_later(
                prompt, state, done.chain, keyer, scope.tenant, tails=scope.caller != ""
            )
        hit = got.found.hit
        if self.auditor is not None and report.source == Source.REMOTE and hit is not None:
            audit = self.auditor.pick(tokens, got.fetched, hit.node_id, hit.alias, scope.adapter)
            if audit is not None:
                check = self.auditor.check
                args = (self.engine, self._lock, keyer, audit, self.planner, self.telemetry.count)
                self.give_back.background(check, *args)

    def _make_room(self, nbytes: int) -> None:
        """Give back at least ``nbytes`` of the KV budget, oldest sessions first (the
        batch asks before a request would wait for room)."""
        self.sessions.drop(nbytes)

    def keyer_for(self, root: bytes | None, caller: str = "") -> BlockKeyer:
        """The keyer of the chains under ``root`` (None: the namespace), its exact
        tails ``caller``'s (:meth:`CacheScope.exact`)."""
        return self.keyer.rooted(root or self.card.namespace, _caller(caller))

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        """A copy of each tenant's counters (for admin reads only)."""
        return self.tenants.counters()

    def prompt_logprobs(
        self,
        tokens: Sequence[int],
        top: int = 0,
        cancel: threading.Event | None = None,
        adapter: str | None = None,
    ) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability and ``top`` alternatives (None for the
        first) with LoRA ``adapter``: one full forward of its own, nothing cached
        reused (see :mod:`kvmesh.engine.scoring`), the engine lock held one chunk at
        a time so running requests decode between chunks. An engine that died fails it."""
        if self.engine_failure is not None:
            raise EngineFailed(f"the engine thread died: {self.engine_failure!r}")
        return prompt_logprobs(self.engine, tokens, top, self._lock, cancel, adapter=adapter)

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
        return sampling.n * self.card.sequence_bytes(prompt_tokens + sampling.max_tokens)

    def _cancelled(self, out: Generation, stage: str) -> None:
        out.cancelled = True
        self.telemetry.count(labelled(Family.CANCELLED, stage))

    def complete(self, tokens: Sequence[int], sampling: Sampling) -> Generation:
        out = Generation()
        for _ in self.generate(tokens, sampling, out):
            pass
        return out

    def _acquire(
        self,
        tokens: list[int],
        keyer: BlockKeyer,
        client: str,
        tenant: str | None,
        stamps: Stamps,
        request: int,
    ) -> _Acquired:
        """The best prefix (:meth:`.acquire.Acquirer.acquire`) among ``client``'s
        live sessions, the local store and the fleet, a fetched one imported as it
        arrives. ``stamps`` hears when candidates were known and when the stream
        connected and received. No idle heap trim lands in the middle of it."""
        keys = keyer.keys(tokens)
        session = self.sessions.best(tokens, keyer.root, client)

        def open_importer(
            hit: PeerHit, held: tuple[Block, ...], keep_from: tuple[int, ...] | None
        ) -> Importer:
            # bounded by the prompt: a validated hit holds no more tokens than its keys
            importer = self.engine.importer(hit.tokens, keep_from)
            self.acquirer.imported(held, importer.add)
            return importer

        def looked_up() -> None:
            stamps.looked_up = time.perf_counter()

        acquiring = f"acquire-{request}"
        memory.after_request(idle=False, source=acquiring)
        try:
            found = self.acquirer.acquire(
                self.engine.layout,
                keys,
                open_importer,
                session=session[1] if session else 0,
                on_looked_up=looked_up,
                owner=tenant,
            )
        finally:
            memory.after_request(idle=True, source=acquiring)
        stamps.looked_up = stamps.looked_up or time.perf_counter()
        if found.source == Source.REMOTE:
            stamps.connected = found.fetched.times.connected
            stamps.received = found.fetched.times.received
        return _Acquired(found, session[0] if session else None)

    def _begin(self, tokens: list[int], got: _Acquired, adapter: str | None) -> _Begun:
        """Under the engine lock: the prompt's state with the acquired prefix imported
        (or the session resumed), its suffix still to compute. A prefix that cannot
        be used is dropped (invariant 1: everything is computed)."""
        t0 = time.perf_counter()
        try:
            found = got.found
            if found.source == Source.SESSION:
                state = self._resume(tokens, got)
            else:
                sink = found.fetched.sink or self._import_held(found.prefix)
                state = self.engine.begin_prefill(tokens, found.prefix, sink, adapter)
        except Exception as e:  # invariant 1: compute it all
            return self._anew(tokens, e, adapter, t0)
        return _Begun(state, found.source, found.prefix, found.fallback, time.perf_counter() - t0)

    def _import_held(self, prefix: tuple[Block, ...]) -> Importer | None:
        """The stored ``prefix`` copied into an importer through the acquirer (which
        learns the import bandwidth from it, as from a fetch's); None for none.
        Stored blocks are whole (the store refuses trimmed ones)."""
        if not prefix:
            return None
        importer = self.engine.importer(sum(b.header.tokens for b in prefix))
        self.acquirer.imported(prefix, importer.add)
        return importer

    def _anew(
        self, tokens: list[int], error: BaseException, adapter: str | None, t0: float | None = None
    ) -> _Begun:
        """A prompt computed from nothing, after ``error`` made its prefix unusable."""
        t0 = time.perf_counter() if t0 is None else t0
        state = self.engine.begin_prefill(tokens, adapter=adapter)
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
            done.report, done.chain = _prefill_report(self.planner, tokens, got, b, plan.compute_s)
            out.report = done.report
            done.prompt = state.view(len(tokens), state.logits)

        def anew(error: BaseException) -> PrefillPlan:
            begun = self._anew(tokens, error, plan.state.adapter)
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
        export of the rest (on the give-back thread)."""
        b = self.card.block_tokens
        n = state.cached // b * b
        fleet = self.give_back.fleet  # None: nothing shared
        if not self.publish_enabled or fleet is None or n <= state.imported_tokens:
            return
        if not self.give_back.reserve():
            return
        partial = state.view(n)  # blocks only: no tail

        def chains() -> list[list[Block]]:  # on the give-back thread
            keys = keyer.keys(partial.tokens)
            have = list(fleet.local_prefix(keys).blocks)
            more = self.engine.export(partial, keyer, keys, first_block=len(have))
            return [have + more]

        self.give_back.submit(chains, Count.PARTIAL_BLOCKS, owner)

    def _resume(self, tokens: list[int], got: _Acquired) -> KVState:
        session = self.sessions.take(got.session) if got.session is not None else None
        if session is None:
            raise CacheMiss("the session was taken by another request")
        return self.engine.begin_resume(session, got.found.tokens, tokens)

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
        if not self.give_back.reserve():
            return
        keyer = keyer or self.keyer

        def chains() -> list[list[Block]]:  # on the give-back thread
            # after a trimmed import the prompt's state lacks the positions before
            # its windows: its blocks are exported from where it holds them all
            held = -(-self.engine.exportable_from(prompt) // self.card.block_tokens)
            n_reused = max(len(reused), held)
            blocks = list(reused[:n_reused]) + self.engine.export(
                prompt, keyer, first_block=n_reused
            )
            prompt_full = [b for b in blocks if b.header.kind == "block"]
            skipped = n_reused - len(reused[:n_reused])  # blocks the chain starts after
            more = self.engine.export(
                final.view(final.cached),
                keyer,
                first_block=skipped + len(prompt_full),
            )
            if blocks:
                self.calibrator.calibrate(blocks[0])
            out = [blocks, prompt_full + more] if more else [blocks]
            if tails:
                return out
            whole = ([b for b in c if b.header.kind != "tail"] for c in out)
            return [c for c in whole if c]

        self.give_back.submit(chains, Count.PUBLISHED_BLOCKS, owner)

    def publish_pending(self) -> int:
        """Publishes not yet handed to peers (exports running or queued sends)."""
        return self.give_back.pending()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued publishes to reach the peers (tests and the demo)."""
        self.give_back.flush(timeout)

    def close(self) -> None:
        self.batch.close()
        self.give_back.close()
        self.planner.flush()  # what it learned of the links, kept for the next start


class TenantStats:
    """Counters per tenant (requests, hits, prompt and reused tokens), bounded:
    beyond :data:`MAX_TENANT_STATS` names, the rest are counted together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, int]] = {}

    def count(self, tenant: str | None, report: PrefillReport) -> None:
        if tenant is None:
            return
        with self._lock:
            if tenant not in self._stats and len(self._stats) >= MAX_TENANT_STATS:
                tenant = OTHER_TENANTS
            c = self._stats.setdefault(tenant, {})
            for name, n in (
                ("requests", 1),
                ("hits", int(report.reused_tokens > 0)),
                ("prompt_tokens", report.prompt_tokens),
                ("reused_tokens", report.reused_tokens),
            ):
                c[name] = c.get(name, 0) + n

    def counters(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t: dict(c) for t, c in self._stats.items()}


def _wire_report(found: Acquired, remote: bool) -> dict[str, Any]:
    """The report's fields on how a fetch moved (or would have moved) its bytes."""
    f = found.fetched
    out: dict[str, Any] = {}
    if f.choice is not None:
        c = f.choice
        out["planner"] = {"choice": c.name, "fetch_s_est": c.fetch_s, "compute_s_est": c.compute_s}
    if remote:
        out.update(bytes_wire=f.times.wire_bytes, trimmed=f.want.keep_from is not None)
        out["codec"] = f.want.codecs[0] if f.want.codecs else ""
    return out
