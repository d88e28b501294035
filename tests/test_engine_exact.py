"""Exactness of export / import on real forward passes (demo-tiny), on every engine."""

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import Sampling
from kvmesh.errors import MalformedPayload
from kvmesh.store import BlockStore


@pytest.fixture(scope="module", params=["torch", "mlx", "mlx-q8"])
def engine(request, tiny_engine):
    if request.param == "torch":
        return tiny_engine
    from kvmesh.engine import load_engine

    if request.param == "mlx-q8":  # mlx-lm's QuantizedKVCache: (packed, scales, biases) per K and V
        return load_engine("demo-tiny", "mlx", kv_bits=8, kv_group_size=32)
    return load_engine("demo-tiny", "mlx")


def same(a, b) -> bool:
    """Bitwise equality of two logits vectors (torch or mlx)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _keyer(engine):
    return BlockKeyer(engine.card.namespace, engine.card.block_tokens)


def _prompt(engine, n=150):
    text = "The quick brown fox jumps over the lazy dog. " * 10
    return engine.encode(text)[:n]


def test_export_import_is_byte_identical_and_continuation_bitwise_equal(engine):
    toks = _prompt(engine)
    b = engine.card.block_tokens
    p = (len(toks) // b - 1) * b  # prefix ends on a block boundary before the end
    local = engine.prefill(toks[:p])
    blocks = engine.export(local, _keyer(engine))[:-1]  # full blocks only
    assert sum(x.header.tokens for x in blocks) == p

    imported = engine.prefill(toks, blocks)
    assert imported.imported_tokens == p and imported.computed_tokens == len(toks) - p
    continued = engine.extend(local, toks[p:])
    assert same(imported.logits, continued.logits)  # bitwise

    # KV re-exported from the imported cache is byte-identical
    again = engine.export(imported, _keyer(engine))[: len(blocks)]
    assert [bytes(x.blob) for x in again] == [bytes(x.blob) for x in blocks]
    # and the whole cache after the suffix (imported + computed) equals the local one
    cont = engine.export(continued, _keyer(engine))
    assert [bytes(x.blob) for x in engine.export(imported, _keyer(engine))] == [
        bytes(x.blob) for x in cont
    ]


def test_greedy_tokens_equal_cold_full_prefill(engine):
    toks = _prompt(engine)
    s = Sampling(max_tokens=12)
    cold = list(engine.generate(engine.prefill(toks), s))
    store = BlockStore(1 << 26)
    for blk in engine.export(engine.prefill(toks[:100]), _keyer(engine)):
        store.put(blk)
    m = store.longest_prefix(_keyer(engine).keys(toks))
    assert m.tokens == 96 and m.tail is None
    hit = list(engine.generate(engine.prefill(toks, m.all()), s))
    assert hit == cold


def test_exact_repeat_uses_stored_logits_without_a_forward_pass(engine, monkeypatch):
    toks = _prompt(engine)
    state = engine.prefill(toks)
    blocks = engine.export(state, _keyer(engine))
    assert blocks[-1].header.kind == "tail"
    sampling = Sampling(max_tokens=1, temperature=0.8, seed=3)
    cold_first = next(engine.generate(state, sampling))

    calls = []
    orig = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda *a: calls.append(a) or orig(*a))
    again = engine.prefill(toks, blocks)
    first = next(engine.generate(again, sampling))
    assert calls == [] and again.used_stored_logits and again.computed_tokens == 0
    assert first == cold_first


def test_full_blocks_without_logits_recompute_only_the_last_token(engine):
    toks = _prompt(engine, 128)
    blocks = engine.export(engine.prefill(toks), _keyer(engine))[:-1]
    st = engine.prefill(toks, blocks)
    assert st.computed_tokens == 1 and st.imported_tokens == 127
    # the last token is recomputed: equal to continuing the local cache the same way
    local = engine.resume(engine.prefill(toks), 127, toks)
    assert same(st.logits, local.logits)


def test_sampled_decode_is_reproducible(engine):
    toks = _prompt(engine, 40)
    s = Sampling(max_tokens=10, temperature=1.0, top_p=0.9, seed=11)
    a = list(engine.generate(engine.prefill(toks), s))
    b = list(engine.generate(engine.prefill(toks), s))
    assert a == b


def test_broken_chains_are_rejected(engine):
    toks = _prompt(engine)
    blocks = engine.export(engine.prefill(toks), _keyer(engine))
    with pytest.raises(MalformedPayload):
        engine.prefill(toks, [blocks[0], blocks[2]])  # a hole
    with pytest.raises(MalformedPayload):
        engine.prefill(toks[:40], blocks)  # longer than the prompt


def test_torch_and_mlx_cards_for_the_same_weights_are_different_namespaces(tiny_engine):
    from kvmesh.engine import load_engine

    mlx = load_engine("demo-tiny", "mlx")
    assert mlx.card.weights_digest == tiny_engine.card.weights_digest
    assert mlx.card.namespace != tiny_engine.card.namespace
    toks = _prompt(tiny_engine, 100)
    store = BlockStore(1 << 26)
    for blk in tiny_engine.export(tiny_engine.prefill(toks), _keyer(tiny_engine)):
        store.put(blk)
    assert store.longest_prefix(_keyer(mlx).keys(toks)).tokens == 0


def test_kv_quantization_is_part_of_the_card(tiny_engine):
    from kvmesh.engine import load_engine

    plain = load_engine("demo-tiny", "mlx")
    q8 = load_engine("demo-tiny", "mlx", kv_bits=8, kv_group_size=32)
    q4 = load_engine("demo-tiny", "mlx", kv_bits=4, kv_group_size=32)
    assert len({plain.card.namespace, q8.card.namespace, q4.card.namespace}) == 3
    assert q4.card.kv_bytes_per_token < q8.card.kv_bytes_per_token < plain.card.kv_bytes_per_token
    toks = _prompt(q8, 70)
    blocks = q8.export(q8.prefill(toks), _keyer(q8))
    assert blocks[0].nbytes - blocks[0].payload_offset == q8.card.kv_bytes_per_token * 32
