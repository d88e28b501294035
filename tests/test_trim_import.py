"""Trimmed imports of sliding-window models (issue 41), torch and mlx.

An import of ``[0, P)`` needs a sliding layer of window ``W`` only from
``keep_from`` on (``Layout.keep_from``): the zoo's models under a 24-token window,
two separate loads of one directory (producer, consumer), every exported block
cut to the parts the import wants (``codec.trim``: what a peer sends). For ``P``
around the window, on and off the block grid, up to several windows:

- the trimmed import continues **bitwise** as the whole import and as the producer
  continuing its own cache (logits, greedy tokens), one token or more than a block;
- a cut to ``P - 1`` (the head's crop when no tail logits came) and to the lowest
  position whose window the import still holds are the producer's own cuts;
- a cut below that is refused (``restorable`` 0): the engine computes instead, as
  a cold run does;
- an export below a trimmed layer's low bound is a CacheMiss, never its unwritten
  memory; the blocks from the import's end on are the producer's bytes;
- an importer with ``keep_from`` refuses a block lacking a wanted part, one
  without it any trimmed block, and takes whole blocks (their extra parts ignored).

mlx-lm 0.32 builds rotating caches for Gemma 3 and Gemma 4 only (see
tests/test_sliding.py), so its cases are those.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import ALL, decode_block, trim
from kvmesh.engine import Sampling, load_engine
from kvmesh.errors import CacheMiss, MalformedPayload

from . import zoo

W = 24
B = 32  # the zoo's block size (DEFAULT_BLOCK_TOKENS)
# around the window (nothing to trim), a block multiple, a multiple plus a tail, 3W,
# a low bound exactly P - 1 - W (mlx's cut to P - 1 needs every position it holds),
# several windows
LENGTHS = (W - 1, W, W + 1, 4 * B, 4 * B + 7, 3 * W, W + 1 + 2 * B, 8 * W - 3)
MORE = B + 5  # a continuation past the next block boundary
GREEDY = Sampling(max_tokens=5, stop_on_eos=False)
CASES = {  # case: (engine, zoo arch)
    "torch-gemma3": ("torch", "gemma3"),
    "torch-mistral": ("torch", "mistral"),  # every layer sliding
    "torch-gemma4": ("torch", "gemma4"),  # two geometries, KV-shared layers
    "mlx-gemma3": ("mlx", "gemma3"),
    "mlx-gemma4": ("mlx", "gemma4"),
}
_loaded: dict[str, tuple] = {}


def engines(case: str) -> tuple:
    """(producer, consumer, tokens): two loads of one windowed directory."""
    if case not in _loaded:
        _loaded.clear()  # one pair alive at a time
        kind, arch = CASES[case]
        src = zoo.hf_model(arch) if kind == "torch" else zoo.mlx_model(arch, "float32")
        path = zoo.windowed(src, W)
        pair = [load_engine(str(path), kind) for _ in range(2)]
        _loaded[case] = (*pair, zoo.prompt_tokens(path, max(LENGTHS) + MORE + 8))
    return _loaded[case]


def same(a, b) -> bool:
    a, b = (np.asarray(x.float() if hasattr(x, "float") else x) for x in (a, b))
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def keyer(engine) -> BlockKeyer:
    return BlockKeyer(engine.card.namespace, engine.card.block_tokens)


def wire(blocks, consumer) -> list:
    return [decode_block(bytes(b.blob), consumer.layout, b.digest) for b in blocks]


def trimmed(blocks, layout, kf) -> list:
    return [trim(b, layout.want(b.header, kf)) for b in blocks]


def imported(consumer, n, blocks, kf):
    imp = consumer.importer(n, kf)
    for b in blocks:
        imp.add(b)
    return imp


def floor(consumer, kf) -> int:
    """The fewest positions a trimmed import can be cut back to (but none): each
    trimmed sliding layer's live window within what it holds."""
    live = {"torch": -1, "mlx": 0}[consumer.name]  # transformers keeps W - 1, mlx-lm W
    g = consumer.card.geometry
    return max(
        (lo + g[i].window + live for i, lo in enumerate(kf) if g[i].window and lo), default=0
    )


@pytest.mark.parametrize("p", LENGTHS)
@pytest.mark.parametrize("case", CASES)
def test_a_trimmed_import_continues_bitwise(case, p):
    producer, consumer, toks = engines(case)
    assert any(consumer.card.sliding_windows)
    kf = consumer.layout.keep_from(p)
    if p - 1 - W < B:  # no sliding layer's block lies wholly before its window
        assert kf is None
        return
    assert kf is not None
    geometry = consumer.card.geometry
    assert all(
        lo == (0 if not g.window else B * ((p - 1 - W) // B))
        for lo, g in zip(kf, geometry, strict=True)
        if g.has_kv
    )
    local = producer.prefill(toks[:p])
    whole = wire(producer.export(local, keyer(producer)), consumer)
    cut = trimmed(whole, consumer.layout, kf)
    assert any(not b.whole for b in cut)
    assert sum(b.nbytes for b in cut) < sum(b.nbytes for b in whole)

    # the exact repeat: the tail's logits, no forward
    again = consumer.begin_prefill(toks[:p], cut, imported(consumer, p, cut, kf))
    assert again.used_stored_logits and again.cached == p and same(again.logits, local.logits)
    _holds_only_from(consumer, again.cache, kf, p)

    for extra in (1, MORE):  # the whole import's, the producer's own continuation
        longer = toks[: p + extra]
        mine = consumer.prefill(longer, cut, imported(consumer, p, cut, kf))
        theirs = consumer.prefill(longer, whole)
        own = producer.extend(producer.prefill(toks[:p]), longer[p:])
        assert mine.imported_tokens == p and mine.computed_tokens == extra
        assert same(mine.logits, theirs.logits) and same(mine.logits, own.logits)
    # from the first position every layer holds (the import's blocks past every
    # low bound, then what it computed): the producer's bytes
    start = consumer.exportable_from(mine)
    assert start == max(kf[i] for i, g in enumerate(geometry) if g.window) and start % B == 0
    assert producer.exportable_from(own) == 0
    published = consumer.export(mine, keyer(consumer), first_block=start // B)
    cold = producer.export(own, keyer(producer), first_block=start // B)
    assert [b.blob for b in published] == [b.blob for b in cold]
    assert len(published) >= 2 + p // B - start // B
    with pytest.raises(CacheMiss):  # a trimmed layer's first block was never there
        consumer.export(mine, keyer(consumer))
    said = list(consumer.generate(mine, GREEDY))
    assert said == list(consumer.generate(theirs, GREEDY)) == list(producer.generate(own, GREEDY))
    assert same(mine.logits, own.logits)  # after decode steps past the import, too


@pytest.mark.parametrize("p", [4 * B, 4 * B + 7, 8 * W - 3, W + 1 + 2 * B])
@pytest.mark.parametrize("case", CASES)
def test_cuts_of_a_trimmed_import(case, p):
    producer, consumer, toks = engines(case)
    kf = consumer.layout.keep_from(p)
    assert kf is not None
    local = producer.prefill(toks[:p])
    whole = wire(producer.export(local, keyer(producer)), consumer)
    cut = trimmed(whole, consumer.layout, kf)
    other = toks[p + 8 : p + 8 + 6]  # a different continuation

    if p % B == 0:  # full blocks, no tail: the head recomputes the last token (cut to P - 1)
        st = consumer.prefill(toks[:p], cut[:-1], imported(consumer, p, cut[:-1], kf))
        assert (st.imported_tokens, st.computed_tokens, st.cached) == (p - 1, 1, p)
        own = producer.resume(local, p - 1, toks[:p])
        assert same(st.logits, own.logits) and same(
            st.logits, consumer.prefill(toks[:p], whole[:-1]).logits
        )

    st = consumer.prefill(toks[:p], cut, imported(consumer, p, cut, kf))
    low = floor(consumer, kf)
    assert low <= p - 1 and consumer.restorable(st.cache, p - 1) == p - 1
    for q in (p - 1, low):  # cuts whose window the import holds: the producer's own
        assert consumer.restorable(st.cache, q) == q
        mine = consumer.resume(st, q, toks[:q] + other)
        own = producer.resume(local, q, toks[:q] + other)
        assert mine.computed_tokens == len(other) and same(mine.logits, own.logits)
        assert list(consumer.generate(mine, GREEDY)) == list(producer.generate(own, GREEDY))

    # below that: nothing restorable, the session computes (a cold run's numbers)
    for q in (low - 1, W):
        assert consumer.restorable(st.cache, q) == 0
        mine = consumer.resume(st, q, toks[:q] + other)
        cold = producer.prefill(toks[:q] + other)
        assert mine.cached == len(toks[:q] + other) and mine.computed_tokens == len(mine.tokens)
        assert same(mine.logits, cold.logits)
    with pytest.raises(CacheMiss):
        consumer._crop(st.cache, low - 1)


@pytest.mark.parametrize("case", ["torch-gemma3", "mlx-gemma3"])
def test_an_importer_takes_what_its_keep_from_wants(case):
    producer, consumer, toks = engines(case)
    p = 8 * W - 3
    kf = consumer.layout.keep_from(p)
    local = producer.prefill(toks[:p])
    whole = wire(producer.export(local, keyer(producer)), consumer)
    cut = trimmed(whole, consumer.layout, kf)
    first = cut[0]
    assert not first.whole
    g = consumer.card.geometry
    full = next(i for i, x in enumerate(g) if x.has_kv and not x.window)

    with pytest.raises(MalformedPayload, match="trimmed"):  # no keep_from: whole blocks only
        consumer.importer(p).add(first)
    less = trim(first, first.present & ~(1 << full))  # a full-attention layer left out too
    with pytest.raises(MalformedPayload, match="lacks parts"):
        consumer.importer(p, kf).add(less)
    # a lower bound than the import needs is a different importer: the trimmed block lacks it
    with pytest.raises(MalformedPayload, match="lacks parts"):
        consumer.importer(p, tuple(0 for _ in kf)).add(first)

    # whole blocks under keep_from: their extra parts ignored, the same continuation
    longer = toks[: p + 3]
    mixed = [*whole[:2], *cut[2:]]
    mine = consumer.prefill(longer, mixed, imported(consumer, p, mixed, kf))
    theirs = consumer.prefill(longer, whole)
    assert same(mine.logits, theirs.logits)
    _holds_only_from(consumer, mine.cache, kf, p + 3)
    # trimmed blocks without an importer: imported as the card trims them
    assert same(consumer.prefill(longer, cut).logits, theirs.logits)

    bad = list(kf)
    bad[full] = B  # a full-attention layer needs every position
    with pytest.raises(ValueError):
        consumer.importer(p, bad)
    with pytest.raises(ValueError):  # a window that would reach below what is kept
        consumer.importer(B + W - 2, [B if x.window else 0 for x in g])
    assert all(b.present == ALL for b in whole)


def _holds_only_from(engine, cache, kf, n) -> None:
    """Each trimmed sliding layer records exactly positions [keep_from, n)."""
    layers = cache.layers if engine.name == "torch" else list(cache)
    recorded = [
        (getattr(la, "kvmesh_lo", 0), la.kvmesh_record[0].shape[-2])
        for la in layers
        if getattr(la, "kvmesh_record", None) is not None
    ]
    lows = sorted(
        {lo for lo, g in zip(kf, engine.card.geometry, strict=True) if g.window and g.has_kv}
    )
    assert recorded and sorted({lo for lo, _ in recorded}) == lows
    assert all(lo + size == n for lo, size in recorded)
