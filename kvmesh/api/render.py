"""Finished generations as OpenAI's response bodies: a chat completion's message
(with parsed tool calls) or a completion's text (after its echoed prompt), their
logprobs in each route's shape, usage and the ``kvmesh`` report.

Contracts:

- Responses name the model by its canonical served name, whichever alias the
  request used, as vLLM does.
- ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens not recomputed;
  each prompt counts once, however many choices decode from it.
- Logprobs are finite: one that is not (-inf) is reported as ``LOGPROB_FLOOR``.
  An echoed prompt's first token has a null logprob, as OpenAI's and vLLM's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..engine import Decoded, TokenLogprob
from ..runtime.head import Generation, HeadRuntime
from .requests import ChatRequest, GenerationRequest
from .scheduler import TokenStream
from .tools import ToolCall, ToolParser

LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM report for a token of probability ~0


@dataclass(eq=False)
class Run:
    """One prompt's generation within a request (a request with several prompts has
    one each); ``stream`` is None when nothing is generated (echo, ``max_tokens: 0``)."""

    tokens: list[int]
    out: Generation
    stream: TokenStream | None = None
    echo: str | None = None  # the prompt's text, shown before the answer
    prompt_lp: list[TokenLogprob | None] | None = None  # echo with logprobs


class Renderer:
    """Response bodies of ``runtime``'s generations, served as ``model_name``."""

    def __init__(self, runtime: HeadRuntime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self._token_texts: dict[int, str] = {}

    def served(self, req: GenerationRequest) -> str:
        """The ``model`` an answer to ``req`` names: the LoRA adapter it asked for
        (as vLLM answers), else the canonical name."""
        return req.model if req.model in self.runtime.adapters else self.model_name

    def body(
        self,
        req: GenerationRequest,
        rid: str,
        chat: bool,
        runs: list[Run],
        parser: ToolParser | None = None,
    ) -> dict[str, Any]:
        """The whole answer to ``req``: choice ``i * n + j`` is prompt ``i``'s ``j``-th."""
        choices = []
        top = req.want_logprobs()
        for i, (run, c) in enumerate((r, c) for r in runs for c in r.out.choices):
            # no stop string: the whole answer decoded at once
            text = c.text if c.stopped else self.runtime.engine.decode_text(c.tokens)
            if chat:
                choices.append(self._chat_choice(req, i, c, text, top, parser))
            else:
                choices.append(self._completion_choice(i, run, c, text, top))
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.served(req),  # as the stream's chunks name it (and vLLM)
            "choices": choices,
            "usage": self.usage(runs),
            "kvmesh": self.report(runs),
        }

    def _chat_choice(
        self,
        req: GenerationRequest,
        i: int,
        c: Decoded,
        text: str,
        top: int | None,
        parser: ToolParser | None,
    ) -> dict[str, Any]:
        """A chat choice's message; with a tool parser, its calls split out of the text
        and logprobs for every token (the calls' too)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish, shown = c.finish_reason, c.shown
        if parser is not None:
            raw, _ = self.raw_text(c, req.stops(), final=True)
            content, calls = parser.parse(raw)
            calls = self.allowed(req, calls)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.as_dict() for call in calls]
            finish, shown = self.finish(c, bool(calls), parser), len(c.tokens)
        return {
            "index": i,
            "finish_reason": finish,
            "logprobs": self.logprobs(c, 0, shown, True, top),
            "message": message,
        }

    def _completion_choice(
        self, i: int, run: Run, c: Decoded, text: str, top: int | None
    ) -> dict[str, Any]:
        """A completion's choice: the echoed prompt (if any) then the answer, their
        logprobs one after the other."""
        echo = run.echo or ""
        answer_lp = self.logprobs(c, 0, c.shown, False, top, len(echo))
        return {
            "index": i,
            "finish_reason": c.finish_reason,
            "text": echo + text,
            "logprobs": _joined(self.echoed(run, top), answer_lp),
        }

    def raw_text(self, c: Decoded, stops: tuple[str, ...], final: bool) -> tuple[str, int]:
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
    def finish(c: Decoded, called: bool, parser: ToolParser) -> str:
        """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling
        (not for a named function: ``stop``, as OpenAI's and vLLM's)."""
        if called and parser.finish_as_call and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    @staticmethod
    def allowed(req: GenerationRequest, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls ``req`` accepts: the first only with ``parallel_tool_calls: false``."""
        no_parallel = isinstance(req, ChatRequest) and req.parallel_tool_calls is False
        return calls[:1] if no_parallel else calls

    @staticmethod
    def report(runs: list[Run]) -> Any:
        reports = [
            {**r.out.report.as_dict(), "ttft_s": r.out.ttft_s} if r.out.report else None
            for r in runs
        ]
        return reports[0] if len(reports) == 1 else {"prompts": reports}

    @staticmethod
    def usage(runs: list[Run]) -> dict[str, Any]:
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

    def token_text(self, token: int) -> str:
        """A token's own text, special tokens included (as vLLM reports them)."""
        text = self._token_texts.get(token)
        if text is None:
            text = str(self.runtime.engine.tokenizer.decode([token], skip_special_tokens=False))
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token] = text
        return text

    def echoed(self, run: Run, top: int | None) -> dict[str, Any] | None:
        """The legacy logprobs lists of an echoed prompt (its first token's null, as
        OpenAI's), offsets counted in the tokens' texts; None when not asked."""
        if top is None or run.prompt_lp is None:
            return None
        name = self.token_text
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

    def logprobs(
        self,
        c: Decoded,
        start: int,
        stop: int,
        chat: bool,
        top: int | None,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        """Logprobs of tokens [start, stop) of ``c`` in the route's shape (None when
        not asked): chat's ``content`` list, or the legacy completions lists."""
        if top is None:
            return None
        if chat:
            return self._chat_logprobs(c.logprobs[start:stop])
        return self._legacy_logprobs(c, start, stop, offset)

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        name = self.token_text
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

    def _legacy_logprobs(self, c: Decoded, start: int, stop: int, offset: int) -> dict[str, Any]:
        """Completions' lists: ``top_logprobs`` holds the sampled token too, so up to
        ``logprobs + 1`` entries, as OpenAI's; ``text_offset`` moved on by ``offset``,
        an echoed prompt's length."""
        entries = c.logprobs[start:stop]
        name = self.token_text
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


def _finite(logprob: float) -> float:
    # -inf (probability 0) is not JSON: report OpenAI's and vLLM's floor instead
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects one after the other (an echoed prompt's, the answer's)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}
