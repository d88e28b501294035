"""Every block is checked against the card's tensor specs, whatever tier it came
from (issue 21, finding 2): one check (:func:`kvmesh.codec.check_header`) behind
decoding, the store (RAM and disk) and every import; a disk file whose header
describes fewer layers than the model has is never imported."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvmesh.codec import (
    PREFIX,
    Block,
    BlockHeader,
    Layout,
    TensorSpec,
    check_block,
    check_form,
    check_header,
    decode_block,
    digest_blob,
    new_blob,
    parse_prefix,
)
from kvmesh.compat import dtype_size
from kvmesh.engine.base import Importer, check_chain
from kvmesh.errors import IncompatibleCard, MalformedPayload
from kvmesh.store import BlockStore, DiskConfig

from .helpers import small_card, synthetic_chain

CARD = small_card(num_layers=4, sliding_windows=(0, 0, 0, 0))
LAYOUT = Layout(CARD)
TOKS = list(range(14))  # three blocks of 4 and a 2-token tail
BIG = 1 << 30


def chain() -> list[Block]:
    return synthetic_chain(CARD, TOKS)


def resealed(block: Block, **over: Any) -> Block:
    """``block`` with header fields replaced, its payload cut or padded to what the
    new header announces and sealed with a valid digest: only a spec check can
    tell it from a good block."""
    header = _replace(block.header, **over)
    blob, view = new_blob(header)
    old = bytes(block.payload())
    view[:] = (old + bytes(len(view)))[: len(view)]
    return LAYOUT.seal(header, blob)


def _replace(h: BlockHeader, **over: Any) -> BlockHeader:
    fields = dict(
        namespace=h.namespace,
        key=h.key,
        parent=h.parent,
        kind=h.kind,
        start=h.start,
        tokens=h.tokens,
        layers=h.layers,
        logits=h.logits,
    )
    fields.update(over)
    return BlockHeader(**fields)  # type: ignore[arg-type]


def fewer_layers(block: Block, n: int = 2) -> Block:
    return resealed(block, layers=block.header.layers[:n])


LIES = {
    "fewer layers": lambda b: fewer_layers(b),
    "more layers": lambda b: resealed(b, layers=b.header.layers * 2),
    "wrong dtype": lambda b: resealed(
        b, layers=tuple(tuple(TensorSpec("float16", t.shape) for t in la) for la in b.header.layers)
    ),
    "wrong shape": lambda b: resealed(
        b,
        layers=tuple(
            tuple(TensorSpec(t.dtype, (t.shape[0] * 2, *t.shape[1:])) for t in la)
            for la in b.header.layers
        ),
    ),
    "a K without a V": lambda b: resealed(b, layers=tuple(la[:1] for la in b.header.layers)),
    "logits on a block": lambda b: resealed(b, logits=LAYOUT.logits()),
    "wrong token count": lambda b: resealed(b, tokens=3),
    "off a block boundary": lambda b: resealed(b, start=b.header.start + 1),
}


# -- the one check -------------------------------------------------------------


def test_good_blocks_pass_every_check():
    blocks = chain()
    for b in blocks:
        check_block(b, LAYOUT)
        check_form(b.header)
        assert decode_block(bytes(b.blob), LAYOUT, b.digest).header == b.header
    assert check_chain(blocks, LAYOUT, len(TOKS)) == len(TOKS)


@pytest.mark.parametrize("lie", sorted(LIES))
def test_each_lie_is_refused_by_the_check_decode_and_the_chain(lie):
    blocks = chain()
    bad = LIES[lie](blocks[1])
    with pytest.raises(MalformedPayload):  # the header alone tells
        check_header(bad.header, LAYOUT)
    with pytest.raises(MalformedPayload):
        check_block(bad, LAYOUT)
    with pytest.raises(MalformedPayload):  # a peer's bytes: the same check
        decode_block(bytes(bad.blob), LAYOUT, bad.digest)
    with pytest.raises(MalformedPayload):  # an import, whatever tier it came from
        check_chain([blocks[0], bad, *blocks[2:]], LAYOUT, len(TOKS))


@pytest.mark.parametrize(
    "over",
    [
        {"logits": None},  # a tail without logits
        {"logits": TensorSpec("float32", (CARD.vocab_size + 1,))},
        {"logits": TensorSpec("float16", (CARD.vocab_size,))},
        {"tokens": CARD.block_tokens},  # a tail as long as a block
    ],
)
def test_a_tail_must_carry_the_cards_logits(over):
    tail = chain()[-1]
    with pytest.raises(MalformedPayload):
        check_block(resealed(tail, **over), LAYOUT)


def test_another_namespace_is_incompatible_not_a_copy():
    other = small_card(model_id="other", num_layers=4, sliding_windows=(0, 0, 0, 0))
    with pytest.raises(IncompatibleCard):
        check_block(synthetic_chain(other, TOKS)[0], LAYOUT)


def test_bytes_that_disagree_with_the_header_are_refused():
    b = chain()[0]
    short = Block(b.header, b.blob[:-1], b.digest, b.payload_offset)
    with pytest.raises(MalformedPayload):
        check_block(short, LAYOUT)


def test_the_card_free_form_check_catches_what_needs_no_card():
    b = chain()[1]
    with pytest.raises(MalformedPayload):
        check_form(LIES["a K without a V"](b).header)
    with pytest.raises(MalformedPayload):
        check_form(LIES["logits on a block"](b).header)
    wrong_axis = tuple(tuple(TensorSpec(t.dtype, (2, 5, 4)) for t in la) for la in b.header.layers)
    with pytest.raises(MalformedPayload):
        check_form(_replace(b.header, layers=wrong_axis))
    check_form(fewer_layers(b).header)  # a whole layer fewer needs the card to be seen


# -- import ----------------------------------------------------------------------


class _Recording(Importer):
    """A real importer whose copy only records which blocks reached it."""

    def __init__(self, n_tokens: int, layout: Layout | None) -> None:
        super().__init__(n_tokens, layout)
        self.copied: list[bytes] = []

    def _copy(self, block: Block) -> None:
        assert len(list(block.kv_tensors())) == 2 * CARD.num_layers  # one per buffer
        self.copied.append(block.key)

    def cache(self) -> Any:
        return None


def test_importer_checks_before_copying():
    blocks = chain()
    imp = _Recording(len(TOKS), LAYOUT)
    imp.add(blocks[0])
    with pytest.raises(MalformedPayload):
        imp.add(fewer_layers(blocks[1]))
    assert imp.copied == [blocks[0].key] and imp.added == 1  # nothing written for the bad one


def test_kv_tensors_leave_the_tails_logits_out():
    tail = chain()[-1]
    kv, every = list(tail.kv_tensors()), list(tail.tensors())
    assert len(kv) == 2 * CARD.num_layers and every[:-1] == kv
    assert every[-1][0] == LAYOUT.logits() and len(every[-1][1]) == LAYOUT.logits().nbytes


def test_an_engine_prefill_refuses_a_block_with_fewer_layers(tiny_engine):
    from kvmesh.blocks import BlockKeyer

    eng = tiny_engine
    toks = eng.encode("Specs are checked on import. " * 12)
    keyer = BlockKeyer(eng.card.namespace, eng.card.block_tokens)
    blocks = eng.export(eng.prefill(toks), keyer)
    assert eng.card.num_layers > 2
    header = blocks[1].header
    header = _replace(header, layers=header.layers[:2])
    blob, view = new_blob(header)
    view[:] = bytes(blocks[1].payload())[: len(view)]
    bad = eng.layout.seal(header, blob)
    with pytest.raises(MalformedPayload, match="layer count"):
        eng.prefill(toks, [blocks[0], bad, *blocks[2:]])


# -- the store: RAM and disk -----------------------------------------------------


def test_a_store_that_knows_the_card_refuses_a_bad_put():
    s = BlockStore(BIG, layouts=[LAYOUT])
    blocks = chain()
    s.put(blocks[0])
    with pytest.raises(MalformedPayload):
        s.put(fewer_layers(blocks[1]))
    assert s.stats.rejects == {"malformed_payload": 1} and blocks[1].key not in s


def _plant(tmp_path: Path) -> tuple[list[Block], Block]:
    """A disk tier holding the chain with block 1 replaced by a 2-layer copy."""
    s = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG))
    blocks = chain()
    bad = fewer_layers(blocks[1])
    for b in (blocks[0], bad, *blocks[2:]):
        s.put(b)
    assert s.flush(10)
    s.close()
    return blocks, bad


def test_without_the_card_the_disk_tier_serves_it_and_import_refuses(tmp_path):
    blocks, bad = _plant(tmp_path)
    s = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG))
    m = s.longest_prefix([b.key for b in blocks[:2]])
    assert m.blocks[1].digest == bad.digest  # structurally fine: only the card can tell
    with pytest.raises(MalformedPayload):
        check_chain(m.blocks, LAYOUT, len(TOKS))


def test_expect_deletes_and_counts_a_disk_file_that_disagrees_with_the_card(tmp_path):
    blocks, bad = _plant(tmp_path)
    s = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG))
    assert s.expect(LAYOUT) == 1
    assert s.disk_stats.corrupt == 1
    assert not (tmp_path / "blocks" / f"{bad.digest.hex()}.kvb").exists()
    m = s.longest_prefix([b.key for b in blocks[:3]], blocks[3].key)
    assert [b.key for b in m.blocks] == [blocks[0].key]  # its subtree went with it
    check_chain(m.blocks, LAYOUT, len(TOKS))


def test_a_store_built_with_the_card_drops_the_file_at_its_scan(tmp_path):
    blocks, bad = _plant(tmp_path)
    s = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG), layouts=[LAYOUT])
    assert s.disk_stats.corrupt == 1 and s.disk_stats.orphans == 2  # block 2 and the tail
    assert s.longest_prefix([b.key for b in blocks[:3]]).tokens == CARD.block_tokens


def test_a_header_that_breaks_the_card_free_form_is_deleted_at_scan(tmp_path):
    """Strict on read even with no card known: K without V is no block of any card."""
    blocks = chain()
    s = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG))
    s.put(blocks[0])
    assert s.flush(10)
    s.close()
    (f,) = (tmp_path / "blocks").iterdir()
    rewrite_header(f, lambda doc: doc["layers"].__setitem__(0, doc["layers"][0][:1]))
    s2 = BlockStore(BIG, disk=DiskConfig(str(tmp_path), BIG))
    assert s2.disk_stats.corrupt == 1 and s2.disk_stats.entries == 0


# -- a real head process ---------------------------------------------------------


def rewrite_header(f: Path, mutate: Any) -> Path:
    """Rewrite the block file ``f``: ``mutate`` its header JSON, cut the payload to
    what the new header announces and store it under its new BLAKE3 name, so the
    file is whole and its digest valid (only a spec check can refuse it)."""
    raw = f.read_bytes()
    end = PREFIX.size + parse_prefix(raw)
    doc = json.loads(raw[PREFIX.size : end])
    mutate(doc)
    specs = [t for layer in doc["layers"] for t in layer] + (
        [doc["logits"]] if doc["logits"] else []
    )
    size = sum(dtype_size(dt) * _prod(shape) for dt, shape in specs)
    hdr = json.dumps(doc, separators=(",", ":")).encode()
    blob = PREFIX.pack(b"KVB1", len(hdr)) + hdr + raw[end : end + size]
    assert len(blob) == PREFIX.size + len(hdr) + size
    new = f.with_name(digest_blob(blob, "blake3").hex() + ".kvb")
    new.write_bytes(blob)
    os.unlink(f)
    return new


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_head_process_never_imports_a_planted_file_with_fewer_layers(tmp_path):
    """A real `kvmesh head --disk`: after a cold answer and a stop, one block file is
    rewritten to describe 2 of the model's layers (payload cut to match, digest
    valid). After a restart the same prompt gets the cold answer, and the file is
    counted: as a prefill fallback when the head imports it (the spec check at
    import), or as a corrupt disk file once the store knows the card (the
    store's check at start, ``BlockStore.expect``)."""
    from .test_api import Head
    from .test_disk import _cached, _completion, _wait, block_files

    disk = tmp_path / "disk"
    text = "A block file must match the model it is imported into. " * 20

    def start() -> Head:
        return Head("--disk", str(disk), "--disk-budget", "64MiB", "--alias", "spec")

    h = start()
    try:
        cold = _completion(h, text)
        n = cold["usage"]["prompt_tokens"]
        _wait(lambda: len(block_files(disk)) >= n // 32, "disk writes")
    finally:
        h.stop()
    bt = 32
    assert n >= 3 * bt
    layers = json.loads(_header_bytes(block_files(disk)[bt]))["layers"]
    assert len(layers) > 2
    rewrite_header(block_files(disk)[bt], lambda doc: doc.__setitem__("layers", doc["layers"][:2]))
    h = start()
    try:
        corrupt0 = h.metric('kvmesh_tier_corrupt_total{tier="disk"}')
        out = _completion(h, text)
        assert out["choices"][0]["text"] == cold["choices"][0]["text"]
        assert _cached(out) <= bt  # never the planted block, nor anything after it
        fallback = h.metric('kvmesh_fallbacks_total{reason="malformed_payload"}')
        corrupt = h.metric('kvmesh_tier_corrupt_total{tier="disk"}')
        assert fallback + corrupt == 1, (fallback, corrupt0, corrupt, out["kvmesh"])
        if fallback:  # refused at import: the whole prompt computed, the reason reported
            assert out["kvmesh"]["source"] == "compute"
            assert out["kvmesh"]["fallback"] == "malformed_payload"
    finally:
        h.stop()


def _header_bytes(f: Path) -> bytes:
    raw = f.read_bytes()
    return raw[PREFIX.size : PREFIX.size + parse_prefix(raw)]
