"""The placement policy (kvmesh/mesh/placement.py) as plain functions, then as the
real nodes run it: gRPC and bulk servers on loopback in this process, twelve
cache peers, a head's client publishing and looking up."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Layout
from kvmesh.mesh import hits as hits_module
from kvmesh.mesh.metrics import NodeCollector
from kvmesh.mesh.placement import (
    MAX_REPLICAS,
    REPAIR_CHECKS,
    Policy,
    Popularity,
    Rate,
    by_load,
    place_index,
    probe_rank,
    rendezvous,
    repair_ranks,
    replica_ranks,
    replicas_for,
)

from .helpers import small_card, synthetic_chain
from .test_lookup_fanout import _asked, _fleet

IDS = [f"n{i}" for i in range(20)]
CARD = small_card()


def test_one_rendezvous_for_peers_and_simulation():
    assert hits_module.rendezvous is rendezvous  # no second copy
    owners = rendezvous(b"root", IDS, 3)
    assert owners == rendezvous(b"root", list(reversed(IDS)), 3)  # order-free
    assert owners != rendezvous(b"other root", IDS, 3)
    assert replica_ranks(b"root", IDS, 4) == rendezvous(b"root", IDS, 4)
    assert len(replica_ranks(b"root", [f"m{i}" for i in 300 * [0]], 10**6)) <= MAX_REPLICAS


def test_a_chain_goes_to_the_first_block_the_roots_owners_lack():
    assert place_index(10, 0) is None  # nothing there yet: the root's owners take it
    assert place_index(10, 3) == 3  # a shared preamble of 3: placed by block 3
    assert place_index(10, 10) is None  # all of it is there already
    assert place_index(10, 3, Policy(deep=False)) is None  # the old policy: the root


def test_replicas_grow_with_rate_and_shrink_when_cool():
    policy = Policy(window_s=2.0, hot_rate=2.0, per_replica_rate=2.0, max_replicas=8)
    assert [replicas_for(r, policy) for r in (0, 1.9, 2, 4.1, 10, 1000)] == [0, 0, 1, 3, 5, 8]
    pop = Popularity(policy, clock=lambda: 0.0, max_keys=2)
    t, got = 0.0, {}
    for rate in (1, 4, 16):  # lookups per second, 4 s each
        for _ in range(4 * rate):
            t += 1 / rate
            got[rate] = pop.hit(b"hot", t)
    assert got[1] <= 1 < got[4] < got[16] == 8  # grew with the rate
    assert pop.hot(t) == {b"hot": 8}
    assert pop.rate(b"hot", t + 1.0) < pop.rate(b"hot", t)  # cooling
    assert pop.hot(t + 2 * policy.window_s) == {}  # cold again: no extra holders
    pop.hit(b"a", t)
    pop.hit(b"b", t)
    assert pop.rate(b"hot", t) == 0.0  # bounded: the least recently seen is forgotten


def test_rate_is_a_sliding_window_seen_at_once():
    r = Rate(1.0, 0.0)
    for i in range(10):
        r.add(i / 10)
    assert 10 <= r.per_s(0.99) < 10.2  # the first window: over the time since it began
    assert 4 < r.per_s(1.5) < 6  # half of the last window still counts
    assert r.per_s(2.0) == 0 and r.per_s(5.0) == 0
    burst = Rate(2.0, 0.0)
    burst.add(0.01, 3)
    assert burst.per_s(0.01) == 3  # 3 at once: over half a window, not over 0.01 s


def test_probe_repair_and_choice():
    rng = random.Random(1)
    ranks = replica_ranks(b"hot", IDS, 5)
    assert probe_rank(ranks, ranks[:4], rng) == ranks[4]
    assert probe_rank(ranks, ranks, rng) is None
    fill = repair_ranks(ranks, ranks[2], rng)
    assert fill[0] == ranks[2] and sorted(fill) == sorted(ranks)  # the probed rank first
    many = replica_ranks(b"hot", [f"m{i}" for i in range(300)], MAX_REPLICAS)
    assert len(repair_ranks(many, many[0], rng)) == REPAIR_CHECKS
    load = {"a": 5.0, "b": 1.0, "c": 1.0}
    rtt = {"a": 0.1, "b": 2.0, "c": 1.0}
    assert by_load(["a", "b", "c"], load.__getitem__, rtt.__getitem__) == ["c", "b", "a"]
    assert by_load(["a", "b"], load.__getitem__, policy=Policy(by_load=False)) == ["a", "b"]


# -- the real nodes ------------------------------------------------------------------


def test_peers_place_deep_count_demand_and_spread_a_hot_prefix():
    async def run() -> None:
        nodes, head = await _fleet(12)
        client, by_id = head.client, {n.node_id: n for n in nodes}
        keyer = BlockKeyer(CARD.namespace, CARD.block_tokens)
        preamble = list(range(12))  # 3 shared blocks
        toks = [preamble + [100 + i] * 9 for i in range(3)]  # then 2 own blocks and a tail
        try:
            for t in toks:
                client.enqueue_publish(CARD, synthetic_chain(CARD, t))
                await client.drain()
            keys = [keyer.keys(t) for t in toks]
            root = rendezvous(keys[0].blocks[0], list(by_id), 1)[0]
            assert by_id[root].store.lookup(list(keys[0].blocks)).blocks  # the first: at the root
            for k in keys[1:]:  # the others: by their first block the root lacks (block 3)
                deep = rendezvous(k.blocks[3], list(by_id), 1)[0]
                assert len(by_id[deep].store.lookup(list(k.blocks)).blocks) == len(k.blocks)
            assert client.counters["publish_placed_deep"] == 2
            assert sum(n.cache.popularity.rate(keys[0].blocks[-1]) for n in nodes) == 0  # quiet

            # a lookup finds the chain in two rounds: root's owners (+1), then block 3's
            before = _asked(nodes)
            found, errors = await client.lookup(CARD, keys[2])
            assert not errors and found[0].tokens == len(toks[2])
            assert _asked(nodes) - before <= 2 * client.replicas + 2

            # the root's chain turns hot: its owner asks for replicas, a lookup probes one
            # rank, and a fetch from a holder gives the probed ranks copies
            for _ in range(40):
                found, _ = await client.lookup(CARD, keys[0])
            assert found[0].replicas >= 1 and client.counters["lookup_replica_probes"] >= 1
            assert client.load_of(root) >= 0  # a card's rate; a claim that is none is the busiest
            for bad in (-1.0, float("nan"), float("inf")):
                head.membership._members[root].card.load = bad
                assert client.load_of(root) == float("inf")
            head.membership._members[root].card.load = 0.0
            before = _asked(nodes)
            found, _ = await client.lookup(CARD, keys[0])
            assert _asked(nodes) - before <= 2 * client.replicas + 2
            for hit in found:  # fetch from each holder found (each may carry a repair)
                await client.fetch(Layout(CARD), hit)
            await client.drain()
            holders = [n for n in nodes if n.store.lookup(list(keys[0].blocks)).blocks]
            assert len(holders) >= 2 and client.counters["replica_repairs"] >= 1
            served = sum(n.cache.counters["fetches"] for n in nodes)
            assert served == len(found)

            # an operator sees who serves: fetches and bytes out on /metrics
            busiest = max(nodes, key=lambda n: n.cache.counters["fetches"])
            reg = CollectorRegistry()
            reg.register(NodeCollector(lambda: busiest))
            text = generate_latest(reg).decode()
            assert f"kvmesh_fetches_served_total {float(busiest.cache.counters['fetches'])}" in text
            assert (
                f"kvmesh_bytes_served_total {float(busiest.cache.counters['bytes_served'])}" in text
            )
            assert busiest.cache.counters["bytes_served"] > 0
            assert "kvmesh_fetch_rate " in text and "kvmesh_hot_prefixes " in text

            # a peer claiming that a prefix needs 10**9 holders is capped, and the lookup
            # still asks at most 2k + 2 peers
            by_id[root].cache.popularity.hit = lambda key, now=None: 10**9  # type: ignore[method-assign]
            before = _asked(nodes)
            found, _ = await client.lookup(CARD, keys[0])
            assert max(h.replicas for h in found) == MAX_REPLICAS
            assert _asked(nodes) - before <= 2 * client.replicas + 2
        finally:
            for n in [*nodes, head]:
                await n.stop(0)

    asyncio.run(run())


def test_the_simulation_runs_the_policy_and_meets_its_bounds(tmp_path):
    out = tmp_path / "scale_sim.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / "scale_sim.py"
    r = subprocess.run(
        [sys.executable, str(bench), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    after = [x for x in rows if x["policy"] == "after"]
    before = {(x["nodes"], x["k"]): x for x in rows if x["policy"] == "before"}
    assert all(x["max_fanout"] <= x["fanout_bound"] for x in rows)
    for x in after:
        old = before[x["nodes"], x["k"]]
        assert x["max_over_mean_served"] <= 5 < old["max_over_mean_served"]
        assert x["hit_rate"] > old["hit_rate"]
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra draws it
        assert out.with_suffix(".png").exists()
