"""Decoding one sequence: what to sample (:class:`Sampling`), the sampler loop
(:class:`Decoder`), and the answer as it grows (:class:`Decoded`: tokens,
logprobs, text with stop strings cut off).

The decoder asks its engine only for ``sample``, ``logprob``, ``new_rng``,
``decode_text``, ``tokenizer`` and ``eos_ids``; forwarding each sampled token is
the caller's (:meth:`kvmesh.engine.protocol.Engine.decode_batch`).
"""

from __future__ import annotations

import bisect
import functools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .grammar import ConstraintFailed, GrammarMatcher, GrammarSpec, compile_grammar

if TYPE_CHECKING:
    from .protocol import Engine
    from .state import KVState


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
    the text's: long stop strings cost their one table (:func:`stop_borders`,
    shared by every scanner of the same string), not a rescan per token.
    ``steps`` counts that work (characters compared, fallbacks included)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything fed so far
        self.cut: int | None = None  # where the first stop string starts, once found
        self.steps = 0  # characters compared so far, fallbacks included
        self._borders = [stop_borders(s) for s in self.stops]
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
def stop_borders(stop: str) -> array:
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
    default. Without a grammar none of this runs."""

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
                raise ConstraintFailed("the output constraint allows no token here")
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
