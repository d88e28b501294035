"""The head's HTTP application (FastAPI).

Health, metrics, network reads and the dashboard are ``async`` and only read
counters and snapshots: they never wait on the engine, on a queued generation or
on a thread pool, so they answer while the request queue is full. Generations
run on the scheduler's own threads (``scheduler.py``); the guard (``guard.py``)
checks API keys and body sizes first. Nothing public shows a local path.

Roles (:class:`Access`, :mod:`.credentials`): the guard decides once who a
request is. ``/metrics`` shows per-tenant series (requests, hits, prompt and
reused tokens, stored bytes per tier) only to an admin's scrape, and
``/v1/admin/tenants`` answers only an admin (a tenant's key: 403); everyone
else sees the aggregates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import memory
from ..engine.grammar import ConstraintFailed
from ..engine.grammar import cache_stats as grammar_cache_stats
from ..engine.vision import ImageGone
from ..errors import Reason
from ..runtime.batch import CANCEL_STAGES, EngineFailed
from ..runtime.head import HeadRuntime
from ..runtime.telemetry import Count, Family, Source, Timer, labelled
from . import cache_query, network, tokenize
from .cache_query import PATH as QUERY
from .credentials import (
    Credentials,
    Tenants,
    default_secret_file,
    head_secret,
    load_credentials,
)
from .errors import APIError, error_response
from .guard import Guard, identity_of
from .head_options import HeadOptions
from .network import NetworkState, require_admin
from .openai import OpenAIService, router
from .scheduler import QueueFull, Scheduler

log = logging.getLogger("kvmesh.api")


def _memory_metrics(m: dict[str, Any]) -> Any:
    """The head's memory against its budgets (kvmesh.memory.report)."""
    for name, key, doc in (
        ("kvmesh_memory_rss_bytes", "rss_bytes", "Resident set size of the head process"),
        ("kvmesh_memory_bound_bytes", "bound_bytes", "Model + --budget + --kv-budget"),
        ("kvmesh_memory_ready_bytes", "ready_bytes", "RSS when the head was ready"),
    ):
        yield GaugeMetricFamily(name, doc, value=m[key])
    if m["heap"] is not None:
        yield GaugeMetricFamily(
            "kvmesh_memory_heap_free_bytes", "Free malloc heap", value=m["heap"]["free"]
        )
    yield CounterMetricFamily("kvmesh_memory_trims", "Idle heap trims", value=m["trims"])
    yield CounterMetricFamily(
        "kvmesh_memory_released_bytes", "RSS given back by idle trims", value=m["released_bytes"]
    )


class HeadCollector(Collector):
    def __init__(
        self,
        runtime: HeadRuntime,
        scheduler: Scheduler,
        memory_report: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.memory_report = memory_report

    def collect(self) -> Any:
        if self.memory_report is not None:
            yield from _memory_metrics(self.memory_report())
        snap = self.runtime.telemetry.snapshot()
        c = snap["counters"]
        for key, doc in (
            (Count.COMPLETION_TOKENS, "Tokens generated"),
            (Count.PROMPT_TOKENS, "Prompt tokens received"),
            (Count.KV_ASSISTED_TOKENS, "Prompt tokens imported, not recomputed"),
            (Count.COMPUTED_PROMPT_TOKENS, "Prompt tokens computed locally"),
            (Count.REQUESTS, "Requests completed"),
            (Count.BYTES_FETCHED, "KV bytes fetched from peers"),
            (Count.LOOKUP_SKIPPED, "Session continuations computed without a fleet lookup"),
            (Count.RENDERS_REUSED, "Chat prompts whose ids a render of the same messages kept"),
        ):
            yield CounterMetricFamily(f"kvmesh_{key}", doc, value=c.get(key, 0))
        src = CounterMetricFamily("kvmesh_prefill", "Prefills by source tier", labels=["source"])
        for tier in Source:
            src.add_metric([tier], c.get(labelled(Family.PREFILL_SOURCE, tier), 0))
        yield src
        fb = CounterMetricFamily("kvmesh_fallbacks", "Cache fallbacks by reason", labels=["reason"])
        for reason, n in sorted(self.runtime.telemetry.fallbacks.items()):
            fb.add_metric([reason], n)
        yield fb
        t = snap["timers"]
        for name, timer, doc in (
            ("kvmesh_import_seconds", Timer.IMPORT, "Seconds spent importing KV"),
            ("kvmesh_fetch_seconds", Timer.FETCH, "Seconds spent fetching KV"),
            ("kvmesh_prefill_seconds", Timer.PREFILL, "Seconds spent in prefill"),
            ("kvmesh_prefill_saved_seconds", Timer.SAVED, "Estimated prefill seconds saved"),
        ):
            yield CounterMetricFamily(name, doc, value=t.get(timer, 0.0))
        yield GaugeMetricFamily(
            "kvmesh_prefill_tokens_per_second",
            "Learned local prefill speed",
            value=self.runtime.planner.prefill_tps or 0.0,
        )
        yield CounterMetricFamily(
            "kvmesh_checksum_failures",
            "Fetches refused because a block failed SHA-256",
            value=c.get(labelled(Family.FALLBACK, Reason.CHECKSUM_MISMATCH), 0),
        )
        yield from self._requests(c)
        yield from self._peers(c)

    def _requests(self, c: dict[str, Any]) -> Any:
        s = self.scheduler
        yield GaugeMetricFamily(
            "kvmesh_queue_waiting", "Requests admitted, waiting for the engine", value=s.waiting
        )
        yield GaugeMetricFamily("kvmesh_queue_running", "Requests on the engine", value=s.running)
        yield GaugeMetricFamily("kvmesh_queue_max", "--max-queue", value=s.max_queue)
        batch = self.runtime.batch
        yield GaugeMetricFamily(
            "kvmesh_batch_sequences", "Sequences decoding together now", value=batch.running
        )
        yield GaugeMetricFamily("kvmesh_batch_max", "--max-batch", value=batch.max_batch)
        yield CounterMetricFamily(
            "kvmesh_batch_steps",
            "Decode steps (of every sequence decoding together)",
            value=batch.steps,
        )
        yield CounterMetricFamily(
            "kvmesh_batch_ridden_steps",
            "Sequence steps computed in a prompt's prefill forward (no forward of their own)",
            value=batch.ridden_steps,
        )
        yield CounterMetricFamily(
            "kvmesh_queue_rejected", "Requests refused with 503 (queue full)", value=s.rejected
        )
        cancelled = CounterMetricFamily(
            "kvmesh_requests_cancelled", "Requests whose client left, by stage", labels=["stage"]
        )
        for stage in CANCEL_STAGES:
            cancelled.add_metric([stage], c.get(labelled(Family.CANCELLED, stage), 0))
        yield cancelled
        yield from self._prefill_work(c)

    def _prefill_work(self, c: dict[str, Any]) -> Any:
        """How prompts were computed: forwards and tokens, the largest chunk, and
        what was shared between requests instead of computed twice."""
        batch = self.runtime.batch
        for name, value, doc in (
            (
                "prefill_forwards",
                batch.prefill_forwards,
                "Prefill forwards (each at most a chunk a prompt)",
            ),
            (
                "prefill_computed_tokens",
                batch.prefill_tokens,
                "Prompt tokens computed by prefill forwards",
            ),
            (
                "shared_tokens",
                batch.shared_tokens,
                "Prompt positions taken from another request's prefill",
            ),
            (
                "share_waits",
                batch.share_waits,
                "Requests that waited for another's prefill of their prefix",
            ),
            (
                "share_rescued_tokens",
                batch.share_rescued_tokens,
                "Shared positions taken from a producer that was cancelled or failed",
            ),
            (
                "partial_blocks",
                c.get(Count.PARTIAL_BLOCKS, 0),
                "Blocks kept from prompts whose request was cancelled or failed",
            ),
        ):
            yield CounterMetricFamily(f"kvmesh_{name}", doc, value=value)
        yield from self._images()
        yield GaugeMetricFamily(
            "kvmesh_prefill_peak_chunk_tokens",
            "Most tokens one prompt computed in one forward (at most --prefill-chunk)",
            value=batch.peak_prefill_chunk,
        )

    def _images(self) -> Any:
        """A vision-language model's encoder work (nothing for a text model)."""
        vision = self.runtime.engine.vision
        if vision is None:
            return
        yield CounterMetricFamily(
            "kvmesh_images_encoded", "Images run through the vision encoder", value=vision.encoded
        )
        yield CounterMetricFamily(
            "kvmesh_image_encoder_seconds",
            "Seconds in the vision encoder",
            value=vision.encoder_seconds,
        )
        yield CounterMetricFamily(
            "kvmesh_image_rows_taken",
            "Images whose encoder rows came from this node's store or a peer (not encoded)",
            value=vision.taken,
        )

    def _peers(self, c: dict[str, Any]) -> Any:
        """Per-peer health (circuit breaker and audits), peers named by alias."""
        planner, alias = self.runtime.planner, self._aliases()
        off = GaugeMetricFamily(
            "kvmesh_peer_backoff_seconds", "Seconds a failed peer is still avoided", labels=["peer"]
        )
        for peer, left in sorted(planner.backed_off().items()):
            off.add_metric([alias.get(peer, peer[:12])], left)
        yield off
        quarantined = GaugeMetricFamily(
            "kvmesh_peer_quarantined", "Peers whose KV failed an audit", labels=["peer"]
        )
        for peer in sorted(planner.quarantined):
            quarantined.add_metric([alias.get(peer, peer[:12])], 1)
        yield quarantined
        failed = CounterMetricFamily(
            "kvmesh_peer_failures", "Failed fetches by reason", labels=["reason"]
        )
        for reason, n in sorted(self.runtime.telemetry.family(Family.PEER_FAILED).items()):
            failed.add_metric([reason], n)
        yield failed
        yield CounterMetricFamily(
            "kvmesh_audits", "Imported blocks recomputed and compared", value=c.get(Count.AUDITS, 0)
        )
        yield CounterMetricFamily(
            "kvmesh_audit_mismatches",
            "Audits whose recompute disagreed",
            value=c.get(Count.AUDIT_MISMATCH, 0),
        )

    def _aliases(self) -> dict[str, str]:
        fleet = self.runtime.fleet
        return fleet.aliases() if fleet else {}


class TenantCollector(Collector):
    """Per-tenant series: only ever registered in the registry key holders read."""

    def __init__(self, runtime: HeadRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Any:
        rows = tenant_rows(self.runtime)
        for name, doc in (
            ("requests", "Requests completed"),
            ("hits", "Requests that reused cached prompt tokens"),
            ("prompt_tokens", "Prompt tokens received"),
            ("reused_tokens", "Prompt tokens reused, not recomputed"),
        ):
            fam = CounterMetricFamily(f"kvmesh_tenant_{name}", doc, labels=["tenant"])
            for tenant, row in rows.items():
                fam.add_metric([tenant], row.get(name, 0))
            yield fam
        stored = GaugeMetricFamily(
            "kvmesh_tenant_stored_bytes", "Bytes a tenant holds", labels=["tenant", "tier"]
        )
        for tenant, row in rows.items():
            for tier in ("ram", "disk"):
                stored.add_metric([tenant, tier], row.get(f"{tier}_bytes", 0))
        yield stored


def tenant_rows(runtime: HeadRuntime) -> dict[str, dict[str, int]]:
    """Each tenant's counters and the bytes it holds in the local store (admin only)."""
    rows = runtime.tenant_counters()
    if runtime.fleet is not None:
        for tenant, (ram, disk) in runtime.fleet.store.owners().items():
            rows.setdefault(tenant, {}).update(ram_bytes=ram, disk_bytes=disk)
    return rows


@dataclass(frozen=True)
class TenantOptions:
    """``kvmesh head``'s tenant flags (see :mod:`.credentials`)."""

    header: str | None = None  # --tenant-header: a trusted gateway names the tenant
    shared: tuple[str, ...] = ()  # --shared-tenant: tenants on the one shared cache
    secret_file: str | None = None  # --tenant-secret-file: roots' secret without a fleet key
    budget_bytes: int | None = None  # --tenant-budget: per tenant, RAM and disk tiers each


STATIC = Path(__file__).parent / "static"
OPENAI_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", QUERY, *tokenize.PATHS}
)


@dataclass(frozen=True)
class Access:
    """Who may do what (``kvmesh head`` flags): tenant keys are ``api_key_file``
    (given to ``create_app`` itself); admin and gateway keys are separate."""

    admin_key_file: str | None = None  # --admin-key-file: network writes, pairing, /v1/admin
    gateway_key_file: str | None = None  # --gateway-key-file: may name --tenant-header
    exact_by_address: bool = False  # --exact-reuse-by-address: one address, one user


_FLAGS = HeadOptions()  # the option rows' defaults, declared there once


@dataclass(frozen=True)
class Limits:
    """What the head's HTTP front door admits (``kvmesh head`` flags, whose
    defaults these are)."""

    max_queue: int = _FLAGS.max_queue  # requests waiting for the engine before a 503
    max_body_bytes: int = _FLAGS.max_body_bytes  # a larger body is a 413
    api_key_scope: str = _FLAGS.api_key_scope  # admin: network writes; all: OpenAI routes too
    max_queued_tokens: int = _FLAGS.max_queued_tokens  # prompt tokens waiting before a 503


def create_app(
    runtime: HeadRuntime,
    model_name: str,
    max_context: int,
    api_key_file: str | None = None,
    fleet_key: bytes | None = None,
    state_file: Path | None = None,
    aliases: tuple[str, ...] = (),
    max_tokens_default: int | None = None,
    limits: Limits | None = None,
    tenant_options: TenantOptions | None = None,
    access: Access | None = None,
    tool_call_parser: str = "auto",
) -> FastAPI:
    limits = limits or Limits()
    topts = tenant_options or TenantOptions()
    memory_report = _memory_reporter(runtime)
    access = access or Access()
    credentials = load_credentials(
        api_key_file,
        access.admin_key_file,
        access.gateway_key_file,
        header=topts.header,
        scope=limits.api_key_scope,
        exact_by_address=access.exact_by_address,
    )
    tenants = _tenants(runtime, credentials, topts)
    app = FastAPI(title="kvmesh head", docs_url="/docs", redoc_url=None)
    scheduler = Scheduler(runtime, limits.max_queue, limits.max_queued_tokens)
    service = OpenAIService(
        runtime,
        scheduler,
        model_name,
        max_context,
        aliases,
        max_tokens_default,
        tenants,
        tool_call_parser,
    )
    app.state.runtime = runtime
    app.state.openai = service
    app.state.scheduler = scheduler
    scope = OPENAI_ROUTES if limits.api_key_scope == "all" else ()
    app.add_middleware(
        Guard,
        credentials=credentials,
        protected=scope.__contains__,
        max_body_bytes=limits.max_body_bytes,
    )
    _add_error_handlers(app)
    _add_health_routes(app, runtime, scheduler, model_name, memory_report)
    _add_metrics_routes(app, runtime, scheduler, memory_report)
    app.include_router(router(service))
    app.include_router(cache_query.router(runtime, service))
    app.include_router(tokenize.router(service))
    app.include_router(network.router(runtime, NetworkState(state_file), fleet_key))
    _add_dashboard(app)
    return app


def _memory_reporter(runtime: HeadRuntime) -> Callable[[], dict[str, Any]]:
    """The head's memory report (:func:`kvmesh.memory.report`), as a function."""
    weights = memory.model_bytes(getattr(runtime.engine, "model", None))  # once: never change

    def memory_report() -> dict[str, Any]:
        """RSS against model + --budget + --kv-budget (kvmesh.memory.report)."""
        store = runtime.fleet.store.stats.budget_bytes if runtime.fleet else None
        report = memory.report(store, runtime.batch.kv_budget_bytes, weights)
        return {**report, "grammars": grammar_cache_stats()}

    return memory_report


def _add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, in OpenAI's body (:mod:`.errors`)."""

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull) -> Any:
        return error_response(
            503,
            f"the request queue is full ({exc}); retry later",
            "server_error",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Any:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Any:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Any:
        code = "body_too_large" if exc.status_code == 413 else None
        return error_response(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error",
            code=code,
            headers=exc.headers,
        )

    @app.exception_handler(ConstraintFailed)
    async def _constraint_failed(request: Request, exc: ConstraintFailed) -> Any:
        return error_response(400, str(exc), code="grammar_failed")

    @app.exception_handler(ImageGone)
    async def _image_gone(request: Request, exc: ImageGone) -> Any:
        return error_response(503, str(exc), "server_error", code="image_evicted")

    @app.exception_handler(EngineFailed)
    async def _engine_failed(request: Request, exc: EngineFailed) -> Any:
        return error_response(
            503,
            "the engine failed: no request can run on this head (see /healthz and the server log)",
            "server_error",
            code="engine_failed",
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Any:
        log.exception("request failed")
        return error_response(500, "internal error", "server_error")


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """A body pydantic refused: a 400 naming its first bad field."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON")
    if loc == [] and first.get("type") in ("model_attributes_type", "dict_type"):
        return error_response(400, "the request body must be a JSON object")
    msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
    return error_response(400, msg, param=".".join(loc) or None)


def _add_health_routes(
    app: FastAPI,
    runtime: HeadRuntime,
    scheduler: Scheduler,
    model_name: str,
    memory_report: Callable[[], dict[str, Any]],
) -> None:
    @app.get("/healthz")
    async def healthz() -> Any:
        fleet = runtime.fleet
        failure = runtime.engine_failure
        body = {
            "status": "ok" if failure is None else "engine_failed",
            "model": model_name,  # the served name, never a local path (server.model_names)
            "namespace": runtime.card.namespace_hex[:12],
            "peers": len(fleet.members()) if fleet else 0,
            "compatible_peers": len(fleet.compatible_peers(runtime.card)) if fleet else 0,
            "publish_pending": runtime.publish_pending(),
            "queue": {
                "waiting": scheduler.waiting,
                "queued_tokens": scheduler.queued_tokens,  # the waiting prompts' (bounded)
                "running": scheduler.running,
                "max": scheduler.max_queue,
            },
            "batch": {"sequences": runtime.batch.running, "max": runtime.batch.max_batch},
            "memory": memory_report(),
        }
        if failure is None:
            return body
        body["error"] = f"the engine thread died: {failure!r}"  # red: no request can run
        return JSONResponse(body, status_code=503)

    @app.get("/health")
    async def health() -> Response:
        """vLLM's liveness check (load generators such as guidellm ask it): 200 with an
        empty body while the engine serves, 503 once it died. Open as /healthz is."""
        return Response(status_code=200 if runtime.engine_failure is None else 503)


def _add_metrics_routes(
    app: FastAPI,
    runtime: HeadRuntime,
    scheduler: Scheduler,
    memory_report: Callable[[], dict[str, Any]],
) -> None:
    """``/metrics`` (per-tenant series only to an admin's scrape) and the admins'
    per-tenant table."""
    registry, private = CollectorRegistry(), CollectorRegistry()
    for reg in (registry, private):
        reg.register(HeadCollector(runtime, scheduler, memory_report))
        if runtime.fleet is not None:
            reg.register(runtime.fleet.collector())
    private.register(TenantCollector(runtime))

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        admin = identity_of(request).admin  # per-tenant series: admins only
        return PlainTextResponse(
            generate_latest(private if admin else registry).decode(),
            media_type="text/plain; version=0.0.4",
        )

    @app.get("/v1/admin/tenants")
    async def tenant_stats(request: Request) -> Any:
        require_admin(request)
        return {"tenants": tenant_rows(runtime)}


def _add_dashboard(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def _tenants(runtime: HeadRuntime, credentials: Credentials, opts: TenantOptions) -> Tenants | None:
    """The head's tenants' roots, under the tenant secret (never the fleet key: a
    node paired into the fleet cannot derive them), and the budget every tenant,
    the default one included, is held to. None when no request names a tenant."""
    if opts.budget_bytes is not None and runtime.fleet is not None:
        runtime.fleet.store.set_tenant_budget(opts.budget_bytes)
    if not credentials.tenants_enabled and opts.budget_bytes is None:
        return None
    secret = opts.secret_file or default_secret_file()
    if credentials.tenants_enabled and runtime.fleet is not None:
        log.info(
            "tenants' caches are derived under the tenant secret %s: heads that share them "
            "(across restarts or with another head) use the same file",
            secret,
        )
    return Tenants(runtime.card.namespace, head_secret(secret), frozenset(opts.shared))
