"""``kvmesh demo``: the original system's evidence, reproduced on one machine.

``run_local`` measures a cold prefill against an import of the same prefix from a
local block store; the two-node scenario lives in :mod:`kvmesh.runtime.demo`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .blocks import BlockKeyer
from .engine import Engine, KVState, Sampling
from .store import BlockStore

DEMO_TOKENS = 8

TOPICS = (
    "prefill is the expensive part of a long prompt",
    "idle memory across a small fleet becomes a shared cache",
    "immutable blocks are verified before they are imported",
    "decode always stays local and makes no remote call",
    "a peer that fails only costs a local recompute",
)


def demo_prompt(engine: Engine, target_tokens: int = 1000) -> list[int]:
    """A deterministic chat prompt of about ``target_tokens`` tokens."""
    lines: list[str] = []
    i = 0
    while True:
        lines.append(f"Note {i}: {TOPICS[i % len(TOPICS)]}.")
        msgs = [
            {"role": "system", "content": "You are a concise assistant for operators."},
            {"role": "user", "content": "\n".join(lines) + "\nSummarise the notes."},
        ]
        ids = engine.encode_chat(msgs)
        if len(ids) >= target_tokens:
            return ids
        i += 1


@dataclass(frozen=True)
class LocalResult:
    prompt_tokens: int
    reused_tokens: int
    cold_ttft_s: float
    hit_ttft_s: float
    speedup: float
    outputs_identical: bool
    bytes_stored: int
    blocks: int


def run_local(
    engine: Engine,
    prompt_tokens: int = 1000,
    gen_tokens: int = DEMO_TOKENS,
    progress: Callable[[str], None] = lambda _: None,
    tokens: Sequence[int] | None = None,
) -> LocalResult:
    """Cold prefill, then an import of the same prefix from a local store, of
    ``tokens`` (default: :func:`demo_prompt` of ``prompt_tokens``)."""
    tokens = list(tokens) if tokens is not None else demo_prompt(engine, prompt_tokens)
    sampling = Sampling(max_tokens=gen_tokens)
    keyer = BlockKeyer(engine.card.namespace, engine.card.block_tokens)
    if engine.reuse_off is not None:
        progress(f"prefix reuse is off for this model: {engine.reuse_off}")
    engine.prefill(tokens[:8])  # warm up kernels: the baseline is the engine's best path

    progress(f"cold prefill of {len(tokens)} tokens")
    t0 = time.perf_counter()
    cold = engine.prefill(tokens)
    prompt_view = KVState(list(tokens), cold.cache, cold.logits, len(tokens))
    gen = engine.generate(cold, sampling)
    first = next(gen)
    cold_ttft = time.perf_counter() - t0
    cold_out = [first, *gen]

    progress("exporting blocks into the local store")
    store = BlockStore(budget_bytes=1 << 30)
    for blk in engine.export(prompt_view, keyer):
        store.put(blk)

    progress("importing the prefix into a fresh state")
    t0 = time.perf_counter()
    match = store.longest_prefix(keyer.keys(tokens))
    hit = engine.prefill(tokens, match.all())
    gen = engine.generate(hit, sampling)
    first = next(gen)
    hit_ttft = time.perf_counter() - t0
    hit_out = [first, *gen]
    return LocalResult(
        prompt_tokens=len(tokens),
        reused_tokens=hit.imported_tokens,  # a hybrid's: up to its last state checkpoint
        cold_ttft_s=round(cold_ttft, 6),
        hit_ttft_s=round(hit_ttft, 6),
        speedup=round(cold_ttft / hit_ttft, 1),
        outputs_identical=cold_out == hit_out,
        bytes_stored=store.stats.used_bytes,
        blocks=store.stats.entries,
    )


def as_dict(result: LocalResult) -> dict[str, object]:
    return asdict(result)
