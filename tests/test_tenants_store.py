"""Tenant budgets in the block store: a tenant at its budget evicts only its own
blocks, leaf first, in RAM and on the disk tier."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer, chain_root, tenant_root
from kvmesh.codec import Block, Layout, new_blob
from kvmesh.errors import StoreFull
from kvmesh.store import BlockStore, DiskConfig

from .helpers import small_card

CARD = small_card()
LAYOUT = Layout(CARD)
B = CARD.block_tokens


def chain(tenant: str, tokens: list[int]) -> list[Block]:
    """Full blocks of ``tokens`` under ``tenant``'s root."""
    root = chain_root(CARD.namespace, tenant_root(b"secret", tenant))
    keyer = BlockKeyer(CARD.namespace, B, root=root)
    keys = keyer.keys(tokens)
    out = []
    for i, key in enumerate(keys.blocks):
        h = LAYOUT.header("block", key, keyer.parent_of(keys, i), i * B, B)
        blob, view = new_blob(h)
        rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        view[:] = rng.integers(0, 256, size=len(view), dtype=np.uint8).tobytes()
        out.append(LAYOUT.seal(h, blob))
    return out


def put_all(store: BlockStore, blocks: list[Block], owner: str | None) -> int:
    """Like ``Fleet.keep``: stop at the first refusal; how many were stored."""
    for i, blk in enumerate(blocks):
        try:
            store.put(blk, owner=owner)
        except StoreFull:
            return i
    return len(blocks)


NB = chain("x", list(range(B)))[0].nbytes  # headers differ by a few bytes: budgets have slack


def room(n: int) -> int:
    return n * NB + NB // 2


def held(store: BlockStore, blocks: list[Block]) -> int:
    return sum(b.key in store for b in blocks)


def test_tenant_at_its_budget_evicts_only_its_own_blocks():
    store = BlockStore(room(12))
    store.set_tenant_budget(room(4))
    bob = [chain("bob", [7, i] + [1] * (2 * B - 2)) for i in range(2)]  # 2 chains of 2 blocks
    for c in bob:
        assert put_all(store, c, "bob") == 2
    anon = chain("anon", [3] * (3 * B))
    assert put_all(store, anon, None) == 3  # a peer's blocks: no owner
    for i in range(20):  # alice floods: many two-block prompts
        put_all(store, chain("alice", [i] * (2 * B)), "alice")
        assert store.owned_bytes("alice") <= room(4)
    assert all(b.key in store for c in bob for b in c)  # bob's blocks all kept
    assert all(b.key in store for b in anon)
    assert store.owned_bytes("bob") == sum(b.nbytes for c in bob for b in c)
    assert store.owned_bytes("alice") > 3 * NB
    recent = chain("alice", [19] * (2 * B))
    assert all(b.key in store for b in recent)  # LRU: alice keeps her newest
    assert chain("alice", [0] * (2 * B))[0].key not in store
    assert store.reachable_bytes() == store.stats.used_bytes  # leaf-first: nothing stranded
    assert set(store.owners()) == {"alice", "bob"}


def test_owners_that_hold_nothing_are_forgotten():
    store = BlockStore(room(2))
    for i in range(50):  # gateway tenants come and go
        put_all(store, chain(f"t{i}", [i] * B), f"t{i}")
    assert len(store.owners()) <= 3
    assert sum(ram for ram, _ in store.owners().values()) == store.stats.used_bytes


def test_chain_longer_than_the_budget_keeps_its_prefix():
    store = BlockStore(room(100))
    store.set_tenant_budget(room(3))
    long = chain("alice", list(range(8 * B)))
    assert put_all(store, long, "alice") == 3  # its own parent is never its victim
    assert [b.key in store for b in long] == [True] * 3 + [False] * 5


def test_tenant_under_its_budget_may_use_a_full_store():
    store = BlockStore(room(6))
    store.set_tenant_budget(room(4))
    old = chain("anon", [5] * (4 * B))
    assert put_all(store, old, None) == 4
    assert put_all(store, chain("alice", [1] * (4 * B)), "alice") == 4
    # alice pushed out anonymous leaves (leaf first), but never more than her own share
    assert [b.key in store for b in old] == [True, True, False, False]
    assert put_all(store, chain("alice", [2] * (4 * B)), "alice") == 4
    assert [b.key in store for b in old] == [True, True, False, False]  # now only her own go


def test_budgets_must_be_positive():
    with pytest.raises(ValueError):
        BlockStore(NB).set_tenant_budget(0)
    with pytest.raises(ValueError):
        BlockStore(NB).set_tenant_budget(NB, -1)


def test_disk_tier_tenant_budget(tmp_path):
    store = BlockStore(room(3), disk=DiskConfig(str(tmp_path), room(40)))
    store.set_tenant_budget(room(3), room(4))
    bob = chain("bob", [9] * (3 * B))
    assert put_all(store, bob, "bob") == 3
    store.flush(10)
    bob_disk = store.owned_bytes("bob", "disk")
    assert bob_disk == sum(b.nbytes for b in bob)  # admitted on eviction... or written behind
    for i in range(10):
        put_all(store, chain("alice", [i] * (2 * B)), "alice")
        store.flush(10)
        assert store.owned_bytes("alice", "disk") <= room(4)
    assert store.owned_bytes("alice", "disk") > 2 * NB  # alice did use the disk tier
    assert store.owned_bytes("bob", "disk") == bob_disk  # none of bob's files evicted
    assert store.reachable_bytes("disk") == store.disk_stats.used_bytes
    store.close()
