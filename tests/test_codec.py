import dataclasses
import hashlib
import json
import struct
import tracemalloc

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh import codec
from kvmesh.codec import (
    PREFIX,
    Assembler,
    Layout,
    check_block,
    chunks,
    decode_block,
    trim,
)
from kvmesh.compat import CompatCard
from kvmesh.errors import ChecksumMismatch, IncompatibleCard, MalformedPayload, OversizePayload

from .helpers import small_card, synthetic_chain

CARD = small_card()
LAYOUT = Layout(CARD)


@st.composite
def blocks(draw):
    n = draw(st.integers(1, 20))
    toks = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
    seed = draw(st.integers(0, 1000))
    chain = synthetic_chain(CARD, toks, seed)
    return draw(st.sampled_from(chain))


@given(blocks(), st.integers(1, 97))
def test_round_trip_whole_and_chunked(block, chunk):
    again = decode_block(bytes(block.blob), LAYOUT, block.digest)
    assert again.header == block.header and again.digest == block.digest
    asm = Assembler(LAYOUT, len(block.blob), block.digest)
    for c in chunks(bytes(block.blob), chunk):
        asm.feed(c)
    out = asm.finish()
    assert bytes(out.blob) == bytes(block.blob) and out.header == block.header
    assert [bytes(v) for _, v in out.tensors()] == [bytes(v) for _, v in block.tensors()]


@given(blocks(), st.data())
def test_every_truncation_is_a_typed_error(block, data):
    cut = data.draw(st.integers(0, len(block.blob) - 1))
    with pytest.raises(MalformedPayload):
        decode_block(bytes(block.blob[:cut]), LAYOUT)
    asm = Assembler(LAYOUT, len(block.blob))
    with pytest.raises(MalformedPayload):
        asm.feed(block.blob[:cut])
        asm.finish()


@given(blocks(), st.data())
def test_every_bit_flip_is_detected(block, data):
    pos = data.draw(st.integers(0, len(block.blob) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(block.blob)
    bad[pos] ^= 1 << bit
    with pytest.raises((MalformedPayload, ChecksumMismatch, IncompatibleCard)):
        decode_block(bytes(bad), LAYOUT, block.digest)


def _rewrite_header(block, mutate):
    hlen = PREFIX.unpack_from(block.blob, 0)[1]
    doc = json.loads(bytes(block.blob[PREFIX.size : PREFIX.size + hlen]))
    mutate(doc)
    hdr = json.dumps(doc).encode()
    return PREFIX.pack(b"KVB1", len(hdr)) + hdr + bytes(block.payload())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["layers"][0][0].__setitem__(0, "float16"),  # wrong dtype
        lambda d: d["layers"][0][1].__setitem__(1, [2, 5, 4]),  # wrong shape
        lambda d: d["layers"].pop(),  # wrong layer count
        lambda d: d.__setitem__("tokens", 3),  # block with wrong token count
        lambda d: d.__setitem__("kind", "bogus"),
        lambda d: d.__setitem__("start", 3),
        lambda d: d.__setitem__("key", "zz"),
        lambda d: d.__setitem__("tokens", True),
        lambda d: d.__setitem__("layers", "nope"),
    ],
)
def test_header_lies_are_rejected(mutate):
    block = synthetic_chain(CARD, list(range(9)))[0]
    with pytest.raises(MalformedPayload):
        decode_block(_rewrite_header(block, mutate), LAYOUT)


def test_wrong_namespace_is_incompatible():
    other = small_card(model_id="other")
    block = synthetic_chain(other, list(range(9)))[0]
    with pytest.raises(IncompatibleCard):
        decode_block(bytes(block.blob), LAYOUT)


def test_oversize_announcements_allocate_nothing():
    tracemalloc.start()
    try:
        with pytest.raises(OversizePayload):
            Assembler(LAYOUT, 1 << 40)
        with pytest.raises(OversizePayload):
            decode_block(PREFIX.pack(b"KVB1", 1 << 31) + b"x" * 100, LAYOUT)
        asm = Assembler(LAYOUT, LAYOUT.max_block_bytes)
        with pytest.raises(OversizePayload):
            asm.feed(PREFIX.pack(b"KVB1", 1 << 30))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_announced_size_must_match_header():
    block = synthetic_chain(CARD, list(range(9)))[0]
    asm = Assembler(LAYOUT, len(block.blob) + 8)
    with pytest.raises(MalformedPayload):
        asm.feed(block.blob)


def _root(block, h):
    """A block's digest as the schema states it, computed here independently: the
    hash of the domain, the header's bytes and each part's hash (every layer's K/V,
    the states, the logits)."""
    hlen = struct.unpack_from("<I", block.blob, 4)[0]
    header = block.blob[8 : 8 + hlen]
    payload, off, parts = block.blob[8 + hlen :], 0, []
    for size in block.header.part_sizes:
        parts.append(h(payload[off : off + size]).digest())
        off += size
    assert off == len(payload)
    framed = b"kvmesh/block/v5\0" + struct.pack("<I", hlen) + header
    return h(framed + struct.pack("<H", len(parts)) + b"".join(parts)).digest()


def test_digest_is_blake3_of_the_header_and_parts_by_default():
    block = synthetic_chain(CARD, list(range(9)))[0]
    assert CARD.block_digest == "blake3"
    assert block.digest == _root(block, blake3.blake3)
    assert len(block.parts) == CARD.num_layers + 2


def test_sha256_card_digests_with_sha256_and_is_another_namespace():
    sha = small_card(block_digest="sha256")
    assert sha.namespace != CARD.namespace  # mixed fleets never compare digests
    block = synthetic_chain(sha, list(range(9)))[0]
    assert block.digest == _root(block, hashlib.sha256)
    assert decode_block(block.blob, Layout(sha), block.digest).digest == block.digest
    asm = Assembler(Layout(sha), len(block.blob), block.digest)
    asm.feed(block.blob)
    assert asm.finish().digest == block.digest


def test_digest_under_the_wrong_algorithm_is_refused():
    block = synthetic_chain(CARD, list(range(9)))[0]
    sha = _root(block, hashlib.sha256)
    with pytest.raises(ChecksumMismatch):
        decode_block(block.blob, LAYOUT, sha)
    asm = Assembler(LAYOUT, len(block.blob), sha)
    asm.feed(block.blob)
    with pytest.raises(ChecksumMismatch):
        asm.finish()


def test_unknown_digest_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="block digest"):
        small_card(block_digest="md5")
    with pytest.raises(ValueError, match="block digest"):
        CompatCard.from_json({**CARD.to_json(), "block_digest": "crc32"})


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_garbage_never_crashes(raw):
    with pytest.raises(MalformedPayload):
        decode_block(raw, LAYOUT)


def test_decoded_headers_share_the_layouts_specs():
    """The card's layers are recognised in one comparison and the decoded header
    holds the layout's own spec objects, so later checks compare by identity."""
    block = synthetic_chain(CARD, list(range(9)))[0]
    h = decode_block(bytes(block.blob), LAYOUT).header
    assert h.layers is LAYOUT.layers(h.tokens)


def test_unknown_dtype_is_a_malformed_header_not_a_crash():
    from kvmesh.codec import read_header

    block = synthetic_chain(CARD, list(range(9)))[0]
    raw = _rewrite_header(block, lambda d: d["layers"][0][0].__setitem__(0, "float7"))
    with pytest.raises(MalformedPayload, match="unknown dtype"):
        read_header(raw[PREFIX.size : PREFIX.size + PREFIX.unpack_from(raw, 0)[1]])


SLIDING = small_card(num_layers=3, sliding_windows=(8, 0, 8))


def test_keep_from_names_each_layers_first_needed_block():
    """An import of [0, n) needs a full layer's every position, a sliding layer's
    from the block holding n - 1 - W (window W; the import may be cut to n - 1),
    and trims nothing where that saves no block, or on a card whose import may end
    on a recurrent checkpoint."""
    lay = Layout(SLIDING)
    assert lay.keep_from(40) == (28, 0, 28)  # 40 - 1 - 8 = 31 -> block at 28
    assert lay.keep_from(12) is None  # 12 - 1 - 8 = 3: block 0, nothing saved
    assert lay.keep_from(13) == (4, 0, 4)
    assert Layout(CARD).keep_from(400) is None  # no sliding layer


def test_a_trimmed_block_keeps_the_producers_digest_and_only_its_parts():
    lay = Layout(SLIDING)
    chain = synthetic_chain(SLIDING, list(range(41)))
    keep = lay.keep_from(41)
    assert keep == (32, 0, 32)
    for blk in chain:
        want = lay.want(blk.header, keep)
        part = trim(blk, want)
        check_block(part, lay)
        assert part.digest == blk.digest
        end = blk.header.start + blk.header.tokens
        if end <= 32:  # before the window: only the full layer (and empty parts) travel
            assert [i for i, _ in part.kv_layers()] == [1]
            assert len(part.blob) < len(blk.blob)
            with pytest.raises(ValueError):
                list(part.kv_tensors())
        else:
            assert part is blk and part.whole
        whole = dict(blk.kv_layers())
        for i, tensors in part.kv_layers():
            assert [bytes(v) for _, v in tensors] == [bytes(v) for _, v in whole[i]]
        if blk.header.logits is not None:
            assert bytes(part.logits_bytes()) == bytes(blk.logits_bytes())


def test_a_trimmed_block_whose_bytes_lie_is_refused():
    lay = Layout(SLIDING)
    blk = synthetic_chain(SLIDING, list(range(41)))[0]
    part = trim(blk, lay.want(blk.header, lay.keep_from(41)))
    short = dataclasses.replace(part, blob=part.blob[:-1])
    with pytest.raises(MalformedPayload):
        check_block(short, lay)
    with pytest.raises(ValueError):
        trim(part, codec.ALL)
