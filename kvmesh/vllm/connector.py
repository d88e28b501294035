"""``KVMeshConnector``: vLLM's KV connector API on top of the kvmesh mesh.

Scheduler side (never waits on the network):

- ``get_num_new_matched_tokens``: the prompt's full pages (never its last token)
  are keyed with kvmesh's chained keys; the local store answers at once, the
  fleet on a lookup thread (the scheduler is told "ask again", ``None``, until
  it has answered). The planner takes a remote hit only when its transfer beats
  vLLM's own measured prefill; the fetch starts right away, verified block by
  block, while vLLM allocates pages. The answer is always an asynchronous load.
- ``update_state_after_alloc`` / ``build_connector_meta``: which vLLM pages to
  fill for which request, and which computed prompts to save.

Worker side:

- ``start_load_kv``: each load runs on a load thread: verified blocks (local or
  fetched) are copied into the request's pages; pages that could not be had are
  reported through ``get_block_ids_with_load_errors`` together with the request
  in ``get_finished``, so vLLM recomputes them (the answer never depends on the
  cache).
- ``wait_for_save``: once a prompt's prefill is complete, its full pages not yet
  stored are copied out (one copy, on the model's path), then sealed (SHA-256),
  stored and published by the publisher thread through the bounded queue.

Requests that kvmesh's keys cannot describe (LoRA adapters, multimodal inputs,
a cache salt, prompt embeddings) are neither looked up nor saved.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..blocks import PrefixKeys
from ..codec import Block
from ..errors import CacheMiss, ConfigError, KVMeshError
from ..mesh.hits import PeerHit
from . import service as services
from .config import parse_settings
from .pages import DTYPES, CacheSpec, Pages, check_position, model_card, page_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # type: ignore[import-not-found]
    from vllm.forward_context import ForwardContext  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
    from vllm.v1.core.sched.output import SchedulerOutput  # type: ignore[import-not-found]
    from vllm.v1.kv_cache_interface import KVCacheConfig  # type: ignore[import-not-found]
    from vllm.v1.request import Request  # type: ignore[import-not-found]

log = logging.getLogger("kvmesh.vllm")
MIN_CACHE_BUDGET_S = 0.2
IDLE_YIELD_S = 0.002


# -- metadata (scheduler -> worker) --------------------------------------------


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]  # the request's vLLM blocks, page i in block_ids[i]
    first_page: int  # pages before this are vLLM's own prefix cache
    pages: int  # load pages [first_page, pages)


@dataclass
class SaveSpec:
    req_id: str
    tokens: list[int]  # the prompt's full pages
    block_ids: list[int]


@dataclass
class KVMeshMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step_tokens: int = 0


# -- the scheduler's view of one request ---------------------------------------


@dataclass
class Plan:
    """Where one prompt's pages come from: the local store's chain, then a peer's."""

    keys: PrefixKeys
    local: tuple[Block, ...]
    lookup: concurrent.futures.Future[None] | None = None
    hit: PeerHit | None = None
    fetch: concurrent.futures.Future[None] | None = None
    fetched: dict[int, Block] = field(default_factory=dict)  # page index -> verified block
    fetch_error: str | None = None
    pages: int = 0  # pages this plan promises

    def __post_init__(self) -> None:
        self.pages = len(self.local)

    def block(self, i: int) -> Block | None:
        return self.local[i] if i < len(self.local) else self.fetched.get(i)


@dataclass
class _Tracked:
    tokens: list[int]
    block_ids: list[int]
    saved: bool = False


class KVMeshConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = parse_settings(extra)
        self.cache_spec = _cache_spec(kv_cache_config)
        if vllm_config.parallel_config.world_size != 1:
            raise ConfigError("KVMeshConnector serves one device per vLLM process (TP = PP = 1)")
        self.block_size = self.cache_spec.block_size
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM's default fails a request whose load failed; kvmesh never lets the
            # cache decide an answer (the scheduler reads this after building us)
            log.info("kvmesh: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._lock = threading.Lock()
        # scheduler side
        self._eligible: dict[str, bool] = {}
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._first_local: dict[str, int] = {}
        # worker side
        self.pages: Pages | None = None
        self._done: dict[str, list[int]] = {}  # finished loads -> block ids that failed
        self._errors: set[int] = set()
        self._t_bind = 0.0
        self._inflight = 0  # loads submitted and not finished
        self.svc = services.current() if role == KVConnectorRole.SCHEDULER else None
        if role == KVConnectorRole.SCHEDULER and self.svc is None:
            raise ConfigError(
                "KVMeshConnector needs vLLM's scheduler and worker in one process "
                "(the uni executor of a single-device deployment)"
            )

    # ==========================================================================
    # worker side
    # ==========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for g in self._kv_cache_config.kv_cache_groups for n in g.layer_names]
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no cache for layers {missing[:3]}")
        tensors = [kv_caches[n] for n in names]
        probe = model_card(
            *_model_dirs(self._vllm_config),
            self.cache_spec,
            engine="probe",
            quantization=str(self._vllm_config.model_config.quantization or "none"),
        )
        kind = page_layout(tensors, probe)  # checks every tensor against the card
        card = dataclasses.replace(probe, engine=_engine_name(self._vllm_config, names[0], kind))
        self.pages = Pages(card, tensors)
        self.svc = services.start(self.settings, card)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._t_bind = time.perf_counter()

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
            # an idle step while pages arrive: vLLM steps again at once; give the fetch
            # and copy threads the interpreter for a moment instead of spinning
            time.sleep(IDLE_YIELD_S)
        for spec in meta.saves:
            try:
                self._save(spec)
            except Exception as e:  # a save never fails a request
                log.warning("save of %s failed: %r", spec.req_id, e)
                svc.count("save_failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, {}
            for bad in done.values():
                self._errors.update(bad)
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            services.stop()

    def _require_svc(self) -> services.MeshService:
        if self.svc is None:
            raise RuntimeError("kvmesh: no cache registered yet")
        return self.svc

    # -- loads -----------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> None:
        """Fill the request's pages from its plan; report the pages that failed."""
        svc = self._require_svc()
        failed = list(spec.block_ids[spec.first_page : spec.pages])
        t0 = time.perf_counter()
        try:
            plan = self._plans_for_worker(spec.req_id)
            if plan is None:
                raise CacheMiss("no plan for this request")
            if plan.fetch is not None:
                # a failed fetch recorded its reason; its verified prefix is still used
                with contextlib.suppress(Exception):
                    plan.fetch.result(timeout=svc.fleet.fetch_deadline + 5)
            t1 = time.perf_counter()
            svc.count("load_wait_ms", round((t1 - t0) * 1000))
            assert self.pages is not None
            for i in range(spec.first_page, spec.pages):
                blk = plan.block(i)
                if blk is None:
                    break
                check_position(blk, svc.keyer, plan.keys, i)
                self.pages.copy_in(blk, spec.block_ids[i])
                failed.pop(0)
            svc.count("pages_loaded", spec.pages - spec.first_page - len(failed))
            svc.count("copy_in_ms", round((time.perf_counter() - t1) * 1000))
            if failed:
                svc.count(f"load_fallback:{plan.fetch_error or 'missing'}")
        except Exception as e:  # the cache never decides correctness
            log.info("load for %s failed: %r", spec.req_id, e)
            svc.count(f"load_failed:{e.reason if isinstance(e, KVMeshError) else 'error'}")
        with self._lock:
            self._done[spec.req_id] = failed
            self._inflight -= 1

    def _plans_for_worker(self, req_id: str) -> Plan | None:
        svc = self._require_svc()
        with svc.plans_lock:
            plan = svc.plans.get(req_id)
        return plan if isinstance(plan, Plan) else None

    # -- saves -----------------------------------------------------------------

    def _save(self, spec: SaveSpec) -> None:
        svc = self._require_svc()
        assert self.pages is not None
        keys = svc.keyer.keys(spec.tokens)
        have = svc.fleet.local_prefix(keys).blocks
        if len(have) >= len(keys.blocks):
            return
        if not svc.try_reserve_publish():
            return
        try:
            copies = [
                self.pages.copy_out(svc.keyer, keys, i, spec.block_ids[i])
                for i in range(len(have), len(keys.blocks))
            ]
        except Exception:
            svc.release_publish()
            raise
        svc.publisher.submit(self._publish, list(have), copies)

    def _publish(self, have: list[Block], copies: list[tuple[bytearray, object]]) -> None:
        svc = self._require_svc()
        pages = self.pages
        assert pages is not None  # copies were made from them
        try:
            chain = have + [pages.seal(blob, header) for blob, header in copies]
            svc.fleet.keep(chain)
            if svc.settings.publish:
                svc.fleet.publish(svc.card, chain)
            svc.count("pages_published", len(copies))
        except Exception as e:
            log.warning("publish failed: %r", e)
            svc.count("publish_failed")
        finally:
            svc.release_publish()

    # ==========================================================================
    # scheduler side
    # ==========================================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        svc = self._require_svc()
        req_id = request.request_id
        tokens = request.prompt_token_ids
        eligible = _eligible(request)
        with self._lock:
            self._eligible[req_id] = eligible
        if not eligible or tokens is None:
            return 0, False
        pages = (len(tokens) - 1) // self.block_size  # vLLM computes at least the last token
        if pages * self.block_size <= num_computed_tokens:
            return 0, False
        with svc.plans_lock:
            plan = svc.plans.get(req_id)
            if plan is None:
                plan = svc.plans[req_id] = self._plan(svc, list(tokens[: pages * self.block_size]))
        if plan.lookup is not None and not plan.lookup.done():
            return None, False  # ask again next step: the fleet has not answered yet
        with self._lock:
            self._first_local[req_id] = num_computed_tokens
        have = plan.pages * self.block_size
        if have <= num_computed_tokens:
            return 0, False
        return have - num_computed_tokens, True

    def _plan(self, svc: services.MeshService, tokens: list[int]) -> Plan:
        keys = svc.keyer.keys(tokens)
        plan = Plan(keys, svc.fleet.local_prefix(keys).blocks)
        if len(plan.local) < len(keys.blocks):
            plan.lookup = svc.lookups.submit(self._lookup, svc, plan)
        return plan

    def _lookup(self, svc: services.MeshService, plan: Plan) -> None:
        """On a lookup thread: ask the fleet, let the planner choose, start the fetch."""
        try:  # a peer that fails lookups backs off; one that answers is forgiven
            hits, errors = svc.fleet.lookup(
                svc.card, plan.keys, **svc.planner.lookup_hooks(svc.count)
            )
            b = self.block_size
            have = len(plan.local)
            for hit in hits:
                n = min(len(hit.blocks), len(plan.keys.blocks))
                if n <= have or not svc.planner.usable(hit.node_id):
                    continue
                hit = dataclasses.replace(hit, blocks=hit.blocks[:n], tail=None, tokens=n * b)
                nbytes = sum(i.nbytes for i in hit.blocks[have:])
                if not svc.planner.estimate(hit.node_id, (n - have) * b, nbytes).worth_it:
                    svc.count("planned_compute")
                    continue
                plan.hit, plan.pages = hit, n
                plan.fetch = svc.fetches.submit(self._fetch, svc, plan, hit, have, nbytes)
                svc.count("remote_hits")
                return
            svc.count("lookup_misses" if not errors else f"lookup_errors:{errors[0]}")
        except Exception as e:  # a lookup that fails is a miss
            log.info("lookup failed: %r", e)
            svc.count("lookup_errors:error")

    def _fetch(
        self, svc: services.MeshService, plan: Plan, hit: PeerHit, start: int, nbytes: int
    ) -> None:
        """On a fetch thread: stream the hit's pages after the local ones, verified."""
        budget = min(
            svc.fleet.fetch_deadline,
            max(svc.planner.compute_s(plan.pages * self.block_size), MIN_CACHE_BUDGET_S),
        )
        index = {k: i for i, k in enumerate(plan.keys.blocks)}

        def on_block(blk: Block) -> None:
            i = index.get(blk.key)
            if i is not None:
                plan.fetched[i] = blk

        t0 = time.perf_counter()
        try:
            svc.fleet.fetch(svc.layout, hit, start, on_block, budget)
        except Exception as e:  # the verified pages before the failure still load
            # counted; only the peer's own failures back it off (busy or ours do not)
            plan.fetch_error = svc.planner.fetch_failed(hit.node_id, e, svc.count, hit.alias)
        else:
            svc.planner.observe_fetch(hit.node_id, nbytes, time.perf_counter() - t0)
            svc.count("fetched_bytes", nbytes)
            svc.planner.peer_succeeded(hit.node_id)
        svc.count("fetch_ms", round((time.perf_counter() - t0) * 1000))
        chain = []
        for i in range(start, plan.pages):
            blk = plan.fetched.get(i)
            if blk is None:
                break
            chain.append(blk)
        if chain and start == len(plan.local):
            svc.fleet.keep(chain)  # continues the stored chain: serve it from here too

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
            self._loads.append(
                LoadSpec(
                    req_id,
                    list(blocks.get_block_ids()[0]),
                    first // self.block_size,
                    end // self.block_size,
                )
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVMeshMetadata(step_tokens=int(scheduler_output.total_num_scheduled_tokens))
        with self._lock:
            meta.loads, self._loads = self._loads, []
            for new in scheduler_output.scheduled_new_reqs:
                if self._eligible.get(new.req_id) and new.prompt_token_ids is not None:
                    self._tracked[new.req_id] = _Tracked(
                        list(new.prompt_token_ids), list(new.block_ids[0])
                    )
                    self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                tracked = self._tracked.get(req_id)
                if tracked is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids and new_ids is not None:
                    tracked.block_ids = list(new_ids[0])
                elif new_ids is not None:
                    tracked.block_ids.extend(new_ids[0])
                self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(
        self, meta: KVMeshMetadata, req_id: str, computed: int, out: SchedulerOutput
    ) -> None:
        """Save the prompt's full pages in the step that completes its prefill."""
        t = self._tracked[req_id]
        if t.saved or computed + out.num_scheduled_tokens.get(req_id, 0) < len(t.tokens):
            return
        t.saved = True
        pages = min(len(t.tokens) // self.block_size, len(t.block_ids))
        if pages:
            meta.saves.append(
                SaveSpec(req_id, t.tokens[: pages * self.block_size], t.block_ids[:pages])
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        svc = self._require_svc()
        with svc.plans_lock:
            plan = svc.plans.pop(req_id, None)
        with self._lock:
            self._eligible.pop(req_id, None)
            self._tracked.pop(req_id, None)
            self._first_local.pop(req_id, None)
        if plan is not None and plan.fetch is not None:
            plan.fetch.cancel()
        return False, None


# -- helpers ---------------------------------------------------------------------


def _eligible(request: Request) -> bool:
    """Requests whose KV is a function of the prompt's token ids alone."""
    return (
        getattr(request, "lora_request", None) is None
        and not getattr(request, "mm_features", None)
        and not getattr(request, "cache_salt", None)
        and getattr(request, "prompt_embeds", None) is None
    )


def _cache_spec(kv_cache_config: KVCacheConfig) -> CacheSpec:
    """One group of plain full-attention layers, or a clear error: sliding windows,
    hybrid (Mamba) models, MLA and quantized KV are not served."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # type: ignore[import-not-found]

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVMeshConnector serves models with one KV cache group, this one has {len(groups)} "
            "(sliding-window or hybrid attention)"
        )
    spec = groups[0].kv_cache_spec
    plain = (
        type(spec) is FullAttentionSpec
        and getattr(spec, "sliding_window", None) is None
        and getattr(spec, "attention_chunk_size", None) is None
        and getattr(spec, "head_size_v", spec.head_size) in (None, spec.head_size)
        and int(getattr(spec, "kv_quant_mode", 0)) == 0
        and getattr(spec, "page_size_padded", None) is None
    )
    if not plain:
        raise ConfigError(f"KVMeshConnector does not serve {type(spec).__name__} caches: {spec}")
    if spec.dtype not in DTYPES:
        raise ConfigError(f"KVMeshConnector does not serve a {spec.dtype} KV cache")
    return CacheSpec(
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        block_size=int(spec.block_size),
        kv_dtype=DTYPES[spec.dtype],
    )


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


def _engine_name(vllm_config: VllmConfig, layer: str, kind: str) -> str:
    """vLLM version, platform, attention backend, page layout, model dtype, compilation."""
    import vllm  # type: ignore[import-not-found]
    from vllm.platforms import current_platform  # type: ignore[import-not-found]

    ctx = vllm_config.compilation_config.static_forward_context.get(layer)
    backend = getattr(getattr(ctx, "attn_backend", None), "get_name", lambda: "unknown")()
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    mode = vllm_config.compilation_config.mode
    return (
        f"vllm/{vllm.__version__}/{current_platform.device_type}/{backend}/{kind}/{dtype}/"
        f"compile={getattr(mode, 'name', mode)}"
    )
