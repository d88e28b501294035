"""The mlx engine is exact on the model zoo: every architecture mlx-lm runs, with
float32, bfloat16, 4-bit (float16 scales) and 8-bit (bfloat16 scales) weights.

For each (arch, variant) a producer engine prefills a prompt and exports it; the
blocks travel as chunked wire bytes into a separate consumer engine. There:

- the card's KV dtype, kv heads and head dim are the real cache's;
- an exact repeat gives bitwise the producer's logits (stored in the tail);
- a prefix extension (+17 tokens) gives bitwise the logits of the producer
  continuing its own cache, and the greedy text of a cold run;
- past a sliding window (Gemma-3's rotating layers) the whole prompt travels
  and the same holds.

Quantized weights prefill slowly on mlx's CPU backend (~7 ms/token for 4-bit),
so they run fewer lengths, the longest 130 tokens (still past the 96-token
windows) instead of ~500.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Assembler, chunks
from kvmesh.engine import Sampling, load_engine

from . import zoo

LENGTHS = (1, 31, 32, 33, 64, 65, 500)
QUANT_LENGTHS = (1, 32, 33, 65, 130)
EXTRA = 17
GREEDY = Sampling(max_tokens=8, stop_on_eos=False)
COMBOS = [(a, v) for a in zoo.ARCHS for v in zoo.MLX_VARIANTS]
CASES = [(a, v, n) for a, v in COMBOS for n in (QUANT_LENGTHS if v in ("q4", "q8") else LENGTHS)]
# what mlx computes each variant's cache in: the activations' dtype, not the weights'
CACHE_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "q4": "float16", "q8": "bfloat16"}

_engines: dict[tuple[str, str], tuple] = {}


def engines(arch: str, variant: str):
    """(producer, consumer, prompt): two separate engines on one model; one pair
    alive at a time (cases run grouped by model)."""
    if (arch, variant) not in _engines:
        _engines.clear()
        path = zoo.mlx_model(arch, variant)
        prompt = zoo.prompt_tokens(path, max(LENGTHS) + EXTRA)
        _engines[arch, variant] = (
            load_engine(str(path), "mlx"),
            load_engine(str(path), "mlx"),
            prompt,
        )
    return _engines[arch, variant]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def over_the_wire(blocks, consumer):
    """Each block as the mesh moves it: chunked bytes, reassembled and verified
    against the consumer's own card."""
    out = []
    for blk in blocks:
        asm = Assembler(consumer.layout, len(blk.blob), blk.digest)
        for c in chunks(bytes(blk.blob), 1 << 14):
            asm.feed(bytes(c))
        out.append(asm.finish())
    return out


def export(engine, state):
    return engine.export(state, BlockKeyer(engine.card.namespace, engine.card.block_tokens))


def greedy(engine, state) -> list[int]:
    return list(engine.generate(state, GREEDY))


def continued(engine, tokens, p, state=None):
    """The producer continuing its own cache of ``tokens[:p]`` with the rest."""
    base = state if state is not None else engine.prefill(tokens[:p])
    return engine.extend(base, tokens[p:])


@pytest.mark.parametrize(("arch", "variant"), COMBOS)
def test_card_tells_the_caches_dtype_and_geometry(arch, variant):
    producer, _, prompt = engines(arch, variant)
    card = producer.card
    assert card.kv_dtype == CACHE_DTYPE[variant]
    cache = producer.prefill(prompt[:40]).cache
    for layer in cache:
        for arr in (layer.keys, layer.values):
            assert str(arr.dtype).endswith(card.kv_dtype)
            assert arr.shape[1] == card.num_kv_heads and arr.shape[-1] == card.head_dim
    cfg = json.loads((zoo.mlx_model(arch, variant) / "config.json").read_text())
    assert card.num_kv_heads == cfg["num_key_value_heads"]
    assert len(card.sliding_windows) == cfg["num_hidden_layers"]


@pytest.mark.parametrize(("arch", "variant", "n"), CASES)
def test_repeat_and_extension_after_a_remote_import(arch, variant, n):
    producer, consumer, prompt = engines(arch, variant)
    tokens, longer = prompt[:n], prompt[: n + EXTRA]
    state = producer.prefill(tokens)
    blocks = over_the_wire(export(producer, state), consumer)
    p = sum(b.header.tokens for b in blocks)
    # exact repeat (past a sliding window too): the tail's stored logits, no forward pass
    assert p == n
    hit = consumer.prefill(tokens, blocks)
    assert hit.used_stored_logits and same(hit.logits, state.logits)

    extended = consumer.prefill(longer, blocks)
    assert extended.imported_tokens == p and extended.computed_tokens == len(longer) - p
    ref = continued(producer, longer, p, state)
    assert same(extended.logits, ref.logits)
    assert greedy(consumer, extended) == greedy(producer, producer.prefill(longer))


# -- the original bug, and the demo, on demo-tiny's own conversions ----------------


@pytest.fixture(scope="module")
def tiny_mlx(tiny_dir):
    """demo-tiny as mlx-lm converts it: 4-bit with float16 scales, and bfloat16."""
    home = zoo.zoo_home()
    return {
        v: zoo.convert_mlx(tiny_dir, home / f"{tiny_dir.name}-mlx-{v}", v)
        for v in ("q4", "bfloat16")
    }


def test_4bit_float16_scales_card_is_float16_and_import_is_exact(tiny_mlx):
    """Regression: the card said float32 for a float16 cache, and import + suffix
    was silently off by ~0.4 in the logits."""
    producer, consumer = (load_engine(str(tiny_mlx["q4"]), "mlx") for _ in range(2))
    assert producer.card.kv_dtype == "float16"
    tokens = producer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:100]
    state = producer.prefill(tokens[:64])
    blocks = over_the_wire(export(producer, state)[:2], consumer)
    imported = consumer.prefill(tokens, blocks)
    assert same(imported.logits, producer.extend(state, tokens[64:]).logits)


@pytest.mark.parametrize("variant", ["q4", "bfloat16"])
def test_demo_local_on_mlx_conversions(tiny_mlx, variant):
    args = ["demo", "--local", "--json", "--engine", "mlx", "--prompt-tokens", "300"]
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args, "--model", str(tiny_mlx[variant])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["outputs_identical"] is True
    assert row["reused_tokens"] == row["prompt_tokens"] >= 300


@pytest.mark.parametrize("variant", ["bfloat16", "q4"])
def test_quantized_kv_carries_the_caches_scale_dtype(variant):
    """kv_bits: K and V travel as (packed, scales, biases), scales in the cache's dtype."""
    path = str(zoo.mlx_model("qwen2", variant))
    producer, consumer = (load_engine(path, "mlx", kv_bits=4, kv_group_size=32) for _ in range(2))
    assert producer.card.kv_dtype == CACHE_DTYPE[variant] and producer.card.kv_quant == "q4g32"
    tokens = zoo.prompt_tokens(path, 65 + EXTRA)
    state = producer.prefill(tokens[:65])
    blocks = over_the_wire(export(producer, state), consumer)
    assert same(consumer.prefill(tokens[:65], blocks).logits, state.logits)
    extended = consumer.prefill(tokens, blocks)
    assert same(extended.logits, producer.extend(state, tokens[65:]).logits)


def test_a_kv_group_size_mlx_cannot_use_is_refused_at_load():
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match="group size"):  # llama's head dim is 16
        load_engine(str(zoo.mlx_model("llama", "float32")), "mlx", kv_bits=4, kv_group_size=32)
