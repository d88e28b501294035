"""``kvmesh head``: engine + mesh node + HTTP API in one process.

The HTTP listener serves TLS when given ``http_tls_cert``/``http_tls_key``; a
plaintext listener on a non-loopback address is allowed (as vLLM's) but warned
about, and never hands out the fleet key (``network.pairing_refusal``).

A request without ``max_tokens`` generates at most ``max_tokens_default`` tokens
(``DEFAULT_MAX_TOKENS`` unless the operator says otherwise; None: the rest of the
context window, as OpenAI and vLLM), so one client cannot hold a batch slot for a
whole context by leaving it out.

An idle HTTP connection stays open ``HTTP_KEEP_ALIVE_S`` (longer than clients keep
theirs), so that the client, not the head, is the side that closes it.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the mesh loads when the head runs, not when the CLI starts
    from ..engine import Engine
    from ..mesh.node import NodeConfig, NodeThread
    from ..runtime.head import HeadRuntime
    from .head_options import HeadOptions

log = logging.getLogger("kvmesh.head")

HTTP_KEEP_ALIVE_S = 75


def bind(listen: str) -> socket.socket:
    from ..units import split_hostport

    host, port = split_hostport(listen)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it every keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_head(opts: HeadOptions, node_config: NodeConfig) -> None:
    from ..engine import load_engine
    from ..engine.embedded import resolve_model
    from ..mesh.node import NodeThread
    from ..runtime.ready import on_passing_thread, prepare_process, ready

    prepare_process()  # before torch's threads allocate: the fetch's threads share the warm heap

    def load() -> Engine:
        engine = load_engine(
            opts.model,
            opts.engine,
            progress=lambda m: log.info(m),
            device=opts.device,
            dtype=opts.dtype,
            block_digest=opts.block_digest,
            deterministic_grid=opts.deterministic_grid,
        )
        # what a head does once at start (warm prefill, gc frozen, switch interval, warm
        # heap), after the model's allocations; the HeadRuntime warms the fetch path
        ready(engine, None, engine.layout)
        return engine

    # the engine thread's OpenMP team must be the process's only one: see ready.py
    engine = on_passing_thread(load)
    path = resolve_model(opts.model)
    cfg = json.loads((Path(path) / "config.json").read_text())
    max_context = int(cfg.get("text_config", cfg).get("max_position_embeddings", 4096))
    node = NodeThread(node_config)
    sigterm = _SigtermExits()  # from here a SIGTERM ends through the finally below
    closers: list[Callable[[], None]] = [node.close]  # goodbye, disk writes, sockets
    try:
        _serve(opts, engine, node, node_config, max_context, closers)
    finally:
        sigterm.ignore()  # a second SIGTERM does not cut the clean-up short
        for close in reversed(closers):
            try:
                close()
            except Exception:  # the node is still told to close
                log.exception("closing the head")
        sigterm.restore()


def _serve(
    opts: HeadOptions,
    engine: Engine,
    node: NodeThread,
    node_config: NodeConfig,
    max_context: int,
    closers: list[Callable[[], None]],
) -> None:
    """Build the head on ``node`` and serve HTTP until shut down; what must be
    closed afterwards goes on ``closers`` as soon as it exists."""
    import uvicorn

    # FastAPI imports ujson when it is there (for a response class the head never
    # uses); other tools bring it (sanic, via guidellm), and with it loaded an idle
    # head kept ~40 MiB more free heap after a burst (tests/test_memory_head.py)
    sys.modules.setdefault("ujson", None)  # type: ignore[arg-type]
    from ..runtime.ready import on_passing_thread
    from ..units import is_loopback
    from .app import Access, Limits, TenantOptions, create_app

    runtime = on_passing_thread(lambda: _runtime(opts, engine, node, node_config))
    closers.append(runtime.close)
    name, aliases = opts.model_names()
    app = create_app(
        runtime,
        name,
        max_context,
        opts.api_key_file,
        node_config.security.fleet_key,
        aliases=aliases,
        max_tokens_default=opts.max_tokens_default,
        tool_call_parser=opts.tool_call_parser,
        limits=Limits(
            opts.max_queue, opts.max_body_bytes, opts.api_key_scope, opts.max_queued_tokens
        ),
        tenant_options=TenantOptions(
            opts.tenant_header,
            opts.shared_tenants,
            opts.tenant_secret_file,
            opts.tenant_budget_bytes,
        ),
        access=Access(opts.admin_key_file, opts.gateway_key_file, opts.exact_reuse_by_address),
    )
    closers.append(app.state.scheduler.close)
    closers.append(app.state.openai.close)  # the prompt-scoring thread
    sock = bind(opts.listen)
    host, port = sock.getsockname()[:2]
    tls = bool(opts.http_tls_cert)
    if not tls and not is_loopback(host):
        log.warning(
            "HTTP on %s is plaintext: API keys and prompts cross the network in clear "
            "(--http-tls-cert/--http-tls-key)",
            host,
        )
    fleet = runtime.fleet
    assert fleet is not None  # the head was built on a node
    print(
        f"kvmesh head {fleet.alias} {'https' if tls else 'http'}://{host}:{port} "
        f"grpc {fleet.address} epoch {fleet.epoch} "
        f"model {engine.card.summary()} device {getattr(engine, 'device', 'mlx')}",
        flush=True,
    )
    uvicorn.Server(_uvicorn_config(app, opts)).run(sockets=[sock])


def _runtime(
    opts: HeadOptions, engine: Engine, node: NodeThread, node_config: NodeConfig
) -> HeadRuntime:
    """The head's runtime on ``node``. Its start runs forwards (warm-up, probes): the
    caller builds it on a passing thread (see :func:`run_head`)."""
    from ..engine.embedded import kvmesh_home
    from ..runtime.head import HeadRuntime
    from ..runtime.planner import Planner

    return HeadRuntime(
        engine,
        node,
        hash_key=node_config.security.block_hash_key,
        publish=opts.publish,
        max_sessions=opts.max_sessions,
        audit_rate=opts.audit_rate,
        max_batch=opts.max_batch,
        kv_budget_bytes=opts.kv_budget_bytes,
        prefill_chunk=opts.prefill_chunk,
        adapters=opts.lora_modules(),
        # what it learns of links and of its own prefill outlives a restart
        planner=Planner(home=kvmesh_home(), model=engine.card.namespace_hex),
    )


def _uvicorn_config(app: Any, opts: HeadOptions) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        # the same server stack whatever else is installed (guidellm and sanic bring
        # uvloop, httptools and websockets: with websockets loaded, the same heap
        # effect as ujson's above)
        loop="asyncio",
        http="h11",
        ws="none",
        # an idle connection is closed by the client, not under it: a server that
        # closes first (uvicorn's default 5 s, httpx's and guidellm's expiry too) races
        # a request the client sends on it then (a ReadError); nginx's default
        timeout_keep_alive=HTTP_KEEP_ALIVE_S,
        # X-Forwarded-For/-Proto name the client and the scheme only from a proxy the
        # operator named: from anyone else (loopback too) they would forge both
        proxy_headers=bool(opts.forwarded_allow_ips),
        forwarded_allow_ips=opts.forwarded_allow_ips or "",
        ssl_certfile=opts.http_tls_cert,
        ssl_keyfile=opts.http_tls_key,
    )


class _SigtermExits:
    """SIGTERM ends the process through ``finally`` blocks (exit status 0): uvicorn
    shuts down on it, then raises it again under the handler it found, which by
    default kills the process before the node is closed. Only on the main thread
    (uvicorn takes signals only there too)."""

    def __init__(self) -> None:
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.previous = signal.signal(signal.SIGTERM, self._leave)

    @staticmethod
    def _leave(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    def ignore(self) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def restore(self) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, self.previous)
