"""Our own deadline is not the peer's failure (issue #37), on a real peer process.

A real ``kvmesh peer`` holds a chain; its data path runs through a FaultProxy
that holds the first byte of a response back for a while (a slow peer) or for
good (a hung one). The acquisition core (the head's and the vLLM connector's)
gives each fetch the requester's own budget:

- a budget shorter than the peer's delay runs out: fallback ``budget``, counted
  ``fetch_skipped:budget``, and the peer is not backed off (a later fetch with
  time enough gets the chain from it);
- a peer silent past its own per-peer timeout (the progress timeout, within a
  longer budget) is ``stalled``, and a killed one ``peer_unreachable``: both
  counted ``peer_failed:<reason>`` and backed off;
- a peer that never delivers, tried with budgets shorter than its progress
  timeout, uses them up without blame until its silences add up past that
  timeout: then it is ``stalled`` and backed off.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvmesh.blocks import BlockKeyer, PrefixKeys
from kvmesh.codec import Block, Layout
from kvmesh.mesh.fleet import Fleet
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.acquire import Acquirer, Fetched
from kvmesh.runtime.planner import STALL_S, Planner

from .helpers import small_card, synthetic_chain, wait_for
from .procs import FaultProxy, Peer, free_port

CARD = small_card(num_kv_heads=4, head_dim=64, block_tokens=16)  # 64 KiB blocks
TOKENS = [5 + i % 11 for i in range(160)]  # 10 blocks of 16
PROGRESS_S = 2.0  # MeshClient's progress timeout: how long a peer may stay silent
assert PROGRESS_S == STALL_S


class Counts(Counter[str]):
    def __call__(self, name: str, n: int = 1) -> None:
        self[name] += n


class Sink:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.add = self.blocks.append


@dataclass
class Slow:
    """A real peer holding the chain, its data path behind a proxy, and a head-side
    acquirer that found it."""

    peer: Peer
    proxy: FaultProxy
    me: NodeThread
    acq: Acquirer
    planner: Planner
    count: Counts
    keys: PrefixKeys

    @property
    def peer_id(self) -> str:
        return next(c.node_id for c in self.me.node.membership.live() if c.alias == "slow")

    def delay(self, seconds: float | None) -> threading.Timer | None:
        """Hold the peer's next response back ``seconds`` (None: until the test ends)."""
        self.proxy.stall_at(0)
        if seconds is None:
            return None
        timer = threading.Timer(seconds, self.proxy.stalled.clear)
        timer.daemon = True
        timer.start()
        return timer

    def fetch(self, budget: float) -> Fetched:
        local = self.acq.local(self.keys)
        found = self.acq.candidates(CARD, self.keys, 0)
        assert [h.alias for h in found.hits] == ["slow"], found
        return self.acq.fetch(
            Layout(CARD), found.hits, local, 0, 0, budget, lambda hit, keep: Sink(), owner=None
        )


@pytest.fixture
def slow(tmp_path) -> Iterator[Slow]:
    data_port = free_port()
    proxy = FaultProxy(data_port)
    peer = Peer(
        "--data-port",
        str(data_port),
        "--advertise-data-port",
        str(proxy.port),
        "--no-local-socket",  # every block byte through the proxy
        alias="slow",
        log_dir=tmp_path,
    )
    made: list[NodeThread] = []
    try:
        pub = NodeThread(NodeConfig(alias="pub", seeds=[peer.address], gossip_interval=0.2))
        made.append(pub)
        wait_for(lambda: len(pub.node.membership.live()) == 1, what="gossip")
        fleet = Fleet(pub)
        fleet.publish(CARD, synthetic_chain(CARD, TOKENS, tail=False))
        fleet.drain(10)
        me = NodeThread(
            NodeConfig(alias="me", seeds=[peer.address], roles=("head",), gossip_interval=0.2)
        )
        made.append(me)
        ns = CARD.namespace_hex
        wait_for(
            lambda: any(
                c.alias == "slow" and ns in c.namespaces for c in me.node.membership.live()
            ),
            what="the peer's card with the chain's namespace",
        )
        assert me.node.client.progress_timeout == PROGRESS_S
        count = Counts()
        planner = Planner(prefill_tps=1.0)  # computing is slow: every fetch is worth it
        keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
        yield Slow(peer, proxy, me, Acquirer(Fleet(me), planner, count), planner, count, keys)
    finally:
        proxy.stalled.clear()
        for n in made:
            n.close()
        peer.kill()
        proxy.close()


def _peer_failed(count: Counts) -> dict[str, int]:
    return {k: v for k, v in count.items() if k.startswith("peer_failed:")}


def test_a_budget_shorter_than_a_slow_peers_delay_blames_nobody(slow):
    timer = slow.delay(1.5)  # the peer answers, 1.5 s late
    out = slow.fetch(budget=0.5)
    assert out.hit is None and out.fallback == "budget"
    assert slow.count["fetch_skipped:budget"] == 1 and not _peer_failed(slow.count)
    assert slow.planner.usable(slow.peer_id) and slow.planner.backed_off() == {}
    assert timer is not None
    timer.join()

    slow.delay(1.0)  # as slow again, and this time the budget outlasts it: it was healthy
    out = slow.fetch(budget=10.0)
    assert out.hit is not None and out.hit.alias == "slow" and out.fallback is None
    assert len(out.blocks) == len(TOKENS) // CARD.block_tokens
    assert not _peer_failed(slow.count) and slow.planner.silent_s(slow.peer_id) == 0.0


def test_a_peer_silent_past_its_progress_timeout_is_backed_off(slow):
    slow.delay(None)  # hung: the budget is longer than the peer may stay silent
    out = slow.fetch(budget=2 * PROGRESS_S)
    assert out.hit is None and out.fallback == "stalled"
    assert _peer_failed(slow.count) == {"peer_failed:stalled": 1}
    assert "fetch_skipped:budget" not in slow.count
    assert not slow.planner.usable(slow.peer_id)


def test_a_killed_peer_is_backed_off_whatever_the_budget(slow):
    local = slow.acq.local(slow.keys)
    found = slow.acq.candidates(CARD, slow.keys, 0)
    slow.peer.kill()  # answered the lookup, then died
    slow.proxy.sever()
    out = slow.acq.fetch(Layout(CARD), found.hits, local, 0, 0, 0.5, lambda hit, keep: Sink())
    assert out.hit is None and out.fallback == "peer_unreachable"
    assert _peer_failed(slow.count) == {"peer_failed:peer_unreachable": 1}
    assert not slow.planner.usable(slow.peer_id)


def test_silent_overruns_add_up_to_a_stall(slow):
    """A hung data path behind budgets shorter than the progress timeout: each try
    alone blames nobody, but the silences add up; past the progress timeout the
    peer has kept us waiting longer than it may, and is backed off as stalled."""
    slow.delay(None)
    fallbacks = []
    while slow.planner.usable(slow.peer_id):
        assert len(fallbacks) < 20, fallbacks
        fallbacks.append(slow.fetch(budget=0.5).fallback)
    assert fallbacks[-1] == "stalled" and set(fallbacks[:-1]) == {"budget"}
    assert len(fallbacks) >= 4  # 0.5 s each: more than the progress timeout in all
    assert slow.count["fetch_skipped:budget"] == len(fallbacks) - 1
    assert _peer_failed(slow.count) == {"peer_failed:stalled": 1}
