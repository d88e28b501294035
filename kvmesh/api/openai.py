"""OpenAI-compatible completions and chat completions, streaming and not.

Bad requests get a 4xx with an OpenAI-style error body; the head keeps serving.
Generations run on the scheduler (``scheduler.py``): a full queue is a 503, and a
client that disconnects cancels its request, queued or running, streaming or not.
``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens not recomputed.

Contracts:

- Sampling parameters are checked here, in OpenAI's ranges; a value outside is a
  400, never a 500: ``temperature`` finite in [0, 2], ``top_p`` in (0, 1],
  ``presence_penalty``/``frequency_penalty`` in [-2, 2], ``n`` in [1, 16] and at
  most ``--max-batch``, ``seed`` in [0, 2**63), ``logprobs``/``top_logprobs`` in
  [0, 20], ``max_tokens`` at least 1 with prompt + max_tokens within the context.
  ``null`` is the default, as in OpenAI's schema.
- Every accepted value is one the engine samples with, never NaN (vLLM's rule): a
  temperature below 1e-5 is greedy, one below 0.01 is raised to 0.01 (vLLM's rule,
  applied by the engines: :func:`kvmesh.engine.sampling.safe_temperature`).
- A request without ``max_tokens`` generates at most ``max_tokens_default``
  (``kvmesh head --default-max-tokens``), never past the context window.
- Parameters kvmesh does not implement (``NO_OP``) are accepted only with the value
  that changes nothing (what SDKs send by default); any other value is a 400.
  ``stream_options`` without ``stream: true`` is a 400, as OpenAI's.
- Responses, streamed or not, name the model by its canonical served name (the
  first ``--served-model-name``), whichever alias the request used, as vLLM does.
- A request the head could never run (``n`` beyond ``--max-batch``, a worst case
  beyond ``--kv-budget``) is a 400 before anything starts, streamed or not.
- A stream sends a chunk as soon as a token is decoded, its text empty while that
  text is held back (an unfinished UTF-8 character, a possible start of a stop
  string), as vLLM does: a client's first chunk marks the first token.
- A stream that fails after its headers are sent ends with an OpenAI-style
  ``data: {"error": {...}}`` event and then ``data: [DONE]``, never a cut stream.
- Logprobs are finite: one that is not (-inf) is reported as ``LOGPROB_FLOOR``.
- Tenants: a request uses the cache of the tenant the guard decided
  (:func:`~kvmesh.api.guard.identity_of`), and ``cache_salt`` (vLLM's field,
  both routes; ``null`` is none) separates further within it; a bad salt (not a
  string, empty, longer than ``MAX_CACHE_SALT_CHARS``) is a 400 naming it.
  ``cached_tokens`` and the ``kvmesh`` field describe only that cache, and across
  callers only whole blocks (see :mod:`kvmesh.runtime.head`); an anonymous
  caller is nobody's own, so it gets whole blocks only.
- Bounded work: token ids are JSON integers (not ``true``, not ``1.0``); at most
  ``MAX_STOPS`` stop strings of at most ``MAX_STOP_CHARS`` characters; bodies
  parse off the event loop (:class:`~kvmesh.api.guard.BodyOffLoop`).
- Tools (chat): ``tools`` are rendered by the model's own chat template; with
  ``tool_choice`` ``auto`` the answer's calls are parsed (:mod:`.tools`) into
  ``message.tool_calls`` and stream deltas, with ``finish_reason: "tool_calls"``
  (a template that does not mention tools, or a head with no tool-call parser for
  its model, is a 400 naming ``tools``); ``none`` renders them and parses nothing;
  ``required`` and a named function constrain the answer (as vLLM does) to an
  array of calls or to that function's arguments, valid against its
  ``parameters`` (``required`` finishes ``tool_calls``, a named function
  ``stop``, as OpenAI's). Assistant ``tool_calls`` and tool messages'
  ``tool_call_id`` reach the template.
- ``response_format`` ``json_object`` / ``json_schema`` and vLLM's
  ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and ``guided_json``/``_regex``/``_choice``/``_grammar`` extras
  (both routes) constrain the answer by constrained decoding
  (:mod:`kvmesh.engine.grammar`), compiled off the engine thread before the
  request starts: a bad one is a 400 naming it, as are two at once (a forced tool
  call is one).
- Several prompts (completions: a list of strings or of token lists) are one
  generation each, admitted together (one queue slot each; more prompts than
  ``--max-queue`` is a 400); choice ``i * n + j`` is prompt ``i``'s ``j``-th.
- ``echo`` (completions) puts each prompt before its answer, with the prompt
  tokens' logprobs when ``logprobs`` is set (the first token's is null, as
  OpenAI's and vLLM's), computed by one full forward of their own
  (:mod:`kvmesh.engine.scoring`: a cached prefix cannot give them); with echo,
  ``max_tokens: 0`` returns the prompt alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator
from starlette.concurrency import run_in_threadpool

from ..blocks import check_cache_salt, request_root
from ..engine import Decoded, Sampling
from ..engine.base import TokenLogprob
from ..engine.grammar import GrammarSpec, compile_grammar
from ..errors import NoChatTemplate
from ..runtime.batch import EngineFailed, OverBudget
from ..runtime.head import Generation, HeadRuntime, Scope
from .credentials import DEFAULT_TENANT, Tenants
from .guard import BodyOffLoop, identity_of
from .scheduler import Job, QueueFull, Scheduler, TokenStream
from .tools import (
    NamedParser,
    RequiredParser,
    ToolCall,
    ToolError,
    ToolParser,
    ToolStream,
    check_tool_choice,
    check_tools,
    detect_parser,
    make_parser,
    named_schema,
    required_schema,
    template_message,
)

log = logging.getLogger("kvmesh.api")

# Not implemented: accepted only with these values, which change nothing (SDKs send
# them by default); any other would change the answer, so it is refused, not ignored.
NO_OP: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "top_k": (-1, 0),  # vLLM's sampling extensions, off
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
}
UNSUPPORTED = tuple(NO_OP)
# what to send instead, said in the 400
INSTEAD = {
    "functions": "send 'tools' (OpenAI's replacement for the deprecated 'functions')",
    "function_call": "send 'tool_choice' (OpenAI's replacement for 'function_call')",
}
# OpenAI's schema makes these nullable: null means the default
NULLABLE = (
    "temperature",
    "top_p",
    "n",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "echo",
)
# vLLM's older top-level spellings of structured_outputs' fields
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM report for a token of probability ~0
MAX_N = 16  # sequences per request: each holds its own copy of the prompt's KV while decoding
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 4096  # a stop string is matched on every token: bound the work it asks
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    message = _printable(message)  # it may quote the client's own (broken) text
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(value: Any) -> None:
    """Lone surrogates (``"\\ud800"`` is valid JSON) are not text: refuse them at the
    door, or a tokenizer, a log line or a stored group name fails on them later.
    Iterative: a deeply nested body is not a stack overflow."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list) and not _only_numbers(v):
            todo.extend(v)


_NUMBERS = frozenset({int, float, bool, type(None)})


def _only_numbers(values: list[Any]) -> bool:
    """Whether ``values`` holds no text (a token id list): one pass in C, so a
    million ids do not hold the event loop for a walk in Python."""
    return set(map(type, values)) <= _NUMBERS


class Body(BaseModel):
    """A JSON request body: every string in it is valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        _check_text(data)
        return data


class _Common(Body):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)  # every engine's RNG takes it
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens whatever is sampled
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    cache_salt: Any = None  # checked in OpenAIService.scope: one 400 message for every bad value
    response_format: Any = None  # checked in OpenAIService._grammar: a 400 naming it

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULLABLE)}
        return data

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop sequences are supported", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise APIError(
                400, f"a stop sequence has at most {MAX_STOP_CHARS} characters", param="stop"
            )
        return tuple(s for s in stop if s)

    def want_logprobs(self) -> int | None:
        """How many alternatives to report per token; None = no logprobs."""
        return None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    def want_logprobs(self) -> int | None:
        return self.logprobs


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None  # checked in .tools: one 400 naming the exact field
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    def want_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(p["text"])
    return "".join(parts)


def _refuse_unsupported(req: _Common) -> None:
    """400 for what kvmesh does not implement (unless its value changes nothing) and
    for what OpenAI itself refuses."""
    extra = req.model_extra or {}
    for name, no_ops in NO_OP.items():
        value = extra.get(name)
        if value is not None and not _same_as_any(value, no_ops):
            allowed = " or ".join(json.dumps(v) for v in no_ops)
            instead = f"; {INSTEAD[name]}" if name in INSTEAD else ""
            raise APIError(
                400,
                f"'{name}' is not supported by kvmesh (only {allowed} is accepted){instead}",
                param=name,
                code="unsupported_parameter",
            )
    if extra.get("best_of") is not None and req.n > 1:  # best_of 1 < n: as OpenAI
        raise APIError(400, "best_of must be at least n", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )


def _same_as_any(value: Any, no_ops: tuple[Any, ...]) -> bool:
    """Equal in JSON terms: ``true`` is not ``1`` and ``1.0`` is ``1``."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_ops)


def _finite(logprob: float) -> float:
    # -inf (probability 0) is not JSON: report OpenAI's and vLLM's floor instead
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as served (:meth:`OpenAIService.tool_plan`)."""

    tools: list[dict[str, Any]] | None = None  # checked, as the template gets them
    choice: str = "none"
    parser: ToolParser | None = None  # None: the answer's text is its content
    schema: dict[str, Any] | None = None  # a forced call's output is constrained to it


@dataclass(eq=False)
class _Run:
    """One prompt's generation within a request (a request with several prompts has
    one each); ``stream`` is None when nothing is generated (echo, ``max_tokens: 0``)."""

    tokens: list[int]
    out: Generation
    stream: TokenStream | None = None
    echo: str | None = None  # the prompt's text, shown before the answer
    prompt_lp: list[TokenLogprob | None] | None = None  # echo with logprobs


class OpenAIService:
    """``model_name`` is the canonical name (``/v1/models``); ``aliases`` are also
    accepted in requests (vLLM: ``--served-model-name`` and the ``--model`` argument
    as given). ``max_tokens_default`` caps a request that sets no ``max_tokens``
    (None: the rest of the context window, as OpenAI and vLLM do).
    ``tool_parser``: ``kvmesh head --tool-call-parser`` (auto: from the chat
    template, see :func:`.tools.detect_parser`; none: tools are refused with auto)."""

    def __init__(
        self,
        runtime: HeadRuntime,
        scheduler: Scheduler,
        model_name: str,
        max_context: int,
        aliases: tuple[str, ...] = (),
        max_tokens_default: int | None = None,
        tenants: Tenants | None = None,
        tool_parser: str = "auto",
    ) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.model_name = model_name
        self.aliases = aliases
        self.tenants = tenants
        self.max_context = max_context
        self.max_tokens_default = max_tokens_default
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        if tool_parser == "auto":
            template = getattr(runtime.engine.tokenizer, "chat_template", None)
            self.tool_parser = detect_parser(template if isinstance(template, str) else None)
        else:
            self.tool_parser = None if tool_parser == "none" else tool_parser
        # prompt scoring (echo + logprobs): one at a time, off the event loop and off
        # the scheduler's threads; each holds the engine lock a chunk at a time
        self._scoring = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-score")

    def names(self) -> set[str]:
        return {self.model_name, *self.aliases, self.runtime.card.model_id}

    def scope(self, request: Request, req: _Common) -> Scope:
        """Whose cache ``req`` uses: its tenant (as the guard decided) and
        ``cache_salt``, and whose token-exact reuse. A 400 for a bad salt."""
        return self.scope_of(request, req.cache_salt)

    def scope_of(self, request: Request, value: object) -> Scope:
        """:meth:`scope` from the request and its ``cache_salt`` field's value."""
        try:
            salt = None if value is None else check_cache_salt(value)
        except ValueError as e:
            raise APIError(400, str(e), param="cache_salt", code="invalid_cache_salt") from None
        who = identity_of(request)
        if self.tenants is None:
            return Scope(request_root(self.runtime.card.namespace, None, salt), None, who.caller)
        tenant = who.tenant or DEFAULT_TENANT  # keyless requests count (and are capped) too
        return Scope(self.tenants.root(tenant, salt), tenant, who.caller)

    def _check(self, req: _Common, n_prompt: int) -> Sampling:
        if req.model not in self.names():
            raise APIError(
                404,
                f"The model '{req.model}' does not exist",
                param="model",
                code="model_not_found",
            )
        _refuse_unsupported(req)
        stops, logprobs = req.stops(), req.want_logprobs()
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if req.n > self.runtime.batch.max_batch:  # its n sequences decode in one batch
            raise APIError(
                400,
                f"n={req.n} exceeds this head's --max-batch {self.runtime.batch.max_batch}",
                param="n",
            )
        return Sampling(
            max_tokens=self._max_tokens(req, n_prompt),
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop_on_eos=not req.ignore_eos,
            stop=stops,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            n=req.n,
            grammar=self._grammar(req),
        )

    def _grammar(self, req: _Common) -> GrammarSpec | None:
        """The constraint of ``req``'s output (None: free text): ``response_format``
        ``json_object``/``json_schema``, vLLM's ``structured_outputs`` and
        ``guided_*`` extras, or a forced tool call's (:meth:`tool_plan`). A bad one,
        or two at once, is a 400 naming one of them."""
        forced = self.tool_plan(req).schema if isinstance(req, ChatRequest) else None
        specs: list[tuple[str, GrammarSpec]] = []
        rf = req.response_format
        try:
            if rf is not None and not isinstance(rf, dict):
                raise ValueError("response_format must be an object with a type")
            spec = GrammarSpec.from_response_format(rf)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None
        if spec is not None:
            specs.append(("response_format", spec))
        extra = req.model_extra or {}
        so = extra.get("structured_outputs")
        if so is not None and not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        params = dict(so or {})
        params.update({k: extra[k] for k in GUIDED if extra.get(k) is not None})
        name = next((k for k in GUIDED if k in params), "structured_outputs")
        try:
            spec = GrammarSpec.from_structured_outputs(params)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
        if spec is not None:
            specs.append((name, spec))
        if forced is not None:
            try:
                specs.append(("tool_choice", GrammarSpec.json_schema(forced, strict=False)))
            except ValueError as e:
                raise APIError(400, f"tools: {e}", param="tools") from None
        if len(specs) > 1:
            raise APIError(
                400,
                f"{specs[0][0]} and {specs[1][0]} both constrain the answer: give one",
                param=specs[0][0],
            )
        return specs[0][1] if specs else None

    def _max_tokens(self, req: _Common, n_prompt: int) -> int:
        """The request's own limit, else the operator's default cap, and never past
        the context window (a prompt that fills it is a 400). 0 only with echo."""
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, self.max_context - n_prompt)
            if self.max_tokens_default:
                max_tokens = min(max_tokens, self.max_tokens_default)
        echo = isinstance(req, CompletionRequest) and req.echo
        if max_tokens < (0 if echo else 1):
            raise APIError(
                400,
                "max_tokens must be at least 1 (0 only with echo)"
                if echo or max_tokens == 0
                else "max_tokens must be at least 1",
                param="max_tokens",
            )
        if n_prompt + max_tokens > self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{n_prompt} and max_tokens asks for {max_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
        return max_tokens

    # -- prompts ---------------------------------------------------------------------

    def prompt_count(self, req: _Common) -> int:
        """How many prompts ``req`` holds (no tokenizing): a 400 beyond --max-queue."""
        p = req.prompt if isinstance(req, CompletionRequest) else None
        if not isinstance(p, list) or not p or isinstance(p[0], int):
            return 1
        if len(p) > self.scheduler.max_queue:
            raise APIError(
                400,
                f"{len(p)} prompts in one request: at most this head's --max-queue "
                f"({self.scheduler.max_queue})",
                param="prompt",
            )
        return len(p)

    def tokens(self, req: _Common) -> list[int]:
        """The request's (one) prompt as token ids (CPU work: call off the event loop)."""
        if isinstance(req, ChatRequest):
            return self.chat_tokens(req)
        assert isinstance(req, CompletionRequest)
        return self.completion_tokens(req)

    def prompts(self, req: _Common) -> list[list[int]]:
        """Every prompt of the request as token ids (CPU work: call off the event loop)."""
        if isinstance(req, ChatRequest):
            return [self.chat_tokens(req)]
        assert isinstance(req, CompletionRequest)
        return self.completion_prompts(req)

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        """A completion's one prompt (several are a 400)."""
        if self.prompt_count(req) != 1:
            raise APIError(400, "only one prompt per request is supported here", param="prompt")
        return self.completion_prompts(req)[0]

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self.runtime.engine.encode(p)]
        if p and all(isinstance(x, str) for x in p):
            return [self.runtime.engine.encode(str(x)) for x in p]
        if p and all(isinstance(x, list) for x in p):
            return [self._token_ids(x) for x in p]  # type: ignore[arg-type]
        return [self._token_ids(p)]

    def _token_ids(self, p: list[Any]) -> list[int]:
        vocab = self.runtime.card.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in p):
            raise APIError(400, f"token ids must be integers in [0, {vocab})", param="prompt")
        return [int(t) for t in p]

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as echoed: a string prompt as given, token ids decoded
        with their special tokens."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, str) for x in p):
            return [str(x) for x in p]
        tok = self.runtime.engine.tokenizer
        return [str(tok.decode(t, skip_special_tokens=False)) for t in prompts]

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        tools = self.tool_plan(req).tools
        try:
            msgs = [
                template_message(m.role, _text(m.content), m.model_extra or {})
                for m in req.messages
            ]
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        engine = self.runtime.engine
        try:
            if tools is None:
                return engine.encode_chat(msgs)
            if not getattr(engine.tokenizer, "chat_template", None):
                raise NoChatTemplate("this model has no chat template: it cannot be given tools")
            text = engine.tokenizer.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=True
            )
            return list(engine.tokenizer.encode(text, add_special_tokens=False))
        except NoChatTemplate as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template") from None
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a bad field
            raise APIError(
                400,
                f"the model's chat template refused these messages: {e}",
                param="messages",
                code="chat_template_error",
            ) from None

    def tool_plan(self, req: ChatRequest) -> ToolPlan:
        """The request's checked tools (None: none), its tool choice, the parser of its
        answer (None: its text is the content) and the schema a forced call is
        constrained to: 400s for what cannot be served."""
        try:
            tools = check_tools(req.tools) if req.tools is not None else []
            choice = check_tool_choice(req.tool_choice, tools)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if not tools:
            return ToolPlan()
        if choice == "required":
            parallel = req.parallel_tool_calls is not False
            return ToolPlan(tools, choice, RequiredParser(), required_schema(tools, parallel))
        if choice.startswith("function:"):
            name = choice.removeprefix("function:")
            return ToolPlan(tools, choice, NamedParser(name), named_schema(tools, name))
        if choice == "none":
            return ToolPlan(tools, choice)
        template = getattr(self.runtime.engine.tokenizer, "chat_template", None)
        if not isinstance(template, str) or "tools" not in template:
            raise APIError(
                400,
                "this model's chat template does not render tools, so it cannot choose "
                "to call them (tool_choice 'required' or a named function still can)",
                param="tools",
                code="unsupported_parameter",
            )
        parser = make_parser(self.tool_parser)
        if parser is None:
            raise APIError(
                400,
                "this head has no tool-call parser for its model (start it with "
                "--tool-call-parser NAME), so it cannot return the calls the model chooses; "
                "tool_choice 'required' or a named function still can",
                param="tools",
                code="no_tool_parser",
            )
        return ToolPlan(tools, choice, parser)

    # -- running -----------------------------------------------------------------------

    def admit(self, count: int) -> list[Job]:
        """A queue slot per prompt, all or none (QueueFull: a 503)."""
        jobs: list[Job] = []
        try:
            for _ in range(count):
                jobs.append(self.scheduler.admit())
        except QueueFull:
            for job in jobs:
                self.scheduler.release(job)
            raise
        return jobs

    def start(
        self,
        req: _Common,
        tokens: list[int],
        job: Job,
        client: str = "",
        scope: Scope | None = None,
    ) -> tuple[Generation, TokenStream]:
        """Check ``req`` (4xx before anything runs) and start its generation as
        ``client``'s (its fair share, see :class:`~.credentials.Identity`) in ``scope``'s cache."""
        sampling = self._checked(req, tokens)
        out = Generation(choices=[Decoded() for _ in range(sampling.n)])  # read while it runs
        return out, self.scheduler.start(job, tokens, sampling, out, client, scope)

    def _checked(self, req: _Common, tokens: list[int]) -> Sampling:
        sampling = self._check(req, len(tokens))
        if sampling.max_tokens == 0:  # echo alone: nothing decodes
            return sampling
        try:  # before a stream's 200: a request this head could never run is the client's 400
            self.runtime.check_request(len(tokens), sampling)
        except OverBudget as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return sampling

    async def launch(
        self,
        req: _Common,
        prompts: list[list[int]],
        jobs: list[Job],
        client: str = "",
        scope: Scope | None = None,
    ) -> list[_Run]:
        """Check every prompt (4xx before anything runs), score echoed prompts, then
        start each prompt's generation on its job (a job with nothing to generate is
        released)."""
        samplings = [self._checked(req, tokens) for tokens in prompts]
        spec = samplings[0].grammar
        if spec is not None:  # compiled here (cached), never on the engine thread: a 400 if bad
            try:
                await run_in_threadpool(compile_grammar, self.runtime.engine.tokenizer, spec)
            except ValueError as e:
                extra = req.model_extra or {}
                given = [k for k in ("structured_outputs", *GUIDED) if extra.get(k) is not None]
                param = (
                    "response_format" if req.response_format is not None else [*given, "tools"][0]
                )
                raise APIError(400, str(e), param=param) from None
        runs = [
            _Run(tokens, Generation(choices=[Decoded() for _ in range(s.n)]))
            for tokens, s in zip(prompts, samplings, strict=True)
        ]
        if isinstance(req, CompletionRequest) and req.echo:
            texts = await run_in_threadpool(self.echo_texts, req, prompts)
            top = req.want_logprobs()
            loop = asyncio.get_running_loop()
            for run, text, job in zip(runs, texts, jobs, strict=True):
                run.echo = text
                if top is not None:
                    score = functools.partial(
                        self.runtime.prompt_logprobs, run.tokens, top, job.cancel
                    )
                    run.prompt_lp = await loop.run_in_executor(self._scoring, score)
        for run, sampling, job in zip(runs, samplings, jobs, strict=True):
            if sampling.max_tokens == 0:
                for c in run.out.choices:
                    c.done = True  # finish_reason "length": the limit was 0 tokens
                self.scheduler.release(job)
            else:
                run.stream = self.scheduler.start(job, run.tokens, sampling, run.out, client, scope)
        return runs

    def close(self) -> None:
        self._scoring.shutdown(wait=False, cancel_futures=True)

    # -- answers -----------------------------------------------------------------------

    def _raw_text(self, c: Decoded, stops: tuple[str, ...], final: bool) -> tuple[str, int]:
        """The text of ``c``'s tokens with special tokens kept (tool-call markers
        are special tokens in several families), its ending EOS left out, cut at the
        first stop string; while it is not ``final`` an unfinished character is left
        out. And how many tokens that was."""
        tokens = list(c.tokens)
        n = len(tokens)
        eos = self.runtime.engine.eos_ids
        while tokens and tokens[-1] in eos:
            tokens.pop()
        text = str(self.runtime.engine.tokenizer.decode(tokens, skip_special_tokens=False))
        if not final:
            text = text.rstrip("\ufffd")
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        return (text[: min(cuts)] if cuts else text), n

    @staticmethod
    def _finish(c: Decoded, called: bool, parser: ToolParser) -> str:
        """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling
        (not for a named function: ``stop``, as OpenAI's and vLLM's)."""
        if called and parser.finish_as_call and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    def body(
        self,
        req: _Common,
        rid: str,
        chat: bool,
        runs: list[_Run],
        parser: ToolParser | None = None,
    ) -> dict[str, Any]:
        choices = []
        top = req.want_logprobs()
        for i, (run, c) in enumerate((r, c) for r in runs for c in r.out.choices):
            # no stop string: the whole answer decoded at once, as before stop strings existed
            text = c.text if c.stopped else self.runtime.engine.decode_text(c.tokens)
            choice: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason}
            if chat:
                choice["logprobs"] = self._logprobs(c, 0, c.shown, chat, top)
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if parser is not None:
                    raw, _ = self._raw_text(c, req.stops(), final=True)
                    content, calls = parser.parse(raw)
                    calls = self._allowed(req, calls)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.as_dict() for call in calls]
                    choice["finish_reason"] = self._finish(c, bool(calls), parser)
                    choice["logprobs"] = self._logprobs(c, 0, len(c.tokens), chat, top)
                choice["message"] = message
            else:
                choice["text"] = (run.echo or "") + text
                choice["logprobs"] = self._echoed(run, top)
                more = self._logprobs(c, 0, c.shown, chat, top, len(run.echo or ""))
                choice["logprobs"] = _joined(choice["logprobs"], more)
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,  # canonical, as the stream's chunks (and vLLM)
            "choices": choices,
            "usage": self._usage(runs),
            "kvmesh": self._report(runs),
        }

    @staticmethod
    def _allowed(req: _Common, calls: list[ToolCall]) -> list[ToolCall]:
        no_parallel = isinstance(req, ChatRequest) and req.parallel_tool_calls is False
        return calls[:1] if no_parallel else calls

    @staticmethod
    def _report(runs: list[_Run]) -> Any:
        reports = [
            {**r.out.report.as_dict(), "ttft_s": r.out.ttft_s} if r.out.report else None
            for r in runs
        ]
        return reports[0] if len(reports) == 1 else {"prompts": reports}

    @staticmethod
    def _usage(runs: list[_Run]) -> dict[str, Any]:
        n_prompt = sum(len(r.tokens) for r in runs)
        cached = sum(r.out.report.reused_tokens for r in runs if r.out.report)
        # each prompt counts once, however many choices decode from it
        generated = sum(len(c.tokens) for r in runs for c in r.out.choices)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": generated,
            "total_tokens": n_prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _token_text(self, token: int) -> str:
        """A token's own text, special tokens included (as vLLM reports them)."""
        text = self._token_texts.get(token)
        if text is None:
            text = str(self.runtime.engine.tokenizer.decode([token], skip_special_tokens=False))
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token] = text
        return text

    def _echoed(self, run: _Run, top: int | None) -> dict[str, Any] | None:
        """The legacy logprobs lists of an echoed prompt (its first token's null, as
        OpenAI's), offsets counted in the tokens' texts; None when not asked."""
        if top is None or run.prompt_lp is None:
            return None
        name = self._token_text
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        at = 0
        for t, e in zip(run.tokens, run.prompt_lp, strict=True):
            text = name(t)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(e.logprob))
            alts = {name(j): _finite(lp) for j, lp in e.top}
            alts.setdefault(text, _finite(e.logprob))
            tops.append(alts)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _logprobs(
        self,
        c: Decoded,
        start: int,
        stop: int,
        chat: bool,
        top: int | None,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        """Logprobs of tokens [start, stop) of ``c`` in the route's shape: chat's
        ``content`` list, or the legacy completions lists (``top_logprobs`` holds
        the sampled token too, so up to ``logprobs + 1`` entries, as OpenAI's;
        ``text_offset`` moved on by ``offset``, an echoed prompt's length)."""
        if top is None:
            return None
        entries = c.logprobs[start:stop]
        name = self._token_text
        if chat:
            return {
                "content": [
                    {
                        "token": name(e.token),
                        "logprob": _finite(e.logprob),
                        "bytes": list(name(e.token).encode()),
                        "top_logprobs": [
                            {
                                "token": name(t),
                                "logprob": _finite(lp),
                                "bytes": list(name(t).encode()),
                            }
                            for t, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        tops = []
        for e in entries:
            alts = {name(t): _finite(lp) for t, lp in e.top}
            alts.setdefault(name(e.token), _finite(e.logprob))
            tops.append(alts)
        return {
            "tokens": [name(e.token) for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": [o + offset for o in c.offsets[start:stop]],
        }

    async def sse(
        self,
        req: _Common,
        rid: str,
        chat: bool,
        runs: list[_Run],
        parser: ToolParser | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events of a started generation, always ending with ``[DONE]``:
        a failure after the headers are sent (they carried 200) becomes an error
        event first. Starlette stops iterating when the client leaves, which
        cancels the streams (a BaseException: nothing more is sent then)."""
        try:
            async for event in self._events(req, rid, chat, runs, parser):
                yield event
        except Exception as e:
            yield _sse(_stream_error(rid, e))
        yield "data: [DONE]\n\n"

    async def _events(
        self,
        req: _Common,
        rid: str,
        chat: bool,
        runs: list[_Run],
        parser: ToolParser | None,
    ) -> AsyncIterator[str]:
        """Each choice's text as the engine detokenizes it (text that could start a
        stop string is held back until it cannot) with the logprobs of the tokens
        that text accounts for, a chunk whenever a token was decoded (its text
        possibly empty); then the finish reasons, and usage if asked. With a tool
        parser, content and ``tool_calls`` deltas as :class:`.tools.ToolStream`
        finds them. An echoed prompt is each choice's first chunk."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        top = req.want_logprobs()
        stops = req.stops()
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        no_parallel = isinstance(req, ChatRequest) and req.parallel_tool_calls is False

        def chunk(
            i: int,
            text: str,
            logprobs: Any,
            finish: str | None,
            first: bool = False,
            calls: list[dict[str, Any]] | None = None,
        ) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish}
                if logprobs is not None:
                    choice["logprobs"] = logprobs
            else:
                choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
            return _sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                }
            )

        pairs = [(r, c) for r in runs for c in r.out.choices]
        views = [ToolStream(parser) if parser is not None else None for _ in pairs]
        sent_text = [0] * len(pairs)
        sent_tokens = [0] * len(pairs)
        decoded = [0] * len(pairs)  # tokens a chunk has been sent for, text or not

        def tool_news(i: int, c: Decoded, view: ToolStream, final: bool) -> Iterator[str]:
            raw, n = self._raw_text(c, stops, final)
            content, calls = view.update(raw, final)
            if no_parallel:
                calls = [d for d in calls if d["index"] == 0]
            lp = self._logprobs(c, sent_tokens[i], n, chat, top)
            if content or calls or n > decoded[i] or final:
                finish = self._finish(c, view.called, view.parser) if final else None
                yield chunk(i, content, lp, finish, calls=calls)
            sent_tokens[i] = decoded[i] = n

        def news(final: bool) -> Iterator[str]:
            for i, (run, c) in enumerate(pairs):
                view = views[i]
                if view is not None:
                    yield from tool_news(i, c, view, final)
                    continue
                n = len(c.tokens)  # before the text: a token counted here has been sampled
                shown, text = c.shown, c.text  # shown first: text only grows after it
                lp = self._logprobs(c, sent_tokens[i], shown, chat, top, len(run.echo or ""))
                new = text[sent_text[i] :]
                # a new token is a chunk even when its text is held back (an unfinished
                # character, a possible stop string), as vLLM sends it: the client's
                # first chunk is the first token, not the first printable text
                if new or (lp and shown > sent_tokens[i]) or n > decoded[i] or final:
                    yield chunk(i, new, lp, c.finish_reason if final else None)
                sent_text[i], sent_tokens[i], decoded[i] = len(text), shown, n

        for i, (run, _) in enumerate(pairs):
            if chat:
                yield chunk(i, "", None, None, first=True)
            elif run.echo is not None:
                yield chunk(i, run.echo, self._echoed(run, top), None)
        async for _ in _merged([r.stream for r in runs if r.stream is not None]):
            for event in news(final=False):
                yield event
        for event in news(final=True):
            yield event
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(runs),
                }
            )


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects one after the other (an echoed prompt's, the answer's)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


_END = object()


async def _merged(streams: list[TokenStream]) -> AsyncIterator[None]:
    """One step per token of any of ``streams``, until all have ended; an error in
    one is raised here, and leaving early cancels them all."""
    if len(streams) == 1:
        async for _ in streams[0]:
            yield None
        return
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: TokenStream) -> None:
        try:
            async for _ in stream:
                queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)
        queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield None
    finally:
        for t in tasks:
            t.cancel()


def _sse(body: dict[str, Any]) -> str:
    # allow_nan=False: NaN is not JSON; a value that slipped through fails here, loudly
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def _stream_error(rid: str, e: Exception) -> dict[str, Any]:
    """The error event of a stream that failed after it began (OpenAI's shape, as
    vLLM sends it). An APIError says what it is; anything else is the engine's
    failure, logged here and named only generically to the client."""
    if isinstance(e, APIError):
        err = {"message": _printable(e.message), "type": e.type, "param": e.param, "code": e.code}
    else:
        log.error("stream %s failed after it began: %s: %s", rid, type(e).__name__, e)
        code = "engine_failed" if isinstance(e, EngineFailed) else "generation_failed"
        err = {
            "message": "the generation failed on the server; the output is incomplete",
            "type": "server_error",
            "param": None,
            "code": code,
        }
    return {"error": err}


def router(service: OpenAIService) -> APIRouter:
    r = APIRouter(route_class=BodyOffLoop)

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": service.created,
                    "owned_by": "kvmesh",
                }
            ],
        }

    async def respond(request: Request, req: _Common, chat: bool) -> Any:
        scope = service.scope(request, req)  # a bad salt or tenant: 400 before any work
        parser = service.tool_plan(req).parser if isinstance(req, ChatRequest) else None
        jobs = service.admit(service.prompt_count(req))  # QueueFull: 503 before any work
        try:
            prompts = await run_in_threadpool(service.prompts, req)  # templating is CPU work
            client = identity_of(request).share
            runs = await service.launch(req, prompts, jobs, client, scope)
        except BaseException:
            for job in jobs:  # none started (launch starts them last, all at once)
                service.scheduler.release(job)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return StreamingResponse(
                service.sse(req, rid, chat, runs, parser),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        streams = [r.stream for r in runs if r.stream is not None]
        if not await _finish_unless_gone(request, streams):
            return error_response(499, "the client closed the request", code="client_closed")
        return service.body(req, rid, chat, runs, parser)

    @r.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Any:
        return await respond(request, req, chat=False)

    @r.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest) -> Any:
        return await respond(request, req, chat=True)

    return r


async def _finish_unless_gone(request: Request, streams: list[TokenStream]) -> bool:
    """Read ``streams`` to their end; False, with the jobs cancelled, when the client
    disconnects first (a queued request then never runs)."""

    async def drain() -> None:
        async for _ in _merged(streams):
            pass

    async def gone() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    if not streams:
        return True
    tasks = [asyncio.ensure_future(drain()), asyncio.ensure_future(gone())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks[0].done():
            tasks[0].result()  # a generation error is raised here
            return True
        return False
    finally:
        for t in tasks:
            t.cancel()  # leaving the streams early cancels the jobs
