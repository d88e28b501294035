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
enforces the bound). A ``compact`` spec (vLLM's ``disable_any_whitespace``; a
forced tool call's arguments) admits none: a small model cannot spend its tokens on
whitespace. A schema's ``x-guidance`` options override this. ``strict``
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
WHITESPACE = r"[\x20\x09]{0,4}(?:\r?\n[\x20\x09]{0,32})?"  # between JSON tokens
CACHE_SIZE = 128  # compiled grammars kept per tokenizer (least recently used dropped)
# what a client may ask compiled: checked before llguidance sees it
MAX_SOURCE_CHARS = 1 << 20  # a schema (compact JSON), regex, grammar or choices together
MAX_DEPTH = 64  # nesting of a schema's JSON (and of a tool's parameters, by the API)
MAX_INT = 2**63 - 1  # llguidance's integers are 64-bit: a bound beyond is not what it checks
# compiled grammars hold ~100 bytes per source character: the caches are bounded by
# the source characters they hold, and report them (cache_stats)
CACHE_CHARS = 2 << 20  # per tokenizer
VALID_CHARS = 4 << 20  # checked specs' llguidance grammars, all tokenizers


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
    compact: bool = False  # JSON without whitespace between tokens (vLLM's disable_any_whitespace)

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
        if self.size > MAX_SOURCE_CHARS:
            raise ValueError(
                f"a {self.kind} of {self.size} characters is over the {MAX_SOURCE_CHARS} allowed"
            )
        _grammar(self)  # every spec that exists is valid (cached: built once)

    @property
    def size(self) -> int:
        """Its source's characters (what the caches count)."""
        src = self.source
        return len(src) if isinstance(src, str) else sum(map(len, src))

    # -- builders ---------------------------------------------------------------

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str | bool, strict: bool = True
    ) -> GrammarSpec:
        """A JSON schema (a mapping, or its JSON text). An object's properties come
        in the order the schema lists them (llguidance's rule), so the order of its
        keys matters and two specs of the same schema in another order differ."""
        if isinstance(schema, str):
            if len(schema) > 4 * MAX_SOURCE_CHARS:  # spaced JSON compacts; this never will
                raise ValueError(f"a JSON schema is at most {MAX_SOURCE_CHARS} characters")
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"the JSON schema is not JSON: {first_line(e)}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, Mapping):
            raise ValueError("a JSON schema is an object")
        check_schema(schema)
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
        spec = cls._from_vllm(kind, value)
        return replace(spec, compact=True) if params.get("disable_any_whitespace") else spec

    @classmethod
    def _from_vllm(cls, kind: str, value: Any) -> GrammarSpec:
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
        return f"GrammarSpec({self.kind!r}, {src!r}, strict={self.strict}, compact={self.compact})"


class ConstraintFailed(ValueError):
    """A grammar that compiled failed while decoding (a resource limit met on a
    later step, a state with no token allowed): the request's fault, its job alone
    ends (the API's 400, or a stream's error event)."""


def first_line(e: object) -> str:
    """An error's first line: llguidance appends its parser state (and a Rust panic
    its backtrace), which is not the client's business."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:500]


def json_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, Mapping):
            children: Iterable[Any] = v.values()
        elif isinstance(v, list | tuple):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


def _bounds(schema: Mapping[str, Any]) -> Iterable[Any]:
    """The numeric bounds an integer schema object states."""
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if k in schema:
                yield schema[k]


def check_schema(schema: Mapping[str, Any]) -> None:
    """What llguidance would not check as asked: nesting past :data:`MAX_DEPTH`
    (each level is work and stack), and integer bounds beyond 64 bits (it would
    clamp them and answer values outside the schema)."""
    if json_depth(schema) > MAX_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_DEPTH} levels")
    stack: list[Any] = [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            for b in _bounds(v):
                if isinstance(b, int | float) and not isinstance(b, bool) and abs(b) > MAX_INT:
                    raise ValueError(f"integer bound {b} is beyond 64 bits (±{MAX_INT})")
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _limits() -> Any:
    """llguidance's resource limits: its defaults, without its debug dump in errors."""
    import llguidance as llg

    return llg.LLParserLimits(verbose_errors=False)


_VALID: OrderedDict[GrammarSpec, str] = OrderedDict()  # spec -> llguidance grammar (LRU)
_VALID_LOCK = threading.Lock()
_VALID_HELD = [0]  # characters of the grammars in _VALID


def _grammar(spec: GrammarSpec) -> str:
    """``spec`` as an llguidance grammar, checked (no tokenizer needed): ValueError
    with llguidance's message when it is not valid."""
    with _VALID_LOCK:
        hit = _VALID.get(spec)
        if hit is not None:
            _VALID.move_to_end(spec)
    if hit is not None:
        return hit
    import llguidance as llg

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = str(spec.source) if spec.kind == "json_schema" else '{"type":"object"}'
            options: JsonCompileOptions = (
                {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
                if spec.compact
                else {"whitespace_pattern": WHITESPACE}
            )
            options["lenient"] = not spec.strict
            g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif spec.kind == "regex":
            g = llg.LLMatcher.grammar_from_regex(str(spec.source))
        elif spec.kind == "choice":
            g = llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(s) for s in spec.source)
            )
        else:
            g = llg.grammar_from("grammar", str(spec.source))
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"invalid {spec.kind}: {first_line(e)}") from None
    except BaseException as e:  # a Rust panic (pyo3's PanicException is a BaseException)
        if not _is_panic(e):
            raise
        raise ValueError(f"invalid {spec.kind}: {first_line(e)}") from None
    err = llg.LLMatcher.validate_grammar(g, limits=_limits())
    if err:
        raise ValueError(f"invalid {spec.kind}: {first_line(err)}")
    with _VALID_LOCK:
        if spec not in _VALID:
            _VALID[spec] = g
            _VALID_HELD[0] += len(g)
        while _VALID and (_VALID_HELD[0] > VALID_CHARS or len(_VALID) > 4 * CACHE_SIZE):
            _VALID_HELD[0] -= len(_VALID.popitem(last=False)[1])
    return g


def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException"


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
        self.chars = 0  # source characters of ``grammars``
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
        self._start = llg.LLMatcher(vocab.llg, _grammar(spec), log_level=0, limits=_limits())
        if not self._start.is_error():
            # the first mask now, in the compiling thread: it builds the lexer (seconds
            # for some patterns, never on the engine's step) and shows errors a grammar
            # meets only there (an unresolvable $ref): the client's 400, not a failure
            bits = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
            self._start.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self._start.is_error():
            raise ValueError(f"invalid {spec.kind}: {first_line(self._start.get_error())}")

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
        if spec not in vocab.grammars:
            vocab.grammars[spec] = compiled
            vocab.chars += spec.size
        compiled = vocab.grammars[spec]
        vocab.grammars.move_to_end(spec)
        while len(vocab.grammars) > 1 and (
            len(vocab.grammars) > CACHE_SIZE or vocab.chars > CACHE_CHARS
        ):
            vocab.chars -= vocab.grammars.popitem(last=False)[0].size
    return compiled


def cache_stats() -> dict[str, int]:
    """What the grammar caches hold (for the memory report): compiled grammars and
    their source characters, over every tokenizer, and the checked specs'."""
    with _VOCABS_LOCK:
        vocabs = list(_VOCABS.values())
    compiled = chars = 0
    for v in vocabs:
        with v.lock:
            compiled += len(v.grammars)
            chars += v.chars
    with _VALID_LOCK:
        checked, held = len(_VALID), _VALID_HELD[0]
    return {
        "compiled": compiled,
        "compiled_source_chars": chars,
        "checked": checked,
        "checked_chars": held,
    }


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
            raise ConstraintFailed(
                f"the output constraint failed while decoding: {first_line(m.get_error())}"
            )
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
            raise ConstraintFailed(
                f"the grammar refused token {token}: {first_line(self._m.get_error())}"
            )

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can follow: the sequence ends."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What came so far is a whole match (it may still go on)."""
        return bool(self._m.is_accepting())


__all__ = [
    "CACHE_CHARS",
    "CACHE_SIZE",
    "KINDS",
    "MAX_DEPTH",
    "MAX_SOURCE_CHARS",
    "WHITESPACE",
    "CompiledGrammar",
    "ConstraintFailed",
    "GrammarMatcher",
    "GrammarSpec",
    "cache_stats",
    "check_schema",
    "compile_grammar",
    "first_line",
    "hf_tokenizer",
    "json_depth",
    "prepare",
]
