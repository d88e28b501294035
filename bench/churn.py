"""A peer under churn of 10x its budget: stored bytes never exceed the budget,
and the process's RSS stays within the budget plus a fixed overhead.

    python bench/churn.py --json bench/results/churn.json [--budget-mib 256]
    python bench/churn.py --smoke --json /tmp/churn.json   # CI: 32 MiB budget, 2x through

Exits non-zero if the peer ever stored more than its budget.

Distinct 32-block prompts of demo-shaped KV (769 KiB blocks, ~25 MB a prompt) are
published to a real `kvmesh peer` process until 10x its budget has gone through.
After every publish: the peer's stored bytes (its gossiped card) and its RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from _common import demo_card, machine, run_main, spawn_peer, stop, synthetic_blocks

from kvmesh.mesh.client import MeshClient
from kvmesh.mesh.membership import Membership
from kvmesh.mesh.proto import kvmesh_pb2 as pb


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def run(pid: int, address: str, budget: int, factor: int) -> dict[str, object]:
    card = demo_card()
    m = Membership("churn", lambda: pb.CapabilityCard(alias="churn"))
    c = MeshClient(m, fetch_deadline=60)
    await c.exchange(address, None)
    peer = m.live()[0]
    base_rss = rss_bytes(pid)
    samples, sent, i = [], 0, 0
    blocks, _ = synthetic_blocks(card, 32 * card.block_tokens, seed=0)
    rejected = 0
    while sent < factor * budget:
        blocks, _ = synthetic_blocks(card, 32 * card.block_tokens, seed=i + 1)
        resp = await c.publish(peer, card, blocks[:32])
        rejected += resp.rejected
        sent += sum(b.nbytes for b in blocks[:32])
        await c.exchange(address, None)
        me = next(x for x in m.live() if x.node_id == peer.node_id)
        samples.append(
            {"sent": sent, "used": me.used_bytes, "entries": me.entries, "rss": rss_bytes(pid)}
        )
        i += 1
        if i % 20 == 0:
            print(
                f"sent {sent / 2**20:7.0f} MiB  stored {me.used_bytes / 2**20:6.1f} MiB  "
                f"rss {samples[-1]['rss'] / 2**20:6.1f} MiB",
                flush=True,
            )
    await c.close()
    max_used = max(s["used"] for s in samples)
    max_rss = max(s["rss"] for s in samples)
    return {
        "budget_bytes": budget,
        "sent_bytes": sent,
        "max_stored_bytes": max_used,
        "stored_within_budget": max_used <= budget,
        "rss_at_start_bytes": base_rss,
        "max_rss_bytes": max_rss,
        "rss_overhead_over_budget_bytes": max_rss - budget,
        "publish_rejections": rejected,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/churn.json")
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CI: a 32 MiB budget, 2x through")
    args = ap.parse_args()
    if args.smoke:
        args.budget_mib, args.factor = 32, 2
    budget = args.budget_mib << 20
    proc, address = spawn_peer("--budget", f"{args.budget_mib}MiB", "--gossip-interval", "30")
    # spawn_peer passes --budget 4GiB first; the later flag wins
    try:
        out = asyncio.run(run(proc.pid, address, budget, args.factor))
    finally:
        stop(proc)
    print(
        f"budget {budget / 2**20:.0f} MiB, {out['sent_bytes'] / 2**30:.2f} GiB sent: max stored "
        f"{out['max_stored_bytes'] / 2**20:.1f} MiB, max RSS {out['max_rss_bytes'] / 2**20:.1f} MiB "
        f"(RSS at start {out['rss_at_start_bytes'] / 2**20:.1f} MiB; overhead over budget "
        f"{out['rss_overhead_over_budget_bytes'] / 2**20:.1f} MiB)"
    )
    with open(args.json, "w") as fh:
        json.dump({"machine": machine(), "at": time.time(), **out}, fh, indent=1)
    if not out["stored_within_budget"]:
        sys.exit("the peer stored more than its budget")


if __name__ == "__main__":
    run_main(main)
