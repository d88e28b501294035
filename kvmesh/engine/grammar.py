"""Structured output by constrained decoding: a grammar's token mask on each step's
logits, from llguidance.

A request's constraint is a :class:`GrammarSpec` (hashable, so it rides in the frozen
:class:`~kvmesh.engine.decode.Sampling`): a JSON schema, any JSON object, a regular
expression, a choice among strings, or a context-free grammar (Lark or GBNF, as
vLLM's ``structured_outputs.grammar``). A spec that exists is valid: a bad one
raises :class:`ValueError` when it is built (the API answers 400). It is compiled
once per (tokenizer, spec) (:func:`compile_grammar`, a bounded LRU per tokenizer);
each sequence gets its own :class:`GrammarMatcher`: ``allowed()`` is the mask over
the model's logits for the next token, ``advance(token)`` consumes the sampled
token, ``done`` says the grammar is complete (finish reason ``stop``).
:class:`~kvmesh.engine.decode.Decoder` drives it; an engine's ``sample`` only sees
the mask. The mask acts after the forward: the KV is the same with or without a
constraint.

Building one from a request: :meth:`GrammarSpec.from_response_format`,
:meth:`GrammarSpec.from_tool` (``tool_choice`` required or named),
:meth:`GrammarSpec.from_structured_outputs` (vLLM's ``structured_outputs`` and
``guided_*`` extras), or the kind's own class method.

EOS: the grammar's end-of-text token is replaced by the engine's ``eos_ids``,
allowed exactly when the grammar accepts what came so far; tokens past the
tokenizer's vocabulary are never allowed.

JSON: between tokens, up to 4 spaces or tabs, then at most one line break and up
to 32 more (:data:`WHITESPACE`): compact, spaced and pretty-printed JSON fit, the
runaway whitespace of unbounded ``whitespace_flexible`` does not (llguidance >= 1.9
enforces the bound). A schema's ``x-guidance`` options override this. ``strict``
(OpenAI's ``json_schema.strict``) makes a schema keyword llguidance does not
implement an error; otherwise it is ignored. Either way the output is constrained.

Why llguidance rather than xgrammar: docs/benchmarks.md, "Grammar libraries".
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
WHITESPACE = r"[\x20\x09]{0,4}(?:\r?\n[\x20\x09]{0,32})?"  # between JSON tokens
CACHE_SIZE = 128  # compiled grammars kept per tokenizer (least recently used dropped)


@dataclass(frozen=True)
class GrammarSpec:
    """What a sequence's output must match. ``kind``: ``json_schema`` (``source``:
    the schema as JSON text; ``strict``), ``json_object`` (any JSON object),
    ``regex`` (``source``: the pattern, Rust ``regex`` syntax, matched whole),
    ``choice`` (``source``: a tuple of strings, the output is exactly one) or
    ``grammar`` (``source``: Lark or GBNF text). Build one with the class methods;
    invalid ones raise :class:`ValueError`."""

    kind: str
    source: str | tuple[str, ...] = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind == "choice":
            if (
                not isinstance(self.source, tuple)
                or not self.source
                or not all(isinstance(s, str) for s in self.source)
            ):
                raise ValueError("a choice needs a non-empty list of strings")
        elif not isinstance(self.source, str):
            raise ValueError(f"a {self.kind} grammar's source is a string")
        _grammar(self)  # every spec that exists is valid (cached: built once)

    # -- builders ---------------------------------------------------------------

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str | bool, strict: bool = True
    ) -> GrammarSpec:
        """A JSON schema (a mapping, or its JSON text). An object's properties come
        in the order the schema lists them (llguidance's rule), so the order of its
        keys matters and two specs of the same schema in another order differ."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise ValueError("a JSON schema is an object")
        # compact but in the schema's order: properties are written in that order
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", text, bool(strict))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> GrammarSpec:
        return cls("choice", tuple(options))

    @classmethod
    def cfg(cls, text: str) -> GrammarSpec:
        """A context-free grammar in Lark (llguidance's syntax) or GBNF."""
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
        """OpenAI's ``response_format``: ``text`` (or none) → None; ``json_object``;
        ``json_schema`` with ``json_schema: {name, schema, strict}`` (OpenAI's
        ``strict`` defaults to false)."""
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping):
                raise ValueError("response_format.json_schema is required for type json_schema")
            schema = spec.get("schema", spec.get("json_schema"))  # vLLM's older spelling too
            if schema is None:
                raise ValueError("response_format.json_schema.schema is required")
            return cls.json_schema(schema, strict=bool(spec.get("strict", False)))
        raise ValueError(f"unsupported response_format type {kind!r}")

    @classmethod
    def from_tool(cls, tool: Mapping[str, Any]) -> GrammarSpec:
        """A tool's arguments: the JSON schema of its ``parameters`` (an OpenAI tool,
        ``{"type": "function", "function": {...}}``, or the function itself); no
        parameters → any object without properties."""
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        return cls.json_schema(params, strict=bool(fn.get("strict", False)))

    @classmethod
    def from_structured_outputs(cls, params: Mapping[str, Any]) -> GrammarSpec | None:
        """vLLM's extras: ``structured_outputs`` (``json``, ``regex``, ``choice``,
        ``grammar``, ``json_object``) or the older top-level ``guided_json``,
        ``guided_regex``, ``guided_choice``, ``guided_grammar``; None when none is
        set, ValueError when more than one is."""
        keys = {
            "json": "json",
            "guided_json": "json",
            "regex": "regex",
            "guided_regex": "regex",
            "choice": "choice",
            "guided_choice": "choice",
            "grammar": "grammar",
            "guided_grammar": "grammar",
            "json_object": "json_object",
        }
        given = [(keys[k], v) for k, v in params.items() if k in keys and v not in (None, False)]
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(k for k, v in params.items() if k in keys and v not in (None, False))
            raise ValueError(f"only one structured output constraint at a time, not {names}")
        kind, value = given[0]
        if kind == "json":
            return cls.json_schema(value)
        if kind == "json_object":
            return cls.json_object()
        if kind == "choice":
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise ValueError("choice is a list of strings")
            return cls.choice(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} is a string")
        return cls.regex(value) if kind == "regex" else cls.cfg(value)

    def __repr__(self) -> str:
        src = self.source if len(str(self.source)) <= 60 else f"{str(self.source)[:57]}..."
        return f"GrammarSpec({self.kind!r}, {src!r}, strict={self.strict})"


_VALID: dict[GrammarSpec, str] = {}  # spec -> llguidance grammar, bounded below
_VALID_LOCK = threading.Lock()


def _grammar(spec: GrammarSpec) -> str:
    """``spec`` as an llguidance grammar, checked (no tokenizer needed): ValueError
    with llguidance's message when it is not valid."""
    with _VALID_LOCK:
        hit = _VALID.get(spec)
    if hit is not None:
        return hit
    import llguidance as llg

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = str(spec.source) if spec.kind == "json_schema" else '{"type":"object"}'
            options: JsonCompileOptions = {
                "whitespace_pattern": WHITESPACE,
                "lenient": not spec.strict,
            }
            g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif spec.kind == "regex":
            g = llg.LLMatcher.grammar_from_regex(str(spec.source))
        elif spec.kind == "choice":
            g = llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(s) for s in spec.source)
            )
        else:
            g = llg.grammar_from("grammar", str(spec.source))
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid {spec.kind}: {e}") from None
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        raise ValueError(f"invalid {spec.kind}: {err}")
    with _VALID_LOCK:
        if len(_VALID) >= 4 * CACHE_SIZE:
            _VALID.pop(next(iter(_VALID)))
        _VALID[spec] = g
    return g


# -- per tokenizer -------------------------------------------------------------------


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face fast tokenizer behind an engine's ``tokenizer``: itself, or
    the one mlx-lm's ``TokenizerWrapper`` wraps (its ``_tokenizer``; the wrapper
    forwards every other attribute, so only the type tells them apart)."""
    from transformers import PreTrainedTokenizerFast

    t = tokenizer
    for _ in range(4):
        if isinstance(t, PreTrainedTokenizerFast):
            return t
        t = getattr(t, "_tokenizer", None)
        if t is None:
            break
    raise ValueError(
        f"structured output needs a Hugging Face fast tokenizer, not {type(tokenizer).__name__}"
    )


class _Vocabulary:
    """One tokenizer's llguidance tokenizer and its compiled grammars (LRU)."""

    def __init__(self, hf: Any) -> None:
        import llguidance.hf

        self.llg = llguidance.hf.from_tokenizer(hf)
        self.size = int(self.llg.vocab_size)
        self.eos = np.array(sorted(set(self.llg.eos_tokens)), dtype=np.int64)
        self.grammars: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self.lock = threading.Lock()


_VOCABS: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()
_BUILDING: dict[int, threading.Lock] = {}


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    hf = hf_tokenizer(tokenizer)
    with _VOCABS_LOCK:
        v = _VOCABS.get(hf)
        if v is not None:
            return v
        building = _BUILDING.setdefault(id(hf), threading.Lock())
    with building:  # one build per tokenizer; others wait for it
        with _VOCABS_LOCK:
            v = _VOCABS.get(hf)
        if v is None:
            try:
                v = _Vocabulary(hf)
                with _VOCABS_LOCK:
                    _VOCABS[hf] = v
            finally:
                with _VOCABS_LOCK:
                    _BUILDING.pop(id(hf), None)
    return v


def prepare(tokenizer: Any) -> None:
    """Build ``tokenizer``'s grammar vocabulary now (seconds for a large vocabulary,
    once per process) rather than on the first constrained request."""
    _vocabulary(tokenizer)


class CompiledGrammar:
    """A spec compiled for one tokenizer: the matcher every sequence copies."""

    def __init__(self, vocab: _Vocabulary, spec: GrammarSpec) -> None:
        import llguidance as llg

        self.spec, self.vocab = spec, vocab
        self._start = llg.LLMatcher(vocab.llg, _grammar(spec), log_level=0)
        if self._start.is_error():
            raise ValueError(f"invalid {spec.kind}: {self._start.get_error()}")

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


def compile_grammar(tokenizer: Any, spec: GrammarSpec) -> CompiledGrammar:
    """``spec`` compiled for ``tokenizer`` (an engine's), cached: the most recently
    used :data:`CACHE_SIZE` specs per tokenizer."""
    vocab = _vocabulary(tokenizer)
    with vocab.lock:
        hit = vocab.grammars.get(spec)
        if hit is not None:
            vocab.grammars.move_to_end(spec)
            return hit
    compiled = CompiledGrammar(vocab, spec)  # outside the lock: others keep decoding
    with vocab.lock:
        compiled = vocab.grammars.setdefault(spec, compiled)
        vocab.grammars.move_to_end(spec)
        while len(vocab.grammars) > CACHE_SIZE:
            vocab.grammars.popitem(last=False)
    return compiled


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._m = compiled._start.deep_copy()
        self._n = compiled.vocab.size
        self._bits = np.zeros((self._n + 31) // 32, dtype=np.int32)

    def allowed(self, width: int, eos: Iterable[int] = ()) -> np.ndarray:
        """A bool per logit (``width``: the model's logits, maybe wider than the
        tokenizer) saying which tokens may come next; ``eos`` (the engine's EOS
        ids) are allowed where the grammar could end here."""
        m = self._m
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise RuntimeError(f"constrained decoding failed: {m.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), count=self._n, bitorder="little")
        if width == self._n:
            mask = bits.view(bool)
        else:  # padding past the tokenizer is never allowed
            mask = np.zeros(width, dtype=bool)
            k = min(width, self._n)
            mask[:k] = bits[:k].view(bool)
        own = self.compiled.vocab.eos
        mask[own[own < width]] = False  # the grammar's end of text: the engine's EOS below
        if m.is_accepting():
            ids = np.fromiter((e for e in eos if 0 <= e < width), dtype=np.int64)
            mask[ids] = True
        return mask

    def advance(self, token: int) -> None:
        """Consume the sampled ``token`` (one :meth:`allowed` said could come)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can follow: the sequence ends."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What came so far is a whole match (it may still go on)."""
        return bool(self._m.is_accepting())


__all__ = [
    "CACHE_SIZE",
    "KINDS",
    "WHITESPACE",
    "CompiledGrammar",
    "GrammarMatcher",
    "GrammarSpec",
    "compile_grammar",
    "hf_tokenizer",
    "prepare",
]
