"""The disk tier: crash safety, budgets, leaf-first eviction, rebuild, promotion."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import MAX_CHUNK_BYTES, chunks
from kvmesh.disk import DiskConfig
from kvmesh.errors import StoreFull
from kvmesh.store import BlockStore
from kvmesh.store_cli import store as store_cli

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


def _peer_has_disk_flags() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "peer", "--help"], capture_output=True, text=True
    )
    return "--disk" in out.stdout


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
        wait_for(lambda: len(h.node.node.membership.live()) >= 1, what="gossip")
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
        wait_for(lambda: len(h2.node.node.membership.live()) >= 1, what="gossip")
        again = h2.complete(toks, SAMPLING)
        assert again.report.source == "remote"
        assert again.report.reused_tokens >= 0.9 * len(toks)
        assert again.tokens == cold.tokens
    finally:
        close(h2)
        p2.close()


@pytest.mark.skipif(
    not _peer_has_disk_flags(), reason="`kvmesh peer --disk` is not wired into cli.py yet"
)
def test_peer_process_with_disk_survives_sigkill(tiny_engine, tmp_path):
    """Issue 14's done-when: publish through a head to `kvmesh peer --disk`, SIGKILL
    the peer and drop the head, restart both: a remote hit with identical text."""
    from .procs import Peer
    from .test_mesh import SAMPLING, close, fresh_head, make_head, prompt, wait_for

    disk = tmp_path / "disk"
    p = Peer("--disk", str(disk), "--disk-budget", "64MiB", alias="dp", log_dir=tmp_path)
    toks = prompt(tiny_engine, 300, salt="sigkill")
    h = make_head(tiny_engine, [p.address])
    try:
        wait_for(lambda: len(h.node.node.membership.live()) >= 1, what="gossip")
        cold = h.complete(toks, SAMPLING)
        h.flush()
        n = len(toks) // tiny_engine.card.block_tokens
        wait_for(lambda: len(list((disk / "blocks").glob("*.kvb"))) >= n, what="disk writes")
    finally:
        close(h)
        p.kill()
    p.start()
    try:
        h2 = fresh_head(tiny_engine, [p])
        try:
            again = h2.complete(toks, SAMPLING)
            assert again.report.source == "remote"
            assert again.report.reused_tokens >= 0.9 * len(toks)
            assert again.tokens == cold.tokens
        finally:
            close(h2)
    finally:
        p.kill()
