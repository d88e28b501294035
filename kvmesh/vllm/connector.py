"""``KVMeshConnector``: vLLM's KV connector API on top of the kvmesh mesh, in vLLM's
own process layout: the scheduler side in the engine-core process, the worker side
in each worker process (one per tensor-parallel rank), nothing shared between them
but vLLM's connector metadata, which vLLM serialises every step.

Scheduler side (never waits, holds no mesh state):

- ``get_num_new_matched_tokens``: a prompt's full pages (never its last token)
  are *asked* of the workers in the next step's metadata; vLLM is told "ask
  again" (``None``) until every rank has answered how many pages it can load
  (``build_connector_worker_meta`` → ``update_connector_output``). The load
  offered is the least any rank holds, always asynchronous; a worker that does
  not answer in time (lookup deadline + grace) means computing.
- ``update_state_after_alloc`` / ``build_connector_meta``: which vLLM pages to
  fill for which request, which computed prompts to save, which requests ended.
- ``request_finished``: what kvmesh did for the request goes back to the client
  as ``kv_transfer_params["kvmesh"]`` (pages offered and loaded, source, peer,
  fallback).

Worker side (each rank its own mesh node, store and shard of the KV heads; the
rank and world size are in the card, so shards of different layouts never mix):

- an *ask* starts an acquisition on a worker thread through the shared core
  (:mod:`kvmesh.runtime.acquire`: local store, fleet candidates, planned verified
  fetch, next candidate on failure); its promise is answered as soon as the
  fetch starts, the fetch goes on while vLLM allocates pages.
- ``start_load_kv``: verified pages are copied into the request's pages on a load
  thread; pages that could not be had are reported through
  ``get_block_ids_with_load_errors`` with the request in ``get_finished``, so
  vLLM recomputes them (the answer never depends on the cache). vLLM reports a
  load finished only once every rank has finished it.
- ``wait_for_save``: the prompt pages a step completed and the store lacks are
  copied out in that step (one copy, on the model's path: a sliding window's
  pages are freed at the next step); once the prefill is complete the chain is
  sealed (BLAKE3), stored and published by the core's publisher through its
  bounded slots. A page vLLM no longer holds (behind a window, from its own
  cache) and the store lacks means nothing of that prompt is published.

vLLM's hybrid KV cache manager (``SupportsHMA``): each attention group (full,
sliding window) has its own block ids; a kvmesh page is one block index over all
groups, the layers in the model's order, so the card does not depend on how vLLM
grouped them. A load fills only the blocks vLLM keeps (null ids behind a window).

KV events (vLLM's ``kv_events_config`` with ``enable_kv_cache_events``): rank 0's
worker hears its store (full blocks stored in or removed from RAM or disk, with
their tokens) and sends the changes in its worker metadata; the scheduler keeps
them in a bounded buffer (past ``MAX_EVENTS`` it drops the newest and counts
them) and ``take_events()`` hands them to vLLM's publisher as vLLM's own
``BlockStored`` / ``BlockRemoved`` (medium ``CPU`` for the RAM tier, ``STORAGE``
for the disk tier), in the same stream as vLLM's GPU blocks. The connector never
sends ``AllBlocksCleared``: that would wipe vLLM's own blocks from a router's view.
The hashes are kvmesh's keys (opaque); with a ``cache_salt`` they are that salt's
chain's, never the salt itself.

A request with vLLM's ``cache_salt`` is keyed from a chain root of the namespace
and the salt, so it is looked up and saved only among requests with the same
salt. Requests that kvmesh's keys cannot describe (LoRA adapters, multimodal
inputs, prompt embeddings, an invalid salt) are neither looked up nor saved.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ..blocks import BlockKeyer, PrefixKeys, chain_root, check_cache_salt
from ..codec import Block
from ..errors import CacheMiss, ConfigError, KVMeshError
from ..mesh.hits import PeerHit
from . import service as services
from .config import parse_settings
from .pages import DTYPES, FP8, CacheSpec, Pages, check_position, model_card, page_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvmesh.vllm")
IDLE_YIELD_S = 0.002
MAX_ACQUISITIONS = 256  # requests a worker may be acquiring pages for at once
ANSWER_GRACE_S = 5.0  # beyond the lookup deadline, before the scheduler stops waiting
MAX_EVENTS = 10_000  # KV events the scheduler holds for vLLM's publisher, then drops
# page copies a worker holds for prompts whose prefill is not complete; a prompt
# that would go past it is not published (counted ``save_dropped``)
MAX_PENDING_BYTES = 1 << 30


# -- metadata: scheduler -> workers (every step) ---------------------------------


@dataclass
class Ask:
    req_id: str
    tokens: list[int]  # the prompt's full pages that vLLM does not compute itself
    salt: str | None = None  # vLLM's cache_salt: its own key chain (see keyer_for)


#: A request's vLLM block ids, one list per KV cache group: page i of group g in
#: ``ids[g][i]``, 0 (vLLM's null block) where the group holds none (a sliding
#: window's pages behind it).
GroupIds = list[list[int]]


@dataclass
class LoadSpec:
    req_id: str
    block_ids: GroupIds  # the request's vLLM blocks
    first_page: int  # pages before this are vLLM's own prefix cache
    pages: int  # load pages [first_page, pages)


@dataclass
class SaveSpec:
    """Pages [first, first + len(block_ids[0])) of a prompt, computed by this step's
    end: copied now (a sliding window frees its pages at the next step), stored and
    published with the rest of the chain once ``final`` (the prefill is complete)."""

    req_id: str
    tokens: list[int]  # the prompt's full pages up to this step's last
    block_ids: GroupIds  # per group, the ids of pages [first, ...)
    first: int = 0
    final: bool = True
    salt: str | None = None


@dataclass
class KVMeshMetadata(KVConnectorMetadata):
    asks: list[Ask] = field(default_factory=list)  # find these prompts' pages
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # finished: forget their pages
    step_tokens: int = 0


# -- metadata: workers -> scheduler (every step, merged over the ranks) ---------------


@dataclass
class KVMeshWorkerMeta(KVConnectorWorkerMetadata):
    answers: dict[str, dict[int, int]] = field(default_factory=dict)  # req -> rank -> pages
    reports: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # load results
    cards: dict[int, list[str]] = field(default_factory=dict)  # rank -> [engine, namespace]
    # KV events (rank 0 only: the other ranks hold the same prefixes): msgpack lists
    # of vLLM events, and the store changes dropped before they could be sent
    events: list[bytes] = field(default_factory=list)
    events_dropped: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVMeshWorkerMeta:
        assert isinstance(other, KVMeshWorkerMeta)
        for mine, theirs in ((self.answers, other.answers), (self.reports, other.reports)):
            for req_id, by_rank in theirs.items():
                mine.setdefault(req_id, {}).update(by_rank)  # type: ignore[arg-type]
        self.cards.update(other.cards)
        self.events.extend(other.events)
        self.events_dropped += other.events_dropped
        return self


class EventBuffer:
    """The scheduler's KV events from the workers, for vLLM's publisher: at most
    ``max_events`` held (past that the newest are dropped and counted), decoded
    as vLLM's own classes, never an ``AllBlocksCleared`` (it would wipe vLLM's own
    blocks from a router's view)."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        from vllm.distributed import kv_events as kv

        self.max_events = max_events
        self.dropped = 0  # by a worker's sink, or here
        self.undecodable = 0  # payloads no event could be read from
        self._events: deque[Any] = deque()
        self._decoder = msgspec.msgpack.Decoder(
            list[kv.BlockStored | kv.BlockRemoved | kv.AllBlocksCleared]
        )

    def keep(self, payloads: list[bytes], dropped: int = 0) -> None:
        """Each payload: a msgpack list of events (``MeshService.take_events``)."""
        for payload in payloads:
            try:
                events = self._decoder.decode(payload)
            except msgspec.DecodeError as e:  # a worker of another version: counted, said once
                if not self.undecodable:
                    log.warning("kvmesh: undecodable KV events from a worker dropped: %s", e)
                self.undecodable += 1
                continue
            for ev in events:
                if type(ev).__name__ == "AllBlocksCleared":
                    continue
                if len(self._events) >= self.max_events:
                    dropped += 1
                else:
                    self._events.append(ev)
        if dropped:
            if self.dropped == 0:  # once: a publisher that does not drain is a deployment issue
                log.warning("kvmesh: KV events dropped: vLLM does not drain take_events()")
            self.dropped += dropped

    def take(self) -> list[Any]:
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)


# -- a worker's pages for one request -----------------------------------------------


@dataclass
class Acquisition:
    """Where one prompt's pages come from on this rank: the local store's chain,
    then verified pages fetched from a peer (by page index)."""

    keys: PrefixKeys
    local: tuple[Block, ...] = ()
    pages: int = 0  # pages promised to the scheduler
    fetched: dict[int, Block] = field(default_factory=dict)
    source: str = "none"  # local | remote | none
    peer: str = ""
    fallback: str | None = None
    done: concurrent.futures.Future[None] | None = None
    index: dict[bytes, int] = field(default_factory=dict)  # page key -> page index

    def __post_init__(self) -> None:
        self.index = {k: i for i, k in enumerate(self.keys.blocks)}

    def block(self, i: int) -> Block | None:
        return self.local[i] if i < len(self.local) else self.fetched.get(i)

    def add(self, blk: Block) -> None:
        """The fetch's sink: a verified block, placed by its key."""
        i = self.index.get(blk.key)
        if i is not None:
            self.fetched[i] = blk


@dataclass
class _Asked:
    """The scheduler's view of one request it asked the workers about."""

    t0: float
    answers: dict[int, int] = field(default_factory=dict)  # rank -> pages
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    loading: bool = False  # a load was scheduled: never a second one


@dataclass
class _Tracked:
    tokens: list[int]
    block_ids: GroupIds
    salt: str | None = None
    saved: int = 0  # pages handed to the workers to save
    final: bool = False  # the prefill is complete: nothing more to save


@dataclass
class _Pending:
    """A worker's copies of one prompt's pages, until its prefill is complete."""

    have: tuple[Block, ...]  # the chain's start, already in the local store
    copies: list[tuple[bytearray, object]] = field(default_factory=list)
    broken: bool = False  # a page could not be had: nothing of it is published

    @property
    def nbytes(self) -> int:
        return sum(len(blob) for blob, _ in self.copies)

    @property
    def next_page(self) -> int:
        return len(self.have) + len(self.copies)


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    """Both roles; each uses only its half. The scheduler (vLLM's engine core)
    decides from the workers' answers; each worker (one per tensor-parallel rank)
    finds, fetches, loads and saves its own shard of every page. With vLLM's hybrid
    KV cache manager (``SupportsHMA``) every attention group is paged with its own
    block ids; a page is a block over all of them."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = parse_settings(extra)
        self.cache_spec = _cache_spec(kv_cache_config, str(vllm_config.cache_config.cache_dtype))
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("KVMeshConnector does not serve pipeline parallel deployments")
        self.tp = int(parallel.tensor_parallel_size)
        self.block_size = self.cache_spec.block_size
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM's default fails a request whose load failed; kvmesh never lets the
            # cache decide an answer (the scheduler reads this after building us)
            log.info("kvmesh: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._lock = threading.Lock()
        # scheduler side
        self._eligible: dict[str, bool] = {}
        self._salts: dict[str, str | None] = {}
        self._asked: dict[str, _Asked] = {}
        self._asks: list[Ask] = []
        self._drops: list[str] = []
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._first_local: dict[str, int] = {}
        self._cards: dict[int, list[str]] = {}  # what each rank serves, as it told us
        self._answer_s = float(self.settings["lookup_timeout"]) + ANSWER_GRACE_S
        events_cfg = vllm_config.kv_events_config
        self._events_on = bool(events_cfg is not None and events_cfg.enable_kv_cache_events)
        self.events = EventBuffer()  # the workers' KV events, for take_events()
        # worker side
        self.svc: services.MeshService | None = None
        self.rank = 0
        self.pages: Pages | None = None
        self._acqs: dict[str, Acquisition] = {}
        self._answers: dict[str, int] = {}  # to report: req -> pages promised
        self._reports: dict[str, dict[str, Any]] = {}  # to report: req -> load result
        self._done: dict[str, list[int]] = {}  # finished loads -> block ids that failed
        self._pending: dict[str, _Pending] = {}  # prompts being saved, page by page
        self._pending_bytes = 0  # their copies' bytes, at most MAX_PENDING_BYTES
        self._failed_loads: set[str] = set()  # loads that failed, by request
        self._errors: set[int] = set()
        self._t_bind = 0.0
        self._inflight = 0  # acquisitions and loads not finished

    # ==========================================================================
    # worker side
    # ==========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
        )

        group_of = {
            n: g
            for g, grp in enumerate(self._kv_cache_config.kv_cache_groups)
            for n in grp.layer_names
        }
        names = _model_order(list(group_of))  # one card whichever groups vLLM formed
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no cache for layers {missing[:3]}")
        tensors = [kv_caches[n] for n in names]
        self.cache_spec = dataclasses.replace(
            self.cache_spec, windows=_layer_windows(self._vllm_config, names)
        )
        probe = model_card(
            *_model_dirs(self._vllm_config),
            self.cache_spec,
            engine="probe",
            quantization=str(self._vllm_config.model_config.quantization or "none"),
        )
        kind = page_layout(tensors, probe)  # checks every tensor against the card
        self.rank = int(get_tensor_model_parallel_rank()) if self.tp > 1 else 0
        engine = _engine_name(self._vllm_config, names[0], kind, self.rank, self.tp)
        if self.cache_spec.kv_dtype in FP8.values():
            engine += f"/kv_scales={_kv_scales(self._vllm_config, names)}"
        card = dataclasses.replace(probe, engine=engine)
        self.pages = Pages(card, tensors, [group_of[n] for n in names])
        cfg = self.settings.node_config(self.rank, self.tp)
        self.svc = services.MeshService(
            self.settings, card, cfg, events=self._events_on and self.rank == 0
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._t_bind = time.perf_counter()
        assert isinstance(connector_metadata, KVMeshMetadata)
        svc = self._require_svc()
        with self._lock:
            for req_id in connector_metadata.drops:
                acq = self._acqs.pop(req_id, None)
                if acq is not None and acq.done is not None:
                    acq.done.cancel()
                pending = self._pending.pop(req_id, None)
                if pending is not None:  # ended before its prefill completed
                    self._forget(pending)
            for ask in connector_metadata.asks:  # started before the forward: it overlaps
                if ask.req_id in self._acqs:
                    continue
                if len(self._acqs) >= MAX_ACQUISITIONS:
                    svc.count("acquire_dropped")
                    self._answers[ask.req_id] = 0
                    continue
                keys = _keyer_for(svc.keyer, ask.salt).keys(ask.tokens)
                acq = self._acqs[ask.req_id] = Acquisition(keys)
                self._inflight += 1
                acq.done = svc.acquires.submit(self._acquire, ask.req_id, acq)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshMetadata)
        for spec in meta.loads:
            with self._lock:
                self._inflight += 1
            self._require_svc().loads.submit(self._load, spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a loading request is not in the batch

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole pages are copied once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshMetadata)
        svc = self._require_svc()
        if meta.step_tokens:
            svc.planner.observe_prefill(meta.step_tokens, time.perf_counter() - self._t_bind)
        elif self._inflight:
            # an idle step while pages are found or arrive: vLLM steps again at once;
            # give the acquisition threads the interpreter instead of spinning
            time.sleep(IDLE_YIELD_S)
        for spec in meta.saves:
            try:
                self._save(spec)
            except Exception as e:  # a save never fails a request
                log.warning("save of %s failed: %r", spec.req_id, e)
                svc.count("save_failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads. A failed page is reported as its block ids (vLLM recomputes
        from the first) on a cache of one full-attention group; with several groups
        or a window vLLM cannot map block ids back (or would compute over pages the
        window already dropped), so the whole request is failed and recomputed."""
        with self._lock:
            done, self._done = self._done, {}
            failed = {r for r, bad in done.items() if bad}
            if self._request_level_failures():
                return KVConnectorTransferResults(finished_recving=set(done), failed_recving=failed)
            for bad in done.values():
                self._errors.update(bad)
        return KVConnectorTransferResults(finished_recving=set(done))

    def _request_level_failures(self) -> bool:
        assert self.pages is not None
        return len(set(self.pages.groups)) > 1 or any(self.cache_spec.layer_windows())

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._lock:
            answers, self._answers = self._answers, {}
            reports, self._reports = self._reports, {}
        svc = self._require_svc()
        events, dropped = svc.take_events()
        if not answers and not reports and not events and not dropped:
            return None
        return KVMeshWorkerMeta(
            {r: {self.rank: n} for r, n in answers.items()},
            {r: {self.rank: rep} for r, rep in reports.items()},
            {self.rank: [svc.card.engine, svc.card.namespace_hex]},
            [events] if events else [],
            dropped,
        )

    def shutdown(self) -> None:
        if self.svc is not None:
            svc, self.svc = self.svc, None
            svc.close()

    def _require_svc(self) -> services.MeshService:
        if self.svc is None:
            raise RuntimeError("kvmesh: no cache registered yet")
        return self.svc

    # -- acquisitions (a worker thread per request) ------------------------------

    def _acquire(self, req_id: str, acq: Acquisition) -> None:
        """Local store, then the fleet through the shared acquisition core; the
        promise (pages) goes to the scheduler as soon as it is known."""
        svc = self._require_svc()
        try:
            self._find(svc, req_id, acq)
        except Exception as e:  # the cache never decides correctness
            log.info("acquisition for %s failed: %r", req_id, e)
            svc.count("lookup_errors:error")
        finally:
            with self._lock:
                if req_id not in self._answers and acq.pages == 0:
                    self._answers[req_id] = 0
                self._inflight -= 1

    def _answer(self, req_id: str, acq: Acquisition, pages: int) -> None:
        with self._lock:
            acq.pages = pages
            self._answers[req_id] = pages

    def _find(self, svc: services.MeshService, req_id: str, acq: Acquisition) -> None:
        want = len(acq.keys.blocks)
        local = svc.acquirer.local(acq.keys)
        acq.local = local.blocks[:want]
        have = len(acq.local)
        if have:
            acq.source = "local"
        if have >= want:
            self._answer(req_id, acq, have)
            return
        found = svc.acquirer.candidates(svc.card, acq.keys, have * self.block_size)
        svc.count("lookup_us", round(found.lookup_s * 1e6))
        hits = [_capped(h, want, self.block_size) for h in found.hits]
        hits = [h for h in hits if h.tokens > have * self.block_size]
        if not hits:
            svc.count(
                "lookup_misses" if found.fallback is None else f"lookup_errors:{found.fallback}"
            )
            self._answer(req_id, acq, have)
            return

        def started(hit: PeerHit) -> None:
            if acq.source != "remote":  # the first candidate: the promise
                acq.source, acq.peer = "remote", hit.alias
                svc.count("remote_hits")
                self._answer(req_id, acq, len(hit.blocks))

        budget = svc.acquirer.budget(want * self.block_size) - found.lookup_s
        done = svc.acquirer.fetch(
            svc.layout, hits, local, have, have * self.block_size, budget, lambda h: acq, started
        )
        acq.fallback = done.fallback
        if acq.source != "remote":
            svc.count(
                "planned_compute" if done.fallback is None else f"fetch_failed:{done.fallback}"
            )
            self._answer(req_id, acq, have)

    # -- loads -----------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> None:
        """Fill the request's pages from its acquisition; report the pages that failed."""
        svc = self._require_svc()
        failed = _ids_of(spec.block_ids, spec.first_page, spec.pages)
        report: dict[str, Any] = {"loaded": 0}
        t0 = time.perf_counter()
        try:
            with self._lock:
                acq = self._acqs.get(spec.req_id)
            if acq is None:
                raise CacheMiss("no pages found for this request")
            report.update(source=acq.source, peer=acq.peer)
            if acq.done is not None:
                # a failed fetch recorded its reason; its verified prefix is still used
                with contextlib.suppress(Exception):
                    acq.done.result(timeout=svc.fleet.fetch_deadline + 5)
            t1 = time.perf_counter()
            svc.count("load_wait_ms", round((t1 - t0) * 1000))
            blocks = self._contiguous(svc, acq, spec)
            page = iter(range(spec.first_page, spec.pages))
            assert self.pages is not None
            pages = self.pages
            loaded = 0

            def copy(blk: Block) -> None:
                nonlocal loaded
                i = next(page)
                pages.copy_in(blk, _page_ids(spec.block_ids, i))
                loaded += 1
                done = set(_ids_of(spec.block_ids, i, i + 1))
                failed[:] = [b for b in failed if b not in done]

            try:
                svc.acquirer.imported(blocks, copy)
            finally:
                report["loaded"] = loaded
                svc.count("pages_loaded", report["loaded"])
                svc.count("copy_in_ms", round((time.perf_counter() - t1) * 1000))
            if failed:
                report["fallback"] = acq.fallback or "missing"
                svc.count(f"load_fallback:{report['fallback']}")
        except Exception as e:  # the cache never decides correctness
            log.info("load for %s failed: %r", spec.req_id, e)
            report["fallback"] = e.reason if isinstance(e, KVMeshError) else "error"
            svc.count(f"load_failed:{report['fallback']}")
        with self._lock:
            self._done[spec.req_id] = failed
            self._reports[spec.req_id] = report
            self._inflight -= 1

    def _contiguous(
        self, svc: services.MeshService, acq: Acquisition, spec: LoadSpec
    ) -> list[Block]:
        """The verified pages [first_page, pages) up to the first missing one, each
        checked to sit where its key says."""
        out = []
        for i in range(spec.first_page, spec.pages):
            blk = acq.block(i)
            if blk is None:
                break
            check_position(blk, svc.keyer, acq.keys, i)
            out.append(blk)
        return out

    # -- saves -----------------------------------------------------------------

    def _save(self, spec: SaveSpec) -> None:
        """Copy this step's new pages of a prompt (the one copy on the model's path);
        once its prefill is complete, seal, store and publish the chain off the path."""
        svc = self._require_svc()
        assert self.pages is not None
        pages = self.pages
        keys = _keyer_for(svc.keyer, spec.salt).keys(spec.tokens)
        p = self._pending.get(spec.req_id)
        if p is None:
            have = svc.fleet.local_prefix(keys).blocks[: len(keys.blocks)]
            if spec.final and len(have) >= len(keys.blocks):
                return  # every page already held
            p = self._pending[spec.req_id] = _Pending(tuple(have))
        try:
            if not p.broken:
                self._copy_pages(svc, pages, keys, spec, p)
        except Exception:
            self._abandon(svc, p, None)  # counted by wait_for_save
            raise
        finally:
            if spec.final:
                del self._pending[spec.req_id]
                self._forget(p)
        # a slot only now (never held across steps); none free is counted publish_dropped
        if spec.final and not p.broken and p.copies and svc.publisher.reserve():
            self._publish(svc, pages, p)

    def _copy_pages(
        self, svc: services.MeshService, pages: Pages, keys: PrefixKeys, spec: SaveSpec, p: _Pending
    ) -> None:
        end = spec.first + min((len(g) for g in spec.block_ids), default=0)
        if p.next_page < spec.first:  # pages neither held nor copied: no chain
            self._abandon(svc, p, "save_gap")
            return
        t0 = time.perf_counter()
        for i in range(p.next_page, min(end, len(keys.blocks))):
            ids = _page_ids(spec.block_ids, i, spec.first)
            if None in ids:  # behind a window, from vLLM's own cache: gone
                self._abandon(svc, p, "save_gap")
                return
            if self._pending_bytes + pages.page_bytes > MAX_PENDING_BYTES:
                self._abandon(svc, p, "save_dropped")
                return
            p.copies.append(pages.copy_out(svc.keyer, keys, i, ids))
            self._pending_bytes += len(p.copies[-1][0])
        svc.count("copy_out_us", round((time.perf_counter() - t0) * 1e6))

    def _abandon(self, svc: services.MeshService, p: _Pending, reason: str | None) -> None:
        """A page of the chain cannot be had: nothing of this prompt is published."""
        p.broken = True
        self._forget(p)
        if reason:
            svc.count(reason)

    def _forget(self, p: _Pending) -> None:
        """Stop counting ``p``'s copies against the pending budget (a broken prompt's
        are dropped now; a complete one's go on to be sealed)."""
        self._pending_bytes -= p.nbytes
        if p.broken:
            p.copies.clear()

    def _publish(self, svc: services.MeshService, pages: Pages, p: _Pending) -> None:
        """Seal, store and publish ``p``'s chain in a slot reserved for it."""

        def chains() -> list[list[Block]]:
            t1 = time.perf_counter()
            sealed = [pages.seal(blob, header) for blob, header in p.copies]
            svc.count("seal_us", round((time.perf_counter() - t1) * 1e6))
            return [list(p.have) + sealed]  # kept here, then sent to the peers

        svc.publisher.submit(chains, "pages_published")

    # ==========================================================================
    # scheduler side
    # ==========================================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        tokens = request.prompt_token_ids
        eligible = _eligible(request)
        with self._lock:
            self._eligible[req_id] = eligible
            salt = self._salts[req_id] = _salt(request) if eligible else None
        if not eligible or tokens is None:
            return 0, False
        pages = (len(tokens) - 1) // self.block_size  # vLLM computes at least the last token
        if pages * self.block_size <= num_computed_tokens:
            return 0, False
        with self._lock:
            asked = self._asked.get(req_id)
            if asked is None:  # the workers find its pages; ask again next step
                self._asked[req_id] = _Asked(time.monotonic())
                self._asks.append(Ask(req_id, list(tokens[: pages * self.block_size]), salt))
                return None, False
            if asked.loading:
                return 0, False
            if len(asked.answers) < self.tp:
                if time.monotonic() - asked.t0 < self._answer_s:
                    return None, False
                asked.loading = True  # no answer in time: computed, never waited for
                return 0, False
            have = min(asked.answers.values()) * self.block_size  # every rank's pages
            self._first_local[req_id] = num_computed_tokens
        if have <= num_computed_tokens:
            return 0, False
        return have - num_computed_tokens, True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVMeshWorkerMeta):
            return
        if meta.events or meta.events_dropped:
            self.events.keep(meta.events, meta.events_dropped)
        with self._lock:
            self._cards.update(meta.cards)
            for req_id, by_rank in meta.answers.items():
                asked = self._asked.get(req_id)
                if asked is not None:
                    asked.answers.update(by_rank)
            for req_id, reports in meta.reports.items():
                asked = self._asked.get(req_id)
                if asked is not None:
                    asked.reports.update(reports)

    def take_events(self) -> Iterable[Any]:
        """kvmesh's tier changes since the last call, as vLLM's event classes (vLLM's
        scheduler publishes them with its own, each step)."""
        return self.events.take()

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        with self._lock:
            first = self._first_local.get(req_id, 0)
            end = first + num_external_tokens
            if first % self.block_size or end % self.block_size:
                raise RuntimeError(f"kvmesh: unaligned load [{first}, {end})")
            asked = self._asked.get(req_id)
            if asked is not None:
                asked.loading = True
            self._loads.append(
                LoadSpec(
                    req_id,
                    _group_ids(blocks.get_block_ids()),
                    first // self.block_size,
                    end // self.block_size,
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVMeshMetadata(step_tokens=int(scheduler_output.total_num_scheduled_tokens))
        with self._lock:
            meta.loads, self._loads = self._loads, []
            meta.asks, self._asks = self._asks, []
            meta.drops, self._drops = self._drops, []
            for new in scheduler_output.scheduled_new_reqs:
                if self._eligible.get(new.req_id) and new.prompt_token_ids is not None:
                    self._tracked[new.req_id] = _Tracked(
                        list(new.prompt_token_ids),
                        _group_ids(new.block_ids),
                        self._salts.get(new.req_id),
                    )
                    self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                tracked = self._tracked.get(req_id)
                if tracked is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids and new_ids is not None:
                    tracked.block_ids = _group_ids(new_ids)
                elif new_ids is not None:
                    for group, ids in zip(tracked.block_ids, new_ids, strict=True):
                        group.extend(ids)
                self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(
        self, meta: KVMeshMetadata, req_id: str, computed: int, out: SchedulerOutput
    ) -> None:
        """Hand the workers the prompt's pages this step completes (a sliding window
        frees its pages at the next step, so they are copied in this one); the step
        that completes the prefill says so (``final``)."""
        t = self._tracked[req_id]
        if t.final:
            return
        end = min(computed + out.num_scheduled_tokens.get(req_id, 0), len(t.tokens))
        held = min(len(ids) for ids in t.block_ids)
        pages = min(end // self.block_size, held)
        t.final = end >= len(t.tokens)
        if pages > t.saved or (t.final and t.saved):
            ids = [g[t.saved : pages] for g in t.block_ids]
            meta.saves.append(
                SaveSpec(
                    req_id,
                    t.tokens[: pages * self.block_size],
                    ids,
                    t.saved,
                    t.final,
                    t.salt,
                )
            )
            t.saved = max(t.saved, pages)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (its workers drop its pages next step); what kvmesh did
        for it goes back to the client as ``kv_transfer_params["kvmesh"]``."""
        req_id = request.request_id
        with self._lock:
            self._eligible.pop(req_id, None)
            self._salts.pop(req_id, None)
            tracked = self._tracked.pop(req_id, None)
            self._first_local.pop(req_id, None)
            asked = self._asked.pop(req_id, None)
            if asked is not None or (tracked is not None and tracked.saved and not tracked.final):
                self._drops.append(req_id)  # its workers forget its acquisition and copies
            if asked is None:
                return False, None
            cards = {str(rank): card for rank, card in sorted(self._cards.items())}
        return False, {"kvmesh": {**_summary(asked, self.tp), "cards": cards}}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager's ``request_finished``: pages were saved as they were
        computed, so nothing is held back."""
        return self.request_finished(request, [])


def _summary(asked: _Asked, tp: int) -> dict[str, Any]:
    """One request's kvmesh outcome over all ranks (the least any rank got)."""
    out: dict[str, Any] = {
        "pages": min(asked.answers.values()) if len(asked.answers) == tp else 0,
        "loaded": min((r.get("loaded", 0) for r in asked.reports.values()), default=0),
    }
    if len(asked.reports) < tp:
        out["loaded"] = 0
    for r in asked.reports.values():
        for k in ("source", "peer", "fallback"):
            if r.get(k) and k not in out:
                out[k] = r[k]
    return out


def _capped(hit: PeerHit, pages: int, block_size: int) -> PeerHit:
    """A hit cut to the pages asked for (never the tail: vLLM computes the last token)."""
    n = min(len(hit.blocks), pages)
    return dataclasses.replace(hit, blocks=hit.blocks[:n], tail=None, tokens=n * block_size)


# -- helpers ---------------------------------------------------------------------


def _group_ids(ids: Iterable[Iterable[int]]) -> GroupIds:
    """vLLM's block ids (a tuple with one list per KV cache group) as kvmesh keeps them."""
    return [list(g) for g in ids]


def _page_ids(ids: GroupIds, page: int, first: int = 0) -> list[int | None]:
    """Page ``page``'s block id in each group (lists starting at page ``first``), None
    where vLLM holds none (its null block, 0)."""
    return [g[page - first] or None for g in ids]


def _ids_of(ids: GroupIds, start: int, stop: int) -> list[int]:
    """The real (non-null) block ids of pages [start, stop) over every group."""
    return [b for g in ids for b in g[start:stop] if b]


def _model_order(names: list[str]) -> list[str]:
    """Layer names in the model's order (vLLM lists them group by group)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return sorted(names, key=extract_layer_index)
    except (AssertionError, ValueError):  # names without one layer number: vLLM's order
        return names


def _eligible(request: Request) -> bool:
    """Requests whose KV is a function of the prompt's token ids alone (a cache
    salt, when valid, only changes where their key chain starts)."""
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        try:
            check_cache_salt(salt)
        except ValueError:
            return False
    return (
        getattr(request, "lora_request", None) is None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


def _salt(request: Request) -> str | None:
    return getattr(request, "cache_salt", None) or None


def _keyer_for(keyer: BlockKeyer, salt: str | None) -> BlockKeyer:
    """The key chain of a request with vLLM's ``cache_salt``: rooted in the namespace
    and the salt (:func:`~kvmesh.blocks.chain_root`), so salted requests are saved
    and found under keys no other salt (or none) shares."""
    if salt is None:
        return keyer
    return keyer.rooted(chain_root(keyer.namespace, None, salt))


def _cache_spec(kv_cache_config: KVCacheConfig, cache_dtype: str = "auto") -> CacheSpec:
    """Attention KV of one page shape in one or more groups, or a clear error. With
    vLLM's hybrid manager sliding-window layers are a group of their own (pages
    behind the window are freed: a page is saved in the step that computes it);
    without it they are full-attention pages that keep every position. Mamba /
    Gated DeltaNet state, MLA, chunked-local attention and quantized KV other than
    per-tensor FP8 are not served."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("vLLM gave KVMeshConnector no KV cache group")
    specs = [g.kv_cache_spec for g in groups]
    for spec in specs:
        plain = (
            type(spec) in (FullAttentionSpec, SlidingWindowSpec)
            and getattr(spec, "attention_chunk_size", None) is None
            and getattr(spec, "head_size_v", spec.head_size) in (None, spec.head_size)
            and getattr(spec, "page_size_padded", None) is None
        )
        if not plain:
            raise ConfigError(
                f"KVMeshConnector does not serve {type(spec).__name__} caches"
                f"{' (hybrid recurrent state: not yet)' if 'Mamba' in type(spec).__name__ else ''}"
                f": {spec}"
            )
    shapes = {
        (s.block_size, s.num_kv_heads, s.head_size, s.dtype, int(getattr(s, "kv_quant_mode", 0)))
        for s in specs
    }
    if len(shapes) != 1:
        raise ConfigError(
            f"KVMeshConnector serves KV cache groups of one page shape; these differ: {sorted(map(str, shapes))}"
        )
    spec = specs[0]
    return CacheSpec(
        num_layers=sum(len(g.layer_names) for g in groups),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        block_size=int(spec.block_size),
        kv_dtype=_kv_dtype(spec, cache_dtype),
    )


def _kv_dtype(spec: Any, cache_dtype: str) -> str:
    """The card's KV dtype: the model's, or vLLM's FP8 with one scale per layer for
    K and for V (``FP8_PER_TENSOR``: the page holds FP8 values and nothing else)."""
    mode = getattr(spec, "kv_quant_mode", 0)
    if int(mode) == 0 and spec.dtype in DTYPES:
        return DTYPES[spec.dtype]
    if getattr(mode, "name", "") == "FP8_PER_TENSOR" and cache_dtype in FP8:
        return FP8[cache_dtype]
    raise ConfigError(
        f"KVMeshConnector does not serve a {spec.dtype} KV cache "
        f"(kv_cache_dtype {cache_dtype!r}, {getattr(mode, 'name', mode)})"
    )


def _kv_scales(vllm_config: VllmConfig, names: list[str]) -> str:
    """A digest of every layer's K and V scale, for an FP8 card's engine string: the
    same bytes under other scales are other numbers."""
    ctx = vllm_config.compilation_config.static_forward_context
    scales = [
        (
            float(getattr(ctx.get(n), "_k_scale_float", 1.0)),
            float(getattr(ctx.get(n), "_v_scale_float", 1.0)),
        )
        for n in names
    ]
    return hashlib.sha256(repr(scales).encode()).hexdigest()[:12]


def _layer_windows(vllm_config: VllmConfig, names: list[str]) -> tuple[int, ...]:
    """Each attention layer's sliding window as vLLM built the layer (0: none)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return tuple(int(getattr(ctx.get(n), "sliding_window", None) or 0) for n in names)


def _model_dirs(vllm_config: VllmConfig) -> tuple[Path, Path]:
    mc = vllm_config.model_config
    return _local_dir(mc.model, mc.revision), _local_dir(mc.tokenizer or mc.model, None)


def _local_dir(name: str, revision: str | None) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    try:  # a hub id vLLM has already downloaded
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:
        raise ConfigError(
            f"kvmesh needs the model's files on disk to derive its card; {name!r} is not a "
            "local directory or a downloaded hub snapshot"
        ) from None


def _engine_name(vllm_config: VllmConfig, layer: str, kind: str, rank: int, world: int) -> str:
    """vLLM version, platform, attention backend, page layout, model dtype, compilation,
    and which tensor-parallel shard of the KV heads (rank of world size) the pages hold."""
    import vllm
    from vllm.platforms import current_platform

    ctx = vllm_config.compilation_config.static_forward_context.get(layer)
    backend = getattr(getattr(ctx, "attn_backend", None), "get_name", lambda: "unknown")()
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    mode = vllm_config.compilation_config.mode
    return (
        f"vllm/{vllm.__version__}/{current_platform.device_type}/{backend}/{kind}/{dtype}/"
        f"compile={getattr(mode, 'name', mode)}/tp={rank}of{world}"
    )
