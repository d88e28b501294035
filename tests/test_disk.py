"""The disk tier: crash safety, budgets, leaf-first eviction, rebuild, promotion."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmesh.blocks import BlockKeyer
from kvmesh.cli.store import store as store_cli
from kvmesh.codec import MAX_CHUNK_BYTES, PREFIX, chunks, digest_blob, parse_prefix
from kvmesh.errors import StoreFull
from kvmesh.store import BlockStore, DiskConfig

from .helpers import small_card, synthetic_chain

CARD = small_card()
KEYER = BlockKeyer(CARD.namespace, CARD.block_tokens)
BIG = 1 << 30


def disk_store(path: Path, ram: int = BIG, disk: int = BIG, **kw: object) -> BlockStore:
    return BlockStore(ram, disk=DiskConfig(str(path), disk, **kw))  # type: ignore[arg-type]


def filled(path: Path, toks: list[int], **kw: object) -> tuple[BlockStore, list]:
    s = disk_store(path, **kw)  # type: ignore[arg-type]
    chain = synthetic_chain(CARD, toks)
    for b in chain:
        s.put(b)
    assert s.flush(10)
    return s, chain


def files(path: Path) -> list[Path]:
    return sorted((path / "blocks").iterdir())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "blocks").iterdir()) + sum(
        f.stat().st_size for f in (path / "tmp").iterdir()
    )


def test_restart_rebuilds_the_index_under_a_new_epoch(tmp_path):
    toks = list(range(18))
    s, chain = filled(tmp_path, toks)
    epoch = s.epoch
    s.close()
    s2 = disk_store(tmp_path)
    assert s2.epoch != epoch
    assert s2.disk_stats.entries == len(chain) and s2.stats.entries == 0
    m = s2.longest_prefix(KEYER.keys(toks))
    assert m.tokens == 18 and [bytes(b.blob) for b in m.all()] == [b.blob for b in chain]
    assert s2.disk_stats.hits == 1 and s2.disk_stats.promotions == len(chain)
    assert s2.stats.entries == len(chain)  # promoted: the next lookup is served from RAM
    assert s2.reachable_bytes("disk") == s2.disk_stats.used_bytes
    s2.close()


def test_ram_evictions_stay_on_disk_and_are_served(tmp_path):
    a, b = list(range(40)), [7] + list(range(40))
    probe = synthetic_chain(CARD, a)
    s = disk_store(tmp_path, ram=3 * probe[0].nbytes)
    for toks in (a, b):
        for blk in synthetic_chain(CARD, toks):
            s.put(blk)
        s.flush(10)
    assert s.stats.used_bytes <= s.stats.budget_bytes
    assert s.reachable_bytes() == s.stats.used_bytes
    m = s.longest_prefix(KEYER.keys(a))
    assert m.tokens == 40 and [bytes(x.blob) for x in m.all()] == [x.blob for x in probe]
    assert s.stats.used_bytes <= s.stats.budget_bytes
    s.close()


def test_torn_truncated_corrupt_and_misnamed_files_are_never_served(tmp_path):
    toks = list(range(32))  # 8 blocks + an empty tail
    s, chain = filled(tmp_path, toks)
    s.close()
    by_key = {b.key: b for b in chain}
    path = {b.key: tmp_path / "blocks" / (b.digest.hex() + ".kvb") for b in chain}
    keys = KEYER.keys(toks)
    # block 5: one payload byte flipped (only the digest can tell)
    raw = bytearray(path[keys.blocks[5]].read_bytes())
    raw[-1] ^= 1
    path[keys.blocks[5]].write_bytes(bytes(raw))
    # block 6: truncated; block 7: renamed to another digest; plus junk and a torn write
    with open(path[keys.blocks[6]], "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    path[keys.blocks[7]].rename(tmp_path / "blocks" / ("ab" * 32 + ".kvb"))
    (tmp_path / "blocks" / "junk.kvb").write_bytes(b"KVB1 not a block")
    (tmp_path / "tmp" / "deadbeef.1234").write_bytes(raw[: len(raw) // 3])

    s2 = disk_store(tmp_path)
    d = s2.disk_stats
    assert d.torn == 1 and d.corrupt == 2  # junk and truncated: found by the header scan
    m = s2.longest_prefix(keys)
    assert m.tokens == 5 * CARD.block_tokens and m.tail is None  # stops before block 5
    assert [b.blob for b in m.blocks] == [by_key[k].blob for k in keys.blocks[:5]]
    assert d.corrupt == 3  # block 5's digest, checked on read; its subtree is dropped
    assert s2.get(keys.blocks[5]) is None and keys.tail not in s2
    assert not list((tmp_path / "tmp").iterdir())
    names = {f.name for f in files(tmp_path)}
    assert names == {by_key[k].digest.hex() + ".kvb" for k in keys.blocks[:5]}
    assert s2.reachable_bytes("disk") == d.used_bytes == dir_bytes(tmp_path)
    s2.close()


def test_misnamed_file_is_caught_on_read(tmp_path):
    toks = list(range(8))
    s, chain = filled(tmp_path, toks)
    s.close()
    victim = tmp_path / "blocks" / (chain[1].digest.hex() + ".kvb")
    victim.rename(tmp_path / "blocks" / ("cd" * 32 + ".kvb"))
    s2 = disk_store(tmp_path)
    assert s2.longest_prefix(KEYER.keys(toks)).tokens == 4
    assert s2.disk_stats.corrupt == 1 and len(files(tmp_path)) == 1
    s2.close()


def test_orphans_are_deleted_at_start(tmp_path):
    toks = list(range(16))
    s, chain = filled(tmp_path, toks)
    s.close()
    (tmp_path / "blocks" / (chain[1].digest.hex() + ".kvb")).unlink()
    s2 = disk_store(tmp_path)
    assert s2.disk_stats.orphans == len(chain) - 2 and len(files(tmp_path)) == 1
    s2.close()


def test_disk_budget_is_never_exceeded_and_eviction_is_leaf_first(tmp_path):
    nb = synthetic_chain(CARD, list(range(4)))[0].nbytes
    budget = 10 * nb + nb // 2
    s = disk_store(tmp_path, ram=4 * nb, disk=budget)
    rng = random.Random(0)
    for i in range(30):
        toks = [rng.randrange(3)] + [rng.randrange(50) for _ in range(rng.randrange(4, 24))]
        for blk in synthetic_chain(CARD, toks, tail=i % 2 == 0):
            s.put(blk)
        s.flush(10)
        assert s.disk_stats.used_bytes <= budget and dir_bytes(tmp_path) <= budget
        # every byte on disk is reachable through blocks on disk (chains stay whole)
        assert s.reachable_bytes("disk") == s.disk_stats.used_bytes
        assert s.reachable_bytes() == s.stats.used_bytes
    assert s.disk_stats.evictions > 0
    s.close()
    s2 = disk_store(tmp_path, disk=budget)
    assert s2.disk_stats.orphans == 0 and s2.reachable_bytes("disk") == s2.disk_stats.used_bytes
    s2.close()


def test_a_long_chain_keeps_its_prefix_on_disk(tmp_path):
    toks = list(range(64))
    chain = synthetic_chain(CARD, toks, tail=False)
    six = sum(b.nbytes for b in chain[:6])
    s = disk_store(tmp_path, ram=2 * chain[-1].nbytes, disk=six)
    with pytest.raises(StoreFull):  # RAM and disk both full of one unbroken chain
        for b in chain:
            s.put(b)
            s.flush(10)
    s.close()
    s2 = disk_store(tmp_path, disk=six)
    assert s2.longest_prefix(KEYER.keys(toks)).tokens == 6 * CARD.block_tokens
    s2.close()


def test_a_smaller_budget_at_restart_evicts_leaves(tmp_path):
    toks = list(range(32))
    s, chain = filled(tmp_path, toks)
    s.close()
    s2 = disk_store(tmp_path, disk=3 * chain[0].nbytes)
    assert s2.disk_stats.used_bytes <= 3 * chain[0].nbytes
    assert s2.longest_prefix(KEYER.keys(toks)).tokens == 3 * CARD.block_tokens
    s2.close()


def test_admit_hit_writes_only_blocks_that_were_hit(tmp_path):
    hot, cold = list(range(12)), [9] * 12
    s = disk_store(tmp_path, admit="hit")
    for toks in (hot, cold):
        for b in synthetic_chain(CARD, toks):
            s.put(b)
    s.flush(10)
    assert s.disk_stats.admissions == 0
    assert s.longest_prefix(KEYER.keys(hot)).tokens == 12
    s.flush(10)
    assert s.disk_stats.admissions == 4 and len(files(tmp_path)) == 4
    s.close()


def test_promotion_waits_for_hot_blocks_and_room(tmp_path):
    toks = list(range(16))
    s, chain = filled(tmp_path, toks)
    s.close()
    s2 = BlockStore(2 * chain[0].nbytes, disk=DiskConfig(str(tmp_path), BIG, promote_hits=2))
    keys = KEYER.keys(toks)
    assert s2.longest_prefix(keys).tokens == 16 and s2.disk_stats.promotions == 0
    assert s2.longest_prefix(keys).tokens == 16  # hot now, but only two blocks fit in RAM
    assert s2.disk_stats.promotions == 2 and s2.stats.used_bytes <= s2.stats.budget_bytes
    assert s2.longest_prefix(keys).tokens == 16
    s2.close()


def test_leases_and_get_see_disk_blocks(tmp_path):
    toks = list(range(8))
    s, chain = filled(tmp_path, toks)
    s.close()
    s2 = disk_store(tmp_path)
    lease = s2.lease([b.key for b in chain])
    assert all(s2.get(b.key).blob == b.blob for b in chain)
    assert s2.stats.entries == 0  # a fetch reads through; only lookups promote
    s2.release(lease.id)
    s2.close()


def test_a_big_disk_block_is_an_mmap_view_served_in_slices(tmp_path):
    card = small_card(num_layers=1, num_kv_heads=40, head_dim=4096, sliding_windows=(0,))
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    toks = list(range(4))
    chain = synthetic_chain(card, toks, tail=False)
    assert chain[0].nbytes > MAX_CHUNK_BYTES
    s = disk_store(tmp_path)
    s.put(chain[0])
    s.flush(10)
    s.close()
    s2 = BlockStore(1 << 20, disk=DiskConfig(str(tmp_path), BIG))  # RAM too small to promote
    blk = s2.get(keyer.keys(toks).blocks[0])
    assert isinstance(blk.blob, memoryview)
    assert b"".join(bytes(c) for c in chunks(blk.blob, 1 << 20)) == chain[0].blob
    assert s2.longest_prefix(keyer.keys(toks)).tokens == 4
    s2.close()


def test_a_lookup_reads_no_file_and_a_bad_file_fails_its_fetch(tmp_path):
    toks = list(range(16))
    s, chain = filled(tmp_path, toks)
    s.close()
    keys = KEYER.keys(toks)
    p = tmp_path / "blocks" / (chain[2].digest.hex() + ".kvb")
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1  # only the digest can tell
    p.write_bytes(bytes(raw))
    s2 = disk_store(tmp_path)
    assert s2._files is not None
    found = s2.lookup(keys)  # the index alone: keys, sizes and digests from headers
    assert found.tokens == 16 and found.disk_blocks == len(chain) and s2._files.reads == 0
    assert [(r.key, r.digest, r.nbytes) for r in found.blocks] == [
        (b.key, b.digest, b.nbytes) for b in chain[:4]
    ]
    assert s2.disk_stats.corrupt == 0 and s2.disk_stats.hits == 1
    lease = s2.lease([b.key for b in chain[:4]])
    assert s2.get(chain[1].key).blob == chain[1].blob
    assert s2.get(chain[2].key) is None  # the fetch fails; the file is deleted and counted
    assert s2.disk_stats.corrupt == 1 and chain[3].key not in s2 and not p.exists()
    s2.release(lease.id)
    assert s2.longest_prefix(keys).tokens == 2 * CARD.block_tokens
    assert s2.reachable_bytes("disk") == s2.disk_stats.used_bytes == dir_bytes(tmp_path)
    s2.close()


def test_disk_reads_and_digests_happen_outside_the_store_lock(tmp_path):
    import threading

    toks = list(range(16))
    s, chain = filled(tmp_path, toks)
    s.close()
    s2 = disk_store(tmp_path)
    files_, lock_free = s2._files, []
    assert files_ is not None
    read = files_.open

    def open_(*a):  # another thread must be able to take the store lock meanwhile
        def take() -> None:
            got = s2._lock.acquire(timeout=5)  # a bound, not a measurement
            if got:
                s2._lock.release()
            lock_free.append(got)

        t = threading.Thread(target=take)
        t.start()
        t.join()
        return read(*a)

    files_.open = open_  # type: ignore[method-assign]
    m = s2.longest_prefix(KEYER.keys(toks))
    assert m.tokens == 16 and m.disk_blocks == len(chain) and m.from_disk
    assert lock_free == [True] * len(chain)
    assert s2.disk_stats.promotions == len(chain)
    m = s2.longest_prefix(KEYER.keys(toks))  # promoted: served from RAM now
    assert m.tokens == 16 and not m.from_disk and len(lock_free) == len(chain)
    s2.close()


def test_store_cli_stats_and_verify(tmp_path):
    toks = list(range(16))
    s, chain = filled(tmp_path, toks)
    s.close()
    runner = CliRunner()
    r = runner.invoke(store_cli, ["stats", str(tmp_path), "--json"])
    assert r.exit_code == 0 and f'"blocks": {len(chain)}' in r.output
    assert runner.invoke(store_cli, ["verify", str(tmp_path)]).exit_code == 0
    p = tmp_path / "blocks" / (chain[2].digest.hex() + ".kvb")
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1
    p.write_bytes(bytes(raw))
    r = runner.invoke(store_cli, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and "digest mismatch" in r.output
    assert r.output.count("orphan") == len(chain) - 3  # its descendants
    r = runner.invoke(store_cli, ["verify", str(tmp_path), "--delete"])
    assert r.exit_code == 0 and not p.exists() and len(files(tmp_path)) == 2
    assert runner.invoke(store_cli, ["verify", str(tmp_path)]).exit_code == 0


# -- a mesh node with a disk tier -----------------------------------------------


def test_node_with_disk_is_a_remote_hit_after_both_restart(tiny_engine, tmp_path):
    """In-process: a peer node with a disk tier, and a head, both restarted."""
    from kvmesh.mesh.node import NodeConfig, NodeThread

    from .test_mesh import SAMPLING, close, make_head, prompt, wait_for

    def peer() -> NodeThread:
        return NodeThread(
            NodeConfig(
                listen="127.0.0.1:0",
                alias="disk-peer",
                gossip_interval=0.3,
                ttl=2,
                disk_path=str(tmp_path / "disk"),
                disk_budget_bytes=64 << 20,
            )
        )

    toks = prompt(tiny_engine, 300, salt="disk")
    p = peer()
    h = make_head(tiny_engine, [p.node.address])
    try:
        wait_for(lambda: len(h.fleet.members()) >= 1, what="gossip")
        cold = h.complete(toks, SAMPLING)
        h.flush()
        wait_for(lambda: p.node.store.stats.entries > 0, what="publish")
        assert p.node.store.flush(10)
    finally:
        close(h)
        p.loop.call_soon_threadsafe(p.loop.stop)  # no goodbye, no store close: a crash
    p2 = peer()
    h2 = make_head(tiny_engine, [p2.node.address])
    try:
        assert p2.node.store.disk_stats.entries > 0 and p2.node.store.stats.entries == 0
        wait_for(lambda: len(h2.fleet.members()) >= 1, what="gossip")
        again = h2.complete(toks, SAMPLING)
        assert again.report.source == "remote"
        assert again.report.reused_tokens >= 0.9 * len(toks)
        assert again.tokens == cold.tokens
    finally:
        close(h2)
        p2.close()


def block_files(disk: Path) -> dict[int, Path]:
    """A disk tier's block files (not tails) by their first token."""
    out = {}
    for f in (disk / "blocks").glob("*.kvb"):
        raw = f.read_bytes()
        header = json.loads(raw[PREFIX.size : PREFIX.size + parse_prefix(raw)])
        if header["kind"] == "block":
            out[header["start"]] = f
    return out


def flip_last_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))


def test_a_bad_file_on_a_peer_fails_its_fetch_and_the_head_computes(tiny_engine, tmp_path):
    """A lookup advertises a disk block from the index; at fetch time its file is
    bad: the fetch fails with a typed error, the head computes, the text is the same."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvmesh.mesh.metrics import NodeCollector
    from kvmesh.mesh.node import NodeConfig, NodeThread

    from .test_mesh import SAMPLING, close, fresh_head, make_head, prompt, wait_for

    disk = tmp_path / "disk"
    cfg = dict(
        listen="127.0.0.1:0",
        alias="disk-peer",
        gossip_interval=0.3,
        ttl=2,
        disk_path=str(disk),
        disk_budget_bytes=64 << 20,
    )
    toks = prompt(tiny_engine, 300, salt="badfile")
    p = NodeThread(NodeConfig(**cfg))  # type: ignore[arg-type]
    h = make_head(tiny_engine, [p.node.address])
    try:
        wait_for(lambda: len(h.fleet.members()) >= 1, what="gossip")
        cold = h.complete(toks, SAMPLING)
        h.flush()
        wait_for(lambda: p.node.store.stats.entries > 0, what="publish")
        assert p.node.store.flush(10)
    finally:
        close(h)
        p.close()
    bt = tiny_engine.card.block_tokens
    flip_last_byte(block_files(disk)[2 * bt])
    p2 = NodeThread(NodeConfig(**cfg))  # type: ignore[arg-type]
    h2 = fresh_head(tiny_engine, [p2.node], alias="head-2")
    try:
        again = h2.complete(toks, SAMPLING)
        assert again.tokens == cold.tokens
        assert again.report.source == "compute" and again.report.fallback == "lease_expired"
        d = p2.node.store.disk_stats
        assert d.corrupt == 1 and p2.node.cache.counters["fetch_rejected:not_found"] == 0
        reg = CollectorRegistry()
        reg.register(NodeCollector(lambda: p2.node))
        text = generate_latest(reg).decode()
        assert 'kvmesh_tier_corrupt_total{tier="disk"} 1.0' in text
        assert 'kvmesh_tier_entries{tier="ram"}' in text
    finally:
        close(h2)
        p2.close()


def _completion(head, text: str) -> dict:
    body = {"model": "demo-tiny", "prompt": text, "max_tokens": 8, "temperature": 0}
    r = head.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_head_and_disk_peer_processes_survive_sigkill(tmp_path):
    """Issue 14's done-when: publish through a `kvmesh head` to a `kvmesh peer --disk`,
    SIGKILL the peer and the head, restart both: the same prompt is a remote hit
    (>= 90% of the prompt cached) with identical text."""
    from .procs import Peer
    from .test_api import Head

    disk = tmp_path / "disk"
    text = "A disk tier outlives its process. " * 30
    p = Peer("--disk", str(disk), "--disk-budget", "64MiB", alias="dp", log_dir=tmp_path)
    try:
        h = Head("--seed", p.address, "--alias", "h1")
        try:
            h.wait(lambda s: s["peers"] >= 1)
            cold = _completion(h, text)
            n = cold["usage"]["prompt_tokens"]
            h.wait(lambda s: s["publish_pending"] == 0)
            _wait(lambda: len(block_files(disk)) >= n // 32, "disk writes")
        finally:
            h.proc.kill()  # SIGKILL, both
            h.proc.wait(10)
            h.http.close()
        p.kill()
        p.start()
        h2 = Head("--seed", p.address, "--alias", "h2")
        try:
            h2.wait(lambda s: s["peers"] >= 1)
            again = _completion(h2, text)
            assert again["kvmesh"]["source"] == "remote", again["kvmesh"]
            assert _cached(again) >= 0.9 * again["usage"]["prompt_tokens"]
            assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        finally:
            h2.stop()
    finally:
        p.kill()


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    from .test_mesh import wait_for

    wait_for(cond, timeout=timeout, what=what)


def test_head_process_own_disk_hit_and_bad_files(tmp_path):
    """`kvmesh head --disk`: after a SIGKILL the head's own disk serves the prompt
    (`source: "disk"`). Then files are corrupted, truncated and half-written while
    it is down: none is served, each is counted, the answer is the cold one."""
    from .test_api import Head

    disk = tmp_path / "disk"
    text = "Cache that survives restarts. " * 30

    def start() -> Head:
        return Head("--disk", str(disk), "--disk-budget", "64MiB", "--alias", "solo")

    h = start()
    try:
        cold = _completion(h, text)
        n = cold["usage"]["prompt_tokens"]
        _wait(lambda: len(block_files(disk)) >= n // 32, "disk writes")
        assert cold["kvmesh"]["source"] == "compute"
    finally:
        h.proc.kill()
        h.proc.wait(10)
        h.http.close()
    h = start()
    try:
        assert h.metric('kvmesh_tier_entries{tier="disk"}') >= n // 32
        warm = _completion(h, text)
        assert warm["kvmesh"]["source"] == "disk", warm["kvmesh"]
        assert _cached(warm) >= 0.9 * n
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert h.metric('kvmesh_tier_hits_total{tier="disk"}') == 1
        assert h.metric('kvmesh_prefill_total{source="disk"}') == 1
    finally:
        h.proc.kill()
        h.proc.wait(10)
        h.http.close()
    bt = 32
    by_start = block_files(disk)
    flip_last_byte(by_start[1 * bt])  # whole, right size: only the digest on read can tell
    with open(by_start[3 * bt], "r+b") as f:  # truncated mid-payload
        f.truncate(f.seek(0, os.SEEK_END) - 100)
    half = by_start[5 * bt].read_bytes()  # half-written under its final name ...
    by_start[5 * bt].write_bytes(half[: len(half) // 2])
    (disk / "tmp" / (by_start[5 * bt].stem + ".0001")).write_bytes(
        half[: len(half) // 3]
    )  # ... and torn
    h = start()
    try:
        assert h.metric('kvmesh_tier_corrupt_total{tier="disk"}') == 2  # found by the header scan
        assert h.metric('kvmesh_disk_files_deleted_total{reason="torn"}') == 1
        assert h.metric('kvmesh_disk_files_deleted_total{reason="orphan"}') >= 1
        out = _completion(h, text)
        assert out["choices"][0]["text"] == cold["choices"][0]["text"]
        assert out["kvmesh"]["source"] == "disk" and _cached(out) == bt  # block 0 only
        assert h.metric('kvmesh_tier_corrupt_total{tier="disk"}') == 3  # block 1, on read
        # the recomputed blocks are published and written again in the background:
        # once the writer is idle, every file left holds the bytes its name promises
        from .test_mesh import wait_for

        wait_for(lambda: not list((disk / "tmp").iterdir()), what="the disk writer")
        for f in (disk / "blocks").glob("*.kvb"):
            assert digest_blob(f.read_bytes(), "blake3").hex() == f.stem, f
    finally:
        h.stop()
