import dataclasses
import json

import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.compat import CompatCard, files_digest
from kvmesh.store import BlockStore


def test_card_is_derived_from_the_model(tiny_engine, tiny_dir):
    card = tiny_engine.card
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert card.num_layers == cfg["num_hidden_layers"]
    assert card.num_kv_heads == cfg["num_key_value_heads"]
    assert card.head_dim == cfg["head_dim"]
    assert card.kv_dtype == "float32"
    assert card.sliding_windows == (0,) * card.num_layers
    assert '"rope_theta":1000000.0' in card.rope
    assert len(card.weights_digest) == 64 and len(card.tokenizer_digest) == 64
    assert card.namespace_hex[:12] in card.summary()
    assert CompatCard.from_json(card.to_json()) == card


@pytest.mark.parametrize(
    "field",
    [f.name for f in dataclasses.fields(CompatCard)],
)
def test_any_changed_field_is_a_new_namespace_and_a_miss(tiny_engine, field):
    card = tiny_engine.card
    value = getattr(card, field)
    if field == "block_digest":  # a closed set: the other algorithm
        other = "sha256" if value == "blake3" else "blake3"
    elif isinstance(value, str):
        other = value + "x"
    elif isinstance(value, tuple):
        other = value + (1,)
    else:
        other = value + 1
    changed = dataclasses.replace(card, **{field: other})
    assert changed.namespace != card.namespace

    tokens = list(range(100))
    state = tiny_engine.prefill(tokens)
    store = BlockStore(1 << 26)
    for blk in tiny_engine.export(state, BlockKeyer(card.namespace, card.block_tokens)):
        store.put(blk)
    keys = BlockKeyer(changed.namespace, card.block_tokens).keys(tokens)
    match = store.longest_prefix(keys)
    assert match.tokens == 0 and match.blocks == ()


def test_weight_digest_is_memoised_and_tracks_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    (tmp_path / "m").mkdir()
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(b"a" * 1000)
    d1 = files_digest(tmp_path / "m", ["model.safetensors"])
    cache = json.loads((tmp_path / "home" / "digests.json").read_text())
    assert len(cache) == 1
    f.write_bytes(b"b" * 1001)
    assert files_digest(tmp_path / "m", ["model.safetensors"]) != d1
