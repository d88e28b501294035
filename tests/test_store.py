import random

import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.errors import LeaseExpired, OrphanBlock, StaleEpoch, StoreFull
from kvmesh.store import BlockStore

from .helpers import small_card, synthetic_chain

CARD = small_card()
KEYER = BlockKeyer(CARD.namespace, CARD.block_tokens)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_longest_prefix_never_crosses_a_hole():
    toks = list(range(18))
    chain = synthetic_chain(CARD, toks)
    store = BlockStore(1 << 20)
    for blk in chain:
        store.put(blk)
    assert store.longest_prefix(KEYER.keys(toks)).tokens == 18
    assert store.longest_prefix(KEYER.keys(toks)).tail is not None
    # a different prompt sharing two blocks: only those two are used, no tail
    other = toks[:8] + [99] * 10
    m = store.longest_prefix(KEYER.keys(other))
    assert m.tokens == 8 and m.tail is None
    # remove a middle block by building a store without it: later blocks unreachable
    holes = BlockStore(1 << 20)
    holes.put(chain[0])
    with pytest.raises(OrphanBlock):
        holes.put(chain[2])
    keys = KEYER.keys(toks)
    assert (
        holes.longest_prefix(keys.blocks[:1] + (b"\0" * 32,) + keys.blocks[2:], keys.tail).tokens
        == 4
    )


def test_missing_middle_block_stops_the_prefix():
    toks = list(range(16))
    chain = synthetic_chain(CARD, toks)
    store = BlockStore(1 << 20)
    for blk in chain:
        store.put(blk)
    keys = KEYER.keys(toks)
    forged = list(keys.blocks)
    forged[1] = bytes(32)
    m = store.longest_prefix(forged, keys.tail)
    assert [b.key for b in m.blocks] == [keys.blocks[0]] and m.tail is None


def test_immutability():
    chain = synthetic_chain(CARD, list(range(8)))
    store = BlockStore(1 << 20)
    assert store.put(chain[0]) is True
    assert store.put(chain[0]) is False
    evil = synthetic_chain(CARD, list(range(8)), seed=7)[0]
    assert evil.key == chain[0].key and evil.digest != chain[0].digest
    # another producer's bytes for the same tokens: the first are kept, a variant
    # is counted, and nothing is rejected (README: which bytes a prefix has)
    assert store.put(evil) is False
    assert store.get(chain[0].key).digest == chain[0].digest
    assert store.stats.variants == 1 and not store.stats.rejects


def _all_reachable(store):
    return store.reachable_bytes() == store.stats.used_bytes


def test_churn_never_exceeds_budget_or_strands_a_block():
    rng = random.Random(1)
    size = synthetic_chain(CARD, list(range(4)), tail=False)[0].nbytes
    store = BlockStore(size * 25)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(6)]
    for step in range(600):
        base = rng.choice(prefixes)
        toks = base + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        for blk in synthetic_chain(CARD, toks):
            try:
                store.put(blk)
            except (OrphanBlock, StoreFull):
                break
        if step % 7 == 0:
            store.longest_prefix(KEYER.keys(rng.choice(prefixes)))
        assert store.stats.used_bytes <= store.stats.budget_bytes
        assert _all_reachable(store)
    assert store.stats.evictions > 100


def test_eviction_takes_leaves_not_roots():
    toks = list(range(16))
    chain = synthetic_chain(CARD, toks, tail=False)
    size = chain[0].nbytes
    store = BlockStore(size * 4 + 16)  # headers differ by a few bytes
    for blk in chain:
        store.put(blk)
    store.longest_prefix(KEYER.keys(toks))  # touches root first, leaf last
    other = synthetic_chain(CARD, [77] * 4, tail=False)[0]
    store.put(other)
    assert chain[0].key in store and chain[3].key not in store
    assert _all_reachable(store)


def test_lease_protects_until_it_ends_and_epoch_voids_it():
    clock = Clock()
    toks = list(range(8))
    chain = synthetic_chain(CARD, toks, tail=False)
    size = chain[0].nbytes
    store = BlockStore(size * 2, clock=clock)
    for blk in chain:
        store.put(blk)
    lease = store.lease([b.key for b in chain], ttl=5)
    with pytest.raises(StoreFull):
        store.put(synthetic_chain(CARD, [9] * 4, tail=False)[0])
    assert all(b.key in store for b in chain)
    assert store.check_lease(lease.id, store.epoch) == lease
    with pytest.raises(StaleEpoch):
        store.check_lease(lease.id, "another-epoch")
    clock.t = 6
    with pytest.raises(LeaseExpired):
        store.check_lease(lease.id, store.epoch)
    store.put(synthetic_chain(CARD, [9] * 4, tail=False)[0])
    assert chain[1].key not in store
    restarted = BlockStore(size * 2, clock=clock)
    assert restarted.epoch != store.epoch
    with pytest.raises(StaleEpoch):
        restarted.check_lease(lease.id, store.epoch)


def test_release_frees_blocks():
    chain = synthetic_chain(CARD, list(range(8)), tail=False)
    store = BlockStore(chain[0].nbytes * 2)
    for blk in chain:
        store.put(blk)
    lease = store.lease([chain[1].key])
    store.release(lease.id)
    store.put(synthetic_chain(CARD, [5] * 4, tail=False)[0])
    assert chain[1].key not in store
    with pytest.raises(LeaseExpired):
        store.lease([chain[1].key])
