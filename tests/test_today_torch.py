"""Today's architectures on the torch engine: Gemma 4 (per-layer head dims,
KV-shared layers, k=v, MoE, sliding windows), its hub (multimodal) layout,
Qwen3.5 (Gated DeltaNet beside full attention) in both layouts, gpt-oss (sinks,
MoE, sliding windows), LFM2 (short convolutions) and Nemotron-H (Mamba2), each in
float32 and bfloat16.

For every prompt length, blocks exported by one engine are imported by another
(a separate model load, and a third one after a "restart" that decodes the
blocks from their bytes): an exact repeat reuses the whole prompt and its stored
logits; an extension reuses every whole block (a hybrid: up to its last state
checkpoint); and the continuation is the producer continuing its own cache,
bitwise (logits) and token for token.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import decode_block
from kvmesh.engine.base import Sampling
from kvmesh.engine.hf import TransformersEngine

from . import zoo

LENGTHS = (1, 31, 32, 33, 65, 500)  # 500: past four 96-token windows
EXTRA = 20
STEPS = 6


@functools.cache
def _engines(arch: str, dtype: str) -> tuple[TransformersEngine, TransformersEngine]:
    path = zoo.hf_model(arch, dtype)
    return TransformersEngine(path, dtype=dtype), TransformersEngine(path, dtype=dtype)


def _greedy(engine: TransformersEngine, state) -> list[int]:  # type: ignore[no-untyped-def]
    return list(engine.generate(state, Sampling(max_tokens=STEPS, stop_on_eos=False)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", zoo.TODAY)
def test_blocks_of_one_engine_continue_exactly_in_another(arch, dtype):
    producer, importer = _engines(arch, dtype)
    card = producer.card
    assert importer.card == card and producer.reuse_off is None
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    path = zoo.hf_model(arch, dtype)
    lengths = LENGTHS if dtype == "float32" else (33, 500)
    for n in lengths:
        tokens = zoo.prompt_tokens(path, n)
        own = producer.prefill(tokens)
        blocks = producer.export(own, keyer)

        # an exact repeat: every token and the stored logits
        hit = importer.prefill(tokens, blocks)
        assert hit.imported_tokens == n and hit.used_stored_logits, (arch, n)
        assert torch.equal(hit.logits, own.logits)
        assert _greedy(importer, hit) == _greedy(producer, producer.fork(own)), (arch, n)

        # an extension from whole blocks, against the producer resuming its own cache
        longer = tokens + zoo.prompt_tokens(path, EXTRA, seed=1)
        whole = [b for b in blocks if b.header.kind == "block"]
        ext = importer.prefill(longer, whole)
        q = ext.imported_tokens
        # every whole block (a hybrid's last one carries the state after it)
        assert q == n // card.block_tokens * card.block_tokens, (arch, n, q)
        mine = producer.resume(own, q, longer)
        assert mine.cached == ext.cached == len(longer)
        assert torch.equal(ext.logits, mine.logits), (arch, n)
        assert _greedy(importer, ext) == _greedy(producer, mine), (arch, n)


@pytest.mark.parametrize("arch", zoo.TODAY)
def test_an_import_after_a_restart_decodes_the_bytes_and_reuses_the_prompt(arch):
    path = zoo.hf_model(arch)
    producer, _ = _engines(arch, "float32")
    tokens = zoo.prompt_tokens(path, 500)
    own = producer.prefill(tokens)
    blocks = producer.export(own, BlockKeyer(producer.card.namespace, producer.card.block_tokens))
    restarted = TransformersEngine(path)  # a new process's load: the same card
    assert restarted.card.namespace == producer.card.namespace
    wire = [decode_block(bytes(b.blob), restarted.layout, b.digest) for b in blocks]
    hit = restarted.prefill(tokens, wire)
    assert hit.imported_tokens == len(tokens) and torch.equal(hit.logits, own.logits)
    assert _greedy(restarted, hit) == _greedy(producer, producer.fork(own))
    shipped = sum(b.nbytes for b in blocks)
    assert shipped <= card_bytes(producer.card, len(tokens)) + 64 * 1024 * len(blocks)


def card_bytes(card, n: int) -> int:  # type: ignore[no-untyped-def]
    """What the card says ``n`` positions cost (state checkpoints spread over them)."""
    return card.kv_bytes_per_token * n + card.state_bytes + 4 * card.vocab_size


def test_kv_shared_layers_ship_nothing_and_head_dims_differ_per_layer():
    producer, _ = _engines("gemma4", "float32")
    g = producer.card.geometry
    kinds = [x.kind for x in g]
    assert kinds.count("shared") == 2 and kinds[-2:] == ["shared", "shared"]
    dims = {(x.kv_heads, x.head_dim) for x in g if x.has_kv}
    assert len(dims) == 2  # sliding (2 heads x 32) and full (1 head x 64)
    block = producer.export(
        producer.prefill(list(range(5, 40))),
        BlockKeyer(producer.card.namespace, producer.card.block_tokens),
    )[0]
    assert [len(layer) for layer in block.header.layers] == [2 if x.has_kv else 0 for x in g]


def test_a_hybrid_checkpoints_its_state_and_ends_imports_on_one():
    producer, importer = _engines("qwen3_5", "float32")
    card = producer.card
    assert card.state_every >= 2 and any(x.state for x in card.geometry)
    b, every = card.block_tokens, card.state_every
    path = zoo.hf_model("qwen3_5")
    tokens = zoo.prompt_tokens(path, b * (2 * every + 3) + 5)
    own = producer.prefill(tokens)
    blocks = producer.export(own, BlockKeyer(card.namespace, b))
    whole, tail = blocks[:-1], blocks[-1]
    carrying = [x.header.start // b for x in whole if x.header.states]
    # the grid's checkpoints, and the prompt's last two whole blocks (a next turn ends there)
    grid = {i for i in range(len(whole)) if (i + 1) % every == 0}
    assert carrying == sorted(grid | {len(whole) - 2, len(whole) - 1})
    assert tail.header.kind == "tail" and tail.header.states
    assert importer.prefill(tokens, whole).imported_tokens == len(whole) * b
    # a chain that stops one block past the grid's checkpoint: the import ends on the
    # checkpoint, the rest is computed
    state = importer.prefill(tokens, whole[: every + 1])
    assert state.imported_tokens == every * b
    assert torch.equal(state.logits, own.logits)


@pytest.mark.parametrize("arch", ["gemma4", "qwen3_5_hub"])
def test_the_cli_demo_runs_on_it(arch):
    from click.testing import CliRunner

    from kvmesh.cli import main

    path = zoo.hf_model(arch)
    res = CliRunner().invoke(
        main, ["demo", "--local", "--json", "--model", str(path), "--prompt-tokens", "300"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["outputs_identical"] and out["reused_tokens"] >= 0.9 * out["prompt_tokens"]
