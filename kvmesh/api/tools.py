"""Tool calling on the chat route: ``tools`` and ``tool_choice`` checked, chat
messages put in the shape chat templates read, and the model's tool calls parsed
out of its text by the parser of its family.

Contracts:

- ``tools`` are checked strictly (OpenAI's rules): a list of
  ``{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}``, names matching ``^[a-zA-Z0-9_-]{1,64}$`` and unique,
  ``parameters`` a JSON schema of an object. A bad one is a :class:`ToolError`
  (the API's 400) naming the parameter.
- Messages reach the chat template in OpenAI's shape, as vLLM passes them: an
  assistant message's ``tool_calls`` (``function.arguments`` parsed from its JSON
  string into the object templates print with ``tojson``; kept as the string when
  it is not JSON) and a tool message's ``tool_call_id`` (and ``name``). So turn
  *n + 1*'s prompt is turn *n*'s plus the new turn, and reuses it.
- Parsers (:data:`PARSERS`, ``kvmesh head --tool-call-parser``): ``hermes``,
  ``llama3_json``, ``mistral``, ``harmony`` (also ``openai``), each class stating
  its family's format. They read the generated text with special tokens kept
  (several families' call markers are special tokens). ``auto`` picks one from
  the chat template where that is unambiguous (:func:`detect_parser`).
- A call's ``arguments`` are the JSON text the model wrote for them (not
  re-serialized), so a stream's argument pieces add up to exactly the whole
  answer's. The content is the text outside calls, stripped; a call the model left
  unfinished (or whose JSON does not parse) makes a whole answer plain content, as
  vLLM does; a stream has already sent what it had.
- Streams (:class:`ToolStream`) re-split the whole text at each step and send what
  is new: content that could still be the start of a call marker is held back, a
  call is announced (``index``, ``id``, ``type``, ``function.name``) once its name
  is complete, then its arguments as string pieces.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..engine.grammar import MAX_DEPTH, json_depth

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # as OpenAI
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad ``tools``, ``tool_choice`` or message: the API answers 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# -- checking the request ---------------------------------------------------------


def check_tools(value: Any) -> list[dict[str, Any]]:
    """``tools`` as the template gets them (OpenAI's shape, unknown keys dropped);
    a :class:`ToolError` for anything OpenAI would refuse."""
    if not isinstance(value, list):
        raise ToolError("'tools' must be a list of function tools", "tools")
    if len(value) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools are supported", "tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}: only tools of type 'function' are supported", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(
                f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$",
                f"{where}.function.name",
            )
        if name in names:
            raise ToolError(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        spec: dict[str, Any] = {"name": name}
        desc = fn.get("description")
        if desc is not None:
            if not isinstance(desc, str):
                raise ToolError(
                    f"{where}.function.description must be a string",
                    f"{where}.function.description",
                )
            spec["description"] = desc
        params = fn.get("parameters")
        if params is not None:
            _check_object_schema(params, f"{where}.function.parameters")
            spec["parameters"] = params
        strict = fn.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise ToolError(
                    f"{where}.function.strict must be a boolean", f"{where}.function.strict"
                )
            spec["strict"] = strict
        out.append({"type": "function", "function": spec})
    return out


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _check_object_schema(schema: Any, param: str) -> None:
    """A JSON schema of an object (``type`` "object" or left out), checked as far as
    its shape goes: every ``type`` a JSON type, ``properties`` an object of
    schemas, ``required`` a list of names. Iterative: a deep schema is no stack
    overflow."""
    if not isinstance(schema, dict):
        raise ToolError(f"{param} must be a JSON schema object", param)
    if json_depth(schema) > MAX_DEPTH:  # the chat template recurses through it
        raise ToolError(f"{param} nests deeper than {MAX_DEPTH} levels", param)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ToolError(f"{param} must describe an object (type 'object')", param)
    todo: list[tuple[Any, str]] = [(schema, param)]
    while todo:
        s, where = todo.pop()
        if isinstance(s, bool):  # true / false are schemas too
            continue
        if not isinstance(s, dict):
            raise ToolError(f"{where} must be a JSON schema (an object)", param)
        t = s.get("type")
        types = t if isinstance(t, list) else [t] if t is not None else []
        if any(not isinstance(x, str) or x not in _SCHEMA_TYPES for x in types):
            raise ToolError(f"{where}.type must be a JSON type or a list of them", param)
        props = s.get("properties")
        if props is not None:
            if not isinstance(props, dict):
                raise ToolError(f"{where}.properties must be an object of schemas", param)
            todo.extend((v, f"{where}.properties.{k}") for k, v in props.items())
        req = s.get("required")
        if req is not None and (
            not isinstance(req, list) or not all(isinstance(r, str) for r in req)
        ):
            raise ToolError(f"{where}.required must be a list of property names", param)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(s.get(key), (dict, bool)):
                todo.append((s[key], f"{where}.{key}"))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            v = s.get(key)
            if v is not None:
                if not isinstance(v, list):
                    raise ToolError(f"{where}.{key} must be a list of schemas", param)
                todo.extend((x, f"{where}.{key}[{i}]") for i, x in enumerate(v))
        for key in ("$defs", "definitions"):
            v = s.get(key)
            if isinstance(v, dict):
                todo.extend((x, f"{where}.{key}.{k}") for k, x in v.items())


def check_tool_choice(value: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """``tool_choice`` as ``"none"``, ``"auto"``, ``"required"`` or the name of the
    function it forces; None is OpenAI's default (``auto`` with tools, else ``none``)."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError(
                "tool_choice must be 'none', 'auto', 'required' or a named function",
                "tool_choice",
            )
        if value == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools", "tool_choice")
        return value if tools else "none"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ToolError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    known = {t["function"]["name"] for t in tools}
    if not isinstance(name, str) or name not in known:
        raise ToolError(f"tool_choice names no tool of this request: {name!r}", "tool_choice")
    return "function:" + name


def template_message(role: str, content: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """One chat message as a template reads it (see the module's contract)."""
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and extra.get("tool_calls") is not None:
        msg["tool_calls"] = _template_calls(extra["tool_calls"])
    if role == "tool":
        cid = extra.get("tool_call_id")
        if cid is not None:
            if not isinstance(cid, str):
                raise ToolError("a tool message's tool_call_id must be a string", "messages")
            msg["tool_call_id"] = cid
    name = extra.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ToolError("a message's name must be a string", "messages")
        msg["name"] = name
    return msg


def _template_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ToolError("an assistant message's tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError("each tool call needs a function with a name and arguments", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # else kept as the model wrote it
                args = json.loads(args)
        elif not isinstance(args, dict):
            raise ToolError("a tool call's arguments must be a JSON string", "messages")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        cid = call.get("id")
        if cid is not None:
            if not isinstance(cid, str):
                raise ToolError("a tool call's id must be a string", "messages")
            entry["id"] = cid
        out.append(entry)
    return out


# -- parsing the model's output ---------------------------------------------------------


@dataclass
class RawCall:
    """A call as far as the text goes: ``name`` once complete, ``args`` the JSON
    text of its arguments so far (all of it once ``done``)."""

    name: str | None = None
    args: str = ""
    done: bool = False
    at: int = 0  # where in the answer the call's text begins


@dataclass
class Split:
    """Text split into what is content and what are calls (see :meth:`ToolParser.split`)."""

    content: str = ""
    calls: list[RawCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(ABC):
    """One family's way of writing tool calls."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # what starts a call (content before is held)
    finish_as_call: ClassVar[bool] = True  # an answer with calls finishes as "tool_calls"
    #: the functions a call may name (None: any); a call to another is broken, as
    #: OpenAI never answers with a tool the request did not offer
    names: frozenset[str] | None = None

    @abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """The content and calls of ``text``. Not ``final``: content that could still
        become part of a call is left out, and ``split`` of a longer text never
        takes back content or a call already seen (streams send it as it comes)."""

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: its content (None when empty) and calls (:meth:`settle`)."""
        content, calls = self.settle(text, final=True)
        return content or None, [ToolCall(self.new_id(), c.name or "", c.args) for c in calls]

    def settle(self, text: str, final: bool) -> tuple[str, list[RawCall]]:
        """The content and the finished, well-formed calls of ``text``: the one truth a
        stream and a whole answer share. The first call that is broken (its arguments
        not JSON, a function not offered, or unfinished when ``final``, as when
        ``max_tokens`` cuts it) and all after it are content, as written; a call still
        being written is held back."""
        split = self.split(text, final)
        calls: list[RawCall] = []
        for raw in split.calls:
            args = _final_args(raw)
            if self.names is not None and raw.name not in self.names:
                args = None  # as broken as arguments that do not parse
            if raw.name is not None and args is not None:
                calls.append(RawCall(raw.name, args, True, raw.at))
            elif raw.done or final:
                before = self.split(text[: raw.at], final=True).content
                return _tidy(before + text[raw.at :]), calls
            else:
                break
        return _tidy(split.content), calls

    def held(self, tail: str, final: bool) -> str:
        """``tail`` less any end of it that may begin a call marker (unless final)."""
        if final:
            return tail
        return tail[: len(tail) - _partial_marker(tail, self.markers)]


def _final_args(raw: RawCall) -> str | None:
    """A finished call's arguments as a JSON string, or None when they do not parse."""
    if not raw.done:
        return None
    text = raw.args.strip() or "{}"
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, str):  # arguments written as a JSON string of JSON
        try:
            json.loads(value)
        except ValueError:
            return None
        return value
    return text


def _tidy(content: str) -> str:
    """Content as shown: no leading whitespace, and trailing whitespace held back
    until more text follows (dropped at the end)."""
    return content.strip()


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


# -- a small JSON scanner for partial text --------------------------------------------------

_WS = " \t\r\n"
_PRIMITIVE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """``s[i]`` is a quote: the index after the string's closing quote, or None."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at ``s[i]``, or None when the text
    ends first (or what is there is no JSON value)."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    m = _PRIMITIVE.match(s, i)
    if m is None or m.end() == len(s):  # a number at the end may go on
        return None
    return m.end()


@dataclass
class _Obj:
    """A JSON object's fields as far as the text goes: name -> (start, end or None)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    first: str | None = None  # the first key, once complete
    end: int | None = None  # after the closing brace


def scan_object(s: str, i: int) -> _Obj | None:
    """The fields of the object starting at ``s[i]`` (``{``); None if it is not one."""
    if i >= len(s) or s[i] != "{":
        return None
    obj = _Obj()
    i = _skip_ws(s, i + 1)
    while i < len(s):
        if s[i] == "}":
            obj.end = i + 1
            return obj
        if s[i] != '"':
            return obj if not obj.fields else None
        kend = _string_end(s, i)
        if kend is None:
            return obj
        try:
            key = json.loads(s[i:kend])
        except ValueError:
            return None
        if obj.first is None:
            obj.first = key
        i = _skip_ws(s, kend)
        if i >= len(s):
            return obj
        if s[i] != ":":
            return None
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return obj
        vend = value_end(s, i)
        obj.fields[key] = (i, vend)
        if vend is None:
            return obj
        i = _skip_ws(s, vend)
        if i < len(s) and s[i] == ",":
            i = _skip_ws(s, i + 1)
    return obj


def _object_call(s: str, i: int, args_keys: tuple[str, ...]) -> tuple[RawCall, int]:
    """A call written as one JSON object ``{"name": ..., <args key>: {...}}`` at
    ``s[i]``; and where it ends (``len(s)`` when it does not yet)."""
    obj = scan_object(s, i)
    call = RawCall(at=i)
    if obj is None:
        return call, len(s)
    name = obj.fields.get("name")
    if name is not None and name[1] is not None:
        try:
            value = json.loads(s[name[0] : name[1]])
        except ValueError:
            value = None
        call.name = value if isinstance(value, str) else None
    args = next((obj.fields[k] for k in args_keys if k in obj.fields), None)
    if args is not None:
        start, end = args
        if end is not None:
            call.args = s[start:end]
        elif s[start] in "{[":  # an open object streams as it grows
            call.args = s[start:]
    call.done = obj.end is not None
    if call.done and args is None:
        call.args = "{}"
    return call, obj.end if obj.end is not None else len(s)


class HermesParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen 2.5/3/3.5,
    Hermes)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START,)

    def split(self, text: str, final: bool) -> Split:
        out, pos = Split(), 0
        content = []
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                content.append(self.held(text[pos:], final))
                break
            content.append(text[pos:i])
            body_at = i + len(self.START)
            j = text.find(self.END, body_at)
            body = text[body_at : j if j >= 0 else len(text)]
            call, _ = _object_call(body, _skip_ws(body, 0), ("arguments", "parameters"))
            call.at = i
            call.done = call.done or j >= 0  # closed: what it holds is all it will
            out.calls.append(call)
            if j < 0:
                break
            pos = j + len(self.END)
        out.content = "".join(content)
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole answer is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``;``), after an optional ``<|python_tag|>``; anything else is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        elif not final and self.TAG.startswith(body):
            return Split()  # nothing yet, or the start of the tag
        if not final and not body:
            return Split()  # the tag alone: a call follows
        if not body.startswith("{"):
            return Split(content=text)
        first = scan_object(body, 0)
        if first is None or (first.first is not None and first.first != "name"):
            return Split(content=text)  # an answer in JSON, not a call
        if first.first is None:  # its first key is not complete yet
            return Split(content=text) if final else Split()
        out, i, off = Split(), 0, len(text) - len(body)
        while i < len(body) and body[i] == "{":
            call, i = _object_call(body, i, ("parameters", "arguments"))
            call.at = off + call.at if out.calls else 0  # a first call broken: all is text
            out.calls.append(call)
            if not call.done:
                return out
            i = _skip_ws(body, i)
            if i < len(body) and body[i] == ";":
                i = _skip_ws(body, i + 1)
        out.content = body[i:]
        return out


class MistralParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 tokenizers)
    and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+, also with ``[CALL_ID]id``)."""

    name = "mistral"
    START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (START,)

    def new_id(self) -> str:  # Mistral's templates insist on nine letters and digits
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def split(self, text: str, final: bool) -> Split:
        i = text.find(self.START)
        if i < 0:
            return Split(content=self.held(text, final))
        out = Split(content=text[:i])
        while i >= 0:
            nxt = text.find(self.START, i + len(self.START))
            seg = text[i + len(self.START) : nxt if nxt >= 0 else len(text)]
            s = seg.lstrip()
            if s.startswith("["):
                self._array(s, out, i, i + len(self.START) + len(seg) - len(s))
            elif s:
                out.calls.append(self._named(s, final))
                out.calls[-1].at = i
            i = nxt
        return out

    def _array(self, s: str, out: Split, marker: int, off: int) -> None:
        """The calls of ``s``, an array at ``off`` in the answer after the marker at
        ``marker`` (where its first call's text begins)."""
        i = _skip_ws(s, 1)
        first = True
        while i < len(s) and s[i] == "{":
            call, i = _object_call(s, i, ("arguments", "parameters"))
            call.at = marker if first else off + call.at
            first = False
            out.calls.append(call)
            if not call.done:
                return
            i = _skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i = _skip_ws(s, i + 1)

    def _named(self, s: str, final: bool) -> RawCall:
        a = s.find(self.ARGS)
        if a < 0:
            return RawCall()
        name = s[:a].split(self.CALL_ID)[0].strip()
        rest = s[a + len(self.ARGS) :]
        start = _skip_ws(rest, 0)
        end = value_end(rest, start)
        if end is not None:
            return RawCall(name or None, rest[start:end], True)
        open_value = rest[start:] if rest[start : start + 1] in ("{", "[") else ""
        return RawCall(name or None, open_value, final and not rest[start:].strip())


class HarmonyParser(ToolParser):
    """gpt-oss's harmony format, from after the generation prompt ``<|start|>assistant``:
    messages ``<|channel|>CHANNEL [to=functions.NAME] [<|constrain|>json]<|message|>BODY``
    ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``, the next one after
    ``<|start|>ROLE``. A message to ``functions.NAME`` is a call; the ``final``
    channel (and ``commentary`` to nobody) is content; ``analysis`` is dropped."""

    name = "harmony"
    MESSAGE, START = "<|message|>", "<|start|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    RECIPIENT = re.compile(r"to=([^\s<]+)")
    CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

    def split(self, text: str, final: bool) -> Split:
        out = Split()
        content: list[str] = []
        pos = 0  # where the next segment's text begins
        for k, seg in enumerate(text.split(self.START)):
            seg_at = pos - len(self.START) if k else 0  # its <|start|>
            pos += len(seg) + len(self.START)
            m = seg.find(self.MESSAGE)
            if m < 0:
                if final and seg.strip() and not out.calls and not content:
                    content.append(seg)  # no harmony at all: plain text
                continue
            header, body = seg[:m], seg[m + len(self.MESSAGE) :]
            ended = [body.find(e) for e in self.ENDS if e in body]
            done = bool(ended) or final
            if ended:
                body = body[: min(ended)]
            elif not final:
                body = body[: len(body) - _partial_marker(body, self.ENDS + (self.START,))]
            to = self.RECIPIENT.search(header)
            channel = self.CHANNEL.search(header)
            if to is not None and to.group(1).startswith("functions."):
                name = to.group(1)[len("functions.") :]
                out.calls.append(RawCall(name or None, body.strip(), done, seg_at))
            elif to is None and (channel is None or channel.group(1) in ("final", "commentary")):
                content.append(body)
        out.content = "".join(content)
        return out


class NamedParser(ToolParser):
    """``tool_choice`` naming a function: the whole answer is that function's
    arguments (constrained to its ``parameters`` schema, :func:`named_schema`).
    Its finish reason stays ``stop``, as OpenAI's and vLLM's."""

    name = "named"
    finish_as_call = False

    def __init__(self, function: str) -> None:
        self.function = function

    def split(self, text: str, final: bool) -> Split:
        start = _skip_ws(text, 0)
        end = value_end(text, start)
        if end is not None:
            return Split(content=text[end:], calls=[RawCall(self.function, text[start:end], True)])
        args = text[start:] if text[start : start + 1] in ("{", "[") else ""
        return Split(calls=[RawCall(self.function, text[start:].strip() if final else args, final)])


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the answer is a JSON array of
    ``{"name": ..., "parameters": {...}}``, at least one (constrained to
    :func:`required_schema`, as vLLM does)."""

    name = "required"

    def split(self, text: str, final: bool) -> Split:
        out, s = Split(), text
        i = _skip_ws(s, 0)
        if i >= len(s) or s[i] != "[":
            return Split(content=text if final else "")
        i = _skip_ws(s, i + 1)
        while i < len(s) and s[i] == "{":
            call, i = _object_call(s, i, ("parameters", "arguments"))
            call.at = call.at if out.calls else 0  # a first call broken: the array is text
            out.calls.append(call)
            if not call.done:
                return out
            i = _skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i = _skip_ws(s, i + 1)
        return out


def named_schema(tools: Sequence[Mapping[str, Any]], function: str) -> dict[str, Any]:
    """The JSON schema of ``function``'s arguments (any object when it has none)."""
    fn = next(t["function"] for t in tools if t["function"]["name"] == function)
    return dict(fn.get("parameters") or {"type": "object", "properties": {}})


def required_schema(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s answer: an array of one or
    more calls (one without ``parallel``), each a tool's name and arguments valid
    against its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters")
                or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, HarmonyParser)
}
PARSERS["openai"] = HarmonyParser  # vLLM's name for gpt-oss's
#: ``kvmesh head --tool-call-parser``: auto (from the template), none, or a family
PARSER_CHOICES = ("auto", "none", *PARSERS)


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format names, where only one
    fits (None: the template writes no tool calls kvmesh knows)."""
    if not template:
        return None
    found = set()
    if "<tool_call>" in template:
        found.add("hermes")
    if "[TOOL_CALLS]" in template:
        found.add("mistral")
    if "to=functions" in template or ("<|channel|>" in template and "<|call|>" in template):
        found.add("harmony")
    if "<|python_tag|>" in template or ("ipython" in template and "<|eot_id|>" in template):
        found.add("llama3_json")
    return found.pop() if len(found) == 1 else None


def make_parser(name: str | None, names: Iterable[str] | None = None) -> ToolParser | None:
    """Family ``name``'s parser (None: no such family), its calls limited to ``names``."""
    if name not in PARSERS:
        return None
    parser = PARSERS[name]()
    parser.names = None if names is None else frozenset(names)
    return parser


class ToolStream:
    """A stream's tool-call deltas: :meth:`update` with the whole text so far returns
    the new content and the new ``tool_calls`` delta entries (OpenAI's shape). A call
    is sent whole, once its arguments are complete JSON (:meth:`ToolParser.settle`), so
    that a stream and the whole answer agree: a call cut by ``max_tokens`` is never
    half-sent, it ends as content in both."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of content sent
        self.ids: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.parser.settle(text, final)
        new = content[self.sent :]
        self.sent = max(self.sent, len(content))
        deltas: list[dict[str, Any]] = []
        for k in range(len(self.ids), len(calls)):
            self.ids.append(self.parser.new_id())
            call = ToolCall(self.ids[k], calls[k].name or "", calls[k].args)
            deltas.append({"index": k, **call.as_dict()})
        return new, deltas
