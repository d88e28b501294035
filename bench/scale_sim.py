"""Scale simulation (no processes) of the placement policy the peers run: lookup
fan-out, hit rate and load per node for 10-1,000 nodes.

    python bench/scale_sim.py --json bench/results/scale_sim.json
    python bench/scale_sim.py --smoke --json /tmp/scale_sim.json   # CI: small, same checks

It runs the peers' own placement (:mod:`kvmesh.mesh.placement`), composition
included: :func:`locate` decides whom a lookup asks (the root's ``k + 1`` owners,
the ``k`` owners of the first block they lack, one replica rank of a hot prefix),
:func:`holders` which holder serves the fetch (the least loaded), :func:`place`
where a computed chain goes and :func:`offer` who gets it and who gets repair
copies: the same calls :class:`kvmesh.mesh.client.MeshClient` makes, with nodes
in memory where it sends RPCs. Each holder counts the lookups it answers
(:class:`Popularity`); its load is its fetches served per second over the
policy's window (the peers use the rate each card gossips, plus their own
fetches in flight). "before" runs the same calls under the policy without deep
placement, replicas or load-aware choice.

Workload: every node sends one request per simulated second. Every prompt starts
with one chat-template block shared by all prompts (``--distinct-roots``: none).
30% of requests are one hot system prompt (8 blocks, the template included); the
rest come from 200 conversation openings, each new prompt with its own 31 blocks
after the template, and a request repeats an earlier prompt with probability
0.7. A node holds 400 blocks (LRU by block, leaves first, as the store evicts).
A request is a hit when more than the template is found; otherwise it is
computed and published. Prints busiest/mean, hit rate and fan-out per row;
writes JSON and a PNG of load per node before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvmesh.mesh.placement import (
    REPAIR_FANOUT,
    Answer,
    Policy,
    Popularity,
    Rate,
    holders,
    locate,
    offer,
    place,
    ranking,
)

BEFORE = Policy(deep=False, replicate=False, by_load=False)
AFTER = Policy()
BUDGET_BLOCKS = 400


class Node:
    """A peer's store as blocks (LRU), its popularity counts and its served load."""

    def __init__(self, policy: Policy) -> None:
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.popularity = Popularity(policy, clock=lambda: 0.0)
        self.rate = Rate(policy.window_s, 0.0)
        self.served = 0

    def held(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` held (a lookup: the index only)."""
        n = 0
        while n < len(chain) and chain[n] in self.blocks:
            n += 1
        return n

    def put(self, chain: Sequence[bytes]) -> None:
        for key in reversed(chain):  # leaves older than their parents: evicted first
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > BUDGET_BLOCKS:
            self.blocks.popitem(last=False)

    def serve(self, chain: Sequence[bytes], now: float) -> None:
        for key in reversed(chain):
            self.blocks.move_to_end(key)
        self.served += 1
        self.rate.add(now)


def chain_of(own: bytes, blocks: int, template: bool = True) -> list[bytes]:
    """Chained block keys: the shared template block (unless ``template`` is
    false: ``--distinct-roots``), then ``own`` blocks."""
    keys, parent = [], b"namespace"
    for i in range(blocks):
        token = b"template" if i == 0 and template else own + i.to_bytes(4, "little")
        parent = hashlib.sha256(parent + token).digest()
        keys.append(parent)
    return keys


class Fleet:
    def __init__(self, n_nodes: int, k: int, policy: Policy, seed: int) -> None:
        self.ids = [f"node-{i}" for i in range(n_nodes)]
        self.nodes = {i: Node(policy) for i in self.ids}
        self.k, self.policy = k, policy
        self.rng = random.Random(seed)
        self.messages = self.max_messages = 0
        # memoized: the peers' rendezvous order is pure (same key, same answer)
        self.ranked = functools.lru_cache(maxsize=1 << 16)(ranking(self.ids))

    async def request(self, chain: list[bytes], now: float) -> bool:
        """One lookup, then the fetch from the holder the policy picks (with the
        repair copies it owes) or the publish of what was computed."""

        async def ask(who: Sequence[str], want: int) -> tuple[list[str], list[Answer]]:
            asked = list(who[:want])  # nodes in memory always answer
            return asked, [a for n in asked if (a := self.answer(n, chain, now)).held]

        found = await locate(chain, self.ranked, ask, self.k, self.policy, self.rng)
        fanout = len(found.asked)
        self.messages += fanout
        self.max_messages = max(self.max_messages, fanout)
        best = found.best
        if best > 1:  # more than the template: fetched from the least loaded holder
            load = {a.node: self.nodes[a.node].rate.per_s(now) for a in found.answers}
            order = holders(
                found.answers, load.__getitem__, None, self.policy, self.rng, found.shed
            )
            self.nodes[order[0]].serve(chain[:best], now)
            if order[0] in found.owed:
                await offer(
                    found.repair, REPAIR_FANOUT, best, *self.store(chain[:best]), missing=True
                )
        if best < len(chain):
            await self.publish(chain)
        return best > 1

    def answer(self, node: str, chain: list[bytes], now: float) -> Answer:
        """A node's lookup answer; the prefix it holds counts as demand."""
        held = self.nodes[node].held(chain)
        hot = self.nodes[node].popularity.hit(chain[held - 1], now) if held else 0
        return Answer(node, held, held, hot)

    def store(self, chain: list[bytes]) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``held`` and ``send`` for :func:`offer` of ``chain``: nodes in memory."""

        async def held(node: str) -> int:
            return self.nodes[node].held(chain)

        async def send(node: str, have: int) -> bool:
            self.nodes[node].put(chain)
            return True

        return held, send

    async def publish(self, chain: list[bytes]) -> None:
        """Where the peers' publisher puts a computed chain."""
        held, send = self.store(chain)
        where = await place(chain, self.ranked, held, self.policy)
        assert where is not None  # nodes in memory always answer
        await offer(where.targets, self.k, len(chain), held, send, where.known)


def simulate(
    n_nodes: int, k: int, policy: Policy, requests: int, seed: int, template: bool = True
) -> dict[str, object]:
    return asyncio.run(_simulate(n_nodes, k, policy, requests, seed, template))


async def _simulate(
    n_nodes: int, k: int, policy: Policy, requests: int, seed: int, template: bool
) -> dict[str, object]:
    rng = random.Random(seed)
    fleet = Fleet(n_nodes, k, policy, seed)
    hot = chain_of(b"hot system prompt", 8, template)
    seen: list[list[bytes]] = []
    hits = 0
    for i in range(requests):
        now = i / n_nodes  # each node sends one request per second
        if rng.random() < 0.3:
            chain = hot
        elif seen and rng.random() < 0.7:
            chain = rng.choice(seen)
        else:
            conv = f"conv-{rng.randrange(200)}".encode() + rng.randbytes(4)
            chain = chain_of(conv, 32, template)
            seen.append(chain)
        hits += await fleet.request(chain, now)
    served = sorted((nd.served for nd in fleet.nodes.values()), reverse=True)
    mean = sum(served) / len(served)
    return {
        "nodes": n_nodes,
        "k": k,
        "policy": "after" if policy.deep else "before",
        "fanout_per_lookup": fleet.messages / requests,
        "max_fanout": fleet.max_messages,
        "fanout_bound": 2 * k + 2,
        "hit_rate": hits / requests,
        "max_over_mean_served": (served[0] / mean) if mean else 0.0,
        "busiest_share": served[0] / max(1, sum(served)),
        "served_sorted": served,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/scale_sim.json")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--smoke", action="store_true", help="10 and 100 nodes, 3,000 requests")
    ap.add_argument(
        "--distinct-roots",
        action="store_true",
        help="no shared template block (each conversation its own root)",
    )
    args = ap.parse_args()
    sizes = (10, 100) if args.smoke else (10, 30, 100, 300, 1000)
    requests = 3000 if args.smoke else args.requests
    rows = []
    for n in sizes:
        for policy in (BEFORE, AFTER):
            for k in (1, 2, 3):
                r = simulate(n, k, policy, requests, n, not args.distinct_roots)
                rows.append(r)
                print(
                    f"{n:5d} nodes  {r['policy']:6s} k={k}: busiest/mean "
                    f"{r['max_over_mean_served']:6.1f}  hit {r['hit_rate']:.3f}  fan-out "
                    f"{r['fanout_per_lookup']:4.2f} (max {r['max_fanout']}, bound "
                    f"{r['fanout_bound']})",
                    flush=True,
                )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "served_sorted"} for r in rows]
    workload = "distinct roots" if args.distinct_roots else "shared chat template"
    out.write_text(
        json.dumps({"requests": requests, "workload": workload, "results": summary}, indent=1)
    )
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict[str, object]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    n = max(int(r["nodes"]) for r in rows)  # type: ignore[call-overload]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        if r["nodes"] == n and r["k"] in (1, 3):
            served = r["served_sorted"]
            axes[0].plot(
                range(1, len(served) + 1),
                served,  # type: ignore[arg-type]
                label=f"{r['policy']} k={r['k']}",
            )
    axes[0].set_yscale("symlog", linthresh=1)
    axes[0].set(
        xscale="log",
        ylim=(0, None),
        xlabel=f"node (busiest first, {n} nodes)",
        ylabel="fetches served",
    )
    for policy in ("before", "after"):
        sel = [r for r in rows if r["policy"] == policy and r["k"] == 1]
        axes[1].plot(
            [r["nodes"] for r in sel],
            [r["max_over_mean_served"] for r in sel],
            marker="o",
            label=f"{policy} k=1",
        )
    axes[1].set(xscale="log", yscale="log", xlabel="nodes", ylabel="busiest node / mean")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
