"""mlx-lm sliding-window layers (RotatingKVCache): prefixes of any length export and
import exactly, before and after decode steps rotate the layers in place."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer

WINDOW = 64


@pytest.fixture(scope="module")
def swa_engine(tiny_dir, tmp_path_factory):
    """demo-tiny's weights as a Llama with alternating sliding / full attention layers."""
    from safetensors.numpy import load_file, save_file

    from kvmesh.engine import load_engine

    d = tmp_path_factory.mktemp("swa") / "llama-swa-tiny"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        _name_or_path="llama-swa-tiny",
        sliding_window=WINDOW,
        attention_bias=False,
        mlp_bias=False,
        layer_types=["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2),
    )
    (d / "config.json").write_text(json.dumps(cfg))
    w = {
        k: v for k, v in load_file(str(d / "model.safetensors")).items() if not k.endswith(".bias")
    }
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return load_engine(str(d), "mlx")


def _same(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_card_records_the_windows_and_caches_rotate(swa_engine):
    from mlx_lm.models.cache import RotatingKVCache

    assert swa_engine.card.sliding_windows == (WINDOW, 0, WINDOW, 0)
    assert any(isinstance(c, RotatingKVCache) for c in swa_engine.new_cache())


def test_prefix_within_the_window_is_exact(swa_engine):
    keyer = BlockKeyer(swa_engine.card.namespace, swa_engine.card.block_tokens)
    toks = swa_engine.encode("sliding windows rotate; " * 3)[:60]
    blocks = swa_engine.export(swa_engine.prefill(toks), keyer)
    assert [b.header.kind for b in blocks] == ["block", "tail"]
    again = swa_engine.prefill(toks, blocks)
    assert again.used_stored_logits
    longer = toks + swa_engine.encode(" and then some more text beyond the window" * 2)
    imported = swa_engine.prefill(longer, blocks[:1])  # 32 tokens, then 90 computed past the window
    local = swa_engine.extend(swa_engine.prefill(toks[:32]), longer[32:])
    assert imported.imported_tokens == 32 and _same(imported.logits, local.logits)


def test_beyond_the_window_the_whole_prompt_travels_and_continues_exactly(swa_engine):
    keyer = BlockKeyer(swa_engine.card.namespace, swa_engine.card.block_tokens)
    toks = swa_engine.encode("x y z " * 200)[:150]
    assert len(toks) == 150 > 2 * WINDOW
    state = swa_engine.prefill(toks)
    blocks = swa_engine.export(state, keyer)
    assert sum(b.header.tokens for b in blocks) == 150 and blocks[-1].header.kind == "tail"
    again = swa_engine.prefill(toks, blocks)
    assert again.used_stored_logits and _same(again.logits, state.logits)
    more = swa_engine.encode(" and then some more text")
    for extra in (more[:1], more):  # one token (mlx-lm writes in place), several (concatenates)
        imported = swa_engine.prefill(toks + extra, blocks)
        local = swa_engine.extend(swa_engine.prefill(toks), extra)
        assert imported.imported_tokens == 150 and _same(imported.logits, local.logits)


def test_after_rotating_decode_steps_every_position_is_still_exported(swa_engine):
    from kvmesh.engine import Sampling

    keyer = BlockKeyer(swa_engine.card.namespace, swa_engine.card.block_tokens)
    toks = swa_engine.encode("rotate me " * 10)[:40]
    state = swa_engine.prefill(toks)
    list(swa_engine.generate(state, Sampling(max_tokens=60, stop_on_eos=False)))  # past the window
    assert any(getattr(c, "_idx", 0) < c.offset for c in state.cache)  # rotated in place
    full = type(state)(state.tokens[: state.cached], state.cache, None, state.cached)
    exported = swa_engine.export(full, keyer)
    n = sum(b.header.tokens for b in exported)
    assert n == state.cached // 32 * 32 == 96
    fresh = swa_engine.export(swa_engine.prefill(toks), keyer)
    assert exported[0].blob == fresh[0].blob  # the prompt's block: the prefill's bytes
    longer = state.tokens[: n + 5]
    imported = swa_engine.prefill(longer, exported)
    assert _same(imported.logits, swa_engine.resume(state, n, longer).logits)


def test_a_session_past_the_window_is_resumed(swa_engine):
    from kvmesh.engine import Sampling
    from kvmesh.runtime.head import HeadRuntime

    head = HeadRuntime(swa_engine, None, publish=False)
    sampling = Sampling(max_tokens=40, stop_on_eos=False)
    first = swa_engine.encode("the window slides along " * 3)[:40]
    out = head.complete(first, sampling)
    follow = first + out.tokens[:-1] + swa_engine.encode(" and then?")
    again = head.complete(follow, Sampling(max_tokens=5, stop_on_eos=False))
    assert again.report is not None and again.report.source == "session"
    assert again.report.reused_tokens == len(first) + len(out.tokens) - 1
    own = swa_engine.prefill(first)  # the session's state, as the engine alone makes it
    list(swa_engine.generate(own, sampling))
    resumed = swa_engine.resume(own, again.report.reused_tokens, follow)
    assert again.tokens == list(
        swa_engine.generate(resumed, Sampling(max_tokens=5, stop_on_eos=False))
    )
    head.close()


# -- the card is probed from the real cache; a disagreement is an error at load ---


def test_a_window_the_config_does_not_declare_is_an_error_at_load(swa_engine, monkeypatch):
    import mlx_lm.models.llama as llama
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvmesh.engine import load_engine
    from kvmesh.errors import ConfigError

    def wider(self):  # a cache whose windows disagree with config.json's sliding_window
        return [RotatingKVCache(max_size=2 * WINDOW), KVCache()] * (len(self.layers) // 2)

    monkeypatch.setattr(llama.Model, "make_cache", wider)
    with pytest.raises(ConfigError, match="window"):
        load_engine(str(swa_engine.path), "mlx")


def test_quantized_kv_with_sliding_windows_is_refused_with_a_reason(swa_engine):
    from kvmesh.engine import load_engine
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="sliding windows"):
        load_engine(str(swa_engine.path), "mlx", kv_bits=8, kv_group_size=32)


def test_a_cache_of_another_dtype_is_never_exported_under_the_card(swa_engine):
    from kvmesh.errors import ConfigError

    keyer = BlockKeyer(swa_engine.card.namespace, swa_engine.card.block_tokens)
    state = swa_engine.prefill(swa_engine.encode("half " * 20)[:40])
    for layer in state.cache:  # what the old card's float32 guess met on a float16 cache
        layer.keys, layer.values = layer.keys.astype(swa_engine.mx.float16), layer.values
    with pytest.raises(ConfigError, match="float16"):
        swa_engine.export(state, keyer)
