"""--audit-rate: a peer serving well-formed but wrong KV is caught and quarantined.

The wrong blocks are real exports of the prompt with their K/V values scaled,
re-sealed so that header, size and digest are all consistent: no structural
check can tell them apart. Only a recompute can.
"""

from __future__ import annotations

import numpy as np

from kvmesh.codec import Block, new_blob, seal
from kvmesh.engine import KVState
from kvmesh.runtime.head import HeadRuntime

from .procs import Peer
from .test_mesh import SAMPLING, close, fresh_head, make_head, prompt, wait_for


def _scaled(block: Block, factor: float) -> Block:
    """The same header with every float32 K/V value scaled (a tail's logits kept)."""
    blob, view = new_blob(block.header)
    view[:] = block.payload()
    off = 0
    for spec, _ in block.tensors():
        if spec is block.header.logits:
            break
        vals = np.frombuffer(view[off : off + spec.nbytes], np.float32)
        vals *= factor
        off += spec.nbytes
    return seal(block.header, blob, "blake3")


def _publish_wrong(engine, peer: Peer, toks: list[int]) -> None:
    h = make_head(engine, [peer.address], alias="forger")
    try:
        wait_for(lambda: len(h.fleet.members()) >= 1, what="gossip")
        state = engine.prefill(toks)
        blocks = engine.export(KVState(toks, state.cache, state.logits, len(toks)), h.keyer)
        h.fleet.publish(engine.card, [_scaled(b, 1.5) for b in blocks])
        h.flush()
    finally:
        close(h)


def _audited_head(engine, peer: Peer) -> HeadRuntime:
    return fresh_head(engine, [peer], runtime={"audit_rate": 1.0})


def test_wrong_kv_is_caught_by_an_audit_and_the_peer_quarantined(tiny_engine, tmp_path):
    peer = Peer(alias="forging-peer", log_dir=tmp_path)
    first, second = prompt(tiny_engine, 200, "forged a "), prompt(tiny_engine, 200, "forged b ")
    for toks in (first, second):
        _publish_wrong(tiny_engine, peer, toks)
    h = _audited_head(tiny_engine, peer)
    try:
        h.planner.prefill_tps = 100.0  # a real model's speed: fetching is worth it
        out = h.complete(first, SAMPLING)
        assert out.report.source == "remote"  # well-formed: no structural check refuses it
        wait_for(lambda: h.telemetry.counters["audits"] >= 1, what="the audit")
        assert h.telemetry.counters["audit_mismatch"] == 1
        peer_id = next(c.node_id for c in h.fleet.members() if c.alias == peer.alias)
        assert not h.planner.usable(peer_id)
        h.planner.prefill_tps = 100.0
        again = h.complete(second, SAMPLING)
        assert again.report.source == "compute" and again.report.reused_tokens == 0
        cold = list(tiny_engine.generate(tiny_engine.prefill(second), SAMPLING))
        assert again.tokens == cold
    finally:
        close(h)
        peer.kill()


def test_an_honest_peer_passes_its_audits(tiny_engine, tmp_path):
    from .test_mesh import published

    peer = Peer(alias="honest-peer", log_dir=tmp_path)
    toks = prompt(tiny_engine, 200, "honest audit ")
    published(tiny_engine, [peer], toks)
    h = _audited_head(tiny_engine, peer)
    try:
        h.planner.prefill_tps = 100.0
        out = h.complete(toks, SAMPLING)
        assert out.report.source == "remote"
        wait_for(lambda: h.telemetry.counters["audits"] >= 1, what="the audit")
        assert h.telemetry.counters["audit_mismatch"] == 0
        assert not h.planner.quarantined
    finally:
        close(h)
        peer.kill()
