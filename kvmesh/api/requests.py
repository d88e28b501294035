"""The bodies of the OpenAI routes (pydantic models) and the checks that need no head.

Contracts:

- Sampling parameters are in OpenAI's ranges, else a 400 (never a 500):
  ``temperature`` finite in [0, 2], ``top_p`` in (0, 1], ``presence_penalty`` /
  ``frequency_penalty`` in [-2, 2], ``n`` in [1, ``MAX_N``], ``seed`` in [0, 2**63),
  ``logprobs``/``top_logprobs`` in [0, 20]. ``null`` is the default, as in
  OpenAI's schema.
- Parameters kvmesh does not implement (``NO_OP``) are accepted only with the value
  that changes nothing (what SDKs send by default); any other value is a 400.
  ``stream_options`` without ``stream: true`` is a 400, as OpenAI's.
- Bounded work: every string is valid Unicode (no lone surrogates); token ids are
  JSON integers (not ``true``, not ``1.0``); at most ``MAX_STOPS`` stop strings of
  at most ``MAX_STOP_CHARS`` characters, ``MAX_STOP_TOTAL_CHARS`` in all (vLLM bounds
  none; OpenAI takes 4).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from .errors import APIError

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
MAX_N = 16  # sequences per request: each holds its own copy of the prompt's KV while decoding
# vLLM takes any number of stop strings (lm-eval sends a task's `until` and the EOS
# text: humaneval's are 5); each is matched on every token, so their count and their
# characters together bound the work a request asks
MAX_STOPS = 256
MAX_STOP_CHARS = 4096  # one stop string
MAX_STOP_TOTAL_CHARS = 1 << 16  # all of a request's stop strings together (their tables)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API


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


class GenerationRequest(Body):
    """What a completion and a chat completion share."""

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
        if sum(map(len, stop)) > MAX_STOP_TOTAL_CHARS:
            raise APIError(
                400,
                f"stop sequences have at most {MAX_STOP_TOTAL_CHARS} characters in all",
                param="stop",
            )
        return tuple(s for s in stop if s)

    def want_logprobs(self) -> int | None:
        """How many alternatives to report per token; None = no logprobs."""
        return None


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    def want_logprobs(self) -> int | None:
        return self.logprobs


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(GenerationRequest):
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


def content_text(
    content: str | list[dict[str, Any]] | None,
    image: Callable[[dict[str, Any]], str] | None = None,
) -> str:
    """A message's content as text: a string, or its parts joined, each ``image_url``
    part as ``image(part)`` says (without ``image``: a 400, as for any other part)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.get("type") == "image_url" and image is not None:
            parts.append(image(p))
        elif p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        else:
            parts.append(p["text"])
    return "".join(parts)


def refuse_unsupported(req: GenerationRequest) -> None:
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
