"""Synthetic cards and blocks for tests that need no model."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Block, Layout, new_blob
from kvmesh.compat import CompatCard


def small_card(**over: object) -> CompatCard:
    fields: dict[str, object] = dict(
        engine="transformers",
        model_id="synthetic",
        weights_digest="0" * 64,
        tokenizer_digest="1" * 64,
        quantization="none",
        kv_dtype="float32",
        rope="{}",
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        sliding_windows=(0, 0),
        vocab_size=16,
        block_tokens=4,
    )
    fields.update(over)
    return CompatCard(**fields)  # type: ignore[arg-type]


def synthetic_chain(
    card: CompatCard, tokens: list[int], seed: int = 0, tail: bool = True
) -> list[Block]:
    """Blocks for ``tokens`` with pseudo-random KV bytes fixed by (key, seed)."""
    layout = Layout(card)
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    keys = keyer.keys(tokens)
    b = card.block_tokens
    out = []
    for i, key in enumerate(keys.blocks):
        out.append(
            _fill(layout, layout.header("block", key, keyer.parent_of(keys, i), i * b, b), seed)
        )
    if tail:
        parent = keys.blocks[-1] if keys.blocks else card.namespace
        out.append(
            _fill(
                layout,
                layout.header("tail", keys.tail, parent, len(keys.blocks) * b, keys.tail_tokens),
                seed,
            )
        )
    return out


def _fill(layout: Layout, header, seed: int) -> Block:  # type: ignore[no-untyped-def]
    # bytes depend on the key (and seed), so one key always has one content
    rng = np.random.default_rng([int.from_bytes(header.key[:8], "little"), seed])
    blob, view = new_blob(header)
    view[:] = rng.integers(0, 256, size=len(view), dtype=np.uint8).tobytes()
    return layout.seal(header, blob)


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_whole_remote_hit(warm: dict, cold: dict, answer: Callable[[dict], object]) -> None:
    """``warm`` (an OpenAI response from a head) took its whole prompt from a peer and
    answered exactly as ``cold`` did (``answer``: what of a response must be equal)."""
    assert warm["kvmesh"]["source"] == "remote", warm["kvmesh"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"]
    assert answer(warm) == answer(cold)  # tokens and log-probabilities, exactly
