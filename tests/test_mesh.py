"""Integration: real peer processes on loopback, a head in this process."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import Sampling
from kvmesh.errors import LeaseExpired, StaleEpoch
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.runtime.head import Generation, HeadRuntime

from .helpers import wait_for
from .procs import FaultProxy, Peer, free_port

SAMPLING = Sampling(max_tokens=6)


def make_head(engine, seeds, alias="head", runtime=None, **cfg) -> HeadRuntime:
    node = NodeThread(
        NodeConfig(
            listen="127.0.0.1:0", seeds=list(seeds), alias=alias, gossip_interval=0.3, ttl=2, **cfg
        )
    )
    return HeadRuntime(engine, node, **(runtime or {}))


def close(head: HeadRuntime) -> None:
    head.close()
    if head.node:
        head.node.close()


def prompt(engine, n=200, salt=""):
    text = (salt + "Idle memory in a fleet becomes a shared prefill cache. ") * 20
    return engine.encode(text)[:n]


def published(engine, peers, tokens):
    """Cold request on a throwaway head; returns its greedy output once published."""
    h = make_head(engine, [p.address for p in peers], alias="publisher")
    try:
        wait_for(lambda: len(h.fleet.members()) >= len(peers), what="gossip")
        out = h.complete(tokens, SAMPLING)
        h.flush()
        return out.tokens
    finally:
        close(h)


def fresh_head(engine, peers, **cfg):
    h = make_head(engine, [p.address for p in peers], **cfg)
    ns, aliases = engine.card.namespace_hex, {p.alias for p in peers}
    wait_for(
        lambda: any(ns in c.namespaces and c.alias in aliases for c in h.fleet.members()),
        what="a compatible peer",
    )
    return h


def client_node(engine, peers) -> NodeThread:
    """A bare mesh node (no head) that sees a peer of ``engine``'s card: for the
    mesh client's own protocol."""
    node = NodeThread(
        NodeConfig(
            listen="127.0.0.1:0",
            seeds=[p.address for p in peers],
            alias="client",
            gossip_interval=0.3,
            ttl=2,
        )
    )
    ns = engine.card.namespace_hex
    try:
        wait_for(
            lambda: any(ns in c.namespaces for c in node.node.membership.live()),
            what="a compatible peer",
        )
    except BaseException:
        node.close()
        raise
    return node


@pytest.fixture
def peer(tmp_path):
    p = Peer(alias="p1", log_dir=tmp_path)
    yield p
    p.kill()


@pytest.fixture(scope="module")
def three_peers(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers")
    first = Peer(alias="p0", log_dir=d)
    rest = [Peer("--seed", first.address, alias=f"p{i}", log_dir=d) for i in (1, 2)]
    yield [first, *rest]
    for p in (first, *rest):
        p.kill()


async def _exchange_cards(address: str) -> list[pb.CapabilityCard]:
    import grpc

    from kvmesh.mesh.proto import kvmesh_pb2_grpc as pbg

    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pbg.MembershipStub(ch).Exchange(pb.ExchangeRequest(), timeout=2)
        return list(resp.cards)


def cards_seen(address: str) -> dict[str, pb.CapabilityCard]:
    return {c.alias: c for c in asyncio.run(_exchange_cards(address))}


def test_gossip_converges_and_dead_nodes_expire(tmp_path):
    a = Peer(alias="a", log_dir=tmp_path)
    b = Peer("--seed", a.address, alias="b", log_dir=tmp_path)
    c = Peer("--seed", a.address, alias="c", log_dir=tmp_path)
    # an observer whose TTL (60 s) outlasts every wait below: only a goodbye can
    # remove a node from its view in time (no wall-clock assertion needed)
    e = Peer("--seed", a.address, "--ttl", "60", alias="e", log_dir=tmp_path)
    d = None
    try:
        for p in (a, b, c):
            wait_for(
                lambda p=p: set(cards_seen(p.address)) >= {"a", "b", "c"},
                what=f"{p.alias} sees all",
            )
        seen = cards_seen(a.address)
        assert seen["b"].endpoints[0].interface == "loopback"
        assert seen["b"].epoch == b.epoch and "cache" in seen["b"].roles
        assert seen["b"].budget_bytes == 2 << 30
        old_epoch = b.epoch
        c.kill()  # SIGKILL: no goodbye, the card expires after its TTL (2 s)
        wait_for(lambda: "c" not in cards_seen(a.address), timeout=8, what="c expires")
        d = Peer("--seed", a.address, alias="d", log_dir=tmp_path)
        wait_for(lambda: "d" in cards_seen(e.address), what="d joins")
        assert d.stop() == 0  # SIGTERM: a clean stop says goodbye
        wait_for(lambda: "d" not in cards_seen(e.address), timeout=8, what="d's goodbye")
        b.restart()  # same node id (alias + address): a new epoch replaces the old card
        assert b.epoch != old_epoch
        wait_for(lambda: cards_seen(a.address)["b"].epoch == b.epoch, what="new epoch seen")
    finally:
        for p in (a, b, c, d, e):
            if p is not None:
                p.kill()


def test_remote_hit_is_exact_after_head_restart(tiny_engine, three_peers):
    toks = prompt(tiny_engine, 200, "exact ")
    cold = published(tiny_engine, three_peers, toks)
    h = fresh_head(tiny_engine, three_peers)
    try:
        out = h.complete(toks, SAMPLING)
        r = out.report
        assert r.source == "remote" and r.fallback is None
        assert r.reused_tokens == len(toks) and r.used_stored_logits
        assert out.tokens == cold
        assert r.bytes_fetched > 0
        # the imported KV equals local KV bit for bit, and so does the continuation
        blocks = h.fleet.store.longest_prefix(h.keyer.keys(toks)).blocks[:6]
        longer = toks + [65, 66]
        local = tiny_engine.resume(tiny_engine.prefill(toks), 192, longer)  # the publisher's own KV
        imported = tiny_engine.prefill(longer, blocks)
        assert imported.imported_tokens == 192
        assert torch.equal(local.logits, imported.logits)
    finally:
        close(h)


def test_prefix_extension_fetches_the_common_blocks(tiny_engine, three_peers):
    base = prompt(tiny_engine, 160, "ext ")
    published(tiny_engine, three_peers, base)
    h = fresh_head(tiny_engine, three_peers)
    try:
        longer = base + tiny_engine.encode(" and a brand new question at the end?")
        cold = tiny_engine.generate(tiny_engine.prefill(longer), SAMPLING)
        out = h.complete(longer, SAMPLING)
        assert out.report.source == "remote" and out.report.reused_tokens == 160, (
            out.report,
            h.telemetry.counters,
        )
        assert out.tokens == list(cold)
    finally:
        close(h)


def test_no_remote_call_during_decode(tiny_engine, three_peers):
    toks = prompt(tiny_engine, 180, "decode ")
    published(tiny_engine, three_peers, toks)
    h = fresh_head(tiny_engine, three_peers)

    def cache_rpcs():
        counted = h.fleet.counters()
        return sum(v for k, v in counted.items() if k.startswith("rpc:") and k != "rpc:Exchange")

    try:
        out = Generation()
        gen = h.generate(toks, Sampling(max_tokens=12, stop_on_eos=False), out)
        next(gen)
        at_first = cache_rpcs()
        assert at_first >= 2  # lookup + fetch happened before the first token
        for i, _ in enumerate(gen):
            assert cache_rpcs() == at_first
            if i == 9:  # the last token: decode is over, publishing has not started
                break
        assert len(out.tokens) == 11 and out.report.source == "remote", (
            out.report,
            h.fleet.counters(),
        )
    finally:
        close(h)


# -- faults: each falls back to local prefill with the same answer -------------


def _baseline(engine, toks):
    return list(engine.generate(engine.prefill(toks), SAMPLING))


def test_peer_killed_before_request(tiny_engine, peer):
    toks = prompt(tiny_engine, 150, "killed ")
    published(tiny_engine, [peer], toks)
    h = fresh_head(tiny_engine, [peer])
    try:
        peer.kill()
        out = h.complete(toks, SAMPLING)
        assert out.report.source == "compute" and out.report.fallback == "peer_unreachable"
        assert out.tokens == _baseline(tiny_engine, toks)
        assert h.telemetry.fallbacks["peer_unreachable"] == 1
    finally:
        close(h)


def test_hung_peer_hits_the_lookup_deadline(tiny_engine, peer):
    toks = prompt(tiny_engine, 150, "hung ")
    published(tiny_engine, [peer], toks)
    h = fresh_head(tiny_engine, [peer])
    try:
        peer.signal(signal.SIGSTOP)
        out = h.complete(toks, SAMPLING)
        # the lookup deadline ended the wait (how long it took belongs in bench/)
        assert h.fleet.counter("lookup_failed:timeout") == 1
        assert out.report.fallback == "timeout" and out.tokens == _baseline(tiny_engine, toks)
    finally:
        peer.signal(signal.SIGCONT)
        close(h)


PATHS = ["bulk", "grpc"]  # block bytes on the bulk data path, or (--no-bulk) over gRPC


@contextlib.contextmanager
def behind_proxy(engine, tmp_path, alias, path="bulk", **head_cfg):
    """A peer reached only through FaultProxies (gRPC and, on the bulk path, its data
    port), holding a published prompt, and a fresh head: yields (the proxy that
    carries block bytes, peer, head, prompt tokens)."""
    port, data_port = free_port(), free_port()
    proxy, data_proxy = FaultProxy(port), FaultProxy(data_port)
    if path == "bulk":  # a peer "across the network": no same-host socket around the proxy
        extra = (
            "--data-port",
            str(data_port),
            "--advertise-data-port",
            str(data_proxy.port),
            "--no-local-socket",
        )
    else:
        extra = ("--no-bulk",)
    p = Peer(
        "--advertise",
        f"{proxy.address},interface=ethernet",
        *extra,
        port=port,
        alias=alias,
        log_dir=tmp_path,
    )
    h = None
    carrier = data_proxy if path == "bulk" else proxy
    try:
        toks = prompt(engine, 250, alias + " ")
        published(engine, [p], toks)
        h = fresh_head(engine, [p], **head_cfg)
        yield carrier, p, h, toks
        assert h.fleet.counter("bytes_fetched") == 0  # every fetch failed
        assert (carrier.connections > 0) and (path == "bulk") == (data_proxy.connections > 0)
    finally:
        for x in (proxy, data_proxy):
            x.stalled.clear()
        if h is not None:
            close(h)
        p.kill()
        proxy.close()
        data_proxy.close()


@pytest.mark.parametrize("path", PATHS)
def test_corrupted_bytes_in_flight_are_caught(tiny_engine, tmp_path, path):
    with behind_proxy(tiny_engine, tmp_path, "corrupt", path) as (proxy, _, h, toks):
        proxy.corrupt_at(20000)
        out = h.complete(toks, SAMPLING)
        assert proxy.corrupted == 1
        assert out.report.fallback == "checksum_mismatch"
        assert out.tokens == _baseline(tiny_engine, toks)


@pytest.mark.parametrize("path", PATHS)
def test_peer_killed_mid_stream(tiny_engine, tmp_path, path):
    with behind_proxy(tiny_engine, tmp_path, "midkill", path) as (proxy, p, h, toks):
        proxy.stall_at(10000)
        threading.Thread(
            target=lambda: (proxy.stalled.wait(10), p.kill(), proxy.sever(), proxy.stalled.clear()),
            daemon=True,
        ).start()
        out = h.complete(toks, SAMPLING)
        assert out.report.fallback == "peer_unreachable"
        assert out.report.source == "compute" and out.tokens == _baseline(tiny_engine, toks)


@pytest.mark.parametrize("path", PATHS)
def test_hung_peer_mid_stream_times_out(tiny_engine, tmp_path, path):
    with behind_proxy(tiny_engine, tmp_path, "midhang", path, fetch_deadline=1.5) as (
        proxy,
        _,
        h,
        toks,
    ):
        # a real model's speed: the budget (its compute time) outlasts the deadline,
        # where demo-tiny's own measured speed would end the wait first ("budget")
        h.planner.prefill_tps = 100.0
        proxy.stall_at(10000)
        out = h.complete(toks, SAMPLING)
        assert out.report.fallback == "timeout"
        assert out.tokens == _baseline(tiny_engine, toks)


def test_stale_epoch_and_expired_lease(tiny_engine, tmp_path):
    port = free_port()  # a fixed data port too, so the restarted peer answers the old hit
    p = Peer("--data-port", str(free_port()), port=port, alias="epoch", log_dir=tmp_path)
    try:
        toks = prompt(tiny_engine, 150, "epoch ")
        published(tiny_engine, [p], toks)
        node = client_node(tiny_engine, [p])
        try:
            client, card = node.node.client, tiny_engine.card
            keys = BlockKeyer(card.namespace, card.block_tokens).keys(toks)
            hits, _ = node.call(client.lookup(card, keys))
            with pytest.raises(LeaseExpired):
                node.call(client.fetch(tiny_engine.layout, hits[0], lease_ttl=1e-6))
            p.restart()
            published(tiny_engine, [p], toks)
            with pytest.raises(StaleEpoch):
                node.call(client.fetch(tiny_engine.layout, hits[0]))
        finally:
            node.close()
    finally:
        p.kill()


def test_incompatible_card_is_a_miss(tiny_engine, peer):
    import dataclasses

    toks = prompt(tiny_engine, 150, "card ")
    published(tiny_engine, [peer], toks)
    node = client_node(tiny_engine, [peer])
    try:
        client, card = node.node.client, tiny_engine.card
        keyer = BlockKeyer(card.namespace, card.block_tokens)
        hits, _ = node.call(client.lookup(card, keyer.keys(toks)))
        assert hits and hits[0].tokens == len(toks)
        other = dataclasses.replace(card, quantization="int4")
        other_keys = BlockKeyer(other.namespace, other.block_tokens).keys(toks)
        hits, _ = node.call(client.lookup(other, other_keys))
        assert hits == []
        # and a block offered under the wrong card is refused by the peer
        blocks = tiny_engine.export(tiny_engine.prefill(toks), keyer)
        target = next(c for c in node.node.membership.live() if c.alias == peer.alias)
        resp = node.call(client.publish(target, other, blocks))
        assert resp.stored == 0 and resp.rejected == 1 and resp.reason == "incompatible_card"
    finally:
        node.close()


def test_mlx_head_gets_an_exact_remote_hit(three_peers):
    from kvmesh.engine import load_engine

    mlx = load_engine("demo-tiny", "mlx")
    toks = prompt(mlx, 170, "mlx ")
    cold = published(mlx, three_peers, toks)
    h = fresh_head(mlx, three_peers)
    try:
        out = h.complete(toks, SAMPLING)
        assert out.report.source == "remote" and out.report.used_stored_logits
        assert out.tokens == cold
    finally:
        close(h)
