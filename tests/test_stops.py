"""Stop strings matched incrementally (kvmesh/engine/base.py, StopScanner): each
piece of text costs work in proportion to its own length times the number of stop
strings, never their length (issue #36: four 30,000-character stops made every
decode step rescan them, O(length²) per token), with exactly the semantics of the
rescanning scanner it replaced: where the answer is cut (the earliest start of any
stop string, across pieces) and what is held back while streaming (an end of the
text that could still start a stop string). The old scanner is kept below as the
reference; the real engine on demo-tiny (one character per token) checks a stop
string spanning several tokens, its held-back text token by token, and the work of
long stop strings on a real decode."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.base import Decoded, Decoder, Sampling, StopScanner
from kvmesh.engine.decode import stop_borders

PROMPT = "Explain prefill caching"


class Rescanning:
    """The scanner before issue #36, verbatim in behaviour: the reference."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.cut: int | None = None
        self._scanned = 0

    def feed(self, piece: str) -> int:
        if self.cut is not None:
            return self.cut
        self.text += piece
        if not self.stops:
            return len(self.text)
        hits = [i for s in self.stops if (i := self.text.find(s, self._scanned)) >= 0]
        if hits:
            self.cut = min(hits)
            return self.cut
        safe = len(self.text) - max(self._partial(s) for s in self.stops)
        self._scanned = safe
        return safe

    def _partial(self, stop: str) -> int:
        for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
            if self.text.endswith(stop[:k]):
                return k
        return 0


def same_as_reference(stops: Sequence[str], pieces: Sequence[str]) -> StopScanner:
    new, old = StopScanner(stops), Rescanning(stops)
    for piece in pieces:
        assert new.feed(piece) == old.feed(piece), (stops, pieces, new.text)
        assert (new.cut, new.text) == (old.cut, old.text)
    return new


# a small alphabet: stops overlap themselves and each other, and occur often
_text = st.text(alphabet="abc\n", max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc\n", max_size=7), max_size=4),
    pieces=st.lists(_text, max_size=12),
)
def test_cut_and_holdback_are_the_rescanning_scanners(stops, pieces):
    same_as_reference(stops, pieces)


@pytest.mark.parametrize(
    ("stops", "pieces"),
    [
        (["abcd"], ["xa", "b", "c", "d", "e"]),  # one stop over four pieces
        (["abcd"], ["xab", "cab", "cd"]),  # a false start, then the real one
        (["aab"], ["a", "a", "a", "a", "b"]),  # a fallback to a shorter start
        (["abcd", "bc"], ["abcd"]),  # the longer stop starts first: it wins in one piece
        (["abcd", "bc"], ["ab", "c", "d"]),  # ... and "bc" wins once it completes first
        (["world", "lo w"], ["hel", "lo wor"]),
        (["\n\n", "\n"], ["x\n", "\n"]),
        (["aa"], ["baa"]),
        (["é✓"], ["caf", "é", "✓!"]),  # characters, not bytes
        ([], ["anything"]),
        ([""], ["empty stops are ignored"]),
    ],
)
def test_boundaries_match_the_reference(stops, pieces):
    same_as_reference(stops, pieces)


def test_a_stop_over_several_pieces_is_held_back_then_cut():
    s = StopScanner(["abcd"])
    assert s.feed("xa") == 1 and s.feed("b") == 1 and s.feed("c") == 1  # "abc" may start it
    assert s.feed("x") == 5 and s.cut is None  # "abcx" cannot: all shown
    assert s.feed("ab") == 5 and s.feed("cd") == 5 and s.cut == 5
    assert s.feed("more") == 5 and s.text == "xabcxabcd"  # nothing fed after a cut


def test_long_stops_cost_the_new_text_not_their_length():
    # issue #36's case: four 30,000-character stops, whose long self-overlapping
    # starts are the rescanning scanner's worst case; text that keeps almost
    # matching them (a run of "a" as long as the stops, then others)
    n = 30_000
    stops = ["a" * (n - 1) + "b", "a" * (n - 1) + "c", ("ab" * n)[:n], "x" * n]
    stop_borders.cache_clear()
    s = StopScanner(stops)
    fed = 0
    for piece in ["a"] * n + ["d", "ab"] * 500 + ["a" * 7] * 300:
        before = s.steps
        held = len(s.text) + len(piece) - s.feed(piece)
        fed += len(piece)
        # per piece: at most two comparisons per character per stop, plus the
        # fallbacks that earlier characters paid for (bounded in total below)
        assert s.cut is None and held <= n - 1
        assert s.steps - before <= 2 * len(stops) * len(piece) + 2 * n * len(stops)
    assert s.steps <= 2 * len(stops) * fed  # amortized: linear in the text, all stops
    info = stop_borders.cache_info()
    assert info.misses == len(set(stops))  # one table per distinct stop string
    siblings = [StopScanner(stops) for _ in range(8)]  # n=8: the tables are shared
    assert stop_borders.cache_info().misses == info.misses
    assert all(x._borders[0] is s._borders[0] for x in siblings)


def test_the_engine_holds_back_a_stop_spanning_tokens_and_cuts_it(tiny_engine):
    """A stop of four characters that spans several tokens of a real decode: token
    by token, the text shown is what the reference scanner shows for the text
    decoded so far; none of the stop is ever shown, and the answer is cut at it."""
    e = tiny_engine
    state = e.prefill(e.encode(PROMPT))
    base = Sampling(max_tokens=24, stop_on_eos=False, frequency_penalty=0.5)
    free = Decoded()
    list(e.generate(e.fork(state), base, free))
    whole = free.text
    # four characters from the fifth on that occur there first
    at = next(i for i in range(4, len(whole) - 4) if whole.find(whole[i : i + 4]) == i)
    stop = whole[at : at + 4]
    out = Decoded()
    sampling = Sampling(**{**base.__dict__, "stop": (stop, "\u2603")})
    decoder = Decoder(e, e.fork(state), sampling, out)
    assert decoder.text is not None
    ref = Rescanning([stop, "\u2603"])
    while True:
        _, last = decoder.next()
        seen = decoder.text.scanner.text
        safe = ref.feed(seen[len(ref.text) :])
        if ref.cut is None and last:
            safe = len(ref.text)  # the end: nothing can complete a stop string any more
        assert out.text == ref.text[:safe] and len(out.text) <= at, (out.text, seen)
        if last:
            break
        e.decode_batch([decoder.state])
    assert out.stopped and out.finish_reason == "stop" and out.text == whole[:at]
    assert out.tokens == free.tokens[: len(out.tokens)]
    spanning = [o for o in out.offsets if at <= o < at + len(stop)]
    assert len(spanning) >= 2  # the premise: the stop string spans several tokens
    assert decoder.text.scanner.steps <= 2 * 2 * len(decoder.text.scanner.text)


def test_long_stops_on_a_real_decode_cost_the_text(tiny_engine):
    """n=8 sequences, four 30,000-character stops: the scanners' work is a few
    comparisons per generated character, whatever the stops' length."""
    e = tiny_engine
    stops = tuple(c * 29_999 + "\u2603" for c in "abcd")
    sampling = Sampling(max_tokens=16, stop_on_eos=False, temperature=1.0, seed=3, stop=stops)
    state = e.prefill(e.encode(PROMPT))
    decoders = [Decoder(e, e.fork(state), sampling, Decoded()) for _ in range(8)]
    going = list(decoders)
    while going:
        for d in going:
            d.next()
        going = [d for d in going if d.out is not None and not d.out.done]
        if going:
            e.decode_batch([d.state for d in going])
    for d in decoders:
        assert d.out is not None and d.text is not None
        chars = len(d.text.scanner.text)
        assert d.out.finish_reason == "length" and chars > 0
        assert d.text.scanner.steps <= 2 * len(stops) * chars
