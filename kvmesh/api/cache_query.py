"""``POST /v1/cache/query``: how much of a prompt this head and its fleet hold.

A router or a gateway asks without knowing kvmesh's key scheme. The body names
the model and exactly one of ``prompt`` (text or token ids, as
``/v1/completions``), ``messages`` (as ``/v1/chat/completions``: the chat
template applied) or ``token_ids``; the prompt is tokenized exactly as a
completion's. The answer::

    {"model", "prompt_tokens", "block_size", "cached_tokens", "source", "peer",
     "fallback", "prefix": {"session": n, "local": n, "disk": n, "<peer alias>": n, ...}}

``prefix`` holds the prompt tokens each source holds from the start: ``session``
(this head's live sessions), ``local`` (its RAM tier), ``disk`` (its store with
the disk tier under RAM) and every compatible peer asked (by alias; a peer
holding nothing, or not answering within the lookup deadline, shows 0).
``cached_tokens``, ``source``, ``peer`` and ``fallback`` are what the next
completion of the same prompt would report (``usage.prompt_tokens_details.
cached_tokens``, ``kvmesh.source``, ``kvmesh.peer``, ``kvmesh.fallback``) if
nothing changed in between and its fetch worked: the head's own acquisition
decision, made by the same code (:meth:`~kvmesh.runtime.acquire.Acquirer.plan`:
the fleet asked only where the completion would ask it, within the same
budget); a prefix covering the whole prompt counts in full only with its stored
tail (logits), else less its last token. Nothing is fetched, and nothing is
learned: the local store is read from its index, untouched; a peer failing its
lookup is not backed off. Protected like the OpenAI routes (``--api-key-scope all``). Bad input
is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt

from ..runtime.head import CacheScope, HeadRuntime
from ..store import Peek
from .errors import APIError
from .guard import BodyOffLoop, identity_of
from .openai import OpenAIService
from .requests import Body, ChatRequest, CompletionRequest, Message

PATH = "/v1/cache/query"


class CacheQuery(Body):
    model: str
    prompt: str | list[StrictInt] | list[str] | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    token_ids: list[StrictInt] | None = None
    cache_salt: Any = None  # checked as a completion's: the answer is for that cache


def router(runtime: HeadRuntime, service: OpenAIService) -> APIRouter:
    r = APIRouter(route_class=BodyOffLoop)

    @r.post(PATH)
    async def query(request: Request, req: CacheQuery) -> dict[str, Any]:
        # the caller's own tenant, salt and adapter
        scope = service.scope_of(request, req.cache_salt, req.model)
        client = identity_of(request).share
        if req.model not in service.names():
            raise APIError(
                404,
                f"The model '{req.model}' does not exist",
                param="model",
                code="model_not_found",
            )
        given = [f for f in ("prompt", "messages", "token_ids") if getattr(req, f) is not None]
        if len(given) != 1:
            raise APIError(
                400,
                "give exactly one of prompt, messages or token_ids",
                param=given[1] if len(given) > 1 else "prompt",
            )
        tokens = await asyncio.to_thread(_tokens, service, req, scope.root)
        if not tokens:
            raise APIError(400, "the prompt is empty", param=given[0])
        if len(tokens) > service.max_context:
            raise APIError(
                400,
                f"the prompt has {len(tokens)} tokens, more than this model's "
                f"context of {service.max_context}",
                param=given[0],
                code="context_length_exceeded",
            )
        answer = await asyncio.to_thread(cached_prefix, runtime, tokens, scope, client)
        return {"model": service.model_name, **answer}

    return r


def _tokens(service: OpenAIService, req: CacheQuery, root: bytes | None) -> list[int]:
    """The prompt's token ids through the completion's own code (its checks too; its
    pictures under chain ``root``, as the request's)."""
    if req.messages is not None:
        chat = ChatRequest(model=req.model, messages=req.messages)
        return service.chat_tokens(chat, root=root)
    if req.token_ids is not None:
        prompt: Any = req.token_ids
        try:
            return service.completion_tokens(CompletionRequest(model=req.model, prompt=prompt))
        except APIError as e:
            raise APIError(400, e.message, param="token_ids") from None
    assert req.prompt is not None
    return service.completion_tokens(CompletionRequest(model=req.model, prompt=req.prompt))


def cached_prefix(
    runtime: HeadRuntime, tokens: list[int], scope: CacheScope | None = None, client: str = ""
) -> dict[str, Any]:
    """Per source, the prompt tokens held from the start in ``scope``'s cache, with
    ``client``'s own sessions and tails (as its completion would see them; default:
    the shared cache); and the head's acquisition plan (:meth:`Acquirer.plan`):
    its source, the tokens it would not recompute, and why it would fall back."""
    n = len(tokens)
    scope = scope or CacheScope()
    caller = scope.exact(client)  # once: an anonymous caller's is new each time
    keyer = runtime.keyer_for(scope.root, caller)
    keys = keyer.keys(tokens)
    session = runtime.sessions.prefix(tokens, keyer.root, caller)
    acquirer = runtime.acquirer
    plan = acquirer.plan(runtime.engine.layout, keys, session=session)
    # the peers' answers: the plan's own lookup, or (held here: none was sought)
    # one made after the decision, for the report only
    offered = plan.offered if plan.sought else acquirer.offers(runtime.card, keys)
    fleet = acquirer.fleet
    peek = fleet.peek(keys) if fleet is not None else Peek(0, 0, False)
    prefix = {"session": session, "local": peek.ram_tokens, "disk": peek.tokens}
    if fleet is not None:
        prefix |= {card.alias: 0 for card in fleet.compatible_peers(runtime.card)}
    for hit in offered:
        prefix[hit.alias] = max(prefix.get(hit.alias, 0), hit.tokens)
    return {
        "prompt_tokens": n,
        "block_size": runtime.card.block_tokens,
        "cached_tokens": _not_recomputed(plan.tokens, plan.whole, n),
        "source": plan.source,
        "peer": plan.hit.alias if plan.hit is not None else None,
        "fallback": plan.fallback,
        "prefix": prefix,
    }


def _not_recomputed(held: int, whole: bool, n: int) -> int:
    """Prompt tokens not recomputed from a prefix of ``held`` tokens: all with the
    stored tail's logits, else at least the last one is computed."""
    return n if whole and held == n else min(held, n - 1)
