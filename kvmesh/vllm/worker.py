"""The connector's worker role (one per tensor-parallel rank, in vLLM's worker
process): its own mesh node, store and shard of the KV heads (the rank and world
size are in the card, so shards of different layouts never mix).

- an *ask* starts an acquisition on a worker thread through the shared core
  (:mod:`kvmesh.runtime.acquire`: local store, fleet candidates, planned verified
  fetch, next candidate on failure); its promise is answered as soon as the
  fetch starts, the fetch goes on while vLLM allocates pages.
- ``start_load``: verified pages are copied into the request's pages on a load
  thread; pages that could not be had are reported so vLLM recomputes them (the
  answer never depends on the cache). With several KV cache groups or a window
  the whole request is failed instead (vLLM cannot map a block back there).
  Where vLLM can take failed pages back by block id, an acquisition that ended
  says how many pages it holds verified in memory (*ready*): the scheduler then
  loads them synchronously, copied here before the step's forward, never waited
  for (failed pages are reported by block id after the step, and recomputed).
- ``wait_for_save``: the prompt pages a step completed and the store lacks are
  copied out in that step (one copy, on the model's path: a sliding window's
  pages are freed at the next step); once the prefill is complete the chain is
  sealed, stored and published off the path through the core's bounded slots. A
  page vLLM no longer holds and the store lacks means nothing of that prompt is
  published.
- a request's page keys are hashed once: at its ask, and by a save step only
  past the keys its records hold (dropped with them when it finishes).
- on a hybrid's card (``STATE_WHERE_SAVED``) a peer's hit, the stored chain and
  the pages loaded are cut where :class:`~kvmesh.vllm.pages.StateCut` says: the
  last page that carries a recurrent state.
- KV events: rank 0 hears its store and sends the changes in its worker metadata.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ..blocks import BlockKeyer, PrefixKeys
from ..codec import Block
from ..errors import CacheMiss, ConfigError, Reason
from ..mesh.hits import PeerHit
from ..runtime.acquire import PageLimits
from ..runtime.planner import failure_reason
from ..runtime.telemetry import Count, Family, Source, labelled
from . import service as services
from .config import ConnectorSettings
from .meta import KVMeshMetadata, KVMeshWorkerMeta, LoadSpec, SaveSpec, ids_of, page_ids
from .pages import (
    FP8,
    CacheSpec,
    Pages,
    check_position,
    model_card,
    page_keys,
    page_layout,
)
from .spec import (
    engine_name,
    kv_scales,
    layer_kv,
    layer_states,
    layer_windows,
    model_dirs,
    model_order,
    shared_layers,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvmesh.vllm")


class WorkerCount(StrEnum):
    """A connector worker's own counters (beside :mod:`kvmesh.runtime.telemetry`'s)."""

    LOOKUP_US = "lookup_us"
    LOOKUP_MISSES = "lookup_misses"  # no peer held more than this rank
    REMOTE_HITS = "remote_hits"
    ACQUIRE_DROPPED = "acquire_dropped"  # past MAX_ACQUISITIONS: computed
    LOAD_WAIT_MS = "load_wait_ms"
    LOADS_SYNC = "loads_sync"  # copied in before the step's forward that computes the rest
    LOADS_ASYNC = "loads_async"  # on a load thread, the request scheduled after
    PAGES_LOADED = "pages_loaded"
    COPY_IN_MS = "copy_in_ms"
    COPY_OUT_US = "copy_out_us"
    SEAL_US = "seal_us"
    PAGES_PUBLISHED = "pages_published"
    SAVE_FAILED = "save_failed"
    SAVE_GAP = "save_gap"  # a page neither held nor stored: the prompt is not published
    SAVE_DROPPED = "save_dropped"  # past MAX_PENDING_BYTES: the prompt is not published


IDLE_YIELD_S = 0.002
MAX_ACQUISITIONS = 256  # requests a worker may be acquiring pages for at once
# page copies a worker holds for prompts whose prefill is not complete; a prompt
# that would go past it is not published (counted ``save_dropped``)
MAX_PENDING_BYTES = 1 << 30


@dataclass
class Acquisition:
    """Where one prompt's pages come from on this rank: the local store's chain,
    then verified pages fetched from a peer (by page index)."""

    keys: PrefixKeys
    local: tuple[Block, ...] = ()
    pages: int = 0  # pages promised to the scheduler
    answered: bool = False  # the promise went out (a stream's start, or the end)
    fetched: dict[int, Block] = field(default_factory=dict)
    source: str = Source.COMPUTE  # a Source
    peer: str = ""
    fallback: str | None = None
    done: concurrent.futures.Future[None] | None = None
    index: dict[bytes, int] = field(default_factory=dict)  # page key -> page index

    def __post_init__(self) -> None:
        self.index = {k: i for i, k in enumerate(self.keys.blocks)}

    def block(self, i: int) -> Block | None:
        return self.local[i] if i < len(self.local) else self.fetched.get(i)

    def held(self) -> int:
        """Pages held verified in memory, from the first, without a gap."""
        i = 0
        while self.block(i) is not None:
            i += 1
        return i

    def add(self, blk: Block) -> None:
        """The fetch's sink: a verified block, placed by its key."""
        i = self.index.get(blk.key)
        if i is not None:
            self.fetched[i] = blk


@dataclass
class _Pending:
    """A worker's copies of one prompt's pages, until its prefill is complete, and
    the prompt's page keys (each page hashed once: see :func:`~kvmesh.vllm.pages.page_keys`)."""

    have: tuple[Block, ...]  # the chain's start, already in the local store
    keyer: BlockKeyer  # the request's own key chain (its Scope's)
    keys: PrefixKeys  # at least the pages saved so far
    copies: list[tuple[bytearray, object]] = field(default_factory=list)
    broken: bool = False  # a page could not be had: nothing of it is published

    @property
    def nbytes(self) -> int:
        return sum(len(blob) for blob, _ in self.copies)

    @property
    def next_page(self) -> int:
        return len(self.have) + len(self.copies)


class KVMeshWorker:
    """The worker role: finds, fetches, loads and saves this rank's shard of every
    page. The mesh service starts once vLLM registers its cache tensors."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        cache_spec: CacheSpec,
        tp: int,
        events: bool,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.settings = settings
        self.cache_spec = cache_spec
        self.block_size = cache_spec.block_size
        self.tp = tp
        self._events_on = events
        self._lock = threading.Lock()
        self.svc: services.MeshService | None = None
        self.rank = 0
        self.pages: Pages | None = None
        self._acqs: dict[str, Acquisition] = {}
        self._answers: dict[str, int] = {}  # to report: req -> pages promised
        self._ready: dict[str, int] = {}  # to report: req -> pages held, acquisition ended
        self._reports: dict[str, dict[str, Any]] = {}  # to report: req -> load result
        self._done: dict[str, list[int]] = {}  # finished loads -> block ids that failed
        self._pending: dict[str, _Pending] = {}  # prompts being saved, page by page
        self._pending_bytes = 0  # their copies' bytes, at most MAX_PENDING_BYTES
        self._errors: set[int] = set()
        self._t_bind = 0.0
        self._inflight = 0  # acquisitions and loads not finished

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
        )

        group_of = {
            n: g
            for g, grp in enumerate(self._kv_cache_config.kv_cache_groups)
            for n in grp.layer_names
        }
        missing = [n for n in group_of if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no cache for layers {missing[:3]}")
        # layers reading another's KV (Gemma 3n/4) are in no group: in the card as shared
        shared = shared_layers(self._vllm_config, list(kv_caches), group_of)
        group_of.update({n: group_of[target] for n, target in shared.items()})
        names = model_order(list(group_of))  # one card whichever groups vLLM formed
        tensors = [kv_caches[n] for n in names]
        kv = layer_kv(self._kv_cache_config, names)
        windows = layer_windows(self._vllm_config, names)
        self.cache_spec = dataclasses.replace(
            self.cache_spec,
            num_layers=len(names),
            windows=tuple(w if heads else 0 for w, (heads, _) in zip(windows, kv, strict=True)),
            states=layer_states(self._kv_cache_config, names),
            kv=kv,
        )
        probe = model_card(
            *model_dirs(self._vllm_config),
            self.cache_spec,
            engine="probe",
            quantization=str(self._vllm_config.model_config.quantization or "none"),
        )
        kind = page_layout(tensors, probe)  # checks every tensor against the card
        self.rank = int(get_tensor_model_parallel_rank()) if self.tp > 1 else 0
        # the attention backend of the first layer with KV of its own
        owners = [n for n, (heads, _) in zip(names, kv, strict=True) if heads]
        engine = engine_name(self._vllm_config, owners[0], kind, self.rank, self.tp)
        if self.cache_spec.kv_dtype in FP8.values():
            engine += f"/kv_scales={kv_scales(self._vllm_config, owners)}"
        card = dataclasses.replace(probe, engine=engine)
        self.pages = Pages(card, tensors, [group_of[n] for n in names])
        cfg = self.settings.node_config(self.rank, self.tp)
        self.svc = services.MeshService(
            self.settings, card, cfg, events=self._events_on and self.rank == 0
        )

    def bind(self, connector_metadata: KVMeshMetadata) -> None:
        """This step's metadata: drops forgotten, asks started (they overlap the forward)."""
        self._t_bind = time.perf_counter()
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
                    svc.count(WorkerCount.ACQUIRE_DROPPED)
                    self._answers[ask.req_id] = 0
                    continue
                keys = ask.scope.keys(svc.keyer, ask.tokens)
                acq = self._acqs[ask.req_id] = Acquisition(keys)  # saves reuse them
                self._inflight += 1
                acq.done = svc.acquires.submit(self._acquire, ask.req_id, acq)

    def start_load(self, meta: KVMeshMetadata) -> None:
        """Before the forward: synchronous loads copied in now (their pages are in
        memory, the request is in this step's batch), the others on load threads."""
        svc = self._require_svc()
        for spec in meta.loads:
            svc.count(WorkerCount.LOADS_SYNC if spec.sync else WorkerCount.LOADS_ASYNC)
            if spec.sync:
                failed = self._load(spec, wait_s=0.0)
                with self._lock:
                    self._errors.update(failed)
                continue
            with self._lock:
                self._inflight += 1
            svc.loads.submit(self._load_async, spec)

    def wait_for_save(self, meta: KVMeshMetadata) -> None:
        """After the forward: the prefill rate observed, this step's pages saved."""
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
                svc.count(WorkerCount.SAVE_FAILED)

    def get_transfer_results(self) -> KVConnectorTransferResults:
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

    def build_worker_meta(self) -> KVMeshWorkerMeta | None:
        with self._lock:
            answers, self._answers = self._answers, {}
            ready, self._ready = self._ready, {}
            reports, self._reports = self._reports, {}
        svc = self._require_svc()
        events, dropped = svc.take_events()
        if not answers and not ready and not reports and not events and not dropped:
            return None
        return KVMeshWorkerMeta(
            answers={r: {self.rank: n} for r, n in answers.items()},
            ready={r: {self.rank: n} for r, n in ready.items()},
            reports={r: {self.rank: rep} for r, rep in reports.items()},
            cards={self.rank: [svc.card.engine, svc.card.namespace_hex]},
            events=[events] if events else [],
            events_dropped=dropped,
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
            svc.count(labelled(Family.LOOKUP_FAILED, failure_reason(e)))
        finally:
            with self._lock:  # the promise and what is ready go out in the same step
                if not acq.answered:
                    acq.answered = True
                    self._answers[req_id] = acq.pages  # 0 if the acquisition failed
                if self._sync_loads(svc):
                    self._ready[req_id] = acq.held()
                self._inflight -= 1

    def _sync_loads(self, svc: services.MeshService) -> bool:
        """Whether a load may run in the step that schedules it: a failed page must
        be reportable by block id (one full-attention group, no state cut)."""
        return not self._request_level_failures() and not svc.cut.applies

    def _answer(self, req_id: str, acq: Acquisition, pages: int) -> None:
        with self._lock:
            acq.pages, acq.answered = pages, True
            self._answers[req_id] = pages

    def _find(self, svc: services.MeshService, req_id: str, acq: Acquisition) -> None:
        """The shared acquisition (:meth:`Acquirer.acquire`) over whole pages: the
        store's chain, else the first peer worth fetching from, into ``acq``."""
        want = len(acq.keys.blocks)

        def open_sink(hit: PeerHit, held: Sequence[Block], _: object) -> Acquisition:
            acq.local = tuple(held)  # the stored pages the fetch continues (whole: paged)
            return acq

        def started(hit: PeerHit) -> None:
            if acq.source != Source.REMOTE:  # the first stream: the promise
                acq.source, acq.peer = Source.REMOTE, hit.alias
                svc.count(WorkerCount.REMOTE_HITS)
                self._answer(req_id, acq, len(hit.blocks))

        pages = PageLimits(want, svc.cut.hit, svc.cut.blocks)
        got = svc.acquirer.acquire(svc.layout, acq.keys, open_sink, pages=pages, on_start=started)
        svc.count(WorkerCount.LOOKUP_US, round(got.lookup_s * 1e6))
        acq.fallback = got.fallback
        if acq.source == Source.REMOTE:
            return
        acq.local, acq.source = got.local.blocks, got.source  # no stream: what is held
        if got.fallback is not None:
            svc.count(labelled(Family.FALLBACK, got.fallback))
        elif got.tokens < want * self.block_size:
            svc.count(Count.PLANNED_COMPUTE if got.offered else WorkerCount.LOOKUP_MISSES)
        acq.pages = len(acq.local)  # promised as the acquisition ends (_acquire)

    # -- loads -----------------------------------------------------------------

    def _load_async(self, spec: LoadSpec) -> None:
        """A load thread's: the pages that failed go back as a finished transfer."""
        failed = self._load(spec, wait_s=self._require_svc().fleet.fetch_deadline + 5)
        with self._lock:
            self._done[spec.req_id] = failed
            self._inflight -= 1

    def _load(self, spec: LoadSpec, wait_s: float) -> list[int]:
        """Fill the request's pages from its acquisition (its fetch waited for up to
        ``wait_s``); the block ids that failed, its report kept for the scheduler."""
        svc = self._require_svc()
        failed = ids_of(spec.block_ids, spec.first_page, spec.pages)
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
                    acq.done.result(timeout=wait_s)
            t1 = time.perf_counter()
            svc.count(WorkerCount.LOAD_WAIT_MS, round((t1 - t0) * 1000))
            blocks = self._contiguous(svc, acq, spec)
            page = iter(range(spec.first_page, spec.pages))
            assert self.pages is not None
            pages = self.pages
            if svc.cut.applies and not pages.holds_state(page_ids(spec.block_ids, spec.pages - 1)):
                raise CacheMiss("vLLM gave no state page where the load ends")
            loaded = 0

            def copy(blk: Block) -> None:
                nonlocal loaded
                i = next(page)
                pages.copy_in(blk, page_ids(spec.block_ids, i))
                loaded += 1
                done = set(ids_of(spec.block_ids, i, i + 1))
                failed[:] = [b for b in failed if b not in done]

            try:
                svc.acquirer.imported(blocks, copy)
            finally:
                report["loaded"] = loaded
                svc.count(WorkerCount.PAGES_LOADED, report["loaded"])
                svc.count(WorkerCount.COPY_IN_MS, round((time.perf_counter() - t1) * 1000))
            if failed:
                report["fallback"] = acq.fallback or Reason.MISS
                svc.count(labelled(Family.LOAD_FALLBACK, report["fallback"]))
        except Exception as e:  # the cache never decides correctness
            log.info("load for %s failed: %r", spec.req_id, e)
            report["fallback"] = failure_reason(e)
            svc.count(labelled(Family.LOAD_FAILED, report["fallback"]))
        with self._lock:
            self._reports[spec.req_id] = report
        return failed

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
        return out[: svc.cut.blocks(out)]

    # -- saves -----------------------------------------------------------------

    def _save(self, spec: SaveSpec) -> None:
        """Copy this step's new pages of a prompt (the one copy on the model's path);
        once its prefill is complete, seal, store and publish the chain off the path."""
        svc = self._require_svc()
        assert self.pages is not None
        pages = self.pages
        p = self._pending.get(spec.req_id)
        if p is None:
            p = self._start_save(svc, spec)
            if p is None:
                return  # every page already held
        else:
            p.keys = page_keys(p.keyer, spec.tokens, p.keys, spec.scope.media)
        try:
            if not p.broken:
                self._copy_pages(svc, pages, spec, p)
        except Exception:
            self._abandon(svc, p, None)  # counted by wait_for_save
            raise
        finally:
            if spec.final:
                del self._pending[spec.req_id]
                self._forget(p)
        # a slot only now (never held across steps); none free is counted publish_dropped
        if spec.final and not p.broken and p.copies and svc.give_back.reserve():
            self._publish(svc, pages, p, spec.tokens)

    def _start_save(self, svc: services.MeshService, spec: SaveSpec) -> _Pending | None:
        """A prompt's first save step: its record, from the keys its ask hashed (if
        it was asked) and the chain's start the store holds; None if the prefill is
        complete and every page already held."""
        keyer = spec.scope.keyer(svc.keyer)
        with self._lock:
            acq = self._acqs.get(spec.req_id)
        known = acq.keys if acq is not None else None
        keys = page_keys(keyer, spec.tokens, known, spec.scope.media)
        n = len(spec.tokens) // self.block_size
        have = svc.fleet.local_prefix(keys).blocks[:n]
        if spec.final and len(have) >= n:
            return None
        p = self._pending[spec.req_id] = _Pending(tuple(have), keyer, keys)
        return p

    def _copy_pages(
        self, svc: services.MeshService, pages: Pages, spec: SaveSpec, p: _Pending
    ) -> None:
        end = spec.first + min((len(g) for g in spec.block_ids), default=0)
        if p.next_page < spec.first:  # pages neither held nor copied: no chain
            self._abandon(svc, p, WorkerCount.SAVE_GAP)
            return
        t0 = time.perf_counter()
        for i in range(p.next_page, min(end, len(spec.tokens) // self.block_size)):
            ids = page_ids(spec.block_ids, i, spec.first)
            if not pages.holds_kv(ids):  # behind a window, from vLLM's own cache: gone
                self._abandon(svc, p, WorkerCount.SAVE_GAP)
                return
            if self._pending_bytes + pages.page_bytes > MAX_PENDING_BYTES:
                self._abandon(svc, p, WorkerCount.SAVE_DROPPED)
                return
            # a recurrent state only where this step's forward ended: vLLM's checkpoint
            state = i == spec.state_page and pages.holds_state(ids)
            p.copies.append(pages.copy_out(svc.keyer, p.keys, i, ids, state))
            self._pending_bytes += len(p.copies[-1][0])
        svc.count(WorkerCount.COPY_OUT_US, round((time.perf_counter() - t0) * 1e6))

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

    def _publish(
        self, svc: services.MeshService, pages: Pages, p: _Pending, tokens: Sequence[int]
    ) -> None:
        """Seal, store and publish ``p``'s chain (the prompt ``tokens``'s first pages)
        in a slot reserved for it."""
        b, first = self.block_size, len(p.have)
        svc.renew_tokens(p.keys.blocks[first : p.next_page], tokens[first * b : p.next_page * b])

        def chains() -> list[list[Block]]:
            t1 = time.perf_counter()
            sealed = [pages.seal(blob, header) for blob, header in p.copies]
            svc.count(WorkerCount.SEAL_US, round((time.perf_counter() - t1) * 1e6))
            return [list(p.have) + sealed]  # kept here, then sent to the peers

        svc.give_back.submit(chains, WorkerCount.PAGES_PUBLISHED)
