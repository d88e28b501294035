"""Real client SDKs against a real head, with their defaults (issue #50): the OpenAI
Agents SDK (``agents``: ``Runner`` on ``OpenAIChatCompletionsModel``) and LangChain's
``ChatOpenAI`` (``bind_tools``, ``with_structured_output``).

With ``tool_choice`` ``auto`` (both SDKs' default) the model itself decides to call a
tool, and the zoo's random weights never write a Hermes ``<tool_call>`` of their own. So
the zoo's tools model is first taught, by a few hundred steps of training on the exact
prompts these clients send (captured through a scripted transport), to answer each with
the call (and, once the tool's result is in, with a short final answer); the head then
serves that model with nothing forced, and the SDKs run unchanged. Its parser, not a
grammar, turns the model's text into the ``tool_calls`` the SDKs execute.

The forced paths (``tool_choice`` ``required``, structured output) need no teaching:
constrained decoding makes even random weights answer valid JSON, or finish clearly
when ``max_tokens`` cuts it short.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from . import zoo
from .test_api import Head

CITY = "Paris"
ARGS = json.dumps({"city": CITY})  # as the model writes them
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
WEATHER = "sunny, 21 C"
FINAL = "It is sunny in Paris."
INSTRUCTIONS = "You answer questions about the weather. Use the get_weather tool."
QUESTION = "What is the weather in Paris today?"

Scripted = Callable[[dict[str, Any]], str | None]  # a request body -> the call's arguments or None


# -- the answers a scripted transport gives (and the model is taught to give) -----------------


def completion(body: dict[str, Any], arguments: str | None, text: str) -> dict[str, Any]:
    """A chat completion answering ``body``: a get_weather call with ``arguments``, or ``text``."""
    if arguments is not None:
        call = {"id": "call_0", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": arguments}
        msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        msg, finish = {"role": "assistant", "content": text}, "stop"
    return {
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def wants_call(body: dict[str, Any]) -> bool:
    """The taught behaviour: call the tool unless its result is already in."""
    return body["messages"][-1]["role"] != "tool"


def recorder(bodies: list[dict[str, Any]]) -> httpx.MockTransport:
    """A transport answering as the taught model will, recording every request body."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        args = ARGS if wants_call(body) else None
        return httpx.Response(200, json=completion(body, args, FINAL))

    return httpx.MockTransport(handle)


# -- the clients' flows --------------------------------------------------------------------


def weather_agent(model: Any, calls: list[dict[str, Any]], **settings: Any) -> Any:
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append({"city": city})
        return WEATHER

    return Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(**settings),
    )


def agents_model(base_url: str, model: str, http: httpx.AsyncClient | None = None) -> Any:
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http, max_retries=0)
    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def run_agent(agent: Any, max_turns: int = 4) -> Any:
    from agents import Runner

    return asyncio.run(Runner.run(agent, QUESTION, max_turns=max_turns))


def get_weather(city: str) -> str:
    """The weather in a city now.

    Args:
        city: The city.
    """
    return WEATHER


def langchain_model(base_url: str, model: str, http: httpx.Client | None = None) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=model,
        temperature=0,
        max_retries=0,
        http_client=http,
    )


def langchain_messages() -> list[Any]:
    from langchain_core.messages import HumanMessage, SystemMessage

    return [SystemMessage(INSTRUCTIONS), HumanMessage(QUESTION)]


# -- teaching the zoo model ------------------------------------------------------------------


def captured_bodies(model: str) -> list[dict[str, Any]]:
    """The request bodies both SDKs send in the flows below, answered by a script."""
    bodies: list[dict[str, Any]] = []
    base = "http://scripted.invalid/v1"
    calls: list[dict[str, Any]] = []
    http = httpx.AsyncClient(transport=recorder(bodies))
    result = run_agent(weather_agent(agents_model(base, model, http), calls, temperature=0))
    assert calls == [{"city": CITY}] and result.final_output == FINAL, (calls, result)
    llm = langchain_model(base, model, httpx.Client(transport=recorder(bodies)))
    msg = llm.bind_tools([get_weather]).invoke(langchain_messages())
    assert msg.tool_calls[0]["args"] == {"city": CITY}, msg
    return bodies


def render(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the head renders a chat request with tools."""
    from kvmesh.api.requests import ChatRequest, content_text
    from kvmesh.api.tools import check_tools, template_message

    req = ChatRequest(**body)
    msgs = [
        template_message(m.role, content_text(m.content), m.model_extra or {}) for m in req.messages
    ]
    text = tokenizer.apply_chat_template(
        msgs, tools=check_tools(req.tools), tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def teach(src: Path, dst: Path, examples: list[tuple[list[int], list[int]]]) -> None:
    """Train ``src`` until greedy decoding of every prompt gives its answer with a margin
    (so the head's own kernels give the same), and save it to ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    assert model.config.attention_dropout == 0.0  # a training forward's logits are eval's
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = [
        (torch.tensor([p + a]), torch.tensor([[-100] * len(p) + a]), len(p)) for p, a in examples
    ]
    margin = 0.0
    for _step in range(600):
        opt.zero_grad()
        outs = [model(input_ids=ids, labels=labels) for ids, labels, _ in batch]
        # the margin of the weights this forward ran: saved as they are once it is enough
        margin = min(
            answer_margin(o.logits.detach(), ids, n)
            for o, (ids, _, n) in zip(outs, batch, strict=True)
        )
        if margin > 5.0:
            break
        sum(o.loss for o in outs).backward()
        opt.step()
    assert margin > 5.0, f"the model did not learn its answers (margin {margin:.2f})"
    print(f"\ntaught {len(examples)} answers in {_step + 1} steps (margin {margin:.1f})")
    model.save_pretrained(str(dst))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, dst / f.name)


def answer_margin(logits: Any, ids: Any, n_prompt: int) -> float:
    """Over the answer's tokens: the smallest lead of the right token's logit over the next."""
    logits = logits[0, n_prompt - 1 : -1]
    want = ids[0, n_prompt:]
    right = logits.gather(1, want[:, None])[:, 0]
    other = logits.scatter(1, want[:, None], float("-inf")).max(dim=1).values
    return float((right - other).min())


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    from transformers import AutoTokenizer

    src = zoo.tools_model()
    bodies = captured_bodies("taught")
    tok = AutoTokenizer.from_pretrained(str(src))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for body in bodies:
        answer = CALL if wants_call(body) else FINAL
        examples.append((render(tok, body), tok.encode(answer, add_special_tokens=False) + [end]))
    dst = tmp_path_factory.mktemp("taught")
    teach(src, dst, examples)
    return dst, bodies


@pytest.fixture(scope="module")
def head(taught, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("logs") / "head.err", "w")  # noqa: SIM115
    h = Head("--no-publish", "--served-model-name", "taught", model=str(taught[0]), log=log)
    yield h
    h.stop()
    log.close()
    print("\nhead stderr (tail):\n" + Path(log.name).read_text()[-2000:])


@pytest.fixture(scope="module")
def base_url(head) -> str:
    return head.url + "/v1"


def schema_valid(doc: Any, schema: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(doc, schema)


# -- the OpenAI Agents SDK -------------------------------------------------------------------


def test_head_renders_the_prompts_the_model_was_taught(head, taught):
    """The head's prompt for each captured request is as long as the one trained on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(taught[0]))
    for body in taught[1]:
        r = head.http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(render(tok, body))


def test_agents_sdk_auto_tool_choice_calls_the_tool(base_url):
    from agents import ToolCallItem, ToolCallOutputItem

    calls: list[dict[str, Any]] = []
    # ModelSettings' defaults (tool_choice unset: auto) but greedy, as the model was taught
    agent = weather_agent(agents_model(base_url, "taught"), calls, temperature=0)
    assert agent.model_settings.tool_choice is None
    tool = agent.tools[0]
    result = run_agent(agent)
    assert calls == [{"city": CITY}], calls  # the function ran, once, with the model's arguments
    items = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert len(items) == 1
    args = json.loads(items[0].raw_item.arguments)
    schema_valid(args, tool.params_json_schema)
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert [o.output for o in outputs] == [WEATHER]
    assert result.final_output == FINAL, result.final_output


@pytest.mark.parametrize("max_tokens", [6, 24, 400])
def test_agents_sdk_required_never_runs_a_truncated_call(base_url, max_tokens):
    """``tool_choice`` required with a small ``max_tokens``: the SDK either gets a call
    whose arguments parse against the tool's schema, or an answer it can finish on; it
    never gets a call cut short (the SDK would raise ModelBehaviorError on its JSON)."""
    from agents import ToolCallItem

    calls: list[dict[str, Any]] = []
    bodies: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []

    async def request(req: httpx.Request) -> None:
        bodies.append(json.loads(req.content))

    async def response(r: httpx.Response) -> None:
        await r.aread()
        answers.append(r.json())

    http = httpx.AsyncClient(event_hooks={"request": [request], "response": [response]})
    model = agents_model(base_url, "taught", http)
    agent = weather_agent(
        model, calls, tool_choice="required", max_tokens=max_tokens, temperature=1.0
    )
    tool = agent.tools[0]
    result = run_agent(agent)
    assert bodies[0]["tool_choice"] == "required" and bodies[0]["max_tokens"] == max_tokens
    for a in answers:
        choice = a["choices"][0]
        for c in choice["message"].get("tool_calls") or []:
            schema_valid(json.loads(c["function"]["arguments"]), tool.params_json_schema)
        if choice["finish_reason"] == "length":  # cut short: no call announced
            assert not choice["message"].get("tool_calls"), choice
    items = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert len(calls) == len(items)
    for args in calls:
        schema_valid(args, tool.params_json_schema)
    assert isinstance(result.final_output, str)
    first = answers[0]["choices"][0]
    if max_tokens >= 400:  # room for a whole call: the forced call is made
        assert first["finish_reason"] == "tool_calls" and calls, first
    print(
        f"\nmax_tokens {max_tokens}: first answer {first['finish_reason']}, "
        f"{len(calls)} calls ran, {len(answers)} requests"
    )


# -- LangChain ---------------------------------------------------------------------------------


def test_langchain_bind_tools_auto_calls_the_tool(base_url):
    from langchain_core.utils.function_calling import convert_to_openai_tool

    llm = langchain_model(base_url, "taught")
    msg = llm.bind_tools([get_weather]).invoke(langchain_messages())  # tool_choice: auto
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    assert len(msg.tool_calls) == 1, msg
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"], call
    schema_valid(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    assert call["args"] == {"city": CITY}
    assert get_weather(**call["args"]) == WEATHER
    assert msg.response_metadata["finish_reason"] == "tool_calls"


class Forecast(BaseModel):
    """A forecast."""

    city: str = Field(max_length=12)
    sky: Literal["sunny", "cloudy", "rain"]
    warm: bool


def test_langchain_structured_output_default_method(base_url):
    llm = langchain_model(base_url, "taught").bind(max_tokens=300, seed=1)
    out = llm.with_structured_output(Forecast, include_raw=True).invoke(
        [*langchain_messages()[:1], ("user", "Give the forecast for Paris as JSON.")]
    )
    assert out["parsing_error"] is None, out
    parsed = out["parsed"]
    assert isinstance(parsed, Forecast), out
    Forecast.model_validate_json(out["raw"].content)
