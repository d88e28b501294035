"""A head's remote hit on a sliding-window model moves only what its import needs
(issue 41), end to end: a real ``kvmesh peer`` process holds a prompt a first
head computed and published; fresh heads fetch it over the bulk path.

- Trimmed (the default): the peer sends PARTS frames, the head's report says
  ``trimmed`` and counts fewer wire bytes than the whole blocks, and the answer is
  the producer's, token for token.
- ``window_trim=False`` (``--no-window-trim``): whole blocks, the same answer.
- The trimmed blocks are not kept in the fresh head's store (they are no whole
  block), and a second request for the prompt is answered the same.
- Over a slow link, once its codecs are calibrated on real KV, a head asks for
  compressed parts: the same answer, fewer bytes on the wire.
- A peer whose trimmed stream lies (a flipped byte, a part left out, a part digest
  that does not make the block's) is a counted fallback: the head computes, the
  answer is the cold one, nothing it sent is kept.
"""

from __future__ import annotations

import pytest

from kvmesh.engine import Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import HeadRuntime
from kvmesh.runtime.planner import Planner
from kvmesh.runtime.telemetry import Source

from . import zoo
from .helpers import wait_for
from .procs import Peer

W = 24
SAMPLING = Sampling(max_tokens=6, stop_on_eos=False)


@pytest.fixture(scope="module")
def model():
    path = zoo.windowed(zoo.hf_model("gemma3"), W)
    engine = load_engine(str(path), "torch")
    assert any(engine.card.sliding_windows)
    return engine, zoo.prompt_tokens(path, 8 * W + 11)


@pytest.fixture
def peer(tmp_path):
    p = Peer(alias="cache", log_dir=tmp_path)
    yield p
    p.kill()


def head(engine, seed: str, trim: bool = True, fresh: bool = True) -> HeadRuntime:
    node = NodeThread(
        NodeConfig(
            listen="127.0.0.1:0",
            seeds=[seed],
            alias="head",
            gossip_interval=0.3,
            ttl=2,
            roles=("head", "cache"),
            window_trim=trim,
        )
    )
    rt = HeadRuntime(engine, node)
    ns = engine.card.namespace_hex
    if fresh:  # the peer holds the namespace's blocks
        wait_for(lambda: any(ns in c.namespaces for c in node.node.membership.live()), 10)
    else:
        wait_for(lambda: node.node.membership.live(), 10)
    return rt


def close(rt: HeadRuntime) -> None:
    rt.close()
    assert rt.node is not None
    rt.node.close()


def remote(rt: HeadRuntime, prompt):
    out = rt.complete(prompt, SAMPLING)
    r = out.report
    assert r is not None and r.source == Source.REMOTE and r.fallback is None, r
    assert r.reused_tokens == len(prompt)
    return out, r


def stored(rt: HeadRuntime, prompt) -> tuple:
    """The blocks of ``prompt`` the head's own store holds."""
    assert rt.fleet is not None
    return rt.fleet.local_prefix(rt.keyer.keys(prompt)).all()


def served(rt: HeadRuntime) -> int:
    """The peer's gossiped count of block bytes it sent to fetchers, as sent."""
    assert rt.fleet is not None
    return sum(c.bytes_served for c in rt.fleet.members() if c.alias == "cache")


def publish(engine, peer: Peer, prompt):
    """A first head computes ``prompt`` and publishes it to ``peer``: its answer."""
    first = head(engine, peer.address, fresh=False)
    try:
        cold = first.complete(prompt, SAMPLING)
        assert cold.report is not None and cold.report.source == Source.COMPUTE
        first.flush(30)
        return cold
    finally:
        close(first)


def test_a_remote_hit_on_a_sliding_model_moves_only_the_window(model, peer):
    engine, prompt = model
    cold = publish(engine, peer, prompt)

    whole = head(engine, peer.address, trim=False)
    try:
        w_out, w = remote(whole, prompt)
        assert not w.trimmed and w.bytes_wire >= w.bytes_fetched > 0
        wait_for(lambda: served(whole) >= w.bytes_fetched, 10)  # whole blocks, raw
        before = served(whole)
    finally:
        close(whole)

    trimmed = head(engine, peer.address)
    try:
        t_out, t = remote(trimmed, prompt)
        assert t.trimmed and 0 < t.bytes_wire < w.bytes_wire
        # the peer's card says what crossed the wire, not the blocks it read
        wait_for(lambda: served(trimmed) > before, 10)
        assert served(trimmed) - before <= t.bytes_wire
        # what stayed home: every sliding layer's blocks before its window
        keep = engine.layout.keep_from(len(prompt))
        assert keep is not None and max(keep) > 0
        assert t.bytes_fetched < w.bytes_fetched
        assert t_out.tokens == w_out.tokens == cold.tokens  # identical answers
        assert t.planner["choice"] == "fetch"
        assert all(b.whole for b in stored(trimmed, prompt))
        again = trimmed.complete(prompt, SAMPLING)
        assert again.tokens == cold.tokens
    finally:
        close(trimmed)


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("parts-flip", "checksum_mismatch"),
        ("parts-missing", "malformed_payload"),
        ("manifest-lie", "checksum_mismatch"),
    ],
)
def test_a_lying_trimmed_stream_is_a_counted_fallback(model, tmp_path, mode, reason):
    engine, prompt = model
    liar = Peer(alias=f"hostile-{mode}", log_dir=tmp_path, command=("tests.hostile_peer", mode))
    try:
        cold = publish(engine, liar, prompt)
        fresh = head(engine, liar.address)
        try:
            out = fresh.complete(prompt, SAMPLING)
            r = out.report
            assert r is not None and r.source == Source.COMPUTE, r
            assert r.fallback == reason, r
            assert fresh.telemetry.counters[f"peer_failed:{reason}"] == 1
            assert out.tokens == cold.tokens
            assert all(b.whole for b in stored(fresh, prompt))
        finally:
            close(fresh)
    finally:
        liar.kill()


def test_over_a_slow_link_the_parts_come_compressed_and_exact(model, peer):
    """A head whose link to the peer is slow (a 100 Mbit/s prior for loopback here)
    and whose codecs are calibrated on real KV asks for compressed parts; the
    answer is the producer's, and fewer bytes cross the wire than arrive."""
    engine, prompt = model
    cold = publish(engine, peer, prompt)
    node = NodeThread(
        NodeConfig(
            listen="127.0.0.1:0", seeds=[peer.address], alias="slow", gossip_interval=0.3, ttl=2
        )
    )
    rt = HeadRuntime(engine, node, planner=Planner(priors={"loopback": 12.5e6}))
    try:
        ns = engine.card.namespace_hex
        wait_for(lambda: any(ns in c.namespaces for c in node.node.membership.live()), 10)
        state = engine.prefill(prompt[:64])
        real = engine.export(state, rt.keyer)[0]
        rt.calibrator.calibrate(real)  # what a head's first fetch or export does
        wait_for(lambda: "bp-zstd1" in rt.calibrator.stats(), 30)
        out, r = remote(rt, prompt)
        assert r.codec in ("bp-zstd1", "bp-lz4") and r.trimmed, r
        assert r.bytes_wire < r.bytes_fetched  # compressed on the wire, whole once decoded
        assert out.tokens == cold.tokens
    finally:
        close(rt)
