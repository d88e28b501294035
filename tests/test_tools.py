"""Tool calling: the parsers of each family on literal outputs (whole and streamed),
``tools`` checking, the response shapes on the real app, and a real head on a zoo
model whose template renders tools, driven by the official ``openai`` client: tools
reach the template, a tool-result turn reuses the turn before it, and what is not
served is a 400 naming the parameter.

The zoo's models have random weights: they never write a tool call of their own, so
the parsing of real answers is shown on the literal outputs of each family, through
the app with the zoo tokenizer's own tokens (the whole answer and its stream)."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from kvmesh.api.tools import (
    HarmonyParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
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

from . import zoo
from .test_api import Head

# bounded strings: a random model's free text inside a constrained string ends in time
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "units": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "units"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the repository for a string.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 16}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]


# -- parsers on literal outputs -------------------------------------------------------


def streamed(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``text`` ``step`` characters at a time, then finish; reassemble the deltas
    as a client does (content concatenated, calls by index: id and name once, then
    argument pieces)."""
    s = ToolStream(parser)
    content, calls = "", {}
    cuts = [*range(step, len(text), step), len(text)]
    for i, cut in enumerate(cuts):
        new, deltas = s.update(text[:cut], final=i == len(cuts) - 1)
        content += new
        for d in deltas:
            call = calls.setdefault(d["index"], {"arguments": ""})
            if "id" in d:
                assert "name" not in call, "a call is announced once"
                call.update(id=d["id"], name=d["function"]["name"], type=d["type"])
            else:
                assert "name" in call, "arguments come after the call's name"
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)]


def check_family(parser: ToolParser, text: str, content: str | None, calls: list[tuple]) -> None:
    """The whole answer parses to ``content`` and ``calls`` ([(name, arguments)]),
    arguments valid JSON; a stream in any step size reassembles to the same."""
    got_content, got = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for c in got:
        assert c.id.startswith("call_") or isinstance(parser, MistralParser)
    for step in (1, 3, 7, len(text)):
        s_content, s_calls = streamed(parser, text, step)
        assert s_content == (content or ""), (step, s_content)
        assert [(c["name"], c["arguments"]) for c in s_calls] == [
            (c.name, c.arguments) for c in got
        ], step
        assert all(c["type"] == "function" and c["id"] for c in s_calls)
    check_cuts_agree(parser, text)


def check_cuts_agree(parser: ToolParser, text: str) -> None:
    """Cut anywhere (as ``max_tokens`` cuts an answer), the whole answer and its
    stream say the same: the same content, the same calls, no call half-sent."""
    for cut in range(len(text) + 1):
        content, calls = parser.parse(text[:cut])
        for step in (1, 5):
            s_content, s_calls = streamed(parser, text[:cut], step)
            assert s_content == (content or ""), (cut, step, s_content, content)
            assert [(c["name"], c["arguments"]) for c in s_calls] == [
                (c.name, c.arguments) for c in calls
            ], (cut, step)
        for c in calls:
            json.loads(c.arguments)


HERMES_TWO = (
    "I will look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "units": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" {brace}"}}\n'
    "</tool_call>"
)


def test_hermes_calls_with_content_whole_and_streamed():
    check_family(
        HermesParser(),
        HERMES_TWO,
        "I will look both up.",
        [
            ("get_weather", {"city": "Paris", "units": "c"}),
            ("search", {"query": 'a "quoted" {brace}'}),
        ],
    )
    # no call: all content, the marker's partial start held back only while streaming
    check_family(HermesParser(), "The answer is <tool", "The answer is <tool", [])
    # arguments written as a JSON string of JSON (some Qwen answers)
    text = '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>'
    _, calls = HermesParser().parse(text)
    assert calls[0].arguments == '{"query": "x"}'


def test_hermes_broken_or_unfinished_call_is_content():
    broken = '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>'
    assert HermesParser().parse(broken) == (broken, [])
    cut = 'Sure.<tool_call>\n{"name": "search", "arguments": {"query": "abc'
    assert HermesParser().parse(cut) == (cut, [])
    # a stream never half-sends a call: cut by max_tokens, it is content there too
    for step in (1, 2, len(cut)):
        assert streamed(HermesParser(), cut, step) == (cut, [])
    # the calls before a broken one stay calls; it and all after it are its text
    two = HERMES_TWO[: HERMES_TWO.index('"a \\"quoted')]
    content, calls = HermesParser().parse(two)
    assert [c.name for c in calls] == ["get_weather"]
    assert content == "I will look both up.\n\n" + two[two.rindex("<tool_call>") :].rstrip()
    after = broken + "Then <tool_call>\n" + '{"name": "search", "arguments": {}}</tool_call>'
    assert HermesParser().parse(after) == (after, [])
    check_cuts_agree(HermesParser(), after)


def test_a_call_to_a_function_not_offered_is_text():
    """Only the request's tools are called (a random model invents names); checked the
    same way whole and streamed."""
    parser = make_parser("hermes", ["get_weather", "search"])
    invented = '<tool_call>\n{"name": "gday modelget_city", "arguments": {}}\n</tool_call>'
    assert parser.parse(invented) == (invented, [])
    assert parser.parse(HERMES_TWO)[1][1].name == "search"
    check_cuts_agree(parser, HERMES_TWO.replace('"search"', '"searchx"'))
    assert make_parser("hermes").parse(invented)[1][0].name == "gday modelget_city"


def test_llama3_json_calls():
    check_family(
        Llama3JsonParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
    )
    check_family(
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "search", "parameters": {"query": "fjord"}}',
        None,
        [("get_weather", {"city": "Oslo"}), ("search", {"query": "fjord"})],
    )
    check_family(Llama3JsonParser(), "It is cold in Oslo.", "It is cold in Oslo.", [])
    # an answer in JSON that is not a call stays content
    check_family(Llama3JsonParser(), '{"city": "Oslo"}', '{"city": "Oslo"}', [])


def test_mistral_calls_both_formats():
    check_family(
        MistralParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "search", "arguments": {}}]',
        None,
        [("get_weather", {"city": "Rome"}), ("search", {})],
    )
    check_family(
        MistralParser(),
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]search[ARGS]{"query": "x"}',
        "Checking.",
        [("get_weather", {"city": "Rome"}), ("search", {"query": "x"})],
    )
    _, calls = MistralParser().parse('[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "y"}')
    assert calls[0].name == "search" and json.loads(calls[0].arguments) == {"query": "y"}
    # Mistral's templates accept only nine letters and digits as a call id
    assert len(calls[0].id) == 9 and set(calls[0].id) <= set(string.ascii_letters + string.digits)


def test_harmony_calls_and_final_channel():
    call = (
        "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Lima"}'
    )
    check_family(HarmonyParser(), call, None, [("get_weather", {"city": "Lima"})])
    recipient_first = (
        '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "q"}'
        "<|call|>"
    )
    check_family(HarmonyParser(), recipient_first, None, [("search", {"query": "q"})])
    final = (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny in Lima."
    )
    check_family(HarmonyParser(), final, "It is sunny in Lima.", [])


def test_forced_answers_required_and_named():
    """What constrained decoding makes the model write for ``tool_choice`` required
    (an array of calls) and a named function (its arguments alone)."""
    check_family(
        RequiredParser(),
        '[ {"name": "get_weather", "parameters": {"city": "Rome", "units": "c"}},\n'
        '  {"name": "search", "parameters": {"query": "x"}} ]',
        None,
        [("get_weather", {"city": "Rome", "units": "c"}), ("search", {"query": "x"})],
    )
    check_family(NamedParser("search"), ' {"query": "x y"}', None, [("search", {"query": "x y"})])
    schema = required_schema(check_tools(TOOLS), parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert named_schema(check_tools(TOOLS), "search") == SEARCH["function"]["parameters"]


def test_auto_detection_from_templates():
    assert detect_parser(zoo.QWEN2_5_TOOLS_TEMPLATE) == "hermes"
    assert detect_parser(zoo.CHATML_TEMPLATE) is None
    assert detect_parser(None) is None
    assert detect_parser("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert detect_parser("<|start|>assistant to=functions.{{ name }}<|call|>") == "harmony"
    assert detect_parser("{{- '<|python_tag|>' }}{{- 'ipython' }}<|eot_id|>") == "llama3_json"
    # two formats in one template: not unambiguous
    assert detect_parser("<tool_call> [TOOL_CALLS]") is None


# -- checking tools and messages ------------------------------------------------------------


BAD_TOOLS = [
    ("not a list", "tools"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    (
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        "tools[0].function.parameters",
    ),
    (
        [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}],
        "tools[0].function.parameters",
    ),
    (
        [{"type": "function", "function": {"name": "f", "description": 3}}],
        "tools[0].function.description",
    ),
    (
        [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
        "tools[0].function.strict",
    ),
]


@pytest.mark.parametrize("tools,param", BAD_TOOLS)
def test_bad_tools_name_the_parameter(tools, param):
    with pytest.raises(ToolError) as e:
        check_tools(tools)
    assert e.value.param == param


def test_tool_choice_values():
    tools = check_tools(TOOLS)
    assert check_tool_choice(None, tools) == "auto"
    assert check_tool_choice(None, []) == "none"
    assert check_tool_choice("none", tools) == "none"
    named = {"type": "function", "function": {"name": "search"}}
    assert check_tool_choice(named, tools) == "function:search"
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, 3):
        with pytest.raises(ToolError):
            check_tool_choice(bad, tools)
    with pytest.raises(ToolError):
        check_tool_choice("required", [])


def test_messages_reach_the_template_in_openai_shape():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "x"}'},
    }
    msg = template_message("assistant", "", {"tool_calls": [call]})
    assert msg["tool_calls"][0]["function"]["arguments"] == {"query": "x"}  # as templates print
    assert msg["tool_calls"][0]["id"] == "call_1"
    tool = template_message("tool", "42", {"tool_call_id": "call_1", "name": "search"})
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "search"}
    with pytest.raises(ToolError):
        template_message("assistant", "", {"tool_calls": "x"})


# -- the app's answers with a literal tool call (the zoo tokenizer's tokens) -----------------


@pytest.fixture(scope="module")
def tool_dir():
    return zoo.tools_model()


@pytest.fixture(scope="module")
def tool_app(tool_dir) -> Iterator[TestClient]:
    from kvmesh.api.app import create_app
    from kvmesh.engine import load_engine
    from kvmesh.runtime.head import HeadRuntime

    rt = HeadRuntime(load_engine(str(tool_dir), "torch"), None, publish=False)
    app = create_app(rt, "tools", 4096)
    with TestClient(app) as c:
        c.app_state = app.state  # type: ignore[attr-defined]
        yield c
    rt.close()


class _Scripted:
    """Stands in for a generation's token stream: each step appends the next token
    of a scripted answer to the choice, as the engine thread does."""

    def __init__(self, decoded, tokens: list[int]) -> None:
        self.decoded, self.tokens = decoded, tokens

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for t in self.tokens:
            self.decoded.tokens.append(t)
            yield t
        self.decoded.finish_reason, self.decoded.done = "stop", True


def _scripted_runs(service, answer: str):
    from kvmesh.api.render import Run as _Run
    from kvmesh.engine import Decoded
    from kvmesh.runtime.head import Generation

    eos = min(service.runtime.engine.eos_ids)
    tokens = service.runtime.engine.tokenizer.encode(answer, add_special_tokens=False) + [eos]
    run = _Run([1, 2, 3], Generation(choices=[Decoded()]))
    run.stream = _Scripted(run.out.choices[0], tokens)  # type: ignore[assignment]
    return run


def _chat(**kw):
    from kvmesh.api.requests import ChatRequest

    return ChatRequest(model="tools", messages=[{"role": "user", "content": "hi"}], **kw)


async def _answer(service, answer: str, stream: bool, **kw) -> Any:
    req = _chat(tools=TOOLS, stream=stream, **kw)
    parser = service.tool_plan(req).parser
    run = _scripted_runs(service, answer)
    if stream:
        return [e async for e in service.sse(req, "chatcmpl-x", True, [run], parser)]
    async for _ in run.stream:
        pass
    return service.body(req, "chatcmpl-x", True, [run], parser)


def test_app_answers_tool_calls_whole_and_streamed(tool_app):
    import asyncio

    service = tool_app.app_state.openai
    assert service.tool_parser == "hermes"  # auto: the template writes <tool_call>
    body = asyncio.run(_answer(service, HERMES_TWO, stream=False))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "I will look both up."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "search"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "units": "c",
    }
    events = asyncio.run(_answer(service, HERMES_TWO, stream=True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    content, calls = "", {}
    for ch in chunks:
        delta = ch["choices"][0]["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls") or []:
            c = calls.setdefault(d["index"], {"arguments": ""})
            if "id" in d:
                c.update(id=d["id"], name=d["function"]["name"])
            c["arguments"] += d["function"].get("arguments", "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert content == msg["content"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ]
    # parallel_tool_calls false: the first call only
    one = asyncio.run(_answer(service, HERMES_TWO, stream=False, parallel_tool_calls=False))
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    # an answer without a call is the content, finish_reason as decoded
    plain = asyncio.run(_answer(service, "No tool needed.", stream=False))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "No tool needed."}
    assert plain["choices"][0]["finish_reason"] == "stop"


# -- a real head on the zoo model, with the openai client ------------------------------------


@pytest.fixture(scope="module")
def head(tool_dir):
    h = Head("--no-publish", "--exact-reuse-by-address", "--alias", "tools", model=str(tool_dir))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(head):
    return openai.OpenAI(base_url=head.url + "/v1", api_key="unused")


MODEL = "qwen2-tools-float32-r1"
ASK = [{"role": "user", "content": "What is the weather in Paris today?"}]


def test_tools_auto_and_none_render_the_tools(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0
    )
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    # the template rendered the tools: a longer prompt, the same with auto and none
    assert auto.usage.prompt_tokens == none.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    for r in (auto, none):
        assert r.choices[0].finish_reason in ("stop", "length")
        assert not r.choices[0].message.tool_calls  # random weights call nothing
    streamed = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0, stream=True
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (auto.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == auto.choices[0].finish_reason


SYSTEM = (
    "You are a careful coding agent working in a large repository. "
    + "Read the files you need, run the tests that cover your change, and report what you did. "
    * 40
)


def test_tool_result_turns_reuse_the_turn_before(client):
    """An agent loop: each turn adds the assistant's tool call and the tool's result to
    the conversation; from turn 2 on at least 90% of every prompt is reused."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find where the cache is flushed and check the weather."},
    ]
    for turn in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=3, temperature=0
        )
        n, cached = r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
        assert n > 1000
        if turn:
            assert cached >= 0.9 * n, (turn, cached, n)
        call_id = f"call_{turn:024x}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": json.dumps({"query": f"q{turn}"}),
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"result {turn}: ok"})


def valid(doc: Any, schema: dict[str, Any]) -> None:
    """``doc`` against ``schema`` (the tests' small schemas: by hand; and with
    jsonschema where it is installed)."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(doc, schema)
    assert isinstance(doc, dict) and set(doc) == set(schema["required"])
    for k, v in doc.items():
        prop = schema["properties"][k]
        assert isinstance(v, str) and len(v) <= prop.get("maxLength", 1 << 30)
        assert v in prop.get("enum", [v])


def reassembled(chunks) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed chat answer as the client rebuilds it: content, calls, finish reason."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"arguments": ""})
            if d.id:
                call.update(id=d.id, name=d.function.name)
            call["arguments"] += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


# the grammar lets whitespace in between JSON tokens, which a random model writes plenty of
FORCED = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 800, "temperature": 1.0}


def test_tool_choice_required_returns_calls_valid_against_their_schemas(client):
    """Constrained decoding makes a random model's answer calls that parse and
    validate; streamed, the deltas rebuild the same calls."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in (0, 1, 2):
        # one call: a random model would go on adding calls to the array for ever
        one = {"parallel_tool_calls": False}
        r = client.chat.completions.create(**FORCED, tool_choice="required", seed=seed, **one)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            valid(json.loads(call.function.arguments), schemas[call.function.name])
        assert len(choice.message.tool_calls) == 1
        s = client.chat.completions.create(
            **FORCED, tool_choice="required", seed=seed, stream=True, **one
        )
        content, calls, finish = reassembled(list(s))
        assert not content and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]


@pytest.mark.parametrize("max_tokens", [4, 12])
def test_a_call_cut_by_max_tokens_is_the_same_text_streamed_or_not(client, max_tokens):
    """``tool_choice: required`` cut by ``max_tokens``: no call in either (a client
    would run it with half its arguments), the same text as content, ``length``."""
    ask = {**FORCED, "tool_choice": "required", "seed": 5, "max_tokens": max_tokens}
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content.startswith("[")
    content, calls, finish = reassembled(list(client.chat.completions.create(**ask, stream=True)))
    assert (content, calls, finish) == (choice.message.content, [], "length")


def test_a_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**FORCED, tool_choice=named, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    s = client.chat.completions.create(**FORCED, tool_choice=named, seed=3, stream=True)
    _, calls, finish = reassembled(list(s))
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


def test_response_format_json_schema_and_json_object(client):
    schema = WEATHER["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=800, response_format=fmt, stream=stream, seed=4
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
        valid(json.loads(text), schema)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":  # any object may outgrow max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_structured_output_extras(head):
    """vLLM's ``structured_outputs`` and its older ``guided_*`` spellings, both routes."""
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 2}
    completion = {"model": MODEL, "prompt": "The answer:", "max_tokens": 40, "seed": 2}
    for path, base in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        for extra, check in (
            ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
            ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
            ({"guided_regex": "[a-c]{2,4}"}, lambda t: 2 <= len(t) <= 4 and set(t) <= set("abc")),
            (
                {"structured_outputs": {"json": SEARCH["function"]["parameters"]}},
                lambda t: valid(json.loads(t), SEARCH["function"]["parameters"]) is None,
            ),
        ):
            r = head.http.post(path, json={**base, **extra})
            assert r.status_code == 200, (path, extra, r.text)
            c = r.json()["choices"][0]
            text = c["message"]["content"] if "message" in c else c["text"]
            assert c["finish_reason"] == "stop" and check(text), (path, extra, text)
    for extra, param in (
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": "(", "max_tokens": 2}, "guided_regex"),
        ({"structured_outputs": 3}, "structured_outputs"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    ):
        r = head.http.post("/v1/completions", json={**completion, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "tool_choice": "required"},
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"echo": True}, "echo"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_parameter(client, extra, param):
    kw = {k: v for k, v in extra.items() if k in ("tool_choice", "response_format")}
    body = {k: v for k, v in extra.items() if k not in kw}
    tools = body.pop("tools", TOOLS if "tool_choice" in kw else openai.NOT_GIVEN)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, tools=tools, extra_body=body, **kw
        )
    assert e.value.body["param"] == param, e.value.body
    if param.startswith("function"):  # the 400 says what to send instead
        assert "tool" in e.value.body["message"], e.value.body


def test_tools_on_a_template_without_them_is_a_400():
    h = Head("--no-publish", "--alias", "no-tools")
    try:
        r = h.http.post(
            "/v1/chat/completions",
            json={"model": "demo-tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 2},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        # tool_choice none without tools, and tools: [], change nothing
        for extra in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}):
            ok = h.http.post(
                "/v1/chat/completions",
                json={"model": "demo-tiny", "messages": ASK, "max_tokens": 2, **extra},
            )
            assert ok.status_code == 200, (extra, ok.text)
    finally:
        h.stop()


def test_the_parser_option_auto_none_or_named(tool_app):
    """``--tool-call-parser``: auto reads the template, a name is taken as given,
    none leaves auto without a parser (a 400 naming ``tools``; a forced call still
    works: it needs no parser of the model's own format)."""
    from kvmesh.api.app import create_app

    runtime = tool_app.app_state.runtime
    assert tool_app.app_state.openai.tool_parser == "hermes"
    for name, want in (("mistral", "mistral"), ("openai", "openai"), ("none", None)):
        assert (
            create_app(runtime, "tools", 4096, tool_call_parser=name).state.openai.tool_parser
            == want
        )
    with TestClient(create_app(runtime, "tools", 4096, tool_call_parser="none")) as c:
        body = {"model": "tools", "messages": ASK, "tools": TOOLS, "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_tool_parser", r.text
        assert r.json()["error"]["param"] == "tools"
        none = c.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert none.status_code == 200, none.text
