import hashlib
import struct

import pytest

from kvmesh.blocks import BlockKeyer, Media, adapter_digest, chain_root, request_root

NS = hashlib.sha256(b"ns").digest()


def test_chain_depends_on_every_earlier_token():
    k = BlockKeyer(NS, 4)
    a = k.keys(list(range(12)))
    b = k.keys([99] + list(range(1, 12)))
    assert len(a.blocks) == 3 and a.tail_tokens == 0
    assert all(x != y for x, y in zip(a.blocks, b.blocks, strict=True))
    c = k.keys(list(range(8)) + [0, 0, 0, 0])
    assert a.blocks[:2] == c.blocks[:2] and a.blocks[2] != c.blocks[2]


def test_tail_is_token_exact_and_distinct_from_blocks():
    k = BlockKeyer(NS, 4)
    a = k.keys(list(range(10)))
    assert a.tail_tokens == 2
    assert k.keys(list(range(10))).tail == a.tail
    assert k.keys(list(range(9)) + [7]).tail != a.tail
    assert k.keys(list(range(9))).tail != a.tail
    # an empty tail (n % B == 0) still has a key: it carries logits only
    assert k.keys(list(range(8))).tail not in k.keys(list(range(8))).blocks


def test_hmac_keys_differ_from_plain_and_between_fleets():
    toks = list(range(16))
    plain = BlockKeyer(NS, 4).keys(toks)
    f1 = BlockKeyer(NS, 4, fleet_key=b"k1" * 16).keys(toks)
    f2 = BlockKeyer(NS, 4, fleet_key=b"k2" * 16).keys(toks)
    assert len({plain.blocks[0], f1.blocks[0], f2.blocks[0]}) == 3


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockKeyer(NS, 0)
    with pytest.raises(ValueError):
        BlockKeyer(b"short", 4)
    with pytest.raises(ValueError):
        BlockKeyer(NS, 4).block_key(NS, [1, 2])


def test_split_at_cuts_on_every_multiple_and_keeps_every_token():
    from kvmesh.blocks import split_at

    toks = list(range(100))
    assert [len(p) for p in split_at(toks, 0, 32)] == [32, 32, 32, 4]
    assert [len(p) for p in split_at(toks[:70], 10, 32)] == [22, 32, 16]  # 10..31, 32..63, 64..79
    assert sum(split_at(toks, 5, 7), []) == toks
    assert split_at([], 0, 32) == []
    # and at the extra positions asked for (a prompt's last whole blocks)
    assert [len(p) for p in split_at(toks, 10, 64, [32, 96])] == [22, 32, 32, 14]
    assert [len(p) for p in split_at(toks, 0, 64, [64, 200])] == [64, 36]


def test_a_prompt_keeps_the_state_after_its_last_two_whole_blocks_off_the_grid():
    from kvmesh.blocks import last_block_stops, stale_states

    # blocks of 32, a grid of 64: 96 is off it, 64 on it, the end (100) kept anyway
    assert last_block_stops(0, 100, 32, 64) == [96]
    assert last_block_stops(0, 160, 32, 1024) == [128]  # an end on a boundary is its own
    assert last_block_stops(500, 530, 32, 1024) == [512]  # 480: an earlier chunk's
    assert last_block_stops(0, 20, 32, 64) == []
    # a prompt's state at 530 keeps the states after its last two whole blocks
    assert stale_states([416, 448, 480, 500, 512], 530, 1024, 32) == [416, 448, 500]
    assert stale_states([64, 96, 100], 128, 64, 32) == [100]  # 64: the grid's
    assert stale_states([32, 96, 100], 160, 64, 32) == [32, 96, 100]  # 160, 128 kept


def test_text_keys_are_what_they_were():
    """Keys without media or adapter are the bytes every stored block was keyed by."""
    k = BlockKeyer(NS, 4)
    msg = NS + b"B" + (4).to_bytes(4, "little") + struct.pack("<4I", 0, 1, 2, 3)
    assert k.keys(list(range(6))).blocks[0] == hashlib.sha256(msg).digest()
    assert k.keys(list(range(6)), ()) == k.keys(list(range(6)))
    assert chain_root(NS) == NS and request_root(NS) is None
    salted = hashlib.sha256(
        b"kvmesh/chain-root/v1\x00" + NS + b"\x00" + (1).to_bytes(4, "little") + b"s"
    ).digest()
    assert chain_root(NS, None, "s") == salted


def test_a_block_sees_the_media_it_overlaps_and_text_before_it_is_shared():
    k = BlockKeyer(NS, 4)
    toks = [7] * 3 + [9] * 6 + [5] * 5  # an image's placeholders at [3, 9)
    img = Media(3, 6, hashlib.sha256(b"pixels").digest())
    other = Media(3, 6, hashlib.sha256(b"pixels, one changed").digest())
    text, a, b = k.keys(toks), k.keys(toks, [img]), k.keys(toks, [other])
    assert a.blocks[0] != text.blocks[0]  # positions 0-3 overlap the image at 3
    assert len({a.blocks[1], b.blocks[1], text.blocks[1]}) == 3
    assert a.blocks[2] != b.blocks[2] and a.tail != b.tail  # after the image: its chain
    assert k.keys(toks, [img]) == a  # the same image at the same place: the same keys
    moved = k.keys(toks, [Media(4, 5, img.digest)])
    assert moved.blocks[0] != a.blocks[0]  # the same image elsewhere is another prompt
    later = k.keys(toks, [Media(8, 2, img.digest)])
    assert later.blocks[:2] == text.blocks[:2] and later.blocks[2] != text.blocks[2]
    # a tail overlapping an item hashes it; one before it does not
    assert k.keys(toks[:13], [Media(12, 1, img.digest)]).tail != k.keys(toks[:13]).tail
    assert k.keys(toks[:13], [Media(13, 1, img.digest)]) == k.keys(toks[:13])
    with pytest.raises(ValueError):
        Media(0, 0, img.digest)
    with pytest.raises(ValueError):
        Media(0, 1, b"short")


def test_an_adapter_roots_its_own_chain(tmp_path):
    def adapter(name: str, weights: bytes, config: str = '{"r": 8}'):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(config)
        (d / "adapter_model.safetensors").write_bytes(weights)
        return d

    a = adapter_digest(adapter("a", b"\x01" * 64))
    assert adapter_digest(adapter("a-renamed", b"\x01" * 64)) == a  # identity is content
    assert adapter_digest(adapter("b", b"\x01" * 63 + b"\x02")) != a  # one weight byte
    assert adapter_digest(adapter("c", b"\x01" * 64, '{"r": 4}')) != a  # its config
    roots = {
        NS,
        chain_root(NS, adapter=a),
        chain_root(NS, adapter=adapter_digest(tmp_path / "b")),
        chain_root(NS, None, "s"),
        chain_root(NS, None, "s", a),
        chain_root(NS, hashlib.sha256(b"t").digest(), None, a),
    }
    assert len(roots) == 6 and request_root(NS, adapter=a) == chain_root(NS, adapter=a)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match="not a LoRA adapter"):
            adapter_digest(bad)
    with pytest.raises(ValueError, match="32 bytes"):
        chain_root(NS, adapter=b"short")
