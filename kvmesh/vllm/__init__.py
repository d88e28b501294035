"""kvmesh inside vLLM: a KV connector, so vLLM servers share prefill through the mesh.

``pip install 'kvmesh[vllm]'`` registers :func:`register` as a ``vllm.general_plugins``
entry point, which makes ``"kv_connector": "KVMeshConnector"`` available to
``vllm serve`` and ``LLM(...)``. Importing this package does not import vLLM.
See ``docs/vllm.md``.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVMeshConnector"
CONNECTOR_MODULE = "kvmesh.vllm.connector"


def register() -> None:
    """vLLM plugin entry point: register the connector by name (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
