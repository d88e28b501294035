import hashlib
import json
import tracemalloc

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.codec import (
    PREFIX,
    Assembler,
    Layout,
    chunks,
    decode_block,
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


def test_digest_is_blake3_of_blob_by_default():
    block = synthetic_chain(CARD, list(range(9)))[0]
    assert CARD.block_digest == "blake3"
    assert block.digest == blake3.blake3(block.blob).digest()


def test_sha256_card_digests_with_sha256_and_is_another_namespace():
    sha = small_card(block_digest="sha256")
    assert sha.namespace != CARD.namespace  # mixed fleets never compare digests
    block = synthetic_chain(sha, list(range(9)))[0]
    assert block.digest == hashlib.sha256(block.blob).digest()
    assert decode_block(block.blob, Layout(sha), block.digest).digest == block.digest
    asm = Assembler(Layout(sha), len(block.blob), block.digest)
    asm.feed(block.blob)
    assert asm.finish().digest == block.digest


def test_digest_under_the_wrong_algorithm_is_refused():
    block = synthetic_chain(CARD, list(range(9)))[0]
    sha = hashlib.sha256(block.blob).digest()
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
