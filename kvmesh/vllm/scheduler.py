"""The connector's scheduler role (vLLM's engine-core process): never waits, holds no
mesh state, decides from what the workers answer.

- ``get_num_new_matched_tokens``: a prompt's full pages (never its last token)
  are *asked* of the workers in the next step's metadata; vLLM is told "ask
  again" (``None``) until every rank has answered how many pages it can load.
  The load offered is the least any rank holds; no answer in time (lookup
  deadline + grace) means computing. Where every rank says those pages are
  already verified in its memory the load is *synchronous*: the request joins
  this step's batch and the workers copy its pages in before the forward (an
  asynchronous load waits for a step to be loaded and another to be scheduled,
  each a whole forward of the others' work).
- ``update_state_after_alloc`` / ``build_connector_meta``: which vLLM pages to
  fill for which request, which pages each step completes (to save), which
  requests ended (to drop).
- ``request_finished``: what kvmesh did goes back to the client as
  ``kv_transfer_params["kvmesh"]`` (pages offered and loaded, source, peer,
  fallback).
- ``take_events``: the workers' KV events (:class:`EventBuffer`) for vLLM's
  publisher, as vLLM's own ``BlockStored`` / ``BlockRemoved``.

Everything the scheduler knows of a request is one :class:`_Request`, created when
vLLM first asks about it and dropped when it finishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from . import spec
from .meta import (
    Ask,
    GroupIds,
    KVMeshMetadata,
    KVMeshWorkerMeta,
    LoadSpec,
    SaveSpec,
    group_ids,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvmesh.vllm")
ANSWER_GRACE_S = 5.0  # beyond the lookup deadline, before the scheduler stops waiting
MAX_EVENTS = 10_000  # KV events the scheduler holds for vLLM's publisher, then drops


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


@dataclass
class _Asked:
    """What the workers answered about one request's pages."""

    t0: float
    answers: dict[int, int] = field(default_factory=dict)  # rank -> pages
    ready: dict[int, int] = field(default_factory=dict)  # rank -> pages verified in memory
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    loading: bool = False  # a load was scheduled: never a second one
    sync: bool = False  # the load offered is synchronous (every rank ready)
    load: str = ""  # how the load scheduled ran: "sync" or "async"


@dataclass
class _Tracked:
    """A scheduled prompt whose pages are handed to the workers as steps complete them."""

    tokens: list[int]
    block_ids: GroupIds
    scope: spec.Scope
    saved: int = 0  # pages handed to the workers to save
    final: bool = False  # the prefill is complete: nothing more to save


@dataclass
class _Request:
    """Everything the scheduler keeps of one request, dropped in one place."""

    scope: spec.Scope | None  # what its keys hash besides tokens; None: they cannot describe it
    asked: _Asked | None = None
    tracked: _Tracked | None = None
    first_local: int = 0  # tokens vLLM's own prefix cache holds


class KVMeshScheduler:
    """The scheduler role. ``tp`` ranks answer every ask; ``block_size`` tokens a page."""

    def __init__(self, block_size: int, tp: int, answer_s: float) -> None:
        self.block_size = block_size
        self.tp = tp
        self._answer_s = answer_s
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._asks: list[Ask] = []
        self._loads: list[LoadSpec] = []
        self._drops: list[str] = []
        self._cards: dict[int, list[str]] = {}  # what each rank serves, as it told us
        self.events = EventBuffer()  # the workers' KV events, for take_events()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        tokens = request.prompt_token_ids
        with self._lock:
            r = self._requests.get(req_id)
            if r is None:
                r = self._requests[req_id] = _Request(spec.scope_of(request))
        if r.scope is None or tokens is None:
            return 0, False
        pages = (len(tokens) - 1) // self.block_size  # vLLM computes at least the last token
        if pages * self.block_size <= num_computed_tokens:
            return 0, False
        with self._lock:
            asked = r.asked
            if asked is None:  # the workers find its pages; ask again next step
                r.asked = _Asked(time.monotonic())
                self._asks.append(Ask(req_id, list(tokens[: pages * self.block_size]), r.scope))
                return None, False
            if asked.loading:
                return 0, False
            if len(asked.answers) < self.tp:
                if time.monotonic() - asked.t0 < self._answer_s:
                    return None, False
                asked.loading = True  # no answer in time: computed, never waited for
                return 0, False
            have = min(asked.answers.values()) * self.block_size  # every rank's pages
            asked.sync = len(asked.ready) == self.tp and (
                min(asked.ready.values()) * self.block_size >= have
            )
            r.first_local = num_computed_tokens
        if have <= num_computed_tokens:
            return 0, False
        return have - num_computed_tokens, not asked.sync

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVMeshWorkerMeta):
            return
        if meta.events or meta.events_dropped:
            self.events.keep(meta.events, meta.events_dropped)
        with self._lock:
            self._cards.update(meta.cards)
            for req_id, by_rank in meta.answers.items():
                asked = self._asked(req_id)
                if asked is not None:
                    asked.answers.update(by_rank)
            for req_id, by_rank in meta.ready.items():
                asked = self._asked(req_id)
                if asked is not None:
                    asked.ready.update(by_rank)
            for req_id, reports in meta.reports.items():
                asked = self._asked(req_id)
                if asked is not None:
                    asked.reports.update(reports)

    def _asked(self, req_id: str) -> _Asked | None:
        r = self._requests.get(req_id)
        return None if r is None else r.asked

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
            r = self._requests.get(req_id)
            first = r.first_local if r is not None else 0
            end = first + num_external_tokens
            if first % self.block_size or end % self.block_size:
                raise RuntimeError(f"kvmesh: unaligned load [{first}, {end})")
            asked = r.asked if r is not None else None
            sync = asked is not None and asked.sync
            if asked is not None:
                asked.loading, asked.load = True, "sync" if sync else "async"
            self._loads.append(
                LoadSpec(
                    req_id,
                    group_ids(blocks.get_block_ids()),
                    first // self.block_size,
                    end // self.block_size,
                    sync,
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVMeshMetadata:
        meta = KVMeshMetadata(step_tokens=int(scheduler_output.total_num_scheduled_tokens))
        with self._lock:
            meta.loads, self._loads = self._loads, []
            meta.asks, self._asks = self._asks, []
            meta.drops, self._drops = self._drops, []
            for new in scheduler_output.scheduled_new_reqs:
                r = self._requests.get(new.req_id)
                if r is not None and r.scope is not None and new.prompt_token_ids is not None:
                    ids = group_ids(new.block_ids)
                    r.tracked = _Tracked(list(new.prompt_token_ids), ids, r.scope)
                    self._maybe_save(meta, new.req_id, r, new.num_computed_tokens, scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                r = self._requests.get(req_id)
                if r is None or r.tracked is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids and new_ids is not None:
                    r.tracked.block_ids = group_ids(new_ids)
                elif new_ids is not None:
                    for group, ids in zip(r.tracked.block_ids, new_ids, strict=True):
                        group.extend(ids)
                self._maybe_save(meta, req_id, r, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(
        self, meta: KVMeshMetadata, req_id: str, r: _Request, computed: int, out: SchedulerOutput
    ) -> None:
        """Hand the workers the prompt's pages this step completes (a sliding window
        frees its pages at the next step, so they are copied in this one); the step
        that completes the prefill says so (``final``)."""
        t = r.tracked
        if t is None or t.final:
            return
        end = min(computed + out.num_scheduled_tokens.get(req_id, 0), len(t.tokens))
        held = min(len(ids) for ids in t.block_ids)
        pages = min(end // self.block_size, held)
        t.final = end >= len(t.tokens)
        if pages > t.saved or (t.final and t.saved):
            ids = [g[t.saved : pages] for g in t.block_ids]
            state_page = end // self.block_size - 1 if end % self.block_size == 0 else -1
            tokens = t.tokens[: pages * self.block_size]
            meta.saves.append(SaveSpec(req_id, tokens, ids, t.saved, t.final, t.scope, state_page))
            t.saved = max(t.saved, pages)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (its workers drop its pages next step); what kvmesh did
        for it goes back to the client as ``kv_transfer_params["kvmesh"]``."""
        with self._lock:
            r = self._requests.pop(request.request_id, None)
            if r is None:
                return False, None
            t = r.tracked
            if r.asked is not None or (t is not None and t.saved and not t.final):
                self._drops.append(request.request_id)  # workers forget its pages and copies
            if r.asked is None:
                return False, None
            cards = {str(rank): card for rank, card in sorted(self._cards.items())}
        return False, {"kvmesh": {**_summary(r.asked, self.tp), "cards": cards}}


def _summary(asked: _Asked, tp: int) -> dict[str, Any]:
    """One request's kvmesh outcome over all ranks (the least any rank got)."""
    out: dict[str, Any] = {
        "pages": min(asked.answers.values()) if len(asked.answers) == tp else 0,
        "loaded": min((r.get("loaded", 0) for r in asked.reports.values()), default=0),
    }
    if len(asked.reports) < tp:
        out["loaded"] = 0
    if asked.load:
        out["load"] = asked.load
    for r in asked.reports.values():
        for k in ("source", "peer", "fallback"):
            if r.get(k) and k not in out:
                out[k] = r[k]
    return out
