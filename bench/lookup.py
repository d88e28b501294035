"""Lookup latency (p50 / p99) against the number of peers and of stored blocks.

    python bench/lookup.py --json bench/results/lookup.json
    python bench/lookup.py --smoke --json /tmp/lookup.json   # CI: 3 peers, 128 blocks

Real `kvmesh peer` processes on loopback; the real client's concurrent lookup
(metadata only) of 32-block prompts. Blocks use a tiny card so that 10^5 of them
fit in memory: lookup cost depends on the number of keys, not on KV size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from _common import demo_card, machine, run_main, spawn_peer, stop, synthetic_blocks

from kvmesh.blocks import BlockKeyer
from kvmesh.mesh.client import MeshClient
from kvmesh.mesh.membership import Membership
from kvmesh.mesh.proto import kvmesh_pb2 as pb

CARD = demo_card(layers=1, kv_heads=1, head_dim=4)
CHAIN = 32  # blocks per prompt
LOOKUPS = [300]  # per figure; fewer in --smoke


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def client_for(addresses: list[str]) -> MeshClient:
    m = Membership(f"bench-{time.time_ns()}", lambda: pb.CapabilityCard(alias="bench"))
    c = MeshClient(m, lookup_deadline=2.0)
    for a in addresses:
        await c.exchange(a, None)
    return c


async def fill(c: MeshClient, n_blocks: int, seed: int) -> list[list[int]]:
    prompts = []
    peers = c.membership.live()
    for j in range(n_blocks // CHAIN):
        blocks, toks = synthetic_blocks(CARD, CHAIN * CARD.block_tokens, seed=seed * 1_000_003 + j)
        for p in peers:
            await c.publish(p, CARD, blocks[:CHAIN])
        prompts.append(toks)
    for p in peers:  # learn that the peers now serve the namespace
        await c.exchange(p.endpoints[0].address, None)
    return prompts


async def measure(c: MeshClient, prompts: list[list[int]]) -> dict[str, float]:
    keyer = BlockKeyer(CARD.namespace, CARD.block_tokens)
    lat = []
    for _ in range(LOOKUPS[0]):
        keys = keyer.keys(random.choice(prompts))
        t0 = time.perf_counter()
        hits, errors = await c.lookup(CARD, keys)
        lat.append(time.perf_counter() - t0)
        assert hits and not errors and hits[0].tokens == CHAIN * CARD.block_tokens
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}


async def run(addresses: list[str], blocks: list[int], peers: list[int]) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    out: dict[str, list[dict]] = {"by_blocks": [], "by_peers": []}  # type: ignore[type-arg]
    c = await client_for(addresses[:1])
    stored, prompts = 0, []
    for n in blocks:
        prompts += await fill(c, n - stored, seed=n)
        stored = n
        r = {"stored_blocks": n, "peers": 1, **await measure(c, prompts)}
        out["by_blocks"].append(r)
        print(
            f"1 peer, {n:6d} blocks: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms", flush=True
        )
    await c.close()
    c = await client_for(addresses[1 : 1 + max(peers)])
    prompts = await fill(c, min(1000, max(blocks)), seed=7)
    await c.close()
    for p in peers:
        c = await client_for(addresses[1 : 1 + p])
        r = {"stored_blocks": CHAIN * len(prompts), "peers": p, **await measure(c, prompts)}
        out["by_peers"].append(r)
        print(
            f"{p:2d} peers, {r['stored_blocks']} blocks each: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms",
            flush=True,
        )
        await c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/lookup.json")
    ap.add_argument("--blocks", default="1000,10000,100000")
    ap.add_argument("--peers", default="1,2,4,8,16")
    ap.add_argument("--smoke", action="store_true", help="CI: 1-2 peers, 64-128 blocks")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.peers, LOOKUPS[0] = "64,128", "1,2", 30
    blocks = [int(x) for x in args.blocks.split(",")]
    peers = [int(x) for x in args.peers.split(",")]
    procs = [spawn_peer("--gossip-interval", "30") for _ in range(1 + max(peers))]
    try:
        out = asyncio.run(run([a for _, a in procs], blocks, peers))
    finally:
        for p, _ in procs:
            p.terminate()  # all stop at once; stop() reaps each
        for p, _ in procs:
            stop(p)
    with open(args.json, "w") as fh:
        json.dump({"machine": machine(), "blocks_per_lookup": CHAIN, **out}, fh, indent=1)


if __name__ == "__main__":
    run_main(main)
