"""Exactness of export / import on real forward passes (demo-tiny)."""

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import Sampling
from kvmesh.errors import MalformedPayload
from kvmesh.store import BlockStore


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


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
    assert torch.equal(imported.logits, continued.logits)  # bitwise

    # KV re-exported from the imported cache is byte-identical
    again = engine.export(imported, _keyer(engine))[: len(blocks)]
    assert [bytes(x.blob) for x in again] == [bytes(x.blob) for x in blocks]
    for layer_a, layer_b in zip(imported.cache.layers, continued.cache.layers, strict=True):
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(
            layer_a.values, layer_b.values
        )


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
    assert torch.equal(st.logits, engine.prefill(toks).logits) or torch.allclose(
        st.logits, engine.prefill(toks).logits, atol=1e-5
    )


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
