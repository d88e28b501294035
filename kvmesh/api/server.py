"""``kvmesh head``: engine + mesh node + HTTP API in one process."""

from __future__ import annotations

import gc
import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvmesh.head")


@dataclass
class HeadOptions:
    model: str = "demo"
    engine: str = "torch"
    listen: str = "127.0.0.1:8000"
    publish: bool = True
    api_key_file: str | None = None
    max_sessions: int = 8
    served_model_names: tuple[str, ...] = ()
    max_tokens_default: int | None = None
    audit_rate: float = 0.0

    def model_names(self) -> tuple[str, tuple[str, ...]]:
        """(canonical name, accepted aliases), as vLLM serves them: the first
        ``--served-model-name``, else ``--model`` as given; the directory name too."""
        given = self.model.rstrip("/") or self.model
        names = (*self.served_model_names, given, Path(given).name)
        return names[0], tuple(dict.fromkeys(names[1:]))


def bind(listen: str) -> socket.socket:
    from ..units import split_hostport

    host, port = split_hostport(listen)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_head(opts: HeadOptions, node_config) -> None:  # type: ignore[no-untyped-def]
    import uvicorn

    from ..engine import load_engine
    from ..engine.demo import resolve_model
    from ..memory import keep_heap_warm
    from ..mesh.node import NodeThread
    from ..runtime.head import HeadRuntime
    from .app import create_app

    engine = load_engine(opts.model, opts.engine, progress=lambda m: log.info(m))
    engine.prefill(engine.encode("warm up"))  # first-call setup is not any request's cost
    gc.collect()
    gc.freeze()  # the model's objects never die: keep full collections off the request path
    keep_heap_warm()  # after the model's allocations: the warm heap stays free for imports
    path = resolve_model(opts.model)
    cfg = json.loads((Path(path) / "config.json").read_text())
    max_context = int(cfg.get("text_config", cfg).get("max_position_embeddings", 4096))
    node = NodeThread(node_config)
    runtime = HeadRuntime(
        engine,
        node,
        hash_key=node_config.security.block_hash_key,
        publish=opts.publish,
        max_sessions=opts.max_sessions,
        audit_rate=opts.audit_rate,
    )
    name, aliases = opts.model_names()
    app = create_app(
        runtime,
        name,
        max_context,
        opts.api_key_file,
        node_config.security.fleet_key,
        aliases=aliases,
        max_tokens_default=opts.max_tokens_default,
    )
    sock = bind(opts.listen)
    host, port = sock.getsockname()[:2]
    print(
        f"kvmesh head {node.node.alias} http://{host}:{port} grpc {node.node.address} "
        f"epoch {node.node.store.epoch} model {engine.card.summary()}",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        runtime.close()
        node.close()
