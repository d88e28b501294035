"""Structured output by constrained decoding (kvmesh/engine/grammar.py, the mask in
Decoder.next) on the test zoo's qwen2, random weights, torch and mlx.

Random weights would write anything: only the grammar makes these outputs parse.
Strings and arrays in the schemas are bounded (maxLength, maxItems) so that a
random model's free text ends within ``max_tokens``; whitespace between JSON
tokens is bounded by the grammar itself (grammar.WHITESPACE)."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from kvmesh.engine import load_engine
from kvmesh.engine.base import Decoded, Decoder, Sampling
from kvmesh.engine.grammar import (
    GrammarSpec,
    compile_grammar,
    hf_tokenizer,
)

from . import zoo

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "maxItems": 3,
        },
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}

_engines: dict[str, object] = {}


def engine(kind: str):
    if kind not in _engines:
        if kind == "torch":
            _engines[kind] = load_engine(str(zoo.hf_model("qwen2")), "torch")
        else:
            pytest.importorskip("mlx_lm")
            _engines[kind] = load_engine(str(zoo.mlx_model("qwen2", "float32")), "mlx")
    return _engines[kind]


def prompt(n: int = 24, seed: int = 0) -> list[int]:
    return zoo.prompt_tokens(zoo.hf_model("qwen2"), n, seed=seed)


def run(eng, sampling: Sampling, tokens: list[int] | None = None) -> Decoded:
    out = Decoded()
    for _ in eng.generate(eng.prefill(tokens or prompt()), sampling, out):
        pass
    return out


def check_schema(doc: object) -> None:
    """``doc`` against SCHEMA: with jsonschema where installed, and by hand always."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(doc, SCHEMA)
    assert isinstance(doc, dict) and set(doc) == {"color", "count", "tags"}
    assert doc["color"] in ("red", "green", "blue")
    assert type(doc["count"]) is int and 0 <= doc["count"] <= 999
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in doc["tags"])


KINDS = ["torch", "mlx"]
TEMPS = [(0.0, None), (1.0, 0), (1.0, 1)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("temperature", "seed"), TEMPS)
def test_json_schema_output_validates(kind, temperature, seed):
    eng = engine(kind)
    spec = GrammarSpec.json_schema(SCHEMA, strict=True)
    out = run(eng, Sampling(max_tokens=256, temperature=temperature, seed=seed, grammar=spec))
    assert out.finish_reason == "stop", out.text
    check_schema(json.loads(out.text))
    assert out.tokens[-1] not in eng.eos_ids  # the grammar ended it, not an EOS
    without = run(eng, Sampling(max_tokens=len(out.tokens), temperature=temperature, seed=seed))
    with pytest.raises(ValueError):  # random weights alone write no JSON
        json.loads(without.text)


@pytest.mark.parametrize("kind", KINDS)
def test_json_object(kind):
    eng = engine(kind)
    spec = GrammarSpec.from_response_format({"type": "json_object"})
    assert spec == GrammarSpec.json_object()
    # a random model's free strings end by chance: a few tries, one must close
    outs = [
        run(eng, Sampling(max_tokens=160, temperature=1.0, seed=s, grammar=spec)) for s in range(3)
    ]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, [o.text for o in outs]
    for o in done:
        assert isinstance(json.loads(o.text), dict)
    for o in outs:  # cut by max_tokens: still a prefix the grammar accepts
        assert o.text.lstrip().startswith("{")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pattern", [r"\d{3}-[a-z]{2}", r"[0-9]{3}-[a-z]{2}"])
def test_regex_matches_whole(kind, pattern):
    eng = engine(kind)
    for temperature, seed in TEMPS:
        spec = GrammarSpec.regex(pattern)
        out = run(eng, Sampling(max_tokens=32, temperature=temperature, seed=seed, grammar=spec))
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text  # \d: Unicode digits, as Python's


@pytest.mark.parametrize("kind", KINDS)
def test_choice_is_one_of_the_strings(kind):
    eng = engine(kind)
    options = ["red", "green apple", 'say "hi"', "a|b", "é\n"]
    spec = GrammarSpec.choice(options)
    seen = set()
    for temperature, seed in TEMPS + [(1.0, 2), (1.0, 3)]:
        s = Sampling(max_tokens=32, temperature=temperature, seed=seed, grammar=spec)
        out = run(eng, s, prompt(24, seed=1))
        assert out.finish_reason == "stop" and out.text in options, out.text
        seen.add(out.text)
    assert len(seen) > 1  # sampled among them, not always the same


def test_logprobs_stay_raw():
    """A forced token's logprob is the raw model's (vLLM's default), not 0 under
    the mask: the one option is forced token by token."""
    eng = engine("torch")
    spec = GrammarSpec.choice(["zebra crossing"])
    out = run(eng, Sampling(max_tokens=16, logprobs=2, grammar=spec))
    assert out.text == "zebra crossing"
    plain = eng.prefill(prompt())
    first = eng.logprob(plain.logits, out.tokens[0], 2)
    assert out.logprobs[0] == first
    assert all(lp.logprob < -0.01 for lp in out.logprobs)


@pytest.mark.parametrize("kind", KINDS)
def test_no_grammar_samples_bitwise_as_before(kind, monkeypatch):
    """Without a grammar the decoder calls ``sample`` exactly as before (no mask
    argument) and the tokens are the plain loop's, greedy, seeded and penalized."""
    eng = engine(kind)
    calls: list[tuple] = []
    real = type(eng).sample

    def spy(self, *a, **kw):
        calls.append((len(a), tuple(kw)))
        return real(self, *a, **kw)

    cases = [
        Sampling(max_tokens=20, stop_on_eos=False),
        Sampling(max_tokens=20, temperature=0.9, top_p=0.8, seed=7, stop_on_eos=False),
        Sampling(max_tokens=20, temperature=1.0, seed=3, presence_penalty=0.5, stop_on_eos=False),
    ]
    for s in cases:
        # the plain loop: what Decoder did before grammars
        state = eng.prefill(prompt())
        rng, counts, ref = eng.new_rng(s.seed), ({} if s.penalized else None), []
        for i in range(s.max_tokens):
            tok = eng.sample(state.logits, s, rng, counts)
            ref.append(tok)
            if counts is not None:
                counts[tok] = counts.get(tok, 0) + 1
            state.tokens.append(tok)
            if i + 1 < s.max_tokens:
                eng.decode_batch([state])
        with monkeypatch.context() as mp:
            mp.setattr(type(eng), "sample", spy)
            got = run(eng, s).tokens
        assert got == ref
        assert calls and all(c == (4, ()) for c in calls)
        calls.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_n_sequences_batched_each_its_own_matcher(kind):
    """``n`` > 1 through the batch runner: every choice its own matcher, decoded in
    one batch with a request that has no grammar, which decodes as alone."""
    from kvmesh.runtime.head import Generation, HeadRuntime

    eng = engine(kind)
    h = HeadRuntime(eng, publish=False, max_sessions=0, max_batch=8)
    try:
        plain = Sampling(max_tokens=40, temperature=1.0, seed=11, stop_on_eos=False)
        alone = h.complete(prompt(30, seed=1), plain).tokens
        spec = GrammarSpec.json_schema(SCHEMA)
        s = Sampling(max_tokens=256, temperature=1.0, seed=5, n=4, grammar=spec)
        outs: dict[str, Generation] = {}
        started = threading.Event()

        def constrained() -> None:
            outs["g"] = Generation()
            for _ in h.generate(prompt(), s, outs["g"]):
                started.set()

        t = threading.Thread(target=constrained)
        t.start()
        assert started.wait(60)
        beside = h.complete(prompt(30, seed=1), plain)
        t.join(120)
        assert not t.is_alive()
        choices = outs["g"].choices
        assert len(choices) == 4
        for c in choices:
            assert c.finish_reason == "stop", c.text
            check_schema(json.loads(c.text))
        assert len({c.text for c in choices}) > 1  # seeds differ, matchers independent
        assert h.batch.peak_batch > 1  # they really shared forwards
        if kind == "torch":  # a batch may round differently: exact where the engine is
            assert beside.tokens[:5] == alone[:5]
    finally:
        h.close()


def test_a_grammar_that_fails_fails_its_request_alone(monkeypatch):
    """Compiled in the caller's thread at submit (its error is the caller's); a
    decoder that still fails on the engine thread fails its job, not the engine."""
    from kvmesh.engine import decode
    from kvmesh.runtime import batch
    from kvmesh.runtime.head import HeadRuntime

    eng = engine("torch")
    h = HeadRuntime(eng, publish=False, max_sessions=0)
    spec = GrammarSpec.regex("[a-z]{3}")
    try:
        with monkeypatch.context() as mp:

            def refuse(tokenizer, spec):
                raise ValueError("no grammar for you")

            mp.setattr(batch, "compile_grammar", refuse)
            with pytest.raises(ValueError, match="no grammar for you"):
                h.complete(prompt(), Sampling(max_tokens=4, grammar=spec))
        with monkeypatch.context() as mp:

            def broken(tokenizer, spec):
                raise RuntimeError("broken on the engine thread")

            mp.setattr(decode, "compile_grammar", broken)
            with pytest.raises(RuntimeError, match="broken on the engine thread"):
                h.complete(prompt(), Sampling(max_tokens=4, n=2, grammar=spec))
        assert h.batch.failure is None
        ok = h.complete(prompt(), Sampling(max_tokens=8, grammar=spec))
        assert re.fullmatch("[a-z]{3}", ok.choices[0].text)
        assert h.batch.running == 0
    finally:
        h.close()


def test_invalid_specs_are_value_errors():
    bad = [
        lambda: GrammarSpec.json_schema({"type": "nonsense"}),
        lambda: GrammarSpec.json_schema('{"type": '),
        lambda: GrammarSpec.json_schema([1, 2]),  # type: ignore[arg-type]
        lambda: GrammarSpec.json_schema({"type": "string", "pattern": "(("}),
        lambda: GrammarSpec.json_schema({"$ref": "#/definitions/missing"}),
        lambda: GrammarSpec.json_schema({"type": "integer", "minimum": "x"}),
        lambda: GrammarSpec.json_schema({"type": "string", "format": "no-such-format"}),
        lambda: GrammarSpec.regex("(("),
        lambda: GrammarSpec.regex("a{3,1}"),
        lambda: GrammarSpec.choice([]),
        lambda: GrammarSpec.cfg("start: missing_rule"),
        lambda: GrammarSpec("xml", "<a/>"),
        lambda: GrammarSpec.from_response_format({"type": "json_schema"}),
        lambda: GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {}}),
        lambda: GrammarSpec.from_response_format({"type": "yaml"}),
    ]
    for make in bad:
        with pytest.raises(ValueError):
            make()
    # not strict: an unknown keyword value is ignored (OpenAI's strict false)
    GrammarSpec.json_schema({"type": "string", "format": "no-such-format"}, strict=False)


def test_builders_and_hashing():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    a = GrammarSpec.from_response_format(rf)
    b = GrammarSpec.json_schema(json.dumps(SCHEMA, indent=2), strict=True)
    assert a == b and hash(a) == hash(b)  # the schema's text is canonical
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format(None) is None
    tool = {"type": "function", "function": {"name": "paint", "parameters": SCHEMA}}
    assert GrammarSpec.from_tool(tool) == GrammarSpec.json_schema(SCHEMA, strict=False)
    assert GrammarSpec.from_tool({"name": "noop"}).kind == "json_schema"
    s = Sampling(grammar=a)
    assert hash(s) == hash(Sampling(grammar=b))
    vllm = GrammarSpec.from_structured_outputs
    assert (
        vllm({"json": SCHEMA})
        == vllm({"guided_json": json.dumps(SCHEMA)})
        == (GrammarSpec.json_schema(SCHEMA))
    )
    assert (
        vllm({"regex": "[a-z]+"}) == vllm({"guided_regex": "[a-z]+"}) == GrammarSpec.regex("[a-z]+")
    )
    assert vllm({"guided_choice": ["a", "b"]}) == GrammarSpec.choice(("a", "b"))
    assert vllm({"grammar": 'start: "x"'}).kind == "grammar"
    assert vllm({"json_object": True}) == GrammarSpec.json_object()
    assert vllm({"guided_json": None, "other": 1}) is None
    for bad in ({"regex": "a", "choice": ["a"]}, {"choice": "ab"}, {"regex": 5}):
        with pytest.raises(ValueError):
            vllm(bad)


def test_properties_come_in_the_schema_s_order():
    eng = engine("torch")
    props = {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}
    schema = {
        "type": "object",
        "properties": props,
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema)
    assert spec != GrammarSpec.json_schema({**schema, "properties": dict(reversed(props.items()))})
    out = run(eng, Sampling(max_tokens=96, grammar=spec))
    assert out.finish_reason == "stop"
    doc = json.loads(out.text)
    assert list(doc) == ["zeta", "alpha"] and all(type(v) is bool for v in doc.values())


def test_cache_and_vocabulary_width(monkeypatch):
    eng = engine("torch")
    spec = GrammarSpec.regex(r"[a-c]{2}")
    one = compile_grammar(eng.tokenizer, spec)
    assert compile_grammar(eng.tokenizer, spec) is one
    from kvmesh.engine import grammar

    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    for p in ("x", "y", "z"):
        compile_grammar(eng.tokenizer, GrammarSpec.regex(p))
    assert compile_grammar(eng.tokenizer, spec) is not one  # dropped: least recently used
    n = len(hf_tokenizer(eng.tokenizer))
    m = one.matcher()
    wide = m.allowed(n + 64, eng.eos_ids)  # an embedding padded past the tokenizer
    assert wide.shape == (n + 64,) and not wide[n:].any() and wide[:n].any()
    assert not wide[list(eng.eos_ids)].any()  # nothing matched yet: no end
    narrow = m.allowed(n - 8, eng.eos_ids)
    assert narrow.shape == (n - 8,)
    assert (narrow == wide[: n - 8]).all()


def test_mlx_wrapper_unwraps_to_the_hf_tokenizer():
    eng = engine("mlx")
    inner = hf_tokenizer(eng.tokenizer)
    assert inner is eng.tokenizer._tokenizer
    with pytest.raises(ValueError):
        hf_tokenizer(object())


def test_decoder_ends_on_eos_when_the_grammar_may_end():
    """``\\d+`` may end after any digit: EOS is allowed then, and a sampled EOS ends
    the sequence with ``stop``; with ``stop_on_eos`` off only digits are allowed."""
    eng = engine("torch")
    spec = GrammarSpec.regex(r"[0-9]+")
    ended = []
    for seed in range(6):
        out = run(eng, Sampling(max_tokens=24, temperature=1.0, seed=seed, grammar=spec))
        assert re.fullmatch(r"[0-9]*", out.text), out.text
        if out.finish_reason == "stop":
            assert out.tokens[-1] in eng.eos_ids
            ended.append(out)
    assert ended  # some seed samples EOS among the few allowed tokens
    state = eng.prefill(prompt())
    d = Decoder(eng, state, Sampling(max_tokens=12, stop_on_eos=False, grammar=spec))
    for _ in range(12):
        tok, last = d.next()
        assert tok not in eng.eos_ids
        if last:
            break
        eng.decode_batch([state])
    assert d.grammar is not None and d.grammar.accepting


def test_allowed_mask_is_the_grammar_s():
    """The mask allows exactly the tokens whose text can continue the match."""
    eng = engine("torch")
    tok = hf_tokenizer(eng.tokenizer)
    m = compile_grammar(eng.tokenizer, GrammarSpec.choice(["abc", "abd"])).matcher()
    allowed = np.flatnonzero(m.allowed(len(tok)))
    texts = {tok.decode([int(i)]) for i in allowed}
    assert texts and all("abc".startswith(t) or "abd".startswith(t) for t in texts)
