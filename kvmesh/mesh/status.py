"""``kvmesh status``: the fleet as one node sees it (one Membership.Exchange).

Each member's row carries the links it measured fetching from its peers (its
card's ``links``: display only), at most ``MAX_SHOWN_LINKS``, peers named by
alias where the answer has their card; a number that is no number (a hostile
card's NaN or negative) shows as none. :func:`links_text` is one row's links as
one line (``peer 12.5 MB/s 50 ms ×3``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from .proto import kvmesh_pb2 as pb
from .proto import kvmesh_pb2_grpc as pbg
from .security import FleetAuth, TLSConfig, open_channel


async def fetch_cards(
    address: str, auth: FleetAuth | None, tls: TLSConfig | None, timeout: float = 5.0
) -> list[pb.CapabilityCard]:
    ch = open_channel(address, tls)
    method = "/kvmesh.v1.Membership/Exchange"
    async with ch:
        resp = await pbg.MembershipStub(ch).Exchange(
            pb.ExchangeRequest(),
            timeout=timeout,
            metadata=auth.call_metadata(method) if auth else None,
        )
    return list(resp.cards)


MAX_SHOWN_LINKS = 16


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) and v >= 0 else None


def _links(c: pb.CapabilityCard, aliases: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for link in list(c.links)[:MAX_SHOWN_LINKS]:
        rate, rtt = _finite(link.bytes_per_s), _finite(link.rtt_s)
        out.append(
            {
                "peer": aliases.get(link.node_id, link.node_id[:12]),
                "node_id": link.node_id[:64],
                "bytes_per_s": rate,
                "rtt_ms": None if rtt is None else round(rtt * 1e3, 2),
                "fetches": link.fetches,
            }
        )
    return out


def links_text(row: dict[str, Any]) -> str:
    """A row's links on one line: ``peer 12.5 MB/s 50 ms ×3, ...`` (– for none)."""
    parts = []
    for link in row.get("links", []):
        rate = "?" if link["bytes_per_s"] is None else f"{link['bytes_per_s'] / 1e6:.1f} MB/s"
        rtt = "" if link["rtt_ms"] is None else f" {link['rtt_ms']:.0f} ms"
        parts.append(f"{link['peer']} {rate}{rtt} ×{link['fetches']}")
    return ", ".join(parts) or "–"


def describe(cards: list[pb.CapabilityCard], now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    aliases = {c.node_id: c.alias for c in cards}
    rows = []
    for i, c in enumerate(cards):
        lookups = c.hits + c.misses
        rows.append(
            {
                "alias": c.alias,
                "node_id": c.node_id,
                "answering": i == 0,  # the first card is the queried node's own
                "roles": list(c.roles),
                "epoch": c.epoch,
                "version": c.version,
                "card_age_s": round(max(0.0, now - c.heartbeat), 2),
                "endpoints": [
                    {"address": e.address, "interface": e.interface, "priority": e.priority}
                    for e in sorted(c.endpoints, key=lambda e: e.priority)
                ],
                "budget_bytes": c.budget_bytes,
                "used_bytes": c.used_bytes,
                "entries": c.entries,
                "hit_ratio": round(c.hits / lookups, 3) if lookups else None,
                "models": list(c.card_summaries),
                "region": c.region,
                "links": _links(c, aliases),
            }
        )
    return rows
