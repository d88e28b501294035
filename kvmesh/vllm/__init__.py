"""kvmesh inside vLLM: a KV connector, so vLLM servers share prefill through the mesh.

``pip install 'kvmesh[vllm]'`` registers :func:`register_connector` as a ``vllm.general_plugins``
entry point, which makes ``"kv_connector": "KVMeshConnector"`` available to
``vllm serve`` and ``LLM(...)``. Importing this package does not import vLLM.
See ``docs/vllm.md``.

Importing it changes nothing process-wide either: vLLM imports it in every one of
its processes (API server, engine core, workers), after torch and its threads,
where one heap for every thread (:func:`kvmesh.runtime.ready.prepare_process`)
would only make the API server's threads contend for one allocator lock. A
worker's :class:`~kvmesh.vllm.service.MeshService` does a head's start-up itself,
for the threads that fetch (created after it): measured in a library process,
one heap set that late leaves a fetch as few page faults as set first.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVMeshConnector"
CONNECTOR_MODULE = "kvmesh.vllm.connector"


def register_connector() -> None:
    """vLLM plugin entry point: register the connector by name (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
