"""The network API: live topology and token telemetry, public reads, admin writes.

Public reads carry aliases, roles, coarse regions, status and aggregates only:
never prompts, prefix hashes, IP addresses, node ids or epochs, and no row of one
request (token series are ``PUBLIC_BUCKET_S`` windows of at least
``MIN_PUBLIC_REQUESTS`` requests; transfers are listed to admins only). With an
admin key (``--admin-key-file``; the guard decided the role) the same endpoints
add addresses, endpoints, RTTs, the link rate the head's planner measured to
each peer and its last fetch-or-compute choice there (``link_mbps``,
``link_rtt_ms``, ``last_choice``), epochs and the last transfers, and the writes
open: groups, pairing. A tenant's key is never an admin's (403). Pairing tokens
are single use and expire; redeeming one over plaintext from off the host is
refused (the scheme is the connection's own: forwarded headers count only from
``--forwarded-allow-ips``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from ..runtime.head import HeadRuntime
from ..runtime.telemetry import Count, Family, Source, Timer, labelled
from ..units import is_loopback
from .errors import APIError
from .guard import BodyOffLoop, identity_of
from .requests import Body

PAIRING_TTL_S = 600.0
SOURCES = tuple(Source)  # where a prefill's prefix came from
PUBLIC_BUCKET_S = 60.0  # public token series: windows this long ...
MIN_PUBLIC_REQUESTS = 5  # ... holding at least this many requests (none shows one request)
ADMIN_KEY = "an admin key is required (--admin-key-file; X-API-Key or Authorization: Bearer)"


def pairing_refusal(scheme: str, client_host: str | None, fleet_key: bool) -> str | None:
    """Why ``/v1/network/pair`` must not answer this connection, or None. The fleet
    key is the fleet's only secret: it never crosses a network in plaintext (a
    loopback client, e.g. a TLS-terminating proxy on the same host, is fine)."""
    if not fleet_key or scheme == "https" or (client_host and is_loopback(client_host)):
        return None
    return (
        "pairing hands out the fleet key and this connection is plaintext: serve the head "
        "with --http-tls-cert/--http-tls-key (or pair from the head's own host)"
    )


class GroupIn(Body):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    members: list[str] = Field(default_factory=list, max_length=256)
    description: str = Field(default="", max_length=512)


class PairIn(Body):
    model_config = ConfigDict(extra="forbid")
    token: str = Field(min_length=8, max_length=128)
    alias: str = Field(default="", max_length=64)


class NetworkState:
    """Groups, pairing tokens and first-seen epochs of the head's view."""

    def __init__(self, state_file: Path | None = None) -> None:
        self._lock = threading.Lock()
        self.groups: dict[str, dict[str, Any]] = {}
        self.pairing: dict[str, float] = {}  # sha256(token) hex -> expiry
        self.epoch_seen: dict[tuple[str, str], float] = {}
        self.state_file = state_file
        if state_file and state_file.is_file():
            self.groups = json.loads(state_file.read_text()).get("groups", {})

    def _save(self) -> None:
        if self.state_file:
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"groups": self.groups}))
            tmp.replace(self.state_file)

    def add_group(self, g: GroupIn) -> dict[str, Any]:
        with self._lock:
            gid = secrets.token_hex(6)
            self.groups[gid] = {
                "id": gid,
                "name": g.name,
                "members": g.members,
                "description": g.description,
                "created": time.time(),
            }
            self._save()
            return self.groups[gid]

    def delete_group(self, gid: str) -> bool:
        with self._lock:
            found = self.groups.pop(gid, None) is not None
            self._save()
            return found

    def issue_token(self) -> tuple[str, float]:
        token = secrets.token_urlsafe(24)
        expires = time.time() + PAIRING_TTL_S
        with self._lock:
            self.pairing[hashlib.sha256(token.encode()).hexdigest()] = expires
        return token, expires

    def redeem(self, token: str) -> bool:
        h = hashlib.sha256(token.encode()).hexdigest()
        with self._lock:
            expires = self.pairing.pop(h, None)  # single use, even when expired
        return expires is not None and expires > time.time()

    def epoch_age(self, node_id: str, epoch: str) -> float:
        key = (node_id, epoch)
        now = time.time()
        with self._lock:
            first = self.epoch_seen.setdefault(key, now)
        return now - first


def _node_rows(runtime: HeadRuntime, state: NetworkState, private: bool) -> list[dict[str, Any]]:
    fleet = runtime.fleet
    rows = []
    cards = []
    if fleet is not None:
        cards = [(fleet.own_card(), 0.0, True)]
        cards += [(c, fleet.card_age(c.node_id), False) for c in fleet.members()]
    backed_off = runtime.planner.backed_off()
    for card, age, is_self in cards:
        ttl = fleet.ttl if fleet else 1
        row: dict[str, Any] = {
            "alias": card.alias,
            "roles": list(card.roles),
            "region": card.region,
            "status": "self" if is_self else ("live" if age < ttl / 2 else "stale"),
            "health": peer_health(runtime, card.node_id, backed_off),
            "card_age_s": round(age, 2),
            "epoch_age_s": round(state.epoch_age(card.node_id, card.epoch), 1),
            "interfaces": sorted({e.interface for e in card.endpoints}),
            "capacity": {
                "budget_bytes": card.budget_bytes,
                "used_bytes": card.used_bytes,
                "entries": card.entries,
            },
            "served": {
                "fetches": card.fetches_served,
                "bytes": card.bytes_served,
                "per_s": round(card.load, 2),
            },
            "hit_ratio": round(card.hits / (card.hits + card.misses), 3)
            if card.hits + card.misses
            else None,
            "models": list(card.card_summaries) if private else len(card.namespaces),
        }
        if private:
            row.update(
                node_id=card.node_id,
                epoch=card.epoch,
                endpoints=[
                    {
                        "address": e.address,
                        "interface": e.interface,
                        "priority": e.priority,
                        "rtt_ms": None
                        if is_self or fleet is None
                        else fleet.rtt(card.node_id, e.address),
                    }
                    for e in card.endpoints
                ],
                **_link(runtime, card.node_id, is_self),
            )
        rows.append(row)
    return rows


def _link(runtime: HeadRuntime, node_id: str, is_self: bool) -> dict[str, Any]:
    """The head planner's view of its link to a peer (admins only: a rate and a
    choice hint at what was fetched)."""
    link = None if is_self else runtime.planner.link(node_id)
    if link is None:
        return {"link_mbps": None, "link_rtt_ms": None, "last_choice": None}
    rate, rtt = link["bytes_per_s"], link["rtt_s"]
    return {
        "link_mbps": None if rate is None else round(rate * 8 / 1e6, 1),
        "link_rtt_ms": None if rtt is None else round(rtt * 1e3, 2),
        "last_choice": link["last_choice"] or None,
    }


def peer_health(runtime: HeadRuntime, node_id: str, backed_off: Mapping[str, float]) -> str:
    """How the head's planner sees a peer: ok, backed off (circuit breaker) or
    quarantined (its KV failed an audit)."""
    if node_id in runtime.planner.quarantined:
        return "quarantined"
    return "backed off" if node_id in backed_off else "ok"


def _tokens(runtime: HeadRuntime, private: bool = False) -> dict[str, Any]:
    """Token counters and a time series: 10 s buckets for an admin; for everyone
    else ``PUBLIC_BUCKET_S`` windows, only those of ``MIN_PUBLIC_REQUESTS`` or more
    requests (a quiet window would show one request's prompt length)."""
    c = runtime.telemetry.snapshot()["counters"]
    bucket_s = 10.0 if private else PUBLIC_BUCKET_S
    series: dict[int, dict[str, float]] = {}
    for r in list(runtime.telemetry.recent):
        b = int(r["t"] // bucket_s * bucket_s)
        s = series.setdefault(
            b,
            {
                "t": b,
                "requests": 0,
                "completion_tokens": 0,
                "kv_assisted_tokens": 0,
                "computed_tokens": 0,
            },
        )
        s["requests"] += 1
        s["completion_tokens"] += r["completion_tokens"]
        s["kv_assisted_tokens"] += r["reused_tokens"]
        s["computed_tokens"] += r["computed_tokens"]
    least = 1 if private else MIN_PUBLIC_REQUESTS
    series = {k: v for k, v in series.items() if v["requests"] >= least}
    return {
        "completed_tokens": c.get(Count.COMPLETION_TOKENS, 0),
        "kv_assisted_tokens": c.get(Count.KV_ASSISTED_TOKENS, 0),
        "computed_prompt_tokens": c.get(Count.COMPUTED_PROMPT_TOKENS, 0),
        "prompt_tokens": c.get(Count.PROMPT_TOKENS, 0),
        "requests": c.get(Count.REQUESTS, 0),
        "series": [series[k] for k in sorted(series)],
    }


def _prefill(runtime: HeadRuntime, state: NetworkState, private: bool) -> dict[str, Any]:
    c = runtime.telemetry.snapshot()["counters"]
    t = runtime.telemetry.snapshot()["timers"]
    sources = {s: c.get(labelled(Family.PREFILL_SOURCE, s), 0) for s in SOURCES}
    total = sum(sources.values())
    fleet = runtime.fleet
    transfers = []
    if fleet is not None and private:  # one transfer is one request's prompt length
        for tr in fleet.transfers()[-20:]:
            transfers.append(
                {
                    "peer": tr.peer,
                    "bytes": tr.bytes,
                    "seconds": round(tr.seconds, 4),
                    "gbps": round(tr.gbps, 3),
                    "at": tr.at,
                    "blocks": tr.blocks,
                    "wire_bytes": tr.wire_bytes,
                    "codec": tr.codec,
                    "trimmed": tr.trimmed,
                }
            )
    return {
        "requests": total,
        "hit_ratio": round((total - sources[Source.COMPUTE]) / total, 3) if total else None,
        "by_source": sources,
        "bytes_fetched": c.get(Count.BYTES_FETCHED, 0),
        "bytes_published": fleet.counter("bytes_published") if fleet else 0,
        "prefill_seconds_saved": round(t.get(Timer.SAVED, 0.0), 3),
        "fallback_reasons": runtime.telemetry.fallbacks,
        "recent_transfers": transfers,
        "capacity": [
            {"alias": n["alias"], **n["capacity"]} for n in _node_rows(runtime, state, private)
        ],
        "tiers": _tiers(runtime),
    }


def _tiers(runtime: HeadRuntime) -> list[dict[str, Any]]:
    """The head's own store, tier by tier (RAM, then disk): aggregates only, public
    like capacity (never a path, a key or a file name)."""
    if runtime.fleet is None:
        return []
    return [
        {
            "tier": t.tier,
            "budget_bytes": t.budget_bytes,
            "used_bytes": t.used_bytes,
            "entries": t.entries,
            "hits": t.hits,
            "admissions": t.admissions,
            "evictions": t.evictions,
            "promotions": t.promotions,
            "corrupt": t.corrupt,
            "dropped": t.dropped,
        }
        for t in runtime.fleet.tier_stats()
    ]


def require_admin(request: Request) -> None:
    """401 for an anonymous request, 403 for a key that is not an admin's."""
    who = identity_of(request)
    if who.admin:
        return
    if who.role == "anonymous":
        raise APIError(401, ADMIN_KEY, "authentication_error", code="invalid_api_key")
    raise APIError(403, ADMIN_KEY, "permission_error", code="admin_only")


def router(runtime: HeadRuntime, state: NetworkState, fleet_key: bytes | None) -> APIRouter:
    r = APIRouter(prefix="/v1/network", route_class=BodyOffLoop)

    def private(request: Request) -> bool:
        return identity_of(request).admin

    @r.get("/summary")
    async def summary(request: Request) -> dict[str, Any]:
        rows = _node_rows(runtime, state, False)
        tok = _tokens(runtime)
        pre = _prefill(runtime, state, False)
        return {
            "nodes": len(rows),
            "heads": sum("head" in n["roles"] for n in rows),
            "caches": sum("cache" in n["roles"] and "head" not in n["roles"] for n in rows),
            "groups": len(state.groups),
            "model": runtime.card.summary() if private(request) else runtime.card.model_id,
            "completed_tokens": tok["completed_tokens"],
            "kv_assisted_tokens": tok["kv_assisted_tokens"],
            "hit_ratio": pre["hit_ratio"],
            "capacity_bytes": sum(n["capacity"]["budget_bytes"] for n in rows),
            "used_bytes": sum(n["capacity"]["used_bytes"] for n in rows),
            "uptime_s": round(time.time() - runtime.telemetry.started, 1),
            "private": private(request),
        }

    @r.get("/nodes")
    async def nodes(request: Request) -> dict[str, Any]:
        return {"nodes": _node_rows(runtime, state, private(request))}

    @r.get("/tokens")
    async def tokens(request: Request) -> dict[str, Any]:
        return _tokens(runtime, private(request))

    @r.get("/prefill")
    async def prefill(request: Request) -> dict[str, Any]:
        return _prefill(runtime, state, private(request))

    @r.get("/groups")
    async def groups() -> dict[str, Any]:
        return {"groups": list(state.groups.values())}

    @r.post("/groups", status_code=201)
    def add_group(g: GroupIn, request: Request) -> dict[str, Any]:
        require_admin(request)
        return state.add_group(g)

    @r.delete("/groups/{gid}")
    def delete_group(gid: str, request: Request) -> Response:
        require_admin(request)
        if not state.delete_group(gid):
            raise APIError(404, f"no group {gid!r}", code="not_found")
        return Response(status_code=204)

    @r.post("/nodes/register", status_code=201)
    def register(request: Request) -> dict[str, Any]:
        require_admin(request)
        token, expires = state.issue_token()
        return {"pairing_token": token, "expires_at": expires, "single_use": True}

    @r.post("/pair")
    def pair(p: PairIn, request: Request) -> JSONResponse:
        client = request.client.host if request.client else None
        refusal = pairing_refusal(request.url.scheme, client, fleet_key is not None)
        if refusal:  # checked before redeeming: the token still works over TLS
            raise APIError(403, refusal, "permission_error", code="plaintext_pairing")
        if not state.redeem(p.token):
            raise APIError(403, "pairing token is unknown, used or expired", "permission_error")
        seeds = runtime.fleet.seeds() if runtime.fleet else []
        body: dict[str, Any] = {"seeds": seeds}
        if fleet_key is not None:
            body["fleet_key"] = fleet_key.decode("latin-1")
        return JSONResponse(body)

    return r
