"""``KVMeshConnector``: vLLM's one connector entry (``KVConnectorBase_V1`` with
``SupportsHMA``), in vLLM's own process layout. vLLM builds it once per role: in
the engine-core process it is a :class:`~kvmesh.vllm.scheduler.KVMeshScheduler`,
in each worker process (one per tensor-parallel rank) a
:class:`~kvmesh.vllm.worker.KVMeshWorker`; nothing is shared between them but the
metadata vLLM serialises every step (:mod:`kvmesh.vllm.meta`).

vLLM's hybrid KV cache manager: each attention group (full, sliding window) has its
own block ids; a kvmesh page is one block index over all groups, the layers in the
model's order, so the card does not depend on how vLLM grouped them.

KV events (vLLM's ``kv_events_config`` with ``enable_kv_cache_events``): rank 0's
worker hears its store (blocks stored in or removed from RAM or disk) and the
scheduler hands them to vLLM's publisher as vLLM's own ``BlockStored`` /
``BlockRemoved`` (medium ``CPU`` for RAM, ``STORAGE`` for disk) in the same stream
as vLLM's blocks; never ``AllBlocksCleared``. The hashes are kvmesh's keys.

A request with vLLM's ``cache_salt`` is keyed from a chain root of the namespace
and the salt, so it is looked up and saved only among requests with the same salt;
a request with a LoRA adapter from a root of its adapter's weights digest (config
and weights files: the same adapter under any name or id shares its KV, another
adapter none, nor does the base model). A page that overlaps a multimodal item's
placeholders also hashes the item's span and vLLM's own hash of it, so it is found
only for the same item at the same place (:class:`~.spec.Scope`). Requests that
kvmesh's keys cannot describe (prompt embeddings, an invalid salt, an adapter
whose files cannot be read) are neither looked up nor saved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ..errors import ConfigError
from .config import parse_settings
from .meta import KVMeshMetadata, KVMeshWorkerMeta
from .scheduler import ANSWER_GRACE_S, EventBuffer, KVMeshScheduler
from .spec import cache_spec
from .worker import KVMeshWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["EventBuffer", "KVMeshConnector", "KVMeshWorkerMeta"]
log = logging.getLogger("kvmesh.vllm")


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry: each role's calls go to that role's object."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = parse_settings(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        spec = cache_spec(kv_cache_config, str(vllm_config.cache_config.cache_dtype))
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("KVMeshConnector does not serve pipeline parallel deployments")
        if (
            parallel.decode_context_parallel_size != 1
            or parallel.prefill_context_parallel_size != 1
        ):
            # a vLLM block then holds block_size x ranks tokens: pages would be misnumbered
            raise ConfigError("KVMeshConnector does not serve context parallel deployments")
        tp = int(parallel.tensor_parallel_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM's default fails a request whose load failed; kvmesh never lets the
            # cache decide an answer (the scheduler reads this after building us)
            log.info("kvmesh: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._scheduler: KVMeshScheduler | None = None
        self._worker: KVMeshWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            answer_s = float(settings["lookup_timeout"]) + ANSWER_GRACE_S
            self._scheduler = KVMeshScheduler(spec.block_size, tp, answer_s)
        else:
            events_cfg = vllm_config.kv_events_config
            events = bool(events_cfg is not None and events_cfg.enable_kv_cache_events)
            self._worker = KVMeshWorker(vllm_config, kv_cache_config, settings, spec, tp, events)

    @property
    def scheduler(self) -> KVMeshScheduler:
        if self._scheduler is None:
            raise RuntimeError("kvmesh: a scheduler call on the worker's connector")
        return self._scheduler

    @property
    def worker(self) -> KVMeshWorker:
        if self._worker is None:
            raise RuntimeError("kvmesh: a worker call on the scheduler's connector")
        return self._worker

    # -- worker role ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVMeshMetadata)
        self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a synchronous load is copied in before the forward; others are not in it

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole pages are copied once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.worker.get_transfer_results()
        return None, (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _meta(self) -> KVMeshMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshMetadata)
        return meta

    # -- scheduler role -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager's ``request_finished``: pages were saved as they were
        computed, so nothing is held back."""
        return self.scheduler.request_finished(request)
