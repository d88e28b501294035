"""OpenAI-compatible completions and chat completions, streaming and not.

Bad requests get a 4xx with an OpenAI-style error body; the head keeps serving.
``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens not recomputed.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..engine import Sampling
from ..errors import NoChatTemplate
from ..runtime.head import Generation, HeadRuntime

UNSUPPORTED = ("stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
               "logit_bias", "tools", "functions", "response_format", "best_of", "echo", "suffix")  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
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


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(p["text"])
    return "".join(parts)


class OpenAIService:
    """``model_name`` is the canonical name (``/v1/models``); ``aliases`` are also
    accepted in requests (vLLM: ``--served-model-name`` and the ``--model`` argument
    as given). ``max_tokens_default`` caps a request that sets no ``max_tokens``
    (None: the rest of the context window, as OpenAI and vLLM do)."""

    def __init__(
        self,
        runtime: HeadRuntime,
        model_name: str,
        max_context: int,
        aliases: tuple[str, ...] = (),
        max_tokens_default: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.aliases = aliases
        self.max_context = max_context
        self.max_tokens_default = max_tokens_default
        self.created = int(time.time())

    def names(self) -> set[str]:
        return {self.model_name, *self.aliases, self.runtime.card.model_id}

    def _check(self, req: _Common, n_prompt: int) -> Sampling:
        if req.model not in self.names():
            raise APIError(
                404,
                f"The model '{req.model}' does not exist",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        extra = req.model_extra or {}
        for name in UNSUPPORTED:  # they would change the answer: refuse rather than ignore
            if extra.get(name) not in (None, 0, 0.0, False, [], "", "none"):
                raise APIError(400, f"'{name}' is not supported by kvmesh yet", param=name)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:  # the rest of the context window, like OpenAI and vLLM
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
        return Sampling(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed
        )

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
        return [int(t) for t in p]  # type: ignore[arg-type]

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        msgs = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        try:
            return self.runtime.engine.encode_chat(msgs)
        except NoChatTemplate as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template") from None

    def run(self, req: _Common, tokens: list[int], chat: bool) -> Any:
        sampling = self._check(req, len(tokens))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                self._sse(rid, tokens, sampling, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        out = self.runtime.complete(tokens, sampling)
        text = self.runtime.engine.decode_text(out.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [choice],
            "usage": self._usage(out, len(tokens)),
            "kvmesh": {**out.report.as_dict(), "ttft_s": out.ttft_s} if out.report else None,
        }

    @staticmethod
    def _usage(out: Generation, n_prompt: int) -> dict[str, Any]:
        cached = out.report.reused_tokens if out.report else 0
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(out.tokens),
            "total_tokens": n_prompt + len(out.tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _sse(
        self, rid: str, tokens: list[int], sampling: Sampling, chat: bool, include_usage: bool
    ) -> Iterator[str]:
        out = Generation()
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        decode = self.runtime.engine.decode_text

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            return f"data: {json.dumps(body)}\n\n"

        if chat:
            yield chunk(None, None, first=True)
        # incremental detokenisation: each step decodes only the tokens since the last
        # emitted boundary (plus the previous window, for tokenizers whose text
        # depends on the token before), never the whole answer again
        prefix = read = 0

        def delta(final: bool) -> str | None:
            nonlocal prefix, read
            before = decode(out.tokens[prefix:read])
            after = decode(out.tokens[prefix:])
            if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
                return None  # nothing new, or an incomplete UTF-8 sequence: wait for more
            prefix, read = read, len(out.tokens)
            return after[len(before) :]

        for _ in self.runtime.generate(tokens, sampling, out):
            text = delta(final=False)
            if text:
                yield chunk(text, None)
        yield chunk(delta(final=True), out.finish_reason)
        if include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                    "usage": self._usage(out, len(tokens))}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"


def router(service: OpenAIService) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    def models() -> dict[str, Any]:
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

    async def respond(req: _Common, chat: bool) -> Any:
        tokens = await run_in_threadpool(service.tokens, req)  # templating is CPU work
        if req.stream:  # the SSE body is produced on starlette's worker threads
            return service.run(req, tokens, chat)
        return await run_in_threadpool(service.run, req, tokens, chat)

    @r.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return await respond(req, chat=False)

    @r.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> Any:
        return await respond(req, chat=True)

    return r
