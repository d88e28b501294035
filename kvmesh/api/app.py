"""The head's HTTP application (FastAPI)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.head import HeadRuntime
from . import network
from .network import APIKeys, NetworkState
from .openai import APIError, OpenAIService, error_response, router

log = logging.getLogger("kvmesh.api")


class HeadCollector(Collector):
    def __init__(self, runtime: HeadRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Any:
        snap = self.runtime.telemetry.snapshot()
        c = snap["counters"]
        for name, key, doc in (
            ("kvmesh_completion_tokens", "completion_tokens", "Tokens generated"),
            ("kvmesh_prompt_tokens", "prompt_tokens", "Prompt tokens received"),
            (
                "kvmesh_kv_assisted_tokens",
                "kv_assisted_tokens",
                "Prompt tokens imported, not recomputed",
            ),
            (
                "kvmesh_computed_prompt_tokens",
                "computed_prompt_tokens",
                "Prompt tokens computed locally",
            ),
            ("kvmesh_requests", "requests", "Requests completed"),
            ("kvmesh_bytes_fetched", "bytes_fetched", "KV bytes fetched from peers"),
        ):
            yield CounterMetricFamily(name, doc, value=c.get(key, 0))
        src = CounterMetricFamily("kvmesh_prefill", "Prefills by source tier", labels=["source"])
        for tier in ("session", "local", "remote", "compute"):
            src.add_metric([tier], c.get(f"prefill_source:{tier}", 0))
        yield src
        fb = CounterMetricFamily("kvmesh_fallbacks", "Cache fallbacks by reason", labels=["reason"])
        for reason, n in sorted(self.runtime.telemetry.fallbacks.items()):
            fb.add_metric([reason], n)
        yield fb
        t = snap["timers"]
        for name, key, doc in (
            ("kvmesh_import_seconds", "import_s", "Seconds spent importing KV"),
            ("kvmesh_fetch_seconds", "fetch_s", "Seconds spent fetching KV"),
            ("kvmesh_prefill_seconds", "prefill_s", "Seconds spent in prefill"),
            ("kvmesh_prefill_saved_seconds", "saved_s", "Estimated prefill seconds saved"),
        ):
            yield CounterMetricFamily(name, doc, value=t.get(key, 0.0))
        yield GaugeMetricFamily(
            "kvmesh_prefill_tokens_per_second", "Learned local prefill speed",
            value=self.runtime.planner.prefill_tps or 0.0,
        )  # fmt: skip
        yield CounterMetricFamily(
            "kvmesh_checksum_failures", "Fetches refused because a block failed SHA-256",
            value=c.get("fallback:checksum_mismatch", 0),
        )  # fmt: skip


STATIC = Path(__file__).parent / "static"


def create_app(
    runtime: HeadRuntime,
    model_name: str,
    max_context: int,
    api_key_file: str | None = None,
    fleet_key: bytes | None = None,
    state_file: Path | None = None,
    aliases: tuple[str, ...] = (),
    max_tokens_default: int | None = None,
) -> FastAPI:
    app = FastAPI(title="kvmesh head", docs_url="/docs", redoc_url=None)
    service = OpenAIService(runtime, model_name, max_context, aliases, max_tokens_default)
    app.state.runtime = runtime
    app.state.openai = service

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Any:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        if loc == [] and first.get("type") in ("model_attributes_type", "dict_type"):
            return error_response(400, "the request body must be a JSON object")
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, msg, param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Any:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Any:
        log.exception("request failed")
        return error_response(500, "internal error", "server_error")

    registry = CollectorRegistry()
    registry.register(HeadCollector(runtime))
    if runtime.node is not None:
        from ..mesh.metrics import NodeCollector

        registry.register(NodeCollector(lambda: runtime.node.node if runtime.node else None))

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        node = runtime.node.node if runtime.node else None
        return {
            "status": "ok",
            "model": model_name,
            "namespace": runtime.card.namespace_hex[:12],
            "peers": len(node.membership.live()) if node else 0,
            "compatible_peers": len(node.client.compatible_peers(runtime.card)) if node else 0,
            "publish_pending": runtime.publish_pending(),
        }

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(registry).decode(), media_type="text/plain; version=0.0.4"
        )

    app.include_router(router(service))
    keys = APIKeys.from_file(api_key_file)
    app.include_router(network.router(runtime, keys, NetworkState(state_file), fleet_key))

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
