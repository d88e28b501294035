"""A fresh head's first fetch (issue #27): where its time goes, and what it warms.

A real cache peer process holds a prompt a first head computed and published; a
new head (new node, empty store) asks for the same prompt: the hit is a real
remote fetch, digest-verified, with the producer's output, and its report breaks
the time to first token into stages that sum to it. The warm-up a head runs at
start stores nothing; an importer filled from several threads at once (a fetch's
hashers) allocates its buffers once and imports exactly what a sequential import
does.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import KVState, Sampling
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import STAGES, HeadRuntime
from kvmesh.runtime.telemetry import Source

from .helpers import wait_for
from .procs import Peer

PROMPT = [5 + (i * 7) % 200 for i in range(200)]  # 6 blocks of 32 and a tail
SAMPLING = Sampling(max_tokens=6)


def head_node(seeds=()) -> NodeThread:
    """The mesh node a test head runs on (a loaded CI machine must not turn a slow
    lookup into a miss: these tests assert hits, not the lookup's deadline)."""
    return NodeThread(
        NodeConfig(
            listen="127.0.0.1:0",
            seeds=list(seeds),
            alias="head",
            gossip_interval=0.3,
            ttl=2,
            roles=("head", "cache"),
            lookup_deadline=5.0,
        )
    )


def head(engine, seeds=()) -> HeadRuntime:
    return HeadRuntime(engine, head_node(seeds))


def close(rt: HeadRuntime) -> None:
    rt.close()
    assert rt.node is not None
    rt.node.close()


def check_breakdown(report, ttft_s: float) -> dict[str, float]:
    b = report.breakdown
    assert tuple(b) == STAGES
    assert all(v >= 0 for v in b.values()), b
    assert math.isclose(sum(b.values()), ttft_s, rel_tol=1e-9, abs_tol=1e-9), (b, ttft_s)
    return b


@pytest.fixture
def peer(tmp_path):
    p = Peer(alias="cache", log_dir=tmp_path)
    yield p
    p.kill()


def test_a_new_head_fetches_the_prompt_and_reports_each_stage(tiny_engine, peer):
    first = head(tiny_engine, [peer.address])
    try:
        wait_for(lambda: first.fleet is not None and first.fleet.members(), 10)
        cold = first.complete(PROMPT, SAMPLING)
        assert cold.report is not None and cold.report.source == Source.COMPUTE
        b = check_breakdown(cold.report, cold.ttft_s)
        assert b["connect"] == b["transfer"] == 0.0  # computed: nothing fetched
        assert b["import"] > 0  # the prefill itself
        first.flush(30)
    finally:
        close(first)

    fresh = head(tiny_engine, [peer.address])
    try:
        assert fresh.node is not None and fresh.fleet.store.stats.entries == 0
        ns = tiny_engine.card.namespace_hex
        wait_for(lambda: any(ns in c.namespaces for c in fresh.fleet.members()), 10)
        hit = fresh.complete(PROMPT, SAMPLING)
        r = hit.report
        assert r is not None and r.source == Source.REMOTE and r.fallback is None
        assert r.reused_tokens == len(PROMPT) and r.bytes_fetched > 0
        assert hit.tokens == cold.tokens  # identical output from the imported KV
        b = check_breakdown(r, hit.ttft_s)
        for stage in ("lookup", "connect", "transfer", "verify", "import", "first_token"):
            assert b[stage] > 0, (stage, b)  # every stage of a remote hit was reached
        # the stream's own clock agrees: connect to last byte is part of the fetch
        assert b["transfer"] <= r.fetch_s
    finally:
        close(fresh)


def test_the_warm_up_is_bounded_and_stores_nothing(tiny_engine):
    rt = head(tiny_engine)
    try:
        assert rt.warm_s > 0  # it ran (a failure would only be logged)
        assert rt.node is not None
        stats = rt.fleet.store.stats
        assert stats.entries == 0 and stats.used_bytes == 0
        # a local request afterwards is unaffected: computed, then reported
        out = rt.complete(PROMPT, SAMPLING)
        assert out.report is not None and out.report.source == Source.COMPUTE
        check_breakdown(out.report, out.ttft_s)
    finally:
        close(rt)


def test_an_importer_filled_from_many_threads_allocates_once_and_imports_exactly(tiny_engine):
    keyer = BlockKeyer(tiny_engine.card.namespace, tiny_engine.card.block_tokens)
    state = tiny_engine.prefill(PROMPT)
    blocks = tiny_engine.export(state, keyer)
    n = sum(b.header.tokens for b in blocks)
    sequential = tiny_engine.importer(n)
    for blk in blocks:
        sequential.add(blk)
    parallel = tiny_engine.importer(n)
    go = threading.Barrier(len(blocks))

    def add(blk) -> None:
        go.wait(10)  # every thread's first add races for the allocation
        parallel.add(blk)

    threads = [threading.Thread(target=add, args=(b,)) for b in blocks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert parallel.added == len(blocks)
    a, b = sequential.cache(), parallel.cache()
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    # and equal to the producer's own cache of those positions
    for la, lp in zip(b.layers, state.cache.layers, strict=True):
        assert torch.equal(la.keys, lp.keys[:, :, :n]) and torch.equal(
            la.values, lp.values[:, :, :n]
        )


def test_detach_keeps_an_imports_buffer_and_copies_a_crop_out_of_it(tiny_engine):
    keyer = BlockKeyer(tiny_engine.card.namespace, tiny_engine.card.block_tokens)
    blocks = tiny_engine.export(tiny_engine.prefill(PROMPT), keyer)
    importer = tiny_engine.importer(sum(b.header.tokens for b in blocks))
    for blk in blocks:
        importer.add(blk)
    state = tiny_engine.prefill(PROMPT, tuple(blocks), importer)
    before = [(ly.keys.data_ptr(), ly.values.data_ptr()) for ly in state.cache.layers]
    tiny_engine.detach(state)  # its layers fill the import's buffer: nothing to copy
    assert [(ly.keys.data_ptr(), ly.values.data_ptr()) for ly in state.cache.layers] == before
    crop = KVState(PROMPT[:64], tiny_engine._crop(state.cache, 64), None, 64)
    tiny_engine.detach(crop)  # 64 of its positions would keep all of them alive: copied
    for ly, orig in zip(crop.cache.layers, state.cache.layers, strict=True):
        assert ly.keys.untyped_storage().nbytes() == ly.keys.nbytes
        assert torch.equal(ly.keys, orig.keys[:, :, :64])
        assert torch.equal(ly.values, orig.values[:, :, :64])
