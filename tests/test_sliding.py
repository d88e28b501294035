"""Sliding-window models reuse whole prompts (issue 29), torch and mlx.

The zoo's models under a 24-token window (tests/zoo.py ``windowed``: the same
weights), prompts of 2 to 8 windows. For each: the producer prefills and exports;
a separate load of the same directory (a restarted head) imports the blocks as
they come off the wire. There

- an exact repeat reuses the whole prompt (the tail's stored logits, bitwise);
- an extension reuses the whole prompt and its logits are bitwise the producer's
  continuing *the very cache those blocks came from* (what kvmesh promises on every
  CPU; see tests/test_zoo_torch.py), one token (mlx-lm's in-place update) or several;
- a block-aligned prefix continues bitwise as the producer's own crop of that cache;
- a live session reuses turn 1 (prompt and answer) in turn 2, past the window;
- the record costs exactly ``card.kv_bytes_per_token`` per position (the bound the
  head's KV budget already reserves).

mlx-lm 0.32 builds rotating (windowed) caches for Gemma-3 only: its Gemma-2 and
Mistral attend fully, and their cards say so.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import decode_block
from kvmesh.engine import KVState, Sampling, load_engine
from kvmesh.runtime.head import HeadRuntime

from . import zoo

W = 24
B = 32  # the zoo's block size (DEFAULT_BLOCK_TOKENS)
LENGTHS = (2 * W + 5, 8 * W - 3)
SUFFIX = 5  # a prompt of n + SUFFIX tokens reuses n: >= 90% for every length here
GEMMA2_TYPES = ("sliding_attention",) * 3 + ("full_attention",)
TORCH = {  # case: (zoo arch, layer_types written in config.json, expected windows)
    "mistral": ("mistral", None, (W, W, W, W)),
    "gemma2": ("gemma2", None, (W, 0, W, 0)),  # hub config: transformers fills them in
    "gemma2-layer_types": ("gemma2", GEMMA2_TYPES, (W, W, W, 0)),
    "gemma3": ("gemma3", None, (W, 0, W, 0)),
}
DTYPES = ("float32", "bfloat16")
GREEDY = Sampling(max_tokens=6, stop_on_eos=False)
_loaded: dict[tuple[str, str, str], tuple] = {}


def engines(kind: str, case: str, dtype: str) -> tuple:
    """(producer, consumer, prompt): two separate loads of one windowed directory."""
    if (kind, case, dtype) not in _loaded:
        _loaded.clear()  # one pair alive at a time
        if kind == "torch":
            arch, types, _ = TORCH[case]
            path = zoo.windowed(zoo.hf_model(arch, dtype), W, types)
            pair = [load_engine(str(path), "torch", dtype=dtype) for _ in range(2)]
        else:
            path = zoo.windowed(zoo.mlx_model(case, dtype), W)
            pair = [load_engine(str(path), "mlx") for _ in range(2)]
        _loaded[kind, case, dtype] = (*pair, zoo.prompt_tokens(path, max(LENGTHS) + SUFFIX))
    return _loaded[kind, case, dtype]


def same(a, b) -> bool:
    a, b = (
        np.asarray(a.float() if hasattr(a, "float") else a),
        np.asarray(b.float() if hasattr(b, "float") else b),
    )
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def export(engine, state) -> list:
    return engine.export(state, BlockKeyer(engine.card.namespace, engine.card.block_tokens))


def wire(blocks, consumer) -> list:
    """Blocks as a peer delivers them: wire bytes decoded and verified."""
    return [decode_block(bytes(b.blob), consumer.layout, b.digest) for b in blocks]


def greedy(engine, state) -> list[int]:
    return list(engine.generate(state, GREEDY))


CASES = [("torch", c, d) for c in TORCH for d in DTYPES] + [("mlx", "gemma3", d) for d in DTYPES]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("kind", "case", "dtype"), CASES)
def test_whole_prompts_are_reused_after_a_restart(kind, case, dtype, n):
    producer, consumer, toks = engines(kind, case, dtype)
    windows = TORCH[case][2] if kind == "torch" else (W, 0, W, 0)
    assert producer.card.sliding_windows == windows
    prompt = toks[:n]
    local = producer.prefill(prompt)
    blocks = wire(export(producer, local), consumer)
    assert sum(b.header.tokens for b in blocks) == n and blocks[-1].header.kind == "tail"

    repeat = consumer.prefill(prompt, blocks)  # exact repeat: no forward pass at all
    assert repeat.imported_tokens == n and repeat.used_stored_logits
    assert same(repeat.logits, local.logits)

    for extra in (1, SUFFIX):  # one token, several: bitwise the producer's own continuation
        longer = toks[: n + extra]
        ext = consumer.prefill(longer, blocks)
        assert ext.imported_tokens == n >= 0.9 * len(longer)
        own = producer.extend(producer.prefill(prompt), longer[n:])
        assert same(ext.logits, own.logits)
    assert greedy(consumer, ext) == greedy(producer, own)

    # whole blocks only (the last token recomputed): as the producer's crop of its cache
    p = n // B * B
    cut = consumer.prefill(toks[: p + SUFFIX], blocks[: p // B])
    assert cut.imported_tokens == p and same(
        cut.logits, producer.resume(local, p, toks[: p + SUFFIX]).logits
    )


def _kv_bytes(kind: str, state: KVState) -> int:
    """What a state's cache holds: full layers' KV plus sliding layers' records."""
    if kind == "torch":
        total = 0
        for layer in state.cache.layers:
            k, v = getattr(layer, "kvmesh_record", None) or (layer.keys, layer.values)
            total += k[:, :, : state.cached].nbytes + v[:, :, : state.cached].nbytes
        return total
    total = 0
    for layer in state.cache:
        k, v = getattr(layer, "kvmesh_record", None) or (layer.keys, layer.values)
        total += k[..., : state.cached, :].nbytes + v[..., : state.cached, :].nbytes
    return total


@pytest.mark.parametrize(("kind", "case", "dtype"), [CASES[0], CASES[-1]])
def test_the_record_costs_what_the_budget_reserves(kind, case, dtype):
    """Every sliding layer records every position, the window stays as the engine
    keeps it: a state holds card.kv_bytes_per_token per position, no more."""
    producer, _, toks = engines(kind, case, dtype)
    state = producer.prefill(toks[: 4 * W])
    greedy(producer, state)  # decode steps past the window add to the record too
    assert state.cached == 4 * W + GREEDY.max_tokens - 1
    assert _kv_bytes(kind, state) == producer.card.kv_bytes_per_token * state.cached
    if kind == "torch":
        sliding = [la for la in state.cache.layers if getattr(la, "sliding_window", 0)]
        assert sliding and all(la.keys.shape[-2] == W - 1 for la in sliding)
    else:
        rotating = [c for c in state.cache if hasattr(c, "max_size")]
        assert rotating and all(c.keys.shape[2] == W for c in rotating)


@pytest.mark.parametrize(("kind", "case", "dtype"), [c for c in CASES if c[2] == "float32"])
def test_a_session_reuses_turn_one_past_the_window(kind, case, dtype):
    producer, _, toks = engines(kind, case, dtype)
    head = HeadRuntime(producer, None, publish=False)
    try:
        first = toks[: 3 * W]
        sampling = Sampling(max_tokens=2 * W, stop_on_eos=False)
        out = head.complete(first, sampling)
        turn2 = first + out.tokens[:-1] + toks[3 * W : 3 * W + 4]
        again = head.complete(turn2, GREEDY)
        assert again.report is not None and again.report.source == "session"
        reused = again.report.reused_tokens
        assert reused == len(first) + len(out.tokens) - 1 >= 0.9 * len(turn2)
        own = producer.prefill(first)  # the session's state, as the engine alone makes it
        assert list(producer.generate(own, sampling)) == out.tokens
        assert again.tokens == greedy(producer, producer.resume(own, reused, turn2))

        repeat = head.complete(turn2, GREEDY)  # an exact repeat: the session again
        assert repeat.report is not None and repeat.report.source == "session"
        assert repeat.report.reused_tokens == len(turn2) - 1 and repeat.tokens == again.tokens
    finally:
        head.close()


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_mlx_lm_attends_fully_for_gemma2_and_mistral_and_the_card_says_so(arch):
    path = zoo.windowed(zoo.mlx_model(arch, "float32"), W)
    assert load_engine(str(path), "mlx").card.sliding_windows == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("kind", "case", "dtype"), [("torch", "gemma3", "float32"), ("mlx", "gemma3", "float32")]
)
def test_a_chunked_prefill_records_every_position(kind, case, dtype):
    """A prompt prefilled a chunk at a time (the head's path while others decode):
    each chunk's positions are recorded before the window trims them."""
    producer, consumer, toks = engines(kind, case, dtype)
    n, chunk = LENGTHS[-1], W + 7
    calls: list[int] = []
    state = producer.prefill(toks[:n], between=lambda: calls.append(1), chunk=chunk)
    assert len(calls) == -(-n // chunk) - 1  # it did run in chunks
    blocks = wire(export(producer, state), consumer)
    assert sum(b.header.tokens for b in blocks) == n
    longer = toks[: n + SUFFIX]
    ext = consumer.prefill(longer, blocks)
    assert ext.imported_tokens == n
    assert same(ext.logits, producer.extend(state, longer[n:]).logits)
