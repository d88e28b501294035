"""Running generations to the client: server-sent events for a stream, and the wait
for a whole answer that gives up when the client leaves.

Contracts:

- A stream sends a chunk as soon as a token is decoded, its text empty while that
  text is held back (an unfinished UTF-8 character, a possible start of a stop
  string), as vLLM does: a client's first chunk marks the first token.
- A stream that fails after its headers are sent ends with an OpenAI-style
  ``data: {"error": {...}}`` event and then ``data: [DONE]``, never a cut stream.
- A client that disconnects cancels its generations, queued or running, streamed
  or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from ..engine import Decoded
from ..engine.grammar import ConstraintFailed
from ..runtime.batch import EngineFailed
from .errors import APIError, printable
from .render import Renderer, Run
from .requests import ChatRequest, GenerationRequest
from .scheduler import TokenStream
from .tools import ToolParser, ToolStream

log = logging.getLogger("kvmesh.api")


async def sse(
    render: Renderer,
    req: GenerationRequest,
    rid: str,
    chat: bool,
    runs: list[Run],
    parser: ToolParser | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of a started generation, always ending with ``[DONE]``:
    a failure after the headers are sent (they carried 200) becomes an error
    event first. Starlette stops iterating when the client leaves, which
    cancels the streams (a BaseException: nothing more is sent then)."""
    try:
        async for event in _Events(render, req, rid, chat, runs, parser):
            yield event
    except Exception as e:
        yield _event(_stream_error(rid, e))
    yield "data: [DONE]\n\n"


class _Events:
    """Each choice's text as the engine detokenizes it (text that could start a
    stop string is held back until it cannot) with the logprobs of the tokens
    that text accounts for, a chunk whenever a token was decoded (its text
    possibly empty); then the finish reasons, and usage if asked (with the
    answer's ``kvmesh`` report, as a whole answer carries it). With a tool
    parser, content and ``tool_calls`` deltas as :class:`.tools.ToolStream`
    finds them. An echoed prompt is each choice's first chunk."""

    def __init__(
        self,
        render: Renderer,
        req: GenerationRequest,
        rid: str,
        chat: bool,
        runs: list[Run],
        parser: ToolParser | None,
    ) -> None:
        self.render, self.req, self.rid, self.chat, self.runs = render, req, rid, chat, runs
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.top = req.want_logprobs()
        self.stops = req.stops()
        self.no_parallel = isinstance(req, ChatRequest) and req.parallel_tool_calls is False
        self.pairs = [(r, c) for r in runs for c in r.out.choices]
        self.views = [ToolStream(parser) if parser is not None else None for _ in self.pairs]
        self.sent_text = [0] * len(self.pairs)
        self.sent_tokens = [0] * len(self.pairs)
        self.decoded = [0] * len(self.pairs)  # tokens a chunk has been sent for, text or not
        opts = req.stream_options or {}
        self.usage = bool(opts.get("include_usage"))
        # vLLM's: usage so far on every chunk too
        self.continuous = self.usage and bool(opts.get("continuous_usage_stats"))

    async def __aiter__(self) -> AsyncIterator[str]:
        for i, (run, _) in enumerate(self.pairs):
            if self.chat:
                yield self._chunk(i, "", None, None, first=True)
            elif run.echo is not None:
                yield self._chunk(i, run.echo, self.render.echoed(run, self.top), None)
        async for _ in merged([r.stream for r in self.runs if r.stream is not None]):
            for event in self._news(final=False):
                yield event
        for event in self._news(final=True):
            yield event
        if self.usage:  # what kvmesh did rides with it, as on a whole answer
            yield self._frame(
                [], usage=self.render.usage(self.runs), kvmesh=self.render.report(self.runs)
            )

    def _news(self, final: bool) -> Iterator[str]:
        """A chunk for each choice that has news since the last (every choice when
        ``final``)."""
        for i, (run, c) in enumerate(self.pairs):
            view = self.views[i]
            if view is not None:
                yield from self._tool_news(i, c, view, final)
                continue
            n = len(c.tokens)  # before the text: a token counted here has been sampled
            shown, text = c.shown, c.text  # shown first: text only grows after it
            lp = self.render.logprobs(
                c, self.sent_tokens[i], shown, self.chat, self.top, len(run.echo or "")
            )
            new = text[self.sent_text[i] :]
            # a new token is a chunk even when its text is held back (an unfinished
            # character, a possible stop string), as vLLM sends it: the client's
            # first chunk is the first token, not the first printable text
            if new or (lp and shown > self.sent_tokens[i]) or n > self.decoded[i] or final:
                yield self._chunk(i, new, lp, c.finish_reason if final else None)
            self.sent_text[i], self.sent_tokens[i], self.decoded[i] = len(text), shown, n

    def _tool_news(self, i: int, c: Decoded, view: ToolStream, final: bool) -> Iterator[str]:
        raw, n = self.render.raw_text(c, self.stops, final)
        content, calls = view.update(raw, final)
        if self.no_parallel:
            calls = [d for d in calls if d["index"] == 0]
        lp = self.render.logprobs(c, self.sent_tokens[i], n, self.chat, self.top)
        if content or calls or n > self.decoded[i] or final:
            finish = self.render.finish(c, view.called, view.parser) if final else None
            yield self._chunk(i, content, lp, finish, calls=calls)
        self.sent_tokens[i] = self.decoded[i] = n

    def _chunk(
        self,
        i: int,
        text: str,
        logprobs: Any,
        finish: str | None,
        first: bool = False,
        calls: list[dict[str, Any]] | None = None,
    ) -> str:
        """Choice ``i``'s chunk in the route's shape: chat's ``delta``, or a completion's
        ``text``."""
        if not self.chat:
            choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
            return self._frame([choice])
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": i, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return self._frame([choice])

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        if self.continuous and choices:
            extra.setdefault("usage", self.render.usage(self.runs))
        return _event(
            {
                "id": self.rid,
                "object": self.object,
                "created": self.created,
                "model": self.render.served(self.req),
                "choices": choices,
                **extra,
            }
        )


_END = object()


async def merged(streams: list[TokenStream]) -> AsyncIterator[None]:
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


async def finish_unless_gone(request: Request, streams: list[TokenStream]) -> bool:
    """Read ``streams`` to their end; False, with the jobs cancelled, when the client
    disconnects first (a queued request then never runs)."""

    async def drain() -> None:
        async for _ in merged(streams):
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


def _event(body: dict[str, Any]) -> str:
    # allow_nan=False: NaN is not JSON; a value that slipped through fails here, loudly
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def _stream_error(rid: str, e: Exception) -> dict[str, Any]:
    """The error event of a stream that failed after it began (OpenAI's shape, as
    vLLM sends it). An APIError says what it is; anything else is the engine's
    failure, logged here and named only generically to the client."""
    if isinstance(e, APIError):
        err = {"message": printable(e.message), "type": e.type, "param": e.param, "code": e.code}
    elif isinstance(e, ConstraintFailed):  # the request's own grammar, not the server
        err = {
            "message": printable(str(e)),
            "type": "invalid_request_error",
            "param": None,
            "code": "grammar_failed",
        }
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
