"""The one acquisition core (kvmesh/runtime/acquire.py) on real nodes over loopback.

A failed candidate gives way to the next one and is backed off; a successful
fetch teaches the planner the peer's bandwidth and the import bandwidth (issue
#27: ``observe_import`` is fed by real imports); a fetched chain that continues
the local one is kept; the give-back queue drops work beyond its slots; a stalled
peer process (SIGSTOP) costs one lookup deadline before the breaker skips it; and
each kind of failure has one reason, whoever acquires: the head's path, a paged
caller's (the vLLM connector's way of calling) and ``/v1/cache/query``'s plan.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import Counter

import pytest

from kvmesh.blocks import BlockKeyer, PrefixKeys
from kvmesh.codec import Block, Layout
from kvmesh.compat import CompatCard
from kvmesh.engine import Sampling
from kvmesh.errors import (
    ChecksumMismatch,
    IncompatibleCard,
    PeerTimeout,
    PeerUnavailable,
    Reason,
)
from kvmesh.mesh.fleet import Fleet
from kvmesh.mesh.hits import PeerHit
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.runtime.acquire import MIN_CACHE_BUDGET_S, Acquirer, PageLimits
from kvmesh.runtime.giveback import GiveBack
from kvmesh.runtime.planner import Planner, failure_reason
from kvmesh.runtime.telemetry import Source
from kvmesh.store import Match, Peek

from .helpers import small_card, synthetic_chain, wait_for
from .procs import Peer

CARD = small_card(num_kv_heads=4, head_dim=64, block_tokens=16)  # 64 KiB blocks: measured
TOKENS = [3 + i % 13 for i in range(160)]  # 10 blocks of 16


class Counts(Counter[str]):
    def __call__(self, name: str, n: int = 1) -> None:
        self[name] += n


class Sink:
    def __init__(self, into: list[Block]) -> None:
        self.add = into.append


def node(alias: str, seeds=(), **cfg) -> NodeThread:
    return NodeThread(
        NodeConfig(alias=alias, seeds=list(seeds), gossip_interval=0.2, ttl=30, **cfg)
    )


def holding(alias: str, blocks: list[Block]) -> NodeThread:
    n = node(alias)
    fleet = Fleet(n)
    fleet.advertise(CARD)
    assert fleet.keep(blocks) == len(blocks)
    return n


@pytest.fixture
def nodes():
    made: list[NodeThread] = []
    yield made
    for n in made:
        with contextlib.suppress(Exception):
            n.close()


def test_a_failed_candidate_gives_way_to_the_next_and_the_planner_learns(nodes):
    chain = synthetic_chain(CARD, TOKENS, tail=False)
    bad = holding("bad", chain)  # the longest hit: asked first
    good = holding("good", chain[:8])
    me = node("me", [bad.node.address, good.node.address], roles=("head",))
    nodes += [bad, good, me]
    wait_for(lambda: len(me.node.membership.live()) == 2, what="gossip")
    count = Counts()
    planner = Planner(prefill_tps=10.0)  # computing is slow: every fetch is worth it
    acq = Acquirer(Fleet(me), planner, count)
    keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
    local = acq.local(keys)
    assert local.tokens == 0
    found = acq.candidates(CARD, keys, 0)
    assert [h.alias for h in found.hits] == ["bad", "good"]
    bad.close()  # answered the lookup, then went away: its fetch fails
    nodes.remove(bad)

    got: list[Block] = []
    started: list[str] = []
    prior = planner.import_bandwidth
    done = acq.fetch(
        Layout(CARD),
        found.hits,
        local,
        0,
        0,
        acq.budget(len(TOKENS)),
        lambda hit, keep: Sink(got),
        lambda hit: started.append(hit.alias),
    )
    assert done.hit is not None and done.hit.alias == "good"
    assert started == ["bad", "good"]
    assert [b.key for b in done.blocks] == list(keys.blocks[:8]) and len(got) >= 8
    assert any(k.startswith("peer_failed:") for k in count), count
    assert not planner.usable(found.hits[0].node_id) and planner.usable(done.hit.node_id)
    assert planner.bandwidth[done.hit.node_id] > 0
    assert planner.import_bandwidth != prior  # learned from the real import (issue #27)
    # the fetched chain continues the (empty) local one: kept, served from here now
    assert acq.local(keys).tokens == 8 * CARD.block_tokens
    assert count["fetched_bytes"] == done.nbytes > 0


def test_imports_teach_the_planner_its_import_bandwidth():
    planner = Planner()
    est = planner.estimate(None, 100, 1 << 24).fetch_s
    chain = synthetic_chain(CARD, TOKENS, tail=False)

    def slow_copy(blk: Block) -> None:
        time.sleep(0.001)  # a slow importer: far below the 2 GB/s prior

    me = node("me")
    try:
        acq = Acquirer(Fleet(me), planner, Counts())
        for _ in range(3):
            assert acq.imported(chain, slow_copy) == len(chain)
    finally:
        me.close()
    assert planner.import_bandwidth < 2e9
    assert planner.estimate(None, 100, 1 << 24).fetch_s > est  # the choice moves with it


def test_the_budget_has_a_floor_and_the_fetch_deadline_as_its_ceiling(nodes):
    me = node("me", fetch_deadline=3.0)
    nodes.append(me)
    planner = Planner(prefill_tps=1e9)
    acq = Acquirer(Fleet(me), planner, Counts())
    assert acq.budget(10) == MIN_CACHE_BUDGET_S
    planner.prefill_tps = 1.0
    assert acq.budget(10) == 3.0


def test_the_give_back_queue_keeps_publishes_and_drops_beyond_its_slots(nodes):
    me = node("me")
    nodes.append(me)
    fleet = Fleet(me)
    fleet.advertise(CARD)
    count = Counts()
    pub = GiveBack(fleet, CARD, 1, count, publish=False)
    gate = threading.Event()
    chain = synthetic_chain(CARD, TOKENS, tail=False)

    def make() -> list[list[Block]]:
        gate.wait(10)
        return [chain, chain[:3]]

    try:
        assert pub.reserve()
        pub.submit(make, "published")
        assert not pub.reserve() and count["publish_dropped"] == 1  # the one slot is taken
        assert pub.pending() == 1
        gate.set()
        pub.flush(10)
        assert pub.pending() == 0 and count["published"] == len(chain)  # distinct blocks
        keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
        assert fleet.local_prefix(keys).tokens == len(TOKENS)
        assert pub.reserve()  # the slot came back
        pub.release()
    finally:
        gate.set()
        pub.close()


def test_a_stalled_peer_costs_one_lookup_deadline_then_is_skipped(nodes, tmp_path):
    """SIGSTOP on a real peer process: the first lookup waits out its deadline and
    backs the peer off; the next one does not wait for it at all."""
    peer = Peer(alias="stalled", log_dir=tmp_path)
    try:
        me = node("me", [peer.address], roles=("head",), lookup_deadline=0.3)
        nodes.append(me)
        wait_for(lambda: len(me.node.membership.live()) == 1, what="gossip")
        count = Counts()
        planner = Planner()
        acq = Acquirer(Fleet(me), planner, count)
        keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
        peer.signal(signal.SIGSTOP)
        first = acq.candidates(CARD, keys, 0)
        assert first.hits == [] and first.fallback is not None  # it waited, and failed
        failed = sum(v for k, v in count.items() if k.startswith("lookup_failed:"))
        assert failed == 1
        stalled = me.node.membership.live()[0].node_id
        assert not planner.usable(stalled)
        skipped = me.node.client.counters["lookup_skipped"]
        second = acq.candidates(CARD, keys, 0)
        # not waited for: no failure to report, asked only by a background probe
        assert second.hits == [] and second.fallback is None
        assert me.node.client.counters["lookup_skipped"] == skipped + 1
    finally:
        peer.kill()


def test_a_hybrids_hit_is_cut_to_its_last_state_checkpoint():
    from kvmesh.mesh.hits import PeerHit
    from kvmesh.mesh.proto import kvmesh_pb2 as pb
    from kvmesh.runtime.acquire import _importable

    card = small_card(
        num_layers=2,
        num_kv_heads=0,
        head_dim=0,
        layer_geometry=("kv:2x4", "state:float32[1,8,4]"),
        state_every=3,
    )
    infos = tuple(pb.BlockInfo(key=bytes([i]) * 32, nbytes=100) for i in range(5))
    b = card.block_tokens
    bare = PeerHit("p", "p", "a", "loopback", "e", infos, None, 5 * b)
    cut = _importable(card, bare)
    assert cut.blocks == infos[:3] and cut.tokens == 3 * b  # blocks 3 and 4 carry no state
    tail = pb.BlockInfo(key=b"t" * 32, nbytes=10)
    whole = PeerHit("p", "p", "a", "loopback", "e", infos, tail, 5 * b + 2)
    assert _importable(card, whole) is whole  # a tail carries the state at its end
    plain = small_card()
    assert _importable(plain, bare) is bare


# -- one vocabulary: every caller reports a failure kind under one reason ----------

KINDS = {
    "timeout": (TimeoutError("the deadline passed"), Reason.TIMEOUT),
    "peer timeout": (PeerTimeout("the peer's deadline passed"), Reason.TIMEOUT),
    "checksum": (ChecksumMismatch("a block's digest is wrong"), Reason.CHECKSUM_MISMATCH),
    "peer gone": (PeerUnavailable("connection refused"), Reason.PEER_UNREACHABLE),
    "incompatible": (IncompatibleCard("another card"), Reason.INCOMPATIBLE_CARD),
}


class FailingFleet:
    """One peer ("far") holding the prompt's whole blocks; its lookup (``stage``
    "lookup") or its fetch ("fetch") fails with ``error``, as the mesh reports it."""

    fetch_deadline = 30.0
    window_trim = True

    def __init__(self, card: CompatCard, keys: PrefixKeys, error: Exception, stage: str) -> None:
        infos = tuple(pb.BlockInfo(key=k, nbytes=64, digest=bytes(32)) for k in keys.blocks)
        tokens = len(infos) * card.block_tokens
        self.hit = PeerHit("far-id", "far", "127.0.0.1:1", "loopback", "e", infos, None, tokens)
        self.error, self.stage = error, stage

    def local_prefix(self, keys: PrefixKeys) -> Match:
        return Match((), None)

    def peek(self, keys: PrefixKeys) -> Peek:
        return Peek(0, 0, False)

    def compatible_peers(self, card: CompatCard) -> list:
        return []

    def keep(self, blocks, owner=None) -> int:
        return 0

    def lookup(self, card, keys, skip=None, on_failure=None, on_success=None):
        if self.stage == "lookup":
            reason = failure_reason(self.error)  # a peer's typed error, or the call's deadline
            if on_failure is not None:  # a plan's lookup teaches the planner nothing
                on_failure("far-id", reason)
            return [], [reason]
        return [self.hit], []

    def fetch(self, layout, hit, start, on_block, timeout, times=None, want=None):
        raise self.error


@pytest.mark.parametrize("stage", ["lookup", "fetch"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_failure_kind_has_one_reason_for_the_head_a_paged_caller_and_the_query(
    tiny_engine, kind, stage
):
    from kvmesh.api.cache_query import cached_prefix
    from kvmesh.runtime.head import HeadRuntime

    error, reason = KINDS[kind]
    planner = Planner(prefill_tps=1.0, default_rtt=0.0)  # computing is slow: fetch worth it
    rt = HeadRuntime(tiny_engine, None, publish=False, max_sessions=0, planner=planner)
    try:
        b = rt.card.block_tokens
        tokens = [3 + i % 50 for i in range(3 * b + 5)]
        keys = rt.keyer.keys(tokens)
        fleet = FailingFleet(rt.card, keys, error, stage)
        rt.acquirer = Acquirer(fleet, rt.planner, rt.telemetry.count)  # type: ignore[arg-type]
        query = cached_prefix(rt, tokens)
        out = rt.complete(tokens, Sampling(max_tokens=1))
        assert out.report is not None
        assert (out.report.source, out.report.fallback) == (Source.COMPUTE, reason)
        if stage == "lookup":  # the plan asks the fleet as the head does: the same reason
            assert (query["source"], query["fallback"]) == (Source.COMPUTE, reason)
        else:  # it would fetch (the plan acts on nothing: the failure is the fetch's)
            assert (query["source"], query["peer"], query["fallback"]) == ("remote", "far", None)
        # the connector's way of calling: whole pages, promised as a stream starts
        paged = Acquirer(
            FailingFleet(rt.card, keys, error, stage), Planner(1.0, default_rtt=0.0), Counts()
        )
        got = paged.acquire(
            Layout(rt.card),
            keys,
            lambda hit, held, keep: Sink([]),
            pages=PageLimits(len(keys.blocks)),
        )
        assert (got.source, got.fallback) == (Source.COMPUTE, reason)
        # then (the peer backed off, or failing its lookups) the plan and the head agree
        again = cached_prefix(rt, tokens)
        nxt = rt.complete(tokens, Sampling(max_tokens=1))
        assert nxt.report is not None
        assert (again["source"], again["fallback"]) == (nxt.report.source, nxt.report.fallback)
    finally:
        rt.close()
