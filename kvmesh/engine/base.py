"""The engine contract and the engine-neutral parts of prefill and export.

An engine holds a model, its tokenizer and its :class:`CompatCard`. Its state for
one sequence is a :class:`KVState`: token ids, an opaque engine cache holding KV
for every token but possibly the last, and the next-token logits.

Prefill from imported blocks (``prefix``) is exact: the blocks' bytes become the
cache's tensors unchanged, so the continuation is bitwise identical to continuing
from the local cache that produced them (invariant 2).

Sliding-window layers: a block carries its positions' KV for *every* layer, and a
prefix of any length is restorable. Importing ``[0, P)`` puts all of it in full
layers and, in a sliding layer of window ``W``, what that layer holds after
computing ``P`` tokens itself (transformers: the last ``W - 1`` positions; mlx-lm's
rotating cache: the last ``W``): all a continuation can attend to. Engines keep
a sliding layer's positions past the window (a per-layer record) so they can be
exported and cropped; each engine's module states what that costs.
"""

from __future__ import annotations

import abc
import bisect
import functools
import json
import threading
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks import BlockKeyer, PrefixKeys
from ..codec import Block, BlockHeader, Layout, check_block, new_blob
from ..compat import (
    CompatCard,
    LayerGeometry,
    dtype_size,
    rope_from_config,
    tokenizer_digest,
    weights_digest,
)
from ..errors import ConfigError, MalformedPayload, NoChatTemplate
from .grammar import GrammarMatcher, GrammarSpec, compile_grammar

PREFILL_CHUNK = 512  # tokens per prefill forward while other sequences are decoding


@dataclass(frozen=True)
class Sampling:
    """How to decode one sequence. The defaults change nothing: no penalty, no stop
    string and no logprobs leave the sampled tokens exactly as plain sampling's."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_on_eos: bool = True
    stop: tuple[str, ...] = ()  # on decoded text; the stop string is not part of the answer
    presence_penalty: float = 0.0  # OpenAI: subtracted once from a token already generated
    frequency_penalty: float = 0.0  # ... and this, times how often it was generated
    logprobs: int | None = None  # record each token's logprob and this many alternatives
    n: int = 1  # sequences from one prefill; sequence i samples with seed + i
    # constrained decoding (structured output): each sequence's tokens follow this
    # grammar (its own matcher; a mask on the logits, logprobs still the raw ones)
    grammar: GrammarSpec | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's raw logits (before
    penalties and temperature, as vLLM reports by default) and the ``top`` most
    likely tokens, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class StopScanner:
    """Finds the first stop string in text that arrives piece by piece, and says
    how much of it is safe to show: text that could still be the start of a stop
    string is held back until the next piece proves it is not.

    Each stop string keeps a Knuth-Morris-Pratt state (the longest end of the text
    so far that is a start of it), so a piece costs work in proportion to its own
    length times the number of stops (amortized: a character's fallbacks are paid
    for by the characters that advanced the state), never the stops' length nor
    the text's: long stop strings cost their one table (:func:`_stop_borders`,
    shared by every scanner of the same string), not a rescan per token.
    ``steps`` counts that work (characters compared, fallbacks included)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything fed so far
        self.cut: int | None = None  # where the first stop string starts, once found
        self.steps = 0  # characters compared so far, fallbacks included
        self._borders = [_stop_borders(s) for s in self.stops]
        self._ends = [0] * len(self.stops)  # per stop: the longest end of text starting it

    def feed(self, piece: str) -> int:
        """Add ``piece``; return how many characters of ``text`` are safe to show
        (all of it up to ``cut`` once a stop string is found)."""
        if self.cut is not None:
            return self.cut
        at = len(self.text)
        self.text += piece
        if not self.stops:
            return len(self.text)
        # every stop's first occurrence ending in this piece; the earliest start wins
        # (a longer stop may start before a shorter one that ends first)
        hits = [
            at + end + 1 - len(s)
            for j, s in enumerate(self.stops)
            if (end := self._advance(j, s, piece)) >= 0
        ]
        if hits:
            self.cut = min(hits)
            return self.cut
        return len(self.text) - max(self._ends)  # a possible start of a stop is held back

    def _advance(self, j: int, stop: str, piece: str) -> int:
        """Run stop ``j``'s state over ``piece``: the index in ``piece`` where its
        first occurrence ends, or -1 (its state then covers the whole text)."""
        borders, k, n, steps = self._borders[j], self._ends[j], len(stop), 0
        for i, c in enumerate(piece):
            while k and c != stop[k]:
                k = borders[k - 1]
                steps += 1
            steps += 1
            if c == stop[k]:
                k += 1
                if k == n:
                    self.steps += steps
                    return i
        self._ends[j] = k
        self.steps += steps
        return -1


@functools.lru_cache(maxsize=64)
def _stop_borders(stop: str) -> array:
    """KMP's failure table of ``stop``: entry ``i`` is the length of the longest
    proper prefix of ``stop[: i + 1]`` that also ends it. O(len(stop)), once per
    distinct stop string (``n`` sequences of one request share it)."""
    borders = array("i", bytes(4 * len(stop)))
    k = 0
    for i in range(1, len(stop)):
        c = stop[i]
        while k and c != stop[k]:
            k = borders[k - 1]
        if c == stop[k]:
            k += 1
        borders[i] = k
    return borders


@dataclass
class Decoded:
    """One decoded sequence as it grows: its tokens, their logprobs (when asked),
    the text safe to show so far (a stop string cut off, a possible start of one
    held back) and, per token, where its text starts. ``done`` once it ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    offsets: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stopped: bool = False  # ended by a stop string, which ``text`` does not include
    done: bool = False

    @property
    def shown(self) -> int:
        """How many tokens the text shown so far accounts for: all of them once the
        sequence ended without a stop string; otherwise those whose text starts
        inside ``text`` (tokens inside or after a stop string are never shown)."""
        if self.done and not self.stopped:
            return len(self.tokens)
        return bisect.bisect_left(self.offsets, len(self.text))


class _Detokenizer:
    """Incremental text of ``out.tokens``: each step decodes only the tokens since
    the last boundary (plus the window before, for tokenizers whose text depends
    on the previous token), never the whole answer again."""

    def __init__(self, decode: Callable[[Sequence[int]], str], out: Decoded, stops: Sequence[str]):
        self.decode, self.out = decode, out
        self.scanner = StopScanner(stops)
        self.prefix = self.read = 0

    def step(self, final: bool) -> None:
        out, toks = self.out, self.out.tokens
        while len(out.offsets) < len(toks):  # where the new tokens' text starts
            out.offsets.append(len(self.scanner.text))
        before = self.decode(toks[self.prefix : self.read])
        after = self.decode(toks[self.prefix :])
        piece = ""
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(toks)
            piece = after[len(before) :]
        safe = self.scanner.feed(piece)
        if self.scanner.cut is not None:
            out.stopped = True
        elif final:
            safe = len(self.scanner.text)  # nothing more can complete a stop string
        out.text = self.scanner.text[:safe]


class Decoder:
    """Samples one sequence's tokens one at a time; the engine forwards each token
    that goes on (:meth:`Engine.decode_batch`). ``out``, when given, is filled in
    before each token is returned: tokens, logprobs, the text to show and why the
    sequence ended (a stop string ends it too; it is not part of ``out.text``).

    With ``sampling.grammar`` the sequence has its own matcher (:mod:`.grammar`):
    each step the tokens the grammar does not allow next are masked out of a copy
    of the logits before sampling (penalties, temperature and top-p then apply as
    ever), the sampled token advances the matcher, and the sequence ends with
    finish reason ``stop`` once the grammar is complete (or when it could end and
    EOS was sampled). Logprobs stay those of the raw logits, as vLLM reports by
    default. Without a grammar nothing of this runs: sampling is bitwise as before."""

    def __init__(
        self, engine: Engine, state: KVState, sampling: Sampling, out: Decoded | None = None
    ) -> None:
        self.engine, self.state, self.sampling, self.out = engine, state, sampling, out
        self.rng = engine.new_rng(sampling.seed)
        self.text = _Detokenizer(engine.decode_text, out, sampling.stop) if out else None
        self.counts: dict[int, int] | None = {} if sampling.penalized else None
        self.grammar: GrammarMatcher | None = None
        if sampling.grammar is not None:
            self.grammar = compile_grammar(engine.tokenizer, sampling.grammar).matcher()
        self.i = 0

    def next(self) -> tuple[int, bool]:
        """The next token, and whether it is the last."""
        eng, state, sampling, out = self.engine, self.state, self.sampling, self.out
        grammar, complete = self.grammar, False
        if grammar is None:
            tok = eng.sample(state.logits, sampling, self.rng, self.counts)
        else:
            eos_ids = eng.eos_ids if sampling.stop_on_eos else ()
            allowed = grammar.allowed(int(state.logits.shape[-1]), eos_ids)
            if not allowed.any():
                raise RuntimeError("the grammar allows no token here")
            tok = eng.sample(state.logits, sampling, self.rng, self.counts, allowed)
        state.tokens.append(tok)
        eos = sampling.stop_on_eos and tok in eng.eos_ids
        if grammar is not None and not eos:
            grammar.advance(tok)
            complete = grammar.done
        self.i += 1
        last = self.i >= sampling.max_tokens or eos or complete
        if out is not None and self.text is not None:
            if sampling.logprobs is not None:
                out.logprobs.append(eng.logprob(state.logits, tok, sampling.logprobs))
            out.tokens.append(tok)
            self.text.step(final=last)
            if out.stopped or last:
                out.finish_reason = "stop" if out.stopped or eos or complete else "length"
                out.done = last = True
        if not last and self.counts is not None:
            self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok, last


@dataclass
class KVState:
    """One sequence's state. ``cache`` holds KV for ``cached`` tokens."""

    tokens: list[int]
    cache: Any
    logits: Any  # next-token logits after tokens[-1]
    cached: int
    imported_tokens: int = 0  # tokens whose KV came from blocks
    computed_tokens: int = 0  # tokens forward-passed by prefill
    used_stored_logits: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


MAX_STATE_EVERY = 32  # blocks: the coarsest recurrent-state checkpoint grid


@dataclass(frozen=True)
class CacheGeometry:
    """What the loaded model's cache really holds, read off a probe forward
    (invariant 5: the card describes the real cache, never a config guess)."""

    kv_dtype: str
    layers: tuple[LayerGeometry, ...]

    @classmethod
    def from_layers(
        cls, layers: Sequence[tuple[str, int, int]], windows: Sequence[int]
    ) -> CacheGeometry:
        """From per-layer (dtype, kv_heads, head_dim) of attention layers as probed."""
        if not layers or len(layers) != len(windows):
            raise ConfigError(
                f"probe found {len(layers)} cache layers for {len(windows)} window entries"
            )
        dtypes = sorted({d for d, _, _ in layers})
        if len(dtypes) != 1:
            raise ConfigError(f"cache layers differ in KV dtype: {dtypes}")
        geoms = tuple(
            LayerGeometry("kv", int(h), int(d), int(w))
            for (_, h, d), w in zip(layers, windows, strict=True)
        )
        return cls(dtypes[0], geoms)

    @classmethod
    def attention(
        cls, kv_dtype: str, kv_heads: int, head_dim: int, windows: Sequence[int]
    ) -> CacheGeometry:
        """Every layer attention KV of one shape (``windows``: per layer, 0 = full)."""
        return cls(kv_dtype, tuple(LayerGeometry("kv", kv_heads, head_dim, w) for w in windows))

    @property
    def uniform(self) -> bool:
        """Every layer attention KV of one shape: the card's scalar fields say it all."""
        return all(g.kind == "kv" for g in self.layers) and (
            len({(g.kv_heads, g.head_dim) for g in self.layers}) == 1
        )

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.layers)

    def state_every(self, block_tokens: int) -> int:
        """Blocks between recurrent-state checkpoints: about as many bytes of state
        as of KV travel (a state can be MBs per layer), never coarser than
        :data:`MAX_STATE_EVERY`; 0 without recurrent layers."""
        state = sum(g.state_bytes for g in self.layers)
        if not state:
            return 0
        size = dtype_size(self.kv_dtype)
        kv_block = sum(2 * g.kv_heads * g.head_dim * size for g in self.layers) * block_tokens
        if not kv_block:
            return MAX_STATE_EVERY
        return max(1, min(MAX_STATE_EVERY, -(-state // kv_block)))

    def card_fields(self, block_tokens: int) -> dict[str, Any]:
        """The card's geometry fields."""
        if self.uniform:
            first = self.layers[0]
            heads, dim, per_layer = first.kv_heads, first.head_dim, tuple[str, ...]()
        else:
            heads, dim = 0, 0
            per_layer = tuple(g.encode() for g in self.layers)
        return {
            "kv_dtype": self.kv_dtype,
            "num_layers": len(self.layers),
            "num_kv_heads": heads,
            "head_dim": dim,
            "sliding_windows": self.sliding_windows,
            "layer_geometry": per_layer,
            "state_every": self.state_every(block_tokens),
        }


def card_from_hf_dir(
    path: Path,
    engine: str,
    geometry: CacheGeometry,
    quantization: str,
    block_tokens: int,
    kv_quant: str = "none",
    tokenizer_dir: Path | None = None,
    block_digest: str = "blake3",
) -> CompatCard:
    """A card for the model in ``path`` whose cache has ``geometry`` (probed); its
    tokenizer files are in ``tokenizer_dir`` when that differs from ``path``."""
    cfg = json.loads((path / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    return CompatCard(
        engine=engine,
        model_id=model_name(path, cfg),
        weights_digest=weights_digest(path),
        tokenizer_digest=tokenizer_digest(tokenizer_dir or path),
        quantization=quantization,
        rope=rope_from_config(text_cfg),
        vocab_size=int(text_cfg["vocab_size"]),
        block_tokens=block_tokens,
        kv_quant=kv_quant,
        block_digest=block_digest,
        **geometry.card_fields(block_tokens),
    )


def model_name(path: Path, cfg: dict[str, Any]) -> str:
    """The model's short name: the last part of ``_name_or_path`` or the directory
    name, never a local absolute path (cards are gossiped and shown publicly)."""
    raw = str(cfg.get("_name_or_path") or "").rstrip("/")
    return raw.rsplit("/", 1)[-1] or path.resolve().name


def check_chain(prefix: Sequence[Block], layout: Layout, tokens: int, checked: bool = False) -> int:
    """Validate that ``prefix`` is a contiguous chain from the root whose every
    block is what ``layout``'s card says a block is (:func:`check_block`:
    namespace, token count, layer count, per-tensor dtypes and shapes, logits),
    whichever tier it came from; return its length in tokens. ``checked``: an
    importer with this layout already checked each block as it was added."""
    parent, pos = layout.card.namespace, 0
    for i, blk in enumerate(prefix):
        if not checked:
            check_block(blk, layout)
        h = blk.header
        if h.parent != parent or h.start != pos:
            raise MalformedPayload(f"block {i} does not continue the chain")
        if h.kind == "tail" and i != len(prefix) - 1:
            raise MalformedPayload("a tail must end the prefix")
        parent, pos = h.key, pos + h.tokens
    if pos > tokens:
        raise MalformedPayload("prefix longer than the prompt")
    return pos


class Importer(abc.ABC):
    """Preallocated KV for ``n_tokens`` positions. ``add`` may be called from any
    thread, in any order, once per block: blocks write disjoint positions.

    With ``layout``, ``add`` checks each block against it (:func:`check_block`)
    before anything is copied, so ``_copy`` may rely on the block holding exactly
    one tensor per buffer, of the card's dtype and shape, and a bad block (from
    any tier) writes nothing. Without one, only :func:`check_chain` at prefill
    checks the blocks."""

    def __init__(self, n_tokens: int, layout: Layout | None = None) -> None:
        self.n_tokens = n_tokens
        self.layout = layout
        self.added = 0
        self._count = threading.Lock()

    def add(self, block: Block) -> None:
        h = block.header
        if self.layout is not None:
            check_block(block, self.layout)
        if h.start + h.tokens > self.n_tokens:
            raise MalformedPayload("block beyond the imported prefix")
        if h.tokens or h.states:  # an empty tail may carry the state at its start
            self._copy(block)
        with self._count:
            self.added += 1

    @abc.abstractmethod
    def _copy(self, block: Block) -> None:
        """Copy ``block``'s K/V (:meth:`Block.kv_tensors`, one per buffer, in
        order) into positions ``[start, start + tokens)``."""

    @abc.abstractmethod
    def cache(self) -> Any: ...


class Engine(abc.ABC):
    """An inference engine adapter."""

    name: str
    card: CompatCard
    layout: Layout
    eos_ids: frozenset[int]
    # why this model's cache cannot be exported or restored exactly (a cache type
    # kvmesh does not know yet): it is served with reuse off; None when it can
    reuse_off: str | None = None

    tokenizer: Any  # a Hugging Face tokenizer, or one with the same methods

    # -- text (chat template applied by the tokenizer) --------------------------

    def encode(self, text: str) -> list[int]:
        """Completions: the tokenizer's own special-token convention (BOS where it
        adds one), as vLLM and transformers tokenize a prompt."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Chat: the chat template alone decides special tokens (it writes BOS
        itself when the model wants one), so none is added twice."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoChatTemplate(
                "this model has no chat template; use /v1/completions with a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    # -- KV -------------------------------------------------------------------

    @abc.abstractmethod
    def importer(self, n_tokens: int) -> Importer:
        """An empty KV buffer for positions [0, n_tokens) that blocks are copied into."""

    def _import(self, blocks: Sequence[Block], n_tokens: int) -> Any:
        imp = self.importer(n_tokens)
        for blk in blocks:
            imp.add(blk)
        return imp.cache()

    @abc.abstractmethod
    def _forward(self, state_cache: Any, tokens: Sequence[int], start: int) -> tuple[Any, Any]:
        """Run ``tokens`` at positions ``start...`` on ``state_cache`` (None = empty);
        return (cache, float32 logits of the last position)."""

    @abc.abstractmethod
    def _crop(self, cache: Any, n_tokens: int) -> Any: ...

    @abc.abstractmethod
    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        """Write positions [start, stop) of every layer, K then V, into ``out``."""

    def _write_state(self, cache: Any, pos: int, out: memoryview) -> None:
        """Write every recurrent layer's state after position ``pos`` into ``out``
        (the card's ``states`` order). Only engines whose cards have state."""
        raise ConfigError(f"the {self.name} engine keeps no recurrent state")

    def _positions(self, cache: Any) -> int | None:
        """How many positions ``cache`` holds, where the engine tracks it (None:
        ask :meth:`restorable`)."""
        return None

    def exportable(self, state: KVState) -> int:
        """How many of ``state``'s positions may be exported: those in its cache."""
        return state.cached

    def restorable(self, cache: Any, n: int) -> int:
        """The most positions, at most ``n``, that ``cache`` can be cut back to: ``n``
        for attention caches; a recurrent state exists only where it was kept (a
        checkpoint, or where the cache ends); none with reuse off."""
        return n if cache is not None and self.reuse_off is None else 0

    @abc.abstractmethod
    def _write_logits(self, logits: Any, out: memoryview) -> None: ...

    @abc.abstractmethod
    def _read_logits(self, view: memoryview) -> Any: ...

    @abc.abstractmethod
    def sample(
        self,
        logits: Any,
        sampling: Sampling,
        rng: Any,
        counts: Mapping[int, int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        """The next token from ``logits``; ``counts`` (tokens generated so far, how
        often) are penalized first when ``sampling`` has a penalty. ``allowed`` (a
        grammar's mask, a bool per logit) sets the others to -inf on a copy first;
        the Decoder passes it only with a grammar."""

    @abc.abstractmethod
    def _log_softmax(self, logits: Any) -> np.ndarray:
        """Float32 log-probabilities of ``logits`` (as a NumPy vector)."""

    def logprob(self, logits: Any, token: int, top: int) -> TokenLogprob:
        """``token``'s logprob under the raw ``logits`` and the ``top`` most likely."""
        lp = self._log_softmax(logits)
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            idx = np.argpartition(-lp, top - 1)[:top]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            best = tuple((int(j), float(lp[j])) for j in idx)
        return TokenLogprob(int(token), float(lp[token]), best)

    @abc.abstractmethod
    def new_rng(self, seed: int | None) -> Any: ...

    # -- engine-neutral -------------------------------------------------------

    def begin_prefill(
        self, tokens: Sequence[int], prefix: Sequence[Block] = (), imported: Importer | None = None
    ) -> KVState:
        """The state of ``tokens`` before its computed suffix: ``prefix`` imported
        (``imported``: already copied in, see :meth:`importer`), ``cached`` the
        positions it holds, ``logits`` None until :meth:`prefill_batch` computed the
        rest. An exact tail (stored logits) leaves nothing to compute: the state is
        whole (``cached == len(tokens)``, logits set)."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("cannot prefill an empty sequence")
        checked = imported is not None and imported.layout is self.layout
        p = check_chain(prefix, self.layout, len(tokens), checked) if prefix else 0
        if imported is not None and (imported.n_tokens != p or imported.added != len(prefix)):
            raise MalformedPayload("the imported buffer does not hold this prefix")
        cache = (
            (imported.cache() if imported is not None else self._import(prefix, p)) if p else None
        )
        tail = prefix[-1] if prefix and prefix[-1].header.kind == "tail" else None
        if p == len(tokens) and tail is not None and self.restorable(cache, p) == p:
            logits = self._read_logits(next(v for s, v in reversed(list(tail.tensors()))))
            return KVState(tokens, cache, logits, p, p, 0, used_stored_logits=True)
        # no stored logits: recompute the last token; a recurrent state restarts
        # from the last checkpoint the prefix carries
        q = self.restorable(cache, p - 1 if p == len(tokens) else p)
        if q != p and q != self._positions(cache):  # an importer may have stopped there
            cache = self._crop(cache, q) if q else None
        return KVState(tokens, cache, None, q, q, len(tokens) - q)

    def begin_resume(self, state: KVState, keep: int, tokens: Sequence[int]) -> KVState:
        """:meth:`begin_prefill` from the first ``keep`` cached positions of a live
        ``state`` (their common prefix with ``tokens``). Nothing is mutated in place."""
        tokens = list(tokens)
        keep = self.restorable(state.cache, min(keep, len(tokens) - 1, state.cached))
        cache = self._crop(state.cache, keep) if keep else None
        return KVState(tokens, cache, None, keep, keep, len(tokens) - keep)

    def prefill(
        self,
        tokens: Sequence[int],
        prefix: Sequence[Block] = (),
        imported: Importer | None = None,
        between: Callable[[], None] | None = None,
        chunk: int = PREFILL_CHUNK,
    ) -> KVState:
        """KV and next-token logits for ``tokens``, importing ``prefix`` first.
        ``imported`` is ``prefix`` already copied in (see :meth:`importer`). With
        ``between``, a suffix longer than ``chunk`` tokens is computed ``chunk`` at
        a time and ``between()`` runs after each chunk but the last (a batch keeps
        decoding while a long prompt is prefilled)."""
        state = self.begin_prefill(tokens, prefix, imported)
        while between is not None and len(state.tokens) - state.cached > chunk:
            self.prefill_batch([state], [chunk])
            between()
        if state.cached < len(state.tokens):
            self.prefill_batch([state], [len(state.tokens) - state.cached])
        return state

    def prefill_batch(self, states: Sequence[KVState], chunks: Sequence[int]) -> None:
        """Compute the next ``chunks[i]`` prompt tokens of each ``states[i]``
        (``tokens[cached : cached + chunks[i]]``), updating its cache, ``cached`` and
        logits (those of its last computed position). Engines that can run several
        prompts in one forward override this; one state alone always takes the
        single-sequence path (:meth:`_forward`), so a lone prompt computes exactly
        as unbatched. This default runs them one after another."""
        if len(states) != len(chunks):
            raise ValueError("one chunk per state")
        for state, n in zip(states, chunks, strict=True):
            at = state.cached
            if n < 1 or at + n > len(state.tokens):
                raise ValueError(f"chunk of {n} tokens at {at} of {len(state.tokens)}")
            state.cache, state.logits = self._forward(state.cache, state.tokens[at : at + n], at)
            state.cached = at + n

    def extend(self, state: KVState, tokens: Sequence[int]) -> KVState:
        """Append ``tokens`` to a live state (sessions: no lookup needed). The
        state's cache is extended in place: ``state`` is spent (:meth:`fork` it
        first to keep it; a hybrid's kept state at its end may be gone)."""
        if not tokens:
            return state
        if state.cached < len(state.tokens):  # last token not in the cache yet
            tokens = state.tokens[state.cached :] + list(tokens)
        cache, logits = self._forward(state.cache, tokens, state.cached)
        all_tokens = state.tokens + list(tokens[len(state.tokens) - state.cached :])
        return KVState(all_tokens, cache, logits, len(all_tokens))

    def resume(self, state: KVState, keep: int, tokens: Sequence[int]) -> KVState:
        """Reuse the first ``keep`` cached positions of a live ``state`` for ``tokens``
        (their common prefix), computing the rest. Nothing is mutated in place."""
        out = self.begin_resume(state, keep, tokens)
        self.prefill_batch([out], [len(out.tokens) - out.cached])
        return out

    def fork(self, state: KVState) -> KVState:
        """An independent copy of a live ``state`` (``n`` sequences from one
        prefill): the same cached tensors (a crop shares them; decoding one copy
        never writes into another) and the same logits."""
        if self.reuse_off is not None:  # a cache it cannot copy: computed again
            again = self.prefill(state.tokens[: state.cached]) if state.cached else None
            cache = again.cache if again is not None else None
            return KVState(list(state.tokens), cache, state.logits, state.cached)
        cache = self._crop(state.cache, state.cached) if state.cached else None
        return KVState(list(state.tokens), cache, state.logits, state.cached)

    def generate(
        self, state: KVState, sampling: Sampling, out: Decoded | None = None
    ) -> Iterator[int]:
        """Decode locally, one sequence. Mutates ``state`` so it ends holding the
        whole sequence. ``out``, when given, is filled in before each token is
        yielded (see :class:`Decoder`)."""
        decoder = Decoder(self, state, sampling, out)
        while True:
            tok, last = decoder.next()
            yield tok
            if last:
                return  # the last token is not forwarded: its KV is never needed here
            self.decode_batch([state])

    def decode_batch(self, states: Sequence[KVState]) -> None:
        """Forward each state's one pending token (the one its decoder just
        sampled), updating its cache, logits and ``cached``. Engines that can run
        several sequences in one forward override this; one state alone always
        takes the single-sequence path, so a lone request decodes exactly as
        without batching. This default runs them one after another."""
        for state in states:
            self._advance(state)

    def _advance(self, state: KVState) -> None:
        pending = state.tokens[state.cached :]
        state.cache, state.logits = self._forward(state.cache, pending, state.cached)
        state.cached = len(state.tokens)

    @property
    def batches(self) -> bool:
        """Whether :meth:`decode_batch` runs several sequences in one forward."""
        return False

    def detach(self, state: KVState) -> None:
        """Make ``state`` own its tensors once it leaves a batch (a session or an
        export must not keep a whole batch's tensors alive)."""
        return None  # engines whose batched rows are copies already have nothing to do

    def export(
        self,
        state: KVState,
        keyer: BlockKeyer,
        keys: PrefixKeys | None = None,
        first_block: int = 0,
    ) -> list[Block]:
        """Blocks for ``state``: full blocks from ``first_block`` on, then the tail.
        Only positions already in the cache are exported; none with reuse off."""
        if self.reuse_off is not None:
            return []
        tokens, limit = state.tokens, self.exportable(state)
        if limit < len(tokens):  # e.g. a generated last token: no KV yet, no logits for it
            tokens = tokens[:limit]
            logits = None
        else:
            logits = state.logits
        keys = keys or keyer.keys(tokens)
        b = self.card.block_tokens
        out: list[Block] = []
        for i in range(first_block, min(len(keys.blocks), limit // b)):
            hdr = self.layout.header("block", keys.blocks[i], keyer.parent_of(keys, i), i * b, b)
            out.append(self._seal(state.cache, hdr))
        if logits is not None:
            n_full = len(keys.blocks)
            parent = keys.blocks[-1] if n_full else keyer.namespace
            hdr = self.layout.header("tail", keys.tail, parent, n_full * b, keys.tail_tokens)
            out.append(self._seal(state.cache, hdr, logits))
        return out

    def _seal(self, cache: Any, header: BlockHeader, logits: Any = None) -> Block:
        blob, view = new_blob(header)
        kv, state = header.kv_bytes, header.state_bytes
        end = header.start + header.tokens
        if header.tokens:
            self._write_kv(cache, header.start, end, view[:kv])
        if state:
            self._write_state(cache, end, view[kv : kv + state])
        if logits is not None:
            self._write_logits(logits, view[kv + state :])
        return self.layout.seal(header, blob)
