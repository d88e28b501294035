"""The mlx engine on today's architectures: per-layer geometry and recurrent state.

- Gemma 4 (float32, and 4-bit as ``mlx_lm.convert -q`` makes it: group 64; the hub's
  multimodal layout too): sliding layers of one head dim and KV heads, full layers of
  another (``attention_k_eq_v``: still two cached arrays), KV-shared layers with no
  cache of their own (the card says ``shared``, a block ships nothing for them), MoE
  blocks.
- Qwen 3.5 (hub layout; float32 and bfloat16): Gated DeltaNet layers (conv and
  recurrent state in an ``ArraysCache``) beside full attention.
- LFM2 (short conv state) and NemotronH (Mamba2 state; MLP blocks without a cache).

For each, a producer engine prefills prompts of 1, 31, 32, 33, 65 and ~500 tokens
and exports them; the blocks travel as chunked wire bytes into a separate importer
engine. There:

- an exact repeat imports every block and the tail and uses the stored logits;
- an extension by 20 tokens from the whole blocks reuses them up to the last state
  checkpoint (all of them without recurrent layers);
- in both, the continuation (12 greedy tokens, every step's logits bitwise) equals the
  producer continuing its own cache (for the extension: its own state cut back to the
  same point with ``resume``, then extended).

The models come from the zoo (``tests/zoo.py``'s ``TODAY``); where the zoo does not
build one, :func:`_adhoc` builds it here (mlx-lm's own classes, seeded weights).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import Sampling, load_engine
from kvmesh.errors import ConfigError

from . import zoo
from .test_zoo_mlx import export, over_the_wire

LENGTHS = (1, 31, 32, 33, 65, 500)
EXTRA = 20
STEPS = 12
GREEDY = Sampling(max_tokens=STEPS, stop_on_eos=False)
MODELS = [
    ("gemma4", "float32"),
    ("gemma4", "q4"),
    ("gemma4_hub", "float32"),
    ("qwen3_5_hub", "float32"),
    ("qwen3_5_hub", "bfloat16"),
    ("qwen3_5_hub", "q4"),
    ("gpt_oss", "float32"),
    ("lfm2", "float32"),
    ("nemotron_h", "float32"),
]


def model_dir(arch: str, variant: str):
    """The zoo's mlx-lm directory of ``arch`` in ``variant``."""
    return zoo.mlx_model(arch, variant)


# -- helpers ------------------------------------------------------------------------

_engines: dict[tuple[str, str], tuple] = {}


def engines(arch: str, variant: str):
    """(producer, importer, prompt): two separate engines on one model; one pair
    alive at a time (cases run grouped by model)."""
    if (arch, variant) not in _engines:
        _engines.clear()
        path = model_dir(arch, variant)
        prompt = zoo.prompt_tokens(path, max(LENGTHS) + EXTRA)
        _engines[arch, variant] = (
            load_engine(str(path), "mlx"),
            load_engine(str(path), "mlx"),
            prompt,
        )
    return _engines[arch, variant]


def raw(logits) -> bytes:
    a = np.asarray(logits)
    assert a.dtype == np.float32
    return a.tobytes()


def continuation(engine, state):
    """12 greedy tokens from ``state`` and the logits each was chosen from."""
    tokens, logits = [], []
    for tok in engine.generate(state, GREEDY):
        tokens.append(tok)
        logits.append(raw(state.logits))
    return tokens, logits


# -- the card -----------------------------------------------------------------------


def test_gemma4_card_lists_each_layers_geometry_and_its_shared_layers():
    for variant, dtype in (("float32", "float32"), ("q4", "float16")):
        producer, _, _ = engines("gemma4", variant)
        card = producer.card
        assert card.kv_dtype == dtype and card.num_layers == 6 and not card.uniform
        assert card.layer_geometry == (
            "kv:2x32:w96",
            "kv:2x32:w96",
            "kv:1x64",  # full: global head dim, one global KV head (K = V projection)
            "kv:2x32:w96",
            "shared",  # attends with layer 3's K/V
            "shared",  # ... with layer 2's
        )
        assert card.state_every == 0
        cache = producer.prefill(zoo.prompt_tokens(producer.path, 40)).cache
        assert len(cache) == 4  # mlx-lm builds no cache for a KV-shared layer
        # one block: every own layer's K and V, nothing for the shared ones
        specs = producer.layout.layers(32)
        assert [len(s) for s in specs] == [2, 2, 2, 2, 0, 0]


def test_recurrent_cards_list_states():
    for arch, variant in (
        ("qwen3_5_hub", "float32"),
        ("lfm2", "float32"),
        ("nemotron_h", "float32"),
    ):
        producer, _, _ = engines(arch, variant)
        kinds = [g.kind for g in producer.card.geometry]
        assert producer.card.state_every > 0
        if arch == "qwen3_5_hub":  # conv state, then the recurrent state, per DeltaNet layer
            assert kinds == ["state", "state", "state", "kv"]
            assert producer.card.geometry[0].state == (
                ("float32", (1, 3, 128)),
                ("float32", (1, 4, 16, 16)),
            )
        elif arch == "lfm2":  # a conv state per conv layer
            assert kinds == ["state", "state", "kv", "state", "kv", "state"]
            assert producer.card.geometry[0].state == (("float32", (1, 2, 64)),)
        else:  # Mamba2, attention, Mamba2, an MLP block that keeps nothing
            assert kinds == ["state", "kv", "state", "none"]


def test_bfloat16_states_keep_their_own_dtypes():
    producer, _, _ = engines("qwen3_5_hub", "bfloat16")
    card = producer.card
    assert card.kv_dtype == "bfloat16"
    assert card.geometry[0].state == (("bfloat16", (1, 3, 128)), ("float32", (1, 4, 16, 16)))


# -- export, import, continue -----------------------------------------------------


@pytest.mark.parametrize(("arch", "variant", "n"), [(*m, n) for m in MODELS for n in LENGTHS])
def test_repeat_and_extension_continue_bitwise(arch, variant, n):
    producer, importer, prompt = engines(arch, variant)
    card, b = producer.card, producer.card.block_tokens
    tokens, longer = prompt[:n], prompt[: n + EXTRA]
    state = producer.prefill(tokens)
    blocks = over_the_wire(export(producer, state), importer)
    assert sum(blk.header.tokens for blk in blocks) == n and blocks[-1].header.kind == "tail"
    if card.state_every:
        carry = [bool(blk.header.states) for blk in blocks]
        last = n // b * b  # the prompt's last two whole blocks carry it too
        assert carry == [
            card.carries_state(blk.header.kind, blk.header.start)
            or (blk.header.kind == "block" and blk.header.start >= last - 2 * b)
            for blk in blocks
        ]
        assert carry[-1]  # every tail carries the state

    # exact repeat: every block and the tail, the stored logits, no forward pass
    hit = importer.prefill(tokens, blocks)
    assert hit.used_stored_logits and hit.imported_tokens == n and hit.computed_tokens == 0
    assert raw(hit.logits) == raw(state.logits)
    assert continuation(importer, hit) == continuation(producer, producer.fork(state))

    # extension from the whole blocks: every one reused (a hybrid's last carries the state)
    whole = [blk for blk in blocks if blk.header.kind == "block"]
    ext = importer.prefill(longer, whole)
    reused = n // b * b
    assert card.importable_blocks(len(whole), [bool(x.header.states) for x in whole]) * b == reused
    assert ext.imported_tokens == reused and ext.computed_tokens == len(longer) - reused
    ref = producer.resume(state, reused, longer)  # its own state cut back to the same point
    assert ref.cached == len(longer) and ref.computed_tokens == len(longer) - reused
    assert raw(ext.logits) == raw(ref.logits)
    assert continuation(importer, ext) == continuation(producer, ref)


def test_an_import_ends_on_the_last_block_that_carries_state():
    """Blocks past the last checkpoint travel but are not restored: the state only
    exists at a checkpoint, so the import restores up to there and computes on."""
    producer, importer, prompt = engines("nemotron_h", "float32")
    card, b = producer.card, producer.card.block_tokens
    every = card.state_every
    assert every > 1
    n = (every + 3) * b + 5  # three whole blocks past the first checkpoint, then a tail
    state = producer.prefill(prompt[:n])
    blocks = over_the_wire(export(producer, state), importer)
    whole = blocks[: every + 1]
    longer = prompt[: n + EXTRA]
    ext = importer.prefill(longer, whole)
    assert ext.imported_tokens == every * b
    assert raw(ext.logits) == raw(producer.resume(state, every * b, longer).logits)
    assert producer.restorable(state.cache, (every + 1) * b) == every * b


def test_a_decoded_state_exports_its_live_state():
    """Decode steps keep no state at their end (only grid points they cross): the
    tail of a decoded state carries the live state, and a crop goes back to the
    last grid point."""
    producer, importer, prompt = engines("lfm2", "float32")
    b = producer.card.block_tokens
    assert producer.card.state_every == 1
    state = producer.prefill(prompt[:20])
    assert len(list(producer.generate(state, Sampling(max_tokens=50, stop_on_eos=False)))) == 50
    producer.decode_batch([state])  # the last sampled token, forwarded as a decode step
    assert state.cached == len(state.tokens) == 70
    assert producer.restorable(state.cache, 70) == 70  # the live state
    assert producer.restorable(state.cache, 69) == 2 * b  # a grid point decoding crossed
    blocks = over_the_wire(export(producer, state), importer)
    assert [(blk.header.kind, bool(blk.header.states)) for blk in blocks] == [
        ("block", True),
        ("block", True),
        ("tail", True),
    ]
    hit = importer.prefill(state.tokens, blocks)
    assert hit.used_stored_logits and raw(hit.logits) == raw(state.logits)
    assert continuation(importer, hit) == continuation(producer, producer.fork(state))
    longer = state.tokens[:66] + prompt[100:110]
    ext = importer.prefill(longer, blocks[:2])
    ref = producer.resume(state, 66, longer)  # cut back to the grid point at 64
    assert ext.imported_tokens == ref.imported_tokens == 2 * b
    assert raw(ext.logits) == raw(ref.logits)
    assert continuation(importer, ext) == continuation(producer, ref)


def test_a_session_resume_on_a_hybrid_reuses_up_to_a_kept_state():
    from kvmesh.runtime.head import HeadRuntime

    engine, _, prompt = engines("qwen3_5_hub", "float32")
    every = engine.card.state_every * engine.card.block_tokens
    head = HeadRuntime(engine, None, publish=False)
    try:
        sampling = Sampling(max_tokens=40, stop_on_eos=False)
        first = prompt[:40]
        out = head.complete(first, sampling)
        follow = first + out.tokens[:-1] + prompt[200:210]
        again = head.complete(follow, Sampling(max_tokens=5, stop_on_eos=False))
        assert again.report is not None and again.report.source == "session"
        assert again.report.reused_tokens == len(first) + len(out.tokens) - 1  # the live state
        own = engine.prefill(first)  # the session's state, as the engine alone makes it
        list(engine.generate(own, sampling))
        resumed = engine.resume(own, again.report.reused_tokens, follow)
        assert again.tokens == list(
            engine.generate(resumed, Sampling(max_tokens=5, stop_on_eos=False))
        )
        # a follow-up that differs inside the session: back to the last checkpoint
        cut = every + 6
        edited = follow[:cut] + prompt[300:310]
        third = head.complete(edited, Sampling(max_tokens=5, stop_on_eos=False))
        assert third.report is not None and third.report.source == "session"
        assert third.report.reused_tokens == every
        ref = engine.resume(own, cut, edited)  # the engine alone: its checkpoint, then on
        assert ref.imported_tokens == every
        assert third.tokens == list(engine.generate(ref, Sampling(max_tokens=5, stop_on_eos=False)))
    finally:
        head.close()


# -- what cannot run or cannot be restored is an error at load ------------------------


def test_a_bfloat16_moe_is_refused_at_load_on_the_cpu():
    """mlx's CPU gather_mm runs float32 only: a bfloat16 Gemma 4 MoE cannot run here."""
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("Metal runs bfloat16 MoE: nothing to refuse")
    src = model_dir("gemma4", "float32")
    bf16 = zoo.convert_mlx(src, zoo.zoo_home() / "gemma4-today-bfloat16", "bfloat16")
    with pytest.raises(ConfigError, match="float32 or quantized") as refused:
        load_engine(str(bf16), "mlx")
    from kvmesh.errors import CannotRestore

    assert not isinstance(refused.value, CannotRestore)  # the model cannot run at all


def test_caches_kvmesh_cannot_map_or_restore_turn_reuse_off(monkeypatch):
    """A cache kvmesh cannot map or restore is no error at load: the model is served
    with reuse off (the reason said), nothing exported or imported."""
    import mlx_lm.models.nemotron_h as nemotron_h
    import mlx_lm.models.qwen3_5 as qwen3_5
    from mlx_lm.models.cache import ArraysCache, ConcatenateKVCache

    from kvmesh.errors import CacheMiss

    latent = zoo.convert_mlx(zoo.latent_model(), zoo.zoo_home() / "latent-mlx-today", "float32")
    engine = load_engine(str(latent), "mlx")  # K and V of other shapes
    assert engine.reuse_off is not None and "latent attention" in engine.reuse_off
    state = engine.prefill(list(range(5, 80)))
    assert engine.export(state, BlockKeyer(engine.card.namespace, 32)) == []
    with pytest.raises(CacheMiss):
        engine.importer(32)
    sampling = Sampling(max_tokens=4, stop_on_eos=False)
    assert list(engine.generate(engine.fork(state), sampling)) == list(
        engine.generate(state, sampling)
    )

    def mamba_only(self):  # caches for some layers, and no way to tell which
        return [ArraysCache(size=2) for layer in self.layers if layer.block_type == "M"]

    monkeypatch.setattr(nemotron_h.Model, "make_cache", mamba_only)
    engine = load_engine(str(model_dir("nemotron_h", "float32")), "mlx")
    assert engine.reuse_off is not None and "which layer" in engine.reuse_off

    def other(self):  # a cache class kvmesh does not restore
        return [ArraysCache(size=2) if x.is_linear else ConcatenateKVCache() for x in self.layers]

    monkeypatch.setattr(qwen3_5.TextModel, "make_cache", other)
    engine = load_engine(str(model_dir("qwen3_5_hub", "float32")), "mlx")
    assert engine.reuse_off is not None and "ConcatenateKVCache" in engine.reuse_off
