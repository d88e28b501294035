"""``kvmesh status``: the fleet as one node sees it (one Membership.Exchange)."""

from __future__ import annotations

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


def describe(cards: list[pb.CapabilityCard], now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
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
            }
        )
    return rows
