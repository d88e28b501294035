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
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.concurrency import run_in_threadpool

from ..blocks import chain_root, check_cache_salt
from ..engine import Decoded, Sampling
from ..errors import NoChatTemplate
from ..runtime.batch import EngineFailed, OverBudget
from ..runtime.head import Generation, HeadRuntime, Scope
from .credentials import DEFAULT_TENANT, Tenants
from .guard import BodyOffLoop, identity_of
from .scheduler import Job, Scheduler, TokenStream

log = logging.getLogger("kvmesh.api")

# Not implemented: accepted only with these values, which change nothing (SDKs send
# them by default); any other would change the answer, so it is refused, not ignored.
NO_OP: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "top_k": (-1, 0),  # vLLM's sampling extensions, off
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
}
UNSUPPORTED = tuple(NO_OP)
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
)
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
    prompt: str | list[StrictInt] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

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
            raise APIError(
                400,
                f"'{name}' is not supported by kvmesh (only {allowed} is accepted)",
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


class OpenAIService:
    """``model_name`` is the canonical name (``/v1/models``); ``aliases`` are also
    accepted in requests (vLLM: ``--served-model-name`` and the ``--model`` argument
    as given). ``max_tokens_default`` caps a request that sets no ``max_tokens``
    (None: the rest of the context window, as OpenAI and vLLM do)."""

    def __init__(
        self,
        runtime: HeadRuntime,
        scheduler: Scheduler,
        model_name: str,
        max_context: int,
        aliases: tuple[str, ...] = (),
        max_tokens_default: int | None = None,
        tenants: Tenants | None = None,
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
            root = None if salt is None else chain_root(self.runtime.card.namespace, None, salt)
            return Scope(root, None, who.caller)
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
        )

    def _max_tokens(self, req: _Common, n_prompt: int) -> int:
        """The request's own limit, else the operator's default cap, and never past
        the context window (a prompt that fills it is a 400)."""
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, self.max_context - n_prompt)
            if self.max_tokens_default:
                max_tokens = min(max_tokens, self.max_tokens_default)
        if max_tokens < 1:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        if n_prompt + max_tokens > self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{n_prompt} and max_tokens asks for {max_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
        return max_tokens

    def tokens(self, req: _Common) -> list[int]:
        """The request's prompt as token ids (CPU work: call off the event loop)."""
        if isinstance(req, ChatRequest):
            return self.chat_tokens(req)
        assert isinstance(req, CompletionRequest)
        return self.completion_tokens(req)

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, str):
            return self.runtime.engine.encode(p)
        if p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            return self.runtime.engine.encode(str(p[0]))
        vocab = self.runtime.card.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in p):
            raise APIError(400, f"token ids must be integers in [0, {vocab})", param="prompt")
        return [int(t) for t in p]

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        msgs = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        try:
            return self.runtime.engine.encode_chat(msgs)
        except NoChatTemplate as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template") from None

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
        sampling = self._check(req, len(tokens))
        try:  # before a stream's 200: a request this head could never run is the client's 400
            self.runtime.check_request(len(tokens), sampling)
        except OverBudget as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        out = Generation(choices=[Decoded() for _ in range(sampling.n)])  # read while it runs
        return out, self.scheduler.start(job, tokens, sampling, out, client, scope)

    def body(
        self, req: _Common, rid: str, chat: bool, n_prompt: int, out: Generation
    ) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(out.choices):
            # no stop string: the whole answer decoded at once, as before stop strings existed
            text = c.text if c.stopped else self.runtime.engine.decode_text(c.tokens)
            choice: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason}
            choice["logprobs"] = self._logprobs(c, 0, c.shown, chat, req.want_logprobs())
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,  # canonical, as the stream's chunks (and vLLM)
            "choices": choices,
            "usage": self._usage(out, n_prompt),
            "kvmesh": {**out.report.as_dict(), "ttft_s": out.ttft_s} if out.report else None,
        }

    @staticmethod
    def _usage(out: Generation, n_prompt: int) -> dict[str, Any]:
        cached = out.report.reused_tokens if out.report else 0
        generated = sum(len(c.tokens) for c in out.choices)  # the prompt counts once
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

    def _logprobs(
        self, c: Decoded, start: int, stop: int, chat: bool, top: int | None
    ) -> dict[str, Any] | None:
        """Logprobs of tokens [start, stop) of ``c`` in the route's shape: chat's
        ``content`` list, or the legacy completions lists (``top_logprobs`` holds
        the sampled token too, so up to ``logprobs + 1`` entries, as OpenAI's)."""
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
            "text_offset": c.offsets[start:stop],
        }

    async def sse(
        self,
        req: _Common,
        rid: str,
        n_prompt: int,
        chat: bool,
        out: Generation,
        stream: TokenStream,
    ) -> AsyncIterator[str]:
        """Server-sent events of a started generation, always ending with ``[DONE]``:
        a failure after the headers are sent (they carried 200) becomes an error
        event first. Starlette stops iterating when the client leaves, which
        cancels ``stream`` (a BaseException: nothing more is sent then)."""
        try:
            async for event in self._events(req, rid, n_prompt, chat, out, stream):
                yield event
        except Exception as e:
            yield _sse(_stream_error(rid, e))
        yield "data: [DONE]\n\n"

    async def _events(
        self,
        req: _Common,
        rid: str,
        n_prompt: int,
        chat: bool,
        out: Generation,
        stream: TokenStream,
    ) -> AsyncIterator[str]:
        """Each choice's text as the engine detokenizes it (text that could start a
        stop string is held back until it cannot) with the logprobs of the tokens
        that text accounts for, a chunk whenever a token was decoded (its text
        possibly empty); then the finish reasons, and usage if asked."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        top = req.want_logprobs()
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def chunk(i: int, text: str, logprobs: Any, finish: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text:
                    delta["content"] = text
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

        sent_text = [0] * len(out.choices)
        sent_tokens = [0] * len(out.choices)
        decoded = [0] * len(out.choices)  # tokens a chunk has been sent for, text or not

        def news(final: bool) -> Iterator[str]:
            for i, c in enumerate(out.choices):
                n = len(c.tokens)  # before the text: a token counted here has been sampled
                shown, text = c.shown, c.text  # shown first: text only grows after it
                lp = self._logprobs(c, sent_tokens[i], shown, chat, top)
                new = text[sent_text[i] :]
                # a new token is a chunk even when its text is held back (an unfinished
                # character, a possible stop string), as vLLM sends it: the client's
                # first chunk is the first token, not the first printable text
                if new or (lp and shown > sent_tokens[i]) or n > decoded[i] or final:
                    yield chunk(i, new, lp, c.finish_reason if final else None)
                sent_text[i], sent_tokens[i], decoded[i] = len(text), shown, n

        if chat:
            for i in range(len(out.choices)):
                yield chunk(i, "", None, None, first=True)
        async for _ in stream:
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
                    "usage": self._usage(out, n_prompt),
                }
            )


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
        job = service.scheduler.admit()  # QueueFull: 503 before any work
        try:
            tokens = await run_in_threadpool(service.tokens, req)  # templating is CPU work
            client = identity_of(request).share
            out, stream = service.start(req, tokens, job, client, scope)
        except BaseException:
            service.scheduler.release(job)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return StreamingResponse(
                service.sse(req, rid, len(tokens), chat, out, stream),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        if not await _finish_unless_gone(request, stream):
            return error_response(499, "the client closed the request", code="client_closed")
        return service.body(req, rid, chat, len(tokens), out)

    @r.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Any:
        return await respond(request, req, chat=False)

    @r.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest) -> Any:
        return await respond(request, req, chat=True)

    return r


async def _finish_unless_gone(request: Request, stream: TokenStream) -> bool:
    """Read ``stream`` to its end; False, with the job cancelled, when the client
    disconnects first (a queued request then never runs)."""

    async def drain() -> None:
        async for _ in stream:
            pass

    async def gone() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(drain()), asyncio.ensure_future(gone())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks[0].done():
            tasks[0].result()  # a generation error is raised here
            return True
        return False
    finally:
        for t in tasks:
            t.cancel()  # leaving the stream early cancels the job
