"""Per-peer link rates and the fetch-or-compute choice (kvmesh/runtime/planner.py,
kvmesh/runtime/links.py), on fake clocks: priors by interface until a peer is
measured, a compressed transfer never lowers a rate, the prefill curve
``a·n + b·n²`` is recovered from samples, the choice flips with prompt length at
12.5 MB/s (100 Mbit/s) and follows ``force``, and ``links.json`` round-trips,
expires and survives garbage. A real node's card, ``kvmesh status``'s rows and
the node's /metrics gauge carry what its planner measured.
"""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.mesh.hits import Transfer
from kvmesh.mesh.metrics import NodeCollector
from kvmesh.mesh.node import MAX_CARD_LINKS, NodeConfig, NodeThread
from kvmesh.mesh.proto import kvmesh_pb2 as pb
from kvmesh.mesh.status import describe, links_text
from kvmesh.runtime.links import (
    LINK_PRIORS,
    LINKS_FILE,
    LINKS_TTL_S,
    MAX_SAVED_LINKS,
    MIN_LINK_BYTES,
    fit_prefill,
)
from kvmesh.runtime.planner import Planner

MB = 1e6
RATE_100MBIT = 12.5 * MB


class Wall:
    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


def _planner(tmp_path=None, **kw) -> tuple[Planner, Wall]:
    wall = Wall()
    return Planner(home=tmp_path, wall=wall, **kw), wall


def _teach(p: Planner, peer: str, rate: float, n: int = 5, connect_s: float = 0.05) -> None:
    for _ in range(n):
        nbytes = int(rate)  # one second's worth
        p.observe_link(peer, wire_bytes=nbytes, raw_bytes=nbytes, link_s=1.0, connect_s=connect_s)


def test_an_unmeasured_peer_is_assumed_at_its_interfaces_prior():
    p, _ = _planner()
    for iface, rate in LINK_PRIORS.items():
        assert p.link_rate("never-seen", iface) == rate
    assert p.link_rate("never-seen", "") == LINK_PRIORS["unknown"]
    assert p.link_rate("never-seen", "carrier-pigeon") == LINK_PRIORS["unknown"]
    assert Planner(default_bandwidth=1e6).link_rate("x") == 1e6  # the old knob: unknown's prior
    # the prior is what a choice uses: ethernet is slower than loopback
    eth = p.choose("a", "ethernet", 1000, 50 << 20)
    lo = p.choose("b", "loopback", 1000, 50 << 20)
    assert not eth.measured and eth.rate == LINK_PRIORS["ethernet"] and eth.fetch_s > lo.fetch_s


def test_a_fetch_teaches_its_peer_and_small_ones_do_not():
    p, _ = _planner()
    p.observe_link("a", wire_bytes=MIN_LINK_BYTES - 1, raw_bytes=1, link_s=1e-3, connect_s=0.02)
    assert p.link_rate("a", "ethernet") == LINK_PRIORS["ethernet"]  # latency, not the link
    assert p.link("a")["rtt_s"] == pytest.approx(0.02)  # the connect still teaches the RTT
    _teach(p, "a", RATE_100MBIT, n=20)
    assert p.link_rate("a", "loopback") == pytest.approx(RATE_100MBIT)  # measured beats prior
    assert p.link_rate("b", "ethernet") == LINK_PRIORS["ethernet"]  # per peer
    assert p.bandwidth == {"a": pytest.approx(RATE_100MBIT)}
    c = p.choose("a", "loopback", 100, 10 << 20)
    assert c.measured and c.rtt_s == pytest.approx(0.05, rel=0.1)


def test_a_compressed_transfer_never_lowers_a_rate():
    p, _ = _planner()
    _teach(p, "a", 50 * MB)
    rng = random.Random(7)
    before = p.link_rate("a")
    for _ in range(200):
        wire = rng.randrange(MIN_LINK_BYTES, 64 << 20)
        p.observe_link(
            "a",
            wire_bytes=wire,
            raw_bytes=int(wire * rng.uniform(1.05, 2.0)),
            link_s=wire / rng.uniform(1 * MB, 80 * MB),
            connect_s=0.01,
        )
        assert p.link_rate("a") >= before
        before = p.link_rate("a")
    assert before > 50 * MB  # the fast ones did raise it
    # an unmeasured peer's compressed transfer below its prior leaves the prior
    p.observe_link("b", wire_bytes=1 << 20, raw_bytes=2 << 20, link_s=1.0, connect_s=0.0)
    assert p.link_rate("b", "ethernet") == LINK_PRIORS["ethernet"]
    # an uncompressed one does lower it: the link is the only bound
    p.observe_link("a", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=1.0)
    assert p.link_rate("a") < before


@pytest.mark.parametrize("a,b", [(2e-4, 3e-9), (1e-3, 0.0), (0.0, 5e-8), (5e-5, 2e-7)])
def test_the_prefill_fit_recovers_a_known_curve(a, b):
    rng = random.Random(11)
    lengths = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768] * 3
    samples = [(n, (a * n + b * n * n) * rng.uniform(0.98, 1.02)) for n in lengths]
    fa, fb = fit_prefill(samples)
    assert fa >= 0 and fb >= 0
    for n in (100, 1000, 16384, 32768):  # the predictions, not just the coefficients
        assert fa * n + fb * n * n == pytest.approx(a * n + b * n * n, rel=0.05)
    if a:
        assert fa == pytest.approx(a, rel=0.05)
    if b:
        assert fb == pytest.approx(b, rel=0.05)
    # the planner keeps the last 32 and uses the curve: a linear rate from short
    # prompts would miss the long one
    p, _ = _planner()
    for n, s in samples:
        p.observe_prefill(n, s)
    truth = a * 32768 + b * 32768**2
    assert p.compute_s(32768) == pytest.approx(truth, rel=0.05)
    assert p.compute_s(1000, have=31768) == pytest.approx(truth - (a * 31768 + b * 31768**2), 0.1)


def test_the_fit_stays_sane_on_degenerate_samples():
    assert fit_prefill([]) is None
    a, b = fit_prefill([(1000, 0.5)] * 5)  # one length: a line through it
    assert (a, b) == (pytest.approx(5e-4), 0.0)
    # a curve bending down (overheads at short lengths): never negative
    a, b = fit_prefill([(100, 0.2), (1000, 0.5), (10000, 2.0)])
    assert a >= 0 and b >= 0 and a * 10000 + b * 1e8 > 0
    p, _ = _planner(prefill_tps=1000.0)
    assert p.compute_s(2000) == pytest.approx(2.0)  # the prior, before any sample
    p.observe_prefill(8, 5.0)  # too short to teach
    assert p.compute_s(2000) == pytest.approx(2.0) and p.prefill_tps is None
    p.prefill_tps = 10.0  # pinned (tests and operators): linear at that rate
    assert p.compute_s(100) == pytest.approx(10.0)


def test_the_choice_flips_with_prompt_length_at_100mbit():
    """At 12.5 MB/s with 24 KB of KV a token (a small model's, fetched whole) and
    a CPU's prefill (1 ms a token plus attention growing with n²): a short prompt
    is computed, a long one fetched, each the faster by the planner's numbers."""
    p, _ = _planner()
    _teach(p, "peer", RATE_100MBIT, n=10, connect_s=0.05)
    a, b = 1e-3, 1e-7
    for n in (256, 512, 1024, 2048, 4096, 8192):
        p.observe_prefill(n, a * n + b * n * n)
    per_token = 24_000
    short = p.choose("peer", "ethernet", 1024, 1024 * per_token)
    long = p.choose("peer", "ethernet", 16384, 16384 * per_token)
    assert not short.fetch and short.compute_s < short.fetch_s
    assert long.fetch and long.fetch_s < long.compute_s
    assert short.rate == pytest.approx(RATE_100MBIT) and short.measured
    # the truth at 16k: fetch ~31.5 s, compute ~43 s; the estimates are within 5%
    assert long.fetch_s == pytest.approx(0.05 + 16384 * per_token / RATE_100MBIT, rel=0.05)
    assert long.compute_s == pytest.approx(a * 16384 + b * 16384**2, rel=0.05)
    # fewer bytes on the wire (a window trim): the short prompt is fetched too
    trimmed = p.choose("peer", "ethernet", 1024, 1024 * per_token, wire_bytes=1024 * 2_000)
    assert trimmed.fetch
    assert p.link("peer")["last_choice"] == "fetch"
    # a peer busy serving others is slower: rate / (1 + load × its fetch time + ours)
    busy = p.choose("peer", "ethernet", 16384, 16384 * per_token, load=2.0, inflight=1)
    assert busy.rate == pytest.approx(RATE_100MBIT / (1 + 2.0 * 1.0 + 1)) and not busy.fetch
    # the old interface agrees
    assert p.estimate("peer", 1024, 1024 * per_token).worth_it is False
    assert p.estimate("peer", 16384, 16384 * per_token).worth_it is True


@pytest.mark.parametrize("force", ["fetch", "compute"])
def test_force_overrides_the_choice_not_the_estimates(force):
    free, _ = _planner()
    forced, _ = _planner(force=force)
    for p in (free, forced):
        _teach(p, "peer", RATE_100MBIT)
    for n in (10, 100_000):
        c, f = free.choose("peer", "", n, n * 1000), forced.choose("peer", "", n, n * 1000)
        assert f.fetch is (force == "fetch") and (f.fetch_s, f.compute_s) == (
            c.fetch_s,
            c.compute_s,
        )
        assert forced.estimate("peer", n, n * 1000).worth_it is (force == "fetch")
    with pytest.raises(ValueError):
        Planner(force="sometimes")


def test_links_json_round_trips_and_expires(tmp_path):
    p, wall = _planner(tmp_path, model="ns-a")
    _teach(p, "peer-1", RATE_100MBIT)
    p.observe_link("peer-2", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=0.01, interface="wifi")
    for n in (100, 1000, 4000):
        p.observe_prefill(n, 1e-3 * n)
    p.flush()
    doc = json.loads((tmp_path / LINKS_FILE).read_text())
    assert set(doc["links"]) == {"peer-1", "peer-2"} and list(doc["prefill"]) == ["ns-a"]
    assert not [f for f in tmp_path.iterdir() if f.name != LINKS_FILE]  # no temporary left
    assert (tmp_path / LINKS_FILE).stat().st_mode & 0o777 == 0o600  # this user's alone
    again = Planner(home=tmp_path, wall=wall, model="ns-a")
    assert again.link_rate("peer-1") == pytest.approx(RATE_100MBIT)
    assert again.link("peer-1")["rtt_s"] == pytest.approx(0.05)
    assert again.link("peer-1")["fetches"] == 5
    assert again.link_rate("peer-2", "wifi") == pytest.approx((1 << 20) / 0.01)
    assert again.compute_s(2000) == pytest.approx(2.0, rel=0.01)
    other = Planner(home=tmp_path, wall=wall, model="ns-b")  # another model's samples: not ours
    assert other.compute_s(2000) == pytest.approx(20.0)
    # a day later, what was learned is forgotten: priors again
    wall.now += LINKS_TTL_S + 1
    later = Planner(home=tmp_path, wall=wall, model="ns-a")
    assert later.link_rate("peer-1", "ethernet") == LINK_PRIORS["ethernet"]
    assert later.compute_s(2000) == pytest.approx(20.0) and later.links() == []
    assert p.link_rate("peer-1", "ethernet") == LINK_PRIORS["ethernet"]  # in memory too


def test_a_fresh_planner_waits_by_its_probe_until_a_prefill_is_measured(tmp_path):
    """The cold time a fetch's wait is measured against: the prior alone at first,
    the start-up probe's rate once probed, the measured curve once a prefill is
    measured (the probe forgotten), and a rate said on the command line over both."""
    p, _ = _planner(tmp_path)
    assert p.probe_s is None and p.cold_s(2000) == pytest.approx(p.compute_s(2000)) == 20.0
    p.observe_probe(64, 0.0064)  # 100 microseconds a token
    assert p.probe_s == pytest.approx(1e-4) and p.cold_s(2000) == pytest.approx(0.2)
    assert p.compute_s(2000) == pytest.approx(20.0)  # the fetch-or-compute choice: unchanged
    for n in (100, 1000, 4000):
        p.observe_prefill(n, 1e-3 * n)
    assert p.probe_s is None and p.cold_s(2000) == pytest.approx(2.0, rel=0.01)
    q, _ = _planner(tmp_path / "q")
    q.observe_probe(64, 0.0064)
    q.prefill_tps = 50.0
    assert q.probe_s is None and q.cold_s(2000) == pytest.approx(40.0)


def test_a_second_planner_merges_into_the_file_and_it_stays_bounded(tmp_path):
    a, wall = _planner(tmp_path)
    for i in range(MAX_SAVED_LINKS + 40):
        wall.now += 1
        a.observe_link(f"p{i}", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=0.01)
    a.flush()
    b = Planner(home=tmp_path, wall=wall)
    wall.now += 1
    b.observe_link("late", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=0.02)
    b.flush()
    links = json.loads((tmp_path / LINKS_FILE).read_text())["links"]
    assert len(links) == MAX_SAVED_LINKS and "late" in links and "p0" not in links
    assert f"p{MAX_SAVED_LINKS + 39}" in links  # the newest kept


GARBAGE = [
    b"not json at all",
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
    b'{"version": 2, "links": {}}',
    b'{"version": 1, "links": [1, 2]}',
    b"[" * 100_000,
    b'{"version": 1, "links": {"x": 1}, "prefill": "no"}',
]


def plant(home, raw: bytes, mode: int = 0o600) -> None:
    """A links file as another program would leave it (mode 600 unless told)."""
    path = home / LINKS_FILE
    path.write_bytes(raw)
    path.chmod(mode)


@pytest.mark.parametrize("raw", GARBAGE, ids=range(len(GARBAGE)))
def test_a_garbage_links_file_is_ignored_with_a_warning(tmp_path, caplog, raw):
    plant(tmp_path, raw)
    with caplog.at_level(logging.WARNING, logger="kvmesh.planner"):
        p, _ = _planner(tmp_path)
    assert p.links() == [] and p.link_rate("x", "wifi") == LINK_PRIORS["wifi"]
    assert any("ignoring" in r.getMessage() for r in caplog.records)
    _teach(p, "x", RATE_100MBIT)
    p.flush()  # and it is replaced by a good one
    assert Planner(home=tmp_path, wall=p._book.wall).link_rate("x") == pytest.approx(RATE_100MBIT)


def test_bad_entries_are_skipped_and_good_ones_kept(tmp_path):
    wall = Wall()
    good = {"bytes_per_s": 1e7, "rtt_s": 0.01, "fetches": 3, "at": wall.now, "interface": "wifi"}
    bad = [
        {**good, "bytes_per_s": float("nan")},
        {**good, "bytes_per_s": -5},
        {**good, "bytes_per_s": 1e300},
        {**good, "bytes_per_s": True},
        {**good, "rtt_s": "fast"},
        {**good, "fetches": -1},
        {**good, "at": wall.now + 10 * LINKS_TTL_S},  # from the future
        {**good, "interface": "<script>"},
        {**good, "bytes_per_s": 10**400},  # no float holds it
        {**good, "at": -(10**400)},
        {**good, "rtt_s": 10**400},
        {**good, "link_s": 10**400},
        {**good, "fetches": 10**400},
        "a string",
    ]
    doc = {
        "version": 1,
        "links": {"good": good, **{f"bad{i}": b for i, b in enumerate(bad)}, "y" * 500: good},
        "prefill": {
            "m": {"at": wall.now, "samples": [[100, "x"]]},
            "big-n": {"at": wall.now, "samples": [[10**400, 1.0]]},
            "big-at": {"at": 10**400, "samples": [[100, 1.0]]},
        },
    }
    plant(tmp_path, json.dumps(doc).replace('"NaN"', "NaN").encode())
    p = Planner(home=tmp_path, wall=wall, model="m")
    assert [r["node_id"] for r in p.links()] == ["good"]
    assert p.link_rate("good") == 1e7 and p.compute_s(100) == pytest.approx(1.0)
    for model in ("big-n", "big-at"):  # a head of those models starts, on its prior
        assert Planner(home=tmp_path, wall=wall, model=model).compute_s(100) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o620])
def test_a_links_file_others_may_read_or_write_is_ignored(tmp_path, caplog, mode):
    """What the planner reads steers every fetch: like the tenant secret, it is read
    only when it is this user's alone (a planted 1 B/s would make a head compute
    everything for a day); the next write replaces it with one that is."""
    wall = Wall()
    doc = {"version": 1, "links": {"fast": {"bytes_per_s": 1.0, "at": wall.now}}}
    plant(tmp_path, json.dumps(doc).encode(), mode)
    with caplog.at_level(logging.WARNING, logger="kvmesh.planner"):
        p = Planner(home=tmp_path, wall=wall)
    assert p.links() == [] and p.link_rate("fast", "loopback") == LINK_PRIORS["loopback"]
    assert any("chmod 600" in r.getMessage() for r in caplog.records)
    _teach(p, "fast", RATE_100MBIT)
    p.flush()
    assert (tmp_path / LINKS_FILE).stat().st_mode & 0o777 == 0o600
    assert Planner(home=tmp_path, wall=wall).link_rate("fast") == pytest.approx(RATE_100MBIT)


def test_a_change_is_saved_behind_a_timer(tmp_path):
    p, _ = _planner(tmp_path)
    _teach(p, "peer", RATE_100MBIT, n=1)
    path = tmp_path / LINKS_FILE
    import time

    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the first change is written at once, off this thread
    assert "peer" in json.loads(path.read_text())["links"]


def test_transfer_keeps_its_old_constructor():
    t = Transfer("peer", 1000, 0.5, 2, 1.0)
    assert (t.wire_bytes, t.raw_bytes, t.codec, t.trimmed) == (0, 0, "", False)
    t = Transfer("peer", 1000, 0.5, 2, 1.0, wire_bytes=400, raw_bytes=1000, codec="zstd")
    assert t.wire_bytes == 400 and t.gbps == pytest.approx(2e-6)


def test_a_nodes_card_status_and_metrics_carry_its_links():
    """A real node whose planner measured 20 peers: its card carries the newest
    16, ``kvmesh status``'s rows name them (by alias where a card says), and its
    /metrics has one gauge a peer."""
    p, wall = _planner()
    for i in range(20):
        wall.now += 1
        _teach(p, f"peer{i:02d}", (i + 1) * MB, n=1, connect_s=0.001 * (i + 1))
    node = NodeThread(NodeConfig(listen="127.0.0.1:0", alias="measurer", bulk=False))
    try:
        node.node.link_rates = p.links
        card = node.node._card()
        assert len(card.links) == MAX_CARD_LINKS
        assert card.links[0].node_id == "peer19" and card.links[0].bytes_per_s == 20 * MB
        assert card.links[0].rtt_s == pytest.approx(0.02) and card.links[0].fetches == 1
        card.node_id = "measurer-id"
        other = pb.CapabilityCard(node_id="peer19", alias="the-fast-one")
        rows = describe([card, other])
        shown = rows[0]["links"]
        assert shown[0]["peer"] == "the-fast-one" and shown[0]["rtt_ms"] == pytest.approx(20.0)
        assert shown[1]["peer"] == "peer18" and rows[1]["links"] == []
        assert links_text(rows[0]).startswith("the-fast-one 20.0 MB/s 20 ms ×1, peer18 19.0 MB/s")
        reg = CollectorRegistry()
        reg.register(NodeCollector(lambda: node.node))
        text = generate_latest(reg).decode()
        assert 'kvmesh_link_bytes_per_second{peer="peer00"} 1e+06' in text
        assert text.count("kvmesh_link_bytes_per_second{") == 20
        node.node.link_rates = lambda: 1 / 0  # a failing source never costs the card
        assert len(node.node._card().links) == 0
    finally:
        node.close()


def test_status_shows_no_numbers_a_hostile_card_made_up():
    card = pb.CapabilityCard(node_id="liar", alias="liar")
    card.links.add(node_id="x" * 40, bytes_per_s=math.nan, rtt_s=-1.0, fetches=3)
    card.links.add(node_id="y", bytes_per_s=math.inf, rtt_s=math.inf, fetches=1)
    for _ in range(30):
        card.links.add(node_id="z", bytes_per_s=1.0)
    (row,) = describe([card])
    assert len(row["links"]) == 16
    assert row["links"][0] == {
        "peer": "x" * 12,
        "node_id": "x" * 40,
        "bytes_per_s": None,
        "rtt_ms": None,
        "fetches": 3,
    }
    assert row["links"][1]["bytes_per_s"] is None
    json.dumps(row, allow_nan=False)  # what --json prints is valid JSON
    assert links_text(row).startswith("xxxxxxxxxxxx ? ×3, y ? ×1")


def test_a_trimmed_transfer_teaches_like_any_other_unless_said_compressed():
    """Fewer wire bytes than raw can be a codec (maybe sender-bound) or framing;
    the caller says which: an uncompressed slow transfer lowers the rate."""
    p, _ = _planner()
    _teach(p, "a", 50 * MB)
    kw = {"wire_bytes": 1 << 20, "raw_bytes": 4 << 20, "link_s": 1.0}
    p.observe_link("a", **kw, compressed=True)
    assert p.link_rate("a") == pytest.approx(50 * MB)
    p.observe_link("a", **kw, compressed=False)
    assert p.link_rate("a") < 50 * MB


def test_a_link_measured_too_slow_is_fetched_once_more_after_a_while(tmp_path):
    """A planted (or once-true) 1 B/s for a loopback peer makes the planner compute;
    RECHECK_S later it fetches once to measure again (once, not every request), and
    what that fetch measures decides from then on."""
    from kvmesh.runtime.planner import RECHECK_S

    wall = Wall()
    doc = {"version": 1, "links": {"fast": {"bytes_per_s": 1.0, "at": wall.now}}}
    plant(tmp_path, json.dumps(doc).encode())
    p = Planner(home=tmp_path, wall=wall)
    p.observe_prefill(1000, 1.0)  # 1,000 tokens/s here

    def choice():
        return p.choose("fast", "loopback", tokens=1000, raw_bytes=1 << 20).fetch

    assert not choice()
    wall.now += RECHECK_S / 2
    assert not choice()  # the evidence is still fresh
    wall.now += RECHECK_S
    assert choice()  # a recheck
    assert not choice() and not choice()  # once, until it is measured or RECHECK_S passes
    p.observe_link("fast", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=1e-3)  # ~1 GB/s
    assert choice() and choice()
    # a peer slow for real stays computed between rechecks
    p.observe_link("slow", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=100.0)
    assert not p.choose("slow", "loopback", tokens=1000, raw_bytes=1 << 20).fetch
    with pytest.raises(AssertionError):  # forced choices are never rechecked
        forced = Planner(wall=wall, force="compute")
        forced.observe_link("x", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=100.0)
        wall.now += 2 * RECHECK_S
        assert forced.choose("x", "loopback", tokens=1000, raw_bytes=1 << 20).fetch
