"""A live session's continuation asks the fleet only while such lookups pay
(kvmesh/runtime/lookup_gate.py): the gate's rule, then the acquisition core on real
nodes over loopback, where a skipped lookup reaches no peer and a peer that comes to
hold more than the session is found again by the next exploring ask."""

from __future__ import annotations

import contextlib

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Layout
from kvmesh.mesh.fleet import Fleet
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.acquire import Acquirer
from kvmesh.runtime.lookup_gate import EXPLORE_EVERY, MIN_SEEN, WINDOW, LookupGate
from kvmesh.runtime.planner import Planner
from kvmesh.runtime.telemetry import Count, Source

from .helpers import small_card, synthetic_chain, wait_for

CARD = small_card(num_kv_heads=1, head_dim=8, block_tokens=16)
TOKENS = [3 + i % 13 for i in range(160)]  # 10 blocks of 16
COST_S = 0.005


def missed(gate: LookupGate, n: int) -> None:
    for _ in range(n):
        gate.learn(False, COST_S)


def test_nothing_is_skipped_before_the_gate_has_seen_enough_lookups():
    gate = LookupGate()
    for _ in range(MIN_SEEN):
        assert gate.ask(1e-9)
        gate.learn(False, COST_S)
    assert not gate.ask(1e-9)


def test_a_skip_needs_the_expected_saving_below_the_lookup_cost():
    gate = LookupGate()
    missed(gate, WINDOW)
    p = 1 / (WINDOW + 2)  # Laplace's rule over a window of misses
    assert not gate.ask(0.99 * COST_S / p)
    assert gate.ask(1.01 * COST_S / p)  # a large saving is always asked about


def test_after_a_run_of_skips_one_is_asked_and_what_it_finds_is_learned():
    gate = LookupGate()
    missed(gate, WINDOW)
    asks = [gate.ask(COST_S) for _ in range(2 * (EXPLORE_EVERY + 1))]
    assert asks == ([False] * EXPLORE_EVERY + [True]) * 2
    for _ in range(WINDOW // 2):  # the routing changed: lookups find more now
        gate.learn(True, COST_S)
    assert all(gate.ask(3 * COST_S) for _ in range(EXPLORE_EVERY + 1))


def test_a_decision_without_acting_changes_nothing():
    gate = LookupGate()
    missed(gate, WINDOW)
    assert not any(gate.ask(COST_S, act=False) for _ in range(3 * EXPLORE_EVERY))
    assert not gate.ask(COST_S)  # no exploration was owed by the plans


def test_a_lookup_that_is_slow_makes_skipping_worth_more():
    gate = LookupGate()
    missed(gate, WINDOW)
    saving = 2 * COST_S / (1 / (WINDOW + 2))
    assert gate.ask(saving)
    for _ in range(30):
        gate.learn(False, 4 * COST_S)  # the mean cost follows: ~4x
    assert not gate.ask(saving)


class Sink(list):
    def add(self, blk) -> None:
        self.append(blk)


class Counts(dict[str, int]):
    def __call__(self, name: str, n: int = 1) -> None:
        self[name] = self.get(name, 0) + n


def node(alias: str, seeds=()) -> NodeThread:
    return NodeThread(NodeConfig(alias=alias, seeds=list(seeds), gossip_interval=0.2, ttl=30))


def test_continuations_skip_the_fleet_until_a_peer_holds_more():
    """A head's session holds 6 of the prompt's 10 blocks; the peer holds the same 6
    (what the head published). Lookups find nothing more, so after the first
    ``MIN_SEEN`` they are skipped and the peer answers none of them; a plan
    (``/v1/cache/query``) still asks. Then another node serves the conversation and
    the peer holds all 10: the next exploring ask finds them."""
    chain = synthetic_chain(CARD, TOKENS, tail=False)
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(contextlib.closing(node("peer")))
        pf = Fleet(peer)
        pf.advertise(CARD)
        assert pf.keep(chain[:6]) == 6
        me = stack.enter_context(contextlib.closing(node("me", [peer.node.address])))
        wait_for(lambda: len(me.node.membership.live()) == 1, what="gossip")
        continue_then_explore(me, peer, pf, chain)


def continue_then_explore(me: NodeThread, peer: NodeThread, pf: Fleet, chain: list) -> None:
    count = Counts()
    acq = Acquirer(Fleet(me), Planner(prefill_tps=1e9), count)  # computing costs nothing
    keys = BlockKeyer(CARD.namespace, CARD.block_tokens).keys(TOKENS)
    held = 6 * CARD.block_tokens

    def continuation():
        return acq.acquire(Layout(CARD), keys, lambda *a: Sink(), session=held)

    def served() -> int:
        return peer.node.cache.counters["lookups"]

    outcomes = [continuation() for _ in range(MIN_SEEN + EXPLORE_EVERY)]
    assert all(o.source == Source.SESSION and o.tokens == held for o in outcomes)
    assert [o.sought for o in outcomes] == [True] * MIN_SEEN + [False] * EXPLORE_EVERY
    assert served() == MIN_SEEN and count[Count.LOOKUP_SKIPPED] == EXPLORE_EVERY
    plan = acq.plan(Layout(CARD), keys, session=held)
    assert plan.sought and served() == MIN_SEEN + 1

    assert pf.keep(chain[6:]) == 4  # a later turn was computed elsewhere
    found = continuation()  # the exploring ask
    assert found.sought and served() == MIN_SEEN + 2
    assert [h.tokens for h in found.offered] == [len(TOKENS)]
    forced = Acquirer(Fleet(me), Planner(prefill_tps=1e9, force="fetch"), Counts())
    forced.gate = acq.gate  # the same history: a forced fetch asks whatever it says
    got = forced.acquire(Layout(CARD), keys, lambda *a: Sink(), session=held)
    assert got.sought and got.source == Source.REMOTE and got.tokens == len(TOKENS)
