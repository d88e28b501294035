"""vLLM's tokenizer routes on the head: ``POST /tokenize``, ``POST /detokenize`` and
``POST /v1/chat/completions/render``.

vLLM's router (``vllm-router``, policies ``cache_aware`` and ``kv_aware``) asks
every worker for a chat request's prompt ids before routing it: render first, and
``/tokenize`` when render is a 404. The answers are vLLM 0.32's shapes:

- ``/tokenize``: the body is ``{"model"?, "prompt": str, "add_special_tokens"?:
  true}`` (tokenized as a completion's prompt) or ``{"model"?, "messages": [...],
  "tools"?, "add_generation_prompt"?: true, ...}`` (rendered as the chat route
  renders it); the answer is ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs`` only with ``return_token_strs``, else null).
- ``/detokenize``: ``{"model"?, "tokens": [ids]}`` gives ``{"prompt": text}``
  (special tokens kept, as vLLM's).
- ``/v1/chat/completions/render``: the body is a chat completion request; the
  answer is vLLM's ``GenerateRequest`` (``request_id``, ``token_ids``,
  ``features``, ``sampling_params``, ``model``, ``stream``, ``cache_salt``, ...).

Contracts:

- A chat's ids are exactly the ones the chat route prefills for the same body
  (:meth:`~kvmesh.api.openai.OpenAIService.chat_tokens`: the same template, tools,
  roles and tool-call turns), so their count is that request's
  ``usage.prompt_tokens``. Render checks the body as the chat route does before
  it generates (its pydantic model, the model name, ``cache_salt``, tools and
  ``tool_choice``, sampling ranges, parameters kvmesh refuses, ``n``, the
  context): a request the chat route refuses, render refuses with the same 4xx.
  ``/tokenize`` renders ``tools`` whatever ``tool_choice`` (the ids do not depend
  on it); what the chat route cannot render (``add_generation_prompt: false``,
  ``continue_final_message``, a request's own ``chat_template``,
  ``add_special_tokens: true`` with messages) is a 400 naming it, never ids the
  chat route would not prefill.
- Bad input is a 400 in the head's error body (:mod:`.errors`); an unknown model
  a 404 ``model_not_found`` (as the chat route's and vLLM's). ``model`` may be
  left out, as vLLM allows here. The guard has already checked keys and the body
  size; under ``--api-key-scope all`` these routes need a key, as the OpenAI
  routes do.
- Templating, tokenizing and decoding run on a worker thread, never on the event
  loop. Nothing here touches the engine's compute, the request queue or the KV
  cache: only the model's tokenizer.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt
from starlette.concurrency import run_in_threadpool

from ..blocks import MEDIA_IDS
from .errors import APIError
from .guard import BodyOffLoop
from .openai import OpenAIService
from .requests import Body, ChatRequest, Message

TOKENIZE, DETOKENIZE, RENDER = "/tokenize", "/detokenize", "/v1/chat/completions/render"
PATHS = frozenset({TOKENIZE, DETOKENIZE, RENDER})


class TokenizeRequest(Body):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``: exactly one
    of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: Any = None  # checked as the chat route's (.tools): a 400 naming the field
    tool_choice: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt]


def router(service: OpenAIService) -> APIRouter:
    r = APIRouter(route_class=BodyOffLoop)

    @r.post(TOKENIZE)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(service, req.model)
        tokens, strs = await run_in_threadpool(tokenized, service, req)
        return {
            "count": len(tokens),
            "max_model_len": service.max_context,
            "tokens": tokens,
            "token_strs": strs,
        }

    @r.post(DETOKENIZE)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(service, req.model)
        text = await run_in_threadpool(decoded, service, req.tokens)
        return {"prompt": text}

    @r.post(RENDER)
    async def render(request: Request, req: ChatRequest) -> dict[str, Any]:
        check_model(service, req.model)
        scope = service.scope(request, req)  # a bad cache_salt: the chat route's 400
        # under the chat's own root: the chat that follows takes these ids (prompt_memo)
        tokens = await run_in_threadpool(service.chat_tokens, req, None, scope.root)
        sampling = service.sampling_for(req, len(tokens))  # the chat route's own checks
        return {
            "request_id": "chatcmpl-" + secrets.token_hex(16),
            "token_ids": MEDIA_IDS.model_ids(tokens),
            "token_offsets": None,
            "features": None,  # text only: no multimodal items
            "sampling_params": {
                "n": sampling.n,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "seed": sampling.seed,
                "max_tokens": sampling.max_tokens,
                "stop": list(sampling.stop),
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty,
                "ignore_eos": not sampling.stop_on_eos,
                "logprobs": sampling.logprobs,
            },
            "model": req.model,
            "stream": req.stream,
            "stream_options": req.stream_options if req.stream else None,
            "cache_salt": req.cache_salt,
            "priority": 0,
        }

    return r


def check_model(service: OpenAIService, model: str | None) -> None:
    """A 404 for a model this head does not serve (None: the served one, as vLLM)."""
    if model is not None and model not in service.names():
        raise APIError(
            404, f"The model '{model}' does not exist", param="model", code="model_not_found"
        )


def tokenized(service: OpenAIService, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """The body's ids (a prompt as a completion's, messages as the chat route's) and,
    if asked, each id's token string. CPU work: call off the event loop."""
    given = [f for f in ("prompt", "messages") if getattr(req, f) is not None]
    if len(given) != 1:
        raise APIError(
            400,
            "give exactly one of prompt or messages",
            param=given[1] if given else "prompt",
        )
    tok = service.tokenizer
    if req.prompt is not None:
        if req.add_special_tokens is False:
            tokens = list(tok.encode(req.prompt, add_special_tokens=False))
        else:
            tokens = service.encode(req.prompt)  # the completion's own ids
    else:
        tokens = service.chat_tokens(_chat_request(service, req))
    tokens = [int(t) for t in MEDIA_IDS.model_ids(tokens)]  # an image: its placeholder ids
    strs = [str(s) for s in tok.convert_ids_to_tokens(tokens)] if req.return_token_strs else None
    return tokens, strs


def _chat_request(service: OpenAIService, req: TokenizeRequest) -> ChatRequest:
    """The chat request whose prompt ``req`` asks for: a 400 naming what the chat
    route would not render the same way."""
    for name, value, served in (
        ("add_generation_prompt", req.add_generation_prompt, True),
        ("continue_final_message", req.continue_final_message, False),
        ("add_special_tokens", bool(req.add_special_tokens), False),
        ("chat_template", req.chat_template is not None, False),
    ):
        if value != served:
            raise APIError(
                400,
                f"'{name}' is not supported with messages: kvmesh tokenizes a chat as its "
                "chat route renders it (the model's own template, with the generation prompt)",
                param=name,
                code="unsupported_parameter",
            )
    assert req.messages is not None
    extra: dict[str, Any] = {}
    if req.chat_template_kwargs is not None:  # as the chat route gets it
        extra["chat_template_kwargs"] = req.chat_template_kwargs
    # the ids are the same whatever the choice: auto (the default) needs no parser here
    choice = "none" if req.tools and req.tool_choice in (None, "auto") else req.tool_choice
    return ChatRequest(
        model=req.model or service.model_name,
        messages=req.messages,
        tools=req.tools,
        tool_choice=choice,
        **extra,
    )


def decoded(service: OpenAIService, tokens: list[int]) -> str:
    """The text of ``tokens``, special tokens kept (vLLM's ``/detokenize``); a 400 for
    an id outside the vocabulary. CPU work: call off the event loop."""
    vocab = service.runtime.card.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise APIError(400, f"token ids must be integers in [0, {vocab})", param="tokens")
    return str(service.tokenizer.decode(tokens, skip_special_tokens=False))
