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
    elif field == "layer_geometry":  # the same cache spelled per layer is another card
        other = tuple(g.encode() for g in card.geometry)
    elif field == "state_every":  # needs a recurrent layer: one more layer, holding a state
        card = dataclasses.replace(
            card,
            num_layers=card.num_layers + 1,
            sliding_windows=(*card.sliding_windows, 0),
            layer_geometry=(*(g.encode() for g in card.geometry), "state:float32[1,8,4]"),
            state_every=2,
        )
        other = 3
    elif field == "prefill_grid":  # a multiple of the block size (0, off, is the card as before)
        other = card.block_tokens * 2
    elif isinstance(value, str):
        other = value + "x"
    elif isinstance(value, tuple):
        other = value + (1,)
    else:
        other = value + 1
    changed = dataclasses.replace(card, **{field: other})
    assert changed.namespace != card.namespace
    assert changed.namespace != tiny_engine.card.namespace

    tokens = list(range(100))
    state = tiny_engine.prefill(tokens)
    store = BlockStore(1 << 26)
    ns = tiny_engine.card.namespace
    for blk in tiny_engine.export(state, BlockKeyer(ns, card.block_tokens)):
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


def test_per_layer_geometry_round_trips_and_bad_geometry_is_refused(tiny_engine):
    from kvmesh.compat import LayerGeometry

    for text in (
        "kv:2x32",
        "kv:1x64:w512",
        "shared",
        "none",
        "state:float32[1,96,4]",
        "kv:2x16+state:bfloat16[1,2,16,16];float32[1,8,4]",
    ):
        assert LayerGeometry.decode(text).encode() == text
    for bad in ("kv:0x32", "kv:2x32:w", "state:float99[1]", "state:", "kv:2x32+shared", "x"):
        with pytest.raises(ValueError):
            LayerGeometry.decode(bad)
    card = tiny_engine.card
    with pytest.raises(ValueError):  # one geometry per layer
        dataclasses.replace(card, layer_geometry=("kv:2x16",))
    with pytest.raises(ValueError):  # a state needs its checkpoint interval, and only then
        dataclasses.replace(
            card, layer_geometry=("state:float32[4]",) * card.num_layers, state_every=0
        )
    with pytest.raises(ValueError):
        dataclasses.replace(card, state_every=1)
