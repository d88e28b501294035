"""``kvmesh peer``: a cache-only node. Stops cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .node import MeshNode, NodeConfig

log = logging.getLogger("kvmesh.peer")


async def run_peer(config: NodeConfig, metrics: str | None = None) -> None:
    from ..memory import keep_heap_warm, one_heap

    one_heap()  # before the node's threads allocate (see there)
    keep_heap_warm(64 << 20)  # serving copies every block into grpc buffers: keep them faulted in
    node = MeshNode(config)
    await node.start()
    if metrics:
        from prometheus_client import REGISTRY, start_http_server

        from ..units import split_hostport
        from .metrics import NodeCollector

        REGISTRY.register(NodeCollector(lambda: node))
        host, port = split_hostport(metrics)
        start_http_server(port, addr=host)
    print(
        f"kvmesh peer {node.alias} listening on {node.address} epoch {node.store.epoch}", flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await node.stop(grace=1.0)
    print("kvmesh peer stopped", file=sys.stderr, flush=True)
