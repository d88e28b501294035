"""The chain-root primitive: tenant roots and ``cache_salt`` separate key chains."""

import hashlib

import pytest

from kvmesh.blocks import (
    MAX_CACHE_SALT_CHARS,
    BlockKeyer,
    chain_root,
    check_cache_salt,
    tenant_root,
)

NS = hashlib.sha256(b"ns").digest()
TOKS = list(range(10))  # two blocks of 4 and a tail of 2


def _keys(root: bytes | None, fleet_key: bytes | None = None):
    return BlockKeyer(NS, 4, fleet_key, root=root).keys(TOKS)


def test_no_tenant_no_salt_is_the_namespace_chain():
    assert chain_root(NS) == NS
    assert _keys(chain_root(NS)) == BlockKeyer(NS, 4).keys(TOKS)


def test_roots_separate_every_key_and_the_tail():
    a, b = tenant_root(b"secret", "alice"), tenant_root(b"secret", "bob")
    roots = [
        NS,
        chain_root(NS, a),
        chain_root(NS, b),
        chain_root(NS, a, "s1"),
        chain_root(NS, a, "s2"),
        chain_root(NS, None, "s1"),
        chain_root(NS, b, "s1"),
    ]
    assert len(set(roots)) == len(roots)
    chains = [_keys(r) for r in roots]
    every = [k for c in chains for k in (*c.blocks, c.tail)]
    assert len(set(every)) == len(every)  # no key shared between any two roots
    assert all(len(r) == 32 for r in roots)


def test_a_salt_never_reaches_another_tenant():
    a, b = tenant_root(b"secret", "alice"), tenant_root(b"secret", "bob")
    assert chain_root(NS, b, "alice-salt") != chain_root(NS, a, "alice-salt")
    # the tenant's name is not a salt either: nothing a client sends gives a's root
    assert chain_root(NS, None, "alice") != chain_root(NS, a)
    assert chain_root(NS, b, "alice") != chain_root(NS, a)


def test_tenant_root_is_keyed_by_the_secret():
    assert tenant_root(b"k1", "t") == tenant_root(b"k1", "t")
    assert tenant_root(b"k1", "t") != tenant_root(b"k2", "t")
    assert tenant_root(b"k1", "t") != tenant_root(b"k1", "t ")
    assert tenant_root(b"k1", "ünï") != tenant_root(b"k1", "uni")
    with pytest.raises(ValueError):
        tenant_root(b"", "t")


def test_unambiguous_encoding():
    a = tenant_root(b"secret", "a")
    # salt and tenant are length-prefixed: no split of the same bytes collides
    assert chain_root(NS, a, "x") != chain_root(NS, None, "x")
    assert chain_root(NS, None, "ab") != chain_root(NS, None, "a")


def test_headers_name_the_namespace_not_the_root():
    k = BlockKeyer(NS, 4, root=chain_root(NS, None, "s"))
    keys = k.keys(TOKS)
    assert k.parent_of(keys, 0) == NS and k.parent_of(keys, 1) == keys.blocks[0]
    assert k.rooted(NS).keys(TOKS) == BlockKeyer(NS, 4).keys(TOKS)
    fk = BlockKeyer(NS, 4, b"f" * 32)
    assert fk.rooted(k.root).keys(TOKS) == BlockKeyer(NS, 4, b"f" * 32, k.root).keys(TOKS)
    assert fk.rooted(k.root).keys(TOKS) != keys  # the fleet key still applies


@pytest.mark.parametrize(
    "bad",
    [None, "", 5, 1.5, ["s"], {"a": 1}, b"s", True, "x" * (MAX_CACHE_SALT_CHARS + 1), "\ud800"],
)
def test_bad_salts_are_value_errors(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt(bad)
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="cache_salt"):
            chain_root(NS, None, bad)


@pytest.mark.parametrize("good", ["s", "x" * MAX_CACHE_SALT_CHARS, "ünïcødé 🔑", " ", "\x00"])
def test_good_salts(good):
    assert check_cache_salt(good) == good
    assert chain_root(NS, None, good) != NS


def test_bad_roots():
    with pytest.raises(ValueError):
        BlockKeyer(NS, 4, root=b"short")
    with pytest.raises(ValueError):
        chain_root(NS, b"short")
    with pytest.raises(ValueError):
        chain_root(b"short")


def test_a_callers_tail_is_its_own_and_blocks_are_shared():
    root = chain_root(NS, tenant_root(b"secret", "t"))
    me, you = hashlib.sha256(b"me").digest(), hashlib.sha256(b"you").digest()
    a = BlockKeyer(NS, 4, root=root, caller=me).keys(TOKS)
    b = BlockKeyer(NS, 4, root=root, caller=you).keys(TOKS)
    plain = BlockKeyer(NS, 4, root=root).keys(TOKS)
    assert a.blocks == b.blocks == plain.blocks  # whole blocks: shared within the tenant
    assert len({a.tail, b.tail, plain.tail}) == 3  # the exact tail: the caller's own
    assert BlockKeyer(NS, 4, root=root).rooted(root, me).keys(TOKS) == a
    with pytest.raises(ValueError):
        BlockKeyer(NS, 4, caller=b"short")
