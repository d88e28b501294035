"""Scale simulation (no processes): lookup fan-out, hit rate and load balance for
10-1,000 nodes, rendezvous placement with k replicas against asking every peer.

    python bench/scale_sim.py --json bench/results/scale_sim.json

Workload: requests arrive at random nodes; 30% share one hot system prompt
(8 blocks), the rest come from 200 conversations with their own prefixes, and a
request repeats an earlier prompt of its conversation with probability 0.7. A
computed prefix is published to the k rendezvous owners of its root block
(kvmesh's `rendezvous`), each with a byte budget (LRU). "Ask all" sends every
lookup to every node; "rendezvous" asks the k owners only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections import OrderedDict
from pathlib import Path

from kvmesh.mesh.hits import rendezvous


class Node:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.roots: OrderedDict[bytes, int] = OrderedDict()  # prefix root -> blocks held
        self.served = 0

    def holds(self, root: bytes) -> bool:
        if root in self.roots:
            self.roots.move_to_end(root)
            return True
        return False

    def put(self, root: bytes, blocks: int) -> None:
        self.roots[root] = blocks
        self.roots.move_to_end(root)
        while sum(self.roots.values()) > self.budget:
            self.roots.popitem(last=False)


def simulate(n_nodes: int, k: int, mode: str, requests: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    ids = [f"node-{i}" for i in range(n_nodes)]
    nodes = {i: Node(budget=400) for i in ids}
    hot = hashlib.sha256(b"hot system prompt").digest()
    convs = [hashlib.sha256(f"conv-{c}".encode()).digest() for c in range(200)]
    seen: list[bytes] = []
    hits = messages = 0
    for _ in range(requests):
        if rng.random() < 0.3:
            root, blocks = hot, 8
        elif seen and rng.random() < 0.7:
            root, blocks = rng.choice(seen), 32
        else:
            root, blocks = rng.choice(convs) + rng.randbytes(4), 32
            seen.append(root)
        asked = ids if mode == "all" else rendezvous(root, ids, k)
        messages += len(asked)
        holders = [n for n in asked if nodes[n].holds(root)]
        if holders:
            hits += 1
            nodes[rng.choice(holders)].served += 1
        else:
            for n in rendezvous(root, ids, k):
                nodes[n].put(root, blocks)
    served = [nd.served for nd in nodes.values()]
    mean = sum(served) / len(served)
    return {
        "nodes": n_nodes,
        "k": k,
        "mode": mode,
        "fanout_per_lookup": messages / requests,
        "hit_rate": hits / requests,
        "max_over_mean_served": (max(served) / mean) if mean else 0.0,
        "busiest_share": max(served) / max(1, sum(served)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/scale_sim.json")
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    rows = []
    for n in (10, 30, 100, 300, 1000):
        for mode, k in (("all", 1), ("rendezvous", 1), ("rendezvous", 2), ("rendezvous", 3)):
            r = simulate(n, k, mode, args.requests, seed=n)
            rows.append(r)
            print(f"{n:5d} nodes  {mode:10s} k={k}: fan-out {r['fanout_per_lookup']:7.1f}  "
                  f"hit {r['hit_rate']:.3f}  busiest node serves {r['busiest_share']:.1%} "
                  f"(max/mean {r['max_over_mean_served']:.1f})", flush=True)  # fmt: skip
    out = Path(args.json)
    out.write_text(json.dumps({"requests": args.requests, "results": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for mode, k in (("all", 1), ("rendezvous", 1), ("rendezvous", 3)):
            sel = [r for r in rows if r["mode"] == mode and r["k"] == k]
            label = "ask every peer" if mode == "all" else f"rendezvous k={k}"
            axes[0].plot(
                [r["nodes"] for r in sel],
                [r["fanout_per_lookup"] for r in sel],
                marker="o",
                label=label,
            )
            axes[1].plot(
                [r["nodes"] for r in sel],
                [r["busiest_share"] for r in sel],
                marker="o",
                label=label,
            )
        axes[0].set(
            xscale="log", yscale="log", xlabel="nodes", ylabel="lookup messages per request"
        )
        axes[1].set(xscale="log", xlabel="nodes", ylabel="share of hits served by the busiest node")
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
