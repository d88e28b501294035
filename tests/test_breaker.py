"""The circuit breaker (kvmesh/runtime/planner.py) decays and blames the right party.

A fake clock drives the planner: failures age out over quiet time (so an isolated
failure never escalates), a peer failing on every try still reaches the maximum,
an answered lookup forgives lookup failures but not fetch failures, and the mesh
client reports answered lookups (probes included) for real nodes on loopback.
The score is bounded (thousands of failures stay at the maximum), and the one
fetch/lookup failure policy blames only a peer's own failures: not our own budget
running out (issue #37), unless a peer's silences add up past its progress timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.errors import CacheMiss, ChecksumMismatch, LocalBusy, PeerBusy, PeerTimeout
from kvmesh.mesh.bulk_wire import FetchStalled
from kvmesh.mesh.node import MeshNode, NodeConfig
from kvmesh.runtime.planner import BACKOFF_MAX_S, MAX_TRACKED, Attempt, Planner

from .helpers import small_card

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _planner() -> tuple[Planner, Clock]:
    clock = Clock()
    return Planner(clock=clock, backoff_first_s=1.0, half_life_s=60.0), clock


def test_one_isolated_failure_a_day_never_escalates():
    p, clock = _planner()
    for _ in range(30):
        assert p.peer_failed("a") < 1.001  # the first backoff, every time
        clock.advance(DAY)
        assert p.usable("a")


def test_a_peer_failing_on_every_try_reaches_the_maximum_and_stays_there():
    p, clock = _planner()
    backoffs = []
    for _ in range(12):
        backoffs.append(p.peer_failed("a"))
        assert not p.usable("a")
        clock.advance(backoffs[-1])  # retried the moment its backoff ends: no quiet time
        assert p.usable("a")
    assert backoffs[:4] == [1.0, 2.0, 4.0, 8.0]
    assert backoffs[-1] == BACKOFF_MAX_S
    assert backoffs == sorted(backoffs)


def test_failures_age_out_over_quiet_time():
    p, clock = _planner()
    for _ in range(10):  # escalated to the maximum
        clock.advance(p.peer_failed("a"))
    clock.advance(60.0)  # one half-life of quiet: the score halves (10 -> 5, then +1)
    halved = p.peer_failed("a")
    assert 1.0 < halved < BACKOFF_MAX_S
    clock.advance(halved + 10 * 60.0)  # ten half-lives: all but forgotten
    assert p.peer_failed("a") < 1.1


def test_time_spent_backed_off_is_not_quiet_time():
    """Failures reported while the peer is avoided (background probes) escalate."""
    p, clock = _planner()
    first = p.lookup_failed("a")
    clock.advance(first / 2)
    assert p.lookup_failed("a") > first


def test_an_answered_lookup_forgives_lookup_failures_at_once():
    p, clock = _planner()
    for _ in range(8):
        p.lookup_failed("a")
    assert not p.usable("a")
    p.lookup_succeeded("a")  # e.g. a background probe answered: it is back
    assert p.usable("a")
    assert p.lookup_failed("a") == 1.0  # a later failure starts over
    assert p.backed_off() == {"a": 1.0}


def test_an_answered_lookup_does_not_forgive_a_failed_fetch():
    """A peer may answer every lookup and still fail every fetch."""
    p, clock = _planner()
    p.peer_failed("a")
    backoff = p.peer_failed("a")
    p.lookup_succeeded("a")
    assert not p.usable("a")
    clock.advance(backoff)
    assert p.usable("a")
    assert p.peer_failed("a") == 4.0  # the fetch strikes stood


def test_a_fetch_success_forgives_everything_and_peers_are_apart():
    p, clock = _planner()
    p.peer_failed("a")
    p.lookup_failed("a")
    p.lookup_failed("b")
    p.peer_succeeded("a")
    assert p.usable("a") and not p.usable("b")
    assert set(p.backed_off()) == {"b"}


def test_a_quarantined_peer_stays_out_whatever_succeeds():
    p, _ = _planner()
    p.quarantine("a")
    p.lookup_succeeded("a")
    p.peer_succeeded("a")
    assert not p.usable("a")


def test_the_breaker_table_is_bounded():
    p, _ = _planner()
    for i in range(MAX_TRACKED + 10):
        p.peer_failed(f"p{i}")
    assert len(p.backed_off()) == MAX_TRACKED
    assert p.usable("p0")  # the least recently failed went first


def test_the_mesh_client_reports_answered_lookups_probes_included():
    """Real nodes: a lookup that asks the peer and a background probe of a skipped
    peer both report it answered, which forgives its lookup strikes."""
    card = small_card()
    keys = BlockKeyer(card.namespace, card.block_tokens).keys(list(range(40)))

    async def run() -> None:
        peer = MeshNode(NodeConfig(alias="peer", ttl=60, gossip_interval=60))
        head = MeshNode(NodeConfig(alias="head", roles=("head",), ttl=60, gossip_interval=60))
        for n in (peer, head):
            await n.start()
        try:
            await head.client.exchange(peer.address, peer.node_id)
            p, _ = _planner()
            p.lookup_failed(peer.node_id)
            answered: list[str] = []

            def ok(node_id: str) -> None:
                answered.append(node_id)
                p.lookup_succeeded(node_id)

            hits, errors = await head.client.lookup(card, keys, on_success=ok)
            assert (hits, errors) == ([], []) and answered == [peer.node_id]
            assert p.usable(peer.node_id)

            p.lookup_failed(peer.node_id)
            hits, errors = await head.client.lookup(
                card, keys, skip=lambda n: not p.usable(n), on_success=ok
            )
            assert (hits, errors) == ([], []) and head.client.counters["lookup_skipped"] == 1
            for _ in range(200):  # the probe's answer comes later, on this loop
                if len(answered) == 2:
                    break
                await asyncio.sleep(0.05)
            assert answered == [peer.node_id] * 2 and p.usable(peer.node_id)
        finally:
            for n in (head, peer):
                await n.stop(0.1)

    asyncio.run(run())


def test_thousands_of_failures_stay_at_the_maximum_without_overflowing():
    """A dead peer probed on every lookup fails while backed off, so it never has
    quiet time: its score must stop growing (2 ** 1024 would overflow)."""
    p, clock = _planner()
    for i in range(5000):  # the clock never moves
        fetch, lookup = p.peer_failed("a"), p.lookup_failed("a")
        if i >= 10:
            assert fetch == lookup == BACKOFF_MAX_S
    assert p.backed_off() == {"a": BACKOFF_MAX_S}
    clock.advance(BACKOFF_MAX_S + 10 * 60.0)  # ten half-lives of quiet: it is forgotten
    assert p.peer_failed("a") < 1.1


def test_a_backoff_first_at_the_maximum_is_the_maximum_every_time():
    p, _ = _planner()
    p.backoff_first_s = BACKOFF_MAX_S
    assert all(p.peer_failed("a") == BACKOFF_MAX_S for _ in range(3000))


class Counted(list):
    def __call__(self, name: str) -> None:
        self.append(name)


def test_fetch_failures_blame_only_the_peers_own():
    """One policy for every caller: busy and our own saturation are counted as
    skipped and blame nobody, a miss is ours, anything else backs the peer off."""
    p, _ = _planner()
    count = Counted()
    assert p.fetch_failed("a", PeerBusy("loaded"), count) == "busy"
    assert p.fetch_failed("a", LocalBusy("ours"), count, "alias-a") == "local_busy"
    assert p.fetch_failed("a", CacheMiss("gone"), count) == "miss"
    assert count == ["fetch_skipped:busy", "fetch_skipped:local_busy"]
    assert p.usable("a") and p.backed_off() == {}
    assert p.fetch_failed("a", TimeoutError(), count) == "timeout"
    assert p.fetch_failed("b", ChecksumMismatch("bad"), count) == "checksum_mismatch"
    assert p.fetch_failed("c", RuntimeError("bug"), count) == "error"
    assert count[2:] == [
        "peer_failed:timeout",
        "peer_failed:checksum_mismatch",
        "peer_failed:error",
    ]
    assert set(p.backed_off()) == {"a", "b", "c"}
    p.lookup_succeeded("a")  # an answered lookup does not forgive a failed fetch
    assert not p.usable("a")


def test_lookup_hooks_back_off_count_and_forgive():
    p, _ = _planner()
    count = Counted()
    hooks = p.lookup_hooks(count)
    assert not hooks["skip"]("a")
    hooks["on_failure"]("a", "timeout")
    assert count == ["lookup_failed:timeout"] and hooks["skip"]("a")
    hooks["on_success"]("a")
    assert not hooks["skip"]("a") and p.backed_off() == {}
    p.quarantine("q")
    assert hooks["skip"]("q")


def test_a_deadline_is_ours_only_when_our_budget_was_the_shorter_and_ran_to_its_end():
    ours = Attempt(limit_s=0.5, elapsed_s=0.51, delivered=0, peer_deadline_s=30.0)
    assert ours.ran_out(PeerTimeout("bulk stream deadline passed"))
    assert ours.ran_out(TimeoutError())  # the fleet's own wait for the call
    assert not ours.ran_out(FetchStalled("silent"))  # past its progress timeout: the peer's
    assert not ours.ran_out(ChecksumMismatch("bad"))
    assert not ours.ran_out(PeerBusy("loaded")) and not ours.ran_out(LocalBusy("ours"))
    early = Attempt(limit_s=0.5, elapsed_s=0.1, peer_deadline_s=30.0)
    assert not early.ran_out(PeerTimeout("the peer's own timeout"))  # before our deadline
    # a budget capped at the fetch deadline (less the lookup's time) is that deadline
    capped = Attempt(limit_s=1.49, elapsed_s=1.5, peer_deadline_s=1.5)
    assert not capped.ran_out(PeerTimeout("bulk stream deadline passed"))


def test_our_budget_running_out_is_counted_apart_and_blames_nobody():
    p, _ = _planner()
    count = Counted()
    ran_out = Attempt(limit_s=0.5, elapsed_s=0.5, delivered=1 << 16, peer_deadline_s=30.0)
    for _ in range(4):  # 2 s of our budgets: not yet past what a peer may keep us waiting
        assert p.fetch_failed("a", PeerTimeout("deadline"), count, "a", ran_out) == "budget"
    assert count == ["fetch_skipped:budget"] * 4
    assert p.usable("a") and p.backed_off() == {}
    assert p.bandwidth["a"] == pytest.approx((1 << 16) / 0.5)  # what it sent: it is slow
    # one block then a stall, or a trickle that never finishes: it kept us waiting
    assert p.fetch_failed("a", PeerTimeout("deadline"), count, "a", ran_out) == "stalled"
    assert not p.usable("a")
    past_its_deadline = Attempt(limit_s=30.0, elapsed_s=30.0, peer_deadline_s=30.0)
    assert p.fetch_failed("b", PeerTimeout("deadline"), count, "b", past_its_deadline) == "timeout"
    assert count[-1] == "peer_failed:timeout" and not p.usable("b")


def test_silent_overruns_add_up_decay_and_are_cleared_by_a_fetch_that_worked():
    p, clock = _planner()
    count = Counted()
    silent = Attempt(limit_s=0.5, elapsed_s=0.5, delivered=0, peer_deadline_s=30.0)
    timeout = PeerTimeout("deadline")
    reasons = [p.fetch_failed("a", timeout, count, "a", silent) for _ in range(5)]
    assert reasons == ["budget"] * 4 + ["stalled"]  # 2.5 s of silence: past the 2 s a peer may
    assert count[-1] == "peer_failed:stalled" and not p.usable("a")
    assert p.silent_s("a") == 0.0  # its strikes took over

    for _ in range(3):  # 1.5 s of silence, then an hour of quiet: forgotten
        p.fetch_failed("b", timeout, count, "b", silent)
    clock.advance(3600.0)
    assert p.fetch_failed("b", timeout, count, "b", silent) == "budget"
    assert 0.5 <= p.silent_s("b") < 0.51

    for _ in range(3):  # only a fetch that worked starts it over
        p.fetch_failed("c", timeout, count, "c", silent)
    p.peer_succeeded("c")
    assert p.silent_s("c") == 0.0 and p.usable("c")
